"""Whether two questions ask the same thing: the semantic tier's decision rule.

Cosine similarity alone cannot tell "convert Celsius to Fahrenheit" from "convert Fahrenheit to
Celsius" (0.98 apart is common for such pairs), so the rule has two parts:

1. Guards that refuse outright when the questions differ in something a sentence embedding blurs and
   an answer depends on: numbers and codes (any token with a digit, number words), negation, an
   antonym in place of a word, a term of a closed class (programming language, unit, month, weekday,
   operating system) present in one only, a named entity swapped for another, or two shared words in
   the opposite order around a relation word ("X to Y" / "Y to X", "A about B" / "B about A").
2. A classifier (numpy) over the two unit vectors, seen through a learned projection, and lexical
   features of the pair, trained on the QQP dev split (`bench/semantic_train.py`), whose probability
   must reach a threshold chosen on out-of-fold dev predictions for precision first.

A pair below the cosine floor is refused before either part runs. The weights, trees, word rarity
table, floor and threshold ship in `appliance/data/semantic_rule.npz`; `appliance semantic-eval` runs exactly this rule.
"""

from __future__ import annotations

import hashlib
import io
import math
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

RULE_FILE = Path(__file__).resolve().parent.parent / "data" / "semantic_rule.npz"

_WORD = re.compile(r"[a-z0-9]+(?:\+\+|#)?")
_NEGATION = re.compile(
    r"\b(?:not|no|never|none|nobody|nothing|neither|nor|without|cannot)\b|n't\b|n’t\b"
)
_HAS_DIGIT = re.compile(r"[0-9]").search
_CAPITALIZED = re.compile(r"\b[A-Z][A-Za-z0-9]*(?:\+\+|#)?")


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


STOPWORDS = frozenset(
    _words(
        """a an the is are was were be been being am do does did doing have has had having i me my
        we our you your he she it its they them their this that these those what which who whom
        whose when where why how there here of in on at by for with as and or but if then so than
        too very can could would should will shall may might must s t to from into about over under
        up down out off any some all most more much many such only own same just also get got one
        way ways best good really quora someone something anyone anything thing things like"""
    )
)
# Words that relate the words around them: their two sides may not trade places.
RELATIONS = frozenset(
    _words("to into from than vs versus about over against before after for by under above")
)
# Number words as digits ("one" is left out: far more often a pronoun than a count).
NUMBER_WORDS = {
    w: str(n)
    for n, w in enumerate(
        _words(
            """zero _ two three four five six seven eight nine ten eleven twelve thirteen fourteen
            fifteen sixteen seventeen eighteen nineteen twenty"""
        )
    )
    if w != "_"
} | {"thirty": "30", "forty": "40", "fifty": "50", "hundred": "100", "thousand": "1000"}
NUMBER_WORDS["million"] = "1000000"
NUMBER_WORDS["billion"] = "1000000000"
# Closed classes: a term of one present in only one question changes what is asked.
CLOSED_TERMS = frozenset(
    _words(
        """python java javascript typescript c c++ c# golang rust ruby php perl swift kotlin scala
        haskell erlang elixir lua r matlab julia fortran cobol sql bash powershell dart
        html css react angular vue django flask node nodejs
        celsius fahrenheit kelvin meters meter metres km kilometers kilometres miles mile feet foot
        inches inch cm centimeters kg kilograms pounds pound lbs grams gram ounces ounce liters
        litres gallons gallon dollars dollar euros euro rupees rupee yen yuan bitcoin
        january february march april june july august september october november december
        monday tuesday wednesday thursday friday saturday sunday
        windows linux ubuntu mac macos ios android iphone ipad"""
    )
)
_ANTONYM_PAIRS = """increase decrease|increasing decreasing|best worst|better worse|advantages
disadvantages|advantage disadvantage|pros cons|buy sell|buying selling|good bad|hot cold|up down|
maximum minimum|max min|largest smallest|biggest smallest|longest shortest|highest lowest|high low|
before after|first last|rich poor|cheap expensive|cheapest expensive|fast slow|fastest slowest|
start stop|open close|win lose|encrypt decrypt|upload download|import export|compress decompress|
male female|men women|man woman|boy girl|boys girls|husband wife|gain lose|gaining losing|
easy hard|easiest hardest|true false|love hate|north south|east west|positive negative|
legal illegal|safe dangerous|import export|add remove|enable disable|old new|older newer|
past future|inner outer|input output|min max|lower upper|uppercase lowercase|private public|
acid base|debit credit|borrow lend|push pull|send receive|convex concave|asc desc|ascending
descending|happy sad|strong weak|strengths weaknesses|success failure|profit loss"""
ANTONYMS: dict[str, frozenset[str]] = {}
for _pair in _ANTONYM_PAIRS.replace("\n", " ").split("|"):
    _x, _y = _pair.split()
    ANTONYMS[_x] = ANTONYMS.get(_x, frozenset()) | {_y}
    ANTONYMS[_y] = ANTONYMS.get(_y, frozenset()) | {_x}

