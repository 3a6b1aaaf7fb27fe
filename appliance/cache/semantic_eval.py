"""`appliance semantic-eval --pairs FILE`: the shipped embedder and decision rule on labelled pairs.

Each line of FILE (gzip accepted) is `{"a": "...", "b": "...", "label": 0|1}`. A pair is a hit when the
rule would answer one question with the other's answer, exactly as the semantic tier decides it; the
report gives precision, recall and false hits, beside the plain-cosine table of the same vectors.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from appliance.cache.embedder import Embedder, Vector
from appliance.cache.paraphrase import Decision, Rule, analyze

COSINE_ANCHORS = (0.80, 0.85, 0.90, 0.95, 0.97)
# Longest line read (a pair of questions is a few KiB): a file with no line ends (a binary,
# /dev/zero, a gzip file that inflates to one) is refused after reading this much.
MAX_LINE_CHARS = 1 << 20


class PairsError(Exception):
    """A pairs file that cannot be read; the message names the line."""


@dataclass(frozen=True, slots=True)
class Pair:
    a: str
    b: str
    label: int
    kind: str = ""


def read_pairs(path: Path) -> list[Pair]:
    opener: Any = gzip.open if path.suffix == ".gz" else open
    pairs: list[Pair] = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(iter(lambda: f.readline(MAX_LINE_CHARS + 1), ""), 1):
                if len(line) > MAX_LINE_CHARS:
                    raise PairsError(
                        f"{path}:{number}: a line over {MAX_LINE_CHARS:,} characters: "
                        'expected one {"a": ..., "b": ..., "label": 0|1} a line'
                    )
                if not line.strip():
                    continue
                pairs.append(_pair(line, f"{path}:{number}"))
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise PairsError(f"{path}: cannot read: {exc}") from exc
    if not pairs:
        raise PairsError(f"{path}: no pairs")
    return pairs


def _pair(line: str, where: str) -> Pair:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PairsError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise PairsError(f'{where}: expected an object {{"a": ..., "b": ..., "label": 0|1}}')
    a, b, label = row.get("a"), row.get("b"), row.get("label")
    if not isinstance(a, str) or not isinstance(b, str):
        raise PairsError(f'{where}: "a" and "b" must be strings')
    if label not in (0, 1) or isinstance(label, bool):
        raise PairsError(f'{where}: "label" must be 0 or 1, got {label!r}')
    kind = row.get("kind", "")
    return Pair(a, b, int(label), kind if isinstance(kind, str) else "")


def embed_pairs(embedder: Embedder, pairs: Sequence[Pair]) -> tuple[Vector, Vector, list[bool]]:
    """Unit vectors of each side (each distinct text embedded once) and whether both fit."""
    texts = sorted({t for p in pairs for t in (p.a, p.b)})
    vectors, fits = embedder.embed_many(texts)
    row = {t: i for i, t in enumerate(texts)}
    ia = np.array([row[p.a] for p in pairs])
    ib = np.array([row[p.b] for p in pairs])
    ok = [fits[row[p.a]] and fits[row[p.b]] for p in pairs]
    return vectors[ia], vectors[ib], ok


def decide_all(
    rule: Rule, pairs: Sequence[Pair], va: Vector, vb: Vector, fits: Sequence[bool]
) -> list[Decision]:
    """The rule's decision on every pair; a text too long to embed is never a hit."""
    out: list[Decision] = []
    for p, u, v, ok in zip(pairs, va, vb, fits, strict=True):
        if not ok:
            out.append(Decision(False, 0.0, 0.0, "too long"))
        else:
            out.append(rule.decide(u, v, analyze(p.a), analyze(p.b)))
    return out


def metrics(hits: npt.NDArray[np.bool_], labels: npt.NDArray[np.int64]) -> dict[str, float | int]:
    tp = int((hits & (labels == 1)).sum())
    fp = int((hits & (labels == 0)).sum())
    positives = int((labels == 1).sum())
    return {
        "precision": tp / (tp + fp) if tp + fp else 1.0,
        "recall": tp / positives if positives else 0.0,
        "hits": tp + fp,
        "false_hits": fp,
        "positives": positives,
        "negatives": int((labels == 0).sum()),
    }


def report(pairs: Sequence[Pair], decisions: Sequence[Decision], rule: Rule) -> dict[str, Any]:
    labels = np.array([p.label for p in pairs], dtype=np.int64)
    hits = np.array([d.same for d in decisions])
    cos = np.array([d.similarity for d in decisions], dtype=np.float32)
    result: dict[str, Any] = metrics(hits, labels)
    result["floor"], result["threshold"] = rule.floor, rule.threshold
    result["cosine"] = [{"cosine": c, **metrics(cos >= c, labels)} for c in COSINE_ANCHORS]
    # The rule's precision-recall curve: its classifier threshold varied, guards and floor kept.
    score = np.array([d.score if d.why in ("", "score") else -1.0 for d in decisions])
    result["curve"] = [
        {"threshold": t, **metrics(score >= t, labels)}
        for t in (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.97, 0.99)
    ]
    refusals: dict[str, int] = {}
    for d, label in zip(decisions, labels, strict=True):
        if not d.same and label == 1:
            refusals[d.why] = refusals.get(d.why, 0) + 1
    result["positives_refused_by"] = refusals
    kinds: dict[str, dict[str, int]] = {}
    for p, d in zip(pairs, decisions, strict=True):
        if p.kind:
            k = kinds.setdefault(p.kind, {"pairs": 0, "hits": 0})
            k["pairs"] += 1
            k["hits"] += int(d.same)
    if kinds:
        result["kinds"] = kinds
    result["false_hit_pairs"] = [
        {"a": p.a, "b": p.b, "similarity": round(d.similarity, 4), "score": round(d.score, 4)}
        for p, d in zip(pairs, decisions, strict=True)
        if d.same and p.label == 0
    ]
    return result


def render(result: dict[str, Any]) -> str:
    def row(name: str, m: dict[str, Any]) -> str:
        return (
            f"{name:<28} {m['precision']:>9.3f} {m['recall']:>7.3f} {m['hits']:>7} "
            f"{m['false_hits']:>10}"
        )

    head = f"{'rule':<28} {'precision':>9} {'recall':>7} {'hits':>7} {'false hits':>10}"
    lines = [
        f"pairs: {result['positives']} positive, {result['negatives']} negative",
        head,
        row(f"shipped (floor {result['floor']:.2f}, p>={result['threshold']:.3f})", result),
    ]
    lines += [row(f"plain cosine >= {m['cosine']:.2f}", m) for m in result["cosine"]]
    lines += [row(f"rule, p >= {m['threshold']:.2f}", m) for m in result["curve"]]
    if result["positives_refused_by"]:
        why = ", ".join(f"{k} {v}" for k, v in sorted(result["positives_refused_by"].items()))
        lines.append(f"positives refused by: {why}")
    for kind, k in sorted(result.get("kinds", {}).items()):
        lines.append(f"kind {kind}: {k['hits']}/{k['pairs']} hit")
    return "\n".join(lines)
