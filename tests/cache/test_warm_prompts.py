"""`appliance cache warm`: prompt lines as an editor counts them, a byte order mark ignored; a
key over its rate limit waits for the pushback."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from appliance.tools.warm import Tally, read_prompts, warm_one
from appliance.v1 import inference_pb2 as pb


def test_lines_are_split_at_newlines_only(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a\u2028b"}\r\nplain\x0cpage\n', newline="")
    assert [r.prompt for r in read_prompts(prompts, "m", None)] == ["a\u2028b", "plain\x0cpage"]


def test_a_byte_order_mark_is_not_part_of_the_first_line(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 3}\n')
    [request] = read_prompts(prompts, "m", None)
    assert (request.prompt, request.max_tokens) == ("hi", 3)


class Refusal(grpc.RpcError):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "over the key's rate"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("grpc-retry-pushback-ms", "100"),)


class RateLimitedStub:
    """A gateway whose key is over its rate once for each kind of call, then answers."""

    def __init__(self, cached: bool) -> None:
        self.cached = cached
        self.calls: list[int] = []

    def Complete(self, request: pb.GenerateRequest, **kw: object) -> pb.GenerateResponse:
        self.calls.append(request.cache_policy)
        if self.calls.count(request.cache_policy) == 1:
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED)
        if request.cache_policy == pb.CACHE_POLICY_ONLY and not self.cached:
            raise Refusal(grpc.StatusCode.NOT_FOUND)
        return pb.GenerateResponse()


@pytest.mark.parametrize("cached", [True, False])
def test_a_rate_limited_cache_probe_is_sent_again_after_the_pushback(cached: bool) -> None:
    stub, tally = RateLimitedStub(cached), Tally(1)
    waits: list[float] = []
    request = pb.GenerateRequest(model="m", prompt="hi")
    why = warm_one(stub, request, 500, 10.0, tally, sleep=waits.append)
    assert why == ""
    assert (tally.cached, tally.warmed) == ((1, 0) if cached else (0, 1))
    assert waits == [0.1] * (1 if cached else 2)


class TooLarge(Refusal):
    def details(self) -> str:
        return "Received message larger than max (5242880 vs. 4194304)"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


class TooLargeStub:
    def __init__(self) -> None:
        self.calls = 0

    def Complete(self, request: pb.GenerateRequest, **kw: object) -> pb.GenerateResponse:
        self.calls += 1
        if self.calls > 3:
            raise AssertionError("asked again and again")
        raise TooLarge(grpc.StatusCode.RESOURCE_EXHAUSTED)


def test_resource_exhausted_without_a_pushback_is_a_failure_not_a_wait() -> None:
    # gRPC's own refusal of a message over the server's limit: asking again never helps.
    stub, tally = TooLargeStub(), Tally(1)
    why = warm_one(stub, pb.GenerateRequest(model="m", prompt="x"), 500, 10.0, tally, sleep=print)
    assert why.startswith("RESOURCE_EXHAUSTED: Received message larger than max")
    assert stub.calls == 1
