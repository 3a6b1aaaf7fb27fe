"""The runner's static KV cache and block-granular prefix reuse, run directly on the decoder.

Each reuse case compares a runner with a prefix pool against one without: greedy outputs must be
identical, and the counters must say how much was reused.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch
from google.protobuf import text_format
from torch.utils._python_dispatch import TorchDispatchMode
from tritonclient.grpc import model_config_pb2 as mc

from appliance.engine.llama import LlamaModel
from appliance.engine.prefix_cache import PrefixCache, pool_blocks
from appliance.engine.repository import KvCacheParams, ModelEntry, RepositoryError
from appliance.engine.runner import Emission, Job, RequestPerf, Runner, build_runner
from appliance.engine.sampling import SamplingParams

B = 4  # tokens per block
GREEDY = SamplingParams(top_k=1)
BASE = [1, 5, 17, 42, 3, 88, 60, 7, 9, 19, 33, 96]  # three full blocks


def prefix_runner(model: LlamaModel, blocks: int = 64, fingerprint: str = "fp") -> Runner:
    pool = PrefixCache(model.config, blocks, B, fingerprint, model.device, model.dtype)
    return Runner(model, max_seq_len=64, tokens_per_block=B, prefix=pool)


def run(runner: Runner, prompt: list[int], n: int = 6) -> tuple[list[int], RequestPerf]:
    """One greedy request through the runner's compute thread; its tokens and last perf record."""
    done = threading.Event()
    out: list[Emission] = []

    def emit(e: Emission) -> None:
        out.append(e)
        if e.final:
            done.set()

    job = Job("t", prompt, n, None, GREEDY, streaming=True, emit=emit, return_perf=True)
    runner.submit(job)
    assert done.wait(60)
    perf = next(e.perf for e in reversed(out) if e.perf is not None)
    # The pool is written after the final response; the stats lock orders us after that.
    with runner.stats.changed:
        runner.stats.changed.wait_for(lambda: runner.stats.running is None, timeout=60)
    return [t for e in out for t in (e.tokens or [])], perf


@pytest.fixture
def runners(micro_model: LlamaModel) -> Iterator[tuple[Runner, Runner]]:
    reuse, plain = prefix_runner(micro_model), Runner(micro_model, 64, B)
    yield reuse, plain
    reuse.close()
    plain.close()


