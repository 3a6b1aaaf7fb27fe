"""The HTTP API's wire format without servers: bodies to IncomingRequest, answers to OpenAI's shapes."""

from __future__ import annotations

import json

import grpc
import pytest

from appliance.cache.policy import CachePolicy
from appliance.gateway import openai_wire as wire
from appliance.gateway.errors import RequestError
from appliance.gateway.generation import Delta
from appliance.gateway.reply import Final
from appliance.gateway.request import IncomingRequest


def test_every_field_reaches_the_request() -> None:
    http = wire.parse_request(
        {
            "model": "tiny",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
                },
            ],
            "max_completion_tokens": 9,
            "temperature": 0,
            "top_p": 0.5,
            "seed": 2**64 - 1,
            "stop": "END",
            "n": 1,
            "user": "someone",
            "stream": True,
            "stream_options": {"include_usage": True},
            "appliance": {
                "request_id": "r",
                "namespace": "ns",
                "cache_policy": "REFRESH",
                "top_k": 4,
                "ttft_budget_ms": 250,
                "deadline_ms": 1500,
            },
        },
        chat=True,
    )
    assert http.request == IncomingRequest(
        model="tiny",
        messages=[("system", "Be brief."), ("user", "Hi there")],
        max_tokens=9,
        temperature=0,
        top_p=0.5,
        seed=2**64 - 1,
        stop=["END"],
        request_id="r",
        namespace="ns",
        cache_policy=CachePolicy.REFRESH.value,
        top_k=4,
        ttft_budget_ms=250,
    )
    assert (http.stream, http.include_usage, http.deadline_s) == (True, True, 1.5)


def test_unset_fields_stay_unset_for_the_check_stage() -> None:
    http = wire.parse_request({"model": "tiny", "prompt": ["one"], "stop": None}, chat=False)
    r = http.request
    assert r.prompt == "one"
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "ttft_budget_ms"):
        assert getattr(r, name) is None
    assert (http.stream, http.include_usage, http.deadline_s) == (False, False, None)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "tiny", "prompt": ["a", "b"]},
        {"model": "tiny", "prompt": [1, 2, 3]},
        {"model": "tiny", "prompt": "x", "messages": []},
        {"model": "tiny", "prompt": "x", "appliance": {"cache_policy": "sometimes"}},
        {"model": "tiny", "prompt": "x", "appliance": []},
        {"model": "tiny", "prompt": "x", "appliance": {"deadline_ms": 0}},
    ],
)
def test_refused_completion_bodies(body: dict[str, object]) -> None:
    with pytest.raises(wire.HttpError) as err:
        wire.parse_request(body, chat=False)
    assert err.value.status == 400 and err.value.param


def _final(**kw: object) -> Final:
    fields: dict[str, object] = dict(
        request_id="abc",
        finish_reason="length",
        prompt_tokens=3,
        completion_tokens=2,
        queue_us=1,
        ttft_us=2,
        total_us=3,
        tier="l2",
        model="small",
        degraded=True,
        similarity=None,
        cache_entry="",
    )
    return Final(**{**fields, **kw})  # type: ignore[arg-type]


def _events(data: bytes) -> list[object]:
    parts = data.decode().split("\n\n")
    assert parts[-1] == ""
    assert all(p.startswith("data: ") for p in parts[:-1])
    return [p[6:] if p == "data: [DONE]" else json.loads(p[6:]) for p in parts[:-1]]


