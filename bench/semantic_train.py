"""Trains the semantic tier's decision rule on QQP's dev split (never on test).

    PYTHONPATH=. .venv/bin/python -m bench.semantic_train \
        --pairs ../shared/data/qqp/dev.jsonl.gz --embedder var/semantic \
        --out appliance/data/semantic_rule.npz

The classifier is stacked: a network over the two vectors and the pair features (torch here, numpy
in the gateway), then boosted trees (scikit-learn here, numpy in the gateway) over the features and
the network's probability. Every dev pair gets an out-of-fold score (--folds, fixed seed): the
network and the trees that score it never saw it. The floor and the probability threshold are the
setting with the highest out-of-fold recall whose precision is at least --target-precision with
--confidence (a one-sided Wilson lower bound, so the figure is not luck of the dev sample), the
guards applied exactly as the tier applies them. The shipped network and trees are then fitted on
all of dev. Vectors come from the shipped embedder and are kept beside it (dev-vectors.npz) so a second
run does not embed again.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from appliance.cache.embedder import Vector
from appliance.cache.paraphrase import (
    Question,
    Rule,
    analyze,
    features,
    idf_table,
    idf_weights,
    veto,
)
from appliance.cache.semantic_eval import read_pairs
from bench import record
from bench.semantic import vectors

FLOORS = (0.60, 0.70, 0.75, 0.80)
Floats = npt.NDArray[np.float64]


def train_network(u: Vector, v: Vector, x: Vector, y: np.ndarray, args: Any) -> dict[str, Any]:
    """What paraphrase.Rule.network computes, trained in torch (imported here: torch and
    onnxruntime in one process crash, and the tests import this module for export_trees)."""
    import torch

    class Network(torch.nn.Module):
        def __init__(self, dim: int, rank: int, hidden: int, extra: int) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(dim, rank, bias=False)
            self.hidden = torch.nn.Linear(2 * rank + extra, hidden)
            self.out = torch.nn.Linear(hidden, 1)
            self.drop = torch.nn.Dropout(0.3)

        def forward(self, u: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            pu, pv = self.proj(u), self.proj(v)
            z = torch.cat([pu * pv, (pu - pv).abs(), x], 1)
            h = torch.relu(self.hidden(self.drop(z)))
            out: torch.Tensor = self.out(self.drop(h)).squeeze(1)
            return out

    torch.manual_seed(0)
    mean, scale = x.mean(0), x.std(0) + 1e-6
    ut, vt = torch.tensor(u), torch.tensor(v)
    xt = torch.tensor((x - mean) / scale, dtype=torch.float32)
    yt = torch.tensor(y, dtype=torch.float32)
    net = Network(u.shape[1], args.rank, args.hidden, x.shape[1])
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.05)
    for _ in range(args.epochs):
        net.train()
        for idx in torch.randperm(len(yt)).split(256):  # type: ignore[no-untyped-call]
            # Either question may be the cached one: train on both orders.
            swap = (torch.rand(len(idx)) < 0.5)[:, None]
            a = torch.where(swap, vt[idx], ut[idx])
            b = torch.where(swap, ut[idx], vt[idx])
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(net(a, b, xt[idx]), yt[idx])
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
    return {
        "proj": net.proj.weight.detach().numpy().T.copy(),
        "mean": mean.astype(np.float32),
        "scale": scale.astype(np.float32),
        "w1": net.hidden.weight.detach().numpy().T.copy(),
        "b1": net.hidden.bias.detach().numpy().copy(),
        "w2": net.out.weight.detach().numpy()[0].copy(),
        "b2": np.float32(net.out.bias.item()),
    }


def fit_trees(z: Floats, y: np.ndarray, depth: int) -> Any:
    """Trees of bounded depth: the gateway walks every tree `depth` steps per decision."""
    from sklearn.ensemble import HistGradientBoostingClassifier

    return HistGradientBoostingClassifier(
        max_iter=300, learning_rate=0.05, max_depth=depth, random_state=0, early_stopping=True
    ).fit(z, y)


def export_trees(model: Any) -> dict[str, Any]:
    """A fitted binary HistGradientBoostingClassifier as the arrays paraphrase.Trees reads (no
    categorical features, no missing values: the pair features are always defined)."""
    trees = [predictors[0].nodes for predictors in model._predictors]
    width = max(len(t) for t in trees)

    def padded(field: str, dtype: Any) -> Any:
        out = np.zeros((len(trees), width), dtype=dtype)
        for i, t in enumerate(trees):
            out[i, : len(t)] = t[field]
        return out

    leaf = padded("is_leaf", bool)
    for i, t in enumerate(trees):
        leaf[i, len(t) :] = True
    return {
        "tree_feature": padded("feature_idx", np.int32),
        "tree_threshold": padded("num_threshold", np.float64),
        "tree_left": padded("left", np.int32),
        "tree_right": padded("right", np.int32),
        "tree_leaf": leaf,
        "tree_value": padded("value", np.float64),
        "tree_base": np.float64(np.ravel(model._baseline_prediction)[0]),
        "tree_depth": np.int32(max(int(t["depth"].max()) for t in trees)),
    }


def wilson_lower(hits: int, n: int, confidence: float) -> float:
    """One-sided lower confidence bound of a proportion hits/n."""
    if n == 0:
        return 0.0
    z = statistics.NormalDist().inv_cdf(confidence)
    p = hits / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - spread) / (1 + z * z / n)


def choose(
    score: Floats, cos: Floats, vetoed: np.ndarray, labels: np.ndarray, args: Any
) -> tuple[float, float, float, float]:
    """(floor, threshold, recall, precision): the highest out-of-fold recall whose precision's
    lower bound reaches the target."""
    positives = int(labels.sum())
    best = (0.0, 1.0, 0.0, 1.0)
    for floor in FLOORS:
        s = np.where((cos >= floor) & ~vetoed, score, -1.0)
        order = np.argsort(-s, kind="stable")
        tp = np.cumsum(labels[order])
        for n in range(len(order), 0, -1):
            if s[order[n - 1]] < 0 or (n < len(order) and s[order[n]] == s[order[n - 1]]):
                continue
            hits = int(tp[n - 1])
            if wilson_lower(hits, n, args.confidence) >= args.target_precision:
                if hits / positives > best[2]:
                    best = (floor, float(s[order[n - 1]]), hits / positives, hits / n)
                break
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--embedder", type=Path, default=Path("var/semantic"))
    ap.add_argument("--out", type=Path, default=Path("appliance/data/semantic_rule.npz"))
    ap.add_argument("--target-precision", type=float, default=0.90)
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--train-floor", type=float, default=0.50)
    ap.add_argument("--rank", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--tree-depth", type=int, default=6)
    record.add_flag(ap)
    args = ap.parse_args()
    with record.recording("semantic_train", record.record_dir(args)):
        if "test" in args.pairs.name:
            ap.error("the rule is tuned on dev only")

        pairs = read_pairs(args.pairs)[: args.limit]
        print(f"{len(pairs)} dev pairs")
        va, vb = vectors(args.embedder, "dev", pairs)
        questions: list[tuple[Question, Question]] = [(analyze(p.a), analyze(p.b)) for p in pairs]
        idf = idf_table([q for pair in questions for q in pair])
        cos = (va * vb).sum(1).astype(np.float64)
        vetoed = np.array([bool(veto(a, b)) for a, b in questions])
        labels = np.array([p.label for p in pairs])
        weight = idf_weights(idf)
        x = np.stack([features(va[i], vb[i], *questions[i], weight) for i in range(len(pairs))])
        rows = np.flatnonzero((cos >= args.train_floor) & ~vetoed)
        fold = np.random.default_rng(0).integers(0, args.folds, len(pairs))
        print(f"training on {len(rows)} dev pairs (cos >= {args.train_floor}, no guard refusing)")

        scratch = args.out.with_suffix(".partial.npz")

        def network_scores(weights: dict[str, Any], at: np.ndarray) -> Vector:
            np.savez(scratch, **weights, idf=idf, **_no_trees())
            return Rule(scratch).network(va[at], vb[at], x[at])

        net_oof = np.zeros(len(pairs), dtype=np.float32)
        for k in range(args.folds):
            fit, held = rows[fold[rows] != k], rows[fold[rows] == k]
            weights = train_network(va[fit], vb[fit], x[fit], labels[fit], args)
            net_oof[held] = network_scores(weights, held)
        z = np.concatenate([x, net_oof[:, None]], axis=1).astype(np.float64)
        oof = np.full(len(pairs), -1.0)
        for k in range(args.folds):
            fit, held = rows[fold[rows] != k], rows[fold[rows] == k]
            oof[held] = fit_trees(z[fit], labels[fit], args.tree_depth).predict_proba(z[held])[:, 1]
        floor, threshold, recall, precision = choose(oof, cos, vetoed, labels, args)
        if recall == 0.0:
            print("no setting reaches the target precision", file=sys.stderr)
            return 1
        print(
            f"out-of-fold dev: floor {floor:.2f}, threshold {threshold:.4f}: "
            f"precision {precision:.4f}, recall {recall:.4f}"
        )

        weights = train_network(va[rows], vb[rows], x[rows], labels[rows], args)
        trees = fit_trees(z[rows], labels[rows], args.tree_depth)
        shipped = {**weights, "idf": idf, **export_trees(trees)}
        np.savez(args.out, **shipped, floor=np.float32(floor), threshold=np.float32(threshold))
        scratch.unlink(missing_ok=True)
        check = rows[:2000]
        got = Rule(args.out).trees.probabilities(z[check])
        want = trees.predict_proba(z[check])[:, 1]
        assert np.allclose(got, want, atol=1e-6), "exported trees disagree with scikit-learn"
        print(
            f"wrote {args.out} ({len(trees._predictors)} trees); `appliance semantic-setup` "
            "compiles its classifier for the gateway"
        )
        return 0


def _no_trees() -> dict[str, Any]:
    """A one-leaf ensemble, so a network can be loaded and scored before the trees exist."""
    one = np.zeros((1, 1))
    return {
        "tree_feature": one.astype(np.int32),
        "tree_threshold": one,
        "tree_left": one.astype(np.int32),
        "tree_right": one.astype(np.int32),
        "tree_leaf": np.ones((1, 1), dtype=bool),
        "tree_value": one,
        "tree_base": np.float64(0),
        "tree_depth": np.int32(0),
        "floor": np.float32(0),
        "threshold": np.float32(1),
    }


if __name__ == "__main__":
    sys.exit(main())
