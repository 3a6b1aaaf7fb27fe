"""All file-system access goes through a root prefix.

Facts, plugins and state read and write ``/sys``, ``/proc`` and ``/etc`` relative to a root so the
same code runs on the real host (root ``/``) and on fixture trees in tests. Fixture trees are passive
files, so the kernel behaviours that matter to the tool are emulated here, and only for non-``/``
roots: sysfs *selector* files (``always [madvise] never``) that show the written choice in brackets,
and the per-path rules of ``<root>/.fixture-kernel``, one ``PATH [RULE]`` a line: no rule or an errno
name refuses the write with that error (EIO: managed IRQs; EBUSY, EINVAL, EPERM...), ``max=N`` keeps
at most N of a number written (huge pages the kernel could not all reserve). Callers see exactly
the ``OSError`` or value the kernel would give, so the handling above is the production path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path

KERNEL_MARKER = ".fixture-kernel"
_SELECTOR = re.compile(r"\[([^\]]+)\]")


class Root:
    """A directory that stands for ``/``."""

    def __init__(self, path: str | os.PathLike[str] = "/") -> None:
        self.base = Path(path)
        #: True when this root is the running system, where writes change the machine.
        self.is_host = self.base.resolve() == Path("/")
        self._rules: dict[str, str] | None = None

    def path(self, rel: str) -> Path:
        return self.base / rel.lstrip("/")

    def exists(self, rel: str) -> bool:
        return self.path(rel).exists()

    def read(self, rel: str) -> str | None:
        """Raw text, or None when absent or unreadable (sysfs attributes vanish with hot-plug)."""
        try:
            return self.path(rel).read_text()
        except (FileNotFoundError, NotADirectoryError, PermissionError, IsADirectoryError):
            return None
        except OSError as exc:
            # Some attributes (e.g. an unsupported cpufreq knob) raise EIO/EINVAL on read.
            if exc.errno in (errno.EIO, errno.EINVAL, errno.ENODEV, errno.EOPNOTSUPP):
                return None
            raise

    def read_value(self, rel: str) -> str | None:
        text = self.read(rel)
        return None if text is None else text.strip()

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            return self.path(rel).read_bytes()
        except OSError:
            return None

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(rel)))
        except OSError:
            return []

    def realpath(self, rel: str) -> str:
        """Resolve symlinks and answer as the host would see the path (root prefix removed)."""
        real = Path(os.path.realpath(self.path(rel)))
        base = self.base.resolve()
        try:
            return "/" + str(real.relative_to(base))
        except ValueError:
            return str(real)

    def write(self, rel: str, data: str) -> None:
        """Write an existing attribute or file in place; the kernel's OSError passes through."""
        target = self.path(rel)
        if not self.is_host:
            data = self._emulate_rule(rel, target, data)
            data = self._emulate_selector(target, data)
        with open(target, "w") as fh:
            fh.write(data)

    def create(self, rel: str, data: str, durable: bool = False) -> list[str]:
        """Write a file we own, creating parents; answer the directories created (for revert).

        The file is replaced whole (a reader sees the old or the new text); ``durable`` also
        flushes it and its directory to disk before answering, so a power cut keeps it.
        """
        target = self.path(rel)
        created: list[str] = []
        parent = target.parent
        missing: list[Path] = []
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        for d in reversed(missing):
            d.mkdir()
            created.append("/" + str(d.relative_to(self.base)))
        tmp = target.with_name(target.name + ".host-tune.tmp")
        with open(tmp, "w") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, target)
        if durable:
            self._sync_dir(target.parent)
        return created

    @staticmethod
    def _sync_dir(folder: Path) -> None:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def append(self, rel: str, data: str, durable: bool = False) -> None:
        """Append to a file we own in an existing directory; ``durable`` as for ``create``."""
        target = self.path(rel)
        new = not target.exists()
        with open(target, "a") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        if durable and new:  # the new file's name is on disk once its folder is
            self._sync_dir(target.parent)

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(rel).unlink()

    def rmdir_if_empty(self, rel: str) -> None:
        with contextlib.suppress(OSError):  # not empty: someone else put files there
            self.path(rel).rmdir()

    def _emulate_rule(self, rel: str, target: Path, data: str) -> str:
        if self._rules is None:
            marker = self.base / KERNEL_MARKER
            text = marker.read_text() if marker.exists() else ""
            self._rules = {}
            for line in text.splitlines():
                path, _, how = line.strip().partition(" ")
                if path:
                    self._rules[path.lstrip("/")] = how.strip() or "EIO"
        rule = self._rules.get(rel.lstrip("/"))
        if rule is None:
            return data
        if rule.startswith("max="):
            return f"{min(int(data), int(rule[4:]))}\n"
        code = getattr(errno, rule)
        raise OSError(code, os.strerror(code), str(target))

    @staticmethod
    def _emulate_selector(target: Path, data: str) -> str:
        try:
            current = target.read_text()
        except OSError:
            return data
        if not _SELECTOR.search(current):
            return data
        choice = data.strip()
        options = [o.strip("[]") for o in current.split()]
        if choice not in options:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(target))
        return " ".join(f"[{o}]" if o == choice else o for o in options) + "\n"


def selected(text: str | None) -> str | None:
    """The bracketed choice of a selector file (``always [madvise] never`` -> ``madvise``)."""
    if text is None:
        return None
    m = _SELECTOR.search(text)
    return m.group(1) if m else text.strip()
