"""The gateway as a hostile client and a careless operator meet it: bodies that do not decode, values
that try to forge log lines, a second server on a port already taken."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from appliance import logline
from appliance.config import GatewayConfig, ServerConfig
from appliance.engine.repository import RepositoryError
from appliance.engine.server import start_engine
from appliance.gateway.http_api import WithoutRequestBytes
from appliance.gateway.models import StartupError
from appliance.gateway.server import start_server
from appliance.logline import OneLineFormatter, Throttled
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Engine, Tiny, copy_repository
from tests.gateway.stack import MODEL, Stack, engine_and_gateway


def _debug(config: str) -> str:
    return config.replace("[server]\n", '[server]\nlog_level = "debug"\n')


@pytest.fixture(scope="module")
def gateway(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Engine server and gateway processes; the gateway logs at debug (every request a line)."""
    with engine_and_gateway(tiny, tmp_path_factory.mktemp("hostile"), _debug) as stack:
        yield stack


GARBAGE = [b"\xff", b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x0a\x02\xff\xfe", bytes(range(256))]
METHODS = [
    ("/appliance.v1.Inference/Generate", pb.GenerateRequest),
    ("/appliance.v1.Inference/Complete", pb.GenerateRequest),
    ("/appliance.v1.CacheAdmin/Invalidate", pb.InvalidateRequest),
    ("/appliance.v1.CacheAdmin/Stats", pb.CacheStatsRequest),
    ("/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest),
    ("/grpc.health.v1.Health/Watch", health_pb2.HealthCheckRequest),
    (
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        reflection_pb2.ServerReflectionRequest,
    ),
]


def _undecodable(body: bytes, message: type[Message]) -> bool:
    try:
        message.FromString(body)
    except DecodeError:
        return True
    return False


def _send_raw(channel: grpc.Channel, method: str, body: bytes) -> grpc.RpcError:
    """The body as it is (no serializer), through a generic method; the error it ends with."""
    try:
        if method.endswith("/ServerReflectionInfo"):
            for _ in channel.stream_stream(method)(iter([body]), timeout=30):
                pass
        elif method.endswith(("/Generate", "/Watch")):
            for _ in channel.unary_stream(method)(body, timeout=30):
                pass
        else:
            channel.unary_unary(method)(body, timeout=30)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError(f"{method} accepted {body!r}")


def test_undecodable_bodies_are_invalid_argument_and_logged_once(gateway: Stack) -> None:
    started = time.monotonic()
    with grpc.insecure_channel(gateway.address) as channel:
        for method, message in METHODS:
            expected = message.DESCRIPTOR.full_name
            bodies = [body for body in GARBAGE if _undecodable(body, message)]
            assert len(bodies) >= 3
            for body in bodies * 10:
                err = _send_raw(channel, method, body)
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.details())
                assert err.details() == (
                    f"the request body ({len(body)} bytes) is not a valid {expected}: encode "
                    "it with the service's proto (server reflection serves it)"
                )
        # The gateway still answers, and no decoded request was harmed.
        reply = pb_grpc.InferenceStub(channel).Complete(
            pb.GenerateRequest(
                model=MODEL, prompt="still here", max_tokens=2, request_id="still-here"
            ),
            timeout=60,
        )
        assert reply.final.usage.completion_tokens > 0
    elapsed = time.monotonic() - started
    lines = gateway.log_through("still-here")
    assert not [line for line in lines if " ERROR " in line or line.startswith("Traceback")]
    refusals = [line for line in lines if "refused an undecodable body" in line]
    # One line per 10 s interval at most (the run is usually well inside the first).
    assert 1 <= len(refusals) <= 1 + int(elapsed // 10), refusals


def test_client_values_never_start_a_log_line(gateway: Stack) -> None:
    forged = "x\nFORGED line\r\x1b[2K"
    with grpc.insecure_channel(gateway.address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role=forged, content=forged)])
        for fields in (
            dict(prompt=forged, request_id=forged, namespace="n\nFORGED", max_tokens=2),
            dict(prompt="p", model=forged, max_tokens=2),
            dict(messages=chat, request_id=forged, max_tokens=2),
            dict(prompt="p", request_id=forged, max_tokens=0),
        ):
            fields.setdefault("model", MODEL)
            with contextlib.suppress(grpc.RpcError):
                stub.Complete(pb.GenerateRequest(**fields), timeout=60)  # type: ignore[arg-type]
        admin = pb_grpc.CacheAdminStub(channel)
        with contextlib.suppress(grpc.RpcError):  # a namespace with a line break is refused
            admin.Invalidate(pb.InvalidateRequest(namespace="n\nFORGED", model=forged), timeout=30)
        admin.Invalidate(pb.InvalidateRequest(namespace="n", model=forged), timeout=30)
        last = pb.GenerateRequest(model=MODEL, prompt="p", max_tokens=2, request_id="last")
        stub.Complete(last, timeout=60)
    lines = gateway.log_through("last")
    assert any("x\\nFORGED" in line for line in lines)  # the debug request line was written
    assert not [line for line in lines if line.startswith("FORGED") or "\x1b" in line]


