"""Activation-aware weight quantization (AWQ) of a float Llama checkpoint into an AutoAWQ "gemm"
checkpoint (the format `appliance.engine.awq` loads and describes).

The method is AWQ's, as AutoAWQ runs it (scales without its "duo scaling" weight term):

1. Calibration inputs: `samples` rows of `tokens` token ids, run through the float model. The
   blocks are processed one at a time, each fed the previous float block's outputs (as AutoAWQ
   does), so no block's choice depends on another's quantization.
2. Per block, four groups of linear layers share an input and a preceding operation that can
   absorb a per-input-channel scale s: q/k/v after input_layernorm; gate/up after
   post_attention_layernorm; down_proj after up_proj (silu(gate) * up is linear in up); o_proj
   after v_proj only when their weights have the same shape (as AutoAWQ: with grouped-query
   attention o_proj's inputs are repeated v heads and one v row feeds several of them, so that
   group is skipped).
3. For each group, alpha in 0, 1/grid, ..., (grid - 1)/grid: ``s = mean|x| ** alpha`` per input
   channel over the calibration inputs, normalised by sqrt(max(s) * min(s)); the layers' weights
   become ``Q(W * s) / s`` (Q: round-to-nearest INT4 with an integer zero point per group of
   `group` inputs) and the output of what the group feeds (the attention output with o_proj; the
   MLP output; o_proj's; down_proj's) is compared with the float one. The alpha of least mean
   squared error wins; alpha 0 is s = 1, plain round-to-nearest.
4. The scales are folded: the weights' input columns are multiplied by s and the preceding
   operation's output (the RMSNorm weight, or the rows of v_proj / up_proj) divided by it, which
   leaves the float model's function unchanged.
5. Clip search (optional, as AutoAWQ: every layer but q_proj and k_proj): per group of `group`
   inputs of each output row, the weights are clamped to ±max|w| * (1 - i/20), i < 10, and the
   bound with the least output error on (at most 512 of) the scaled calibration inputs is kept.
6. Each weight is quantized to INT4 (``w ≈ (q - z) * s`` per group, s stored float16) and packed
   in AutoAWQ's layout; the float tensors (embedding, norms with the scales folded, lm_head) are
   written in the checkpoint's float dtype.

Calibration text must not be the text a quality figure is measured on: `appliance/data/
calibration.txt` (general prose) is the shipped calibration text; `bench.quality` scores
`appliance/data/corpus.txt`, which it does not overlap.

    appliance awq-quantize --model DIR --text appliance/data/calibration.txt --out DIR --group 64
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from appliance.engine.awq import AWQ_ORDER, quantization_config
from appliance.engine.llama import (
    LlamaConfig,
    LlamaModel,
    _TensorSource,
    load_config,
    rope_inv_freq,
)
from appliance.engine.quantized import GROUP_SIZES
from appliance.textfile import TextFileError, read_text
from engine_build.hf_config import CheckpointError, read_json

__all__ = [
    "DEFAULT_GRID",
    "AwqError",
    "LayerPlan",
    "Summary",
    "calibrate",
    "calibration_samples",
    "fold",
    "pack_awq",
    "quantize_checkpoint",
    "quantize_tensors",
    "rtn_int4",
    "write_checkpoint",
]

DEFAULT_GRID = 20
MAX_GRID = 100
MAX_SAMPLES = 256
MAX_TOKENS = 2048
MAX_CALIBRATION_TOKENS = 1 << 17  # samples * tokens: the activations of one block stay small
MAX_TEXT_BYTES = 16 << 20
_CLIP_STEPS = 10  # bounds max|w| * (1 - i / 20), i < 10, as AutoAWQ's 0.5 max shrink on 20 points
_CLIP_TOKENS = 512  # calibration rows the clip search scores on
_CLIP_ROWS = 512  # output rows scored at once by the clip search (bounds its memory)
_MIN_RANGE = 1e-5  # AutoAWQ's floor of a group's max - min
_PACK = 8
# Files of a Hugging Face model directory copied beside the AWQ weights (when present).
_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
)


class AwqError(Exception):
    """A bad input of the calibrator: one line that says what to fix."""


@dataclass
class LayerPlan:
    """One block's choices: per scaled group, the scales (None: not scaled) and the alpha; per
    linear (HF name without ``.weight``), the clip bound (out, in / group) or none."""

    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    alphas: dict[str, float] = field(default_factory=dict)
    clips: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Summary:
    """What a calibration did: alphas per block and group, tokens, seconds."""

    alphas: list[dict[str, float]]
    calibration_tokens: int
    seconds: float


def rtn_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest INT4 with an integer zero point per group of `group` inputs, as AutoAWQ:
    (q int32 (out, in) in [0, 15], z int32 (out, in / group) in [0, 15], s float16 (out, in /
    group)) with ``w ≈ (q - z) * s``; s is rounded to float16 before q and z are computed, so the
    stored values are the ones chosen."""
    out_features, in_features = weight.shape
    g = weight.float().reshape(out_features, in_features // group, group)
    high = g.amax(dim=-1, keepdim=True)
    low = g.amin(dim=-1, keepdim=True)
    s16 = ((high - low).clamp(min=_MIN_RANGE) / 15).half()
    if not torch.isfinite(s16).all():
        raise AwqError("a group's INT4 scale overflows float16; the weights are too large")
    s = s16.float()
    z = (-torch.round(low / s)).clamp(0, 15)
    q = (torch.round(g / s) + z).clamp(0, 15)
    return (
        q.to(torch.int32).reshape(out_features, in_features),
        z.to(torch.int32).squeeze(-1),
        s16.squeeze(-1),
    )


def _fake_quant(weight: torch.Tensor, group: int) -> torch.Tensor:
    """The float32 weight `rtn_int4` stands for."""
    q, z, s = rtn_int4(weight, group)
    zeros = z.repeat_interleave(group, dim=1)
    return (q - zeros).float() * s.float().repeat_interleave(group, dim=1)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """(rows, cols) ints in [0, 15] -> (rows, cols / 8) int32 in AWQ's packed order."""
    rows, cols = values.shape
    v = values.to(torch.int64).reshape(rows, cols // _PACK, _PACK)[..., list(AWQ_ORDER)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (v << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class _Block:
    """One decoder block's float32 forward over a batch of sequences (batch, tokens, hidden) from
    position 0, with its weights by short name (q, k, v, o, gate, up, down, ln1, ln2)."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], tokens: int) -> None:
        self.c = config
        self.w = weights
        freqs = torch.outer(torch.arange(tokens, dtype=torch.float32), rope_inv_freq(config))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c.rms_norm_eps))

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos + rotated * self.sin

    def attention(
        self, h: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, v_w: torch.Tensor
    ) -> torch.Tensor:
        """o_proj's input (batch, tokens, heads * head_dim) for normed input h."""
        c = self.c
        b, n, _ = h.shape

        def heads(x: torch.Tensor, count: int) -> torch.Tensor:
            return x.view(b, n, count, c.head_dim).transpose(1, 2)

        q = self._rope(heads(F.linear(h, q_w), c.num_attention_heads))
        k = self._rope(heads(F.linear(h, k_w), c.num_key_value_heads))
        v = heads(F.linear(h, v_w), c.num_key_value_heads)
        attn = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=c.num_attention_heads != c.num_key_value_heads
        )
        return attn.transpose(1, 2).reshape(b, n, c.num_attention_heads * c.head_dim)

    def mlp_act(self, h: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor) -> torch.Tensor:
        return F.silu(F.linear(h, gate_w)) * F.linear(h, up_w)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The block's output and the inputs of its four linear groups."""
        w = self.w
        h1 = self.norm(x, w["ln1"])
        o_in = self.attention(h1, w["q"], w["k"], w["v"])
        x2 = x + F.linear(o_in, w["o"])
        h2 = self.norm(x2, w["ln2"])
        act = self.mlp_act(h2, w["gate"], w["up"])
        out = x2 + F.linear(act, w["down"])
        return out, {"attn": h1, "vo": o_in, "mlp": h2, "down": act}


_SHORT = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
    "ln1": "input_layernorm",
    "ln2": "post_attention_layernorm",
}
# Scaled group -> (the linears that take the scales on their inputs, the op that absorbs 1 / s).
_GROUPS: dict[str, tuple[tuple[str, ...], str]] = {
    "attn": (("q", "k", "v"), "ln1"),
    "vo": (("o",), "v"),
    "mlp": (("gate", "up"), "ln2"),
    "down": (("down",), "up"),
}
_NO_CLIP = ("q", "k")  # AutoAWQ leaves these unclipped: attention scores are sensitive to them


