"""End to end over loopback with real processes: engine server process ← gateway process ← client."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from appliance.client import generate
from appliance.tools import processes
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Tiny
from tests.gateway.stack import engine_and_gateway

MODEL = "tiny"


@pytest.fixture(scope="module")
def gateway_address(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with engine_and_gateway(tiny, tmp_path_factory.mktemp("e2e")) as stack:
        yield stack.address


@pytest.fixture
async def stub(gateway_address: str) -> AsyncIterator[pb_grpc.InferenceStub]:
    async with grpc.aio.insecure_channel(gateway_address) as channel:
        yield pb_grpc.InferenceStub(channel)


def req(**fields: object) -> pb.GenerateRequest:
    fields.setdefault("model", MODEL)
    if "prompt" not in fields and "messages" not in fields:
        fields["prompt"] = "The gateway streams tokens"
    return pb.GenerateRequest(**fields)  # type: ignore[arg-type]


async def test_streamed_generation_shape(stub: pb_grpc.InferenceStub) -> None:
    result = await generate(stub, req(max_tokens=12, temperature=0, request_id="abc"))
    assert result.request_id == "abc"
    assert len(result.token_ids) == result.final.usage.completion_tokens
    assert result.final.usage.prompt_tokens > 0
    assert result.final.cache_tier == pb.CACHE_TIER_MISS
    t = result.final.timings
    assert 0 < t.queue_us <= t.ttft_us <= t.total_us
    if result.final.finish_reason == pb.FINISH_REASON_LENGTH:
        assert result.final.usage.completion_tokens == 12
    else:
        assert result.final.finish_reason == pb.FINISH_REASON_STOP


async def test_request_id_is_generated_when_empty(stub: pb_grpc.InferenceStub) -> None:
    result = await generate(stub, req(max_tokens=2))
    assert len(result.request_id) == 32


async def test_complete_equals_the_concatenated_stream(stub: pb_grpc.InferenceStub) -> None:
    r = req(max_tokens=16, temperature=0.9, seed=42)
    streamed = await generate(stub, r)
    whole = await stub.Complete(r, timeout=60)
    assert whole.text == streamed.text and list(whole.token_ids) == streamed.token_ids
    assert whole.final.finish_reason == streamed.final.finish_reason


async def test_chat_messages_use_the_template(stub: pb_grpc.InferenceStub) -> None:
    chat = pb.ChatMessages(
        messages=[
            pb.ChatMessage(role="system", content="Be brief."),
            pb.ChatMessage(role="user", content="Hello?"),
        ]
    )
    result = await generate(stub, req(messages=chat, max_tokens=4, temperature=0))
    assert result.final.usage.prompt_tokens > 5


async def test_stop_string_cuts_the_text(stub: pb_grpc.InferenceStub) -> None:
    base = await generate(stub, req(max_tokens=40, temperature=0, top_k=1))
    text = base.text
    stop = next(
        text[i : i + 3]
        for i in range(4, len(text) - 3)
        if text[i : i + 3].strip() and text.find(text[i : i + 3]) == i
    )
    cut = await generate(stub, req(max_tokens=40, temperature=0, stop=[stop]))
    assert cut.text == text[: text.index(stop)]
    assert cut.final.finish_reason == pb.FINISH_REASON_STOP


BAD = [
    (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    (dict(prompt="word " * 3000), grpc.StatusCode.INVALID_ARGUMENT, "accepts at most"),
    (dict(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1"),
    (dict(max_tokens=-4), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1"),
    (
        dict(max_tokens=100000),
        grpc.StatusCode.INVALID_ARGUMENT,
        "exceeds this model's limit of 512",
    ),
    (dict(temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0"),
    (dict(top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1]"),
    (dict(top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1]"),
    (dict(top_k=-1), grpc.StatusCode.INVALID_ARGUMENT, "top_k must be >= 0"),
    (dict(model="gpt-9"), grpc.StatusCode.NOT_FOUND, "unknown model 'gpt-9'; known models: tiny"),
    (
        dict(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="robot", content="hi")])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "messages[0].role is 'robot'; expected one of system, user, assistant",
    ),
    (dict(messages=pb.ChatMessages()), grpc.StatusCode.INVALID_ARGUMENT, "messages is empty"),
    # The engine computes logits / temperature: a tiny positive temperature overflows it.
    (dict(temperature=1e-45), grpc.StatusCode.INVALID_ARGUMENT, "temperature must be 0 (greedy)"),
    (dict(temperature=1e9), grpc.StatusCode.INVALID_ARGUMENT, "temperature must be 0 (greedy)"),
    (dict(temperature=2.5), grpc.StatusCode.INVALID_ARGUMENT, "between 0.01 and 2, got 2.5"),
    # The request id travels in headers and log lines: no control characters, spaces or non-ASCII.
    (dict(request_id="a\r\nb"), grpc.StatusCode.INVALID_ARGUMENT, "request_id must be 1 to 128"),
    (dict(request_id="a\x1b[31m"), grpc.StatusCode.INVALID_ARGUMENT, "request_id must be"),
    (dict(request_id="café"), grpc.StatusCode.INVALID_ARGUMENT, "request_id must be"),
    (dict(request_id="a b"), grpc.StatusCode.INVALID_ARGUMENT, "request_id must be"),
    (dict(request_id="r" * 129), grpc.StatusCode.INVALID_ARGUMENT, "request_id must be"),
    # The number of messages is bounded before any is read.
    (
        dict(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user")] * 2049)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "messages holds 2049 messages; at most 2048 are accepted",
    ),
    # So is the number of tool calls in the history, all messages together.
    (
        dict(
            messages=pb.ChatMessages(
                messages=[
                    pb.ChatMessage(role="user", content="go"),
                    pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(name="f")] * 2049),
                ]
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "messages hold 2049 tool calls; at most 2048 are accepted",
    ),
    (dict(cache_policy=99), grpc.StatusCode.INVALID_ARGUMENT, "cache_policy 99 is not one of"),
    (dict(cache_policy=-5), grpc.StatusCode.INVALID_ARGUMENT, "cache_policy -5 is not one of"),
    # An 8 KB model name is echoed shortened: the status stays NOT_FOUND, never a too-large error.
    (dict(model="m" * 8192), grpc.StatusCode.NOT_FOUND, "(8192 characters); known models: tiny"),
    # Megabytes of text are refused by their length, before the tokenizer runs.
    (dict(prompt="x" * 3_000_000), grpc.StatusCode.INVALID_ARGUMENT, "prompt is 3000000 char"),
    (
        dict(
            messages=pb.ChatMessages(
                messages=[pb.ChatMessage(role="user", content="x" * 3_000_000)]
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "the messages are 3000000 characters, more than fit",
    ),
]


@pytest.mark.parametrize(("fields", "code", "message"), BAD)
@pytest.mark.parametrize("rpc", ["Generate", "Complete"])
async def test_bad_input_gets_a_clear_status(
    stub: pb_grpc.InferenceStub,
    rpc: str,
    fields: dict[str, Any],
    code: grpc.StatusCode,
    message: str,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        if rpc == "Generate":
            await generate(stub, req(**fields))
        else:
            await stub.Complete(req(**fields), timeout=30)
    assert err.value.code() == code
    assert message in (err.value.details() or "")


async def test_client_deadline_is_honoured(stub: pb_grpc.InferenceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(stub, req(max_tokens=500), timeout=0.05)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_reflection_answers_under_its_v1_name_too(gateway_address: str) -> None:
    """grpc.reflection.v1 carries v1alpha's messages under a new package name."""
    with grpc.insecure_channel(gateway_address) as channel:
        for package in ("v1", "v1alpha"):
            info = channel.stream_stream(
                f"/grpc.reflection.{package}.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            replies = list(info(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
            names = {s.name for s in replies[0].list_services_response.service}
            assert "appliance.v1.Inference" in names, package


def test_health_and_reflection(gateway_address: str) -> None:
    with grpc.insecure_channel(gateway_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "appliance.v1.Inference"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(channel)
        assert "appliance.v1.Inference" in db.get_services()
        service = descriptor_pool.DescriptorPool(db).FindServiceByName("appliance.v1.Inference")
        assert {m.name for m in service.methods} == {"Generate", "Complete"}


def serve_to_exit(config: Path) -> subprocess.CompletedProcess[str]:
    """`appliance serve` on `config`, to its exit (a start-up that fails)."""
    return subprocess.run(
        [sys.executable, "-m", "appliance", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_engine_unreachable_at_start_up_exits_with_one_line(tiny: Tiny, tmp_path: Path) -> None:
    dead = f"127.0.0.1:{processes.free_port()}"
    config = processes.write_gateway_config(
        tmp_path / "g.toml",
        f"127.0.0.1:{processes.free_port()}",
        MODEL,
        dead,
        tiny.tokenizer_dir,
        1.0,
    )
    done = serve_to_exit(config)
    assert done.returncode == 1  # failed at run time: the configuration is fine
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(
        f"appliance serve: model '{MODEL}': inference server at {dead} not ready"
    )


def test_malformed_config_names_line_and_key(tmp_path: Path) -> None:
    config = tmp_path / "g.toml"
    config.write_text(
        '[server]\nlisten = "127.0.0.1:1"\n\n[models.x]\ntokenizer_dir = "t"\nbackend = 12\n'
    )
    done = serve_to_exit(config)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"appliance serve: {config}:6: key 'models.x.backend': expected str, got int 12"
    )


def cache_cli(gateway_address: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "appliance", "cache", "--gateway", gateway_address, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_cache_cli_stats_and_invalidate(
    stub: pb_grpc.InferenceStub, gateway_address: str
) -> None:
    r = req(prompt="cached by the cli test", max_tokens=4, temperature=0, namespace="cli")
    await stub.Complete(r)
    assert (await stub.Complete(r)).final.cache_tier == pb.CACHE_TIER_EXACT_L1
    stats = cache_cli(gateway_address, "stats")
    counters = dict(line.split() for line in stats.stdout.splitlines())
    assert stats.returncode == 0 and int(counters["l1_hits"]) >= 1
    done = cache_cli(gateway_address, "invalidate", "--namespace", "cli")
    assert done.returncode == 0
    assert done.stdout.strip() == (
        "removed 1 from L1, 0 from Redis, 0 from the semantic index (this gateway's counts; "
        "every gateway on the same Redis drops the same)"
    )
    assert (await stub.Complete(r)).final.cache_tier == pb.CACHE_TIER_MISS


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (
            ["--namespace", "cli", "--entry", "abc"],
            "entry must be a cache key of 32 hex digits (an answer's cache_entry), got 'abc'",
        ),
        (
            ["--model", "tiny", "--entry", "ab" * 16],
            "entry needs the namespace of the request it answered",
        ),
        (["--all", "--entry", "ab" * 16], "entry names one answer: give it without all=true"),
    ],
)
def test_cache_cli_refuses_an_entry_named_wrongly(
    gateway_address: str, args: list[str], why: str
) -> None:
    done = cache_cli(gateway_address, "invalidate", *args)
    assert done.returncode == 1
    assert done.stderr.strip() == f"appliance cache: INVALID_ARGUMENT: {why}"


def test_cache_cli_refuses_an_unscoped_invalidation(gateway_address: str) -> None:
    done = cache_cli(gateway_address, "invalidate")
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "appliance cache: INVALID_ARGUMENT: name a namespace, a model or both; "
        "set all=true to drop every cached answer"
    )
