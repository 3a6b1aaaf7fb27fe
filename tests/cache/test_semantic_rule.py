"""The semantic tier's decision rule on near-identical questions with different answers, and the
`appliance semantic-eval` command that reports it.

tests/cache/data/semantic_pairs.jsonl is written for this (not taken from QQP): pairs that differ in
one entity, number, programming language or platform, conversion direction, negation, antonym or
year (label 0), and paraphrases of the same questions (label 1).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from appliance.cache.classifier import load_rule
from appliance.cache.embedder import Embedder, EmbeddingCancelled, EmbedRun, Vector
from appliance.cache.entry import CachedAnswer
from appliance.cache.paraphrase import RULE_FILE, Rule, analyze, veto
from appliance.cache.semantic_eval import decide_all, embed_pairs, read_pairs
from appliance.cache.vectors import Entry, VectorIndex

PAIRS = Path(__file__).parent / "data" / "semantic_pairs.jsonl"


@pytest.fixture(scope="module")
def embedder(embedder_dir: Path) -> Embedder:
    return Embedder(embedder_dir)


@pytest.fixture(scope="module")
def shipped(embedder_dir: Path) -> Rule:
    """The rule as the gateway loads it: its classifier compiled by set-up."""
    rule, numpy_because = load_rule(embedder_dir)
    assert numpy_because == "" and rule.compiled is not None
    return rule


def test_hard_negatives_almost_never_hit_and_paraphrases_do(
    embedder: Embedder, shipped: Rule
) -> None:
    pairs = read_pairs(PAIRS)
    rule = shipped
    va, vb, fits = embed_pairs(embedder, pairs)
    decisions = decide_all(rule, pairs, va, vb, fits)
    negatives = [d for p, d in zip(pairs, decisions, strict=True) if p.label == 0]
    positives = [d for p, d in zip(pairs, decisions, strict=True) if p.label == 1]
    false_hits = sum(d.same for d in negatives)
    assert len(negatives) >= 90 and len(positives) >= 40
    assert false_hits / len(negatives) <= 0.02, [
        (p.a, p.b) for p, d in zip(pairs, decisions, strict=True) if p.label == 0 and d.same
    ]
    assert sum(d.same for d in positives) / len(positives) >= 0.5
    # Plain cosine cannot tell them apart: most negatives sit above RedisVL's default threshold.
    cos = (va * vb).sum(1)
    labels = np.array([p.label for p in pairs])
    assert (cos[labels == 0] >= 0.9).mean() > 0.3


def test_the_motivating_examples(embedder: Embedder) -> None:
    rule = Rule()

    def same(a: str, b: str) -> bool:
        u, v = embedder.embed(a), embedder.embed(b)
        assert u is not None and v is not None
        return rule.decide(u, v, analyze(a), analyze(b)).same

    assert same(
        "How do I convert Celsius to Fahrenheit?", "How can I convert Celsius to Fahrenheit?"
    )
    assert same("How do I reverse a list in Python?", "How can I reverse a list in Python?")
    assert not same(
        "How do I convert Celsius to Fahrenheit?", "How do I convert Fahrenheit to Celsius?"
    )
    assert not same("How do I reverse a list in Python?", "How do I reverse a list in Java?")


@pytest.mark.parametrize(
    ("a", "b", "why"),
    [
        ("Reset an HP M604n", "Reset an HP M604dn", "numbers"),
        (
            "What do people in Denver think about Seattle?",
            "What do people in Seattle think about Denver?",
            "order",
        ),
        ("Why is the sky blue?", "Why is the sky not blue?", "negation"),
        ("How do I gain weight?", "How do I lose weight?", "antonym"),
        ("How do I sort a list in Python?", "How do I sort a list in Ruby?", "closed-class term"),
        ("What is the capital of France?", "What is the capital of Germany?", "entity"),
        ("What's the capital of France?", "Which city is France's capital?", ""),
        ("How can I lose weight fast?", "How can I fast lose weight?", ""),
    ],
)
def test_guards(a: str, b: str, why: str) -> None:
    assert veto(analyze(a), analyze(b)) == why


def run_eval(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "appliance", "semantic-eval", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_semantic_eval_reports_the_shipped_rule(embedder_dir: Path, tmp_path: Path) -> None:
    pairs = tmp_path / "pairs.jsonl.gz"
    with gzip.open(pairs, "wt") as f:
        f.write(
            json.dumps(
                {"a": "Why is the sky blue?", "b": "Why does the sky look blue?", "label": 1}
            )
            + "\n"
        )
        f.write(
            json.dumps({"a": "How do I gain weight?", "b": "How do I lose weight?", "label": 0})
            + "\n"
        )
    out = run_eval("--pairs", str(pairs), "--embedder", str(embedder_dir), "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert (result["positives"], result["negatives"], result["false_hits"]) == (1, 1, 0)
    assert {"precision", "recall", "cosine", "curve"} <= set(result)
    table = run_eval("--pairs", str(pairs), "--embedder", str(embedder_dir))
    assert "plain cosine >= 0.90" in table.stdout and "shipped" in table.stdout


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("not json", "not JSON"),
        ('{"a": "x", "b": "y", "label": 2}', '"label" must be 0 or 1'),
        ('{"a": 1, "b": "y", "label": 0}', '"a" and "b" must be strings'),
        ("[1, 2]", "expected an object"),
    ],
)
def test_semantic_eval_bad_lines(tmp_path: Path, line: str, says: str) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"a": "x", "b": "y", "label": 1}) + "\n" + line + "\n")
    out = run_eval("--pairs", str(pairs), "--embedder", str(tmp_path / "none"))
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and f"{pairs}:2: {says}" in out.stderr


def test_semantic_eval_without_embedder_says_how_to_make_it(tmp_path: Path) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"a": "x", "b": "y", "label": 1}) + "\n")
    out = run_eval("--pairs", str(pairs), "--embedder", str(tmp_path / "none"))
    assert out.returncode == 2 and "appliance semantic-setup" in out.stderr


def test_semantic_setup_says_one_line(
    semantic_setup: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """Set-up output is the operator's: what was written, without the exporter's and the
    quantizer's chatter."""
    dest, run = semantic_setup
    assert run.stdout == f"embedder: {dest}\n"
    assert run.stderr == ""
    assert {p.name for p in dest.iterdir()} == {
        "model.onnx",
        "tokenizer.json",
        "embedder.json",
        "classifier.onnx",
    }


