"""Property: whatever a client sends, the two edges where its bytes become the one validated request
(the OpenAI JSON body, the gRPC GenerateRequest) and the pipeline's checks after them either pass
it or refuse it with the project's own refusal: an HTTP 4xx or a gRPC status other than INTERNAL
and UNKNOWN, naming the field at fault. Never a TypeError, KeyError, OverflowError, RecursionError
or UnicodeError, which a front end would answer with a 500 or UNKNOWN."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from appliance.backends.base import Speculation
from appliance.gateway import json_body, messages
from appliance.gateway.errors import RequestError
from appliance.gateway.openai_wire import HttpError, error_of, parse_request
from appliance.gateway.request import (
    IncomingRequest,
    Limits,
    check,
    check_guide,
    check_inputs,
    check_speculation,
    check_top_logprobs,
    tokenize,
)
from appliance.gateway.server import RunningGateway
from appliance.text.tokenizer import ModelText
from appliance.v1 import inference_pb2 as pb
from tests.conftest import Engine, Tiny
from tests.gateway.test_http_api import _config, _gateway

LIMITS = Limits(
    max_input_tokens=4096,
    max_output_tokens=64,
    default_max_tokens=16,
    context_length=8192,
    max_input_chars=40_000,
)
PROPERTY = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def text(tiny: Tiny) -> ModelText:
    return ModelText.load(tiny.tokenizer_dir)


# -- values ------------------------------------------------------------------------------------

ODD_TEXT = (
    "",
    "\ud800",
    "a\udfffb",
    "\x00",
    "\x1b[2K\r\n",
    "🙂",
    "\U0010ffff",
    "e\u0301",
    "tiny",
    "user",
    "assistant",
    "tool",
    "auto",
    "none",
    "required",
    "x" * 300,
)
# Text a well-formed field holds (any Unicode text), and any text JSON can hold (unpaired
# surrogates too).
PLAIN_TEXT = tuple(t for t in ODD_TEXT if t.isascii() or t.encode(errors="ignore").decode() == t)
WORDS = st.one_of(
    st.text(st.characters(codec="utf-8"), max_size=12),
    st.lists(st.sampled_from(PLAIN_TEXT), max_size=4).map("".join),
)
TEXT = st.one_of(
    st.text(max_size=12),
    st.sampled_from(ODD_TEXT),
    st.lists(st.sampled_from(ODD_TEXT), max_size=4).map("".join),
)
SMALL = st.integers(1, 70)
UNIT = st.floats(0, 1)
LONG_TEXT = st.sampled_from(("x" * 70_000, "é" * 50_000, "\ud800" * 1000, "<s>" * 20_000))
INTS = st.one_of(
    st.integers(0, 70),
    st.integers(-(2**70), 2**70),
    st.sampled_from(
        (0, 1, -1, 64, 65, 2**31 - 1, 2**31, -(2**31), 2**32, 2**63, 2**64, 2**64 + 1, 10**400)
    ),
)
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from((0.0, -0.0, 0.5, 1.0, 1e-3, 1e308, 5e-324, 3.5e38, math.nan, math.inf)),
)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)


def _deep(depth: int, kind: str) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


DEEP = st.builds(_deep, st.sampled_from((30, 300, 700)), st.sampled_from(("list", "dict")))
JSON = (
    st.recursive(
        SCALARS,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)
        ),
        max_leaves=12,
    )
    | DEEP
)


def either(*valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's value of one of its well-formed shapes (`mutated` makes the rest)."""
    return st.one_of(*valid)


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            found += _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += _paths(v, (*path, i))
    return found


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    """A well-formed body with up to three places replaced by any JSON value, removed, or given
    an unknown key: most bodies get past the first check, and every check sees bad values."""
    body = copy.deepcopy(draw(base))  # strategies such as just() hand out shared values
    for _ in range(draw(st.integers(0, 3))):
        paths = [p for p in _paths(body) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(("replace", "replace", "remove", "unknown")))
        if action == "replace":
            parent[path[-1]] = draw(JSON)
        elif action == "remove":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(TEXT)] = draw(JSON)
    return body