Vector = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class Question:
    """The lexical facts of one question the rule compares."""

    words: tuple[str, ...]
    word_set: frozenset[str]
    content: frozenset[str]
    numbers: frozenset[str]
    negated: bool
    entities: frozenset[str]
    closed: frozenset[str]
    stems: frozenset[str]  # every word, plurals folded
    content_stems: frozenset[str]  # the content words, plurals folded
    grams: frozenset[str]  # character trigrams of the words, spaces between
    bigrams: frozenset[tuple[str, str]]  # the words' consecutive pairs


def analyze(text: str) -> Question:
    lower = text.lower()
    words = tuple(_WORD.findall(lower))
    content = frozenset(w for w in words if w not in STOPWORDS)
    capitalized = [m.group(0).lower() for m in _CAPITALIZED.finditer(text) if m.start() > 0]
    return Question(
        words=words,
        word_set=frozenset(words),
        content=content,
        numbers=frozenset(
            NUMBER_WORDS.get(w, w) for w in words if w in NUMBER_WORDS or _HAS_DIGIT(w)
        ),
        negated=_NEGATION.search(lower.replace("’", "'")) is not None,
        entities=frozenset(w for w in capitalized if w not in STOPWORDS and w != "i"),
        closed=frozenset(_stem(w) for w in words if w in CLOSED_TERMS),
        stems=frozenset(_stem(w) for w in words),
        content_stems=frozenset(_stem(w) for w in content),
        grams=_trigrams(words),
        bigrams=frozenset(pairwise(words)),
    )


def _trigrams(words: tuple[str, ...]) -> frozenset[str]:
    joined = f" {' '.join(words)} "
    return frozenset(map("".join, zip(joined, joined[1:], joined[2:], strict=False)))


IDF_BUCKETS = 1 << 16


def idf_bucket(word: str) -> int:
    """Where a word's inverse document frequency lives in the rule's table (a stable hash: the
    table is learned once and shipped, so Python's per-process string hash will not do)."""
    return zlib.crc32(word.encode()) & (IDF_BUCKETS - 1)


def idf_weights(idf: npt.NDArray[np.float32]) -> Callable[[str], float]:
    """A word's weight in the table, kept for the most recent words (a lookup weighs the same
    question's words once per candidate; a list is indexed several times faster than an array)."""
    table: list[float] = idf.tolist()

    @lru_cache(maxsize=1 << 16)
    def weight(word: str) -> float:
        return table[idf_bucket(word)]

    return weight


def idf_table(questions: list[Question]) -> npt.NDArray[np.float32]:
    """log((n + 1) / (df + 1)) per bucket, df counted over the questions' folded words."""
    df = np.zeros(IDF_BUCKETS, dtype=np.float64)
    for q in questions:
        for w in q.stems:
            df[idf_bucket(w)] += 1
    return np.log((len(questions) + 1) / (df + 1)).astype(np.float32)


