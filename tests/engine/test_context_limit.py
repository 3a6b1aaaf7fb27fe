"""An engine built for a shorter max_seq_len than the model's context (config.json).

The engine server refuses a prompt longer than max_input_len in-band and shortens a
request_output_len that does not fit max_seq_len, as TensorRT-LLM does. The gateway reads both
limits from the model's config.pbtxt parameters and refuses what does not fit before the engine,
as it refuses what does not fit the model's context.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.backends.base import GREEDY, NO_ENGINE_LIMITS, EngineLimits, GenerationRequest
from appliance.backends.triton import engine_limits
from appliance.config import HttpConfig
from appliance.engine.server import load_repository, start_engine
from appliance.gateway.generation import Outcome, generate
from appliance.gateway.models import ServedModel, load_models
from appliance.gateway.server import RunningGateway, start_server
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from engine_build.repo import write_hf_repository
from tests.conftest import Tiny
from tests.engine.test_conformance import collect, request, tokens_of
from tests.support import gateway_config, until_async

SHORT = 64
# More tokens than SHORT.
LONG = "the cache answers repeated questions " * 12


async def test_request_output_len_beyond_the_engine_limit_is_shortened_not_refused(
    tiny: Tiny, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """TensorRT-LLM shortens request_output_len to what max_seq_len leaves after the prompt and
    refuses only a prompt longer than the maximum input length (max_seq_len - 1 here)."""
    repo = write_hf_repository(
        tiny.model_dir, tmp_path_factory.mktemp("short") / "repo", SHORT, guided_decoding=False
    )
    models = load_repository(repo)
    server, _, port = await start_engine(models, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ts_grpc.GRPCInferenceServiceStub(channel)
            prompt = [1, 300, 301, 302, 303, 304]
            responses = await collect(stub, request("long", prompt, max_tokens=1000, end_id=-1))
            assert not [r.error_message for r in responses if r.error_message]
            generated = [t for r in responses for t in tokens_of(r.infer_response)]
            assert len(generated) == SHORT - len(prompt)
            (refused,) = await collect(stub, request("too-long", [5] * SHORT, max_tokens=1))
            assert refused.error_message.startswith(
                "Executor failed process requestId 0 due to the following error: "
                f"Prompt length ({SHORT}) exceeds maximum input length ({SHORT - 1})."
            )
            fits = await collect(stub, request("fits", [5] * (SHORT - 1), max_tokens=8, end_id=-1))
            assert [t for r in fits for t in tokens_of(r.infer_response)] != []
            assert sum(len(tokens_of(r.infer_response)) for r in fits) == 1
    finally:
        await server.stop(grace=None)
        for m in models.values():
            m.runner.close()


def _short_gateway(
    tiny: Tiny, root: Path
) -> contextlib.AbstractAsyncContextManager[tuple[RunningGateway, ServedModel]]:
    """The engine server on a repository built for SHORT tokens, and a gateway (gRPC and HTTP)
    in front of it; the gateway's config.json context is the checkpoint's (2048)."""
    repo = write_hf_repository(tiny.model_dir, root / "repo", SHORT, guided_decoding=False)
    return _gateway_on(tiny, repo)


def _undeclare_limits(repo: Path, engine_dir: Path | None = None) -> None:
    """Takes the max_input_len and max_seq_len parameters out of the repository's config.pbtxt,
    as in a repository filled from NVIDIA's inflight_batcher_llm template, which has neither;
    `engine_dir`, when given, becomes its gpt_model_path (the template's `${engine_dir}`)."""
    pbtxt = repo / "tensorrt_llm" / "config.pbtxt"
    undeclared = re.sub(
        r'parameters \{\s*key: "max_(input|seq)_len"\s*value \{[^}]*\}\s*\}\s*',
        "",
        pbtxt.read_text(),
    )
    assert "max_seq_len" not in undeclared
    if engine_dir is not None:
        assert "gpt_model_path" not in undeclared
        undeclared += (
            f'parameters {{ key: "gpt_model_path" value {{ string_value: "{engine_dir}" }} }}\n'
        )
    pbtxt.write_text(undeclared)


def _engine_config(
    max_input_len: int = SHORT - 1,
    max_seq_len: int = SHORT,
    max_num_tokens: int = 8192,
    context_fmha: bool = True,
    remove_input_padding: bool = True,
    max_draft_len: int = 0,
) -> dict[str, Any]:
    """The parts of a TensorRT-LLM 1.2 engine's config.json (Engine.save: EngineConfig.to_dict,
    BuildConfig.to_dict) that bound a request, with the builder's default plugin settings."""
    return {
        "version": "1.2.1",
        "pretrained_config": {"architecture": "LlamaForCausalLM", "dtype": "bfloat16"},
        "build_config": {
            "max_input_len": max_input_len,
            "max_seq_len": max_seq_len,
            "max_batch_size": 1,
            "max_beam_width": 1,
            "max_num_tokens": max_num_tokens,
            "opt_num_tokens": None,
            "max_draft_len": max_draft_len,
            "plugin_config": {
                "context_fmha": context_fmha,
                "remove_input_padding": remove_input_padding,
                "paged_kv_cache": True,
                "tokens_per_block": 32,
            },
        },
    }


def _engine_dir(root: Path, config: object) -> Path:
    """An engine directory as trtllm-build leaves it: config.json (the engine file itself is
    not read by the gateway)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    (root / "rank0.engine").write_bytes(b"")
    return root


@contextlib.asynccontextmanager
async def _gateway_on(tiny: Tiny, repo: Path) -> AsyncIterator[tuple[RunningGateway, ServedModel]]:
    """The engine server on `repo` and a gateway (gRPC and HTTP) in front of it."""
    models = load_repository(repo)
    server, _, port = await start_engine(models, "127.0.0.1:0")
    config = gateway_config(
        tiny.tokenizer_dir, f"127.0.0.1:{port}", http=HttpConfig(listen="127.0.0.1:0")
    )
    served = await load_models(config)
    gateway = await start_server(config, served)
    try:
        yield gateway, served["tiny"]
    finally:
        await gateway.drain(0.1)
        await server.stop(grace=None)
        for m in models.values():
            m.runner.close()


async def _post(gateway: RunningGateway, path: str, body: Mapping[str, object]) -> tuple[int, Any]:
    assert gateway.http is not None
    url = f"http://127.0.0.1:{gateway.http.port}/v1/{path}"
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as reply:
        return reply.status, await reply.json()


async def test_requests_beyond_the_engine_limits_are_refused_as_context_length_exceeded(
    tiny: Tiny, tmp_path: Path
) -> None:
    """The engine's max_input_len and max_seq_len bound a request as the model's context does:
    refused by the gateway with OpenAI's 400 context_length_exceeded, naming the limit."""
    async with _short_gateway(tiny, tmp_path) as (gateway, _):
        status, body = await _post(gateway, "completions", {"model": "tiny", "prompt": LONG})
        error = body["error"]
        assert status == 400, body
        assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
        assert f"at most {SHORT - 1} input tokens (its engine's max_input_len)" in error["message"]

        chat = {"model": "tiny", "messages": [{"role": "user", "content": LONG}]}
        status, body = await _post(gateway, "chat/completions", chat)
        assert status == 400, body
        assert (body["error"]["code"], body["error"]["param"]) == (
            "context_length_exceeded",
            "messages",
        )

        asked = {"model": "tiny", "prompt": "hi", "max_tokens": SHORT}
        status, body = await _post(gateway, "completions", asked)
        error = body["error"]
        assert status == 400, body
        assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
        assert (
            f"max_tokens ({SHORT}) exceeds the engine's max_seq_len of {SHORT}"
            in (error["message"])
        )

        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Complete(pb.GenerateRequest(model="tiny", prompt=LONG))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_input_len" in (err.value.details() or "")
            # A prompt that fits is served by the same engine.
            ok = await stub.Complete(pb.GenerateRequest(model="tiny", prompt="hi", max_tokens=4))
            assert ok.final.usage.completion_tokens == 4


async def test_default_max_tokens_is_what_the_engine_leaves_after_the_prompt(
    tiny: Tiny, tmp_path: Path
) -> None:
    """No max_tokens: the model's default (256 here) is capped by what max_seq_len leaves after
    the prompt, served to that length and reported as cut by length."""
    async with _short_gateway(tiny, tmp_path) as (gateway, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            asked = pb.GenerateRequest(
                model="tiny", prompt="hi there", ignore_eos=True, temperature=0, seed=1
            )
            reply = await stub.Complete(asked)
            cache = gateway.pipeline.cache
            assert cache is not None
            await until_async(lambda: cache.metrics.writes == 1, "the answer was never stored")
            # Cached as the default it was: asked again, an L1 hit; asked with the default's
            # number as its own max_tokens, refused as it would be uncached.
            assert (await stub.Complete(asked)).final.cache_tier == pb.CACHE_TIER_EXACT_L1
            asked.max_tokens = 256
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Complete(asked)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        usage = reply.final.usage
        assert usage.prompt_tokens + usage.completion_tokens == SHORT
        assert reply.final.finish_reason == pb.FINISH_REASON_LENGTH


async def test_an_answer_the_engine_ends_at_max_seq_len_finishes_by_length(
    tiny: Tiny, tmp_path: Path
) -> None:
    """A generation the engine shortens to its max_seq_len (a request_output_len past it) ends
    with finish reason length, not stop."""
    async with _short_gateway(tiny, tmp_path) as (_, model):
        prompt = [1, 300, 301, 302, 303, 304]
        request = GenerationRequest(
            request_id="past-max-seq-len",
            prompt_ids=prompt,
            max_tokens=1000,
            end_id=model.text.end_id,
            pad_id=model.text.pad_id,
            sampling=GREEDY,
            timeout_s=30.0,
            ignore_eos=True,
        )
        events = [e async for e in generate(model, request, ())]
        outcome = events[-1]
        assert isinstance(outcome, Outcome)
        assert outcome.completion_tokens == SHORT - len(prompt)
        assert outcome.finish_reason == "length"


async def test_the_engine_refusing_a_prompt_is_context_length_exceeded(
    tiny: Tiny, tmp_path: Path
) -> None:
    """An engine that declares no limits (a config.pbtxt without max_input_len and max_seq_len)
    but runs a checkpoint of a shorter context than the gateway's tokenizer says: the engine's
    in-band refusal reaches the client as OpenAI's 400 context_length_exceeded, in its words."""
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny.model_dir, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(
        json.dumps({**config, "max_position_embeddings": SHORT})
    )
    repo = write_hf_repository(checkpoint, tmp_path / "repo", guided_decoding=False)
    _undeclare_limits(repo)
    async with _gateway_on(tiny, repo) as (gateway, model):
        assert model.backend.engine_limits.max_seq_len is None
        chat = {"model": "tiny", "messages": [{"role": "user", "content": LONG}]}
        status, body = await _post(gateway, "chat/completions", chat)
        error = body["error"]
        assert status == 400, body
        assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
        assert f"exceeds maximum input length ({SHORT - 1})" in error["message"]


def test_engine_limits_are_read_from_the_parameters_the_engine_applies() -> None:
    def limits(**given: str) -> EngineLimits:
        config = mc.ModelConfig()
        for name, value in given.items():
            config.parameters[name].string_value = value
        return engine_limits(config.parameters)

    assert limits() == NO_ENGINE_LIMITS
    assert limits(max_seq_len="4096", max_input_len="2048") == EngineLimits(2048, 4096)
    # The engine serves at most max_seq_len - 1 prompt tokens, whatever max_input_len says.
    assert limits(max_seq_len="4096", max_input_len="8192") == EngineLimits(4095, 4096)
    assert limits(max_seq_len="4096") == EngineLimits(4095, 4096)
    assert limits(max_input_len="2048") == EngineLimits(2048, None)
    assert limits(max_seq_len="", max_input_len="0") == NO_ENGINE_LIMITS
    assert limits(max_seq_len="${max_seq_len}") == NO_ENGINE_LIMITS


async def test_limits_of_a_template_repository_are_read_from_its_engine_directory(
    tiny: Tiny, tmp_path: Path
) -> None:
    """A repository filled from NVIDIA's template declares no max_input_len or max_seq_len; its
    gpt_model_path names the engine directory, whose config.json holds the limits the engine
    was built with. The gateway bounds requests by them before the engine (the engine server
    here runs the checkpoint's whole context, so only the gateway refuses)."""
    repo = write_hf_repository(tiny.model_dir, tmp_path / "repo", guided_decoding=False)
    _undeclare_limits(repo, _engine_dir(tmp_path / "engine", _engine_config()))
    async with _gateway_on(tiny, repo) as (gateway, model):
        chat = {"model": "tiny", "messages": [{"role": "user", "content": LONG}]}
        status, body = await _post(gateway, "chat/completions", chat)
        assert status == 400, body
        error = body["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
        assert f"at most {SHORT - 1} input tokens (its engine's max_input_len)" in error["message"]

        asked = {"model": "tiny", "prompt": "hi", "max_tokens": SHORT}
        status, body = await _post(gateway, "completions", asked)
        assert status == 400, body
        assert f"exceeds the engine's max_seq_len of {SHORT}" in body["error"]["message"]

        fits = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
        status, body = await _post(gateway, "completions", fits)
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 4
        assert model.backend.engine_limits == EngineLimits(SHORT - 1, SHORT)


def _limits_with_engine(engine_dir: Path | str, **given: str) -> EngineLimits:
    config = mc.ModelConfig()
    config.parameters["gpt_model_path"].string_value = str(engine_dir)
    for name, value in given.items():
        config.parameters[name].string_value = value
    return engine_limits(config.parameters)


def test_engine_directory_limits_follow_what_the_executor_applies(tmp_path: Path) -> None:
    """TensorRT-LLM's executor (TrtGptModelInflightBatching) takes max_seq_len from the engine;
    its prompt limit is max_seq_len - 1 with chunked context, min(max_seq_len - 1,
    max_num_tokens) with context FMHA on packed input, else the build's max_input_len; a
    request also leaves room for max_draft_len draft tokens (LlmRequest::validate)."""

    def limits(config: dict[str, Any], **given: str) -> EngineLimits:
        return _limits_with_engine(_engine_dir(tmp_path / "engine", config), **given)

    assert limits(_engine_config(max_input_len=16)) == EngineLimits(SHORT - 1, SHORT)
    assert limits(_engine_config(max_num_tokens=32)) == EngineLimits(32, SHORT)
    assert limits(_engine_config(max_input_len=16, context_fmha=False)) == EngineLimits(16, SHORT)
    assert limits(
        _engine_config(max_input_len=16, context_fmha=False), enable_chunked_context="true"
    ) == EngineLimits(SHORT - 1, SHORT)
    assert limits(_engine_config(max_draft_len=4)) == EngineLimits(SHORT - 5, SHORT - 4)
    # The config.pbtxt's parameters win where present; the engine fills in what they lack.
    assert limits(_engine_config(), max_seq_len="4096", max_input_len="2048") == EngineLimits(
        2048, 4096
    )
    assert limits(_engine_config(), max_input_len="16") == EngineLimits(16, SHORT)
    # The template's placeholder, unfilled, names no directory.
    assert _limits_with_engine("${engine_dir}") == NO_ENGINE_LIMITS


@pytest.mark.parametrize(
    ("given", "chunked"),
    [("true", True), ("True", True), ("TRUE", True), ("1", True), ("false", False), ("0", False)],
)
def test_chunked_context_is_on_for_every_value_the_backend_reads_as_true(
    tmp_path: Path, given: str, chunked: bool
) -> None:
    """The tensorrtllm backend's bool parameters (ModelState::GetParameter<bool>) are true for
    True, true, TRUE and 1: with chunked context on, the engine takes prompts up to
    max_seq_len - 1, past max_num_tokens."""
    engine_dir = _engine_dir(tmp_path / "engine", _engine_config(max_num_tokens=32))
    limits = _limits_with_engine(engine_dir, enable_chunked_context=given)
    assert limits == EngineLimits(SHORT - 1 if chunked else 32, SHORT)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"{", "not valid JSON"),
        (b"[" * 100_000, "not valid JSON"),
        (b"\xff\xfe", "not UTF-8"),
        (b"[1, 2]", "build_config"),
        (json.dumps({"version": "1.2.1"}).encode(), "build_config"),
        (json.dumps(_engine_config(max_seq_len=0)).encode(), "max_seq_len"),
        (
            json.dumps(
                {"build_config": {**_engine_config()["build_config"], "max_seq_len": "64"}}
            ).encode(),
            "max_seq_len",
        ),
        (
            json.dumps(
                {"build_config": {**_engine_config()["build_config"], "max_seq_len": True}}
            ).encode(),
            "max_seq_len",
        ),
        (
            json.dumps(
                {"build_config": {**_engine_config()["build_config"], "plugin_config": []}}
            ).encode(),
            "plugin_config",
        ),
        (b" " * (2 * 2**20), "bytes"),
    ],
)
def test_an_engine_config_that_cannot_be_used_leaves_the_limits_unknown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, why: str
) -> None:
    """A config.json too large, not JSON or of the wrong shape: no limits from it, one log line
    naming the file and what is wrong, no exception."""
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "config.json").write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="appliance.backends.triton"):
        assert _limits_with_engine(engine) == NO_ENGINE_LIMITS
    (record,) = caplog.records
    assert str(engine / "config.json") in record.getMessage()
    assert why in record.getMessage()


def test_an_engine_directory_that_cannot_be_read_leaves_the_limits_unknown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No directory there (Triton on another host), no config.json in it, or one that is not a
    plain file (a FIFO would block the read): one log line each, no limits, no exception."""
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "config.json")
    for engine in (tmp_path / "absent", tmp_path, fifo):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="appliance.backends.triton"):
            assert _limits_with_engine(engine) == NO_ENGINE_LIMITS
        (record,) = caplog.records
        assert str(engine / "config.json") in record.getMessage()
