"""Speculative decoding as a Triton client sees it: a model served with `--speculative` declares
the per-request switch and the backend's draft-count outputs; with `return_perf_metrics` each
response carries the request's draft tokens proposed and accepted so far, the counts the engine's
own counters add up; a request that switches speculation off is decoded without drafts and gets
the same tokens (greedy). Requests go over real gRPC to an in-process engine server."""

from __future__ import annotations

import array
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import service_pb2 as ts
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.engine.options import EngineOptions
from appliance.engine.runner import EngineStats
from appliance.engine.server import EngineModel, load_repository, start_engine
from engine_build.pbtxt import (
    ACCEPTANCE_RATE_OUTPUT,
    ACCEPTED_DRAFT_TOKENS_OUTPUT,
    DRAFT_TOKENS_OUTPUT,
    PERF_METRICS_INPUT,
    SPECULATION_INPUT,
)
from tests.conftest import Tiny
from tests.engine.test_conformance import collect, is_final, request, tokens_of

MODEL = "tensorrt_llm"
NGRAM = EngineOptions(speculative="ngram", draft_tokens=4, ngram=3)


@dataclass
class Server:
    stub: ts_grpc.GRPCInferenceServiceStub
    models: dict[str, EngineModel]

    @property
    def stats(self) -> EngineStats:
        return self.models[MODEL].runner.stats


@asynccontextmanager
async def running(repo: Path, options: EngineOptions) -> AsyncIterator[Server]:
    models = load_repository(repo, options)
    grpc_server, _, port = await start_engine(models, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Server(ts_grpc.GRPCInferenceServiceStub(channel), models)
    finally:
        await grpc_server.stop(grace=None)
        for m in models.values():
            m.runner.close()


@pytest.fixture(scope="module")
async def spec(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Server]:
    repo = tmp_path_factory.mktemp("spec-repo")
    shutil.copytree(tiny.repo / MODEL, repo / MODEL)
    async with running(repo, NGRAM) as s:
        yield s


def flag(req: ts.ModelInferRequest, name: str, value: bool) -> ts.ModelInferRequest:
    req.inputs.add(name=name, datatype="BOOL", shape=[1, 1])
    req.raw_input_contents.append(bytes([int(value)]))
    return req


def scalar(response: ts.ModelInferResponse, name: str) -> float | None:
    for i, out in enumerate(response.outputs):
        if out.name == name:
            assert list(out.shape) == [1, 1]
            data = array.array({"INT32": "i", "FP32": "f"}[out.datatype])
            data.frombytes(response.raw_output_contents[i])
            return float(data[0])
    return None


def present(response: ts.ModelInferResponse, name: str) -> float:
    value = scalar(response, name)
    assert value is not None, f"no output {name}"
    return value


# A repeated phrase: prompt lookup finds n-grams to copy from the first decode step.
PROMPT = [300 + i % 7 for i in range(42)]


async def generate(
    s: Server, speculation: bool | None, n: int = 24
) -> tuple[list[int], list[ts.ModelInferResponse]]:
    req = flag(request("r", PROMPT, n, top_k=1), PERF_METRICS_INPUT, True)
    if speculation is not None:
        flag(req, SPECULATION_INPUT, speculation)
    messages = await collect(s.stub, req)
    assert not [m.error_message for m in messages if m.error_message]
    responses = [m.infer_response for m in messages]
    return [t for r in responses for t in tokens_of(r)], responses


async def test_the_served_config_declares_the_switch_and_the_outputs(spec: Server) -> None:
    config = (await spec.stub.ModelConfig(ts.ModelConfigRequest(name=MODEL))).config
    inputs = {i.name: i for i in config.input}
    assert inputs[SPECULATION_INPUT].optional and inputs[PERF_METRICS_INPUT].optional
    outputs = {o.name for o in config.output}
    assert {ACCEPTANCE_RATE_OUTPUT, ACCEPTED_DRAFT_TOKENS_OUTPUT, DRAFT_TOKENS_OUTPUT} <= outputs


async def test_reported_counts_are_what_the_engine_counted(spec: Server) -> None:
    drafted, accepted = spec.stats.spec_draft_tokens, spec.stats.spec_accepted_tokens
    tokens, responses = await generate(spec, None)
    assert tokens and is_final(responses[-1])
    counts = [present(r, DRAFT_TOKENS_OUTPUT) for r in responses]
    assert counts == sorted(counts)  # so far, on every response
    last = responses[-1]
    draft_tokens = scalar(last, DRAFT_TOKENS_OUTPUT)
    accepted_tokens = scalar(last, ACCEPTED_DRAFT_TOKENS_OUTPUT)
    assert draft_tokens is not None and accepted_tokens is not None
    assert draft_tokens > 0
    assert draft_tokens == spec.stats.spec_draft_tokens - drafted
    assert accepted_tokens == spec.stats.spec_accepted_tokens - accepted
    assert scalar(last, ACCEPTANCE_RATE_OUTPUT) == pytest.approx(accepted_tokens / draft_tokens)


async def test_switched_off_a_request_drafts_nothing_and_answers_the_same(spec: Server) -> None:
    with_drafts, _ = await generate(spec, True)
    drafted = spec.stats.spec_draft_tokens
    without, responses = await generate(spec, False)
    assert without == with_drafts
    assert spec.stats.spec_draft_tokens == drafted
    assert {scalar(r, DRAFT_TOKENS_OUTPUT) for r in responses} == {0.0}
    assert scalar(responses[-1], ACCEPTANCE_RATE_OUTPUT) == 0.0


async def test_a_model_served_without_speculation_declares_no_switch(
    tiny: Tiny, tmp_path: Path
) -> None:
    shutil.copytree(tiny.repo / MODEL, tmp_path / MODEL)
    async with running(tmp_path, EngineOptions()) as plain:
        config = (await plain.stub.ModelConfig(ts.ModelConfigRequest(name=MODEL))).config
        assert SPECULATION_INPUT not in {i.name for i in config.input}
        req = flag(request("r", PROMPT, 4, top_k=1), SPECULATION_INPUT, False)
        messages = await collect(plain.stub, req)
        assert "unexpected inference input" in messages[0].error_message
