"""A hostile client, run as its own process so that building and sending its payloads never shares
the event loop (or the GIL) of the gateway it attacks.

    python -m tests.gateway.hostile_client SETTINGS_JSON

SETTINGS_JSON: {"grpc": "HOST:PORT", "http": "HOST:PORT", "ca": PEM, "key": TOKEN,
"marker": TEXT}. Every request carries `marker` in its prompt and the key in its headers; it
prints one JSON object: each attack's name and what the gateway answered (gRPC status name,
HTTP status, or what a raw connection got back).

    python -m tests.gateway.hostile_client '{"flood": "reset" | "ping", "grpc": "HOST:PORT"}'

floods one plaintext HTTP/2 connection: "reset" opens streams and resets each at once (rapid
reset), "ping" sends PING frames. It prints "flooding" once the first frames are sent and
"goaway CODE" when it reads the server's GOAWAY, goes on until its stdin closes or the server
closes the connection, then prints one JSON object: the frames sent, the GOAWAY error code read
(null: none; a reset connection can lose it) and whether the server closed the connection.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import select
import socket
import ssl
import struct
import sys
from typing import Any

import aiohttp
import grpc

from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal header field without indexing, neither string Huffman-coded: the bytes
    travel as they are, so a log of the frames would show them."""
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def http2_request(key: str, marker: str) -> bytes:
    headers = b"".join(
        [
            b"\x83",  # :method POST
            b"\x87",  # :scheme https
            _literal(b":path", b"/v1/completions"),
            _literal(b":authority", b"localhost"),
            _literal(b"authorization", f"Bearer {key}".encode()),
            _literal(b"content-type", b"application/json"),
        ]
    )
    body = json.dumps({"model": "tiny", "prompt": marker}).encode()
    return (
        HTTP2_PREFACE
        + _frame(0x4, 0, 0, b"")  # SETTINGS
        + _frame(0x1, 0x4, 1, headers)  # HEADERS, END_HEADERS
        + _frame(0x0, 0x1, 1, body)  # DATA, END_STREAM
    )


async def raw_tls(host: str, port: int, ca: str, alpn: list[str], data: bytes) -> str:
    """Sends `data` on a TLS connection offering `alpn`; what came back before the close."""
    context = ssl.create_default_context(cadata=ca)
    context.set_alpn_protocols(alpn)
    reader, writer = await asyncio.open_connection(
        host, port, ssl=context, server_hostname="localhost"
    )
    negotiated = writer.get_extra_info("ssl_object").selected_alpn_protocol()
    writer.write(data)
    await writer.drain()
    try:
        reply = await asyncio.wait_for(reader.read(65536), 10)
    except (ConnectionError, ssl.SSLError, TimeoutError):
        reply = b""
    writer.close()
    first = reply.split(b"\r\n", 1)[0].decode(errors="replace")
    return f"alpn={negotiated} reply={first or 'closed'}"


async def attack_grpc(settings: dict[str, Any], out: dict[str, Any]) -> None:
    marker, key = settings["marker"], settings["key"]
    credentials = grpc.ssl_channel_credentials(settings["ca"].encode())
    metadata = (("authorization", f"Bearer {key}"),)
    async with grpc.aio.secure_channel(settings["grpc"], credentials) as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def call(name: str, request: pb.GenerateRequest) -> None:
            try:
                async for _ in stub.Generate(request, metadata=metadata, timeout=60):
                    pass
                out[name] = "OK"
            except grpc.aio.AioRpcError as err:
                out[name] = err.code().name

        empty = pb.ChatMessages(messages=[pb.ChatMessage(role="user")] * 300_000)
        many = pb.GenerateRequest(model="tiny", messages=empty)
        many.messages.messages[0].content = marker
        huge = pb.GenerateRequest(model="tiny", prompt=marker + " x" * 500_000)
        # Under the character bound, over the token bound: refused after tokenizing.
        long = pb.GenerateRequest(model="tiny", prompt=marker + " x y" * 20_000)
        crlf = pb.GenerateRequest(model="tiny", prompt=marker, request_id="a\r\nb", max_tokens=2)
        fine = pb.GenerateRequest(model="tiny", prompt=marker, max_tokens=16)
        await asyncio.gather(
            call("grpc 300k empty messages", many),
            *(call(f"grpc 1 MB prompt {i}", huge) for i in range(4)),
            *(call(f"grpc prompt over the token limit {i}", long) for i in range(4)),
            call("grpc request_id with CR/LF", crlf),
            call("grpc an ordinary stream", fine),
        )