def test_exported_trees_score_as_scikit_learn_does() -> None:
    from sklearn.ensemble import HistGradientBoostingClassifier

    from appliance.cache.paraphrase import Trees
    from bench.semantic_train import export_trees

    rng = np.random.default_rng(0)
    x = rng.normal(size=(3000, 5))
    y = (x[:, 0] + x[:, 1] * x[:, 2] + rng.normal(scale=0.5, size=3000) > 0).astype(int)
    model = HistGradientBoostingClassifier(max_iter=40, random_state=0).fit(x, y)
    want = model.predict_proba(x)[:, 1]
    assert want.std() > 0.2  # a fitted model, not a constant
    got = Trees(export_trees(model)).probabilities(x)
    np.testing.assert_allclose(got, want, atol=1e-9)


def test_the_compiled_classifier_scores_as_the_numpy_rule(
    embedder: Embedder, shipped: Rule
) -> None:
    pairs = read_pairs(PAIRS)
    va, vb, _ = embed_pairs(embedder, pairs)
    x = np.stack(
        [
            shipped.features(u, v, analyze(p.a), analyze(p.b))
            for p, u, v in zip(pairs, va, vb, strict=True)
        ]
    )
    compiled, reference = shipped.scores(va, vb, x), shipped.numpy_scores(va, vb, x)
    assert reference.std() > 0.1  # scores that vary, not a constant
    np.testing.assert_allclose(compiled, reference, atol=1e-6)
    t = shipped.threshold
    assert ((compiled >= t) == (reference >= t)).all()
    # One question against several candidates, as a lookup asks.
    np.testing.assert_allclose(
        shipped.scores(va[0], vb[:4], x[:4]), shipped.numpy_scores(va[0], vb[:4], x[:4]), atol=1e-6
    )


