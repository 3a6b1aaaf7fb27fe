"""Whether a listen address (HOST:PORT, or a Unix socket's path) can be taken, asked before a
server binds it.

gRPC's own refusal of a taken port writes a line of its own to stderr (from its C core) besides the
exception, so a CLI that lets gRPC find out prints two lines; and a server that loads a model first
finds out only after the load.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
from pathlib import Path

# Bytes of a Unix socket's path (sun_path holds 108 with the terminating NUL).
UNIX_PATH_MAX = 107


def is_address(value: object, any_port: bool = False) -> bool:
    """Whether `value` is a HOST:PORT string with a port from 1 to 65535 (`any_port`: or 0, a
    listen address whose port the system picks)."""
    host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    digits = port.isascii() and port.isdigit()  # "²".isdigit() is True; int() refuses it
    return bool(sep and host and digits and (0 if any_port else 1) <= int(port) < 65536)


def taken_address(listen: str) -> str | None:
    """ "cannot listen on HOST:PORT: <reason>" when another process holds the port (or it is
    privileged and we are not), the name does not resolve, or none of its addresses is this
    host's; None otherwise. Other faults (an address family the host lacks beside one it has)
    are left to gRPC, which binds what it can."""
    host, _, port = listen.rpartition(":")
    try:
        addresses = socket.getaddrinfo(
            host.strip("[]") or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        return f"cannot listen on {listen}: {exc.strerror}"
    except (OSError, ValueError):
        return None
    not_ours: list[str] = []
    for family, kind, proto, _, address in addresses:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:
            # A family this host lacks (IPv6 on a kernel without it): gRPC binds the others, and
            # `[::]` as 0.0.0.0.
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                    return f"cannot listen on {listen}: {exc.strerror}"
                if exc.errno == errno.EADDRNOTAVAIL:
                    not_ours.append(exc.strerror or str(exc))
    if addresses and len(not_ours) == len(addresses):
        return f"cannot listen on {listen}: {not_ours[0]} (not an address of this host)"
    return None


def first_taken(*listens: str | None) -> str | None:
    """`taken_address` of the first of a process's listen addresses that has a problem (None:
    an address not configured), or None."""
    return next((t for a in listens if a is not None and (t := taken_address(a))), None)


def socket_path_problem(path: Path) -> str | None:
    """Why `path` cannot name a Unix socket (too long for sun_path), or None."""
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        return f"{path} is longer than a Unix socket's path may be ({UNIX_PATH_MAX} bytes)"
    return None


def lock_path(path: Path) -> Path:
    """The lock file beside socket `path`: a server holds it locked while it serves the path,
    so two servers started at once cannot both take it (looking for a live server and binding
    are two steps). It is left in place when the server stops."""
    return path.with_name(path.name + ".lock")


def locked_for_this_process(path: Path) -> int | None:
    """A descriptor of `path`'s lock file, locked for this process; None when another process
    holds it."""
    fd = os.open(lock_path(path), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def serving_problem(path: Path, locked: bool = False) -> str | None:
    """Why a server cannot take `path`: its folder is missing or not writable, another process
    serves it, or it is not a socket. None when it is free or holds the socket of a server that
    died, which `start` replaces. `locked`: this process holds the path's lock."""
    if not path.parent.is_dir():
        return f"its folder {path.parent} does not exist"
    if not os.access(path.parent, os.W_OK | os.X_OK):
        return f"this user cannot create files in {path.parent}"
    if not locked and lock_path(path).exists():
        fd = locked_for_this_process(path)
        if fd is None:
            return "another process serves it"
        os.close(fd)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(mode):
        return "it exists and is not a socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return None
            return exc.strerror or str(exc)
    return "another process serves it"
