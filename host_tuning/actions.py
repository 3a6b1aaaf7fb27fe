"""Apply, verify and revert a plan's items through their plugins, keeping prior values.

The rules that make the tool safe to run twice live here, once, rather than in every plugin:
a setting already at its value is left alone; a prior value is saved only at the first change;
the kernel's EIO on an IRQ affinity write means a managed IRQ, recorded and skipped; revert walks
the changes backwards so several settings sharing one file unwind to the original bytes.
Runtime values saved before the last reboot are stale (``host_tuning.state``): apply saves fresh
ones, revert does not write them back, verify does not count them as in force.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from dataclasses import dataclass

from host_tuning import state as state_mod
from host_tuning.items import Conflict, Item
from host_tuning.plugins.base import Context
from host_tuning.registry import BY_NAME

CHANGED, UNCHANGED, WOULD_CHANGE = "changed", "unchanged", "would-change"
MANAGED, UNSUPPORTED, FAILED = "managed-skipped", "unsupported", "failed"
OK, DRIFT, REBOOT = "ok", "drift", "reboot-required"
RESTORED, WOULD_RESTORE = "restored", "would-restore"
STALE = "stale"
RESET = "reset-by-reboot"
CONFLICT = "conflict"
#: Statuses that make a command exit 1 (``EXIT_FAILED``): apply again, or fix by hand.
FAILING = (FAILED, DRIFT, CONFLICT)

#: Exit codes of apply, verify and revert (and every host-tune command); the one list of them.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_REBOOT = 0, 1, 2, 3
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success; for verify: every planned setting holds and is in effect",
    EXIT_FAILED: "a setting failed to apply or restore, verify found drift or a hand-set "
    "isolcpus/nohz_full that conflicts with the plan, a file outside the per-setting results "
    "could not be read or written, another apply/revert runs on the same root, or a signal "
    "stopped apply/revert",
    EXIT_USAGE: "usage, profile or plan error, a damaged state file, or not root on the real host",
    EXIT_REBOOT: "verify only: nothing drifted, but settings take effect only after a reboot "
    "(kernel command line not yet in /proc/cmdline, systemd's CPUAffinity= not yet read)",
}


@dataclass(frozen=True)
class Result:
    key: str
    plugin: str
    status: str
    expected: str | None = None
    actual: str | None = None
    note: str = ""


def _managed_note(exc: OSError) -> str:
    return f"kernel refused with EIO ({exc.strerror}): managed IRQ, skipped"


def _forget_earlier_boot(ctx: Context, st: state_mod.State) -> set[str]:
    """Drop the runtime values and managed IRQs saved before the last reboot; answer their keys.

    The kernel started those settings afresh at boot and IRQ numbers were handed out again, so
    the values are no prior state of anything now. Files under /etc survived and stay.
    """
    if not state_mod.from_earlier_boot(ctx.root, st):
        if st.boot_id is None and (st.entries or st.managed):
            # An earlier host-tune's file, written in this boot: it is this boot's from now on
            # (apply saves it even when nothing else changes).
            st.boot_id = state_mod.boot_id(ctx.root)
        return set()
    stale = set()
    for key, entry in list(st.entries.items()):
        plugin = BY_NAME.get(entry.plugin)
        if plugin is not None and not plugin.persistent:
            del st.entries[key]
            stale.add(key)
    st.managed.clear()
    st.boot_id = state_mod.boot_id(ctx.root)
    return stale


def _reset_note() -> str:
    return (
        "saved before the last reboot, which reset it: that value is not written back "
        "(apply saves the value found now)"
    )


def apply(ctx: Context, items: Iterable[Item], dry_run: bool = False) -> list[Result]:
    st = state_mod.load(ctx.root)
    on_disk: str | None = st.to_json()  # None: the journal holds entries st.to_json() has too
    journaling = False
    _forget_earlier_boot(ctx, st)
    results: list[Result] = []
    try:
        for item in items:
            plugin = BY_NAME[item.plugin]
            # IRQ numbers are handed out again at each boot: one managed then is tried again.
            was_managed = item.key in st.managed
            if was_managed and dry_run:
                results.append(Result(item.key, item.plugin, MANAGED, item.desired, None))
                continue
            cur = plugin.current(ctx, item)
            if plugin.same(item, cur):
                if was_managed:
                    st.managed.remove(item.key)
                note = plugin.pending(ctx, item) or ""
                results.append(Result(item.key, item.plugin, UNCHANGED, item.desired, cur, note))
                continue
            why = plugin.unoffered(ctx, item)
            if why is not None:
                results.append(Result(item.key, item.plugin, UNSUPPORTED, item.desired, cur, why))
                continue
            snap = plugin.snapshot(ctx, item)
            if snap is None and not plugin.owns_files:
                if was_managed:
                    st.managed.remove(item.key)
                results.append(
                    Result(item.key, item.plugin, UNSUPPORTED, item.desired, None, "absent here")
                )
                continue
            if dry_run:
                results.append(Result(item.key, item.plugin, WOULD_CHANGE, item.desired, cur))
                continue
            # Recorded before the write, so a signal between the write and its record cannot
            # leave a change revert does not know of; a refused write takes the record back.
            entry = st.entries.get(item.key)
            if entry is None:
                entry = st.entries[item.key] = state_mod.Entry(item.plugin, item.target, snap)
                new_entry = True
                # On disk before the write: a process killed outright (SIGKILL, the OOM killer)
                # runs no finally, and the next apply would save the tuned value as the prior
                # one. Runtime settings' lines need no fsync: a power cut resets them with the
                # record. The first new entry writes the whole state (this boot's id, stale
                # entries dropped), flushed whatever its setting: the file it replaces may hold
                # an earlier apply's records of files under /etc, which a rename that reached
                # the disk before its data would lose. Later ones are appended to the journal.
                if journaling:
                    state_mod.record(ctx.root, st, item.key, durable=plugin.persistent)
                    on_disk = None
                else:
                    st.boot_id = state_mod.boot_id(ctx.root)
                    state_mod.save(ctx.root, st)
                    on_disk, journaling = st.to_json(), True
            else:
                new_entry = False
            try:
                entry.created_dirs += plugin.set(ctx, item)
            except OSError as exc:
                if new_entry:
                    del st.entries[item.key]
                if exc.errno == errno.EIO and item.plugin == "irq":
                    if not was_managed:
                        st.managed.append(item.key)
                    results.append(
                        Result(
                            item.key, item.plugin, MANAGED, item.desired, cur, _managed_note(exc)
                        )
                    )
                else:
                    results.append(
                        Result(item.key, item.plugin, FAILED, item.desired, cur, str(exc))
                    )
                continue
            if was_managed:
                st.managed.remove(item.key)
            if not plugin.owns_files:
                # The kernel may take a write and keep less (huge pages it cannot reserve).
                now = plugin.current(ctx, item)
                if not plugin.same(item, now):
                    note = plugin.shortfall(item, now) or (
                        f"the kernel kept {now} after {item.desired} was written"
                    )
                    results.append(Result(item.key, item.plugin, FAILED, item.desired, now, note))
                    continue
            note = plugin.pending(ctx, item) or ""
            results.append(Result(item.key, item.plugin, CHANGED, item.desired, cur, note))
    finally:
        if not dry_run and st.to_json() != on_disk:
            st.boot_id = state_mod.boot_id(ctx.root)
            if st.entries or st.managed:
                state_mod.save(ctx.root, st)
            else:
                state_mod.remove(ctx.root, st)
    return results


def verify(ctx: Context, items: Iterable[Item]) -> list[Result]:
    st = state_mod.load(ctx.root)
    _forget_earlier_boot(ctx, st)  # in memory only: verify never writes
    results: list[Result] = []
    planned: set[str] = set()
    for item in items:
        planned.add(item.key)
        plugin = BY_NAME[item.plugin]
        if item.key in st.managed:
            results.append(Result(item.key, item.plugin, MANAGED, item.desired, None))
            continue
        cur = plugin.current(ctx, item)
        if plugin.same(item, cur):
            pending = plugin.pending(ctx, item)
            status = REBOOT if pending else OK
            results.append(Result(item.key, item.plugin, status, item.desired, cur, pending or ""))
        elif (why := plugin.unoffered(ctx, item)) is not None:
            results.append(Result(item.key, item.plugin, UNSUPPORTED, item.desired, cur, why))
        elif cur is None and not plugin.owns_files and plugin.snapshot(ctx, item) is None:
            results.append(Result(item.key, item.plugin, UNSUPPORTED, item.desired, None))
        else:
            note = plugin.shortfall(item, cur) or ""
            results.append(Result(item.key, item.plugin, DRIFT, item.desired, cur, note))
    for key, entry in st.entries.items():
        if key not in planned:
            # Applied under an earlier profile; still in force until revert restores it.
            note = "applied earlier, not in this plan; revert restores it"
            results.append(Result(key, entry.plugin, STALE, None, None, note))
    return results


def revert(ctx: Context, dry_run: bool = False) -> list[Result]:
    st = state_mod.load(ctx.root)
    results: list[Result] = []
    entries = dict(st.entries)
    stale = _forget_earlier_boot(ctx, st)
    for key in reversed([k for k in entries if k in stale]):
        entry = entries[key]
        results.append(Result(key, entry.plugin, RESET, entry.snapshot, None, _reset_note()))
    for key in reversed(list(st.entries)):
        entry = st.entries[key]
        plugin = BY_NAME.get(entry.plugin)
        if plugin is None:
            # A state file from another host-tune version: keep the entry, restore by hand.
            note = f"unknown plugin {entry.plugin!r} in the state file; restore by hand"
            results.append(Result(key, entry.plugin, FAILED, entry.snapshot, None, note))
            continue
        if dry_run:
            results.append(Result(key, entry.plugin, WOULD_RESTORE, entry.snapshot, None))
            continue
        try:
            plugin.restore(ctx, entry.target, entry.snapshot)
            status, note = RESTORED, plugin.restored_pending(ctx, key, entry.target) or ""
        except FileNotFoundError as exc:
            if plugin.owns_files:
                results.append(Result(key, entry.plugin, FAILED, entry.snapshot, None, str(exc)))
                continue
            # The kernel attribute went with its device (IRQ freed, NIC or CPU removed): the
            # value is gone too, and keeping the entry would fail every later revert.
            status, note = UNSUPPORTED, f"gone since apply ({exc.strerror}): nothing to restore"
        except OSError as exc:
            results.append(Result(key, entry.plugin, FAILED, entry.snapshot, None, str(exc)))
            continue
        for d in reversed(entry.created_dirs):
            ctx.root.rmdir_if_empty(d)
        del st.entries[key]
        results.append(Result(key, entry.plugin, status, entry.snapshot, None, note))
    if not dry_run:
        if st.entries:
            state_mod.save(ctx.root, st)  # keep what failed so a later revert can retry
        else:
            state_mod.remove(ctx.root, st)
    return results


def conflict_results(conflicts: Iterable[Conflict]) -> list[Result]:
    """verify's rows for hand-set kernel parameters that fight the plan (exit 1, as drift)."""
    return [
        Result(
            f"{c.param} in {c.source}",
            "cmdline",
            CONFLICT,
            f"{c.param}={c.wanted}" if c.wanted else None,
            c.token,
            c.text,
        )
        for c in conflicts
    ]


def exit_code(results: list[Result]) -> int:
    """See ``EXIT_CODES``: drift and failures first (apply again), then a pending reboot."""
    if any(r.status in FAILING for r in results):
        return EXIT_FAILED
    return EXIT_REBOOT if any(r.status == REBOOT for r in results) else EXIT_OK