def test_a_classifier_compiled_from_another_rule_is_not_used(
    embedder_dir: Path, tmp_path: Path
) -> None:
    with np.load(RULE_FILE) as data:
        arrays = dict(data)
    arrays["threshold"] = np.float32(0.5)
    other = tmp_path / "rule.npz"
    np.savez(other, **arrays)
    rule, why = load_rule(embedder_dir, other)
    assert rule.compiled is None and rule.threshold == 0.5
    assert "another rule file" in why and "appliance semantic-setup" in why
    rule, why = load_rule(tmp_path)
    assert rule.compiled is None and "no classifier.onnx" in why


def test_pair_features_are_symmetric_and_see_rare_words() -> None:
    rule = Rule()
    u = np.full(4, 0.5, dtype=np.float32)
    a = analyze("How do I learn the piano quickly?")
    b = analyze("How can I learn to play piano fast?")
    np.testing.assert_allclose(rule.features(u, u, a, b), rule.features(u, u, b, a), rtol=1e-6)
    # A rare word present in one question only weighs more than a common one (the features after
    # the cosine and the eight plain lexical ones: weighted overlap, then min/max/largest weight of
    # the words one side only has).
    rare = rule.features(u, u, a, analyze("How do I learn the piano quickly in Reykjavik?"))
    common = rule.features(u, u, a, analyze("How do I learn the piano quickly in time?"))
    assert rare[9] < common[9] and rare[11] > common[11] and rare[12] > common[12]


def test_a_cluster_of_near_identical_questions_does_not_hide_the_nearest_entry(
    embedder: Embedder,
) -> None:
    """Hundreds of questions that differ only in numbers, in the scope beside the one that matches:
    the search must still return that one (the graph search alone lost it from 160 entries on)."""
    texts = ["What is the meaning of life?", "How do I get rid of acne?"] + [
        f"What was the rainfall in district {n} during week {n // 2 + 7}?" for n in range(440)
    ]
    vectors, _ = embedder.embed_many(texts)
    index = VectorIndex(embedder.dim, 1000, 10**9)
    answer = CachedAnswer("42", (1,), "stop", 1, 1)
    scope = b"s" * 16
    for n, (text, vector) in enumerate(zip(texts, vectors, strict=True)):
        index.add(Entry(n.to_bytes(16, "big"), scope, text, answer, ("ns", "m"), 1e18), vector)
    probe = embedder.embed("What's the meaning of life?")
    assert probe is not None
    found = [entry.text for entry, _ in index.search(scope, probe, 4)]
    assert found[0] == "What is the meaning of life?", found


