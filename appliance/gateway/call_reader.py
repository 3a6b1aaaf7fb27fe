"""The tool call an answer makes, read once in the pipeline for every front end.

A request that offers tools (its ToolChat has a plan) gets a CallReader; every other request gets
none and its replies pass untouched. The reader sees this client's replies (generated or replayed
from the cache alike) and gives back:

- the Final with `tool_call` set (its id from the request id) when the whole answer is one call of
  a listed tool (tool_calls.parse_call);
- the deltas either as they came (`hold=False`: the text streams as generated, and the Final also
  carries the call: the gRPC API's shape), or with their text held back while the answer may still
  be a call (`hold=True`: a call is sent only as the call: OpenAI's shape). Held text that turns
  out not to be a call arrives in one more Delta just before the Final; token ids and
  log-probabilities are never held.

Deltas are shared by every client following a generation, so a held one is a new Delta.
"""

from __future__ import annotations

from appliance.gateway.generation import Delta
from appliance.gateway.reply import Final, Reply
from appliance.gateway.tool_calls import HeldText, ToolCall, ToolChat, call_id, parse_call


class CallReader:
    def __init__(self, chat: ToolChat, request_id: str, hold: bool) -> None:
        assert chat.plan is not None
        self.plan = chat.plan
        self.request_id = request_id
        self._held = HeldText(chat.plan) if hold else None
        self._text: list[str] = []

    @classmethod
    def of(cls, chat: ToolChat | None, request_id: str, hold: bool) -> CallReader | None:
        """None when the request offers no tools (nothing is kept)."""
        if chat is None or chat.plan is None:
            return None
        return cls(chat, request_id, hold)

    def read(self, reply: Reply) -> tuple[Reply, ...]:
        """The replies to send for one of the pipeline's."""
        if isinstance(reply, Delta):
            return (self.delta(reply),)
        return self.final(reply)

    def delta(self, d: Delta) -> Delta:
        if self._held is None:
            self._text.append(d.text)
            return d
        text = self._held.feed(d.text)
        return d if text == d.text else Delta(text, d.token_ids, d.logprobs, d.prompt_tokens)

    def final(self, f: Final) -> tuple[Reply, ...]:
        """The Final with the call the whole answer makes, after the held text that is no call."""
        if self._held is None:
            rest, call = "", parse_call("".join(self._text), self.plan)
        else:
            rest, call = self._held.finish()
        if call is not None:
            f.tool_call = ToolCall(call.name, call.arguments, call_id(self.request_id))
        return (Delta(rest, []), f) if rest else (f,)