def test_whole_prompt_cached_recomputes_one_token(runners: tuple[Runner, Runner]) -> None:
    reuse, plain = runners
    first, _ = run(reuse, BASE)
    again, perf = run(reuse, BASE)
    assert again == first == run(plain, BASE)[0]
    assert perf.kv.reused_tokens == len(BASE) - 1  # the last token is prefilled for its logits
    assert perf.kv.reused_blocks == 3
    # The prompt's blocks, counted when its sequence was added (TensorRT-LLM's per-request count).
    assert perf.kv.total_blocks == -(-len(BASE) // B) and perf.kv.new_blocks == 0


@pytest.mark.parametrize(
    ("name", "prompt", "reused_tokens"),
    [
        ("exactly-N-blocks", [*BASE[:8], 11, 12, 13, 14], 8),
        ("diverges-mid-block", [*BASE[:6], 50, 51, 52, 53, 54], 4),
        ("shorter-than-a-block", BASE[:3], 0),
        ("prefix-then-more", [*BASE, 70, 71, 72, 73, 74], 12),
    ],
)
def test_reuse_never_changes_the_answer(
    runners: tuple[Runner, Runner], name: str, prompt: list[int], reused_tokens: int
) -> None:
    reuse, plain = runners
    run(reuse, BASE)
    got, perf = run(reuse, prompt)
    assert got == run(plain, prompt)[0], name
    assert perf.kv.reused_tokens == reused_tokens
    assert perf.kv.reused_blocks == reused_tokens // B
    assert perf.kv.new_blocks == perf.kv.total_blocks - perf.kv.reused_blocks


def test_generated_tokens_are_reusable_next_turn(runners: tuple[Runner, Runner]) -> None:
    """A multi-turn prompt repeats the previous answer; its blocks were computed while decoding."""
    reuse, plain = runners
    answer, _ = run(reuse, BASE, n=9)
    turn = BASE + answer + [20, 21, 22]
    got, perf = run(reuse, turn)
    assert got == run(plain, turn)[0]
    # The last answer token was never fed back, so only blocks up to it are complete.
    assert perf.kv.reused_tokens == (len(BASE) + len(answer) - 1) // B * B


def test_reused_blocks_give_the_logits_of_a_full_prefill(micro_model: LlamaModel) -> None:
    pool = PrefixCache(micro_model.config, 8, B, "fp", micro_model.device, micro_model.dtype)
    cache = micro_model.new_cache(32)
    micro_model.forward(BASE, cache, 0)
    assert pool.store(BASE, cache) == 3
    prompt = [*BASE[:8], 60, 61, 62]
    slots = pool.match(prompt)
    assert len(slots) == 2
    fresh = micro_model.new_cache(32)
    pool.load(slots, fresh)
    reused = micro_model.forward(prompt[8:], fresh, 8)
    full = micro_model.forward(prompt, micro_model.new_cache(32), 0)
    torch.testing.assert_close(reused, full, rtol=1e-4, atol=1e-5)


class CountCopies(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the copies (aten.copy_) torch runs inside it: on a GPU each is a launch."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.copies = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.copies += func is torch.ops.aten.copy_.default
        return func(*args, **(kwargs or {}))


def test_a_run_of_consecutive_slots_moves_in_one_copy_of_k_and_one_of_v(
    micro_model: LlamaModel,
) -> None:
    pool = PrefixCache(micro_model.config, 8, B, "fp", micro_model.device, micro_model.dtype)
    cache = micro_model.new_cache(32)
    micro_model.forward(BASE, cache, 0)
    with CountCopies() as stored:
        assert pool.store(BASE, cache) == 3  # three new blocks, slots 0, 1, 2
    loaded = micro_model.new_cache(32)
    slots = pool.match(BASE)
    with CountCopies() as moved:
        pool.load(slots, loaded)
    assert (stored.copies, moved.copies) == (2, 2)
    assert slots == [0, 1, 2]  # slot i holds block i
    # Out of order, the slots 2, 0, 1 are two runs: slot 2 alone, slots 0 and 1 together.
    scattered = micro_model.new_cache(32)
    with CountCopies() as moved:
        pool.load([2, 0, 1], scattered)
    assert moved.copies == 4
    for at, block in enumerate([2, 0, 1]):
        for got, want in ((scattered.k, cache.k), (scattered.v, cache.v)):
            assert torch.equal(
                got[:, :, at * B : (at + 1) * B], want[:, :, block * B : (block + 1) * B]
            )


def test_block_n_matches_only_after_blocks_0_to_n_minus_1(micro_model: LlamaModel) -> None:
    pool = PrefixCache(micro_model.config, 8, B, "fp", micro_model.device, micro_model.dtype)
    cache = micro_model.new_cache(32)
    micro_model.forward(BASE, cache, 0)
    pool.store(BASE, cache)
    assert len(pool.match(BASE)) == 3
    # Same second and third blocks after a different first one: nothing matches.
    assert pool.match([2, 2, 2, 2, *BASE[4:]]) == []


def test_lru_eviction_keeps_recent_chains_and_parents(micro_model: LlamaModel) -> None:
    reuse = prefix_runner(micro_model, blocks=5)
    try:
        x, y = [*BASE[:8], 0], [8, 9, 10, 11, 12, 13, 14, 15, 0]
        run(reuse, x, n=1)  # stores x's 2 blocks
        run(reuse, y, n=1)  # 2 more: 4 of 5
        assert run(reuse, x, n=1)[1].kv.reused_blocks == 2  # x is now more recent than y
        z = [30, 31, 32, 33, 34, 35, 36, 37, 0]
        run(reuse, z, n=1)  # needs 2, 1 free: evicts y's last block (a leaf), never a parent
        stats = reuse.stats.kv
        assert (stats.used_blocks, stats.evicted_blocks, stats.max_blocks) == (5, 1, 5)
        assert run(reuse, x, n=1)[1].kv.reused_blocks == 2
        assert run(reuse, y, n=1)[1].kv.reused_blocks == 1  # its parent survived
        # y stored its second block again, evicting the least recent leaf: z's.
        assert run(reuse, z, n=1)[1].kv.reused_blocks == 1
        assert reuse.stats.kv.evicted_blocks == 3
    finally:
        reuse.close()


def test_a_full_pool_never_evicts_the_stored_chains_own_blocks(micro_model: LlamaModel) -> None:
    """A one-token prompt matches no block, yet its greedy answer recomputes a pooled block (the
    least recently used one) and then a new one: storing must evict another chain's block, and
    the request ends with one final response, completed, not failed."""
    reuse = prefix_runner(micro_model, blocks=2)
    try:
        short, _ = run(reuse, [5], n=5)  # stores [5, 3 answer tokens]: 1 of 2 blocks
        run(reuse, [50, 51, 52, 53, 54], n=1)  # another chain's block: the pool is full
        longer, perf = run(reuse, [5], n=9)  # 2 blocks: the first pooled, the second new
        assert longer[:5] == short
        assert perf.kv.reused_blocks == 0
        assert (reuse.stats.completed, reuse.stats.failed) == (3, 0)
        assert reuse.stats.kv.evicted_blocks == 1
        assert run(reuse, [5, *longer[:8]], n=1)[1].kv.reused_blocks == 2
    finally:
        reuse.close()


def test_another_fingerprint_never_matches(micro_model: LlamaModel) -> None:
    """Blocks are keyed from the engine fingerprint: other weights' K/V are never found."""
    old = PrefixCache(micro_model.config, 8, B, "engine-1", micro_model.device, micro_model.dtype)
    new = PrefixCache(micro_model.config, 8, B, "engine-2", micro_model.device, micro_model.dtype)
    cache = micro_model.new_cache(32)
    micro_model.forward(BASE, cache, 0)
    old.store(BASE, cache)
    new._index = old._index  # the same index consulted under the new fingerprint
    assert len(old.match(BASE)) == 3 and new.match(BASE) == []


def test_counters_mirror_kv_cache_stats(runners: tuple[Runner, Runner]) -> None:
    reuse, _ = runners
    run(reuse, BASE, n=2)
    run(reuse, [*BASE[:8], 40, 41, 42, 43], n=2)
    kv = reuse.stats.kv
    assert kv.reused_blocks == 2 and kv.missed_blocks == 3 + 1
    assert kv.reused_tokens == 8
    assert kv.alloc_total_blocks == 4 + 4
    assert kv.alloc_new_blocks == kv.alloc_total_blocks - kv.reused_blocks
    assert kv.stored_blocks == 3 + 1 and kv.used_blocks == 4
    assert kv.hit_rate == pytest.approx(2 / 6)


def test_no_cache_is_allocated_per_request(
    micro_model: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = prefix_runner(micro_model)
    k_ptr = runner.cache.k.data_ptr()

    def refuse(max_seq_len: int) -> NoReturn:
        raise AssertionError("a request allocated a KV cache")

    monkeypatch.setattr(micro_model, "new_cache", refuse)
    try:
        run(runner, BASE)
        run(runner, BASE[:5])
    finally:
        runner.close()
    assert runner.cache.k.data_ptr() == k_ptr
    assert runner.stats.completed == 2


# --- sizing from the repository ---------------------------------------------------------------


def entry(tmp_path: Path, params: dict[str, str]) -> ModelEntry:
    config = mc.ModelConfig(name="m", max_batch_size=1)
    for key, value in params.items():
        config.parameters[key].string_value = value
    (tmp_path / "config.pbtxt").write_text(text_format.MessageToString(config))
    return ModelEntry("m", tmp_path, config, tmp_path)


def test_repository_kv_parameters_and_defaults(tmp_path: Path) -> None:
    default = entry(tmp_path, {}).kv_cache
    assert default == KvCacheParams(None, 32, True, None, 0.9)  # reuse is on when unset
    given = entry(
        tmp_path,
        {
            "max_seq_len": "48",
            "tokens_per_block": "16",
            "enable_kv_cache_reuse": "false",
            "max_tokens_in_paged_kv_cache": "${max_tokens_in_paged_kv_cache}",
        },
    ).kv_cache
    assert given == KvCacheParams(48, 16, False, None, 0.9)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"tokens_per_block": "24"}, "power of two"),
        ({"max_seq_len": "-1"}, "'max_seq_len' must be a positive integer"),
        ({"enable_kv_cache_reuse": "yes"}, "'true' or 'false'"),
        ({"kv_cache_free_gpu_mem_fraction": "1.5"}, r"in \(0, 1\]"),
    ],
)
def test_bad_kv_parameters_name_the_key(
    tmp_path: Path, params: dict[str, str], message: str
) -> None:
    with pytest.raises(RepositoryError, match=message):
        _ = entry(tmp_path, params).kv_cache


