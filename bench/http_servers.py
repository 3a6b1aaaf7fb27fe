"""Which HTTP server library carries the OpenAI-compatible API: measured, not assumed.

Each candidate runs in its own process on uvloop, embedded the way the gateway would embed it (started
inside an already running event loop), and serves the same two routes:
  POST /stream  reads a small JSON body and answers with N server-sent events, then `data: [DONE]`
  POST /json    reads the same body and answers with one small JSON object
One client (aiohttp's, the same for every candidate, keep-alive) sends the requests one at a time,
the candidates taking turns request by request so drift on a shared machine hits them alike.
Reported per candidate: time to the first event (P50/P99), cost per further event, and the JSON
round trip (P50/P99), all client side.

    python -m bench.http_servers [--requests 400] [--events 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import psutil
import uvloop

from appliance.tools import processes
from bench import record
from bench.common import pct

CANDIDATES = ("aiohttp", "uvicorn-asgi", "uvicorn-starlette")
EVENT = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}}]}


def _event(i: int) -> bytes:
    EVENT["choices"][0]["delta"] = {"content": f"tok{i}"}  # type: ignore[index]
    return b"data: " + json.dumps(EVENT).encode() + b"\n\n"


async def _events(n: int) -> AsyncIterator[bytes]:
    for i in range(n):
        yield _event(i)
        await asyncio.sleep(0)  # a token arrives from elsewhere: let the loop run between events
    yield b"data: [DONE]\n\n"


# -- servers -----------------------------------------------------------------------------------


async def serve_aiohttp(port: int, events: int) -> None:
    from aiohttp import web

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        async for chunk in _events(events):
            await response.write(chunk)
        await response.write_eof()
        return response

    async def one(request: web.Request) -> web.Response:
        body = await request.json()
        return web.Response(
            body=json.dumps({"echo": body}).encode(), content_type="application/json"
        )

    app = web.Application()
    app.router.add_post("/stream", stream)
    app.router.add_post("/json", one)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def _asgi(scope: Scope, receive: Receive, send: Send, events: int) -> None:
    """A bare ASGI app: uvicorn's cost without a framework's."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    parsed = json.loads(body)
    if scope["path"] == "/json":
        payload = json.dumps({"echo": parsed}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": payload})
        return
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    async for chunk in _events(events):
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def _uvicorn(app: Any, port: int) -> None:
    import uvicorn

    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        http="httptools",
        lifespan="off",
        access_log=False,
        log_level="warning",
    )
    server = uvicorn.Server(config)
    config.load()
    server.lifespan = config.lifespan_class(config)  # what serve() sets up before startup()
    await server.startup()  # not serve(): that takes over SIGTERM/SIGINT from the host process
    await asyncio.Event().wait()


async def serve_uvicorn_asgi(port: int, events: int) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await _asgi(scope, receive, send, events)

    await _uvicorn(app, port)


async def serve_uvicorn_starlette(port: int, events: int) -> None:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    async def stream(request: Request) -> StreamingResponse:
        await request.json()
        return StreamingResponse(_events(events), media_type="text/event-stream")

    async def one(request: Request) -> Response:
        body = await request.json()
        return Response(json.dumps({"echo": body}).encode(), media_type="application/json")

    app = Starlette(
        routes=[Route("/stream", stream, methods=["POST"]), Route("/json", one, methods=["POST"])]
    )
    await _uvicorn(app, port)


SERVERS = {
    "aiohttp": serve_aiohttp,
    "uvicorn-asgi": serve_uvicorn_asgi,
    "uvicorn-starlette": serve_uvicorn_starlette,
}

# -- client ------------------------------------------------------------------------------------

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello " * 40}], "stream": True}


async def stream_once(session: aiohttp.ClientSession, url: str) -> tuple[float, float, int]:
    """Seconds to the first event, seconds to [DONE], events seen."""
    sent = time.perf_counter()
    first = 0.0
    count = 0
    async with session.post(url + "/stream", json=BODY) as response:
        buffer = b""
        async for chunk in response.content.iter_any():
            if not first:
                first = time.perf_counter()
            buffer += chunk
            count += chunk.count(b"data: ")
        assert buffer.endswith(b"data: [DONE]\n\n")
    return first - sent, time.perf_counter() - sent, count - 1


