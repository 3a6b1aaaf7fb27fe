"""Grammar-constrained decoding through the engine server's Triton protocol.

The tiny model's weights are random, so whatever it writes under a guide is the mask's doing: every
output must satisfy its guide. The repository declares the tensorrt_llm template's two guided-decoding
inputs and serves the model three ways: `guided_llm` (xgrammar, the tiny tokenizer's info file),
`tensorrt_llm` (the inputs declared, guided decoding off), `no_stop_llm` (a tokenizer info file
without stop tokens, so a finished grammar leaves no token to sample) and `guided_sync_llm` (not
decoupled, for ModelInfer).
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.process
import re
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import jsonschema
import pytest
from google.protobuf import text_format
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as ts
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.engine import guide_compile
from appliance.engine.guided import (
    COMPILE_DEADLINE_S,
    COMPILE_MEMORY_BYTES,
    COMPILE_SLOTS,
    MASK_BUDGET,
    MAX_GUIDE_BYTES,
    Guide,
    GuideBusy,
    GuideError,
)
from appliance.engine.metrics import EngineCollector
from appliance.engine.server import EngineModel, EngineService, load_repository, start_engine
from engine_build.pbtxt import GUIDED_DECODING_INPUTS
from engine_build.repo import write_hf_repository
from engine_build.tokenizer_info import write_tokenizer_info
from tests.conftest import Tiny, copy_repository
from tests.engine.test_conformance import (
    collect,
    is_final,
    request,
    tokens_of,
)
from tests.support import until_engine

GUIDED = "guided_llm"
PLAIN = "tensorrt_llm"
NO_STOP = "no_stop_llm"
SYNC = "guided_sync_llm"
EOS = 2
PROMPT = [1, 400, 401, 402, 403]

SCHEMAS: list[dict[str, object]] = [
    {
        "type": "object",
        "properties": {
            # A length-bounded string as a pattern: xgrammar's rule for "maxLength" lets raw
            # control characters into the string, which strict JSON parsers refuse.
            "name": {"type": "string", "pattern": "^[A-Za-z .]{1,12}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "role": {"enum": ["admin", "editor", "viewer"]},
                },
                "required": ["id", "role"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "score": {"type": "number", "minimum": -5, "maximum": 5},
        },
        "required": ["tags", "score"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 10, "maximum": 99},
        "minItems": 2,
        "maxItems": 4,
    },
    {"enum": ["yes", "no", 3, None]},
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -100, "maximum": 100},
                    "y": {"type": "integer", "minimum": -100, "maximum": 100},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
]


def _guided_config(
    source: Path, target: Path, name: str, info: Path | None, decoupled: bool = True
) -> None:
    """The tensorrt_llm config under `name`, declaring the guided-decoding inputs (as the
    TensorRT-LLM template does) and, with `info`, turning on the xgrammar backend."""
    config = text_format.Parse((source / "config.pbtxt").read_text(), mc.ModelConfig())
    config.name = name
    config.model_transaction_policy.decoupled = decoupled
    hf = config.parameters["hf_model_dir"].string_value
    if not Path(hf).is_absolute():
        config.parameters["hf_model_dir"].string_value = str((source / hf).resolve())
    declared = {i.name for i in config.input}
    for input_name in GUIDED_DECODING_INPUTS:
        if input_name in declared:
            continue
        config.input.add(
            name=input_name, data_type=mc.TYPE_STRING, dims=[1], optional=True
        ).allow_ragged_batch = True
    if info is not None:
        config.parameters["guided_decoding_backend"].string_value = "xgrammar"
        config.parameters["xgrammar_tokenizer_info_path"].string_value = str(info)
    target.mkdir(exist_ok=True)
    (target / "config.pbtxt").write_text(text_format.MessageToString(config))


@pytest.fixture(scope="module")
def guided_repo(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = copy_repository(tiny.repo, tmp_path_factory.mktemp("guided"))
    source = repo / PLAIN
    info = repo / "tokenizer_info.json"
    write_tokenizer_info(tiny.tokenizer_dir / "tokenizer.json", [EOS], info)
    no_stop = repo / "tokenizer_info_no_stop.json"
    write_tokenizer_info(tiny.tokenizer_dir / "tokenizer.json", [], no_stop)
    _guided_config(source, repo / GUIDED, GUIDED, info)
    _guided_config(source, repo / NO_STOP, NO_STOP, no_stop)
    _guided_config(source, repo / SYNC, SYNC, info, decoupled=False)
    _guided_config(source, source, PLAIN, None)
    return repo


@pytest.fixture(scope="module")
async def served(guided_repo: Path) -> AsyncIterator[dict[str, EngineModel]]:
    models = load_repository(guided_repo)
    server, _, port = await start_engine(models, "127.0.0.1:0")
    models["_address"] = f"127.0.0.1:{port}"  # type: ignore[assignment]
    try:
        yield models
    finally:
        await server.stop(grace=None)
        for name, m in models.items():
            if not name.startswith("_"):
                m.runner.close()


@pytest.fixture
async def stub(served: dict[str, EngineModel]) -> AsyncIterator[ts_grpc.GRPCInferenceServiceStub]:
    async with grpc.aio.insecure_channel(str(served["_address"])) as channel:
        yield ts_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture(scope="module")
def tokenizer(tiny: Tiny) -> Tokenizer:
    return Tokenizer.from_file(str(tiny.tokenizer_dir / "tokenizer.json"))


def guided(
    kind: str | None,
    guide: str | None,
    *,
    model: str = GUIDED,
    request_id: str = "g",
    max_tokens: int = 200,
    seed: int | None = None,
    greedy: bool = False,
    end_id: int | None = EOS,
    streaming: bool = True,
    prompt: list[int] = PROMPT,
) -> ts.ModelInferRequest:
    req = request(
        request_id,
        prompt,
        max_tokens,
        model=model,
        end_id=end_id,
        seed=seed,
        top_k=1 if greedy else 0,
        top_p=None if greedy else 1.0,
        streaming=streaming,
    )
    for name, value in (("guided_decoding_guide_type", kind), ("guided_decoding_guide", guide)):
        if value is not None:
            req.inputs.add(name=name, datatype="BYTES", shape=[1, 1])
            data = value.encode("utf-8")
            req.raw_input_contents.append(struct.pack("<I", len(data)) + data)
    return req


async def generated(
    stub: ts_grpc.GRPCInferenceServiceStub, req: ts.ModelInferRequest
) -> tuple[list[int], int]:
    """The generated ids and how many responses came; fails on an error response."""
    responses = await collect(stub, req)
    assert all(not m.error_message for m in responses), responses[0].error_message
    assert is_final(responses[-1].infer_response)
    return [t for m in responses for t in tokens_of(m.infer_response)], len(responses)


async def refusal(stub: ts_grpc.GRPCInferenceServiceStub, req: ts.ModelInferRequest) -> str:
    responses = await collect(stub, req)
    assert len(responses) == 1, "a refused request must produce nothing else"
    message = responses[0].error_message
    assert isinstance(message, str) and message
    return message


async def test_every_sampled_output_validates_against_its_json_schema(
    stub: ts_grpc.GRPCInferenceServiceStub, tokenizer: Tokenizer
) -> None:
    for i, schema in enumerate(SCHEMAS):
        for seed in range(6):
            ids, _ = await generated(stub, guided("json_schema", json.dumps(schema), seed=seed))
            text = tokenizer.decode(ids)
            assert len(ids) < 200, f"schema {i} seed {seed}: never finished: {text!r}"
            jsonschema.validate(json.loads(text), schema)


async def test_a_repository_written_with_guided_decoding_serves_a_json_schema_guide(
    tiny: Tiny, tmp_path: Path, tokenizer: Tokenizer
) -> None:
    """What `engine-build repo` and the model makers write is what the engine server serves."""
    repo = write_hf_repository(tiny.model_dir, tmp_path / "repo", guided_decoding=True)
    models = load_repository(repo)
    assert models[PLAIN].grammars is not None
    server, _, port = await start_engine(models, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ts_grpc.GRPCInferenceServiceStub(channel)
            schema = SCHEMAS[1]
            for seed in range(3):
                ids, _ = await generated(
                    stub, guided("json_schema", json.dumps(schema), model=PLAIN, seed=seed)
                )
                jsonschema.validate(json.loads(tokenizer.decode(ids)), schema)
    finally:
        await server.stop(grace=None)
        for m in models.values():
            m.runner.close()


async def test_json_guide_yields_json_and_a_regex_guide_matches(
    stub: ts_grpc.GRPCInferenceServiceStub, tokenizer: Tokenizer
) -> None:
    pattern = r"[a-z]{2,6}@(example|test)\.(com|org) [0-9]{3}"
    for seed in range(5):
        ids, _ = await generated(stub, guided("regex", pattern, seed=seed))
        assert re.fullmatch(pattern, tokenizer.decode(ids)), tokenizer.decode(ids)
    ids, _ = await generated(
        stub, guided("ebnf_grammar", 'root ::= ("yes" | "no") " " [0-9]', seed=1)
    )
    assert re.fullmatch(r"(yes|no) [0-9]", tokenizer.decode(ids))
    # `json` is any JSON value: its guide text, if any, is ignored (as in the backend).
    ids, _ = await generated(stub, guided("json", "ignored", greedy=True, max_tokens=400))
    if len(ids) < 400:
        json.loads(tokenizer.decode(ids))


async def test_constrained_greedy_equals_unconstrained_greedy_when_that_satisfies_the_guide(
    stub: ts_grpc.GRPCInferenceServiceStub, served: dict[str, EngineModel]
) -> None:
    grammars = served[GUIDED].grammars
    assert grammars is not None
    # The text as the grammar sees it: each token's bytes. Random weights write byte tokens and
    # control characters too; the case wants a greedy output that is plain text, so take the
    # longest plain prefix of a prompt's greedy output.
    vocab = grammars.tokenizer.decoded_vocab
    for first in range(300, 600, 7):
        prompt = [1, first, first + 1, first + 2]
        free, _ = await generated(
            stub, guided(None, None, greedy=True, max_tokens=16, end_id=None, prompt=prompt)
        )
        n = next(
            n for n in range(len(free), -1, -1) if _plain(b"".join(vocab[t] for t in free[:n]))
        )
        if n >= 6:
            break
    else:
        pytest.fail("no prompt found whose greedy output starts with plain text")
    free = free[:n]
    text = b"".join(vocab[t] for t in free).decode()
    literal = json.dumps(text)  # an EBNF string literal with the same escapes
    constrained, _ = await generated(
        stub,
        guided(
            "ebnf_grammar",
            f"root ::= {literal}",
            greedy=True,
            max_tokens=n,
            end_id=None,
            prompt=prompt,
        ),
    )
    assert constrained == free
    # A looser guide that the same text satisfies changes nothing either.
    loose, _ = await generated(
        stub,
        guided("regex", r"[ -~]*", greedy=True, max_tokens=n, end_id=None, prompt=prompt),
    )
    assert loose == free


def _plain(text: bytes) -> bool:
    try:
        return all(" " <= c <= "~" for c in text.decode())
    except UnicodeDecodeError:
        return False


async def test_compiled_guides_are_cached(
    stub: ts_grpc.GRPCInferenceServiceStub, served: dict[str, EngineModel]
) -> None:
    grammars = served[GUIDED].grammars
    assert grammars is not None
    schema = json.dumps({"enum": ["cached", "once"]})
    compiles, hits = grammars.stats.compiles, grammars.stats.hits
    for seed in range(3):
        await generated(stub, guided("json_schema", schema, seed=seed))
    assert grammars.stats.compiles == compiles + 1
    assert grammars.stats.hits == hits + 2


async def test_engine_metrics_export_the_compiled_guide_cache(
    stub: ts_grpc.GRPCInferenceServiceStub, served: dict[str, EngineModel]
) -> None:
    models = {name: m for name, m in served.items() if not name.startswith("_")}
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(EngineService(models), models))

    def sample(name: str) -> float:
        value = registry.get_sample_value(name, {"model": GUIDED})
        assert value is not None, f"{name} is not exported for {GUIDED}"
        return value

    before = {
        n: sample(n)
        for n in (
            "appliance_engine_guided_compiles_total",
            "appliance_engine_guided_cache_hits_total",
            "appliance_engine_guided_compile_seconds_total",
        )
    }
    schema = json.dumps({"enum": ["metered", "twice"]})
    for seed in range(2):
        await generated(stub, guided("json_schema", schema, seed=seed))
    assert sample("appliance_engine_guided_compiles_total") == (
        before["appliance_engine_guided_compiles_total"] + 1
    )
    assert sample("appliance_engine_guided_cache_hits_total") == (
        before["appliance_engine_guided_cache_hits_total"] + 1
    )
    assert (
        sample("appliance_engine_guided_compile_seconds_total")
        > (before["appliance_engine_guided_compile_seconds_total"])
    )
    assert sample("appliance_engine_guided_matchers") == 0
    # A model without a guided decoder has no guided series.
    assert (
        registry.get_sample_value("appliance_engine_guided_compiles_total", {"model": PLAIN})
        is None
    )


async def test_a_grammar_with_no_token_left_ends_the_generation(
    stub: ts_grpc.GRPCInferenceServiceStub, tokenizer: Tokenizer
) -> None:
    # No end id and no stop tokens: once "ok" is written, no token is allowed.
    ids, count = await generated(
        stub, guided("regex", "ok", model=NO_STOP, end_id=None, max_tokens=50, seed=3)
    )
    assert tokenizer.decode(ids) == "ok"
    assert count == len(ids) + 1  # the final response carries no token


async def test_cancelling_a_guided_generation_leaves_no_grammar_state(
    stub: ts_grpc.GRPCInferenceServiceStub, served: dict[str, EngineModel]
) -> None:
    model = served[GUIDED]
    assert model.grammars is not None
    stats = model.runner.stats
    cancelled = stats.cancelled
    # Any JSON with whitespace allowed runs on; closing the stream cancels it.
    call = stub.ModelStreamInfer(
        _one(guided("json", None, request_id="c", max_tokens=1500, seed=7, end_id=None)),
        timeout=60,
    )
    first = await call.read()
    assert tokens_of(first.infer_response)
    assert model.grammars.active == 1
    call.cancel()
    await until_engine(stats, lambda: stats.cancelled > cancelled and stats.running is None)
    assert model.grammars.active == 0
    ids, _ = await generated(stub, guided("regex", "[0-9]{4}", seed=1))
    assert len(ids) >= 1 and model.grammars.active == 0


async def _one(req: ts.ModelInferRequest) -> AsyncIterator[ts.ModelInferRequest]:
    yield req
    await asyncio_forever()


async def asyncio_forever() -> None:
    import asyncio

    await asyncio.Event().wait()


BAD = [
    ("xml", "<a/>", "guided_decoding_guide_type 'xml' is not one of json, json_schema"),
    ("regex", None, "guided_decoding_guide is required for guide type 'regex'"),
    ("json_schema", "{", "the JSON Schema is not valid JSON"),
    ("json_schema", "[1, 2]", "the JSON Schema must be a JSON object or boolean, not list"),
    (
        "json_schema",
        '{"type": "foo"}',
        'the JSON Schema cannot be compiled: Unsupported type "foo"',
    ),
    ("regex", "a(b", "the regular expression cannot be compiled: Regex parsing error"),
    ("ebnf_grammar", "root ::= undefined", 'Rule "undefined" is not defined'),
    ("ebnf_grammar", "x" * (MAX_GUIDE_BYTES + 1), f"the limit is {MAX_GUIDE_BYTES} bytes"),
    ("json_schema", "[" * 5000 + "]" * 5000, "the JSON Schema is nested too deeply"),
]


@pytest.mark.parametrize(("kind", "guide", "says"), BAD)
async def test_a_bad_guide_is_refused_before_anything_runs(
    stub: ts_grpc.GRPCInferenceServiceStub,
    served: dict[str, EngineModel],
    kind: str,
    guide: str | None,
    says: str,
) -> None:
    stats = served[GUIDED].runner.stats
    started = stats.started
    message = await refusal(stub, guided(kind, guide))
    assert says in message
    assert "[" not in message.split(":", 1)[0], "no log prefix from the compiler"
    # Refused after Triton core issued the request: the backend's error response, INTERNAL.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, guided(kind, guide), metadata=(("triton_grpc_error", "true"),))
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert says in (err.value.details() or "")
    assert stats.started == started


# 450 nested objects: xgrammar's compile time grows with the cube of the depth (13 s at 400).
SLOW_SCHEMA = '{"type":"object","properties":{"a":' * 450 + '{"type":"integer"}' + "}}" * 450


def compile_processes() -> list[multiprocessing.process.BaseProcess]:
    return [p for p in multiprocessing.active_children() if p.name == guide_compile.PROCESS_NAME]


async def test_a_guide_past_its_compile_deadline_is_refused_and_its_compile_killed(
    stub: ts_grpc.GRPCInferenceServiceStub, served: dict[str, EngineModel]
) -> None:
    grammars = served[GUIDED].grammars
    assert grammars is not None
    stats = served[GUIDED].runner.stats
    started = stats.started
    grammars.deadline_s = 0.5
    try:
        message = await refusal(stub, guided("json_schema", SLOW_SCHEMA))
    finally:
        grammars.deadline_s = COMPILE_DEADLINE_S
    assert "the JSON Schema cannot be compiled within 0.5 s: make it smaller" in message
    assert compile_processes() == [], "the compile's process is killed at the deadline"
    assert stats.started == started
    # The server goes on compiling and serving guides.
    ids, _ = await generated(stub, guided("json_schema", json.dumps({"enum": ["after"]})))
    assert ids


def test_a_compile_past_its_memory_is_refused(served: dict[str, EngineModel]) -> None:
    grammars = served[GUIDED].grammars
    assert grammars is not None
    grammars.memory_bytes = 1 << 20
    try:
        with pytest.raises(GuideError, match="cannot be compiled within 1 MiB of memory"):
            grammars.compile(
                Guide("json_schema", '{"type": "array", "items": ' * 200 + "{}" + "}" * 200)
            )
    finally:
        grammars.memory_bytes = COMPILE_MEMORY_BYTES
    assert compile_processes() == []


def test_a_compile_waits_for_a_slot_no_longer_than_its_deadline(
    served: dict[str, EngineModel],
) -> None:
    grammars = served[GUIDED].grammars
    assert grammars is not None
    taken = 0
    while grammars.slots.acquire(blocking=False):
        taken += 1
    grammars.deadline_s = 0.01
    try:
        with pytest.raises(GuideBusy, match="other guides were being compiled"):
            grammars.compile(Guide("json_schema", '{"enum": ["busy"]}'))
    finally:
        grammars.deadline_s = COMPILE_DEADLINE_S
        for _ in range(taken):
            grammars.slots.release()
    assert taken == COMPILE_SLOTS
    assert grammars.compile(Guide("json_schema", '{"enum": ["busy"]}')) is not None


async def test_a_guide_that_crashes_the_compiler_is_refused_and_the_engine_lives_on(
    stub: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    """30,000 nested groups in a schema's pattern (60 KB) overflow xgrammar's stack: a segfault
    that took the whole engine down when it compiled in the engine's own process."""
    schema = json.dumps({"type": "string", "pattern": "(" * 30000 + "a" + ")" * 30000})
    message = await refusal(stub, guided("json_schema", schema))
    assert message.startswith("the JSON Schema cannot be compiled: its compiler ended"), message
    assert compile_processes() == []
    ids, _ = await generated(stub, guided("json_schema", json.dumps({"enum": ["alive"]})))
    assert ids