async def attack_http(settings: dict[str, Any], out: dict[str, Any]) -> None:
    marker, key, address = settings["marker"], settings["key"], settings["http"]
    host, port = address.rsplit(":", 1)
    base = f"https://{address}"
    context = ssl.create_default_context(cadata=settings["ca"])
    auth = {"Authorization": f"Bearer {key}"}
    connector = aiohttp.TCPConnector(ssl=context)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def post(name: str, body: bytes, headers: dict[str, str] | None = None) -> None:
            url = base + ("/v1/chat/completions" if b'"messages"' in body else "/v1/completions")
            try:
                async with session.post(url, data=body, headers={**auth, **(headers or {})}) as r:
                    await r.read()
                    out[name] = r.status
            except aiohttp.ClientError as exc:  # a broken reply: the test shows which
                out[name] = f"{type(exc).__name__}"

        turns = [{"role": "user", "content": marker}] + [{"role": "user", "content": ""}] * 124_999
        big = json.dumps({"model": "tiny", "messages": turns}).encode()
        digits = "1" + "0" * 400
        plain = json.dumps({"model": "tiny", "prompt": marker, "max_tokens": 2}).encode()
        await asyncio.gather(
            post("http 125k empty messages", big),
            post(
                "http 1 MB prompt",
                json.dumps({"model": "tiny", "prompt": marker + " x" * 500_000}).encode(),
            ),
            post(
                "http 401-digit temperature", plain[:-1] + f', "temperature": {digits}}}'.encode()
            ),
            post("http 401-digit top_p", plain[:-1] + f', "top_p": {digits}}}'.encode()),
            post("http temperature 3", plain[:-1] + b', "temperature": 3}'),
            post(
                "http request_id with CR/LF",
                plain[:-1] + b', "appliance": {"request_id": "a\\r\\nb"}}',
            ),
            post(
                "http streamed request_id with ESC",
                plain[:-1] + b', "stream": true, "appliance": {"request_id": "a\\u001bb"}}',
            ),
            post("http gzip header on a plain body", plain, {"Content-Encoding": "gzip"}),
            post("http gzip body", gzip.compress(plain), {"Content-Encoding": "gzip"}),
        )
        async with session.get(base + "/v1/models") as r:
            out["http models without a key"] = r.status
    out["http/2 prior knowledge"] = await raw_tls(
        host, int(port), settings["ca"], ["h2"], http2_request(key, marker)
    )
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(plain)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + plain
    out["http/1.1 after offering h2"] = await raw_tls(
        host, int(port), settings["ca"], ["h2", "http/1.1"], request
    )


async def main(settings: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    await asyncio.gather(attack_grpc(settings, out), attack_http(settings, out))
    return out


def _goaway_code(pending: bytearray) -> int | None:
    """Takes the whole frames off the front of `pending`: the error code of a GOAWAY among them."""
    code = None
    while len(pending) >= 9:
        length = int.from_bytes(pending[:3], "big")
        if len(pending) < 9 + length:
            break
        if pending[3] == 0x7:
            code = int.from_bytes(pending[13:17], "big")
        del pending[: 9 + length]
    return code


def flood(kind: str, address: str) -> dict[str, Any]:
    host, port = address.rsplit(":", 1)
    path = b"/grpc.health.v1.Health/Check"
    headers = b"".join(
        [
            b"\x83",  # :method POST
            b"\x86",  # :scheme http
            _literal(b":path", path),
            _literal(b":authority", b"localhost"),
            _literal(b"content-type", b"application/grpc"),
            _literal(b"te", b"trailers"),
        ]
    )
    cancel = struct.pack(">I", 0x8)  # RST_STREAM CANCEL
    sock = socket.create_connection((host, int(port)))
    sock.sendall(HTTP2_PREFACE + _frame(0x4, 0, 0, b"") + _frame(0x4, 0x1, 0, b""))
    sock.settimeout(1.0)
    sent, stream, pending, goaway, sending, closed = 0, 1, bytearray(), None, True, False
    while True:
        if sending:
            batch = []
            for _ in range(100):
                if kind == "reset" and stream < 2**31 - 2:
                    batch += [_frame(0x1, 0x4, stream, headers), _frame(0x3, 0, stream, cancel)]
                    stream += 2
                else:
                    batch.append(_frame(0x6, 0, 0, struct.pack(">Q", sent + len(batch))))
            try:
                sock.sendall(b"".join(batch))
            except OSError:
                # Refused, or not read for a second: what the server sends is still read.
                sending = False
            if sent == 0:
                print("flooding", flush=True)
            sent += 100
        readable, _, _ = select.select([sock, sys.stdin], [], [], 0 if sending else 1)
        if sys.stdin in readable and not sys.stdin.readline():
            break
        if sock in readable:
            try:
                data = sock.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                closed = True
                break
            pending += data
            if goaway is None and (goaway := _goaway_code(pending)) is not None:
                print(f"goaway {goaway}", flush=True)
    sock.close()
    return {"sent": sent, "goaway": goaway, "closed": closed}


if __name__ == "__main__":
    settings = json.loads(sys.argv[1])
    if "flood" in settings:
        print(json.dumps(flood(settings["flood"], settings["grpc"])))
    else:
        print(json.dumps(asyncio.run(main(settings))))