async def json_once(session: aiohttp.ClientSession, url: str) -> float:
    sent = time.perf_counter()
    async with session.post(url + "/json", json=BODY) as response:
        await response.read()
    return time.perf_counter() - sent


async def measure(
    urls: dict[str, str], pids: dict[str, int], requests: int
) -> dict[str, dict[str, list[float]]]:
    """Client-side latencies, and the server process's CPU seconds per request (robust to a busy
    machine: time spent waiting for a core is not counted)."""
    out: dict[str, dict[str, list[float]]] = {
        name: {"ttfe": [], "per_event": [], "json": [], "cpu_stream": [], "cpu_json": []}
        for name in urls
    }
    procs = {name: psutil.Process(pid) for name, pid in pids.items()}

    def cpu(name: str) -> float:
        t = procs[name].cpu_times()
        return float(t.user + t.system)

    async with aiohttp.ClientSession() as session:
        for url in urls.values():  # warm-up: connections, code paths
            for _ in range(20):
                await stream_once(session, url)
                await json_once(session, url)
        before = {name: cpu(name) for name in urls}
        for _ in range(requests):
            for name, url in urls.items():
                first, total, events = await stream_once(session, url)
                out[name]["ttfe"].append(first)
                out[name]["per_event"].append((total - first) / max(1, events - 1))
        for name in urls:
            out[name]["cpu_stream"].append((cpu(name) - before[name]) / requests)
        before = {name: cpu(name) for name in urls}
        for _ in range(requests):
            for name, url in urls.items():
                out[name]["json"].append(await json_once(session, url))
        for name in urls:
            out[name]["cpu_json"].append((cpu(name) - before[name]) / requests)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--events", type=int, default=64)
    parser.add_argument("--serve", choices=CANDIDATES, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    record.add_flag(parser)
    args = parser.parse_args()
    with record.recording("http_servers", record.record_dir(args)):
        if args.serve:
            uvloop.run(SERVERS[args.serve](args.port, args.events))
            return 0
        procs: list[subprocess.Popen[bytes]] = []
        urls: dict[str, str] = {}
        pids: dict[str, int] = {}
        try:
            for name in CANDIDATES:
                port = processes.free_port()
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "bench.http_servers",
                            "--serve",
                            name,
                            "--port",
                            str(port),
                            "--events",
                            str(args.events),
                        ]
                    )
                )
                urls[name] = f"http://127.0.0.1:{port}"
                pids[name] = procs[-1].pid
            uvloop.run(_wait_up(urls))
            results = uvloop.run(measure(urls, pids, args.requests))
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
        print(
            f"{args.requests} requests per candidate, {args.events} events per stream; latencies "
            "client-side, CPU = the server process's CPU time per request (µs):"
        )
        print(
            f"{'server':<20}{'first P50':>10}{'first P99':>10}{'/event P50':>11}{'json P50':>9}"
            f"{'json P99':>9}{'CPU stream':>11}{'CPU json':>9}"
        )
        for name, r in results.items():
            us = {k: [v * 1e6 for v in vals] for k, vals in r.items()}
            print(
                f"{name:<20}{pct(us['ttfe'], 0.5):>10.0f}{pct(us['ttfe'], 0.99):>10.0f}"
                f"{pct(us['per_event'], 0.5):>11.1f}{pct(us['json'], 0.5):>9.0f}"
                f"{pct(us['json'], 0.99):>9.0f}{us['cpu_stream'][0]:>11.0f}{us['cpu_json'][0]:>9.0f}"
            )
        return 0


async def _wait_up(urls: dict[str, str]) -> None:
    async with aiohttp.ClientSession() as session:
        for url in urls.values():
            for _ in range(200):
                try:
                    await json_once(session, url)
                    break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