async def test_a_prepared_embedding_is_the_one_the_lookup_uses(
    embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedding prepare starts while L2 answers is awaited by the lookup, not made twice."""
    from appliance.cache.keys import ModelIdentity, SamplingKey
    from appliance.cache.semantic import SemanticTier
    from appliance.cache.tiers import CacheQuery
    from appliance.config import SemanticConfig

    calls: list[str] = []
    embed = embedder.embed

    def counted(text: str, run: EmbedRun | None = None) -> Vector | None:
        calls.append(text)
        return embed(text, run)

    config = SemanticConfig(enabled=True, namespaces=("*",), request_default=True)
    tier = SemanticTier(config, embedder, Rule(), None)
    monkeypatch.setattr(embedder, "embed", counted)
    try:
        sampling = SamplingKey(8, True, 0.0, 1.0, 1, None, ())
        model = ModelIdentity("m", "e", "t", "v")
        query = CacheQuery(b"k" * 16, "ns", model, "What is the capital of France?", (), sampling)
        tier.prepare(query)
        tier.prepare(query)  # one embedding per text, however often prepared
        assert await tier.lookup(query) is None  # an empty index: a miss
        assert calls == ["What is the capital of France?"]
    finally:
        await tier.close()


def test_a_cancelled_embedding_raises_and_leaves_the_model_usable(embedder: Embedder) -> None:
    text = " ".join(["word"] * 120)  # a long run: the cancel lands before or while it runs
    ids = embedder.token_ids(text)
    assert ids is not None
    whole = embedder.embed_ids(ids)
    cancelled = EmbedRun()
    cancelled.cancel()
    with pytest.raises(EmbeddingCancelled):
        embedder.embed(text, cancelled)
    for _ in range(3):
        run = EmbedRun()
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(embedder.embed_ids, ids, run)  # no check before the model
            run.cancel()
            with pytest.raises(EmbeddingCancelled):
                running.result()
    assert np.array_equal(embedder.embed_ids(ids), whole)
    assert np.array_equal(embedder.embed_ids(ids, EmbedRun()), whole)


async def test_an_embedding_prepared_for_an_answered_lookup_is_cancelled_unless_wanted(
    embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """forgo (an earlier tier answered) cancels the embedding prepare started, unless another
    request prepared it too or a lookup already waits on it; a later lookup embeds anew."""
    from appliance.cache.keys import ModelIdentity, SamplingKey
    from appliance.cache.semantic import SemanticTier
    from appliance.cache.tiers import CacheQuery
    from appliance.config import SemanticConfig

    runs: list[tuple[str, str]] = []
    embed = embedder.embed

    def observed(text: str, run: EmbedRun | None = None) -> Vector | None:
        try:
            vector = embed(text, run)
        except EmbeddingCancelled:
            runs.append((text, "cancelled"))
            raise
        runs.append((text, "embedded"))
        return vector

    config = SemanticConfig(enabled=True, namespaces=("*",), request_default=True)
    tier = SemanticTier(config, embedder, Rule(), None)
    monkeypatch.setattr(embedder, "embed", observed)
    model = ModelIdentity("m", "e", "t", "v")
    sampling = SamplingKey(8, True, 0.0, 1.0, 1, None, ())

    def query(text: str) -> CacheQuery:
        return CacheQuery(b"k" * 16, "ns", model, text, (), sampling)

    try:
        # One request prepared it and was answered before this tier: cancelled.
        alone = query("What is the capital of France?")
        tier.prepare(alone)
        tier.forgo(alone)
        assert tier.counters()["semantic_embeddings_cancelled"] == 1
        assert await tier.lookup(alone) is None  # an empty index: a miss, but a vector was made
        assert runs == [(alone.prompt, "cancelled"), (alone.prompt, "embedded")]
        # Two requests prepared it; the one answered early leaves it to the other.
        shared = query("How do I learn Python?")
        tier.prepare(shared)
        tier.prepare(shared)
        tier.forgo(shared)
        assert await tier.lookup(shared) is None
        # A lookup already waits on it when the other request is answered early.
        waited = query("Why is the sky blue?")
        tier.prepare(waited)
        tier.prepare(waited)
        lookup = asyncio.create_task(tier.lookup(waited))
        await asyncio.sleep(0)  # the lookup now awaits the embedding
        tier.forgo(waited)
        assert await lookup is None
        assert runs[2:] == [(shared.prompt, "embedded"), (waited.prompt, "embedded")]
        assert tier.counters()["semantic_embeddings_cancelled"] == 1
        assert tier.counts.skipped == 0  # every lookup had its vector
    finally:
        await tier.close()


def test_many_texts_embed_as_each_alone(embedder: Embedder) -> None:
    """The vectors the rule is trained and evaluated on are the ones the gateway computes, one
    question per run (the int8 model's activation scale is per run)."""
    texts = ["How do I learn Python?", "What is the capital of France?", "Why is the sky blue?"]
    many, fits = embedder.embed_many(texts)
    assert fits == [True, True, True]
    for text, vector in zip(texts, many, strict=True):
        alone = embedder.embed(text)
        assert alone is not None and np.array_equal(vector, alone)


def test_a_pairs_file_without_line_ends_is_refused_after_a_bounded_read(tmp_path: Path) -> None:
    """A wrong file (one endless line: /dev/zero, a binary) costs one bounded line, and so does
    a gzip file that inflates to one."""
    from appliance.cache.semantic_eval import MAX_LINE_CHARS, PairsError

    plain = tmp_path / "one-line.jsonl"
    plain.write_text('{"a": "' + "x" * (MAX_LINE_CHARS + 10))
    packed = tmp_path / "one-line.jsonl.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as f:
        f.write("y" * (MAX_LINE_CHARS + 10))
    for path in (plain, packed):
        with pytest.raises(PairsError, match=rf"{path.name}:1: a line over {MAX_LINE_CHARS:,}"):
            read_pairs(path)