def _stem(word: str) -> str:
    """A crude plural fold, so "capital"/"capitals" count as one word in the features."""
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def _swapped_order(a: Question, b: Question) -> bool:
    """Two words both questions share, in opposite orders, with a relation word between them."""
    shared = [w for w in a.words if w in b.content and w in a.content]
    if len(shared) < 2:
        return False
    pos_a = {w: i for i, w in enumerate(a.words)}
    pos_b = {w: i for i, w in enumerate(b.words)}
    rel_a = [i for i, w in enumerate(a.words) if w in RELATIONS]
    rel_b = [i for i, w in enumerate(b.words) if w in RELATIONS]
    # The same words in another order around a shared word ("why do cats hate dogs" / "dogs hate
    # cats") is a swap too: subject and object traded places.
    same_words = a.content == b.content
    if same_words:
        rel_a += [pos_a[w] for w in shared]
        rel_b += [pos_b[w] for w in shared]
    if not (rel_a and rel_b):
        return False
    for i, x in enumerate(shared):
        for y in shared[i + 1 :]:
            ax, ay, bx, by = pos_a[x], pos_a[y], pos_b[x], pos_b[y]
            if (ax - ay) * (bx - by) >= 0:
                continue
            if any(min(ax, ay) < r < max(ax, ay) for r in rel_a) and any(
                min(bx, by) < r < max(bx, by) for r in rel_b
            ):
                return True
    return False


def veto(a: Question, b: Question) -> str:
    """Why the two questions cannot share an answer whatever their similarity ("" if no guard
    refuses)."""
    if a.numbers != b.numbers:
        return "numbers"
    if a.negated != b.negated:
        return "negation"
    if a.closed != b.closed:
        return "closed-class term"
    a_words, b_words = a.word_set, b.word_set
    for w in a_words - b_words:
        if ANTONYMS.get(w, frozenset()) & (b_words - a_words):
            return "antonym"
    if _unmatched(a.entities, b_words) and _unmatched(b.entities, a_words):
        return "entity"
    if _swapped_order(a, b):
        return "order"
    return ""


def _unmatched(entities: frozenset[str], words: frozenset[str]) -> set[str]:
    """Entities the other question does not name, allowing a derived form (India/Indian)."""
    return {
        e
        for e in entities
        if e not in words and not (len(e) >= 5 and any(w.startswith(e[:5]) for w in words))
    }


def lexical_features(a: Question, b: Question, weight: Callable[[str], float]) -> list[float]:
    """Symmetric lexical facts of a pair, for the classifier: overlaps of words (plain and weighted
    by rarity, `weight` from idf_weights), of word pairs and of character trigrams, and how much
    rare material only one side has."""
    sa, sb = a.content_stems, b.content_stems
    shared = len(sa & sb)
    union = len(sa) + len(sb) - shared
    only_a, only_b = len(sa) - shared, len(sb) - shared
    all_a, all_b = a.word_set, b.word_set
    ent_a, ent_b = len(a.entities - all_b), len(b.entities - all_a)
    la, lb = len(a.words), len(b.words)
    return [
        shared / union if union else 1.0,
        _jaccard(all_a, all_b),
        float(min(only_a, only_b)),
        float(max(only_a, only_b)),
        float(min(ent_a, ent_b)),
        float(max(ent_a, ent_b)),
        abs(la - lb) / max(1, la, lb),
        float(a.words[:1] == b.words[:1]),
        *_weighted_overlap(a.stems, b.stems, weight),
        _jaccard(a.grams, b.grams),
        _jaccard(a.bigrams, b.bigrams),
        float(a.words[-1:] == b.words[-1:]),
        math.log((1 + la) / (1 + lb)) ** 2,
    ]


