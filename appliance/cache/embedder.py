"""The sentence embedder of the semantic tier: all-MiniLM-L6-v2 as ONNX, run by onnxruntime.

The gateway never imports torch: `appliance semantic-setup` exports the model once (with mean pooling
and L2 normalization inside the graph) into a directory with `model.onnx`, `tokenizer.json` and
`embedder.json`; this module only loads those. A question's embedding is latency-bound, and a
gateway's lookups come after idle gaps: there one intra-op thread (the gateway's default) made the
tier's lookup faster than two, though two can be faster for questions run back to back. With more
threads, the others sleep between operators instead of spinning. Spinning within a run only
(stopped when the run returns, so no core is held between questions) helps runs that follow each
other but worsened the tail of a run after an idle gap, so `spin` is off unless asked for
(docs/PERFORMANCE.md#semantic-cache-tier).

Texts longer than MAX_TOKENS word pieces are refused (None), never truncated: two long prompts that
agree in their first 128 pieces would otherwise embed alike however they end.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

try:
    # At import, not first use: onnxruntime must load before usearch (vectors.py), or it crashes.
    import onnxruntime as ort
except ImportError:  # the gateway then runs without the semantic tier
    ort = None

MANIFEST = "embedder.json"
MAX_TOKENS = 128
# Characters looked at before tokenizing: a longer text cannot fit MAX_TOKENS word pieces of
# a few characters each, so it is refused without the tokenizer's work.
MAX_CHARS = 1024

Vector = npt.NDArray[np.float32]


class EmbedderUnavailable(Exception):
    """The exported model is missing or unusable (the gateway then runs without the tier)."""


class EmbeddingCancelled(Exception):
    """The run was cancelled before it finished (its vector is no longer wanted)."""


class EmbedRun:
    """One embedding another thread may cancel: a run not started yet never starts, one under way
    stops at its next operator (onnxruntime's terminate flag), within about one operator's time."""

    def __init__(self) -> None:
        self.options = ort.RunOptions() if ort is not None else None
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        if self.options is not None:
            self.options.terminate = True


def cpu_session(path: Path, threads: int, spin: bool = False) -> Any:
    """An onnxruntime session on the CPU, quiet, one graph node at a time; `spin`: the intra-op
    threads spin between operators, and stop when the run returns."""
    if ort is None:
        raise ImportError("onnxruntime is not installed")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", str(int(spin)))
    if spin:
        options.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class Embedder:
    def __init__(self, model_dir: Path, threads: int = 1, spin: bool = False) -> None:
        try:
            from tokenizers import Tokenizer

            if ort is None:
                raise ImportError("onnxruntime is not installed")

            manifest = json.loads((model_dir / MANIFEST).read_text())
            self.name = str(manifest["model"])
            self.dim = int(manifest["dim"])
            self._session = cpu_session(model_dir / "model.onnx", threads, spin)
            self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        except (OSError, ValueError, KeyError, ImportError, RuntimeError) as exc:
            raise EmbedderUnavailable(
                f"no usable embedder in {model_dir} ({exc}); run `appliance semantic-setup "
                f"--dest {model_dir}`"
            ) from exc
        except Exception as exc:  # onnxruntime's own load errors have no common base class
            raise EmbedderUnavailable(f"embedder in {model_dir} failed to load: {exc}") from exc
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()

    def token_ids(self, text: str) -> list[int] | None:
        """Word pieces of a text that fits, with [CLS]/[SEP]; None when it is too long or empty."""
        if not text.strip() or len(text) > MAX_CHARS:
            return None
        ids: list[int] = self._tokenizer.encode(text).ids
        return ids if len(ids) <= MAX_TOKENS else None

    def embed_ids(self, ids: Sequence[int], run: EmbedRun | None = None) -> Vector:
        """The unit vector of one text's token ids, run alone (see embed_many: no batches)."""
        row = np.array([ids], dtype=np.int64)
        feed = {"input_ids": row, "attention_mask": np.ones_like(row)}
        try:
            out = self._session.run(None, feed, None if run is None else run.options)[0]
        except Exception:  # onnxruntime's errors have no common base class
            if run is not None and run.cancelled:
                raise EmbeddingCancelled from None
            raise
        return np.ascontiguousarray(out[0], dtype=np.float32)

    def embed(self, text: str, run: EmbedRun | None = None) -> Vector | None:
        """The unit vector of one text, or None when it is empty or too long to embed whole;
        EmbeddingCancelled when `run` was cancelled first or meanwhile."""
        if run is not None and run.cancelled:
            raise EmbeddingCancelled
        ids = self.token_ids(text)
        return None if ids is None else self.embed_ids(ids, run)

    def embed_many(self, texts: Sequence[str]) -> tuple[Vector, list[bool]]:
        """Vectors for many texts (zeros where a text does not fit) and which ones fit, each text
        run alone, as the gateway runs it: the int8 model quantizes its activations with one scale
        per run, so texts run in one batch (and their padding) move each other's vectors (cosine
        0.975-0.995 to the text run alone) and a rule calibrated on them would not be on the
        gateway's."""
        ids = [self.token_ids(t) for t in texts]
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, one in enumerate(ids):
            if one is not None:
                out[row] = self.embed_ids(one)
        return out, [x is not None for x in ids]