def test_runner_sized_from_the_repository(micro_model: LlamaModel) -> None:
    runner = build_runner(micro_model, KvCacheParams(48, 4, True, 48 + 10 * 4, 0.9), "fp")
    try:
        assert runner.cache.max_seq_len == 48
        assert runner.prefix is not None and runner.stats.kv.max_blocks == 10
    finally:
        runner.close()
    off = build_runner(micro_model, KvCacheParams(None, 4, False, None, 0.9), "fp")
    try:
        assert off.prefix is None and off.cache.max_seq_len == 64
    finally:
        off.close()
    beyond = build_runner(micro_model, KvCacheParams(65, 4, False, None, 0.9), "fp")
    try:
        assert beyond.cache.max_seq_len == 64  # within the checkpoint's context
    finally:
        beyond.close()


def test_pool_budget_counts_the_running_request(micro_model: LlamaModel) -> None:
    c, dtype, cpu = micro_model.config, micro_model.dtype, torch.device("cpu")
    assert pool_blocks(c, dtype, cpu, 4, 64, 64 + 4 * 7 + 3, 0.9) == 7
    assert pool_blocks(c, dtype, cpu, 4, 64, 32, 0.9) == 0
    assert pool_blocks(c, dtype, cpu, 4, 64, None, 0.9) > 0  # a share of free memory


def test_a_fault_after_the_final_response_sends_no_second_final(
    micro_model: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose bookkeeping fails after its final response went out is that response's:
    no second final (with an error) and no failure counted; the fault is logged."""
    runner = prefix_runner(micro_model)
    try:

        def broken(*args: Any) -> NoReturn:
            raise KeyError("pool")

        monkeypatch.setattr(runner, "_account", broken)
        finals: list[Emission] = []
        done = threading.Event()

        def emit(e: Emission) -> None:
            if e.final:
                finals.append(e)
                done.set()

        runner.submit(Job("t", BASE, 4, None, GREEDY, streaming=False, emit=emit))
        assert done.wait(60)
        with runner.stats.changed:
            runner.stats.changed.wait_for(lambda: runner.stats.running is None, timeout=60)
        assert [e.error for e in finals] == [None]
        assert (runner.stats.completed, runner.stats.failed) == (1, 0)
    finally:
        runner.close()