SCHEMAS = st.one_of(
    st.sampled_from(
        (
            {"type": "object"},
            {"type": "object", "properties": {"city": {"type": "string"}}},
            {"type": "nope"},
            {"$schema": "http://example.com/x"},
            {"$ref": "#/nowhere"},
            {"type": "string", "pattern": "("},
            {"enum": []},
            {"minimum": 10**400},
            {"type": "object", "properties": {"\ud800": {}}},
        )
    ),
    st.just({"type": "object", "properties": {"a": {"type": "integer"}}}),
)
NAMES = st.sampled_from(("f", "get_weather"))
FUNCTION = st.fixed_dictionaries(
    {"name": NAMES},
    optional={"description": WORDS, "parameters": SCHEMAS, "strict": st.booleans()},
)
TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": FUNCTION})
TOOL_CHOICE = st.one_of(
    st.sampled_from(("none", "auto", "required", "f", "get_weather")),
    st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": NAMES})}
    ),
)
PAST_CALL = st.fixed_dictionaries(
    {
        "id": WORDS,
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": NAMES, "arguments": st.one_of(WORDS, st.just('{"a": 1}'))}
        ),
    },
)
PART = st.fixed_dictionaries({"type": st.just("text"), "text": WORDS})
CONTENT = st.one_of(WORDS, WORDS, st.lists(PART, max_size=3), LONG_TEXT)
MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(("system", "user", "developer")), "content": CONTENT},
        optional={"name": WORDS},
    ),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": CONTENT},
        optional={"tool_calls": st.lists(PAST_CALL, max_size=3)},
    ),
    st.fixed_dictionaries({"role": st.just("tool"), "content": CONTENT, "tool_call_id": WORDS}),
)
USER = st.fixed_dictionaries({"role": st.just("user"), "content": CONTENT})
RESPONSE_FORMAT = st.fixed_dictionaries(
    {},
    optional={
        "type": either(st.sampled_from(("text", "json_object", "json_schema", "xml"))),
        "json_schema": either(
            st.fixed_dictionaries(
                {},
                optional={
                    "name": either(WORDS),
                    "schema": SCHEMAS,
                    "strict": either(st.booleans()),
                    "description": either(WORDS),
                },
            )
        ),
    },
)
APPLIANCE = st.fixed_dictionaries(
    {},
    optional={
        "request_id": either(WORDS),
        "namespace": either(WORDS),
        "cache_policy": either(st.sampled_from(("default", "bypass", "only", "BYPASS", "x"))),
        "semantic_cache": either(st.booleans()),
        "top_k": SMALL,
        "ttft_budget_ms": SMALL,
        "deadline_ms": SMALL,
        "speculation": either(st.booleans()),
        "guide": either(
            st.fixed_dictionaries(
                {},
                optional={
                    "type": either(
                        st.sampled_from(("json", "json_schema", "regex", "ebnf_grammar"))
                    ),
                    "guide": either(
                        WORDS, st.sampled_from(("(", "a{99999}", '{"type": "object"}'))
                    ),
                },
            )
        ),
    },
)
COMMON: dict[str, st.SearchStrategy[Any]] = {
    "model": either(st.just("tiny"), st.just("tiny"), WORDS),
    "stream": either(st.booleans()),
    "stream_options": either(
        st.fixed_dictionaries(
            {},
            optional={
                "include_usage": either(st.booleans()),
                "continuous_usage_stats": either(st.booleans()),
                "include_obfuscation": st.booleans(),
            },
        )
    ),
    "max_tokens": SMALL,
    "temperature": UNIT,
    "top_p": UNIT,
    "seed": SMALL,
    "stop": either(WORDS, st.lists(WORDS, max_size=20)),
    "response_format": either(RESPONSE_FORMAT),
    "min_tokens": SMALL,
    "ignore_eos": either(st.booleans()),
    "appliance": either(APPLIANCE),
    "user": either(WORDS),
    "metadata": st.dictionaries(WORDS, WORDS, max_size=2),
    "n": st.just(1),
    "logit_bias": st.sampled_from((None, {})),
    "presence_penalty": st.sampled_from((0, 0.0, None)),
    "echo": st.sampled_from((False, None)),
    "best_of": st.sampled_from((1, None)),
    "suffix": st.none(),
}
OPTIONAL = {k: v for k, v in COMMON.items() if k != "model"}
CHAT = mutated(
    st.fixed_dictionaries(
        {
            "model": COMMON["model"],
            "messages": st.tuples(st.lists(MESSAGE, max_size=3), USER).map(lambda t: [*t[0], t[1]]),
        },
        optional={
            **OPTIONAL,
            "max_completion_tokens": SMALL,
            "tools": either(st.lists(TOOL, max_size=3)),
            "tool_choice": TOOL_CHOICE,
            "parallel_tool_calls": st.booleans(),
            "logprobs": either(st.booleans()),
            "top_logprobs": SMALL,
        },
    )
)
COMPLETION = mutated(
    st.fixed_dictionaries(
        {
            "model": COMMON["model"],
            "prompt": either(WORDS, st.lists(WORDS, max_size=1), LONG_TEXT),
        },
        optional={
            **OPTIONAL,
            "logprobs": SMALL,
        },
    )
)


# -- the property ------------------------------------------------------------------------------

UNSERVED = {"ignore_eos": "takes no ignore_eos"}


