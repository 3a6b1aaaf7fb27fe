"""Trains the semantic tier's decision rule on QQP's dev split (never on test).

    PYTHONPATH=. .venv/bin/python -m bench.semantic_train \
        --pairs ../shared/data/qqp/dev.jsonl.gz --limit 30000 \
        --vectors var/semantic/dev-vectors.npz --out appliance/data/semantic_rule.npz

The dev pairs are split 80/20 (fixed seed): the classifier (one hidden layer, torch here, numpy in the
gateway) learns on the 80 %, and the floor and probability threshold are chosen on the other 20 %
as the settings with the highest recall whose precision reaches --target-precision, the guards
applied exactly as the tier applies them. Vectors come from the shipped embedder and are kept in
--vectors so a second run does not embed again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from appliance.cache.embedder import Embedder, Vector
from appliance.cache.paraphrase import Question, analyze, features, veto
from appliance.cache.semantic_eval import Pair, read_pairs


def vectors(embedder_dir: Path, cache: Path, pairs: list[Pair]) -> tuple[Vector, Vector]:
    texts = sorted({t for p in pairs for t in (p.a, p.b)})
    known: dict[str, int] = {}
    if cache.exists():
        with np.load(cache, allow_pickle=False) as data:
            stored_texts, stored = list(data["texts"]), data["vectors"]
        known = {t: i for i, t in enumerate(stored_texts)}
    missing = [t for t in texts if t not in known]
    if missing:
        print(f"embedding {len(missing)} texts", file=sys.stderr, flush=True)
        new, _ = Embedder(embedder_dir, threads=2).embed_many(missing)
        stored_texts = [*((known and stored_texts) or []), *missing]
        stored = np.concatenate([stored, new]) if known else new
        cache.parent.mkdir(parents=True, exist_ok=True)
        np.savez(cache, texts=np.array(stored_texts), vectors=stored)
        known = {t: i for i, t in enumerate(stored_texts)}
    ia = np.array([known[p.a] for p in pairs])
    ib = np.array([known[p.b] for p in pairs])
    return stored[ia], stored[ib]


def train(x: Vector, y: np.ndarray, hidden: int, epochs: int, seed: int) -> dict[str, Vector]:
    torch.manual_seed(seed)
    mean = x.mean(0)
    scale = x.std(0) + 1e-6
    xt = torch.tensor((x - mean) / scale)
    yt = torch.tensor(y, dtype=torch.float32)
    net = torch.nn.Sequential(
        torch.nn.Dropout(0.1),
        torch.nn.Linear(x.shape[1], hidden),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(hidden, 1),
    )
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-2)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for _ in range(epochs):
        net.train()
        for idx in torch.randperm(len(xt)).split(256):
            opt.zero_grad()
            loss = loss_fn(net(xt[idx]).squeeze(1), yt[idx])
            loss.backward()
            opt.step()
    first, second = net[1], net[4]
    assert isinstance(first, torch.nn.Linear) and isinstance(second, torch.nn.Linear)
    return {
        "mean": mean.astype(np.float32),
        "scale": scale.astype(np.float32),
        "w1": first.weight.detach().numpy().T.copy(),
        "b1": first.bias.detach().numpy().copy(),
        "w2": second.weight.detach().numpy()[0].copy(),
        "b2": np.float32(second.bias.item()),
    }


def scores(w: dict[str, Vector], x: Vector) -> Vector:
    h = np.maximum((x - w["mean"]) / w["scale"] @ w["w1"] + w["b1"], 0.0)
    out: Vector = 1.0 / (1.0 + np.exp(-(h @ w["w2"] + w["b2"])))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=30000)
    ap.add_argument("--embedder", type=Path, default=Path("var/semantic"))
    ap.add_argument("--vectors", type=Path, default=Path("var/semantic/dev-vectors.npz"))
    ap.add_argument("--out", type=Path, default=Path("appliance/data/semantic_rule.npz"))
    ap.add_argument("--target-precision", type=float, default=0.93)
    ap.add_argument("--train-floor", type=float, default=0.70)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=20)
    args = ap.parse_args()
    if "test" in args.pairs.name:
        ap.error("the rule is tuned on dev only")

    pairs = read_pairs(args.pairs)[: args.limit]
    va, vb = vectors(args.embedder, args.vectors, pairs)
    questions: list[tuple[Question, Question]] = [(analyze(p.a), analyze(p.b)) for p in pairs]
    cos = (va * vb).sum(1)
    vetoed = np.array([bool(veto(a, b)) for a, b in questions])
    labels = np.array([p.label for p in pairs])
    order = np.random.default_rng(0).permutation(len(pairs))
    cut = int(0.8 * len(pairs))
    fit_rows, calib_rows = order[:cut], order[cut:]

    def rows_x(rows: np.ndarray) -> Vector:
        return np.stack([features(va[i], vb[i], *questions[i]) for i in rows])

    fit = fit_rows[(cos[fit_rows] >= args.train_floor) & ~vetoed[fit_rows]]
    print(f"training on {len(fit)} dev pairs (cos >= {args.train_floor}, no guard refusing)")
    weights = train(rows_x(fit), labels[fit], args.hidden, args.epochs, seed=0)

    calib_scores = np.zeros(len(pairs))
    calib_scores[calib_rows] = scores(weights, rows_x(calib_rows))
    positives = labels[calib_rows].sum()
    best: tuple[float, float, float, float] | None = None
    for floor in (0.70, 0.75, 0.80, 0.85):
        for threshold in np.arange(0.30, 0.995, 0.005):
            hit = (cos[calib_rows] >= floor) & ~vetoed[calib_rows]
            hit &= calib_scores[calib_rows] >= threshold
            tp = int((hit & (labels[calib_rows] == 1)).sum())
            n = int(hit.sum())
            if n and tp / n >= args.target_precision:
                recall = tp / positives
                if best is None or recall > best[2]:
                    best = (floor, float(threshold), recall, tp / n)
                break
    if best is None:
        print("no setting reaches the target precision", file=sys.stderr)
        return 1
    floor, threshold, recall, precision = best
    print(
        f"held-out dev: floor {floor:.2f}, threshold {threshold:.3f}: "
        f"precision {precision:.3f}, recall {recall:.3f}"
    )
    np.savez(args.out, **weights, floor=np.float32(floor), threshold=np.float32(threshold))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
