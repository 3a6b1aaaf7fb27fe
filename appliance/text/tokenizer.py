"""A model's text side, loaded once at start-up: tokenizer, chat template, limits, end token.

The gateway tokenizes and detokenizes itself so the inference server only ever sees token ids; this is
everything it needs from the model directory for that.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from appliance.text.detokenize import TokenTable, build_token_table
from appliance.text.segments import SegmentCache

CHAT_ROLES = ("system", "user", "assistant")
# Texts up to this many characters are tokenized on the gateway's event loop, longer ones on a
# worker thread (the tokenizer releases the GIL while it runs).
INLINE_CHARS = 8192


def tokenize_on_calling_thread() -> None:
    """Turns the tokenizers' thread pool off for this process. The gateway encodes one text per
    call, so the pool parallelises nothing: it hands the text to a worker whose wake-up lands in
    the request's TTFT tail when the cores are busy. The library reads the variable at each call."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


class TokenizerLoadError(ValueError):
    """The tokenizer directory is missing something the gateway needs; the message says what."""


# Characters of a template's own error a refusal repeats.
MAX_REASON = 200


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with the model's template (e.g. roles out of order)."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def _reads_tools(env: jinja2.Environment, source: str) -> bool:
    """Whether a template reads the `tools` variable (not just the word in its text)."""
    return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the model's chat template refuses these messages: {message}")


def chat_environment() -> jinja2.Environment:
    """Where chat templates compile: sandboxed, with Hugging Face's whitespace settings and its
    `raise_exception`."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env


def render_chat(
    template: jinja2.Template,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    bos: str,
    eos: str,
) -> str:
    """The text the model reads for these messages, as Hugging Face's apply_chat_template renders
    it with a generation prompt."""
    return template.render(
        messages=messages, tools=tools, add_generation_prompt=True, bos_token=bos, eos_token=eos
    )


@dataclass(frozen=True)
class ModelText:
    tokenizer: Tokenizer
    table: TokenTable
    chat_template: jinja2.Template | None
    bos_token: str
    eos_token: str
    end_id: int | None
    pad_id: int | None
    context_length: int | None
    # Digest of the chat template source: a changed template must not reuse cached answers.
    template_version: str
    # The chat template renders `tools` (Hugging Face templates with tool support take them as
    # `tools=[...]`); a chat with tools is otherwise rendered without them (the gateway's fallback).
    takes_tools: bool = False
    # The ids of chat pieces tokenized before (segments.py); None where cutting a chat into pieces
    # could change its ids: its chats are encoded whole.
    segments: SegmentCache | None = None

    @classmethod
    def load(cls, directory: Path) -> ModelText:
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise TokenizerLoadError(
                f"{path} not found: tokenizer_dir must hold a Hugging Face tokenizer.json"
            )
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:
            raise TokenizerLoadError(f"{path}: cannot load tokenizer: {exc}") from exc
        tok_config = _read_json(directory / "tokenizer_config.json")
        model_config = _read_json(directory / "config.json")
        template_source = tok_config.get("chat_template")
        if isinstance(template_source, list):  # named templates: use the default one
            named = {t.get("name"): t.get("template") for t in template_source}
            template_source = named.get("default")
        template = None
        takes_tools = False
        if isinstance(template_source, str):
            env = chat_environment()
            try:
                template = env.from_string(template_source)
                takes_tools = _reads_tools(env, template_source)
            except jinja2.TemplateError as exc:
                raise TokenizerLoadError(
                    f"{directory}: chat_template does not compile: {exc}"
                ) from exc
        bos = _token_text(tok_config.get("bos_token")) or ""
        eos = _token_text(tok_config.get("eos_token")) or ""
        end_id: Any = tokenizer.token_to_id(eos) if eos else None
        if end_id is None:
            eos_ids = model_config.get("eos_token_id")
            end_id = eos_ids[0] if isinstance(eos_ids, list) and eos_ids else eos_ids
        pad = _token_text(tok_config.get("pad_token"))
        pad_id = tokenizer.token_to_id(pad) if pad else None
        context = model_config.get("max_position_embeddings")
        segments = None
        if template is not None:
            chat = template
            segments = SegmentCache.of(tokenizer, lambda m: render_chat(chat, m, None, bos, eos))
        return cls(
            tokenizer=tokenizer,
            table=build_token_table(tokenizer),
            chat_template=template,
            bos_token=bos,
            eos_token=eos,
            end_id=end_id if isinstance(end_id, int) else None,
            pad_id=pad_id if pad_id is not None else (end_id if isinstance(end_id, int) else None),
            context_length=context if isinstance(context, int) else None,
            template_version=hashlib.blake2b(
                str(template_source or "").encode(), digest_size=8
            ).hexdigest(),
            takes_tools=takes_tools,
            segments=segments,
        )

    def encode_prompt(self, prompt: str) -> list[int]:
        """Raw prompts get the model's special tokens (BOS) like the tokenizer adds them."""
        return self._encode(prompt, add_special_tokens=True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The text's token ids. `encode_batch_fast` computes no offsets (nothing here reads
        them) and releases the GIL; with the tokenizers' parallelism off
        (`tokenize_on_calling_thread`) a batch of one runs on the calling thread."""
        ids: list[int] = self.tokenizer.encode_batch_fast(
            [text], add_special_tokens=add_special_tokens
        )[0].ids
        return ids

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        namespace: str = "",
    ) -> list[int]:
        """Chat templates write BOS themselves, so the rendered text is encoded without extras.
        `tools` (OpenAI's function tools) are passed to the template as Hugging Face's
        apply_chat_template passes them; only for a template that `takes_tools`. The pieces of
        the chat this namespace sent before come from the segment cache."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template: send a prompt, not messages")
        try:
            text = render_chat(self.chat_template, messages, tools, self.bos_token, self.eos_token)
        except ChatTemplateError:
            raise
        except (
            jinja2.TemplateError,
            ArithmeticError,
            AttributeError,
            LookupError,
            RecursionError,
            TypeError,
            ValueError,
        ) as exc:
            # The template's filters and operators run on values the client chose (contents, a
            # past tool call's arguments): whatever they raise is these messages' refusal.
            raise ChatTemplateError(
                f"the model's chat template failed on these messages: {str(exc)[:MAX_REASON]}"
            ) from exc
        if self.segments is not None and self.segments.takes(text):
            return self.segments.by_pieces(text, namespace)
        return self._encode(text, add_special_tokens=False)
