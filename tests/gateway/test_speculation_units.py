"""The speculation switch without servers: which requests a model refuses, how the Triton client
reads a model's speculation from its config, and what the switch does to a cache key."""

from __future__ import annotations

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from appliance.backends.base import NO_SPECULATION, Speculation
from appliance.backends.triton import InputNames
from appliance.cache.keys import ModelIdentity, cache_key
from appliance.gateway.errors import RequestError
from appliance.gateway.pipeline import sampling_key
from appliance.gateway.request import (
    CheckedRequest,
    IncomingRequest,
    Limits,
    check,
    check_speculation,
)
from engine_build.pbtxt import SPECULATION_INPUT, declare_perf_metrics

LIMITS = Limits(
    max_input_tokens=100, max_output_tokens=50, default_max_tokens=10, context_length=200
)
DRAFTS = Speculation(drafts=True, switchable=True)
ALWAYS = Speculation(drafts=True, switchable=False)
MODEL = ModelIdentity("m", "e", "t", "1")


def checked(
    speculation: bool | None, temperature: float = 0.0, seed: int | None = None
) -> CheckedRequest:
    incoming = IncomingRequest(
        model="m", prompt="hi", speculation=speculation, temperature=temperature, seed=seed
    )
    return check(incoming, LIMITS)


@pytest.mark.parametrize(
    ("speculation", "asked", "refused"),
    [
        (NO_SPECULATION, None, False),
        (NO_SPECULATION, False, False),
        (NO_SPECULATION, True, True),
        (DRAFTS, True, False),
        (DRAFTS, False, False),
        (ALWAYS, True, False),
        (ALWAYS, False, True),
    ],
)
def test_what_each_model_refuses(
    speculation: Speculation, asked: bool | None, refused: bool
) -> None:
    request = checked(asked)
    if not refused:
        check_speculation(request, "m", speculation)
        return
    with pytest.raises(RequestError) as exc:
        check_speculation(request, "m", speculation)
    assert exc.value.code.name == "INVALID_ARGUMENT"
    assert "model 'm'" in exc.value.message


def config(
    *, switch: bool = False, decoding_mode: str = "", counts: bool = False
) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name="m", max_batch_size=1)
    for name in ("input_ids", "input_lengths", "request_output_len"):
        cfg.input.add(name=name, data_type=mc.TYPE_INT32, dims=[-1])
    cfg.output.add(name="output_ids", data_type=mc.TYPE_INT32, dims=[-1, -1])
    if switch:
        cfg.input.add(name=SPECULATION_INPUT, data_type=mc.TYPE_BOOL, dims=[1], optional=True)
    if decoding_mode:
        cfg.parameters["decoding_mode"].string_value = decoding_mode
    if counts:
        declare_perf_metrics(cfg)
    return cfg


def test_the_client_reads_speculation_from_the_config() -> None:
    assert InputNames.from_config(config()).speculation == NO_SPECULATION
    assert InputNames.from_config(config(decoding_mode="top_k_top_p")).speculation == NO_SPECULATION
    assert InputNames.from_config(config(switch=True)).speculation == DRAFTS
    assert InputNames.from_config(config(decoding_mode="lookahead")).speculation == ALWAYS
    assert not InputNames.from_config(config()).draft_counts
    assert InputNames.from_config(config(counts=True)).draft_counts


def key(speculation: bool | None, temperature: float = 0.0, seed: int | None = None) -> bytes:
    c = checked(speculation, temperature, seed)
    return cache_key("default", MODEL, c.prompt, c.messages, sampling_key(c))


def test_only_a_sampled_request_without_drafts_gets_a_key_of_its_own() -> None:
    assert key(None) == key(False) == key(True)
    assert key(None, 0.7, 3) == key(True, 0.7, 3)
    assert key(False, 0.7, 3) != key(None, 0.7, 3)
