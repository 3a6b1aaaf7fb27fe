"""systemd's notify protocol (Type=notify): READY, WATCHDOG, STOPPING and STATUS datagrams.

No libsystemd: the protocol is one datagram per message on the unix socket named by $NOTIFY_SOCKET
(a leading '@' is the abstract namespace). Outside systemd every call is a no-op.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket


def _address() -> str | None:
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return None
    return "\0" + path[1:] if path.startswith("@") else path


def notify(*fields: str) -> bool:
    """Sends `READY=1`, `STATUS=...` and the like in one datagram; False when not under systemd
    or when the message could not be queued.

    Never blocks: it runs on the event loop, and a receiver whose queue is full would otherwise
    stop the loop (and with it the service) inside a watchdog ping.
    """
    address = _address()
    if address is None:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.setblocking(False)
        try:
            sock.sendto("\n".join(fields).encode(), address)
        except (BlockingIOError, ConnectionRefusedError, FileNotFoundError):
            return False
    return True


def watchdog_interval() -> float | None:
    """Half of WatchdogSec= (systemd's advice), or None when no watchdog is set for this process."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2 / 1_000_000
    except ValueError:
        return None


async def watchdog_loop(interval: float) -> None:
    """Pings from the event loop itself, so a blocked loop stops pinging and systemd restarts us."""
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)


async def ready_until_signalled(status: str) -> None:
    """READY=1, the watchdog pings while serving, then STOPPING=1 once SIGTERM or SIGINT arrives."""
    notify("READY=1", f"STATUS={status}")
    interval = watchdog_interval()
    pinger = asyncio.ensure_future(watchdog_loop(interval)) if interval else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        notify("STOPPING=1", "STATUS=stopping")
        if pinger is not None:
            pinger.cancel()
