"""Reuse of KV blocks across requests, with TensorRT-LLM's `enable_kv_cache_reuse` semantics.

A request's KV is computed into the runner's one preallocated working cache. When a request finishes,
every *full* block of `tokens_per_block` tokens whose K/V it computed is copied into a preallocated
pool, keyed by the token ids of the whole prefix up to and including that block: block N of a new
request matches only if blocks 0..N match, so a reused block always holds exactly the K/V a fresh
prefill would compute at those positions. A new request copies its matched blocks back into the
working cache and prefills only the rest; at least one prompt token is always recomputed, because
the next token's logits come out of a forward pass.

The chain of keys starts at the engine fingerprint, so blocks computed by other weights never match.
Eviction is LRU with parents kept more recent than their children, so the tails of chains go first
and a shared system prompt outlives the conversations built on it (TensorRT-LLM also evicts leaves
of its radix tree first). Only finished requests store blocks: a cancelled or failed request leaves
nothing behind, so nothing half-computed is ever reusable.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from appliance.engine.llama import KVCache, LlamaConfig, empty_kv

__all__ = ["KvCacheStats", "PrefixCache", "RequestKvStats", "free_device_bytes", "pool_blocks"]

log = logging.getLogger(__name__)

# Without `max_tokens_in_paged_kv_cache`, a CPU host shares its memory with the gateway and Redis, so
# the pool takes the free-memory fraction TensorRT-LLM would take on a GPU, but never more than this.
CPU_POOL_CAP_BYTES = 1 << 30


@dataclass
class KvCacheStats:
    """The engine's KV-cache counters, named after TensorRT-LLM's executor `KvCacheStats`.

    A Prometheus exporter can publish them as Triton's `nv_trt_llm_kv_cache_block_metrics` family
    (label `kv_cache_block_type`): `tokens_per_block` is "tokens_per", `max_blocks` "max" (the reuse
    pool's capacity), `used_blocks` "used" (blocks holding reusable K/V), `free_blocks` "free",
    `reused_blocks` "reused" and used/max "fraction". The cumulative counters mirror `reusedBlocks`,
    `missedBlocks`, `allocTotalBlocks` and `allocNewBlocks`; `reused_tokens` (prompt tokens not
    recomputed, vLLM's `prefix_cache_hits`), `stored_blocks` and `evicted_blocks` have no
    TensorRT-LLM gauge.
    """

    tokens_per_block: int = 0
    max_blocks: int = 0
    used_blocks: int = 0
    reused_blocks: int = 0
    missed_blocks: int = 0
    alloc_total_blocks: int = 0
    alloc_new_blocks: int = 0
    reused_tokens: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0

    @property
    def free_blocks(self) -> int:
        return self.max_blocks - self.used_blocks

    @property
    def hit_rate(self) -> float:
        """`cacheHitRate`: reused / (reused + missed)."""
        looked_up = self.reused_blocks + self.missed_blocks
        return self.reused_blocks / looked_up if looked_up else 0.0

    def record(self, request: RequestKvStats, prompt_blocks: int) -> None:
        """Count one request the way the executor does: prompt blocks reused or missed, and the
        blocks its whole sequence took."""
        self.reused_blocks += request.reused_blocks
        self.missed_blocks += prompt_blocks - request.reused_blocks
        self.reused_tokens += request.reused_tokens
        self.alloc_total_blocks += request.total_blocks
        self.alloc_new_blocks += request.new_blocks


@dataclass(frozen=True)
class RequestKvStats:
    """One request's KV blocks, as TensorRT-LLM's `RequestPerfMetrics.kvCacheMetrics` counts them.

    `total_blocks` is the blocks its sequence occupies (the prompt's while it runs, prompt and
    answer once it is accounted), `reused_blocks` those it took from the pool, `new_blocks` the
    rest; `reused_tokens` the prompt tokens not recomputed. The backend returns `reused_blocks` as
    `kv_cache_reused_blocks` and the prompt's `new_blocks` as `kv_cache_alloc_total_blocks` and
    `kv_cache_alloc_new_blocks`.
    """

    total_blocks: int = 0
    reused_blocks: int = 0
    reused_tokens: int = 0

    @property
    def new_blocks(self) -> int:
        return self.total_blocks - self.reused_blocks


def bytes_per_token(config: LlamaConfig, dtype: torch.dtype) -> int:
    """K and V of one token across all layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize


def free_device_bytes(device: torch.device) -> int:
    """Bytes free on `device` now: the CUDA driver's free memory, or MemAvailable on a CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return CPU_POOL_CAP_BYTES


def pool_blocks(
    config: LlamaConfig,
    dtype: torch.dtype,
    device: torch.device,
    tokens_per_block: int,
    max_seq_len: int,
    max_tokens: int | None,
    free_mem_fraction: float,
) -> int:
    """How many blocks the reuse pool gets.

    TensorRT-LLM's pool is `max_tokens_in_paged_kv_cache` tokens when the repository sets it, else
    `kv_cache_free_gpu_mem_fraction` of free device memory; it also holds the running request. Here
    the running request lives in the working cache (max_seq_len tokens), which is taken out of that
    budget; the rest, in whole blocks, is the pool. On CPU the memory-fraction budget is capped at
    CPU_POOL_CAP_BYTES (set max_tokens_in_paged_kv_cache for more).
    """
    if max_tokens is None:
        budget = int(free_device_bytes(device) * free_mem_fraction)
        if device.type != "cuda":
            budget = min(budget, CPU_POOL_CAP_BYTES)
        max_tokens = budget // bytes_per_token(config, dtype)
    return max(0, (max_tokens - max_seq_len) // tokens_per_block)


@dataclass
class _Entry:
    slot: int
    parent: bytes
    tokens: bytes  # the block's token ids as int64s


class PrefixCache:
    """The pool of reusable blocks and its index; used only from the runner's compute thread."""

    def __init__(
        self,
        config: LlamaConfig,
        num_blocks: int,
        tokens_per_block: int,
        fingerprint: str,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if num_blocks <= 0 or tokens_per_block <= 0:
            raise ValueError("a prefix cache needs at least one block of at least one token")
        self.tokens_per_block = tokens_per_block
        self.root = hashlib.blake2b(fingerprint.encode(), digest_size=16).digest()
        # A slot is read only after `store` has written it.
        self.k, self.v = empty_kv(config, tokens_per_block, device, dtype, (num_blocks,))
        # key -> entry, least recently used first.
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()
        self._free = list(range(num_blocks - 1, -1, -1))
        self.stats = KvCacheStats(tokens_per_block=tokens_per_block, max_blocks=num_blocks)

    def snapshot(self) -> KvCacheStats:
        return dataclasses.replace(self.stats)

    def _blocks(self, tokens: Sequence[int], count: int) -> list[bytes]:
        """The first `count` full blocks of `tokens`, each as its int64 token ids' bytes (one
        conversion of the whole run, then slices: a 2,000-token prompt is 62 blocks)."""
        size = self.tokens_per_block * 8
        data = array.array("q", tokens[: count * self.tokens_per_block]).tobytes()
        return [data[i * size : (i + 1) * size] for i in range(count)]

    @staticmethod
    def _key(parent: bytes, block: bytes) -> bytes:
        return hashlib.blake2b(parent + block, digest_size=16).digest()

    def _touch(self, keys: list[bytes]) -> None:
        # Children first, so every parent ends up more recent than its children.
        for key in reversed(keys):
            self._index.move_to_end(key)

    def match(self, prompt: Sequence[int]) -> list[int]:
        """Pool slots of the longest run of leading full prompt blocks already computed."""
        slots: list[int] = []
        keys: list[bytes] = []
        parent = self.root
        for block in self._blocks(prompt, len(prompt) // self.tokens_per_block):
            key = self._key(parent, block)
            entry = self._index.get(key)
            if entry is None or entry.parent != parent or entry.tokens != block:
                break
            slots.append(entry.slot)
            keys.append(key)
            parent = key
        self._touch(keys)
        return slots

    def _positions(self, cache: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """The working cache's blocks first..first+count-1 as (layers, kv_heads, count, block,
        head_dim): the layout of `count` pool slots, permuted."""
        b = self.tokens_per_block
        layers, heads, _, head_dim = cache.shape
        return cache[:, :, first * b : (first + count) * b].view(layers, heads, count, b, head_dim)

    def load(self, slots: Sequence[int], cache: KVCache) -> None:
        """Copy pool blocks into positions 0.. of the working cache: one copy of K and one of V
        per run of consecutive slots (a chain stored at once is one run), since on a GPU each
        copy costs the host a launch, longer than the device takes to copy a block."""
        with torch.inference_mode():
            for first, slot, count in _runs(list(enumerate(slots))):
                for pool, working in ((self.k, cache.k), (self.v, cache.v)):
                    blocks = pool[slot : slot + count].permute(1, 2, 0, 3, 4)
                    self._positions(working, first, count).copy_(blocks)

    def store(self, tokens: Sequence[int], cache: KVCache) -> int:
        """Keep the full blocks of `tokens`, whose K/V the working cache holds at 0..len(tokens).

        Blocks already pooled are only refreshed; new ones take a free slot or evict the least
        recently used block of another chain. Returns how many blocks were newly stored.
        """
        count = min(len(tokens) // self.tokens_per_block, self.stats.max_blocks)
        chain = self._blocks(tokens, count)
        keys: list[bytes] = []
        parent = self.root
        for block in chain:
            keys.append(self._key(parent, block))
            parent = keys[-1]
        # The chain's pooled blocks go to the recent end before any slot is taken: `match` touched
        # only the prompt's, and a block the answer recomputed may be the least recently used.
        self._touch([key for key in keys if key in self._index])
        new: list[tuple[int, int]] = []  # (block of the working cache, its slot)
        parent = self.root
        for i, (key, block) in enumerate(zip(keys, chain, strict=True)):
            if key not in self._index:
                slot = self._take_slot()
                self._index[key] = _Entry(slot, parent, block)
                new.append((i, slot))
            parent = key
        with torch.inference_mode():
            for first, slot, run in _runs(new):
                for pool, working in ((self.k, cache.k), (self.v, cache.v)):
                    blocks = self._positions(working, first, run).permute(2, 0, 1, 3, 4)
                    pool[slot : slot + run].copy_(blocks)
        self._touch(keys)
        stored = len(new)
        self.stats.stored_blocks += stored
        self.stats.used_blocks = len(self._index)
        return stored

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        # The chain being stored was touched by `store` and its new blocks go to the recent end,
        # so with count <= max_blocks the LRU end is another chain's.
        _, victim = self._index.popitem(last=False)
        self.stats.evicted_blocks += 1
        return victim.slot


def _runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first block, first slot, count) of each run of (block, slot) pairs in which both go up by
    one from pair to pair."""
    runs: list[tuple[int, int, int]] = []
    for block, slot in pairs:
        if runs:
            first, start, count = runs[-1]
            if block == first + count and slot == start + count:
                runs[-1] = (first, start, count + 1)
                continue
        runs.append((block, slot, 1))
    return runs
