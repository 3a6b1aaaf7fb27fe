"""Semantic-tier benchmark: quality on QQP test and the hard negatives, lookup cost, memory, rebuild.

    PYTHONPATH=. .venv/bin/python -m bench.semantic [--entries 100000] [--queries 300]

(a) QQP test split (../shared/data/qqp/test.jsonl.gz): the shipped rule (exactly `appliance
    semantic-eval`) beside plain cosine at 0.80/0.90/0.95 and the rule's precision–recall curve, from
    the same vectors. The vectors come from the shipped embedder and are kept beside it
    (test-vectors.npz) so a second run does not embed 40k texts again.
(b) tests/cache/data/semantic_pairs.jsonl: false hits on the hard negatives, recall on paraphrases.
(c) lookup at --entries entries in one scope (QQP dev questions, real vectors): embed, search +
    verify, and the whole lookup, P50/P99; a miss pays the same embed + search + verify.
(d) memory of those entries (RSS growth and the index's own accounting) and the rebuild of the index
    from a real redis-server holding them.
(e) a lookup right behind a request that L2 answered (real redis-server): the embedding that
    request's lookup started when L1 missed is cancelled when L2 answers, against left to run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import psutil
import uvloop

from appliance.cache.classifier import load_rule
from appliance.cache.embedder import MANIFEST, Embedder, Vector
from appliance.cache.entry import CachedAnswer
from appliance.cache.keys import ModelIdentity, SamplingKey
from appliance.cache.l1 import LruCache
from appliance.cache.l2 import RedisSettings, RedisTier
from appliance.cache.metrics import CacheMetrics
from appliance.cache.paraphrase import Rule
from appliance.cache.semantic import SemanticTier, encode_record
from appliance.cache.semantic_eval import Pair, decide_all, read_pairs, render, report
from appliance.cache.tiers import CacheQuery, L1Tier, TierCascade
from appliance.cache.vectors import Entry
from appliance.config import SemanticConfig
from appliance.heap import freeze_heap
from bench import record
from bench.common import pct

QQP = Path(__file__).resolve().parents[2] / "shared" / "data" / "qqp"
HARD = Path(__file__).resolve().parents[1] / "tests" / "cache" / "data" / "semantic_pairs.jsonl"
MODEL = ModelIdentity("bench", "engine-fp", "tok-fp", "v1")
SAMPLING = SamplingKey(64, True, 0.0, 1.0, 1, None, ())
# The gap before each lookup of the gateway-path pass: its threads fall asleep, as between requests.
IDLE_S = 0.004


def vectors(embedder_dir: Path, name: str, pairs: list[Pair]) -> tuple[Vector, Vector]:
    """Vectors of both sides from the embedder in `embedder_dir`, kept beside it in
    NAME-vectors.npz with the model's digest (a second run reads them unless the model changed;
    importing torch in the same process as onnxruntime crashes it, so training imports this)."""
    cache = embedder_dir / f"{name}-vectors.npz"
    # The model's digest and how the vectors were made (one text per run, as the gateway does).
    model = json.loads((embedder_dir / MANIFEST).read_text())["onnx_sha256"] + " one per run"
    texts = sorted({t for p in pairs for t in (p.a, p.b)})
    known: dict[str, int] = {}
    if cache.exists():
        with np.load(cache, allow_pickle=False) as data:
            if "model" in data and str(data["model"]) == model:
                stored_texts, stored = list(data["texts"]), data["vectors"]
                known = {t: i for i, t in enumerate(stored_texts)}
    missing = [t for t in texts if t not in known]
    if missing:
        print(f"embedding {len(missing)} texts", file=sys.stderr, flush=True)
        new, _ = Embedder(embedder_dir, threads=2).embed_many(missing)
        stored_texts = [*((known and stored_texts) or []), *missing]
        stored = np.concatenate([stored, new]) if known else new
        np.savez(cache, texts=np.array(stored_texts), vectors=stored, model=np.array(model))
        known = {t: i for i, t in enumerate(stored_texts)}
    ia = np.array([known[p.a] for p in pairs])
    ib = np.array([known[p.b] for p in pairs])
    return stored[ia], stored[ib]


def quality(embedder_dir: Path, qqp: Path) -> None:
    rule = shipped_rule(embedder_dir)
    pairs = read_pairs(qqp / "test.jsonl.gz")
    va, vb = vectors(embedder_dir, "test", pairs)
    result = report(pairs, decide_all(rule, pairs, va, vb, [True] * len(pairs)), rule)
    print(f"(a) QQP test split, {len(pairs)} pairs\n{render(result)}\n")
    hard = read_pairs(HARD)
    ha, hb = vectors(embedder_dir, "hard", hard)
    r = report(hard, decide_all(rule, hard, ha, hb, [True] * len(hard)), rule)
    print(f"(b) hard negatives (tests/cache/data/semantic_pairs.jsonl)\n{render(r)}\n")


def shipped_rule(embedder_dir: Path) -> Rule:
    """The rule as the gateway loads it (its classifier compiled by set-up), or stop."""
    rule, numpy_because = load_rule(embedder_dir)
    if numpy_because:
        sys.exit(f"bench.semantic: {numpy_because}")
    return rule


def ms(values: list[float]) -> str:
    return f"P50 {pct(values, 0.5) * 1e3:6.2f} ms  P99 {pct(values, 0.99) * 1e3:6.2f} ms"


def filled_tier(embedder_dir: Path, entries: int) -> tuple[SemanticTier, bytes]:
    with np.load(embedder_dir / "dev-vectors.npz") as data:
        texts, vecs = list(data["texts"][:entries]), data["vectors"][:entries]
    config = SemanticConfig(enabled=True, namespaces=("*",), embedder_dir=embedder_dir)
    config = dataclasses.replace(config, max_entries=entries + 1, max_bytes=2**40)
    embedder = Embedder(embedder_dir, config.embed_threads)
    tier = SemanticTier(config, embedder, shipped_rule(embedder_dir), None)
    query = CacheQuery(b"", "ns", MODEL, "x", (), SAMPLING)
    found = tier.eligible(query, asking=False)
    assert found is not None
    scope = found[0]
    answer = CachedAnswer("an answer of a typical length " * 8, tuple(range(64)), "stop", 12, 64)
    gc.collect()
    rss = psutil.Process().memory_info().rss
    started = time.perf_counter()
    tier.index.add_many(
        [
            (Entry(i.to_bytes(16, "big"), scope, str(text), answer, ("ns", "bench"), 1e12), vec)
            for i, (text, vec) in enumerate(zip(texts, vecs, strict=True))
        ]
    )
    took = time.perf_counter() - started
    gc.collect()
    grown = psutil.Process().memory_info().rss - rss
    print(
        f"(d) {entries} entries: RSS +{grown / 2**20:.0f} MiB ({grown / entries:.0f} B/entry, "
        f"answers of {answer.size()} B included); index accounting {tier.index.bytes / 2**20:.0f} "
        f"MiB; vectors and graphs (usearch's count for its part) "
        f"{tier.index.memory_bytes() / 2**20:.0f} MiB; built in {took:.1f} s"
    )
    # What a full collection stalls a gateway for, before and after the heap is frozen as the
    # gateway freezes it (the rest of the run keeps it frozen, as a gateway would).
    tracked = len(gc.get_objects())
    full = timed(gc.collect)
    freeze_heap()
    print(
        f"    full garbage collection ({tracked} tracked objects, the gateway's modules loaded): "
        f"{full * 1e3:.1f} ms; after freeze_heap: {timed(gc.collect) * 1e3:.1f} ms"
    )
    return tier, scope


def timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def lookups(
    tier: SemanticTier, scope: bytes, queries: list[str], baseline: Embedder | None
) -> None:
    """The whole lookup per query, split into tokenizing, the model run, and search + verify; with
    a baseline embedder, its model run on the same query right after ours (same load, same text),
    then search + verify again with the rule's classifier in numpy (after a model run too, so
    both find the caches as a lookup does). Then, in a second pass, the lookup as the gateway makes
    it: the tier's own `lookup` on an event loop, the model on the embedding thread (alone on it:
    the first pass calls the model from this thread), after an idle gap, ours and the baseline's
    alternating."""
    tokenize_s: list[float] = []
    run_s: list[float] = []
    base_s: list[float] = []
    cpu_s: list[float] = []  # the process's CPU time during our model run (both threads)
    base_cpu_s: list[float] = []
    match_s: list[float] = []
    numpy_match_s: list[float] = []
    total_s: list[float] = []
    hits = 0
    for text in queries:
        t0 = time.perf_counter()
        ids = tier.embedder.token_ids(text)
        t1 = time.perf_counter()
        if ids is None:
            continue
        c1 = time.process_time()
        vector = tier.embedder.embed_ids(ids)
        cpu_s.append(time.process_time() - c1)
        t2 = time.perf_counter()
        hit = tier.match(scope, text, vector)
        t3 = time.perf_counter()
        if baseline is not None:
            c3 = time.process_time()
            baseline.embed_ids(ids)
            base_s.append(time.perf_counter() - t3)
            base_cpu_s.append(time.process_time() - c3)
            compiled, tier.rule.compiled = tier.rule.compiled, None
            t4 = time.perf_counter()
            tier.match(scope, text, vector)
            numpy_match_s.append(time.perf_counter() - t4)
            tier.rule.compiled = compiled
        hits += hit is not None
        tokenize_s.append(t1 - t0)
        run_s.append(t2 - t1)
        match_s.append(t3 - t2)
        total_s.append(t3 - t0)
    print(f"(c) lookups at {len(tier.index)} entries, {len(total_s)} queries ({hits} hits)")
    print(f"    tokenize             {ms(tokenize_s)}")
    print(f"    model run            {ms(run_s)}  CPU {statistics.mean(cpu_s) * 1e3:.2f} ms/run")
    if base_s:
        ratio = pct(base_s, 0.5) / pct(run_s, 0.5)
        cpu = statistics.mean(base_cpu_s) * 1e3
        print(
            f"    baseline model run   {ms(base_s)}  CPU {cpu:.2f} ms/run  "
            f"(ours {ratio:.2f}x faster at P50)"
        )
    print(f"    search + verify      {ms(match_s)}")
    if numpy_match_s:
        print(f"    ... classifier numpy {ms(numpy_match_s)}  (baseline)")
    print(f"    whole lookup         {ms(total_s)}  (the sum of the above)")
    tier_s: list[float] = []
    second_base_s: list[float] = []
    ours = tier.embedder

    async def second_pass() -> int:
        """One coroutine for the pass: each lookup awaited as the gateway awaits it, after an idle
        gap as a gateway's lookups come (the model's threads asleep); with a baseline embedder,
        the same lookup through it next (the tier's recent vectors cleared)."""
        found = 0
        for text in queries:
            query = CacheQuery(b"", "ns", MODEL, text, (), SAMPLING, semantic=True)
            for embedder, times in ((ours, tier_s), (baseline, second_base_s)):
                if embedder is None:
                    continue
                tier.embedder = embedder
                tier._recent.clear()
                await asyncio.sleep(IDLE_S)
                started = time.perf_counter()
                hit = await tier.lookup(query)
                times.append(time.perf_counter() - started)
                found += embedder is ours and hit is not None
        tier.embedder = ours
        return found

    tier_hits = uvloop.run(second_pass())
    print(f"    tier.lookup          {ms(tier_s)}  ({tier_hits} hits; what a miss pays)")
    if second_base_s:
        print(f"    ... baseline embedder {ms(second_base_s)}  (the same pass, alternating)")
    graph_recall(tier, scope, queries)


def index_baseline(tier: SemanticTier, scope: bytes, queries: list[str]) -> None:
    """The index's search (int8 graph, float32 re-rank) against a float32 graph over the same
    vectors with the previous release's settings, each timed right after a model run of the
    question (as a lookup meets the caches), alternating; and the RSS each graph adds."""
    from usearch.index import Index

    k = tier.settings.candidates
    vectors = np.stack([v for _, v in tier.index.entries()])
    gc.collect()
    rss = psutil.Process().memory_info().rss
    graph = Index(ndim=vectors.shape[1], metric="ip", dtype="f32", expansion_add=32)
    graph.add(np.arange(len(vectors), dtype=np.uint64), vectors)
    gc.collect()
    grown = psutil.Process().memory_info().rss - rss
    ours_s: list[float] = []
    base_s: list[float] = []
    for text in queries:
        vector = tier.embedder.embed(text)
        if vector is None:
            continue
        started = time.perf_counter()
        tier.index.search(scope, vector, k)
        ours_s.append(time.perf_counter() - started)
        tier.embedder.embed(text)
        started = time.perf_counter()
        found = graph.search(vector, k)
        graph.get(found.keys)
        base_s.append(time.perf_counter() - started)
    print(f"    search, int8 graph + float32 re-rank  {ms(ours_s)}")
    rss_note = f"(RSS of that graph +{grown / 2**20:.0f} MiB)"
    print(f"    search, float32 graph (baseline)      {ms(base_s)}  {rss_note}")


def graph_recall(tier: SemanticTier, scope: bytes, queries: list[str]) -> None:
    """The graph's candidates against an exhaustive search of the same scope: how often the
    nearest entry is missed, and how often the lookup's answer changes."""
    k = tier.settings.candidates
    first = overlap = changed = n = 0
    exact_s: list[float] = []
    for text in queries:
        vector = tier.embedder.embed(text)
        if vector is None:
            continue
        n += 1
        graph = [e.entry_id for e, _ in tier.index.search(scope, vector, k, exact=False)]
        started = time.perf_counter()
        exact = [e.entry_id for e, _ in tier.index.search(scope, vector, k, exact=True)]
        exact_s.append(time.perf_counter() - started)
        first += graph[:1] == exact[:1]
        overlap += len(set(graph) & set(exact))
        answers = [tier.match(scope, text, vector, exact=mode) for mode in (False, True)]
        changed += len({hit.entry if hit else None for hit in answers}) > 1
    print(
        f"    graph vs exhaustive  nearest entry found {first}/{n}, candidates {overlap}/{n * k}, "
        f"answers that differ {changed}/{n}; exhaustive search {ms(exact_s)}"
    )


@asynccontextmanager
async def redis_l2() -> AsyncIterator[RedisTier]:
    """An L2 tier on a redis-server of its own (the tests' helper starts it)."""
    from tests.cache.redis_server import RedisServer

    with tempfile.TemporaryDirectory() as work:
        server = RedisServer(Path(work))
        server.start()
        try:
            settings = RedisSettings(url=server.url, timeout_ms=1000.0, mac_key=b"bench-key" * 4)
            l2 = RedisTier(settings)
            yield l2
            await l2.close()
        finally:
            server.kill()


async def rebuild(tier: SemanticTier, entries: int) -> None:
    async with redis_l2() as l2:
        config = dataclasses.replace(tier.settings, max_entries=entries + 1)
        shared = SemanticTier(config, tier.embedder, tier.rule, l2)
        pipe = l2.client.pipeline(transaction=False)
        for n, (entry, vector) in enumerate(tier.index.entries()):
            name = l2.redis_key("ns", "bench", b"") + "sem-" + entry.entry_id.hex()
            pipe.set(name, l2.seal(name, encode_record(entry, vector, time.time())))
            if n % 2000 == 1999:
                await pipe.execute()
        await pipe.execute()
        started = time.perf_counter()
        await shared._rebuild()
        took = time.perf_counter() - started
        print(f"(d) rebuild from redis: {len(shared.index)} entries in {took:.1f} s")
        await shared.close()


async def behind_an_l2_hit(tier: SemanticTier, queries: list[str]) -> None:
    """Pairs of questions: the first answered by L2 (its embedding began when L1 missed), the
    second asked as soon as that answer is out, its lookup timed through the whole cascade (L1,
    L2's round trip, the semantic tier); the first's embedding cancelled when L2 answers, as
    shipped, or left to run, alternating pair by pair, each pair after an idle gap."""
    answer = CachedAnswer("an answer from redis", (1, 2, 3), "stop", 3, 3)
    shipped = tier.forgo
    times: dict[str, list[float]] = {"cancelled": [], "left to run": []}
    cancelled = tier.counts.cancelled
    async with redis_l2() as l2:
        lru = LruCache(1000, 2**30, 3600)
        cascade = TierCascade([L1Tier(lru), l2, tier], CacheMetrics())
        pairs = list(zip(queries[::2], queries[1::2], strict=False))
        for n, (first, second) in enumerate(pairs):
            answered = CacheQuery(n.to_bytes(16, "big"), "ns", MODEL, first, (), SAMPLING, True)
            asked = CacheQuery(b"\xff" * 16, "ns", MODEL, second, (), SAMPLING, True)
            await l2.put("ns", MODEL.name, answered.key, answer)
            for variant, forgo in (("cancelled", shipped), ("left to run", lambda _: None)):
                tier.forgo = forgo  # type: ignore[method-assign]
                lru.invalidate("", "")
                tier._recent.clear()
                await asyncio.sleep(IDLE_S)
                hit = await cascade.lookup(answered)
                assert hit is not None and hit.tier == "l2"
                started = time.perf_counter()
                await cascade.lookup(asked)
                times[variant].append(time.perf_counter() - started)
        tier.forgo = shipped  # type: ignore[method-assign]
    print(f"(e) a lookup right behind an L2 hit, {len(pairs)} pairs, through L1, L2 and this tier")
    for variant, took in times.items():
        print(f"    prepared embedding {variant:11s} {ms(took)}")
    print(f"    embeddings cancelled: {tier.counts.cancelled - cancelled}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--embedder", type=Path, default=Path("var/semantic"))
    ap.add_argument("--qqp", type=Path, default=QQP)
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument(
        "--baseline-embedder",
        type=Path,
        default=None,
        help="another embedder directory (e.g. the unquantized export) timed beside ours",
    )
    ap.add_argument(
        "--baseline-threads",
        type=int,
        default=None,
        help="intra-op threads of the baseline embedder (default: the tier's embed_threads)",
    )
    ap.add_argument(
        "--baseline-index",
        action="store_true",
        help="also time a float32 graph over the same vectors beside the index's search",
    )
    ap.add_argument(
        "--baseline-spin",
        action="store_true",
        help="the baseline's second thread spins within a run (ours sleeps between operators)",
    )
    record.add_flag(ap)
    args = ap.parse_args()
    with record.recording("semantic", record.record_dir(args)):
        if not args.skip_quality:
            quality(args.embedder, args.qqp)
        tier, scope = filled_tier(args.embedder, args.entries)
        test = read_pairs(args.qqp / "test.jsonl.gz")[: args.queries]
        # QQP test questions against dev questions: mostly misses, some paraphrase hits.
        threads = args.baseline_threads or tier.settings.embed_threads
        baseline = (
            Embedder(args.baseline_embedder, threads, spin=args.baseline_spin)
            if args.baseline_embedder
            else None
        )
        lookups(tier, scope, [p.a for p in test], baseline)
        if args.baseline_index:
            index_baseline(tier, scope, [p.a for p in test])
        uvloop.run(rebuild(tier, args.entries))
        uvloop.run(behind_an_l2_hit(tier, [p.b for p in test]))
        uvloop.run(tier.close())


if __name__ == "__main__":
    main()
