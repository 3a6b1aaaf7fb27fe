"""Shared fixtures: the tiny model, an in-process engine server on loopback, Triton stubs, and the
semantic tier's embedder (exported once per session).

The engine server runs in the test's own event loop (real gRPC over 127.0.0.1) where a test asserts on
its internal state (cancellation); end-to-end tests start real processes instead (tests/gateway).

torch and the engine server are imported inside the fixtures, never at module level: a suite that
uses none of them (engine_build, host_tuning, the gateway's unit tests) never loads torch.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2_grpc as ts_grpc

if TYPE_CHECKING:
    from appliance.engine.runner import EngineStats
    from appliance.engine.server import EngineModel, EngineService
    from tests.cache.redis_server import RedisServer


def _xdist_scope(nodeid: str) -> str:
    return "system" if nodeid.startswith("tests/system/") else "rest"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`pytest -n 2` (make test): the system tests, which boot containers and drive them with
    ansible-playbook (about half the suite's time, one core's worth), run in their written order on
    one worker, and everything else in its order on the other: two scopes of xdist's scope
    scheduling. Its `xdist_group` marks are not used: they group by renaming a test's id, which
    pytest 9.2 no longer allows."""
    from xdist.scheduler import LoadScopeScheduling

    scheduler = LoadScopeScheduling(config, log)
    scheduler._split_scope = _xdist_scope
    return scheduler


def _one_torch_thread() -> None:
    import torch

    torch.set_num_threads(1)


@dataclass(frozen=True)
class Tiny:
    model_dir: Path
    repo: Path

    @property
    def tokenizer_dir(self) -> Path:
        return self.repo / "tensorrt_llm" / "tokenizer"


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    from appliance.tools.tiny_model import ensure_tiny_model

    _one_torch_thread()
    model_dir, repo = ensure_tiny_model(tmp_path_factory.mktemp("tiny"))
    return Tiny(model_dir, repo)


def add_model_variant(repo: Path, name: str, edit: dict[str, object]) -> None:
    """Copies the tensorrt_llm model under another name with config fields changed."""
    source = repo / "tensorrt_llm"
    target = repo / name
    shutil.copytree(source, target, dirs_exist_ok=True)
    config = text_format.Parse((source / "config.pbtxt").read_text(), mc.ModelConfig())
    config.name = name
    hf = config.parameters["hf_model_dir"].string_value
    if not Path(hf).is_absolute():
        config.parameters["hf_model_dir"].string_value = str((source / hf).resolve())
    for key, value in edit.items():
        if key == "decoupled":
            config.model_transaction_policy.decoupled = bool(value)
        elif key == "rename_inputs":
            assert isinstance(value, dict)
            for i in config.input:
                i.name = value.get(i.name, i.name)
    (target / "config.pbtxt").write_text(text_format.MessageToString(config))


def copy_repository(source: Path, dest: Path) -> Path:
    """A copy of a model repository that still finds its checkpoint (one engine server may serve
    a repository at a time, so a test running several needs several)."""
    shutil.copytree(source, dest, dirs_exist_ok=True)
    config = dest / "tensorrt_llm" / "config.pbtxt"
    parsed = text_format.Parse(config.read_text(), mc.ModelConfig())
    hf = Path(parsed.parameters["hf_model_dir"].string_value)
    if not hf.is_absolute():
        parsed.parameters["hf_model_dir"].string_value = str(
            (source / "tensorrt_llm" / hf).resolve()
        )
        config.write_text(text_format.MessageToString(parsed))
    return dest


@pytest.fixture(scope="session")
def engine_repo(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny repository plus a non-decoupled model and one with the pre-1.0 input names."""
    repo = copy_repository(tiny.repo, tmp_path_factory.mktemp("repo"))
    add_model_variant(repo, "sync_llm", {"decoupled": False})
    add_model_variant(
        repo,
        "legacy_names_llm",
        {"rename_inputs": {"seed": "random_seed", "min_tokens": "min_length"}},
    )
    return repo


@dataclass
class Engine:
    address: str
    service: EngineService
    models: dict[str, EngineModel]
    server: grpc.aio.Server
    # The same service's stream socket (None where a test's own engine serves none).
    stream_socket: Path | None = None

    def stats(self, model: str = "tensorrt_llm") -> EngineStats:
        return self.models[model].runner.stats


@pytest.fixture(scope="session")
async def engine(
    engine_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Engine]:
    from appliance.engine.server import load_repository, start_engine, stop_engine

    _one_torch_thread()
    models = load_repository(engine_repo)
    socket = tmp_path_factory.mktemp("engine") / "s.sock"
    server, service, port = await start_engine(models, "127.0.0.1:0", socket)
    yield Engine(f"127.0.0.1:{port}", service, models, server, socket)
    await stop_engine(server, service, 0.0)
    for m in models.values():
        m.runner.close()


async def engine_to_stop(engine_repo: Path) -> tuple[str, Callable[[], Awaitable[None]]]:
    """A private engine server's address and a function that stops it (an engine that dies)."""
    from appliance.engine.server import load_repository, start_engine

    models = load_repository(engine_repo)
    server, _, port = await start_engine({"tensorrt_llm": models["tensorrt_llm"]}, "127.0.0.1:0")

    async def stop() -> None:
        await server.stop(grace=None)
        models["tensorrt_llm"].runner.close()

    return f"127.0.0.1:{port}", stop


@pytest.fixture
async def triton(engine: Engine) -> AsyncIterator[ts_grpc.GRPCInferenceServiceStub]:
    async with grpc.aio.insecure_channel(engine.address) as channel:
        yield ts_grpc.GRPCInferenceServiceStub(channel)


# The semantic tier's embedder, exported once per session by `appliance semantic-setup` itself.
@pytest.fixture(scope="session")
def semantic_setup(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The exported directory and the command's run (its output is checked by a test)."""
    dest = tmp_path_factory.mktemp("embedder")
    run = subprocess.run(
        [sys.executable, "-m", "appliance", "semantic-setup", "--dest", str(dest)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    return dest, run


@pytest.fixture(scope="session")
def embedder_dir(semantic_setup: tuple[Path, subprocess.CompletedProcess[str]]) -> Path:
    return semantic_setup[0]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, one per test module (tests flush it)."""
    from tests.cache.redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.kill()