@pytest.mark.parametrize("chat", [True, False])
def test_stream_chunks_are_the_openai_shapes(chat: bool) -> None:
    body = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "q"}]} if chat else {"prompt": "q"})
    answer = wire.Answer(wire.parse_request(body, chat), "abc", 1700000000)
    data = (
        answer.first_chunk(_final())
        + answer.chunk('a "quoted"\n\u00e9')
        + answer.last_chunks(_final())
    )
    events = _events(data)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    kind = "chat.completion.chunk" if chat else "text_completion"
    for c in chunks:
        assert (c["id"], c["object"], c["created"], c["model"]) == (
            ("chatcmpl-abc" if chat else "cmpl-abc"),
            kind,
            1700000000,
            "tiny",
        )
    key = "delta" if chat else "text"
    texts = [c["choices"][0][key] for c in chunks if c["choices"]]
    if chat:
        assert texts[0] == {"role": "assistant", "content": ""}
        assert texts[1] == {"content": 'a "quoted"\n\u00e9'}
    else:
        assert texts[0] == 'a "quoted"\n\u00e9'
    last, usage = chunks[-2], chunks[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["appliance"] == {
        "request_id": "abc",
        "cache_tier": "l2",
        "model": "small",
        "degraded": True,
        "timings": {"queue_us": 1, "ttft_us": 2, "total_us": 3},
    }
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert all("usage" not in c for c in chunks[:-1])


@pytest.mark.parametrize("cached", [0, 64])
@pytest.mark.parametrize("chat", [True, False])
def test_usage_says_the_cached_prompt_tokens_always(chat: bool, cached: int) -> None:
    """As OpenAI sends it: `prompt_tokens_details.cached_tokens` in every usage, 0 included."""
    body: dict[str, object] = {"model": "tiny"}
    body.update({"messages": [{"role": "user", "content": "q"}]} if chat else {"prompt": "q"})
    final = _final(prompt_tokens=100, cached_tokens=cached)
    whole = wire.Answer(wire.parse_request(body, chat), "abc", 1).whole("t", final)
    assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    answer = wire.Answer(wire.parse_request(streamed, chat), "abc", 1)
    usage = [e for e in _events(answer.last_chunks(final)) if isinstance(e, dict)][-1]
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
    assert usage["usage"]["total_tokens"] == 102


def _delta(text: str, tokens: int, prompt_tokens: int = 7) -> Delta:
    return Delta(text, list(range(tokens)), None, prompt_tokens)


@pytest.mark.parametrize("chat", [True, False])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(chat: bool) -> None:
    body: dict[str, object] = {
        "model": "tiny",
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    body.update({"messages": [{"role": "user", "content": "q"}]} if chat else {"prompt": "q"})
    http = wire.parse_request(body, chat)
    assert (http.include_usage, http.continuous_usage) == (True, True)
    answer = wire.Answer(http, "abc", 1)
    first = _delta("a", 1)
    data = answer.first_chunk(first)
    for delta in (first, _delta("", 2), _delta("b", 1)):
        answer.count(delta)
        if delta.text:
            data += answer.chunk(delta.text)
    data += answer.last_chunks(_final(prompt_tokens=7, completion_tokens=5, cached_tokens=3))
    chunks = [e for e in _events(data) if isinstance(e, dict)]
    running = [
        (c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"], c["usage"]["total_tokens"])
        for c in chunks
    ]
    # The role chunk (chat), each text chunk with the tokens counted so far (a delta without text
    # sends no chunk but counts), the finish chunk with the answer's counts, the usage chunk.
    expected = [(7, 0, 7)] if chat else []
    assert running == [*expected, (7, 1, 8), (7, 4, 11), (7, 5, 12), (7, 5, 12)]
    assert all(
        set(c["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
        for c in chunks[:-1]
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 3
    }


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"continuous_usage_stats": True}, (True, True)),  # vLLM: include_usage defaults to true
        ({"include_usage": False, "continuous_usage_stats": True}, (False, False)),
        ({"include_usage": True, "continuous_usage_stats": False}, (True, False)),
        ({"include_usage": True}, (True, False)),
        ({}, (False, False)),
    ],
)
def test_continuous_usage_stats_as_vllm_takes_them(
    options: dict[str, bool], expected: tuple[bool, bool]
) -> None:
    body = {"model": "tiny", "prompt": "q", "stream": True, "stream_options": options}
    http = wire.parse_request(body, chat=False)
    assert (http.include_usage, http.continuous_usage) == expected


def test_continuous_usage_stats_must_be_a_bool_and_streamed() -> None:
    for body in (
        {
            "model": "tiny",
            "prompt": "q",
            "stream": True,
            "stream_options": {"continuous_usage_stats": "yes"},
        },
        {"model": "tiny", "prompt": "q", "stream_options": {"continuous_usage_stats": True}},
    ):
        with pytest.raises(wire.HttpError) as err:
            wire.parse_request(body, chat=False)
        assert err.value.status == 400 and "stream_options" in (err.value.param or "")


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.FAILED_PRECONDITION, 400),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    ],
)
def test_statuses(code: grpc.StatusCode, status: int) -> None:
    err = wire.error_of(RequestError(code, "why"))
    assert err.status == status
    assert wire.error_body(err)["error"]["message"] == "why"


