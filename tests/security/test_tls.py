"""Real TLS and mutual-TLS handshakes against the gateway, with certificates the test makes, and a
certificate renewal under load that fails no stream."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from collections.abc import Awaitable
from pathlib import Path

import grpc
import pytest

from appliance.security.api_keys import RateLimits
from appliance.security.tls import ServerTls, TlsError, TlsSettings
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Engine, Tiny
from tests.security.certs import CA, Issued
from tests.security.conftest import Keys, bearer, running, tls_channel
from tests.support import gateway_config, until_async


def hit_request(prompt: str = "tls says hello") -> pb.GenerateRequest:
    return pb.GenerateRequest(model="tiny", prompt=prompt, max_tokens=4, temperature=0)


@pytest.fixture
def ca(tmp_path: Path) -> CA:
    return CA(tmp_path, "test-ca")


@pytest.fixture
def other_ca(tmp_path: Path) -> CA:
    return CA(tmp_path, "other-ca")


@pytest.fixture
def server_cert(ca: CA) -> Issued:
    return ca.issue("server", "gateway")


async def _complete(channel: grpc.aio.Channel, **kw: object) -> pb.CompleteResponse:
    reply: pb.CompleteResponse = await pb_grpc.InferenceStub(channel).Complete(
        hit_request(), timeout=10, **kw
    )
    return reply


async def _refused(channel: grpc.aio.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _complete(channel)
    await channel.close()
    return err.value.code()


async def test_tls_handshake_serves_and_plaintext_is_refused(
    tiny: Tiny, engine: Engine, ca: CA, server_cert: Issued
) -> None:
    tls = TlsSettings(server_cert.cert, server_cert.key)
    async with running(gateway_config(tiny.tokenizer_dir, engine.address, tls=tls)) as gw:
        async with tls_channel(gw.port, ca.pem) as channel:
            reply = await _complete(channel)
            assert reply.final.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        plain = grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}")
        assert await _refused(plain) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("fault", ["expired", "wrong-ca", "wrong-host"])
async def test_a_client_refuses_a_bad_server_certificate(
    tiny: Tiny, engine: Engine, ca: CA, other_ca: CA, fault: str
) -> None:
    cert = {
        "expired": lambda: ca.issue("server", "gateway", expired=True),
        "wrong-ca": lambda: other_ca.issue("server", "gateway"),
        "wrong-host": lambda: ca.issue("server", "gateway", hosts=("other.example",)),
    }[fault]()
    async with running(
        gateway_config(tiny.tokenizer_dir, engine.address, tls=TlsSettings(cert.cert, cert.key))
    ) as gw:
        assert await _refused(tls_channel(gw.port, ca.pem)) == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_refuses_clients_without_a_good_certificate(
    tiny: Tiny, engine: Engine, ca: CA, other_ca: CA, server_cert: Issued
) -> None:
    tls = TlsSettings(server_cert.cert, server_cert.key, client_ca_file=ca.path)
    good = ca.issue("client", "client-a", hosts=("client-a.example",), client=True)
    expired = ca.issue("old", "client-a", client=True, expired=True)
    foreign = other_ca.issue("foreign", "client-a", client=True)
    async with running(gateway_config(tiny.tokenizer_dir, engine.address, tls=tls)) as gw:
        async with tls_channel(gw.port, ca.pem, good.cert_pem, good.key_pem) as channel:
            await _complete(channel)
        for refused in (
            tls_channel(gw.port, ca.pem),
            tls_channel(gw.port, ca.pem, expired.cert_pem, expired.key_pem),
            tls_channel(gw.port, ca.pem, foreign.cert_pem, foreign.key_pem),
        ):
            assert await _refused(refused) == grpc.StatusCode.UNAVAILABLE


async def test_a_client_certificate_stands_for_its_key(
    tiny: Tiny, engine: Engine, ca: CA, server_cert: Issued, keys: Keys
) -> None:
    keys.add(["tenant-a"], ["generate"], identities=["client-a.example"])
    other_token = keys.add(["tenant-b"], ["generate"])
    tls = TlsSettings(server_cert.cert, server_cert.key, client_ca_file=ca.path)
    mapped = ca.issue("mapped", "client-a", hosts=("client-a.example",), client=True)
    unmapped = ca.issue("unmapped", "client-z", hosts=("client-z.example",), client=True)
    async with running(
        gateway_config(tiny.tokenizer_dir, engine.address, tls=tls, auth=keys.auth())
    ) as gw:
        async with tls_channel(gw.port, ca.pem, mapped.cert_pem, mapped.key_pem) as channel:
            await _complete(channel)  # the certificate's key holds one namespace: implied
            with pytest.raises(grpc.aio.AioRpcError) as err:
                r = hit_request()
                r.namespace = "tenant-b"
                await pb_grpc.InferenceStub(channel).Complete(r, timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            # A bearer key wins over the certificate.
            r.namespace = "tenant-b"
            await pb_grpc.InferenceStub(channel).Complete(
                r, timeout=10, metadata=bearer(other_token)
            )
        async with tls_channel(gw.port, ca.pem, unmapped.cert_pem, unmapped.key_pem) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _complete(channel)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_only_the_cn_and_dns_or_uri_sans_stand_for_a_key(
    tiny: Tiny, engine: Engine, ca: CA, server_cert: Issued, keys: Keys
) -> None:
    """An email or IP address SAN stands for no key, over gRPC as over HTTP: a CA that puts a
    client's own email address in its certificate lets it name no key by that."""
    keys.add(["tenant-a"], ["generate"], identities=["client-a.example"])
    keys.add(["tenant-b"], ["generate"], identities=["10.9.8.7"])
    tls = TlsSettings(server_cert.cert, server_cert.key, client_ca_file=ca.path)
    by_email = ca.issue("email", "client-z", hosts=(), emails=("client-a.example",), client=True)
    by_ip = ca.issue("ip", "client-y", hosts=("10.9.8.7",), client=True)
    keys.add(["tenant-c"], ["generate"], identities=["spiffe://example/client-c"])
    by_uri = ca.issue("uri", "client-x", hosts=(), uris=("spiffe://example/client-c",), client=True)
    async with running(
        gateway_config(tiny.tokenizer_dir, engine.address, tls=tls, auth=keys.auth())
    ) as gw:
        for issued in (by_email, by_ip):
            channel = tls_channel(gw.port, ca.pem, issued.cert_pem, issued.key_pem)
            assert await _refused(channel) == grpc.StatusCode.UNAUTHENTICATED, issued.cert
        async with tls_channel(gw.port, ca.pem, by_uri.cert_pem, by_uri.key_pem) as channel:
            await _complete(channel)