def test_a_refused_long_name_is_not_written_whole_to_any_log(gateway: Stack) -> None:
    long = "n" * 100_000
    with grpc.insecure_channel(gateway.address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Complete(pb.GenerateRequest(model=MODEL, prompt="p", namespace=long), timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == "namespace is longer than 64 characters"
        unprintable = "namespace holds a control or other unprintable character"
        for name in ("tenant\n", "a\x1b[2Kb", "zero\u200bwidth", "\x7f"):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Complete(pb.GenerateRequest(model=MODEL, prompt="p", namespace=name))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details() == unprintable
        admin = pb_grpc.CacheAdminStub(channel)
        for names, why in (
            (dict(namespace=long), "namespace is longer than 64 characters"),
            (dict(namespace="tenant\tb"), unprintable),
            (dict(model=long), "model is longer than 256 characters"),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                admin.Invalidate(pb.InvalidateRequest(**names), timeout=30)  # type: ignore[arg-type]
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details() == why
        last = pb.GenerateRequest(model=MODEL, prompt="p", max_tokens=2, request_id="after-long")
        stub.Complete(last, timeout=60)
    lines = gateway.log_through("after-long")
    assert max(len(line) for line in lines) < 2_000


def _record(message: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("appliance", logging.ERROR, __file__, 1, message, args, info)


def test_a_record_is_one_line_and_a_traceback_is_indented() -> None:
    formatter = OneLineFormatter(logline.FORMAT)
    try:
        raise ValueError("bad value\nFORGED by the exception's message")
    except ValueError as exc:
        caught = exc
    text = formatter.format(_record("request %s \u2028 %r", "x\nFORGED\r", "y\nz", exc=caught))
    first, *rest = text.split("\n")
    assert "request x\\nFORGED\\r \\u2028 'y\\nz'" in first
    assert rest and all(line.startswith("    ") for line in rest)
    assert "    ValueError: bad value" in rest


def test_a_flood_of_one_warning_is_one_line_per_interval(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    throttled = Throttled(logging.getLogger("appliance.test"), interval_s=10.0)
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])  # logline calls time.monotonic()
    with caplog.at_level(logging.WARNING):
        for i in range(100):
            throttled.warning("bad body %d", i)
        now[0] += 10.0
        throttled.warning("bad body %d", 100)
    assert [r.getMessage() for r in caplog.records] == [
        "bad body 0",
        "bad body 100 (99 more since the last such line, not logged)",
    ]


def test_an_http_server_error_line_holds_neither_its_arguments_nor_placeholders(
    caplog: pytest.LogCaptureFixture,
) -> None:
    record = logging.LogRecord(
        "aiohttp.server", logging.ERROR, __file__, 1, "Error handling request from %s",
        ("203.0.113.9 GET /secret-path",), None,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING):
        assert not WithoutRequestBytes().filter(record)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        "HTTP request refused by the HTTP server (Error handling request: no exception); its "
        "bytes are not logged"
    )


def test_a_second_gateway_on_a_taken_port_exits_with_one_line(
    gateway: Stack, tmp_path: Path
) -> None:
    second = tmp_path / "second.toml"
    second.write_text(gateway.config.read_text().replace('log_level = "debug"\n', ""))
    done = subprocess.run(
        [sys.executable, "-m", "appliance", "serve", "--config", str(second)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # Non-zero: which status a run-time start-up failure gets is the CLI convention's business.
    assert done.returncode != 0
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert lines == [f"appliance serve: cannot listen on {gateway.address}: Address already in use"]


async def test_a_gateway_refuses_a_port_another_server_holds(engine: Engine) -> None:
    config = GatewayConfig(server=ServerConfig(listen=engine.address))
    with pytest.raises(StartupError, match=re.escape(f"cannot listen on {engine.address}: ")):
        await start_server(config, {})


async def test_a_second_engine_server_on_a_taken_port_is_refused(engine: Engine) -> None:
    with pytest.raises(RepositoryError, match=re.escape(f"cannot listen on {engine.address}")):
        await start_engine({}, engine.address)


async def test_an_engine_cli_on_a_taken_port_exits_with_one_line_before_loading(
    engine: Engine, tiny: Tiny, tmp_path: Path
) -> None:
    repo = copy_repository(tiny.repo, tmp_path)  # a repository no running server holds
    command = ["engine", "--repository", str(repo), "--listen", engine.address]
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "appliance", *command],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert lines == [f"appliance engine: cannot listen on {engine.address}: Address already in use"]


def test_health_watch_still_streams(gateway: Stack) -> None:
    with grpc.insecure_channel(gateway.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="appliance.v1.Inference"), timeout=30
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


def test_json_log_lines_are_one_object_each_with_the_access_fields() -> None:
    import io
    import json
    import logging

    from appliance import logline
    from appliance.gateway.report import AccessLog, RequestReport

    root = logging.getLogger()
    saved = [(h, h.formatter) for h in root.handlers], root.level
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root.addHandler(handler)
    try:
        logline.configure("info", "json")
        AccessLog().report(RequestReport(request_id="x\nFORGED", model="tiny", ttft_us=1500))
    finally:
        root.removeHandler(handler)
        for h, f in saved[0]:
            h.setFormatter(f)
        root.setLevel(saved[1])
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["logger"] == "appliance.access" and record["level"] == "info"
    assert record["request_id"] == "x\nFORGED" and record["ttft_us"] == 1500
    assert record["time"].endswith("Z")


def test_the_command_lines_log_level_wins_over_the_files(tiny: Tiny, tmp_path: Path) -> None:
    """The file says error; `--log-level info` still shows the start-up's progress line."""
    import subprocess
    import sys

    from appliance.tools import processes

    config = processes.write_gateway_config(
        tmp_path / "g.toml",
        f"127.0.0.1:{processes.free_port()}",
        "tiny",
        f"127.0.0.1:{processes.free_port()}",  # nothing listens: start-up waits, then gives up
        tiny.tokenizer_dir,
        ready_timeout_s=6.0,
    )
    config.write_text(config.read_text().replace("[server]\n", '[server]\nlog_level = "error"\n'))
    runs = {
        flag: subprocess.Popen(
            [sys.executable, "-m", "appliance", *flag, "serve", "--config", str(config)],
            stderr=subprocess.PIPE,
            text=True,
        )
        for flag in ((), ("--log-level", "info"))
    }
    out = {flag: p.communicate(timeout=60)[1] for flag, p in runs.items()}
    assert "waiting for model" not in out[()]
    assert "waiting for model" in out[("--log-level", "info")]


@pytest.mark.parametrize("listener", ["metrics", "http"])
async def test_a_gateway_port_in_use_is_said_before_the_models_load(
    engine: Engine, tmp_path: Path, listener: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The metrics and HTTP listen addresses are probed with the gRPC one, before the models
    load (here a tokenizer directory that is not there would be named if they did)."""
    from appliance.config import HttpConfig, MetricsConfig
    from appliance.gateway.server import serve
    from tests.support import gateway_config

    taken = engine.address  # a port another server holds
    config = gateway_config(
        tmp_path / "no-tokenizer",
        engine.address,
        metrics=MetricsConfig(listen=taken if listener == "metrics" else None),
        http=HttpConfig(listen=taken if listener == "http" else None),
    )
    assert await serve(config) != 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"appliance serve: cannot listen on {taken}: Address already in use"
    )
