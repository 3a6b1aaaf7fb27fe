"""`appliance health` against a gateway that serves TLS: it connects with --ca-file (and the client
certificate of --cert-file/--key-file under mutual TLS), as `appliance cache` and `bench` do."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from appliance.cli import main
from tests.security.certs import CA


@pytest.fixture
def tls_health(tmp_path: Path) -> Iterator[tuple[str, CA]]:
    ca = CA(tmp_path, "test-ca")
    server = ca.issue("server", "gateway")
    grpc_server = grpc.server(ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), grpc_server)
    credentials = grpc.ssl_server_credentials([(server.key_pem, server.cert_pem)])
    port = grpc_server.add_secure_port("127.0.0.1:0", credentials)
    grpc_server.start()
    try:
        yield f"localhost:{port}", ca
    finally:
        grpc_server.stop(grace=None)


def test_health_of_a_tls_gateway(
    tls_health: tuple[str, CA], capsys: pytest.CaptureFixture[str]
) -> None:
    address, ca = tls_health
    code = main(["health", "--gateway", address, "--ca-file", str(ca.path), "--service", ""])
    out, err = capsys.readouterr()
    assert (code, out) == (0, "SERVING\n"), err


def test_a_tls_option_without_the_ca_file_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["health", "--server-name", "gateway"])
    _, err = capsys.readouterr()
    assert code == 2
    assert err == (
        "appliance health: --server-name: a TLS option; give --ca-file too (connect with TLS)\n"
    )


def test_health_reads_no_api_key(
    tls_health: tuple[str, CA],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A health check needs no key: a stale value in $APPLIANCE_API_KEY changes nothing, and
    there is no --api-key-file to give."""
    address, ca = tls_health
    monkeypatch.setenv("APPLIANCE_API_KEY", "not a key")
    code = main(["health", "--gateway", address, "--ca-file", str(ca.path), "--service", ""])
    out, err = capsys.readouterr()
    assert (code, out) == (0, "SERVING\n"), err
    with pytest.raises(SystemExit):
        main(["health", "--api-key-file", "/dev/null"])
