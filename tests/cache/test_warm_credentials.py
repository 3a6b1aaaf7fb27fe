"""`appliance cache warm` presents the credentials given to `appliance cache`: the API key of
--api-key-file or $APPLIANCE_API_KEY with every request."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from appliance.cli import main
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc

KEY = "ak_0123456789ab_" + "s" * 43


class KeyedGateway(pb_grpc.InferenceServicer):  # type: ignore[misc]
    """Refuses a request without KEY; with it, says nothing is cached, then caches the answer."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def Complete(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> pb.GenerateResponse:
        key = dict(context.invocation_metadata()).get("authorization", "")
        self.keys.append(key)
        if key != f"Bearer {KEY}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "an API key is required")
        if request.cache_policy == pb.CACHE_POLICY_ONLY:
            context.abort(grpc.StatusCode.NOT_FOUND, "not cached")
        return pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_STOP))


@pytest.fixture
def keyed() -> Iterator[tuple[str, KeyedGateway]]:
    fake = KeyedGateway()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_InferenceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", fake
    finally:
        server.stop(grace=None)


def test_warm_presents_the_api_key_file(
    keyed: tuple[str, KeyedGateway], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address, fake = keyed
    key_file, prompts = tmp_path / "key", tmp_path / "prompts.txt"
    key_file.write_text(KEY + "\n")
    prompts.write_text("What is the capital of France?\nHow do I reset my password?\n")
    code = main(
        ["cache", "--gateway", address, "--api-key-file", str(key_file), "warm",
         "--prompts", str(prompts), "--model", "tiny"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.splitlines()[-1].startswith("2/2: 2 warmed, 0 already cached, 0 failed"), out
    assert fake.keys == [f"Bearer {KEY}"] * 4


def test_warm_refuses_a_key_file_that_holds_no_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_file, prompts = tmp_path / "key", tmp_path / "prompts.txt"
    key_file.write_text("not a key\n")
    prompts.write_text("Hi\n")
    code = main(
        ["cache", "--gateway", "127.0.0.1:1", "--api-key-file", str(key_file), "warm",
         "--prompts", str(prompts), "--model", "tiny"]
    )  # fmt: skip
    _, err = capsys.readouterr()
    assert code == 2
    assert err.startswith(f"appliance cache warm: --api-key-file {key_file}"), err
    assert len(err.splitlines()) == 1


def test_a_refused_key_stops_the_warm_up_at_the_first_question(
    keyed: tuple[str, KeyedGateway],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    address, fake = keyed
    monkeypatch.delenv("APPLIANCE_API_KEY", raising=False)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\nthree\n")
    code = main(["cache", "--gateway", address, "warm", "--prompts", str(prompts), "--model", "m"])
    out, err = capsys.readouterr()
    assert code == 1
    assert len(fake.keys) == 1
    assert err.splitlines() == [
        f"appliance cache warm: {address}: UNAUTHENTICATED: an API key is required (the key, "
        "from --api-key-file or $APPLIANCE_API_KEY, needs the scopes generate and "
        "cache:read-only-policy); run again to go on"
    ]
    assert out.startswith("0/3: 0 warmed")