def checks(req: IncomingRequest, text: ModelText) -> None:
    """Pipeline.check's checks (request.check and the model's), then the tokenize stage."""
    checked = check(req, LIMITS)
    check_speculation(checked, "tiny", Speculation())
    check_top_logprobs(checked, "tiny", 5)
    check_guide(checked, "tiny", True)
    check_inputs(checked, "tiny", UNSERVED)
    tokenize(checked, text, LIMITS)


def refused_properly(run: Callable[[], object]) -> None:
    """`run` passes, or raises the project's refusal: a client-error status naming a field."""
    try:
        run()
        event("passed")
    except HttpError as exc:
        event(f"refused {ascii(exc.param).split('[')[0][:30]}")
        assert 400 <= exc.status < 500, (exc.status, exc.message)
        assert exc.param is not None, exc.message
    except RequestError as exc:
        event(f"refused {ascii(exc.field).split('[')[0][:30]}")
        assert exc.code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), exc.message
        assert exc.field is not None, exc.message


def http_edge(data: Any, chat: bool, text: ModelText) -> None:
    """The HTTP API's path: the body's bytes decoded, parsed, checked (as http_api does)."""
    try:
        body = json.dumps(data).encode()
    except (RecursionError, ValueError):
        return
    try:
        decoded = json_body.decode(body)
    except json_body.BodyError:
        return
    http = parse_request(decoded, chat)
    try:
        checks(http.request, text)
    except RequestError as exc:
        raise error_of(exc, chat, http.guide_field, http.max_tokens_field) from None


@PROPERTY
@given(body=CHAT)
def test_chat_bodies_are_passed_or_refused_by_field(body: dict[str, Any], text: ModelText) -> None:
    refused_properly(lambda: http_edge(body, True, text))


@PROPERTY
@given(body=COMPLETION)
def test_completion_bodies_are_passed_or_refused_by_field(
    body: dict[str, Any], text: ModelText
) -> None:
    refused_properly(lambda: http_edge(body, False, text))


# -- what the properties found, each as its smallest example ----------------------------------


