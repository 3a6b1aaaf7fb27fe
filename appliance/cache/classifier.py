"""The decision rule's classifier run as one onnxruntime call.

The rule ships as arrays (`appliance/data/semantic_rule.npz`) and paraphrase.Rule scores with them in
numpy, about forty numpy calls on the two to four pairs of a lookup. `appliance semantic-setup` writes the same
computation (network, then trees) as one ONNX graph, `classifier.onnx`, beside the embedder, stamped
with the SHA-256 of the rule file it was made from; the gateway loads it when the stamp matches the
shipped rule, and otherwise scores in numpy and says why in one log line. The graph compares the
trees' thresholds in float64, as the numpy trees do, so both give the same decisions. One call is
cheaper than the forty, though inside a whole lookup the difference is within the run-to-run noise
(docs/PERFORMANCE.md#semantic-cache-tier).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from appliance.cache.embedder import Vector, cpu_session
from appliance.cache.paraphrase import RULE_FILE, Rule

FILE = "classifier.onnx"
STAMP = "rule_sha256"


class Compiled:
    """Rule.scores through the compiled graph."""

    def __init__(self, path: Path, digest: str) -> None:
        self._session = cpu_session(path, threads=1)
        made_from = self._session.get_modelmeta().custom_metadata_map.get(STAMP, "")
        if made_from != digest:
            raise ValueError(f"{path} was made from another rule file")

    def __call__(self, u: Vector, v: Vector, x: Vector) -> Vector:
        out = self._session.run(None, {"u": np.atleast_2d(u), "v": v, "x": x})[0]
        return np.ascontiguousarray(out[:, 0], dtype=np.float32)


def load_rule(embedder_dir: Path | None, path: Path = RULE_FILE) -> tuple[Rule, str]:
    """The rule, scoring through the compiled classifier in `embedder_dir` when it was made from
    this rule file; and "" or why it scores in numpy."""
    rule = Rule(path)
    if embedder_dir is None:
        return rule, "no embedder directory"
    compiled = embedder_dir / FILE
    if not compiled.exists():
        return rule, f"no {FILE} in {embedder_dir} (run `appliance semantic-setup` again)"
    try:
        rule.compiled = Compiled(compiled, rule.digest)
    except ValueError as exc:
        return rule, f"{exc} (run `appliance semantic-setup` again)"
    except Exception as exc:  # onnxruntime's load errors have no common base class
        return rule, f"{compiled} unusable: {exc}"
    return rule, ""
