"""The OpenAI-compatible HTTP API: a second front door onto the gRPC API's pipeline.

Served by aiohttp's web server inside the gateway's own event loop (aiohttp was measured against
uvicorn with and without Starlette: bench/http_servers.py, docs/PERFORMANCE.md#http-api). Thin like the gRPC
service: a body becomes the pipeline's GenerateRequest (openai_wire), the pipeline's messages become
server-sent events or one JSON answer, and a RequestError becomes an HTTP status in OpenAI's error
shape. Nothing about validation, caching or the engine is decided here.

A client that disconnects cancels its handler (aiohttp's handler cancellation), which closes the
pipeline's stream exactly as a cancelled gRPC call does. A body larger than `max_body_bytes` is
refused with 413: by its Content-Length before any of it is read (and before a client that sends
`Expect: 100-continue` is asked for it), a gzip or deflate body as inflated (it is inflated as it
is read, and refused once it grows past the limit). Another Content-Encoding is refused with 415
(one that does not inflate with 400), and so is a body declared as a form or text (what `curl -d`
sends, and what a web page may send to another origin without the browser asking it first).
A client that sends its body, or reads its stream, with no progress for `client_timeout_s` is cut
off, and so is a TLS handshake that takes longer, and a connection that sends no complete request
head within that time (aiohttp's keepalive_timeout runs from the connection's start and from each
answer, whatever bytes arrive: a head sent a byte at a time is no progress). At most
`max_connections` connections are held at once, each counted from its accept to its end (a TLS
one through its handshake): one more is answered 503 (a retry hint) as it is accepted (over TLS,
once its handshake is done) and closed, its request unread, and counted.

A request that changes something (any method but GET, HEAD, OPTIONS) from a web page of another
origin is refused with 403, as Go's net/http CrossOriginProtection refuses it: when the browser's
`Sec-Fetch-Site` is neither same-origin nor none, or, from a browser that sends none, when its
`Origin` is not the `Host` it asked. Clients that are no browser send neither and pass. There is
no allow-list of origins: the API answers no CORS preflight (OPTIONS), so a page of another origin
can send only what needs none, a POST whose answer it cannot read.

Without API keys, on a loopback address, a request whose `Host` is no loopback name is refused
with 403: a web page whose DNS name is made to resolve to 127.0.0.1 (DNS rebinding) is of the
gateway's origin for the browser, which would let it read the answers. With keys any Host is
answered (a browser sends no key on its own), and so it is without keys on another address
(`[auth] allow_anonymous`: anyone who reaches the gateway may use it).

Nothing a client sends reaches the log: aiohttp's own records of requests it could not parse carry
the raw bytes (an HTTP/2 preface with its HPACK block holds the `authorization` header) and are
rewritten as one line naming the refusal and the peer, at most one per interval. aiohttp's own
answers to such requests (plain text quoting the bytes) are OpenAI's error shape instead.

Every request answered with an error is reported once, as the pipeline reports the requests it
runs: one access line and one count in appliance_requests_total, model `unknown` when refused
before the pipeline, its HTTP status as gRPC names it (WIRE_STATUS). /health's own answers are
probes', no requests.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import ssl as ssl_module
import time
import urllib.parse
import zlib
from asyncio import sslproto
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, cast

import grpc
from aiohttp import HttpVersion11, web
from aiohttp.http_exceptions import BadHttpMethod, LineTooLong
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from aiohttp.web_request import BaseRequest
from aiohttp.web_urldispatcher import _default_expect_handler
from grpc_health.v1 import health, health_pb2

from appliance.config import HttpConfig, is_loopback
from appliance.gateway import json_body
from appliance.gateway import openai_wire as wire
from appliance.gateway.errors import RequestError
from appliance.gateway.generation import Delta, TokenLogprob
from appliance.gateway.health import health_name
from appliance.gateway.metrics import REFUSED_CROSS_ORIGIN, REFUSED_HOST, Counters
from appliance.gateway.pipeline import UNAVAILABLE_RETRY_MS, Pipeline, stopping
from appliance.gateway.reply import Reply
from appliance.gateway.request import echo, new_request_id, valid_request_id
from appliance.logline import Throttled
from appliance.security.auth import CACHE_ONLY, GENERATE, Credentials, Grant, bearer_token
from appliance.security.tls import ServerTls, peercert_names

log = logging.getLogger(__name__)
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    # Proxies (nginx) must pass events on as they come, not buffer them.
    "X-Accel-Buffering": "no",
}
# The status the access log and metrics record for an error answer the pipeline did not give (a
# request refused before it reached the pipeline, or one that was never a generation); another
# status: INVALID_ARGUMENT.
WIRE_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
}
# A request's state (aiohttp's request mapping): when it arrived (monotonic ns), and that its
# outcome is reported (the pipeline reports every request it runs; the HTTP API the others).
RECEIVED = web.RequestKey("appliance.received_ns", int)
REPORTED = web.RequestKey("appliance.reported", bool)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Content-Encodings of a request body the server inflates (within max_body_bytes) or takes as is.
BODY_ENCODINGS = ("identity", "gzip", "deflate")
# Content-Types of a body that is no JSON request: what an HTML form or `curl -d` sends, and the
# types a web page may send to another origin without the browser asking it first (CORS).
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data", "text/plain")
# zlib's window arguments to try for each compressed encoding: gzip's; deflate as HTTP defines
# it (zlib-wrapped), then raw, which some clients send.
DEFLATE_WINDOWS = {"gzip": (16 + zlib.MAX_WBITS,), "deflate": (zlib.MAX_WBITS, -zlib.MAX_WBITS)}
# Bytes of request bodies read and decoded at once, in bodies of max_body_bytes: each is held
# whole until decoded, so clients that each start a large one and send it slowly would otherwise
# hold any amount of memory. A body counts its Content-Length (max_body_bytes when compressed or
# chunked); one past the budget is refused at once as an overload (429, retry after
# BODY_RETRY_MS).
BODY_BUDGET = 32
BODY_RETRY_MS = 1000
# gzip members a body may hold: each one's end copies the rest of the body (zlib's unused_data),
# so 4 MiB of empty 20-byte members held the event loop for 30 s.
MAX_GZIP_MEMBERS = 16
# Methods a page of another origin may send: they change nothing (Go's CrossOriginProtection).
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
# Sec-Fetch-Site values of a request the browser made for the server's own origin or for its user.
SAME_ORIGIN_SITES = ("same-origin", "none")
# Seconds a refused connection is read (and what it sends dropped) after its answer, and how many
# are at once (RefusedConnection).
LINGER_S = 2.0
MAX_LINGERING = 256
# aiohttp's logger of requests it refuses or handlers that raise.
SERVER_LOGGER = "aiohttp.server"
# The line logged (throttled) for a request refused with 403 before it became one, by reason: it
# names the peer, never the header values the client chose.
REFUSAL_LINES = {
    REFUSED_HOST: "HTTP request from %s refused (403): its Host header is no loopback name and "
    "the gateway has no API keys (DNS rebinding?); its Host is not logged",
    REFUSED_CROSS_ORIGIN: "HTTP request from %s refused (403): cross-origin, a browser sent it "
    "for a page of another origin; its Origin and Sec-Fetch-Site are not logged",
}


class StoppedReading(Exception):
    """The HTTP client read nothing for client_timeout_s while a write waited: its connection
    is aborted."""


# Where aiohttp's message template takes an argument (" from %s"): dropped with the argument.
_ARGUMENT = re.compile(r"(?:\s+from)?\s*%[-#0 +]*[0-9.]*[a-zA-Z]")


class WithoutRequestBytes(logging.Filter):
    """Replaces an aiohttp record by one throttled line without its arguments or exception text,
    both of which may hold request bytes (headers, a body, an HTTP/2 connection's frames)."""

    def __init__(self) -> None:
        super().__init__()
        self._throttled = Throttled(logging.getLogger(__name__))

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        what = type(exc).__name__ if exc is not None else "no exception"
        if record.levelno >= logging.WARNING:
            template = record.msg if isinstance(record.msg, str) else ""
            self._throttled.warning(
                "HTTP request refused by the HTTP server (%s: %s); its bytes are not logged",
                _ARGUMENT.sub("", template).strip() or "error",
                what,
            )
        return False


def quiet_http_server_log() -> None:
    """Installs WithoutRequestBytes on aiohttp's server logger once per process."""
    logger = logging.getLogger(SERVER_LOGGER)
    if not any(isinstance(f, WithoutRequestBytes) for f in logger.filters):
        logger.addFilter(WithoutRequestBytes())


def _inflate(body: bytes, windows: tuple[int, ...], limit: int) -> bytes | None:
    """`body` inflated with the first of `windows` that reads it whole; None past `limit` bytes
    (inflated one byte past it at most: a bomb stops there). zlib.error if none reads it. A
    gzip body may hold several members, one after another (RFC 1952), up to MAX_GZIP_MEMBERS."""
    for window in windows:
        parts: list[bytes] = []
        rest, room = body, limit + 1
        try:
            while True:
                if len(parts) == MAX_GZIP_MEMBERS:
                    raise wire.invalid(
                        f"the request body holds more than {MAX_GZIP_MEMBERS} gzip members; "
                        "send it compressed as one"
                    )
                inflater = zlib.decompressobj(window)
                parts.append(inflater.decompress(rest, room))
                room -= len(parts[-1])
                if room <= 0:
                    return None
                if not inflater.eof:
                    raise zlib.error("the stream ends early")
                rest = inflater.unused_data
                if not rest:
                    return b"".join(parts)
                if window != DEFLATE_WINDOWS["gzip"][0]:
                    raise zlib.error("bytes after the stream's end")
        except zlib.error:
            continue
    raise zlib.error("no window reads the body whole")


# What is wrong with a request aiohttp's parser refused, by the parser's exception (its own
# messages quote the request's bytes); any other: UNPARSED_OTHER.
UNPARSED = (
    (LineTooLong, "its URL or a header line is too long"),
    (BadHttpMethod, "its method is not one HTTP defines"),
)
UNPARSED_OTHER = (
    "it is not valid HTTP/1.1 (its request line, a header, or its body's Content-Length, "
    "Transfer-Encoding or chunks)"
)


class OpenAIErrorHandler(RequestHandler):
    """aiohttp's connection handler, whose own answers (a request its parser refuses, a handler
    that raised) are OpenAI's error shape without the request's bytes, not aiohttp's text.
    `ended` runs as its connection ends (None: nothing to run); `errored` is told of each of
    its own answers (the request, its status), which no handler reported."""

    ended: Callable[[], None] | None = None
    errored: Callable[[BaseRequest, int], None] | None = None

    def connection_lost(self, exc: BaseException | None) -> None:
        try:
            super().connection_lost(exc)
        finally:
            if self.ended is not None:
                self.ended()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if a response began
        if status >= 500:
            err = wire.HttpError(status, "server_error", "the gateway failed to answer the request")
        else:
            what = next((text for kind, text in UNPARSED if isinstance(exc, kind)), UNPARSED_OTHER)
            err = wire.HttpError(
                status, "invalid_request_error", f"the HTTP request could not be read: {what}"
            )
        if self.errored is not None:
            self.errored(request, status)
        response = error_response(err)
        response.force_close()
        return response


class OpenAIErrorServer(web.Server):
    """aiohttp's Server, whose connections are OpenAIErrorHandlers (each told `errored`)."""

    errored: Callable[[BaseRequest, int], None] | None = None

    def __call__(self) -> OpenAIErrorHandler:
        handler = OpenAIErrorHandler(self, loop=self._loop, **self._kwargs)
        handler.errored = self.errored
        return handler


class OpenAIErrorRunner(web.AppRunner):
    """An AppRunner whose connections are OpenAIErrorHandlers."""

    async def _make_server(self) -> web.Server:
        # The Application builds the Server with its own settings; only the class changes.
        server = await super()._make_server()
        server.__class__ = OpenAIErrorServer
        return server


class RefusedConnection(asyncio.Protocol):
    """A connection over max_connections: the refusal is written as it is accepted (over TLS,
    once its handshake is done), then what the client sends is read and dropped until it closes
    or LINGER_S passes; a plaintext one's sending side is closed after the answer. Closed with
    its request unread, the connection would be reset and the client would lose the answer (the
    openai SDK then sees a connection error, not the 503 and its retry hint). `linger` False:
    closed after the answer (past MAX_LINGERING). `ended` runs as its connection ends."""

    def __init__(self, answer: bytes, linger: bool) -> None:
        self._answer = answer
        self._linger = linger
        self._timer: asyncio.TimerHandle | None = None
        self.ended: Callable[[], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are no asyncio.WriteTransport subclasses (isinstance is False).
        transport = cast(asyncio.WriteTransport, transport)
        transport.write(self._answer)
        if not self._linger:
            transport.close()
            return
        if transport.can_write_eof():  # not over TLS: its client closes once it has the answer
            transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(LINGER_S, transport.abort)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.ended is not None:
            self.ended()


class AbortedConnection(asyncio.Protocol):
    """A TLS connection refused past MAX_LINGERING: closed as it is accepted, no handshake."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.WriteTransport, transport).abort()


class TlsConnection(sslproto.SSLProtocol):
    """asyncio's server side of a TLS connection (what create_server(ssl=...) makes), which runs
    `ended` when the connection ends: asyncio tells the application's protocol nothing of a
    connection whose handshake failed or timed out."""

    def __init__(
        self,
        app: asyncio.Protocol,
        context: ssl_module.SSLContext,
        handshake_timeout_s: float,
        ended: Callable[[], None],
    ) -> None:
        # No waiter (typeshed asks for one; asyncio takes None): a waiter that holds a failed
        # handshake's exception, never read, would be logged as it is collected. typeshed's
        # timeout is an int; asyncio takes seconds as a float.
        super().__init__(
            asyncio.get_running_loop(),
            app,
            context,
            None,  # type: ignore[arg-type]
            server_side=True,
            ssl_handshake_timeout=handshake_timeout_s,  # type: ignore[arg-type]
        )
        self._ended = ended

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        self._ended()


def connection_refusal(max_connections: int) -> bytes:
    """The whole HTTP answer to a connection over `max_connections`."""
    err = wire.HttpError(
        503,
        "service_unavailable_error",
        f"the gateway holds as many HTTP connections as it takes ({max_connections}, its [http] "
        "max_connections); retry shortly, and reuse connections (HTTP keep-alive)",
        retry_after_ms=UNAVAILABLE_RETRY_MS,
    )
    body = wire.dumps(wire.error_body(err))
    assert err.retry_after_ms is not None
    headers = {
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),
        **retry_headers(err.retry_after_ms),
        "Connection": "close",
    }
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return f"HTTP/1.1 503 Service Unavailable\r\n{head}\r\n".encode() + body


class BoundedSite(web.TCPSite):
    """A TCPSite that holds at most `max_connections` connections, and refuses one more with a
    RefusedConnection (at most MAX_LINGERING linger at once), counted in `refused`. A connection
    is counted from its accept to its end (over TLS, its handshake included): aiohttp knows a
    connection only once its handshake is done, and only after every connection accepted in the
    same pass of the event loop was let in. TLS handshakes are bounded by the client timeout
    (asyncio's default is 60 s). aiohttp offers neither setting."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        ssl: ssl_module.SSLContext | None,
        timeout_s: float,
        max_connections: int,
        refused: Counters | None,
    ) -> None:
        super().__init__(runner, host, port)
        self._tls = ssl
        self._timeout_s = timeout_s
        self._max_connections = max_connections
        self._answer = connection_refusal(max_connections)
        self._refused = refused
        # Connections held (accepted, not ended) and refused ones lingering.
        self.held = 0
        self.lingering = 0

    def _accept(self) -> asyncio.BaseProtocol:
        """The protocol of a connection just accepted (the listener's protocol factory)."""
        if self.held < self._max_connections:
            server = self._runner.server
            assert isinstance(server, OpenAIErrorServer)
            self.held += 1
            return self._ended(server(), self._end_held)
        if self._refused is not None:
            self._refused.inc(())
        if self.lingering < MAX_LINGERING:
            self.lingering += 1
            return self._ended(RefusedConnection(self._answer, True), self._end_lingering)
        if self._tls is not None:
            return AbortedConnection()
        return RefusedConnection(self._answer, False)

    def _ended(
        self, app: OpenAIErrorHandler | RefusedConnection, ended: Callable[[], None]
    ) -> asyncio.BaseProtocol:
        """`app` as the protocol of its connection (in TLS when configured), which runs `ended`
        once, as the connection ends, whatever ends it."""
        if self._tls is None:
            app.ended = ended
            return app
        return TlsConnection(app, self._tls, self._timeout_s, ended)

    def _end_held(self) -> None:
        self.held -= 1

    def _end_lingering(self) -> None:
        self.lingering -= 1

    async def start(self) -> None:
        await web.BaseSite.start(self)
        # Plaintext at the listener: _accept wraps a connection in TLS itself.
        self._server = await asyncio.get_running_loop().create_server(
            self._accept, self._host, self._port, backlog=self._backlog
        )
        self._bound_port = self._server.sockets[0].getsockname()[1]


async def _finish(replies: AsyncIterator[Reply]) -> None:
    """Runs the pipeline past its Final: the answer is stored in the cache and the request
    reported there (closing the stream early would count it as cancelled)."""
    async for _ in replies:
        pass


def retry_headers(retry_after_ms: int) -> dict[str, str]:
    # Retry-After is whole seconds; the openai SDK reads retry-after-ms first.
    return {
        "Retry-After": str(max(1, math.ceil(retry_after_ms / 1000))),
        "retry-after-ms": str(retry_after_ms),
    }


def cross_origin(request: web.Request) -> wire.HttpError | None:
    """The 403 of a request that changes something, sent by a browser for a page of another
    origin (None: a safe method, the server's own origin, or no browser). Go's net/http
    CrossOriginProtection: Sec-Fetch-Site when the browser sends it, else Origin against Host."""
    if request.method in SAFE_METHODS:
        return None
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None:
        if site in SAME_ORIGIN_SITES:
            return None
        why = f"the browser sent it for a page of another origin (Sec-Fetch-Site: {echo(site)})"
    else:
        origin = request.headers.get("Origin")
        if origin is None:
            return None
        # The Host header itself: aiohttp's request.host, without one, asks DNS (getfqdn).
        host = request.headers.get("Host", "")
        try:
            if urllib.parse.urlsplit(origin).netloc == host:
                return None
        except ValueError:
            pass
        why = f"its Origin {echo(origin)} is not the host it was sent to ({echo(host)})"
    return wire.HttpError(
        403,
        "permission_denied_error",
        f"cross-origin request refused: {why}. Call this API from a server (or a client that "
        "is no browser), not from a web page of another origin",
        code="cross_origin_request",
    )


def loopback_host(host: str) -> bool:
    """Whether a Host header names this host by a loopback name (localhost, 127.0.0.0/8, [::1]),
    with or without a port or the root's trailing dot."""
    name, port = (host, "") if host.endswith("]") or ":" not in host else host.rsplit(":", 1)
    if port and not (port.isascii() and port.isdigit()):
        return False
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    elif ":" in name:
        return False
    elif name.endswith("."):
        name = name[:-1]  # the fully qualified spelling, "localhost."
    return bool(name) and is_loopback(f"[{name.lower()}]:0")


def foreign_host(request: web.Request) -> wire.HttpError | None:
    """The 403 of a request to a gateway without API keys on a loopback address whose Host is no
    loopback name: a web page whose name was made to resolve to 127.0.0.1 (DNS rebinding) is of
    the gateway's origin for the browser, which would let it read the answers."""
    host = request.headers.get("Host", "")
    if loopback_host(host):
        return None
    return wire.HttpError(
        403,
        "permission_denied_error",
        f"this gateway has no API keys and answers only requests sent to a loopback name "
        f"(localhost, 127.0.0.1, [::1]), not to {echo(host)}: call it at "
        "http://127.0.0.1:PORT, or configure API keys ([auth] keys_file)",
        code="host_not_loopback",
    )


def error_response(err: wire.HttpError, retry_after_ms: int | None = None) -> web.Response:
    if retry_after_ms is None:
        retry_after_ms = err.retry_after_ms
    headers = {}
    if err.status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="appliance"'
    if retry_after_ms is not None:
        headers.update(retry_headers(retry_after_ms))
    return web.Response(
        status=err.status,
        body=wire.dumps(wire.error_body(err)),
        content_type="application/json",
        headers=headers,
    )


class HttpApi:
    def __init__(
        self,
        pipeline: Pipeline,
        health_servicer: health.aio.HealthServicer,
        service_name: str,
        config: HttpConfig,
        tls: ServerTls | None = None,
        mutual_tls: bool = False,
        refused_connections: Counters | None = None,
        refused_requests: Counters | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.config = config
        # The public API's TLS (the same [tls] files as the gRPC port; None: plaintext).
        self.tls = tls
        self.mutual_tls = mutual_tls
        # Connections refused over max_connections (a metric; None: not counted).
        self._refused_connections = refused_connections
        # Requests refused with 403 before they became requests, by reason (None: not counted),
        # and their throttled log lines.
        self._refused_requests = refused_requests
        self._refusal_logs = {reason: Throttled(log) for reason in REFUSAL_LINES}
        # Requests must name a loopback host (foreign_host): no API keys, on a loopback address.
        # On another one keys are required unless `[auth] allow_anonymous`, which lets anyone in.
        self._loopback_only = (
            not pipeline.access.required
            and config.listen is not None
            and is_loopback(config.listen)
        )
        self._health = health_servicer
        self._service = service_name
        self._created = int(time.time())
        self._active = 0
        # Bytes of the bodies being read and decoded now (BODY_BUDGET).
        self.reading = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False
        app = web.Application(
            client_max_size=config.max_body_bytes, middlewares=[self._openai_errors]
        )
        app.router.add_post(
            "/v1/chat/completions", self.chat_completions, expect_handler=self._expect
        )
        app.router.add_post("/v1/completions", self.completions, expect_handler=self._expect)
        # A route reading no body asks for none; aiohttp's own handler would answer an unmet
        # expectation in plain text quoting it, unreported (_unmet_expectation).
        app.router.add_get("/v1/models", self.models, expect_handler=self._unmet_expectation)
        # A model's name may hold slashes (Hugging Face's org/name), sent encoded or as they are.
        app.router.add_get(
            "/v1/models/{model:.+}", self.model, expect_handler=self._unmet_expectation
        )
        app.router.add_get("/health", self.health, expect_handler=self._unmet_expectation)
        # handle_signals=False: the gateway owns SIGTERM/SIGINT (drain). handler_cancellation:
        # a client's disconnect cancels its handler and so its pipeline stream. keepalive_timeout
        # also closes a connection that sends no complete request head in time. shutdown_timeout:
        # what close() leaves running after its grace is cancelled this much later.
        # auto_decompress=False: `_body` inflates, so every Content-Encoding reaches one check
        # (aiohttp's parser refused br and zstd itself, in plain text, asking for a library).
        self._decoder = json_body.BodyDecoder()
        self._runner = OpenAIErrorRunner(
            app,
            handle_signals=False,
            access_log=None,
            handler_cancellation=True,
            keepalive_timeout=config.client_timeout_s,
            shutdown_timeout=1.0,
            auto_decompress=False,
        )
        quiet_http_server_log()
        self._site: BoundedSite | None = None
        self.port = 0

    async def start(self) -> int:
        """Listens on `config.listen`; returns the bound port. OSError when it cannot."""
        assert self.config.listen is not None
        host, _, port = self.config.listen.rpartition(":")
        await self._runner.setup()
        server = self._runner.server
        assert isinstance(server, OpenAIErrorServer)
        server.errored = self._report_error
        site = BoundedSite(
            self._runner,
            host.strip("[]"),
            int(port),
            self.tls.ssl_context() if self.tls is not None else None,
            self.config.client_timeout_s,
            self.config.max_connections,
            self._refused_connections,
        )
        try:
            await site.start()
        except OSError:
            await self._runner.cleanup()
            raise
        self._site = site
        self.port = site.port
        return self.port

    @property
    def connections(self) -> int:
        """HTTP connections held now (max_connections bounds them)."""
        return self._site.held if self._site is not None else 0

    async def wait_idle(self) -> None:
        await self._idle.wait()

    async def close(self, grace_s: float) -> None:
        """Stops listening and refuses new requests on open connections (503), lets running
        ones finish for up to grace_s, then closes every connection."""
        self.draining = True
        if self._site is not None:
            await self._site.stop()
        try:
            await asyncio.wait_for(self.wait_idle(), grace_s)
        except TimeoutError:
            log.warning("HTTP requests still running after %.1f s; ending them", grace_s)
        await self._runner.cleanup()
        self._decoder.close()

    # -- routes -----------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def models(self, request: web.Request) -> web.Response:
        refused = self._unauthenticated(self._credentials(request))
        if refused is not None:
            return error_response(refused)
        return web.json_response(wire.model_list(sorted(self.pipeline.models), self._created))

    async def model(self, request: web.Request) -> web.Response:
        refused = self._unauthenticated(self._credentials(request))
        if refused is not None:
            return error_response(refused)
        name = request.match_info["model"]
        if name not in self.pipeline.models:
            return error_response(wire.unknown_model(sorted(self.pipeline.models)))
        return web.json_response(wire.model_entry(name, self._created))

    def _unauthenticated(self, credentials: Credentials) -> wire.HttpError | None:
        """The 401 of a request whose credentials the gateway's keys do not know (None: known, or
        no keys configured). Listing models needs a valid key, no particular scope; a generation
        is admitted before its body is read (_admit; the pipeline then checks its scope)."""
        try:
            self.pipeline.access.authenticate(credentials)
        except RequestError as exc:
            return wire.error_of(exc)
        return None

    async def health(self, request: web.Request) -> web.Response:
        """What grpc.health.v1 answers for the gateway, or for one model with ?model=NAME. Its
        503 or 404 is a probe's answer, which refuses nothing: no access line, not counted."""
        request[REPORTED] = True
        model = request.query.get("model")
        service = ""
        if model is not None:
            if model not in self.pipeline.models:
                return web.json_response({"status": "SERVICE_UNKNOWN"}, status=404)
            service = health_name(self._service, model)
        reply = await self._health.Check(health_pb2.HealthCheckRequest(service=service), None)
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        return web.json_response({"status": name}, status=200 if serving else 503)

    def _refused_host(self, request: web.Request) -> wire.HttpError | None:
        return foreign_host(request) if self._loopback_only else None

    def _count_refusal(self, request: web.Request, reason: str) -> None:
        """A 403 before the request became one: counted by reason, and logged at most once an
        interval per reason, naming the peer and none of the client's header values."""
        if self._refused_requests is not None:
            self._refused_requests.inc((reason,))
        self._refusal_logs[reason].warning(REFUSAL_LINES[reason], request.remote)

    @web.middleware
    async def _openai_errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every error answer the pipeline did not report is reported once (_report_error)."""
        request[RECEIVED] = time.monotonic_ns()
        response = await self._answer_or_refuse(request, handler)
        if response.status >= 400:
            self._report_error(request, response.status)
        return response

    async def _answer_or_refuse(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """aiohttp's own refusals (no such route, wrong method) in OpenAI's error shape, and a
        request to a foreign host name (foreign_host)."""
        refused = self._refused_host(request)
        if refused is not None:
            self._count_refusal(request, REFUSED_HOST)
            return error_response(refused)
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = f"{request.method} {request.path}: {exc.reason}"
            if exc.status in (404, 405):
                message += (
                    "; this server offers POST /v1/chat/completions, POST /v1/completions, "
                    "GET /v1/models, GET /health"
                )
            kind = "invalid_request_error" if exc.status < 500 else "server_error"
            response = error_response(wire.HttpError(exc.status, kind, message))
            if "Allow" in exc.headers:  # a 405 names the methods its route takes (RFC 9110)
                response.headers["Allow"] = exc.headers["Allow"]
            return response

    # -- generation -------------------------------------------------------------------------

    async def _expect(self, request: web.Request) -> web.Response | None:
        """`Expect: 100-continue`: the body is asked for (aiohttp's answer) only when the handler
        will read it; otherwise the handler's refusal (503, 401, 403, 413, 429) is the only
        answer and the client never sends the body."""
        if (unmet := await self._unmet_expectation(request)) is not None:
            return unmet
        if (
            self.draining
            or self._refused_host(request) is not None
            or cross_origin(request) is not None
            or not self.pipeline.access.would_admit(
                self._credentials(request), (GENERATE, CACHE_ONLY)
            )
            or self._declared_too_large(request)
            or self._over_budget(request)
        ):
            return None
        await _default_expect_handler(request)
        return None

    async def _unmet_expectation(self, request: web.Request) -> web.Response | None:
        """An HTTP/1.1 `Expect` other than 100-continue: 417 in OpenAI's shape, its value not
        quoted, reported as every error answer is (it is answered before the middleware runs);
        None for any other request."""
        expect = request.headers.get("Expect", "")
        if request.version != HttpVersion11 or expect.lower() == "100-continue":
            return None
        self._report_error(request, 417)
        return error_response(
            wire.HttpError(
                417,
                "invalid_request_error",
                "the request's Expect header is not 100-continue, the one expectation this "
                "server meets; omit it",
            )
        )

    def _declared_too_large(self, request: web.Request) -> bool:
        length = request.content_length
        return length is not None and length > self.config.max_body_bytes

    def _body_size(self, request: web.Request) -> int:
        """What reading and decoding the body may hold: its Content-Length, or the limit."""
        length = request.content_length
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if length is None or encoding != "identity":
            return self.config.max_body_bytes
        return min(length, self.config.max_body_bytes)

    def _over_budget(self, request: web.Request) -> bool:
        budget = BODY_BUDGET * self.config.max_body_bytes
        return self.reading + self._body_size(request) > budget

    async def _read(self, request: web.Request) -> dict[str, Any]:
        """The body decoded, read within BODY_BUDGET."""
        if self._declared_too_large(request):  # the client's fault, before any overload
            raise self._too_large()
        if self._over_budget(request):
            raise wire.HttpError(
                429,
                "rate_limit_error",
                "the gateway is reading as many request bodies as it holds at once; retry shortly",
                retry_after_ms=BODY_RETRY_MS,
            )
        size = self._body_size(request)
        self.reading += size
        try:
            return await self._decode(await self._body(request))
        finally:
            self.reading -= size

    def _too_large(self) -> wire.HttpError:
        return wire.HttpError(
            413,
            "invalid_request_error",
            f"the request body is larger than {self.config.max_body_bytes} bytes "
            "(the gateway's [http] max_body_bytes)",
        )

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if self.draining:  # refused like every request the drain turns away: a retry hint
            refusal = stopping()
            return error_response(wire.error_of(refusal), refusal.retry_after_ms)
        self._active += 1
        self._idle.clear()
        credentials = self._credentials(request)
        grant: Grant | None = None
        try:
            try:
                refused = cross_origin(request)
                if refused is not None:
                    self._count_refusal(request, REFUSED_CROSS_ORIGIN)
                    raise refused
                # Nothing of the body is read for a key the gateway does not know, one over its
                # rate limits, or one that may not generate at all; the scope and namespace the
                # body names are the pipeline's to check.
                grant = self._admit(request, credentials)
                http = wire.parse_request(await self._read(request), chat)
                if not http.request.request_id:
                    # The client's (or its proxy's) id when the body sets none and it is one
                    # the gateway can carry; an unusable one is ignored, never a refusal.
                    header_id = request.headers.get("X-Request-Id", "")
                    usable = valid_request_id(header_id)
                    http.request.request_id = header_id if usable else new_request_id()
            except wire.HttpError as err:
                return error_response(err)
            # OpenAI's answer that is a tool call carries no text: the pipeline holds it back.
            request[REPORTED] = True  # by the pipeline, whatever way it ends
            replies = self.pipeline.run(
                http.request,
                http.deadline_s,
                credentials,
                front_end="http",
                hold_call_text=True,
                admitted=grant,
            )
            assert isinstance(replies, AsyncGenerator)  # closed below, whatever happens
            try:
                return await self._answer(request, http, replies)
            finally:
                await replies.aclose()
        finally:
            if grant is not None:
                grant.release()  # the pipeline's once it ran; not when the body was refused
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    def _admit(self, request: web.Request, credentials: Credentials) -> Grant:
        """AccessControl.admit for a generation, whose body says which scope it needs. A refusal
        of a known key (its rate limits, its scopes) is reported with its key id; an unknown
        key's with none, as every route's 401."""
        try:
            return self.pipeline.access.admit(credentials, (GENERATE, CACHE_ONLY))
        except RequestError as exc:
            request[REPORTED] = True
            known = exc.code != grpc.StatusCode.UNAUTHENTICATED
            key_id = credentials.claimed_key_id() if known else ""
            self.pipeline.refused("http", exc.code.name, request[RECEIVED], key_id)
            err = wire.error_of(exc)
            err.retry_after_ms = exc.retry_after_ms
            raise err from None

    def _credentials(self, request: web.Request) -> Credentials:
        """What the request presents, read as the gRPC service reads its metadata: a Bearer key
        from `Authorization` (present but not Bearer: an invalid key), else, under mutual TLS,
        the verified client certificate's names."""
        header = request.headers.get("Authorization")
        if header is not None:
            return Credentials(bearer_token(header) or "")
        if self.mutual_tls and request.transport is not None:
            return Credentials(None, peercert_names(request.transport.get_extra_info("peercert")))
        return Credentials(None)

    async def _body(self, request: web.Request) -> bytes:
        if request.content_type in FORM_TYPES:
            raise wire.HttpError(
                415,
                "invalid_request_error",
                f"Content-Type {echo(request.content_type)} is not a JSON request; send the body "
                "as JSON with Content-Type: application/json",
            )
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in BODY_ENCODINGS:
            raise wire.HttpError(
                415,
                "invalid_request_error",
                f"Content-Encoding {echo(encoding)} is not accepted; send the body as one of "
                f"{', '.join(BODY_ENCODINGS)}",
            )
        too_large = self._too_large()
        try:
            async with asyncio.timeout(self.config.client_timeout_s):
                body = await request.read()
            if encoding == "identity":
                return body
            inflated = _inflate(body, DEFLATE_WINDOWS[encoding], self.config.max_body_bytes)
            if inflated is None:
                raise too_large
            return inflated
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        except (RequestPayloadError, zlib.error):
            raise wire.invalid(
                f"the request body is not valid for its Content-Encoding {echo(encoding)}; send "
                "it uncompressed, or compressed as Content-Encoding says"
            ) from None
        except TimeoutError:
            raise wire.HttpError(
                408,
                "invalid_request_error",
                f"the request body did not arrive within {self.config.client_timeout_s:g} s",
            ) from None

    async def _decode(self, body: bytes) -> dict[str, Any]:
        try:
            return await self._decoder.decode(body)
        except json_body.BodyError as exc:
            raise wire.invalid(str(exc)) from None
        except json_body.BodyBusy as exc:
            raise wire.HttpError(
                503, "service_unavailable_error", str(exc), retry_after_ms=UNAVAILABLE_RETRY_MS
            ) from None

    def _report_error(self, request: BaseRequest, status: int) -> None:
        """An error answer the pipeline did not report (a refusal before it, a request that was
        never a generation, one the HTTP parser refused) is reported once, as the pipeline
        reports its own: an access line and appliance_requests_total, model `unknown`, the
        status as gRPC names it (WIRE_STATUS)."""
        if request.get(REPORTED):
            return
        request[REPORTED] = True
        code = WIRE_STATUS.get(status, grpc.StatusCode.INVALID_ARGUMENT)
        self.pipeline.refused("http", code.name, request.get(RECEIVED, time.monotonic_ns()))

    async def _answer(
        self,
        request: web.Request,
        http: wire.HttpRequest,
        replies: AsyncIterator[Reply],
    ) -> web.StreamResponse:
        # The first reply decides the status line: refusals before it are HTTP errors.
        try:
            reply = await anext(replies)
        except RequestError as exc:
            return self._refused(http, exc)
        answer = wire.Answer(http, http.request.request_id, int(time.time()))
        if http.stream:
            return await self._stream(request, answer, reply, replies)
        text: list[str] = []
        logprobs: list[TokenLogprob] = []
        try:
            while isinstance(reply, Delta):
                text.append(reply.text)
                if reply.logprobs:
                    logprobs += reply.logprobs
                reply = await anext(replies)
        except RequestError as exc:
            return self._refused(http, exc)
        await _finish(replies)
        return web.Response(
            body=wire.dumps(answer.whole("".join(text), reply, logprobs)),
            content_type="application/json",
            headers={"X-Request-Id": answer.request_id},
        )

    def _refused(self, http: wire.HttpRequest, exc: RequestError) -> web.Response:
        err = wire.error_of(exc, http.chat, http.guide_field, http.max_tokens_field)
        return error_response(err, exc.retry_after_ms)

    async def _stream(
        self,
        request: web.Request,
        answer: wire.Answer,
        reply: Reply,
        replies: AsyncIterator[Reply],
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": answer.request_id})
        await response.prepare(request)
        out = answer.first_chunk(reply)
        try:
            try:
                while isinstance(reply, Delta):
                    answer.count(reply)
                    if reply.text or reply.logprobs:
                        out += answer.chunk(reply.text, reply.logprobs or ())
                    if out:
                        await self._write(request, response, out)
                        out = b""
                    reply = await anext(replies)
                if reply.tool_call is not None:
                    out += answer.call_chunk(reply.tool_call)
                await self._write(request, response, out + answer.last_chunks(reply))
                await _finish(replies)
            except RequestError as exc:
                # The status line is gone: the error travels as an event (the SDKs raise it).
                err = wire.error_of(exc)
                await self._write(request, response, out + wire.stream_error(err))
            await response.write_eof()
        except (StoppedReading, ConnectionResetError):
            # Its connection is aborted, or the client disconnected as a write began (aiohttp
            # refuses a write to a closing transport before the handler's cancellation is
            # delivered): the handler ends like one whose client disconnected (the pipeline's
            # stream is closed by the caller), not as a handler that failed.
            return response
        return response

    async def _write(self, request: web.Request, response: web.StreamResponse, data: bytes) -> None:
        """Writes, bounding the wait for a client that stopped reading (its buffers are full)."""
        transport = request.transport
        if transport is None or transport.get_write_buffer_size() == 0:
            await response.write(data)
            return
        try:
            async with asyncio.timeout(self.config.client_timeout_s):
                await response.write(data)
        except TimeoutError:
            log.warning(
                "HTTP client %s read nothing for %g s; disconnecting",
                request.remote,
                self.config.client_timeout_s,
            )
            transport.abort()
            raise StoppedReading from None