# Ambiguous: every mask costs more than the one before (on a 49k vocabulary 40 ms at the 200th
# token, 167 ms at the 800th: minutes of the compute thread for one answer).
AMBIGUOUS = "root ::= (a | b)*\na ::= [a-z]*\nb ::= [a-z]* [a-z]*"


async def test_a_generation_whose_masks_overrun_their_budget_ends_with_the_guides_error(
    stub: ts_grpc.GRPCInferenceServiceStub, served: dict[str, EngineModel]
) -> None:
    grammars = served[GUIDED].grammars
    assert grammars is not None
    stats = served[GUIDED].runner.stats
    failed = stats.failed
    grammars.mask_budget = (0.0, 0.0)  # any mask overruns it
    try:
        message = await refusal(stub, guided("ebnf_grammar", AMBIGUOUS))
    finally:
        grammars.mask_budget = MASK_BUDGET
    assert message.startswith("the guide's grammar took "), message
    assert "engine failure" not in message
    assert stats.failed == failed + 1
    assert grammars.active == 0
    ids, _ = await generated(stub, guided("ebnf_grammar", AMBIGUOUS, max_tokens=8))
    assert ids


async def test_a_guide_on_a_model_without_guided_decoding_is_refused_as_the_backend_does(
    stub: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    req = guided("json", None, model=PLAIN)
    message = await refusal(stub, req)
    assert "Request is specified with GuidedDecodingParams, but GuidedDecoder is not setup" in (
        message
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, req, metadata=(("triton_grpc_error", "true"),))
    assert err.value.code() == grpc.StatusCode.INTERNAL
    # Without a guide type the model generates as usual (a guide text alone is ignored); no end
    # id, so a sampled end token cannot cut the answer short.
    ids, _ = await generated(stub, guided(None, "ignored", model=PLAIN, max_tokens=4, end_id=None))
    assert len(ids) == 4


async def test_model_infer_and_non_streaming_requests_take_a_guide(
    stub: ts_grpc.GRPCInferenceServiceStub, tokenizer: Tokenizer
) -> None:
    def answer(ids: list[int]) -> str:
        return tokenizer.decode(ids[len(PROMPT) :] if ids[: len(PROMPT)] == PROMPT else ids)

    responses = await collect(stub, guided("regex", "[a-c]{5}", seed=2, streaming=False))
    assert len(responses) == 1
    assert re.fullmatch("[a-c]{5}", answer(tokens_of(responses[0].infer_response)))
    reply = await stub.ModelInfer(guided("regex", "[d-f]{4}", model=SYNC, streaming=False))
    assert re.fullmatch("[d-f]{4}", answer(tokens_of(reply)))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ModelInfer(guided("regex", "a(", model=SYNC, streaming=False))
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "the regular expression cannot be compiled" in (err.value.details() or "")


def test_tokenizer_info_file_has_the_fields_tensorrt_llm_reads(tiny: Tiny, tmp_path: Path) -> None:
    dest = tmp_path / "info.json"
    write_tokenizer_info(tiny.tokenizer_dir / "tokenizer.json", [EOS], dest)
    info = json.loads(dest.read_text())
    assert set(info) == {"encoded_vocab", "tokenizer_str", "stop_token_ids"}
    assert info["stop_token_ids"] == [EOS] and info["encoded_vocab"][EOS] == "</s>"
    assert json.loads(info["tokenizer_str"])["model"]["type"] == "BPE"


@pytest.mark.parametrize(
    ("backend", "info", "says"),
    [
        ("llguidance", "tokenizer_info.json", "supported with the 'xgrammar' backend"),
        ("xgrammar", "missing.json", "Xgrammar's tokenizer info path at"),
    ],
)
def test_a_guided_decoding_config_the_backend_would_not_load_is_refused(
    guided_repo: Path, tmp_path: Path, backend: str, info: str, says: str
) -> None:
    from appliance.engine.repository import RepositoryError, read_repository

    repo = tmp_path / "repo"
    repo.mkdir()
    _guided_config(guided_repo / PLAIN, repo / "m", "m", guided_repo / info)
    config = (repo / "m" / "config.pbtxt").read_text()
    (repo / "m" / "config.pbtxt").write_text(config.replace('"xgrammar"', f'"{backend}"'))
    with pytest.raises(RepositoryError, match=says):
        assert read_repository(repo)["m"].guided_decoding is None


def test_a_guided_repository_without_xgrammar_is_refused_at_load_saying_why(
    tiny: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from appliance.engine.guided import Grammars

    info = tmp_path / "info.json"
    write_tokenizer_info(tiny.tokenizer_dir / "tokenizer.json", [EOS], info)
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    with pytest.raises(ValueError, match=r"needs xgrammar: install the `guided` extra"):
        Grammars.load(info, 2048)


def test_a_guided_model_whose_compile_process_cannot_run_is_refused_at_load(
    tiny: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compile's child re-runs the engine's main script (multiprocessing's rule): one it
    cannot run would refuse every guide; the model load says so instead."""
    from appliance.engine.guided import Grammars

    info = tmp_path / "info.json"
    write_tokenizer_info(tiny.tokenizer_dir / "tokenizer.json", [EOS], info)

    def crashed(*_: object) -> None:
        raise guide_compile.CompileCrashed("1")

    monkeypatch.setattr(guide_compile, "compile_in_child", crashed)
    with pytest.raises(ValueError, match=r"guided decoding cannot compile a guide in a child"):
        Grammars.load(info, 2048)