def test_a_certificate_that_does_not_match_its_key_is_refused(ca: CA) -> None:
    a, b = ca.issue("a", "a"), ca.issue("b", "b")
    with pytest.raises(TlsError, match=r"a\.crt with key .*b\.key: not a certificate and its"):
        ServerTls(TlsSettings(a.cert, b.key))


@pytest.mark.parametrize("fault", ["unreadable", "not a bundle"])
def test_a_client_ca_file_at_fault_is_the_key_the_refusal_names(
    ca: CA, tmp_path: Path, fault: str
) -> None:
    from appliance.config import ConfigError, load_config

    server = ca.issue("localhost", "localhost")
    bundle = tmp_path / "clients.pem"
    if fault == "not a bundle":
        bundle.write_bytes(b"not a certificate")
    tok = tmp_path / "tok"
    tok.mkdir()
    config = tmp_path / "g.toml"
    config.write_text(
        f'[tls]\ncert_file = "{server.cert}"\nkey_file = "{server.key}"\n'
        f'client_ca_file = "{bundle}"\n'
        f'[models.m]\nbackend = "127.0.0.1:1"\ntokenizer_dir = "{tok}"\n'
    )
    with pytest.raises(ConfigError, match=rf":4: key 'tls.client_ca_file': .*{bundle.name}"):
        load_config(config)


def _served_certificate(port: int, ca: Path) -> bytes:
    """The DER certificate the server presents to a new connection (a handshake of its own)."""
    context = ssl.create_default_context(cafile=str(ca))
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def _der(issued: Issued) -> bytes:
    return ssl.PEM_cert_to_DER_cert(issued.cert_pem.decode())


