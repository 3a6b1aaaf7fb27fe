"""Saved prior values, so revert restores exactly what apply found.

Kept under the root (``/var/lib/host-tune/state.json``). A key's prior value is saved once, at
its first change: applying again (or after drift) never overwrites the original.

Two scopes, as tuned keeps its runtime save state under ``/run`` and its persistent state under
``/var/lib``: files host-tune writes under ``/etc`` survive a reboot, so their prior values stay
valid; runtime kernel settings (sysctls, sysfs attributes, IRQ affinities, NIC settings) are back
at what the kernel starts with after a reboot, and IRQ numbers are handed out again. The state
records the boot id (``/proc/sys/kernel/random/boot_id``) its runtime values were saved at; after a
reboot they are stale (see ``host_tuning.actions``). One file keeps both, so ``StateDirectory=``
and the lock stay as they are.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from host_tuning.rootfs import Root

STATE_DIR = "/var/lib/host-tune"
STATE_FILE = f"{STATE_DIR}/state.json"
#: Entries apply added since it last wrote STATE_FILE, one JSON line each, appended before their
#: setting is written (rewriting the whole file per setting is quadratic on a many-CPU host).
JOURNAL = f"{STATE_DIR}/state.json.journal"
BOOT_ID = "/proc/sys/kernel/random/boot_id"
PROC_STAT = "/proc/stat"  # its btime line: when this boot began, in seconds since the epoch


class StateError(ValueError):
    """The state file is not one host-tune wrote; nothing is guessed from it."""


class Busy(RuntimeError):
    """Another apply or revert is changing the same root (exit 1: rerun when it is done)."""


@contextmanager
def locked(root: Root) -> Iterator[None]:
    """Hold the root for one apply or revert at a time.

    Two at once would each save only the prior values they saw, and the later save would drop the
    other's: revert could then not undo those settings. An exclusive flock on the root directory
    itself needs no file of its own (``/`` on the host, the tree under ``--root``), works under
    ProtectSystem=strict, and the kernel drops it however the process ends.
    """
    fd = os.open(root.base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Busy(
                f"another host-tune apply or revert is running on {root.base}; "
                "rerun when it has finished"
            ) from None
        yield
    finally:
        os.close(fd)


@dataclass
class Entry:
    plugin: str
    target: str
    snapshot: str | None
    created_dirs: list[str] = field(default_factory=list)


@dataclass
class State:
    entries: dict[str, Entry] = field(default_factory=dict)  # insertion order == apply order
    managed: list[str] = field(default_factory=list)  # keys the kernel refused with EIO
    own_dirs: list[str] = field(default_factory=list)  # state directories we created
    #: The boot the runtime entries and ``managed`` were recorded in (None: not known).
    boot_id: str | None = None

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "version": 1,
            "boot_id": self.boot_id,
            "entries": [{"key": k, **vars(e)} for k, e in self.entries.items()],
            "managed": self.managed,
            "own_dirs": self.own_dirs,
        }
        return json.dumps(data, indent=1) + "\n"


def _str(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _strs(value: object) -> list[str]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {value!r}")
    return [_str(v) for v in value]


def _entry(e: Any) -> tuple[str, Entry]:
    return _str(e["key"]), Entry(
        _str(e["plugin"]),
        _str(e["target"]),
        None if e["snapshot"] is None else _str(e["snapshot"]),
        _strs(e.get("created_dirs", [])),
    )


def load(root: Root) -> State:
    text = root.read(STATE_FILE)
    journal = root.read(JOURNAL)
    if text is None and journal is None:
        return State()
    try:
        data = json.loads(text) if text is not None else {}
        entries = dict(_entry(e) for e in data.get("entries", []))
        # The last line lacks its newline when apply died appending it: its setting was never
        # written, as apply writes a setting only once its line is complete.
        for line in (journal or "").split("\n")[:-1]:
            key, entry = _entry(json.loads(line))
            entries.setdefault(key, entry)
        boot = data.get("boot_id")
        return State(
            entries,
            _strs(data.get("managed", [])),
            _strs(data.get("own_dirs", [])),
            str(boot) if boot is not None else None,
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        also = f" (with {root.path(JOURNAL)})" if journal is not None else ""
        raise StateError(
            f"{root.path(STATE_FILE)}{also} is damaged ({exc!r}); restore it from a backup or "
            "revert by hand: the prior values it holds cannot be guessed"
        ) from exc


def boot_id(root: Root) -> str | None:
    """This boot's id, or None where the kernel does not offer it (a fixture tree without it)."""
    return root.read_value(BOOT_ID) or None


def booted_at(root: Root) -> float | None:
    """When this boot began (``btime``), or None where the kernel does not say."""
    for line in (root.read(PROC_STAT) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == "btime" and value.strip().isdigit():
            return float(value)
    return None


def from_earlier_boot(root: Root, state: State) -> bool:
    """True when the runtime values in ``state`` were saved before the last reboot.

    A state file without a boot id (written by an earlier host-tune) is of an earlier boot when
    it was last written before this boot began; otherwise it is this boot's, and the caller
    records the boot id in it (``actions``), so the reboot after it is recognised.
    """
    if state.boot_id is None:
        began = booted_at(root)
        written = root.path(STATE_FILE)
        return began is not None and written.exists() and written.stat().st_mtime < began
    now = boot_id(root)
    return now is not None and state.boot_id != now


#: The signals that stop apply and revert (systemd's stop, a closed terminal, Ctrl-C).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


@contextmanager
def _signals_held() -> Iterator[None]:
    """Stop signals wait until the state file is written; they are delivered right after."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def save(root: Root, state: State, durable: bool = True) -> None:
    """Replace the state file whole (the journal's entries with it); ``durable``: on disk before
    answering (fsync)."""
    with _signals_held():
        created = root.create(STATE_FILE, state.to_json(), durable)
        state.own_dirs += [d for d in created if d not in state.own_dirs]
        if created:
            root.create(STATE_FILE, state.to_json(), durable)
        root.remove(JOURNAL)


def record(root: Root, state: State, key: str, durable: bool) -> None:
    """Append the new entry ``key`` to the journal; the state file must already be on disk."""
    line = json.dumps({"key": key, **vars(state.entries[key])}) + "\n"
    with _signals_held():
        root.append(JOURNAL, line, durable)


def remove(root: Root, state: State) -> None:
    root.remove(JOURNAL)
    root.remove(STATE_FILE)
    for d in reversed(state.own_dirs):
        root.rmdir_if_empty(d)