def _jaccard(x: frozenset[Any], y: frozenset[Any]) -> float:
    shared = len(x & y)
    return shared / max(1, len(x) + len(y) - shared)


def _weighted_overlap(
    sa: frozenset[str], sb: frozenset[str], weight_of: Callable[[str], float]
) -> list[float]:
    weight = {w: weight_of(w) for w in sa | sb}
    union = sum(weight.values())
    only_a = sum(weight[w] for w in sa - sb)
    only_b = sum(weight[w] for w in sb - sa)
    return [
        sum(weight[w] for w in sa & sb) / union if union else 1.0,
        min(only_a, only_b),
        max(only_a, only_b),
        max((weight[w] for w in sa ^ sb), default=0.0),
    ]


def features(
    u: Vector, v: Vector, a: Question, b: Question, weight: Callable[[str], float]
) -> Vector:
    """The pair's scalar features: the cosine, then the lexical ones."""
    return np.array([float(u @ v), *lexical_features(a, b, weight)], dtype=np.float32)


@dataclass(frozen=True, slots=True)
class Decision:
    same: bool
    similarity: float  # cosine of the two unit vectors
    score: float  # the classifier's probability (0 when a guard or the floor refused)
    why: str  # "" when same, else what refused: "floor", a guard's name, or "score"


