"""KV-cache reuse as a Triton client sees it: the `return_perf_metrics` outputs of the TensorRT-LLM
backend, identical answers with and without reuse, nothing reusable left by a cancelled request,
and no reuse across a rebuilt model. Requests go over real gRPC to an in-process engine server.
"""

from __future__ import annotations

import array
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as ts
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.engine.runner import EngineStats
from appliance.engine.server import EngineModel, load_repository, start_engine
from tests.conftest import Tiny
from tests.engine.conftest import write_micro_checkpoint
from tests.engine.test_conformance import (
    _first_token_then,
    collect,
    is_final,
    read_rest,
    request,
    tokens_of,
)
from tests.support import until_engine

BLOCK = 8
PERF_OUTPUTS = {
    "kv_cache_alloc_new_blocks": mc.TYPE_INT32,
    "kv_cache_reused_blocks": mc.TYPE_INT32,
    "kv_cache_alloc_total_blocks": mc.TYPE_INT32,
    "arrival_time_ns": mc.TYPE_INT64,
    "first_scheduled_time_ns": mc.TYPE_INT64,
    "first_token_time_ns": mc.TYPE_INT64,
    "last_token_time_ns": mc.TYPE_INT64,
}


def write_model(
    repo: Path, name: str, template: Path, hf_dir: Path, params: dict[str, str]
) -> None:
    """A `tensorrt_llm`-style model that declares the backend's perf-metrics input and outputs."""
    config = text_format.Parse(template.read_text(), mc.ModelConfig())
    config.name = name
    config.parameters["hf_model_dir"].string_value = str(hf_dir)
    for key, value in params.items():
        config.parameters[key].string_value = value
    if "return_perf_metrics" not in {i.name for i in config.input}:
        flag = config.input.add(name="return_perf_metrics", data_type=mc.TYPE_BOOL, dims=[1])
        flag.optional = True
        flag.reshape.SetInParent()
    declared = {o.name for o in config.output}
    for output, dtype in PERF_OUTPUTS.items():
        if output not in declared:
            config.output.add(name=output, data_type=dtype, dims=[1])
    (repo / name).mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(text_format.MessageToString(config))


@dataclass
class Server:
    stub: ts_grpc.GRPCInferenceServiceStub
    models: dict[str, EngineModel]

    def stats(self, model: str) -> EngineStats:
        return self.models[model].runner.stats


@pytest.fixture(scope="module")
async def server(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Server]:
    repo = tmp_path_factory.mktemp("reuse-repo")
    template = tiny.repo / "tensorrt_llm" / "config.pbtxt"
    pool = str(2048 + 64 * BLOCK)  # the running request's max_seq_len plus 64 blocks
    common = {"tokens_per_block": str(BLOCK), "max_tokens_in_paged_kv_cache": pool}
    write_model(repo, "reuse", template, tiny.model_dir, common | {"enable_kv_cache_reuse": "true"})
    write_model(
        repo, "plain", template, tiny.model_dir, common | {"enable_kv_cache_reuse": "false"}
    )
    async with running(repo) as s:
        yield s


