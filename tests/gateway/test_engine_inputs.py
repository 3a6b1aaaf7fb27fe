"""A request field the model's engine takes no input for (TensorRT-LLM builds without a seed, a
minimum length, log-probabilities or an end id) is refused before the cache, naming the model the
client asked for and the field: the gRPC message, and the OpenAI error's `param` over HTTP. The
engine server stands in, behind a config that declares none of those inputs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import openai
import pytest
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as ts

from appliance.engine.server import EngineService
from appliance.gateway.server import RunningGateway
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Engine, Tiny
from tests.gateway.test_http_api import _client
from tests.gateway.test_top_logprobs import gateway_before

# The inputs the config leaves out, and the request field each one serves.
LEFT_OUT = {"seed", "random_seed", "min_tokens", "min_length", "return_log_probs", "end_id"}
FIELDS: dict[str, Any] = {"seed": 7, "min_tokens": 1, "logprobs": True, "ignore_eos": True}


class WithoutInputs(EngineService):
    """The engine server answering ModelConfig with its model's config less LEFT_OUT."""

    async def ModelConfig(
        self, request: ts.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> ts.ModelConfigResponse:
        reply = await super().ModelConfig(request, context)
        config = mc.ModelConfig()
        config.CopyFrom(reply.config)
        kept = [i for i in config.input if i.name not in LEFT_OUT]
        del config.input[:]
        config.input.extend(kept)
        return ts.ModelConfigResponse(config=config)


@pytest.fixture
async def gateway(tiny: Tiny, engine: Engine) -> AsyncIterator[RunningGateway]:
    async for running in gateway_before(WithoutInputs(engine.models), tiny):
        yield running


@pytest.mark.parametrize("field", FIELDS)
async def test_grpc_refusal_names_the_clients_model_and_the_field(
    gateway: RunningGateway, field: str
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        inference = pb_grpc.InferenceStub(channel)
        request = pb.GenerateRequest(model="tiny", prompt="hi", max_tokens=2)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await inference.Complete(
                pb.GenerateRequest(**{**_fields(request), field: FIELDS[field]})
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = refused.value.details() or ""
        assert "model 'tiny'" in details and "tensorrt_llm" not in details, details
        assert f"without {field}" in details, details
        # The same request without the field is served.
        assert (await inference.Complete(request)).text


def _fields(request: pb.GenerateRequest) -> dict[str, Any]:
    return {f.name: v for f, v in request.ListFields()}


@pytest.mark.parametrize("field", FIELDS)
async def test_http_refusal_param_is_the_body_field(gateway: RunningGateway, field: str) -> None:
    # Chat's logprobs is a switch; completions' is a count (0: the chosen token's alone).
    async with _client(gateway) as http:
        with pytest.raises(openai.BadRequestError) as chat:
            await http.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                extra_body={field: FIELDS[field]},
            )
        with pytest.raises(openai.BadRequestError) as completion:
            await http.completions.create(
                model="tiny",
                prompt="hi",
                max_tokens=2,
                extra_body={field: 0 if field == "logprobs" else FIELDS[field]},
            )
    for refused in (chat, completion):
        body: dict[str, Any] = refused.value.body  # type: ignore[assignment]
        assert body["param"] == field and "model 'tiny'" in body["message"], body