@pytest.mark.parametrize("code", [c for c in grpc.StatusCode if c != grpc.StatusCode.OK])
def test_no_status_becomes_a_500(code: grpc.StatusCode) -> None:
    err = wire.error_of(RequestError(code, "why"))
    assert err.status != 500 and err.kind


def test_alternatives_in_openai_shapes() -> None:
    """Chat lists each token's alternatives; completions map their text to log-probabilities with
    the chosen token added when none of them is it (OpenAI's up to N + 1), the most likely of two
    alternatives with the same text kept."""
    from appliance.gateway.generation import TokenLogprob, TopLogprob

    top = (TopLogprob(7, b"a", -0.1), TopLogprob(8, b"b", -0.5), TopLogprob(9, b"a", -0.9))
    entry = TokenLogprob(3, b"c", -2.0, top)
    chat = wire.Answer(
        wire.parse_request(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "q"}],
                "logprobs": True,
                "top_logprobs": 3,
            },
            True,
        ),
        "abc",
        1,
    )
    rendered = chat.render_logprobs([entry])["content"][0]
    assert rendered["top_logprobs"] == [
        {"token": "a", "logprob": -0.1, "bytes": [97]},
        {"token": "b", "logprob": -0.5, "bytes": [98]},
        {"token": "a", "logprob": -0.9, "bytes": [97]},
    ]
    completion = wire.Answer(
        wire.parse_request({"model": "m", "prompt": "q", "logprobs": 3}, False), "abc", 1
    )
    assert completion.render_logprobs([entry])["top_logprobs"] == [
        {"a": -0.1, "b": -0.5, "c": -2.0}
    ]
    zero = wire.Answer(
        wire.parse_request({"model": "m", "prompt": "q", "logprobs": 0}, False), "abc", 1
    )
    assert zero.render_logprobs([entry._replace(top=())])["top_logprobs"] is None
    with pytest.raises(wire.HttpError) as refused:
        wire.parse_request({"model": "m", "prompt": "q", "logprobs": 21}, False)
    assert refused.value.param == "logprobs"
    refusal = RequestError(grpc.StatusCode.INVALID_ARGUMENT, "no", field="top_logprobs")
    assert wire.error_of(refusal, chat=False).param == "logprobs"
    assert wire.error_of(refusal).param == "top_logprobs"


def test_similarity_is_reported_for_any_tier_that_judged_one() -> None:
    # A tier of one's own that answers paraphrases reports its similarity as the semantic tier does.
    facts = wire.extension("abc", _final(tier="paraphrases", similarity=0.91234))
    assert facts["similarity"] == 0.9123
    assert "similarity" not in wire.extension("abc", _final(tier="l1", similarity=None))


