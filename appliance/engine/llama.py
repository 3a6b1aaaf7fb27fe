"""A plain Llama-architecture decoder in torch, for hosts that cannot run a TensorRT-LLM engine.

Deliberately small (gpt-fast style, no framework): the engine server needs exactly one thing from
it, "logits for the next token given a prefix and a per-request KV cache", and every extra layer of
abstraction would be per-token latency on a single-stream appliance. Weights are kept as plain
tensors; q/k/v and gate/up projections are fused at load time so a decode step does two matmuls per
block instead of five.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from safetensors import safe_open

from appliance.engine import fused
from appliance.engine.device import resolve_device
from appliance.engine.linear import Linear, PlainLinear, WeightQuant, quantize_linear
from engine_build.hf_config import CheckpointError, Llama3RopeScaling, LlamaConfig, read_config

__all__ = [
    "CheckpointError",
    "KVCache",
    "LinearMaker",
    "Llama3RopeScaling",
    "LlamaConfig",
    "LlamaModel",
    "load_config",
]


def load_config(model_dir: Path) -> LlamaConfig:
    """Read the checkpoint's config.json, refusing anything this decoder would compute wrong."""
    config = read_config(model_dir)
    where = Path(model_dir) / "config.json"
    if config.architecture != "LlamaForCausalLM":
        raise CheckpointError(
            f"{where}: unsupported architecture {config.architecture!r} for the engine server; "
            "it runs only LlamaForCausalLM checkpoints. Serve others with TensorRT-LLM."
        )
    if config.hidden_act != "silu":
        raise CheckpointError(
            f"{where}: hidden_act {config.hidden_act!r} is not supported; only 'silu' is"
        )
    if config.has_bias:
        raise CheckpointError(
            f"{where}: attention_bias/mlp_bias checkpoints are not supported by this engine"
        )
    if config.rope_type not in ("default", "llama3"):
        raise CheckpointError(
            f"{where}: rope_scaling type {config.rope_type!r} is not supported; this engine "
            "implements only no scaling and 'llama3'. Use a checkpoint with one of those, or "
            "serve it with TensorRT-LLM (engine_dir) instead."
        )
    return config


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse RoPE frequencies (head_dim/2,), float32, with llama3 scaling applied if configured.

    Mirrors transformers' `_compute_llama3_parameters` so logits match HF on long-context models.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class KVCache:
    """Keys and values for one request, preallocated for `max_seq_len` so decode never allocates.

    Layout (layers, kv_heads, max_seq_len, head_dim): a step writes one column per layer in place
    and attention reads the contiguous prefix `[:, :, :end]`. Left uninitialised: no step's result
    depends on a position the request has not written (`LlamaModel.decode_static` reads such
    positions but selects them out).
    """

    def __init__(
        self,
        config: LlamaConfig,
        max_seq_len: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
        if max_seq_len > config.max_position_embeddings:
            raise ValueError(
                f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings "
                f"{config.max_position_embeddings}"
            )
        self.max_seq_len = max_seq_len
        self.k, self.v = empty_kv(config, max_seq_len, device, dtype)


def empty_kv(
    config: LlamaConfig,
    tokens: int,
    device: torch.device,
    dtype: torch.dtype,
    blocks: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V storage of shape (*blocks, layers, kv_heads, tokens, head_dim).

    Uninitialised on purpose: readers only touch positions a forward pass or a copy has written,
    and skipping the memset keeps allocation cheap for long contexts and large pools.
    """
    shape = (*blocks, config.num_hidden_layers, config.num_key_value_heads, tokens, config.head_dim)
    with torch.inference_mode():
        return (
            torch.empty(shape, device=device, dtype=dtype),
            torch.empty(shape, device=device, dtype=dtype),
        )


@dataclass
class _Layer:
    attn_norm: torch.Tensor  # (hidden,)
    wqkv: Linear  # ((heads + 2 * kv_heads) * head_dim, hidden)
    wo: Linear  # (hidden, heads * head_dim)
    mlp_norm: torch.Tensor  # (hidden,)
    w13: Linear  # (2 * intermediate, hidden): gate rows then up rows
    w2: Linear  # (hidden, intermediate)


# Builds a block's linear layer in place of the float weights: (the layer's name, the HF names of
# the weights it fuses, in order) -> the layer (an AWQ checkpoint's layers, `appliance.engine.awq`).
LinearMaker = Callable[[str, tuple[str, ...]], Linear]

# One attention call of a block: (layer index, q (heads, n, d), k and v (kv_heads, n, d)) -> the
# attention output (heads, n, d). It also stores k and v in the cache.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _TensorSource:
    """Name -> tensor lookup across one or several safetensors shards, opened lazily by name."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        index_file = model_dir / "model.safetensors.index.json"
        self.where: dict[str, Path] = {}
        if index_file.is_file():
            try:
                weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index_file}: unreadable shard index: {exc}") from exc
            for name, shard in weight_map.items():
                shard_path = model_dir / shard
                if not shard_path.is_file():
                    raise CheckpointError(
                        f"{index_file} names shard {shard!r}, which is missing from {model_dir}; "
                        "re-download the checkpoint"
                    )
                self.where[name] = shard_path
            return
        shards = sorted(model_dir.glob("*.safetensors"))
        if not shards:
            hint = ""
            if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pth")):
                hint = " (found PyTorch .bin/.pth weights: convert them to safetensors)"
            raise CheckpointError(
                f"{model_dir}: no *.safetensors weight files{hint}; the engine loads only "
                "safetensors checkpoints"
            )
        for shard_path in shards:
            try:
                shard_path.open("rb").close()
            except OSError as exc:  # say "permission denied", not safetensors' "no such file"
                raise CheckpointError(
                    f"{shard_path}: cannot open: {exc.strerror} (the engine runs as uid "
                    f"{os.getuid()}; make the checkpoint readable to it)"
                ) from exc
            try:
                with safe_open(str(shard_path), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                        self.where[name] = shard_path
            except Exception as exc:  # safetensors raises its own, untyped errors
                raise CheckpointError(
                    f"{shard_path}: not a readable safetensors file: {exc}"
                ) from exc

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        shard = self.where.get(name)
        if shard is None:
            raise CheckpointError(
                f"{self.model_dir}: tensor {name!r} is missing from the safetensors files; "
                "the checkpoint is incomplete or not in Hugging Face Llama naming"
            )
        try:
            with safe_open(str(shard), framework="pt") as f:
                tensor: torch.Tensor = f.get_tensor(name)
        except Exception as exc:  # safetensors raises its own, untyped errors
            raise CheckpointError(
                f"{shard}: cannot read tensor {name!r} ({exc}); the file is damaged or truncated, "
                "re-download the checkpoint"
            ) from exc
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{shard}: tensor {name!r} has shape {tuple(tensor.shape)}, config.json implies "
                f"{shape}; config.json does not belong to these weights"
            )
        return tensor


class LlamaModel:
    """Weights plus the forward pass; stateless between calls (all request state is in KVCache).

    `fp8` quantizes the linear layers of every block to E4M3 with that scaling at load; the
    embedding, the norms and lm_head stay in `dtype` (as TensorRT-LLM's FP8 recipe leaves them).
    """

    def __init__(
        self,
        config: LlamaConfig,
        tensors: Mapping[str, torch.Tensor],
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        fp8: WeightQuant | None = None,
        linears: LinearMaker | None = None,
    ) -> None:
        """Build from HF-named tensors already checked for shape (see `load`).

        `tensors` is read one name at a time, so a mapping that makes each tensor on access (random
        weights) never holds more than one block's weights beside the model. With `linears`, the
        blocks' linear layers come from it and `tensors` is never asked for their weights; `fp8`
        then names the format they are in.
        """
        self.config = config
        self.device = resolve_device(device)
        # The fixed-shape decode step's kernels: eager torch (the reference) or the fused Triton
        # kernels (`appliance.engine.fused`), chosen by the engine's --kernels option.
        self.kernels: Literal["torch", "triton"] = "torch"
        self.dtype = dtype
        self.fp8 = fp8
        c = config

        def w(name: str) -> torch.Tensor:
            return tensors[name].to(device=self.device, dtype=dtype).contiguous()

        def linear(name: str, *parts: str) -> Linear:
            if linears is not None:
                return linears(name, parts)
            weight = torch.cat([w(part) for part in parts]) if len(parts) > 1 else w(parts[0])
            if fp8 is None:
                return PlainLinear(weight.contiguous())
            try:
                return quantize_linear(name, weight, fp8, dtype)
            except ValueError as exc:
                raise CheckpointError(str(exc)) from exc

        with torch.inference_mode():
            self.embed = w("model.embed_tokens.weight")
            self.lm_head = self.embed if c.tie_word_embeddings else w("lm_head.weight")
            self.norm = w("model.norm.weight")
            self.layers: list[_Layer] = []
            for i in range(c.num_hidden_layers):
                p = f"model.layers.{i}."
                self.layers.append(
                    _Layer(
                        attn_norm=w(p + "input_layernorm.weight"),
                        wqkv=linear(
                            p + "self_attn.qkv",
                            *(p + f"self_attn.{n}_proj.weight" for n in ("q", "k", "v")),
                        ),
                        wo=linear(p + "self_attn.o_proj", p + "self_attn.o_proj.weight"),
                        mlp_norm=w(p + "post_attention_layernorm.weight"),
                        w13=linear(
                            p + "mlp.gate_up",
                            p + "mlp.gate_proj.weight",
                            p + "mlp.up_proj.weight",
                        ),
                        w2=linear(p + "mlp.down_proj", p + "mlp.down_proj.weight"),
                    )
                )
            # cos/sin for every position, computed in float32 (as HF does) then cast once.
            positions = torch.arange(c.max_position_embeddings, dtype=torch.float32)
            freqs = torch.outer(positions, rope_inv_freq(c))
            emb = torch.cat([freqs, freqs], dim=-1)
            self.cos = emb.cos().to(device=self.device, dtype=dtype)
            self.sin = emb.sin().to(device=self.device, dtype=dtype)
            self.positions = torch.arange(c.max_position_embeddings, device=self.device)
        self._q_size = c.num_attention_heads * c.head_dim

    @property
    def weight_bytes(self) -> int:
        """Bytes a batch-1 decode step reads from weights: every linear layer, lm_head, the norms.

        The embedding table is not read whole (one row per token), unless it is also lm_head.
        """
        linear = sum(
            layer.wqkv.nbytes + layer.wo.nbytes + layer.w13.nbytes + layer.w2.nbytes
            for layer in self.layers
        )
        norms = sum(layer.attn_norm.nbytes + layer.mlp_norm.nbytes for layer in self.layers)
        return linear + norms + self.norm.nbytes + self.lm_head.nbytes

    @staticmethod
    def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
        """Every HF tensor name the checkpoint must contain, with the shape config.json implies."""
        c = config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
            "model.norm.weight": (c.hidden_size,),
        }
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes.update(
                {
                    p + "self_attn.q_proj.weight": (q, c.hidden_size),
                    p + "self_attn.k_proj.weight": (kv, c.hidden_size),
                    p + "self_attn.v_proj.weight": (kv, c.hidden_size),
                    p + "self_attn.o_proj.weight": (c.hidden_size, q),
                    p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
                    p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
                    p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
                    p + "input_layernorm.weight": (c.hidden_size,),
                    p + "post_attention_layernorm.weight": (c.hidden_size,),
                }
            )
        return shapes

    @classmethod
    def load(
        cls,
        model_dir: Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        fp8: WeightQuant | None = None,
    ) -> LlamaModel:
        """Load a HF Llama checkpoint directory, checking every tensor before any is used."""
        model_dir = Path(model_dir)
        config = load_config(model_dir)
        source = _TensorSource(model_dir)
        with torch.inference_mode():
            tensors = {
                name: source.get(name, shape) for name, shape in cls.expected_shapes(config).items()
            }
            return cls(config, tensors, device=device, dtype=dtype, fp8=fp8)

    def new_cache(self, max_seq_len: int) -> KVCache:
        """A cache for one request of at most `max_seq_len` tokens (prompt + generated).

        A single-stream server may allocate one at max_position_embeddings and pass it to every
        `generate` call instead, so no request pays for the allocation.
        """
        return KVCache(self.config, max_seq_len, self.device, self.dtype)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        if x.dtype == torch.float32:  # as below without the casts, no-ops that still dispatch
            return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
        # Variance in float32 as HF does, so bf16/fp16 runs do not drift from the reference.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    @staticmethod
    def _rope(
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        signed_sin: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """HF's rotate_half RoPE, x * cos + cat(-x2, x1) * sin, of x (..., n, head_dim): the two
        halves of head_dim are the (real, imaginary) pairs. It runs as x * cos + swapped halves *
        cat(-sin1, sin2), the same products (a sign flip is exact); `signed_sin`, when given, is
        that cat (`_signed_sin(sin)`), made once by a caller that rotates many tensors."""
        if signed_sin is None:
            signed_sin = LlamaModel._signed_sin(sin)
        half = x.shape[-1] // 2
        swapped = x.view(*x.shape[:-1], 2, half).flip(-2).flatten(-2)
        return x * cos + swapped * signed_sin

    @staticmethod
    def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
        """cat(-sin1, sin2) of RoPE's sin rows (n, head_dim): `_rope`'s signed_sin."""
        half = sin.shape[-1] // 2
        return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)

    def forward(self, token_ids: Sequence[int], cache: KVCache, start_pos: int) -> torch.Tensor:
        """Run `token_ids` at positions start_pos.. and return float32 logits (vocab,) of the last.

        Positions before start_pos must already be in `cache` (from earlier calls); a call with
        several tokens is a prefill (or a chunk of one), a call with one token is a decode step.
        On the Triton kernels a prefill runs `fused.prefill`.
        """
        self._check_run(token_ids, cache, start_pos)
        with torch.inference_mode():
            if self.kernels == "triton" and len(token_ids) > 1:
                return fused.prefill(self, token_ids, cache, start_pos)
            return self._logits(self._forward(token_ids, cache, start_pos)[-1])

    def _check_run(self, token_ids: Sequence[int], cache: KVCache, start_pos: int) -> None:
        n = len(token_ids)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if start_pos < 0 or start_pos + n > cache.max_seq_len:
            raise ValueError(
                f"positions {start_pos}..{start_pos + n - 1} do not fit a cache of "
                f"{cache.max_seq_len} tokens"
            )
        vocab = self.config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}), got {list(token_ids)[:16]}")

    def forward_rows(
        self, token_ids: Sequence[int], cache: KVCache, start_pos: int
    ) -> torch.Tensor:
        """As `forward`, but float32 logits (n, vocab) of every one of `token_ids` (a verify step
        of speculative decoding scores each draft in one pass)."""
        self._check_run(token_ids, cache, start_pos)
        with torch.inference_mode():
            return self._logits(self._forward(token_ids, cache, start_pos))

    def sequence_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Float32 logits (n, vocab) at every position of `token_ids` from position 0, in one
        forward pass on a cache of its own: what evaluations (top-1 agreement) compare."""
        cache = self.new_cache(len(token_ids))  # refuses an empty or too long sequence
        vocab = self.config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}), got {list(token_ids)[:16]}")
        with torch.inference_mode():
            return self._logits(self._forward(token_ids, cache, 0))

    def _forward(self, token_ids: Iterable[int], cache: KVCache, start_pos: int) -> torch.Tensor:
        """The final hidden states (n, hidden) of `token_ids` at positions start_pos.."""
        c = self.config
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        n = ids.shape[0]
        end = start_pos + n
        group = c.num_attention_heads // c.num_key_value_heads
        mask = self.prefill_mask(start_pos, end) if n > 1 else None
        # SDPA's math path scales q and k each by the square root of 1 / sqrt(head_dim).
        root_scale = math.sqrt(1.0 / math.sqrt(c.head_dim))

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            layer_k, layer_v = cache.k[li], cache.v[li]
            layer_k.narrow(1, start_pos, n).copy_(k)
            layer_v.narrow(1, start_pos, n).copy_(v)
            keys, values = layer_k.narrow(1, 0, end), layer_v.narrow(1, 0, end)
            if n == 1:
                # A decode step: the query heads that share a KV head are the rows of one
                # (kv_heads, group, d) batch, so GQA needs neither K/V expansion nor a mask.
                # SDPA's math path spelled out (the same operations, so the same bits, without
                # its dispatch and its all-masked-row check): on CPU it beat the flash kernel's
                # multi-threaded split for one query row and never stalled on a busy core.
                q3 = q.reshape(c.num_key_value_heads, group, c.head_dim) * root_scale
                scores = torch.bmm(q3, keys.transpose(1, 2) * root_scale)
                attn = torch.bmm(torch.softmax(scores, dim=-1), values)
                return attn.view(c.num_attention_heads, 1, c.head_dim)
            return self.attend_prefill(q, keys, values, mask)

        return self._blocks(F.embedding(ids, self.embed), start_pos, end, attend)

    @staticmethod
    def attend_prefill(
        q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention (heads, rows, d) of a prefill's queries q (heads, rows, d) over keys and
        values (kv_heads, positions, d), masked by `prefill_mask`. 4-D inputs take the fused
        flash kernels (CPU and CUDA), which do GQA; with no mask (queries from position 0)
        CUDA's flash attention qualifies."""
        attn = F.scaled_dot_product_attention(
            q.unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=keys.shape[0] < q.shape[0],
        )
        return attn.squeeze(0)

    def prefill_mask(self, start: int, end: int) -> torch.Tensor | None:
        """The causal mask (rows, end) of a prefill's rows at positions start..end-1 over the
        cache's first `end` positions, aligned to absolute positions, so a prefill after a reused
        prefix (or a later chunk of one) is also correct; None from position 0, where SDPA's
        is_causal, which aligns top-left, is right (and lets CUDA take flash attention)."""
        if start == 0:
            return None
        return self.positions[:end][None, :] <= self.positions[start:end][:, None]

    def decode_static(
        self, step_in: torch.Tensor, cache: KVCache, span: int, logits_out: torch.Tensor
    ) -> None:
        """One decode step whose every shape is fixed by `span`, so a CUDA graph can replay it.

        `step_in` is a (2,) long tensor on the device: the token id and its position. Attention
        reads the first `span` cache positions (span > position); the result is written into
        `logits_out` (vocab,) float32. Nothing here reads a tensor's value on the host, so the same
        kernels run whatever the token and position.

        Positions after the step's own were never written by this request and may hold anything,
        NaN included, so they are removed by selection (`torch.where`), never by arithmetic: an
        additive -inf mask or a zero weight leaves NaN (NaN - inf and 0 * NaN are NaN).
        """
        if self.kernels == "triton":
            fused.decode_step(self, step_in, cache, span, logits_out)
            return
        c = self.config
        token, pos = step_in[0:1], step_in[1:2]
        group = c.num_attention_heads // c.num_key_value_heads
        # A key position is visible when it is at or before the query's.
        visible = self.positions[:span] <= pos  # (span,)
        scale = c.head_dim**-0.5

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.k[li].index_copy_(1, pos, k)
            cache.v[li].index_copy_(1, pos, v)
            keys, values = cache.k[li, :, :span], cache.v[li, :, :span]  # (kv_heads, span, d)
            q3 = q.reshape(c.num_key_value_heads, group, c.head_dim)
            scores = torch.matmul(q3, keys.transpose(1, 2)).float() * scale
            scores = torch.where(visible, scores, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(values.dtype)
            live = torch.where(visible.view(span, 1), values, 0.0)
            return torch.matmul(probs, live).view(c.num_attention_heads, 1, c.head_dim)

        x = self._blocks(F.embedding(token, self.embed), pos, None, attend)
        logits_out.copy_(self._logits(x[-1]))

    def prefill_static(
        self,
        ids: torch.Tensor,
        meta: torch.Tensor,
        cache: KVCache,
        span: int,
        logits_out: torch.Tensor,
    ) -> None:
        """A prefill whose every shape is fixed by its bucket (`ids`' length) and `span`, so a
        CUDA graph can replay it for any prompt of at most that many tokens.

        `meta` is a (2,) long tensor on the device: the start position and the count n of live
        tokens; `ids[:n]` are the tokens at positions start..start+n-1 and the rest of `ids` is
        padding (any valid id). Positions before start must already be in `cache` (a reused
        prefix or an earlier chunk); start + bucket <= span <= cache.max_seq_len. The float32
        logits of the last live token are written into `logits_out` (vocab,). Nothing here reads a
        tensor's value on the host.

        Padding affects nothing: a padded row's embedding is zero and a padded query sees only its
        own key, whose value is zero, so the row stays exactly zero through every block (RMSNorm,
        the linear layers, an FP8 per-tensor activation scale included, and SiLU(0) * 0 all map
        zero to zero). Its K/V (zeros) land at positions start+n..start+bucket-1, after the live
        ones; no live query sees them, and every later step writes a position before reading it.
        Positions from start+bucket on are not written here and may hold anything, NaN included:
        they are selected out (`torch.where`) before attention, never masked arithmetically.

        On the Triton kernels (`kernels` "triton", at most `fused.FUSED_ROWS` rows) the step is
        `fused.static_rows`: a padded row runs its padding id as a token, so its K/V at those
        positions are finite but not zero; no live query sees them either way.
        """
        if self._fused_rows(ids):
            last = fused.static_rows(self, ids, meta, cache).index_select(0, meta[1:2] - 1)
            fused.rows_logits(self, last, logits_out.view(1, -1))
            return
        x = self._static_rows(ids, meta, cache, span)
        logits_out.copy_(self._logits(x.index_select(0, meta[1:2] - 1)[0]))

    def verify_static(
        self,
        ids: torch.Tensor,
        meta: torch.Tensor,
        cache: KVCache,
        span: int,
        logits_out: torch.Tensor,
    ) -> None:
        """The verify step of speculative decoding with every shape fixed by its row count (`ids`'
        length) and `span`, so a CUDA graph can replay it for any token, drafts and position.

        `prefill_static`'s contract (the same `ids`, `meta`, padding and cache writes), but the
        float32 logits of every row are written into `logits_out` (rows, vocab): row i scores the
        token after `ids[i]`. A padded row's logits mean nothing (on the torch step they are
        those of a zero hidden state); `forward_rows` is the eager reference for the live ones.
        """
        if self._fused_rows(ids):
            fused.rows_logits(self, fused.static_rows(self, ids, meta, cache), logits_out)
            return
        logits_out.copy_(self._logits(self._static_rows(ids, meta, cache, span)))

    def _fused_rows(self, ids: torch.Tensor) -> bool:
        """Whether a fixed-shape step of these rows runs on the fused Triton kernels."""
        return self.kernels == "triton" and ids.shape[0] <= fused.FUSED_ROWS

    def _static_rows(
        self, ids: torch.Tensor, meta: torch.Tensor, cache: KVCache, span: int
    ) -> torch.Tensor:
        """The final hidden states (bucket, hidden) of `prefill_static`'s rows, whose contract
        this is; the cache holds their K/V afterwards."""
        c = self.config
        bucket = ids.shape[0]
        start, count = meta[0:1], meta[1:2]
        rows = self.positions[:bucket]
        positions = start + rows  # (bucket,) absolute positions of the rows
        live_row = rows < count
        keys_at = self.positions[:span]
        # Live queries see every key at or before them; a padded query sees only its own key.
        visible = torch.where(
            live_row[:, None],
            keys_at[None, :] <= positions[:, None],
            keys_at[None, :] == positions[:, None],
        )
        written = (keys_at < start + bucket).view(span, 1)
        kv_heads, group = c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads
        # Query heads sharing a KV head are rows of one (kv_heads, group * bucket) batch: GQA with
        # neither K/V expansion nor SDPA's enable_gqa; 4-D inputs with a boolean mask take the
        # fused kernels that accept a mask.
        mask = visible.repeat(group, 1).view(1, 1, group * bucket, span)

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.k[li].index_copy_(1, positions, k)
            cache.v[li].index_copy_(1, positions, v)
            keys = torch.where(written, cache.k[li, :, :span], 0.0)
            values = torch.where(written, cache.v[li, :, :span], 0.0)
            attn = F.scaled_dot_product_attention(
                q.reshape(1, kv_heads, group * bucket, c.head_dim),
                keys.unsqueeze(0),
                values.unsqueeze(0),
                attn_mask=mask,
            )
            return attn.view(c.num_attention_heads, bucket, c.head_dim)

        x = torch.where(live_row[:, None], F.embedding(ids, self.embed), 0.0)
        return self._blocks(x, positions, None, attend)

    def _blocks(
        self, x: torch.Tensor, start: int | torch.Tensor, end: int | None, attend: Attend
    ) -> torch.Tensor:
        """Every decoder block over hidden states x (n, hidden) at positions start..

        `start` is an int with `end` (a slice of the RoPE tables) or, with `end` None, a device
        tensor of the n rows' positions (a gather, for the fixed-shape steps).
        """
        c = self.config
        n = x.shape[0]
        if isinstance(start, int):
            cos, sin = self.cos[start:end], self.sin[start:end]
        else:
            cos, sin = self.cos.index_select(0, start), self.sin.index_select(0, start)
        signed_sin = self._signed_sin(sin)
        heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
        qs = self._q_size
        for li, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.attn_norm)
            # (heads + 2 * kv_heads, n, d): q, k and v heads; q and k rotated in one pass.
            qkv = layer.wqkv(h).view(n, heads + 2 * kv_heads, c.head_dim).transpose(0, 1)
            qk = self._rope(qkv[: heads + kv_heads], cos, sin, signed_sin)
            attn = attend(li, qk[:heads], qk[heads:], qkv[heads + kv_heads :]).transpose(0, 1)
            x = x + layer.wo(attn.reshape(n, qs))
            h = self._rms_norm(x, layer.mlp_norm)
            gate, up = layer.w13(h).chunk(2, dim=-1)
            x = x + layer.w2(F.silu(gate) * up)
        return x

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        return F.linear(self._rms_norm(last, self.norm), self.lm_head).float()
