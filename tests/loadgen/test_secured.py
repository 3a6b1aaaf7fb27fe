"""`appliance bench` against a real gateway that wants an API key over TLS or mutual TLS, and one
whose engine dies during the run: the gateway and the tiny engine run in the test's event loop, the
bench in a process of its own."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path

import pytest

from appliance.loadgen.runner import UNAVAILABLE_RUN
from appliance.security.api_keys import RateLimits, write_entries
from appliance.security.tls import TlsSettings
from tests.conftest import Engine, Tiny, engine_to_stop
from tests.security.certs import CA
from tests.security.conftest import Keys, running
from tests.support import gateway_config


async def bench(
    address: str, out: Path, *args: str, key: str | None = None
) -> tuple[int, str, str]:
    """Runs `appliance bench` (model tiny, no warm-up): (exit status, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "APPLIANCE_API_KEY"}
    if key is not None:
        env["APPLIANCE_API_KEY"] = key
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "appliance", "bench", "--address", address, "--model", "tiny"),
        *("--warmup", "0", "--output-tokens", "4", "--out", str(out), *args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, stdout.decode(), stderr.decode()


def written(out: Path) -> str:
    return "".join(p.read_text() for p in (out / "bench.json", out / "requests.csv"))


@pytest.fixture
def ca(tmp_path: Path) -> CA:
    return CA(tmp_path, "bench-ca")


async def test_a_key_from_the_environment_over_tls(
    tiny: Tiny, engine: Engine, keys: Keys, ca: CA, tmp_path: Path
) -> None:
    token = keys.add(["default"], ["generate"])
    server = ca.issue("server", "gateway")
    config = gateway_config(
        tiny.tokenizer_dir,
        engine.address,
        tls=TlsSettings(server.cert, server.key),
        auth=keys.auth(),
    )
    async with running(config) as gw:
        address = f"localhost:{gw.port}"
        out = tmp_path / "run"
        rc, stdout, stderr = await bench(
            address, out, "--requests", "3", "--ca-file", str(ca.path), key=token
        )
        assert rc == 0, stderr
        assert "concurrency 1: 3 sent, 3 ok, 0 errors" in stdout
        assert token not in stdout + stderr + written(out)
        assert token[16:] not in written(out)

        # Without the key: one line naming the ways to give one, before any load.
        rc, stdout, stderr = await bench(address, tmp_path / "nokey", "--ca-file", str(ca.path))
        assert rc == 2
        assert stderr.count("\n") == 1, stderr
        assert stderr.startswith(f"appliance bench: {address}: UNAUTHENTICATED: "), stderr
        assert "--api-key-file or $APPLIANCE_API_KEY" in stderr

        # Plaintext to a TLS listener: the refusal says what to check.
        rc, _, stderr = await bench(address, tmp_path / "plain", "--connect-timeout", "1")
        assert rc == 2
        assert stderr.count("\n") == 1 and "--ca-file" in stderr, stderr


async def test_a_key_file_over_mutual_tls(
    tiny: Tiny, engine: Engine, keys: Keys, ca: CA, tmp_path: Path
) -> None:
    token = keys.add(["default"], ["generate"])
    key_file = tmp_path / "api-key"
    key_file.write_text(token + "\n")
    server = ca.issue("server", "gateway")
    client = ca.issue("client", "bench-client", client=True)
    tls = TlsSettings(server.cert, server.key, client_ca_file=ca.path)
    config = gateway_config(tiny.tokenizer_dir, engine.address, tls=tls, auth=keys.auth())
    async with running(config) as gw:
        out = tmp_path / "run"
        rc, stdout, stderr = await bench(
            f"127.0.0.1:{gw.port}",
            out,
            *("--requests", "2", "--api-key-file", str(key_file), "--ca-file", str(ca.path)),
            *("--cert-file", str(client.cert), "--key-file", str(client.key)),
            key="ak_000000000000_from_the_environment_loses_to_the_file",
        )
        assert rc == 0, stderr
        assert "concurrency 1: 2 sent, 2 ok, 0 errors" in stdout
        assert token not in stdout + stderr + written(out)
        run = json.loads((out / "bench.json").read_text())["run"]
        assert (run["tls"], run["api_key"]) == ("mutual", token[3:15])


@pytest.mark.timeout(120)
async def test_an_engine_that_dies_during_the_run_ends_it_with_what_was_measured(
    tiny: Tiny, engine_repo: Path, tmp_path: Path
) -> None:
    address, stop = await engine_to_stop(engine_repo)
    async with running(gateway_config(tiny.tokenizer_dir, address)) as gw:
        out = tmp_path / "run"
        args = ("--duration", "120", "--out", str(out))
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "appliance", "bench", "--address", f"127.0.0.1:{gw.port}"),
            *("--model", "tiny", "--warmup", "0", "--output-tokens", "4", *args),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stderr is not None and proc.stdout is not None
        # Off a terminal the progress is a line every few seconds; wait for one with answers.
        while line := (await proc.stderr.readline()).decode():
            done = re.match(r"concurrency 1: (\d+) done,", line)
            if done and int(done.group(1)) >= 1:
                break
        await stop()
        stdout, rest = await asyncio.wait_for(proc.communicate(), 60)
    err = rest.decode().splitlines()
    assert proc.returncode == 1, err
    assert re.match(
        rf"appliance bench: 127.0.0.1:{gw.port}: the last \d+ answers, over [\d.]+ s, were "
        r"UNAVAILABLE \(",
        err[-1],
    ), err[-1]
    assert "concurrency 1: " in stdout.decode()
    (level,) = json.loads((out / "bench.json").read_text())["levels"]
    assert level["ok"] >= 1 and level["errors"]["UNAVAILABLE"] >= UNAVAILABLE_RUN


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", ["revoked", "scope removed"])
async def test_a_key_refused_during_the_run_ends_it_at_once_with_one_line(
    change: str, tiny: Tiny, engine: Engine, keys: Keys, tmp_path: Path
) -> None:
    """The keys file changes under a running bench and the gateway reloads it (SIGHUP): every
    further request would be refused the same way, so the run stops, saying which key and why."""
    token = keys.add(["default"], ["generate"])
    key_file = tmp_path / "api-key"
    key_file.write_text(token + "\n")
    by_file = change == "revoked"
    # No per-key rate: the tiny engine answers more than the default 100 requests/s, and the only
    # refusals this run may see are the ones the keys file's change brings.
    auth = keys.auth(limits=RateLimits())
    config = gateway_config(tiny.tokenizer_dir, engine.address, auth=auth)
    async with running(config) as gw:
        address = f"127.0.0.1:{gw.port}"
        out = tmp_path / "run"
        env = {k: v for k, v in os.environ.items() if k != "APPLIANCE_API_KEY"}
        if not by_file:
            env["APPLIANCE_API_KEY"] = token
        given = ("--api-key-file", str(key_file)) if by_file else ()
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "appliance", "bench", "--address", address, "--model", "tiny"),
            *("--warmup", "0", "--output-tokens", "4", "--duration", "600", "--out", str(out)),
            *given,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        assert proc.stderr is not None
        while line := (await proc.stderr.readline()).decode():
            done = re.match(r"concurrency 1: (\d+) done,", line)
            if done and int(done.group(1)) >= 1:
                break
        if by_file:
            keys.entries.clear()
        else:
            keys.entries[0]["scopes"] = ["admin"]
        write_entries(keys.path, keys.entries)
        gw.reload()
        stdout, rest = await asyncio.wait_for(proc.communicate(), 60)
        # Refused from the start: the first request stops the bench, the same line, exit 2.
        rc, _, first = await bench(
            address, tmp_path / "again", *given, key=None if by_file else token
        )
    err = rest.decode().splitlines()
    assert proc.returncode == 1, err
    status = "UNAUTHENTICATED" if by_file else "PERMISSION_DENIED"
    source = f"--api-key-file {key_file}" if by_file else "$APPLIANCE_API_KEY"
    assert err[-1].startswith(f"appliance bench: {address}: the API key of {source} "), err[-1]
    assert f": {status}: " in err[-1], err[-1]
    assert rc == 2 and first.count("\n") == 1, first
    assert first.startswith(f"appliance bench: {address}: the API key of {source} was refused: ")
    assert token not in stdout.decode() + rest.decode() + written(out)
    (level,) = json.loads((out / "bench.json").read_text())["levels"]
    assert level["ok"] >= 1 and set(level["errors"]) == {status}
    assert status in json.loads((out / "bench.json").read_text())["run"]["unreachable"]
