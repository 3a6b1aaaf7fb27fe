"""A prompt longer than what the engine serves: the engine's in-band error reaches the client as
INVALID_ARGUMENT with the engine's own words.

The gateway bounds prompts by the model's context (config.json); an engine built for a shorter
max_seq_len (the repository's parameter) is the case where only the engine can refuse. A prompt that
fits with a request_output_len that does not is served with fewer tokens, as TensorRT-LLM serves it.
"""

from __future__ import annotations

import grpc
import pytest
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.engine.server import load_repository, start_engine
from appliance.gateway.models import load_models
from appliance.gateway.server import start_server
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from engine_build.repo import write_hf_repository
from tests.conftest import Tiny
from tests.engine.test_conformance import collect, request, tokens_of
from tests.support import gateway_config

SHORT = 64


async def test_prompt_beyond_the_engine_limit_is_invalid_argument(
    tiny: Tiny, tmp_path_factory: pytest.TempPathFactory
) -> None:
    repo = write_hf_repository(
        tiny.model_dir, tmp_path_factory.mktemp("short") / "repo", SHORT, guided_decoding=False
    )
    models = load_repository(repo)
    assert models["tensorrt_llm"].max_len == SHORT
    server, _, port = await start_engine(models, "127.0.0.1:0")
    config = gateway_config(tiny.tokenizer_dir, f"127.0.0.1:{port}")
    gateway = await start_server(config, await load_models(config))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            long_prompt = "the cache answers repeated questions " * 12
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Complete(pb.GenerateRequest(model="tiny", prompt=long_prompt))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"exceeds maximum input length ({SHORT - 1})" in (err.value.details() or "")
            # A prompt that fits is served by the same engine.
            ok = await stub.Complete(pb.GenerateRequest(model="tiny", prompt="hi", max_tokens=4))
            assert ok.final.usage.completion_tokens == 4
    finally:
        await gateway.drain(0.1)
        await server.stop(grace=None)
        for m in models.values():
            m.runner.close()


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
