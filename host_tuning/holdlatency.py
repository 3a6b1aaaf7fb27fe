"""Hold a PM QoS CPU latency request for as long as the process lives.

The kernel drops a ``/dev/cpu_dma_latency`` request when its file is closed, so a one-shot write
does nothing; a systemd unit runs this instead. The value is written as a binary s32, which every
kernel accepts (the hex-string form is a later addition).
"""

from __future__ import annotations

import os
import signal
import struct
import threading
from types import FrameType

DEFAULT_PATH = "/dev/cpu_dma_latency"
LATENCY_MAX_US = 2_000_000_000


def encode(us: int) -> bytes:
    if not 0 <= us <= LATENCY_MAX_US:
        raise ValueError("latency must be 0..2e9 microseconds")
    return struct.pack("i", us)


def hold(us: int, path: str = DEFAULT_PATH, stop: threading.Event | None = None) -> int:
    """Open, write, and block until SIGTERM/SIGINT (or ``stop``); the close releases the request."""
    stop = stop or threading.Event()
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, encode(us))
        if threading.current_thread() is threading.main_thread():

            def _stop(signum: int, frame: FrameType | None) -> None:
                stop.set()

            signal.signal(signal.SIGTERM, _stop)
            signal.signal(signal.SIGINT, _stop)
        while not stop.wait(3600):
            pass
    finally:
        os.close(fd)
    return 0