@asynccontextmanager
async def running(repo: Path) -> AsyncIterator[Server]:
    models = load_repository(repo)
    grpc_server, _, port = await start_engine(models, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Server(ts_grpc.GRPCInferenceServiceStub(channel), models)
    finally:
        await grpc_server.stop(grace=None)
        for m in models.values():
            m.runner.close()


def with_perf(req: ts.ModelInferRequest, outputs: tuple[str, ...] = ()) -> ts.ModelInferRequest:
    req.inputs.add(name="return_perf_metrics", datatype="BOOL", shape=[1, 1])
    req.raw_input_contents.append(bytes([1]))
    for name in outputs:
        req.outputs.add(name=name)
    return req


def scalar(response: ts.ModelInferResponse, name: str) -> int | None:
    for i, out in enumerate(response.outputs):
        if out.name == name:
            assert list(out.shape) == [1, 1]
            data = array.array("i" if out.datatype == "INT32" else "q")
            data.frombytes(response.raw_output_contents[i])
            return int(data[0])
    return None


def present(response: ts.ModelInferResponse, name: str) -> int:
    value = scalar(response, name)
    assert value is not None, f"no output {name}"
    return value


async def generate(
    s: Server, model: str, prompt: list[int], n: int = 4
) -> tuple[list[int], list[ts.ModelInferResponse]]:
    req = with_perf(request("r", prompt, n, model=model, top_k=1))
    responses = [m.infer_response for m in await collect(s.stub, req)]
    return [t for r in responses for t in tokens_of(r)], responses


PROMPT = list(range(300, 300 + 3 * BLOCK))  # exactly three blocks


async def test_reused_blocks_are_reported_and_change_nothing(server: Server) -> None:
    first, cold = await generate(server, "reuse", PROMPT)
    again, warm = await generate(server, "reuse", PROMPT)
    plain, _ = await generate(server, "plain", PROMPT)
    assert first == again == plain
    assert {scalar(r, "kv_cache_reused_blocks") for r in cold} == {0}
    # The whole prompt was cached; the last token is recomputed inside the last reused block.
    assert {scalar(r, "kv_cache_reused_blocks") for r in warm} == {3}
    last = warm[-1]
    times = [present(last, f"{t}_time_ns") for t in ("arrival", "first_scheduled", "first_token")]
    assert times == sorted(times) and times[0] and times[-1] <= present(last, "last_token_time_ns")


async def test_block_counts_are_those_of_adding_the_prompt(server: Server) -> None:
    """As TensorRT-LLM counts them when it adds the sequence to the cache: the prompt's blocks
    not reused were allocated (and held no reusable K/V: new), the same on every response."""
    prompt = list(range(1500, 1500 + 3 * BLOCK))
    _, cold = await generate(server, "reuse", prompt)
    _, warm = await generate(server, "reuse", prompt)
    _, longer = await generate(server, "reuse", [*prompt, *range(1700, 1700 + 2 * BLOCK)])
    counts = ("kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "kv_cache_alloc_new_blocks")
    for responses, expected in ((cold, (0, 3, 3)), (warm, (3, 0, 0)), (longer, (3, 2, 2))):
        assert len(responses) > 1
        assert {tuple(scalar(r, name) for name in counts) for r in responses} == {expected}


async def test_diverging_prompt_reuses_only_whole_matching_blocks(server: Server) -> None:
    await generate(server, "reuse", PROMPT)
    prompt = [*PROMPT[: BLOCK + 3], 900, 901, 902, 903, 904, 905, 906]
    got, responses = await generate(server, "reuse", prompt)
    assert got == (await generate(server, "plain", prompt))[0]
    assert scalar(responses[0], "kv_cache_reused_blocks") == 1


async def test_reuse_off_in_config_pbtxt(server: Server) -> None:
    await generate(server, "plain", PROMPT)
    _, responses = await generate(server, "plain", PROMPT)
    assert {scalar(r, "kv_cache_reused_blocks") for r in responses} == {0}
    kv = server.stats("plain").kv
    assert kv.max_blocks == 0 and kv.reused_blocks == 0 and kv.tokens_per_block == BLOCK


async def test_perf_outputs_only_when_asked_for(server: Server) -> None:
    plain = [
        m.infer_response for m in await collect(server.stub, request("p", PROMPT, 2, model="reuse"))
    ]
    assert all(scalar(r, "kv_cache_reused_blocks") is None for r in plain)
    only = with_perf(
        request("q", PROMPT, 2, model="reuse"), ("output_ids", "kv_cache_reused_blocks")
    )
    responses = [m.infer_response for m in await collect(server.stub, only)]
    names = {o.name for r in responses for o in r.outputs}
    assert names == {"output_ids", "kv_cache_reused_blocks"}


async def test_cancelled_request_leaves_nothing_reusable(server: Server) -> None:
    stats = server.stats("reuse")
    fresh = list(range(1000, 1000 + 4 * BLOCK))
    stored = stats.kv.stored_blocks
    cancelled = stats.cancelled
    call, outgoing = await _first_token_then(
        server.stub, with_perf(request("long-kv", fresh, 1500, model="reuse"))
    )
    await collect(server.stub, request("long-kv", stop=True, model="reuse"))
    await until_engine(stats, lambda: stats.cancelled > cancelled and stats.running is None)
    await outgoing.put(None)
    rest = await read_rest(call)
    assert rest and is_final(rest[-1])
    assert stats.kv.stored_blocks == stored
    _, responses = await generate(server, "reuse", fresh)
    assert scalar(responses[0], "kv_cache_reused_blocks") == 0
    _, responses = await generate(server, "reuse", fresh)  # a finished request does store them
    assert scalar(responses[0], "kv_cache_reused_blocks") == 4


async def test_rebuilt_model_never_reuses_old_blocks(tiny: Tiny, tmp_path: Path) -> None:
    """Same repository path and prompt, new weights and engine fingerprint: nothing carries over."""
    template = tiny.repo / "tensorrt_llm" / "config.pbtxt"
    params = {"tokens_per_block": "4", "max_seq_len": "64", "enable_kv_cache_reuse": "true"}
    params["max_tokens_in_paged_kv_cache"] = str(64 + 16 * 4)
    checkpoint, repo = tmp_path / "ckpt", tmp_path / "repo"
    prompt = [1, 5, 17, 42, 3, 88, 60, 7, 9, 19, 33, 96]

    async def serve(overrides: dict[str, object], fingerprint: str) -> tuple[list[int], int, int]:
        shutil.rmtree(checkpoint, ignore_errors=True)
        shutil.rmtree(repo, ignore_errors=True)
        write_micro_checkpoint(checkpoint, overrides)
        write_model(repo, "m", template, checkpoint, params)
        (repo / "m" / "engine_fingerprint").write_text(fingerprint + "\n")
        async with running(repo) as s:
            tokens, first = await generate(s, "m", prompt)
            _, second = await generate(s, "m", prompt)
            reused = [scalar(r[0], "kv_cache_reused_blocks") or 0 for r in (first, second)]
            return tokens, reused[0], reused[1]

    old_tokens, _, old_reused = await serve({}, "engine-1")
    assert old_reused == 3
    new_tokens, first_reused, new_reused = await serve({"intermediate_size": 96}, "engine-2")
    assert first_reused == 0 and new_reused == 3
    params["enable_kv_cache_reuse"] = "false"
    fresh_tokens, _, _ = await serve({"intermediate_size": 96}, "engine-2")
    assert new_tokens == fresh_tokens != old_tokens
