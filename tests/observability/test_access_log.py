"""The access log as an operator reads it: one line per request, text or JSON, whatever a hostile
client puts in the values it chooses, with the JSON fields the README lists."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from appliance.config import ServerConfig
from appliance.gateway.models import load_models
from appliance.gateway.server import RunningGateway, start_server
from appliance.logline import FORMAT, JsonFormatter, OneLineFormatter
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Engine, Tiny
from tests.support import gateway_config

README = Path(__file__).resolve().parents[2] / "README.md"
# Characters that end a line for some reader of the log, or drive a terminal: NEL (a line break to
# Python's str.splitlines), CSI (a terminal's ESC [), the line and paragraph separators, DEL, ESC.
HOSTILE = "ns\x85FORGED \x9b31m\u2028\u2029\x7f\x1b[2J"


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def access() -> Iterator[Records]:
    logger = logging.getLogger("appliance.access")
    records, level = Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(records)
    logger.setLevel(level)


@pytest.fixture
async def gateway(tiny: Tiny, engine: Engine) -> AsyncIterator[RunningGateway]:
    config = gateway_config(
        tiny.tokenizer_dir,
        engine.address,
        server=ServerConfig(listen="127.0.0.1:0", access_log=True),
    )
    running = await start_server(config, await load_models(config))
    yield running
    await running.drain(0.5)


async def test_a_hostile_namespace_is_one_line_in_either_format(
    gateway: RunningGateway, access: Records
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # no namespace may hold them
            await pb_grpc.InferenceStub(channel).Complete(
                pb.GenerateRequest(model="tiny", prompt="hi", max_tokens=1, namespace=HOSTILE)
            )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (record,) = access.records
    for formatter in (JsonFormatter(), OneLineFormatter(FORMAT)):
        line = formatter.format(record)
        assert line.splitlines() == [line], line
        assert line.isprintable(), ascii(line)
    fields = json.loads(JsonFormatter().format(record))
    assert fields["namespace"] == HOSTILE and fields["status"] == "INVALID_ARGUMENT"


async def test_the_json_fields_are_the_ones_the_readme_lists(
    gateway: RunningGateway, access: Records
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        await pb_grpc.InferenceStub(channel).Complete(
            pb.GenerateRequest(model="tiny", prompt="hi", max_tokens=2, temperature=0)
        )
    (record,) = access.records
    fields = set(json.loads(JsonFormatter().format(record)))
    logs = README.read_text().split("- **Logs**:", 1)[1].split("\n- **", 1)[0]
    listed = re.search(r"JSON object a line with the fields (.*?)[;.]\s", logs, re.S)
    assert listed is not None, "the README's Logs paragraph lists the JSON fields"
    assert fields == set(re.findall(r"`([a-z_]+)`", listed.group(1)))


async def test_an_unknown_model_is_a_fixed_marker_not_the_clients_bytes(
    gateway: RunningGateway, access: Records
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pb_grpc.InferenceStub(channel).Complete(
                pb.GenerateRequest(model="no-such-model", prompt="hi", max_tokens=1)
            )
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    (record,) = access.records
    line = OneLineFormatter(FORMAT).format(record)
    assert "model='unknown'" in line and "no-such-model" not in line, line
    assert json.loads(JsonFormatter().format(record))["model"] == "unknown"


async def test_a_deadline_exceeded_line_says_whose_deadline_passed(
    tiny: Tiny, engine: Engine, access: Records
) -> None:
    """As the metrics' `deadline` label: `client` or `model` on DEADLINE_EXCEEDED only, in the
    text line and in the JSON one alike."""
    config = gateway_config(
        tiny.tokenizer_dir,
        engine.address,
        server=ServerConfig(listen="127.0.0.1:0", access_log=True),
        default_deadline_s=0.001,
    )
    running = await start_server(config, await load_models(config))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:  # no client deadline: the model's
                await stub.Complete(pb.GenerateRequest(model="tiny", prompt="hi", max_tokens=1500))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # The client's own deadline, long enough: answered, no deadline on the line.
            await stub.Complete(
                pb.GenerateRequest(model="tiny", prompt="hi", max_tokens=1), timeout=30
            )
    finally:
        await running.drain(0.5)
    exceeded, answered = access.records
    text = OneLineFormatter(FORMAT).format(exceeded)
    assert "status=DEADLINE_EXCEEDED" in text and text.endswith(" deadline=model"), text
    assert json.loads(JsonFormatter().format(exceeded))["deadline"] == "model"
    text = OneLineFormatter(FORMAT).format(answered)
    assert "status=OK" in text and "deadline=" not in text, text
    assert json.loads(JsonFormatter().format(answered))["deadline"] == ""