def test_an_unknown_field_is_named_in_a_bounded_refusal() -> None:
    with pytest.raises(wire.HttpError) as err:
        wire.parse_request({"model": "tiny", "prompt": "x", "bogus": 1}, chat=False)
    assert err.value.message == "Unrecognized request argument supplied: bogus"
    assert err.value.param == "bogus"
    for name in ("k" * 100_000, "two\nlines", ""):
        with pytest.raises(wire.HttpError) as err:
            wire.parse_request({"model": "tiny", "prompt": "x", name: 1}, chat=False)
        assert len(err.value.message) < 200 and "\n" not in err.value.message
        assert err.value.param is not None and len(err.value.param) < 100
        assert repr(name[:10])[:-1] in err.value.message  # quoted: where it starts is shown


HUGE = "\x1b[2J\n" + "k" * 100_000


@pytest.mark.parametrize(
    ("chat", "extra"),
    [
        (True, {"response_format": {"type": "json_schema", "json_schema": {HUGE: 1}}}),
        (True, {"response_format": {"type": HUGE}}),
        (True, {"response_format": {"type": "json_object", HUGE: 1}}),
        (True, {"stream": True, "stream_options": {HUGE: 1}}),
        (False, {"appliance": {HUGE: 1}}),
        (False, {"appliance": {"guide": {"type": HUGE}}}),
        (False, {"appliance": {"guide": {"type": "regex", HUGE: 1}}}),
        (False, {"max_tokens": 10**4000}),
        (False, {HUGE: 1}),
    ],
)
def test_no_refusal_carries_a_clients_long_or_control_text(
    chat: bool, extra: dict[str, object]
) -> None:
    """Names and values a client sent are repeated quoted, escaped and cut, never whole."""
    body: dict[str, object] = {"model": "tiny", **extra}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "x"})
    with pytest.raises(wire.HttpError) as err:
        wire.parse_request(body, chat=chat)
    message, param = err.value.message, err.value.param or ""
    assert len(message) < 400 and len(param) < 100, (len(message), len(param))
    assert message.isprintable() and param.isprintable(), (message[:80], param[:80])


def _strict(data: bytes) -> object:
    """JSON as RFC 8259 defines it: no NaN, Infinity or -Infinity (orjson's, JavaScript's)."""

    def refuse(name: str) -> object:
        raise AssertionError(f"{name} is no JSON value")

    return json.loads(data, parse_constant=refuse)


@pytest.mark.parametrize("chat", [True, False])
def test_a_log_probability_of_minus_infinity_is_openais_floor_in_strict_json(chat: bool) -> None:
    """A grammar's mask (and min_tokens' ban of the end token) gives tokens a log-probability of
    -inf, and the N most likely alternatives of a step the grammar forces hold them: OpenAI writes
    such a value as -9999.0, and JSON has no -Infinity (orjson and JSON.parse refuse it)."""
    from appliance.gateway.generation import TokenLogprob, TopLogprob

    ninf, nan = float("-inf"), float("nan")
    entry = TokenLogprob(3, b"c", ninf, (TopLogprob(7, b"a", -0.0), TopLogprob(8, b"b", nan)))
    body: dict[str, object] = {"model": "m", "stream": True, "logprobs": True if chat else 2}
    body.update({"messages": [{"role": "user", "content": "q"}]} if chat else {"prompt": "q"})
    if chat:
        body["top_logprobs"] = 2
    answer = wire.Answer(wire.parse_request(body, chat), "abc", 1)
    chunk = _strict(answer.chunk("c", [entry])[len(b"data: ") :])
    whole = _strict(wire.dumps(answer.whole("c", _final(), [entry])))
    for rendered in (chunk, whole):
        assert isinstance(rendered, dict)
        logprobs = rendered["choices"][0]["logprobs"]
        if chat:
            token = logprobs["content"][0]
            assert token["logprob"] == -9999.0
            assert [t["logprob"] for t in token["top_logprobs"]] == [-0.0, -9999.0]
        else:
            assert logprobs["token_logprobs"] == [-9999.0]
            assert logprobs["top_logprobs"] == [{"a": -0.0, "b": -9999.0, "c": -9999.0}]