def test_echo_false_is_the_no_op_value_it_is_said_to_be() -> None:
    # The refusal's own message lists false as accepted; false is not 0 here.
    http = parse_request({"model": "tiny", "prompt": "hi", "echo": False}, chat=False)
    assert http.request.prompt == "hi"
    with pytest.raises(HttpError, match="echo is not supported"):
        parse_request({"model": "tiny", "prompt": "hi", "echo": True}, chat=False)
    with pytest.raises(HttpError, match="n is not supported"):
        parse_request({"model": "tiny", "prompt": "hi", "n": True}, chat=False)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "a\ud800"}]},
            "messages[0].content",
        ),
        ({"model": "t\udfff", "messages": [{"role": "user", "content": "a"}]}, "model"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "stop": ["\ud800"]},
            "stop",
        ),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "a"}],
                "tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}],
            },
            "tools[0]",
        ),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "a"}],
                "appliance": {"guide": {"type": "regex", "guide": "\ud800"}},
            },
            "appliance.guide",
        ),
    ],
)
def test_an_unpaired_surrogate_is_refused_naming_its_field(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(HttpError, match="unpaired surrogate") as refused:
        parse_request(body, chat=True)
    assert refused.value.param == param


# -- the gRPC edge -----------------------------------------------------------------------------

# Text a protobuf string holds: any Unicode text without unpaired surrogates, NUL and controls too.
PB_TEXT = st.one_of(WORDS, st.sampled_from(("\x00", "a\x00b", "\x7f\x1b", "tiny", "x" * 300)))
INT32 = st.one_of(SMALL, st.integers(-(2**31), 2**31 - 1))
UINT32 = st.one_of(SMALL, st.integers(0, 2**32 - 1))
UINT64 = st.one_of(SMALL, st.integers(0, 2**64 - 1))
ENUM = st.one_of(st.integers(0, 4), st.integers(-(2**31), 2**31 - 1))
LONG_PB = ("x" * 70_000, "é" * 50_000, "<s>" * 20_000)
PB_SCHEMA = st.one_of(
    st.sampled_from(("", "{", "[]", "null", '{"type": 1}', '{"type": "object"}', "9" * 5000)),
    SCHEMAS.map(json.dumps),
    DEEP.map(json.dumps),
)


def mostly(valid: st.SearchStrategy[Any], wild: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, valid, valid, wild)


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    m = pb.GenerateRequest()
    m.model = draw(st.sampled_from(("tiny", "tiny", "", "other", "\x00")))
    for name, values in (
        ("request_id", mostly(st.just("r-1"), PB_TEXT)),
        ("namespace", mostly(st.just("ns"), PB_TEXT)),
        ("max_tokens", mostly(SMALL, INT32)),
        ("temperature", mostly(st.sampled_from((0.0, 0.7)), FLOATS)),
        ("top_p", mostly(st.just(0.9), FLOATS)),
        ("top_k", mostly(SMALL, INT32)),
        ("seed", UINT64),
        ("cache_policy", mostly(st.integers(0, 3), ENUM)),
        ("ttft_budget_ms", mostly(SMALL, UINT32)),
        ("semantic_cache", st.booleans()),
        ("min_tokens", mostly(st.just(1), INT32)),
        ("ignore_eos", st.booleans()),
        ("logprobs", st.booleans()),
        ("top_logprobs", mostly(st.integers(0, 5), INT32)),
        ("speculation", st.booleans()),
    ):
        if draw(st.integers(0, 3)) == 0:
            value = draw(values)
            if isinstance(value, float):
                value = (
                    float(value) if abs(value) < 3.4e38 or not math.isfinite(value) else math.inf
                )
            setattr(m, name, value)
    m.stop.extend(draw(mostly(st.lists(st.just("."), max_size=2), st.lists(PB_TEXT, max_size=20))))
    which = draw(st.sampled_from(("prompt", "prompt", "messages", "messages", "none")))
    if which == "prompt":
        m.prompt = draw(mostly(st.just("Hello"), st.one_of(PB_TEXT, st.sampled_from(LONG_PB))))
    elif which == "messages":
        m.messages.SetInParent()
        for _ in range(draw(st.sampled_from((0, 1, 1, 2, 3, 2049)))):
            message = m.messages.messages.add(
                role=draw(
                    mostly(
                        st.just("user"),
                        st.sampled_from(("system", "assistant", "tool", "robot", "")),
                    )
                ),
                content=draw(PB_TEXT),
                tool_call_id=draw(st.sampled_from(("call_1", "call_1", ""))),
            )
            for _ in range(draw(st.sampled_from((0, 0, 0, 0, 1, 3)))):
                message.tool_calls.add(
                    name=draw(st.sampled_from(("f", "", "g"))),
                    arguments=draw(st.one_of(PB_TEXT, PB_SCHEMA)),
                    id=draw(PB_TEXT),
                )
    if draw(st.integers(0, 3)) == 0:
        m.guide.type = draw(mostly(st.integers(0, 4), ENUM))
        m.guide.guide = draw(st.one_of(PB_TEXT, PB_SCHEMA, st.sampled_from(("(", "a{99999}"))))
    if draw(st.integers(0, 3)) == 0:
        m.tools.SetInParent()
        for _ in range(draw(st.sampled_from((0, 1, 2, 129)))):
            m.tools.tools.add(
                name=draw(st.sampled_from(("f", "g", "", "bad name", "a" * 65))),
                description=draw(PB_TEXT),
                parameters=draw(PB_SCHEMA),
            )
        m.tools.choice = draw(mostly(st.integers(0, 2), ENUM))
        m.tools.function_name = draw(st.sampled_from(("", "f", "g", "h")))
    return m


def grpc_edge(m: pb.GenerateRequest, text: ModelText) -> None:
    """The gRPC API's path: the message as the server parses it from its bytes, translated,
    checked."""
    parsed = pb.GenerateRequest.FromString(m.SerializeToString())
    checks(messages.request_of(parsed), text)


@PROPERTY
@given(m=generate_requests())
def test_generate_requests_are_passed_or_refused_by_field(
    m: pb.GenerateRequest, text: ModelText
) -> None:
    refused_properly(lambda: grpc_edge(m, text))


# -- end to end --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def gateway(tiny: Tiny, engine: Engine) -> AsyncIterator[RunningGateway]:
    running = await _gateway(_config(tiny, engine.address))
    yield running
    await running.drain(0.5)


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    body=st.one_of(
        CHAT.map(lambda b: ("chat/completions", b)), COMPLETION.map(lambda b: ("completions", b))
    )
)
async def test_bodies_over_http_are_answered_or_refused_never_a_500(
    gateway: RunningGateway, body: tuple[str, dict[str, Any]]
) -> None:
    path, data = body
    try:
        raw = json.dumps(data).encode()
    except (RecursionError, ValueError):
        return
    assert gateway.http is not None
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://127.0.0.1:{gateway.http.port}/v1/{path}", data=raw) as r,
    ):
        answer = await r.read()
    event(str(r.status))
    if r.status == 504:
        # A deadline the client set (1-70 ms here) may pass on a busy machine: the right answer.
        assert _client_deadline(data) is not None, answer[:300]
        assert json.loads(answer)["error"]["type"] == "timeout_error", answer[:300]
        return
    assert r.status == 200 or 400 <= r.status < 500, answer[:300]


def _client_deadline(data: dict[str, Any]) -> object:
    extension = data.get("appliance")
    return extension.get("deadline_ms") if isinstance(extension, dict) else None