def _scales_v_to_o(config: LlamaConfig) -> bool:
    """AutoAWQ scales o_proj into v_proj only when their weights have the same shape."""
    c = config
    v_shape = (c.num_key_value_heads * c.head_dim, c.hidden_size)
    o_shape = (c.hidden_size, c.num_attention_heads * c.head_dim)
    return v_shape == o_shape


def _block_weights(tensors: Mapping[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    p = f"model.layers.{layer}."
    return {short: tensors[p + name + ".weight"].float() for short, name in _SHORT.items()}


def _search_scales(
    block: _Block, name: str, x: torch.Tensor, grid: int, group: int
) -> tuple[torch.Tensor, float]:
    """(scales, alpha) of one group: the alpha whose Q(W * s) / s gives the least output MSE."""
    linears, _ = _GROUPS[name]
    w = block.w

    def output(weights: dict[str, torch.Tensor]) -> torch.Tensor:
        if name == "attn":
            return F.linear(block.attention(x, weights["q"], weights["k"], weights["v"]), w["o"])
        if name == "mlp":
            return F.linear(block.mlp_act(x, weights["gate"], weights["up"]), w["down"])
        return F.linear(x, weights[linears[0]])

    reference = output(w)
    x_mean = x.abs().reshape(-1, x.shape[-1]).mean(0)
    best: tuple[float, torch.Tensor, float] | None = None
    for i in range(grid):
        alpha = i / grid
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        s = torch.where(torch.isfinite(s), s, torch.ones_like(s))
        trial = dict(w)
        for lin in linears:
            trial[lin] = _fake_quant(w[lin] * s, group) / s
        loss = float((output(trial) - reference).pow(2).mean())
        if best is None or loss < best[0]:
            best = (loss, s, alpha)
    assert best is not None
    return best[1], best[2]


def _search_clip(weight: torch.Tensor, x: torch.Tensor, group: int) -> torch.Tensor:
    """Per (output row, input group) the clip bound of least output error (AutoAWQ's
    auto_clip): (out, in / group). The error of a bound is the mean square, over the scored
    inputs, of that group's contribution to the row's output: x_g @ (Q(clamp(w_g)) - w_g)."""
    out_features, in_features = weight.shape
    groups = in_features // group
    rows = x.reshape(-1, in_features)
    step = max(1, rows.shape[0] // _CLIP_TOKENS)
    xs = rows[::step][:_CLIP_TOKENS].reshape(-1, groups, group).transpose(0, 1)  # (groups, n, g)
    bounds = []
    for start in range(0, out_features, _CLIP_ROWS):
        w = weight[start : start + _CLIP_ROWS]
        org_max = w.reshape(w.shape[0], groups, group).abs().amax(dim=-1)  # (rows, groups)
        best_err = torch.full_like(org_max, float("inf"))
        best_max = org_max.clone()
        for i in range(_CLIP_STEPS):
            bound = org_max * (1 - i / (2 * _CLIP_STEPS))
            b = bound.repeat_interleave(group, dim=1)
            delta = _fake_quant(torch.clamp(w, -b, b), group) - w  # (rows, in)
            dg = delta.reshape(-1, groups, group).permute(1, 2, 0)  # (groups, g, rows)
            err = torch.bmm(xs, dg).pow(2).mean(dim=1).t()  # (rows, groups)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better, bound, best_max)
        bounds.append(best_max)
    return torch.cat(bounds)


def calibrate(
    config: LlamaConfig,
    tensors: Mapping[str, torch.Tensor],
    samples: torch.Tensor,
    group: int,
    grid: int = DEFAULT_GRID,
    clip: bool = True,
    say: Callable[[str], None] | None = None,
) -> list[LayerPlan]:
    """Every block's scales and clip bounds for the float checkpoint `tensors` (HF names) from
    calibration token ids `samples` (batch, tokens); grid 1 searches only alpha 0 (no scaling)."""
    c = config
    x = F.embedding(samples, tensors["model.embed_tokens.weight"].float())
    plans: list[LayerPlan] = []
    scale_groups = [g for g in _GROUPS if g != "vo" or _scales_v_to_o(config)]
    with torch.inference_mode():
        for layer in range(c.num_hidden_layers):
            started = time.perf_counter()
            block = _Block(config, _block_weights(tensors, layer), samples.shape[1])
            out, inputs = block.forward(x)
            plan = LayerPlan()
            for name in scale_groups:
                plan.scales[name], plan.alphas[name] = _search_scales(
                    block, name, inputs[name], grid, group
                )
            if clip:
                scaled = _fold_block(block.w, plan)
                for name, (linears, _) in _GROUPS.items():
                    s = plan.scales.get(name)
                    x_in = inputs[name] if s is None else inputs[name] / s
                    for lin in linears:
                        if lin not in _NO_CLIP:
                            plan.clips[lin] = _search_clip(scaled[lin], x_in, group)
            plans.append(plan)
            x = out
            if say is not None:
                alphas = ", ".join(f"{k} {v:.2f}" for k, v in plan.alphas.items())
                say(f"layer {layer}: alpha {alphas}; {time.perf_counter() - started:.1f} s")
    return plans


def _fold_block(weights: dict[str, torch.Tensor], plan: LayerPlan) -> dict[str, torch.Tensor]:
    """The block's weights with its scales folded (function unchanged)."""
    w = dict(weights)
    for name, s in plan.scales.items():
        linears, prev = _GROUPS[name]
        for lin in linears:
            w[lin] = w[lin] * s
        if prev.startswith("ln"):
            w[prev] = w[prev] / s
        else:  # the last rows of the preceding linear feed these inputs
            rows = w[prev].clone()
            rows[-s.shape[0] :] = rows[-s.shape[0] :] / s.view(-1, 1)
            w[prev] = rows
    return w


def fold(
    config: LlamaConfig, tensors: Mapping[str, torch.Tensor], plans: Sequence[LayerPlan]
) -> dict[str, torch.Tensor]:
    """The float checkpoint with every block's scales folded and its clip bounds applied (float32;
    without clip bounds the same function as `tensors`)."""
    out = {name: t.float() for name, t in tensors.items()}
    for layer, plan in enumerate(plans):
        folded = _fold_block(_block_weights(tensors, layer), plan)
        for short, bound in plan.clips.items():
            w = folded[short]
            b = bound.repeat_interleave(w.shape[1] // bound.shape[1], dim=1)
            folded[short] = torch.clamp(w, -b, b)
        p = f"model.layers.{layer}."
        for short, name in _SHORT.items():
            out[p + name + ".weight"] = folded[short]
    return out


def quantize_tensors(
    config: LlamaConfig, folded: Mapping[str, torch.Tensor], group: int, float_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The AWQ checkpoint's tensors: each block linear as qweight/qzeros/scales, every other
    tensor in `float_dtype`."""
    shapes = LlamaModel.expected_shapes(config)
    out: dict[str, torch.Tensor] = {}
    for name in shapes:
        tensor = folded[name]
        if name.endswith("_proj.weight"):
            prefix = name.removesuffix(".weight")
            q, z, s = rtn_int4(tensor, group)
            out[prefix + ".qweight"] = pack_awq(q.t().contiguous())
            out[prefix + ".qzeros"] = pack_awq(z.t().contiguous())
            out[prefix + ".scales"] = s.t().contiguous()
        else:
            out[name] = tensor.to(float_dtype).contiguous()
    return out


def write_checkpoint(
    out_dir: Path,
    raw_config: Mapping[str, object],
    packed: Mapping[str, torch.Tensor],
    group: int,
    model_dir: Path | None = None,
) -> None:
    """Write an AWQ checkpoint: config.json (`raw_config` with the quantization_config), the
    tensors, and the tokenizer and generation files of `model_dir` when it has them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(dict(packed), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for name in _SIDE_FILES:
        if model_dir is not None and (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out_dir / name)
    config = dict(raw_config) | {"quantization_config": quantization_config(group)}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _check_shapes(config: LlamaConfig, group: int, model_dir: Path) -> None:
    if group not in GROUP_SIZES:
        raise AwqError(f"--group {group}: expected one of {', '.join(map(str, GROUP_SIZES))}")
    linears = {
        name: shape
        for name, shape in LlamaModel.expected_shapes(config).items()
        if name.endswith("_proj.weight")
    }
    for name, (out_features, in_features) in linears.items():
        if in_features % group or out_features % _PACK:
            fits = [g for g in GROUP_SIZES if all(s[1] % g == 0 for s in linears.values())]
            hint = f"use --group {fits[-1]}" if fits else "no AWQ group fits this model"
            raise AwqError(
                f"{model_dir}: {name} ({out_features}, {in_features}): the inputs must be "
                f"divisible by the group {group} and the outputs by {_PACK}; {hint}"
            )


def _bounded(flag: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise AwqError(f"{flag} {value}: expected {low}..{high}")


def calibration_samples(ids: Sequence[int], samples: int, tokens: int, text: Path) -> torch.Tensor:
    """`samples` consecutive, non-overlapping runs of `tokens` ids from the start of `ids`."""
    need = samples * tokens
    if len(ids) < need:
        raise AwqError(
            f"--text {text}: {len(ids)} tokens, --samples {samples} x --tokens {tokens} needs "
            f"{need}; give a longer text or fewer samples/tokens"
        )
    return torch.tensor(ids[:need], dtype=torch.long).view(samples, tokens)


def quantize_checkpoint(
    model_dir: Path,
    text: Path,
    out_dir: Path,
    group: int,
    samples: int,
    tokens: int,
    grid: int = DEFAULT_GRID,
    clip: bool = True,
    say: Callable[[str], None] | None = None,
) -> Summary:
    """Calibrate the float checkpoint in `model_dir` on `text` and write the AWQ checkpoint to
    `out_dir` (which must not exist or be empty); AwqError (one line) on a bad input."""
    from tokenizers import Tokenizer

    _bounded("--samples", samples, 1, MAX_SAMPLES)
    _bounded("--tokens", tokens, 2, MAX_TOKENS)
    _bounded("--grid", grid, 1, MAX_GRID)
    if samples * tokens > MAX_CALIBRATION_TOKENS:
        raise AwqError(
            f"--samples {samples} x --tokens {tokens}: at most {MAX_CALIBRATION_TOKENS} "
            "calibration tokens"
        )
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise AwqError(f"--out {out_dir}: exists and is not an empty directory")
    try:
        config = load_config(model_dir)
        raw = read_json(model_dir / "config.json", "checkpoint config.json")
    except CheckpointError as err:
        raise AwqError(str(err)) from err
    if raw.get("quantization_config") is not None:
        raise AwqError(
            f"--model {model_dir}: already quantized (quantization_config); give a float checkpoint"
        )
    _check_shapes(config, group, model_dir)
    if tokens > config.max_position_embeddings:
        raise AwqError(
            f"--tokens {tokens}: the model takes at most {config.max_position_embeddings}"
        )
    try:
        content = read_text(text, MAX_TEXT_BYTES)
    except TextFileError as err:
        raise AwqError(f"--text {text}: {err}") from None
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise AwqError(f"--model {model_dir}: no tokenizer.json to tokenize the calibration text")
    ids = Tokenizer.from_file(str(tokenizer_file)).encode(content, add_special_tokens=False).ids
    batch = calibration_samples(ids, samples, tokens, text)
    started = time.perf_counter()
    try:
        source = _TensorSource(model_dir)
        shapes = LlamaModel.expected_shapes(config)
        tensors = {name: source.get(name, shape) for name, shape in shapes.items()}
    except CheckpointError as err:
        raise AwqError(str(err)) from err
    float_dtype = tensors["model.embed_tokens.weight"].dtype
    plans = calibrate(config, tensors, batch, group, grid, clip, say)
    packed = quantize_tensors(config, fold(config, tensors, plans), group, float_dtype)
    seconds = time.perf_counter() - started
    write_checkpoint(out_dir, raw, packed, group, model_dir)
    summary = Summary([p.alphas for p in plans], samples * tokens, seconds)
    (out_dir / "awq_calibration.json").write_text(
        json.dumps(
            {
                "text": str(text),
                "samples": samples,
                "tokens": tokens,
                "grid": grid,
                "clip": clip,
                "seconds": round(seconds, 1),
                "alphas": summary.alphas,
            },
            indent=1,
        )
        + "\n",
        encoding="utf-8",
    )
    return summary
