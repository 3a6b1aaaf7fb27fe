"""Human tables and JSON for plans and results. Formatting only; nothing here decides anything."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict
from typing import Any

from host_tuning import cpulist
from host_tuning.actions import Result
from host_tuning.cores import CorePlan, cpu_affinity_dropin
from host_tuning.planner import TuningPlan

_NUM = re.compile(r"\d+")


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [len(h) for h in header]
    for r in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, r, strict=True)]

    def fmt(r: list[str]) -> str:
        # The last column (reason / note) is free-running text, not padded.
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths[:-1], strict=True)]
        return "  ".join([*cells, r[-1]]).rstrip()

    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def _cell(value: str | None, width: int = 60) -> str:
    """One table cell: absent shown as '-', file contents on one line, long values cut."""
    if value is None:
        return "-"
    flat = value.strip().replace("\n", "\\n")
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _collapse(rows: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """Merge rows that differ only in one number of their label: ``cpu{0-127} governor``.

    Per-CPU and per-IRQ settings would otherwise drown the few rows an operator needs to read.
    """
    groups: dict[tuple[str, ...], list[int]] = {}
    order: list[tuple[str, ...] | tuple[str, list[str]]] = []
    for label, cols in rows:
        nums = _NUM.findall(label)
        if len(nums) != 1:
            order.append((label, cols))
            continue
        key = (_NUM.sub("#", label), *cols)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(int(nums[0]))
    out: list[tuple[str, list[str]]] = []
    for entry in order:
        if len(entry) == 2 and isinstance(entry[1], list):
            out.append((str(entry[0]), entry[1]))
            continue
        template, *cols = (str(x) for x in entry)
        members = groups[tuple([template, *cols])]
        if len(members) == 1:
            label = template.replace("#", str(members[0]))
        else:
            label = template.replace("#", "{" + cpulist.format(members) + "}")
        out.append((label, cols))
    return out


def cores_dict(c: CorePlan) -> dict[str, Any]:
    return {
        "node": c.node,
        "gpu": c.gpu,
        "housekeeping": cpulist.format(c.housekeeping),
        "nic_irq": cpulist.format(c.nic_irq),
        "gateway": cpulist.format(c.gateway),
        "triton": cpulist.format(c.triton),
        "serving": cpulist.format(c.serving),
        "isolated": cpulist.format(c.isolated),
        "offline": cpulist.format(c.offline),
        "reasons": c.reasons,
    }


def plan_json(plan: TuningPlan) -> str:
    data = {
        "cores": cores_dict(plan.cores),
        "items": [asdict(i) for i in plan.items],
        "advice": [asdict(a) for a in plan.advice],
        "conflicts": [asdict(c) for c in plan.conflicts],
        "systemd": {
            "gateway": cpu_affinity_dropin(plan.cores.gateway, "the gateway"),
            "triton": cpu_affinity_dropin(plan.cores.triton, "Triton"),
        },
    }
    return json.dumps(data, indent=1)


def plan_table(plan: TuningPlan) -> str:
    c = cores_dict(plan.cores)
    rows = [
        ["cores", role, c[role] or "-", c["reasons"].get(role, "")]
        for role in ("housekeeping", "nic_irq", "gateway", "triton", "isolated", "offline")
        if role != "offline" or c[role]
    ]
    rows.insert(0, ["cores", "node", str(c["node"]), c["reasons"]["node"]])
    grouped = _collapse([(it.key, [it.plugin, it.desired, it.reason]) for it in plan.items])
    rows += [[cols[0], label, _cell(cols[1]), cols[2]] for label, cols in grouped]
    text = _table(rows, ["PLUGIN", "SETTING", "VALUE", "REASON"])
    if plan.advice:
        adv = [[a.topic, a.text, a.reason] for a in plan.advice]
        text += "\n\nADVICE (not applied by host-tune)\n" + _table(adv, ["TOPIC", "ACTION", "WHY"])
    if plan.conflicts:
        text += "\n\nCONFLICTS (hand-set kernel parameters; verify fails until fixed)\n"
        text += "\n".join(c.text for c in plan.conflicts)
    return text + "\n"


def plan_notes(plan: TuningPlan, conflicts: bool = False) -> list[str]:
    """What apply and verify say about the plan besides the per-setting results (verify lists
    the conflicts as results of their own)."""
    notes = [plan.cores.reasons["offline"]] if plan.cores.offline else []
    return notes + ([c.text for c in plan.conflicts] if conflicts else [])


def pending_line(pending: list[Result]) -> str:
    """One line for verify's exit 3: what takes effect only after a reboot, and what to run."""
    # A kernel parameter is named by its token; any other setting (systemd's default
    # CPUAffinity=) by its key and how to bring it into effect without a reboot.
    params = [r.expected or r.key for r in pending if r.plugin == "cmdline"]
    others = [f"{r.key} ({r.note})" for r in pending if r.plugin != "cmdline"]
    parts = []
    if params:
        parts.append(
            "kernel command line " + " ".join(params) + " (update-grub or grub2-mkconfig, then "
            "reboot)"
        )
    return f"verify: {len(pending)} setting(s) take effect only after a reboot: " + "; ".join(
        parts + others
    )


def results_json(command: str, results: list[Result], code: int, notes: list[str]) -> str:
    counts = Counter(r.status for r in results)
    changed = counts.get("changed", 0) + counts.get("restored", 0)
    return json.dumps(
        {
            "command": command,
            "changed": changed > 0,
            "counts": dict(counts),
            "reboot_required": any("reboot required" in r.note for r in results),
            "results": [asdict(r) for r in results],
            "exit_code": code,
            "notes": notes,
        },
        indent=1,
    )


def results_table(
    command: str, results: list[Result], verbose: bool = False, notes: list[str] | None = None
) -> str:
    quiet = {"unchanged", "ok"}
    shown = [r for r in results if verbose or r.status not in quiet or r.note]
    grouped = _collapse(
        [(r.key, [r.status, _cell(r.expected), _cell(r.actual), r.note]) for r in shown]
    )
    rows = [[cols[0], label, cols[1], cols[2], cols[3]] for label, cols in grouped]
    counts = Counter(r.status for r in results)
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no settings"
    lines = [_table(rows, ["STATUS", "SETTING", "EXPECTED", "ACTUAL", "NOTE"])] if rows else []
    settled = quiet | {"managed-skipped", "unsupported"}
    if command == "apply" and results and all(r.status in settled for r in results):
        lines.append("nothing to change: the host already matches the plan")
    if command == "verify":
        drift = counts.get("drift", 0)
        lines.append(f"{drift} setting(s) drifted" if drift else "no drift")
        if counts.get("conflict"):
            n = counts["conflict"]
            lines.append(f"{n} hand-set kernel parameter(s) conflict with the plan")
    lines += [f"note: {n}" for n in notes or []]
    lines.append(f"{command}: {summary}")
    return "\n".join(lines) + "\n"