async def test_a_renewed_certificate_is_used_without_failing_a_stream(
    tiny: Tiny, engine: Engine, ca: CA, tmp_path: Path
) -> None:
    live = Issued(tmp_path / "live.crt", tmp_path / "live.key")
    first = ca.issue("first", "gateway")
    renewed = ca.issue("renewed", "gateway")
    live.cert.write_bytes(first.cert_pem)
    live.key.write_bytes(first.key_pem)
    tls = TlsSettings(live.cert, live.key)
    failures: list[BaseException] = []
    done = {"unary": 0, "new_channel": 0, "streams": 0}
    stop = asyncio.Event()

    async def unary(channel: grpc.aio.Channel) -> None:
        while not stop.is_set():
            await _complete(channel)
            done["unary"] += 1

    async def new_channels(port: int) -> None:
        while not stop.is_set():
            async with tls_channel(port, ca.pem) as channel:
                await _complete(channel)
            done["new_channel"] += 1

    async def streams(channel: grpc.aio.Channel) -> None:
        stub = pb_grpc.InferenceStub(channel)
        while not stop.is_set():
            request = pb.GenerateRequest(
                model="tiny",
                prompt="a long answer please",
                max_tokens=40,
                temperature=0,
                cache_policy=pb.CACHE_POLICY_BYPASS,
            )
            final = None
            async for message in stub.Generate(request, timeout=60):
                final = message
            assert final is not None and final.HasField("final")
            done["streams"] += 1

    async def guarded(work: Awaitable[None]) -> None:
        try:
            await work
        except BaseException as exc:  # every failure is the test's failure
            failures.append(exc)
            stop.set()

    async with running(gateway_config(tiny.tokenizer_dir, engine.address, tls=tls)) as gw:
        assert await asyncio.to_thread(_served_certificate, gw.port, ca.path) == _der(first)
        channels = [tls_channel(gw.port, ca.pem) for _ in range(3)]
        workers = [
            asyncio.ensure_future(guarded(unary(channels[0]))),
            asyncio.ensure_future(guarded(unary(channels[1]))),
            asyncio.ensure_future(guarded(streams(channels[2]))),
            asyncio.ensure_future(guarded(new_channels(gw.port))),
        ]
        await until_async(
            lambda: done["streams"] >= 1 and done["new_channel"] >= 3, lambda: f"done {done}"
        )
        # The renewal as a certificate tool does it: each file replaced by a rename (the pair is
        # mismatched in between: that handshake keeps the old certificate).
        for source, target in ((renewed.cert, live.cert), (renewed.key, live.key)):
            staged = target.with_suffix(".new")
            staged.write_bytes(source.read_bytes())
            os.replace(staged, target)

        async def renewed_served() -> bool:
            served = await asyncio.to_thread(_served_certificate, gw.port, ca.path)
            return served == _der(renewed)

        await until_async(renewed_served, "the renewed certificate was never served", 20.0, 0.05)
        before = dict(done)
        await until_async(
            lambda: (
                done["streams"] > before["streams"]
                and done["new_channel"] >= before["new_channel"] + 3
            ),
            lambda: f"done {done}, before the renewal {before}",
        )
        stop.set()
        await asyncio.gather(*workers)
        for channel in channels:
            await channel.close()
    assert failures == []
    assert min(done.values()) > 0, done


async def test_rate_limited_keys_over_tls_get_the_pushback_trailer(
    tiny: Tiny, engine: Engine, ca: CA, server_cert: Issued, keys: Keys
) -> None:
    token = keys.add(["t"], ["generate"], limits=RateLimits(rate_per_s=0.5, burst=1))
    tls = TlsSettings(server_cert.cert, server_cert.key)
    async with (
        running(
            gateway_config(tiny.tokenizer_dir, engine.address, tls=tls, auth=keys.auth())
        ) as gw,
        tls_channel(gw.port, ca.pem) as channel,
    ):
        await _complete(channel, metadata=bearer(token))
        call = pb_grpc.InferenceStub(channel).Complete(
            hit_request(), timeout=10, metadata=bearer(token)
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(err.value.trailing_metadata() or ())
        assert 0 < int(trailers["grpc-retry-pushback-ms"]) <= 2000