class Trees:
    """A boosted tree ensemble (scikit-learn's HistGradientBoostingClassifier, exported by
    `bench/semantic_train.py`) evaluated in numpy. The trees' nodes are laid end to end in flat
    arrays, a node's two children side by side in `child` (left, then right), and a leaf leads to
    itself, so every tree of every row takes one step a level, `depth` levels in all, with no test
    for having arrived: a row goes left where its feature is <= the node's threshold."""

    def __init__(self, data: Any) -> None:
        trees, width = data["tree_feature"].shape
        flat = np.arange(trees * width).reshape(trees, width)
        base = (np.arange(trees) * width)[:, None]
        leaf = data["tree_leaf"].astype(bool)
        left = np.where(leaf, flat, base + data["tree_left"]).ravel()
        right = np.where(leaf, flat, base + data["tree_right"]).ravel()
        self.child = np.stack([left, right], axis=1).ravel().astype(np.intp)
        self.feature = np.where(leaf, 0, data["tree_feature"]).astype(np.intp).ravel()
        self.cut = data["tree_threshold"].astype(np.float64).ravel()
        self.value = data["tree_value"].astype(np.float64).ravel()
        self.roots = base[:, 0].astype(np.intp)
        self.base = float(data["tree_base"])
        self.depth = int(data["tree_depth"])

    def probabilities(self, x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """P(same) for each row of x (n × features)."""
        rows, width = x.shape
        flat = np.ascontiguousarray(x).ravel()
        row_start = (np.arange(rows) * width)[:, None]
        node = np.broadcast_to(self.roots, (rows, self.roots.size))
        for _ in range(self.depth):
            right = flat[row_start + self.feature[node]] > self.cut[node]
            node = self.child[2 * node + right]
        raw = self.base + self.value[node].sum(axis=1)
        out: npt.NDArray[np.float64] = 1.0 / (1.0 + np.exp(-raw))
        return out


class Rule:
    """The shipped decision rule: floor, guards, then the classifier's threshold.

    The classifier has two stages. A small network projects both unit vectors with a learned matrix
    P (a low-rank metric: which directions of the embedding matter for "same question"), takes the
    projections' elementwise product and absolute difference (symmetric in the two questions) and
    the standardized pair features, and applies one ReLU layer and a logistic output. Boosted trees
    then take that probability beside the pair features: the network sees the vectors well, the
    trees the thresholds and interactions of the lexical facts (how much rare material only one
    side has, at which cosine).
    """

    def __init__(self, path: Path = RULE_FILE) -> None:
        raw = path.read_bytes()
        self.digest = hashlib.sha256(raw).hexdigest()
        # The same classifier compiled to one onnxruntime call (classifier.load_rule sets it).
        self.compiled: Callable[[Vector, Vector, Vector], Vector] | None = None
        with np.load(io.BytesIO(raw)) as data:
            self.proj = data["proj"].astype(np.float32)
            self.mean = data["mean"].astype(np.float32)
            self.scale = data["scale"].astype(np.float32)
            self.w1 = data["w1"].astype(np.float32)
            self.b1 = data["b1"].astype(np.float32)
            self.w2 = data["w2"].astype(np.float32)
            self.b2 = float(data["b2"])
            self.idf = data["idf"].astype(np.float32)
            self.weight = idf_weights(self.idf)
            self.trees = Trees(data)
            self.floor = float(data["floor"])
            self.threshold = float(data["threshold"])

    def network(self, u: Vector, v: Vector, x: Vector) -> Vector:
        """The first stage's probabilities for rows of vectors (n × dim each; u may be one vector,
        the question every row compares) and pair features (n × k)."""
        pu, pv = u @ self.proj, v @ self.proj
        z = np.concatenate([pu * pv, np.abs(pu - pv), (x - self.mean) / self.scale], axis=1)
        h = np.maximum(z @ self.w1 + self.b1, 0.0)
        out: Vector = (1.0 / (1.0 + np.exp(-(h @ self.w2 + self.b2)))).astype(np.float32)
        return out

    def scores(self, u: Vector, v: Vector, x: Vector) -> Vector:
        """The classifier's probabilities: the trees' over the features and the network's score."""
        if self.compiled is not None:
            return self.compiled(u, v, x)
        return self.numpy_scores(u, v, x)

    def numpy_scores(self, u: Vector, v: Vector, x: Vector) -> Vector:
        """What `scores` computes, in numpy: the reference the compiled graph is tested against."""
        net = self.network(u, v, x)
        z = np.concatenate([x, net[:, None]], axis=1).astype(np.float64)
        return self.trees.probabilities(z).astype(np.float32)

    def features(self, u: Vector, v: Vector, a: Question, b: Question) -> Vector:
        return features(u, v, a, b, self.weight)

    def decide(self, u: Vector, v: Vector, a: Question, b: Question) -> Decision:
        return self._decide(u, lambda: a, [(v, lambda: b)])[0]

    def decide_many(
        self, u: Vector, text: str, others: Sequence[tuple[Vector, str]]
    ) -> list[Decision]:
        """Question `text` (vector u) against stored questions. Most of a lookup's candidates fall
        below the floor; only those above it (and then the question itself) are analyzed."""
        asked: list[Question] = []

        def question() -> Question:
            if not asked:
                asked.append(analyze(text))
            return asked[0]

        return self._decide(u, question, [(v, partial(analyze, b)) for v, b in others])

    def _decide(
        self,
        u: Vector,
        a: Callable[[], Question],
        others: Sequence[tuple[Vector, Callable[[], Question]]],
    ) -> list[Decision]:
        """The floor, then the guards, then the classifier, run once over the pairs the floor and
        the guards let through; questions are asked for only past the floor."""
        out: list[Decision] = []
        scored: list[tuple[int, Question]] = []
        for v, b_of in others:
            cos = float(u @ v)
            b = None if cos < self.floor else b_of()
            why = "floor" if b is None else veto(a(), b)
            out.append(Decision(False, cos, 0.0, why))
            if b is not None and not why:
                scored.append((len(out) - 1, b))
        if scored:
            vs = np.stack([others[i][0] for i, _ in scored])
            x = np.stack([self.features(u, others[i][0], a(), b) for i, b in scored])
            scores = self.scores(u, vs, x)
            for (i, _), score in zip(scored, scores, strict=True):
                same = bool(score >= self.threshold)
                out[i] = Decision(same, out[i].similarity, float(score), "" if same else "score")
        return out
