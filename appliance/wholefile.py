"""Writing a file whole or not at all.

The data goes to a temporary file beside the target (its name starts with a dot and the target's
name, so globs such as node_exporter's `*.prom` skip it), which is then renamed over the target:
a reader sees the old file or the new one, never part of one, and a failure leaves no temporary
file behind. Each caller turns the OSError into its own message.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_whole"]


def write_whole(
    path: Path, data: bytes, mode: int | None = None, owner: tuple[int, int] | None = None
) -> None:
    """Replaces `path` with `data`; `mode`: its permissions (None: the temporary file's, 0600);
    `owner`: its (uid, gid) (None: the writer's). An OSError names `path`."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(path)) from err
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if owner is not None:
                os.fchown(f.fileno(), *owner)
            if mode is not None:
                os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise
