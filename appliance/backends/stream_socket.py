"""`ModelStreamInfer` over a Unix socket: the engine server's stream socket, both ends.

A gRPC hop costs each end HTTP/2 framing and grpc.aio's call machinery for every message: a bare
grpc.aio relay adds about as much to a call as the call itself costs, a relay over a Unix socket with
length-prefixed messages a small part of that (`bench/streaming.py`). So the engine server can also
serve its streams here (`appliance engine --stream-socket PATH`), and the gateway sends its
generations there (`stream_socket` of a model) while readiness and configuration stay on gRPC.
Closing a connection is a stream's cancellation, so no `stop=true` request follows it. Triton has no
such socket.

The protocol carries Triton's messages unchanged:
- the client opens with `PREAMBLE`; then every message, either way, is its length as 4 bytes
  little-endian and a serialized protobuf: `ModelInferRequest` from the client,
  `ModelStreamInferResponse` from the server;
- one connection is one stream, with a gRPC stream's semantics: requests one after another,
  responses in-band, and closing the connection cancels whatever runs on it;
- a message over the receiving end's limit, a bad preamble or bytes that do not parse close the
  connection, as does a message that stops partway (`FRAME_TIMEOUT_S`); a connection past
  `MAX_CONNECTIONS` is closed when it opens.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import logging
import os
import socket
import struct
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as ts

from appliance.backends.base import BackendError
from appliance.listen import locked_for_this_process, serving_problem
from appliance.logline import Throttled

log = logging.getLogger(__name__)

PREAMBLE = b"appliance-stream-socket/1\n"
_LENGTH = struct.Struct("<I")
# Responses read ahead of the reader, at most; past that the socket is read no further.
INBOX_FRAMES = 256
# A connection that sends no complete preamble in this long is dropped; so is one whose message
# (its length read) does not arrive whole in this long. Between messages a connection may idle:
# the gateway keeps streams open between requests.
PREAMBLE_TIMEOUT_S = 5.0
FRAME_TIMEOUT_S = 5.0
# Generations a gateway may send an engine at once (its model's max_in_flight), and connections
# served at once: a gateway opens one per generation and keeps a few idle, and each holds up to
# a message's bytes while it arrives; the room is for kept streams and a second gateway.
GENERATIONS_MAX = 1024
MAX_CONNECTIONS = 4 * GENERATIONS_MAX
# Connecting while the server's backlog is full: tries, and the wait before the n-th retry (n ×).
CONNECT_TRIES = 5
CONNECT_BACKOFF_S = 0.002


def frame(message: Any) -> bytes:
    payload: bytes = message.SerializeToString()
    return _LENGTH.pack(len(payload)) + payload


class FrameError(Exception):
    """The peer sent what this protocol does not allow; the connection is closed."""


def _checked_size(size: int, max_bytes: int) -> int:
    if size > max_bytes:
        raise FrameError(f"a message of {size} bytes (at most {max_bytes})")
    return size


async def _read_within(reader: asyncio.StreamReader, size: int, timeout_s: float) -> bytes:
    """`size` bytes, or TimeoutError when they do not arrive in `timeout_s`.

    A timer that fires late by half its time or more says this process's event loop was held
    (the peer cannot cause that), and its firing can win over bytes that arrived meanwhile and
    are not yet read. So the wait starts again instead of blaming the peer; an unfinished
    `readexactly` consumes nothing, so nothing is lost."""
    loop = asyncio.get_running_loop()
    while True:
        deadline = loop.time() + timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                return await reader.readexactly(size)
        except TimeoutError:
            if loop.time() - deadline < timeout_s / 2:
                raise


async def _read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    """The next message's payload, refused by its length prefix before its bytes are read."""
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    _checked_size(size, max_bytes)
    try:
        return await _read_within(reader, size, FRAME_TIMEOUT_S)
    except TimeoutError:
        raise FrameError(f"a message that stopped partway for {FRAME_TIMEOUT_S:g} s") from None


# A local client can open connections in a loop: one line per interval, with the count.
_refusals = Throttled(log)


