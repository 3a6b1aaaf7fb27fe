"""Loading an AWQ checkpoint (AutoAWQ / Hugging Face "gemm" format) as the engine's INT4 layers.

An AWQ checkpoint is a Hugging Face Llama checkpoint whose config.json carries
``quantization_config`` ``{"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": true,
"version": "gemm"}`` and whose block linear layers are stored, per HF name ``P`` (e.g.
``model.layers.0.self_attn.q_proj``), as three tensors instead of ``P.weight`` (out, in):

- ``P.qweight`` int32 (in, out / 8): eight 4-bit values of one input row per int32;
- ``P.qzeros`` int32 (in / G, out / 8): the zero points, packed the same way;
- ``P.scales`` float16 (in / G, out).

Within an int32, bits ``4 * i .. 4 * i + 3`` hold output column ``8 * c + AWQ_ORDER[i]`` of its
group of eight (AWQ_ORDER = 0, 2, 4, 6, 1, 3, 5, 7: the interleaving the AWQ GEMM kernel reads);
unpacking takes nibble ``AWQ_REVERSE_ORDER[j]`` for column ``8 * c + j``. The weight is
``w[out, in] = (q - z) * s`` with q, z and s of the input's group. In the engine's INT4 form
(`appliance.engine.quantized`: ``w = (q - 8) * scale + zero``) that is ``scale = s`` and
``zero = (8 - z) * s``, exact in float32.

Every tensor of the model comes from the AWQ checkpoint, the float ones (embedding, norms, lm_head)
included: AWQ folds its activation scales into the RMSNorm weights before the layers it scales, so
the original model's norms would be wrong beside AWQ's linear weights. The repository's
``hf_model_dir`` (the target) still supplies the tokenizer and the shape the fit check plans; an
AWQ checkpoint of another model (architecture, sizes, vocabulary) is refused before any weight is
read.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from appliance.engine.linear import Linear
from appliance.engine.llama import LlamaConfig, LlamaModel, _TensorSource, load_config
from appliance.engine.options import EngineOptions
from appliance.engine.quantized import GROUP_SIZES, GroupQuant, int4_linear
from appliance.engine.repository import ModelEntry
from engine_build.hf_config import CheckpointError, read_json

__all__ = [
    "AWQ_ORDER",
    "AWQ_REVERSE_ORDER",
    "AwqFormat",
    "awq_options",
    "awq_source",
    "check_same_model",
    "load_awq_model",
    "quantization_config",
    "read_awq_format",
    "unpack_awq",
]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_PACK = 8  # 4-bit values per int32
# config.json fields that must equal the target's for the AWQ weights to be the target model's.
_SAME_MODEL_FIELDS = (
    "architecture",
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


@dataclass(frozen=True)
class AwqFormat:
    """An AWQ checkpoint's quantization: 4 bits, one scale and zero point per `group_size` inputs."""

    group_size: int

    @property
    def weight_quant(self) -> GroupQuant:
        return GroupQuant(4, self.group_size)


# The quantization_config fields of the one AWQ variant the engine loads (besides group_size).
LOADABLE: dict[str, object] = {"bits": 4, "zero_point": True, "version": "gemm"}


def quantization_config(group: int) -> dict[str, object]:
    """config.json's quantization_config of an AWQ checkpoint this module loads."""
    return {"quant_method": "awq", **LOADABLE, "group_size": group}


def read_awq_format(model_dir: Path) -> AwqFormat | None:
    """The checkpoint's AWQ format; None when config.json has no quantization_config; a
    CheckpointError (one line) for an AWQ variant the engine cannot load."""
    path = Path(model_dir) / "config.json"
    raw = read_json(path, "checkpoint config.json").get("quantization_config")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: quantization_config is not a JSON object")
    method = raw.get("quant_method")
    if method != "awq":
        raise CheckpointError(
            f"{path}: quantization_config quant_method {method!r} is not supported; the engine "
            "loads float checkpoints and AWQ (quant_method 'awq') only"
        )
    for key, want in LOADABLE.items():
        got = raw.get(key, "gemm" if key == "version" else None)
        if isinstance(got, str):
            got = got.lower()
        if got != want:
            raise CheckpointError(
                f"{path}: AWQ {key} {got!r} is not supported; the engine loads AWQ with bits 4, "
                "zero_point true, version 'gemm'"
            )
    group = raw.get("group_size")
    if group not in GROUP_SIZES:
        raise CheckpointError(
            f"{path}: AWQ group_size {group!r} is not one of "
            f"{', '.join(map(str, GROUP_SIZES))} (the group sizes the INT4 kernels take)"
        )
    assert isinstance(group, int)
    return AwqFormat(group)


def check_same_model(awq: LlamaConfig, target: LlamaConfig, awq_dir: Path) -> None:
    """CheckpointError naming the first config.json field in which the AWQ checkpoint differs
    from the target model."""
    for field in _SAME_MODEL_FIELDS:
        mine, theirs = getattr(awq, field), getattr(target, field)
        if mine != theirs:
            raise CheckpointError(
                f"{Path(awq_dir) / 'config.json'}: AWQ checkpoint of another model: {field} "
                f"{mine!r}, the model it is to serve has {theirs!r}; quantize that model or name "
                "its own AWQ checkpoint"
            )


