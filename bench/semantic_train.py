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

from appliance.cache.embedder import Vector
from appliance.cache.paraphrase import Question, Rule, analyze, features, veto
from appliance.cache.semantic_eval import read_pairs
from bench.semantic import vectors


class Classifier(torch.nn.Module):
    """What paraphrase.Rule computes in numpy, in torch for training."""

    def __init__(self, dim: int, rank: int, hidden: int, extra: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(dim, rank, bias=False)
        self.hidden = torch.nn.Linear(2 * rank + extra, hidden)
        self.out = torch.nn.Linear(hidden, 1)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, u: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        pu, pv = self.proj(u), self.proj(v)
        z = torch.cat([pu * pv, (pu - pv).abs(), x], 1)
        out: torch.Tensor = self.out(self.drop(torch.relu(self.hidden(self.drop(z))))).squeeze(1)
        return out


def train(
    u: Vector, v: Vector, x: Vector, y: np.ndarray, args: argparse.Namespace
) -> dict[str, Vector]:
    torch.manual_seed(0)
    mean, scale = x.mean(0), x.std(0) + 1e-6
    ut, vt = torch.tensor(u), torch.tensor(v)
    xt = torch.tensor((x - mean) / scale, dtype=torch.float32)
    yt = torch.tensor(y, dtype=torch.float32)
    net = Classifier(u.shape[1], args.rank, args.hidden, x.shape[1])
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.05)
    for _ in range(args.epochs):
        net.train()
        for idx in torch.randperm(len(yt)).split(256):
            # Either question may be the cached one: train on both orders.
            swap = (torch.rand(len(idx)) < 0.5)[:, None]
            a = torch.where(swap, vt[idx], ut[idx])
            b = torch.where(swap, ut[idx], vt[idx])
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(net(a, b, xt[idx]), yt[idx])
            loss.backward()
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--embedder", type=Path, default=Path("var/semantic"))
    ap.add_argument("--vectors", type=Path, default=Path("var/semantic/dev-vectors.npz"))
    ap.add_argument("--out", type=Path, default=Path("appliance/data/semantic_rule.npz"))
    ap.add_argument("--target-precision", type=float, default=0.905)
    ap.add_argument("--train-floor", type=float, default=0.50)
    ap.add_argument("--rank", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=5)
    args = ap.parse_args()
    if "test" in args.pairs.name:
        ap.error("the rule is tuned on dev only")

    pairs = read_pairs(args.pairs)[: args.limit]
    print(f"{len(pairs)} dev pairs")
    va, vb = vectors(args.embedder, args.vectors, pairs)
    questions: list[tuple[Question, Question]] = [(analyze(p.a), analyze(p.b)) for p in pairs]
    cos = (va * vb).sum(1)
    vetoed = np.array([bool(veto(a, b)) for a, b in questions])
    labels = np.array([p.label for p in pairs])
    order = np.random.default_rng(0).permutation(len(pairs))
    cut = int(0.8 * len(pairs))
    fit_rows, calib_rows = order[:cut], order[cut:]

    x = np.stack([features(va[i], vb[i], *questions[i]) for i in range(len(pairs))])
    fit = fit_rows[(cos[fit_rows] >= args.train_floor) & ~vetoed[fit_rows]]
    print(f"training on {len(fit)} dev pairs (cos >= {args.train_floor}, no guard refusing)")
    weights = train(va[fit], vb[fit], x[fit], labels[fit], args)
    np.savez(args.out, **weights, floor=np.float32(0), threshold=np.float32(1))
    rule = Rule(args.out)
    calib_scores = np.zeros(len(pairs))
    calib_scores[calib_rows] = rule.scores(va[calib_rows], vb[calib_rows], x[calib_rows])
    positives = labels[calib_rows].sum()
    best: tuple[float, float, float, float] | None = None
    for floor in (0.70, 0.75, 0.80, 0.85):
        for threshold in np.arange(0.30, 0.995, 0.0025):
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