def _log_refusal(exc: FrameError) -> None:
    _refusals.warning("stream socket: closed a connection that sent %s", exc)


class FrameParser:
    """Splits received bytes into message payloads, refusing one over `max_bytes` by its length
    prefix (before its bytes arrive)."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer
        buffer += data
        payloads: list[bytes] = []
        start = 0
        while len(buffer) - start >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(buffer, start)
            end = start + _LENGTH.size + _checked_size(size, self._max)
            if len(buffer) < end:
                break
            payloads.append(bytes(buffer[start + _LENGTH.size : end]))
            start = end
        del buffer[:start]
        return payloads


# --- the client: one stream, as much of grpc.aio's StreamStreamCall as TritonBackend uses ------


class SocketStream(asyncio.Protocol):
    """One stream on the socket at `path`; connects on its first write."""

    def __init__(self, path: str, max_bytes: int) -> None:
        self._path = path
        self._parser = FrameParser(max_bytes)
        self._transport: asyncio.Transport | None = None
        self._inbox: collections.deque[bytes] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._ended = False
        self._cancelled = False
        self._fault: str | None = None

    async def write(self, request: ts.ModelInferRequest) -> None:
        if self._ended:
            raise asyncio.InvalidStateError("the stream has ended")
        if self._transport is None:
            transport = await self._connect()
            transport.write(PREAMBLE + frame(request))
            return
        self._transport.write(frame(request))

    async def _connect(self) -> asyncio.Transport:
        loop = asyncio.get_running_loop()
        for attempt in range(1, CONNECT_TRIES + 1):
            try:
                transport, _ = await loop.create_unix_connection(lambda: self, self._path)
                break
            except OSError as exc:
                # EAGAIN: the server's backlog is full (a burst of new streams); nothing was
                # sent yet, so trying again is safe.
                if exc.errno == errno.EAGAIN and attempt < CONNECT_TRIES and not self._cancelled:
                    await asyncio.sleep(CONNECT_BACKOFF_S * attempt)
                    continue
                self._ended = True
                if self._cancelled:
                    raise asyncio.CancelledError() from None
                raise BackendError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"engine stream socket {self._path} unavailable: {exc.strerror or exc}",
                ) from None
        self._transport = transport
        if self._cancelled:  # cancelled while connecting: as grpc.aio's write of a cancelled call
            self._close()
            raise asyncio.CancelledError()
        return transport

    async def read(self) -> object:
        """The next response; grpc.aio.EOF once the server closed the connection; as grpc.aio's
        call, CancelledError once `cancel` was called."""
        while True:
            if self._cancelled:
                raise asyncio.CancelledError()
            if self._inbox:
                break
            if self._ended:
                if self._fault is not None:
                    raise BackendError(grpc.StatusCode.UNAVAILABLE, self._fault)
                return grpc.aio.EOF
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        payload = self._inbox.popleft()
        if self._paused and len(self._inbox) < INBOX_FRAMES // 2 and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        try:
            return ts.ModelStreamInferResponse.FromString(payload)
        except DecodeError:
            self._close()
            raise BackendError(
                grpc.StatusCode.UNAVAILABLE,
                f"engine stream socket {self._path} sent a message that is not a "
                "ModelStreamInferResponse",
            ) from None

    def cancel(self) -> bool:
        if self._ended:
            return False
        self._cancelled = True
        self._close()
        return True

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._ended

    def _close(self) -> None:
        self._ended = True
        if self._transport is not None:
            self._transport.close()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # asyncio.Protocol

    def data_received(self, data: bytes) -> None:
        try:
            payloads = self._parser.feed(data)
        except FrameError as exc:
            self._fault = f"engine stream socket {self._path} sent {exc}"
            self._close()
            return
        self._inbox.extend(payloads)
        if len(self._inbox) >= INBOX_FRAMES and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        if payloads:
            self._wake()

    def eof_received(self) -> bool:
        self._close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended = True
        self._wake()


# --- the server ----------------------------------------------------------------------------------

Streamer = Callable[
    [AsyncIterator[ts.ModelInferRequest]], AsyncGenerator[ts.ModelStreamInferResponse, None]
]


class SocketInUse(Exception):
    pass


class StreamSocketServer:
    """Serves `streamer` (one call per connection) on a Unix socket at `path`, readable and
    writable by the owner and group only."""

    def __init__(self, path: Path, streamer: Streamer, max_bytes: int) -> None:
        self.path = path
        self._streamer = streamer
        self._max = max_bytes
        self._server: asyncio.AbstractServer | None = None
        self._inode: int | None = None  # of the socket file this server made
        self._lock: int | None = None  # the locked lock file's descriptor while serving
        self._closing = False
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Raises SocketInUse (or OSError) when the path cannot be served."""
        problem = serving_problem(self.path)
        if problem is not None:
            raise SocketInUse(problem)
        self._lock = locked_for_this_process(self.path)
        if self._lock is None:
            raise SocketInUse("another process serves it")
        try:
            problem = serving_problem(self.path, locked=True)  # one that took no lock
            if problem is not None:
                raise SocketInUse(problem)
            self.path.unlink(missing_ok=True)  # a dead server's socket, if anything
            # A full backlog refuses a connect at once (EAGAIN): a burst of new streams waits.
            self._server = await asyncio.start_unix_server(
                self._accept, str(self.path), backlog=socket.SOMAXCONN
            )
            os.chmod(self.path, 0o660)
            self._inode = self.path.lstat().st_ino
        except BaseException:
            self._unlock()
            raise

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return len(self._connections)

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing:  # accepted before `close`, first run after it: never served
            writer.close()
            return
        if len(self._connections) >= MAX_CONNECTIONS:
            _refusals.warning("stream socket: closed a connection past %d open", MAX_CONNECTIONS)
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except FrameError as exc:
            _log_refusal(exc)
        except asyncio.CancelledError:
            # `close` cancelled it past its grace. The server owns this task and nothing awaits
            # it; ended cancelled, Python 3.11's streams would log it as an error.
            pass
        finally:
            self._connections.discard(task)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            preamble = await _read_within(reader, len(PREAMBLE), PREAMBLE_TIMEOUT_S)
        except TimeoutError:
            raise FrameError(f"no preamble in {PREAMBLE_TIMEOUT_S:g} s") from None
        if preamble != PREAMBLE:
            raise FrameError("a preamble of another protocol")
        pump = asyncio.current_task()
        assert pump is not None
        closed = False

        async def requests() -> AsyncIterator[ts.ModelInferRequest]:
            """The connection's requests; at its end (the client closed it, or sent what does
            not parse) whatever runs on it is cancelled, as a cancelled gRPC stream's is."""
            nonlocal closed
            try:
                while True:
                    payload = await _read_frame(reader, self._max)
                    try:
                        request = ts.ModelInferRequest.FromString(payload)
                    except DecodeError:
                        raise FrameError("a message that is not a ModelInferRequest") from None
                    yield request
            except FrameError as exc:  # raised here, it would fail the streamer's reader
                _log_refusal(exc)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                closed = True
                pump.cancel()

        responses = self._streamer(requests())
        awaitable = True
        try:
            async for response in responses:
                writer.write(frame(response))
                await writer.drain()
        except asyncio.CancelledError:
            if not closed:
                raise
            pump.uncancel()  # the connection's own end cancelled it, not its owner
        except GeneratorExit:  # this coroutine is being collected: nothing may be awaited
            awaitable = False
            raise
        finally:
            # The streamer's clean-up (cancelling what runs on the connection) runs now, not
            # when the collector finds it; a no-op where it ended by itself.
            if awaitable:
                await responses.aclose()

    async def close(self, grace_s: float) -> None:
        """Stops accepting; streams still open after `grace_s` are cancelled."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(FileNotFoundError):
            if self.path.lstat().st_ino == self._inode:  # not another server's since
                self.path.unlink()
        self._unlock()
        if self._connections:
            _, pending = await asyncio.wait(list(self._connections), timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