def unpack_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int32 (out, in) in [0, 15], scale and zero float32 (out, in / group)) in the engine's
    INT4 form, w = (q - 8) * scale + zero, from one layer's AWQ tensors (shapes checked by the
    caller)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    reverse = torch.tensor(AWQ_REVERSE_ORDER, device=qweight.device)

    def unpack(packed: torch.Tensor) -> torch.Tensor:
        # (rows, cols / 8) int32 -> (rows, cols): nibble i of each word, then AWQ's column order.
        nibbles = (packed.unsqueeze(-1) >> shifts) & 0x0F  # (rows, cols / 8, 8)
        return nibbles.index_select(-1, reverse).reshape(packed.shape[0], -1)

    q = unpack(qweight).t().contiguous()  # (out, in)
    z = unpack(qzeros).t().float()  # (out, groups)
    s = scales.t().float()  # (out, groups)
    return q, s.contiguous(), ((8 - z) * s).contiguous()


class _FloatTensors(Mapping[str, torch.Tensor]):
    """The checkpoint's float tensors by HF name, read (and shape-checked) on access."""

    def __init__(self, source: _TensorSource, shapes: dict[str, tuple[int, ...]]) -> None:
        self.source, self.shapes = source, shapes

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.source.get(name, self.shapes[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def _read_layer(
    source: _TensorSource, prefix: str, out_features: int, in_features: int, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's (q, scale, zero) in the engine's form; CheckpointError naming the layer."""
    if in_features % group or out_features % _PACK:
        raise CheckpointError(
            f"{source.model_dir}: {prefix}: shape ({out_features}, {in_features}) does not take "
            f"the AWQ group {group}: the inputs must be divisible by it and the outputs by "
            f"{_PACK}"
        )
    groups = in_features // group
    qweight = source.get(prefix + ".qweight", (in_features, out_features // _PACK))
    qzeros = source.get(prefix + ".qzeros", (groups, out_features // _PACK))
    scales = source.get(prefix + ".scales", (groups, out_features))
    for name, tensor in (("qweight", qweight), ("qzeros", qzeros)):
        if tensor.dtype != torch.int32:
            raise CheckpointError(
                f"{source.model_dir}: {prefix}.{name} is {tensor.dtype}, AWQ packs int32"
            )
    if not scales.is_floating_point():
        raise CheckpointError(f"{source.model_dir}: {prefix}.scales is {scales.dtype}, not float")
    return unpack_awq(qweight, qzeros, scales, group)


def awq_source(entry: ModelEntry) -> Path | None:
    """The AWQ checkpoint to serve `entry` from: its `awq_checkpoint` parameter, else its
    hf_model_dir when that is itself an AWQ checkpoint; None for a float checkpoint."""
    if entry.awq_checkpoint is not None:
        return entry.awq_checkpoint
    config = entry.hf_model_dir / "config.json"
    if config.is_file() and read_awq_format(entry.hf_model_dir) is not None:
        return entry.hf_model_dir
    return None


def awq_options(awq_dir: Path, options: EngineOptions) -> EngineOptions:
    """`options` with the AWQ checkpoint's group (what the fit check counts and the log says);
    a CheckpointError unless they ask for INT4 weights."""
    fmt = read_awq_format(awq_dir)
    if fmt is None:
        raise CheckpointError(
            f"{awq_dir / 'config.json'}: no quantization_config: not an AWQ checkpoint"
        )
    if options.weights != "int4":
        raise CheckpointError(
            f"{awq_dir}: an AWQ checkpoint (int4, group {fmt.group_size}) is named for this "
            f"model; serve it with --weights int4, not {options.weights}"
        )
    return replace(options, weight_group=fmt.group_size)


def load_awq_model(
    awq_dir: Path, target: LlamaConfig, device: torch.device, dtype: torch.dtype
) -> LlamaModel:
    """The model of an AWQ checkpoint with its linear layers as the engine's INT4 layers; a
    CheckpointError (one line) when it is not AWQ, not the target model's, or malformed."""
    awq_dir = Path(awq_dir)
    fmt = read_awq_format(awq_dir)
    if fmt is None:
        raise CheckpointError(
            f"{awq_dir / 'config.json'}: no quantization_config: not an AWQ checkpoint"
        )
    config = load_config(awq_dir)
    check_same_model(config, target, awq_dir)
    source = _TensorSource(awq_dir)
    shapes = LlamaModel.expected_shapes(config)
    group = fmt.group_size

    def linear(name: str, parts: tuple[str, ...]) -> Linear:
        pieces = []
        for part in parts:
            out_features, in_features = shapes[part]
            prefix = part.removesuffix(".weight")
            pieces.append(_read_layer(source, prefix, out_features, in_features, group))
        q, scale, zero = (torch.cat([p[i] for p in pieces]).to(device) for i in range(3))
        return int4_linear(q, scale, zero, group, dtype)

    with torch.inference_mode():
        return LlamaModel(
            config,
            _FloatTensors(source, shapes),
            device=device,
            dtype=dtype,
            fp8=fmt.weight_quant,
            linears=linear,
        )
