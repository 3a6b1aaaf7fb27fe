"""Speculative decoding: each mode's build flags, repository parameters, plan bytes, refusals."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from engine_build import commands, pbtxt, planner, repo
from engine_build import spec as spec_module
from engine_build.checkpoint import read_shape
from engine_build.errors import SpecError
from engine_build.spec import BuildSpec, TrtllmInstall, load_spec, validate
from engine_build.speculative import (
    Speculative,
    choices_text,
    lookahead_draft_len,
    parse_choices,
    tree_problem,
)
from engine_build.verify import check_speculative, cross_check_engine

from .conftest import make_checkpoint, spec_sections, write_spec
from .recorded_cli import parse

DATA = Path(__file__).parent / "data"
CKPT, ENGINE = Path("/w/checkpoint"), Path("/w/engine")
GIB = 1 << 30
TREE = ((0,), (0, 0), (1,), (0, 1), (0, 0, 0))


def spec(s: Speculative, **kw: Any) -> BuildSpec:
    kw.setdefault(
        "trtllm", TrtllmInstall(Path("/opt/trtllm"), (), "/src/examples/quantization/quantize.py")
    )
    return BuildSpec(
        source=Path("s.toml"), hf_model_dir=Path("/m"), work_dir=Path("/w"), speculative=s, **kw
    )


MODES: dict[str, tuple[Speculative, dict[str, Any]]] = {
    "draft_target": (
        Speculative("draft_target", 4, draft_hf_model_dir=Path("/d")),
        {"enable_kv_cache_reuse": True},
    ),
    "medusa": (
        Speculative("medusa", medusa_model_dir=Path("/h"), num_medusa_heads=3, medusa_choices=TREE),
        {"quantization": "none", "kv_cache_dtype": "auto"},
    ),
    "eagle": (
        Speculative("eagle", 8, eagle_model_dir=Path("/e"), num_eagle_layers=3, eagle_choices=TREE),
        {"quantization": "none", "kv_cache_dtype": "auto"},
    ),
    "lookahead": (
        Speculative(
            "lookahead",
            lookahead_window_size=4,
            lookahead_ngram_size=3,
            lookahead_verification_set_size=2,
        ),
        {},
    ),
}
BUILD_MODE = {
    "draft_target": "draft_tokens_external",
    "medusa": "medusa",
    "eagle": "eagle",
    "lookahead": "lookahead_decoding",
}
DRAFT_LEN = {"draft_target": 4, "medusa": 5, "eagle": 8, "lookahead": 11}


@pytest.mark.parametrize("mode", MODES)
def test_target_build_flags_parse_with_real_cli(mode: str) -> None:
    s, kw = MODES[mode]
    sp = spec(s, **kw)
    validate(sp)
    ns = parse("trtllm-build", commands.build_args(sp, CKPT, ENGINE))
    assert ns.speculative_decoding_mode == BUILD_MODE[mode]
    assert ns.max_draft_len == DRAFT_LEN[mode]
    assert not ns.gather_context_logits  # trtllm-build refuses it with a draft length
    if mode in ("draft_target", "eagle"):
        assert ns.use_paged_context_fmha == "enable"


def test_lookahead_draft_len_is_the_readme_formula() -> None:
    assert lookahead_draft_len(4, 3, 2) == 1 + 5 * 2
    assert lookahead_draft_len(7, 7, 7) == 5 + 13 * 6
    assert lookahead_draft_len(2, 1, 1) == 0


def test_no_speculation_passes_no_speculative_flags() -> None:
    argv = commands.build_args(spec(Speculative()), CKPT, ENGINE)
    assert "--speculative_decoding_mode" not in argv and "--max_draft_len" not in argv


@pytest.mark.parametrize("mode", ["medusa", "eagle"])
def test_convert_checkpoint_argv_parses_with_recorded_cli(mode: str) -> None:
    s, kw = MODES[mode]
    argv = commands.checkpoint_command(spec(s, **kw), CKPT)
    assert argv[1] == f"/src/examples/{mode}/convert_checkpoint.py"
    ns = parse(f"{mode}/convert_checkpoint.py", argv[2:])
    assert ns.model_dir == "/m" and ns.output_dir == str(CKPT)
    if mode == "medusa":
        assert (ns.num_medusa_heads, ns.max_medusa_token_len, ns.medusa_model_dir) == (3, 5, "/h")
    else:
        assert (ns.num_eagle_layers, ns.max_draft_len, ns.eagle_model_dir) == (3, 8, "/e")


def test_draft_engine_gathers_generation_logits_only_when_used() -> None:
    s, kw = MODES["draft_target"]
    plain = parse("trtllm-build", commands.draft_build_args(spec(s, **kw), CKPT, ENGINE))
    assert plain.speculative_decoding_mode is None and not plain.gather_generation_logits
    logits = Speculative("draft_target", 4, draft_hf_model_dir=Path("/d"), use_draft_logits=True)
    ns = parse("trtllm-build", commands.draft_build_args(spec(logits, **kw), CKPT, ENGINE))
    assert ns.gather_generation_logits
    q = parse("quantize.py", commands.draft_quantize_args(spec(s, **kw), CKPT))
    assert q.model_dir == "/d" and q.qformat == "fp8"


@pytest.mark.parametrize("mode", MODES)
def test_repository_parameters_per_mode_pass_verify(mode: str) -> None:
    s, kw = MODES[mode]
    params = dict(repo.speculative_params(spec(s, **kw)))
    assert params["max_draft_len"] == str(DRAFT_LEN[mode])
    assert params["speculative_decoding_fast_logits"] == "false"
    assert check_speculative(params) == []
    if mode == "medusa":
        assert params["decoding_mode"] == "medusa"
        assert parse_choices(params["medusa_choices"]) == TREE
    if mode == "eagle":
        assert params["eagle_choices"] == "{0}, {0, 0}, {1}, {0, 1}, {0, 0, 0}"
    if mode == "lookahead":
        assert (params["lookahead_window_size"], params["lookahead_ngram_size"]) == ("4", "3")
        assert params["lookahead_verification_set_size"] == "2"
    if mode == "draft_target":
        assert (
            "decoding_mode" not in params
            and params["speculative_draft_model"] == "tensorrt_llm_draft"
        )
        cfg = pbtxt.model_config(repo.repo_params(spec(s, **kw), ENGINE, Path("/r/tensorrt_llm")))
        assert "draft_input_ids" in {t.name for t in cfg.input}


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        ({"lookahead_ngram_size": None}, "needs parameters lookahead_window_size"),
        ({"max_draft_len": "12"}, "needs max_draft_len 11, the engine has 12"),
        ({"speculative_decoding_fast_logits": "true"}, "orchestrator mode"),
        ({"decoding_mode": "lookahed"}, "is not one of"),
    ],
)
def test_verify_catches_speculative_hand_edits(edit: dict[str, str | None], problem: str) -> None:
    s, kw = MODES["lookahead"]
    params = dict(repo.speculative_params(spec(s, **kw)))
    for k, v in edit.items():
        if v is None:
            params.pop(k)
        else:
            params[k] = v
    assert any(problem in p for p in check_speculative(params)), check_speculative(params)


def test_medusa_without_choices_and_bad_choices_are_problems() -> None:
    assert check_speculative({"decoding_mode": "medusa", "max_draft_len": "5"})
    bad = {"decoding_mode": "eagle", "eagle_choices": "[[0]]", "max_draft_len": "5"}
    assert any("does not parse" in p for p in check_speculative(bad))
    assert choices_text(parse_choices("{0}, {0, 1}")) == "{0}, {0, 1}"


def test_plan_counts_heads_drafter_and_longer_sequences() -> None:
    shape = read_shape(DATA / "llama-3.1-8b")
    h, vocab = 4096, 128256
    s, kw = MODES["medusa"]
    cost = planner.draft_cost(shape, spec(s, **kw), None)
    assert cost.bytes == 3 * (h * h + h + vocab * h) * 2 and cost.extra_tokens == 5
    base = planner.make_plan(shape, spec(Speculative(), **kw), 80 * GIB)
    plan = planner.make_plan(shape, spec(s, **kw), 80 * GIB, cost)
    assert plan.kv_pool_bytes < base.kv_pool_bytes and plan.draft_bytes == cost.bytes
    assert plan.kv_tokens_needed == 4128  # 4096 + 5 rounded up to 32-token blocks
    s, kw = MODES["draft_target"]
    cost = planner.draft_cost(shape, spec(s, **kw), shape)  # the 8B as its own draft
    w = planner.weight_bytes_per_gpu(shape, spec(s, **kw))
    assert cost.bytes == w + 4096 * 2 * 32 * 8 * 128  # fp8 KV: one byte an element
    s, kw = MODES["eagle"]
    one_layer = read_shape(DATA / "llama-3.1-8b")
    cost = planner.draft_cost(shape, spec(s, **kw), one_layer)
    assert cost.kv_per_token == 3 * 2 * 32 * 8 * 128 * 2 and cost.extra_tokens == 8 + 3


def _load(tmp_path: Path, section: dict[str, Any], **over: dict[str, Any]) -> BuildSpec:
    ckpt = make_checkpoint(tmp_path / "target")
    sections = spec_sections(ckpt, tmp_path / "w", tmp_path / "venv", speculative=section, **over)
    return load_spec(write_spec(tmp_path / "spec.toml", sections))


@pytest.mark.parametrize(
    ("section", "over", "message"),
    [
        ({"mode": "jacobi"}, {}, "key 'speculative.mode': must be one of none, draft_target"),
        (
            {
                "mode": "lookahead",
                "lookahead_window_size": 4,
                "lookahead_ngram_size": 3,
                "lookahead_verification_set_size": 2,
                "max_draft_len": 11,
            },
            {},
            "'speculative.max_draft_len': does not go with mode = 'lookahead'",
        ),
        (
            {"mode": "medusa", "medusa_model_dir": "/h", "medusa_choices": [[0]]},
            {},
            "supports FP16/BF16 only",
        ),
        (
            {"mode": "draft_target", "draft_hf_model_dir": "d", "max_draft_len": 300},
            {"kv_cache": {"enable_reuse": True}},
            "outside 1..256",
        ),
        (
            {"mode": "draft_target", "draft_hf_model_dir": "d", "max_draft_len": 4},
            {},
            "needs KV-cache reuse",
        ),
        (
            {
                "mode": "eagle",
                "eagle_model_dir": "/e",
                "eagle_choices": [[0], [0, 0]],
                "max_draft_len": 4,
                "num_eagle_layers": 3,
            },
            {"precision": {"quantization": "none", "kv_cache_dtype": "auto"}},
            "num_eagle_layers is 3",
        ),
        (
            {
                "mode": "eagle",
                "eagle_model_dir": "/e",
                "eagle_choices": [[0]],
                "max_draft_len": 4,
                "num_eagle_layers": 1,
                "eagle_dynamic_tree": True,
            },
            {"precision": {"quantization": "none", "kv_cache_dtype": "auto"}},
            "dynamic tree",
        ),
        (
            {"mode": "medusa", "medusa_model_dir": "/h", "medusa_choices": [[0, 1]]},
            {"precision": {"quantization": "none", "kv_cache_dtype": "auto"}},
            "has no parent [0]",
        ),
        (
            {
                "mode": "lookahead",
                "lookahead_window_size": 1,
                "lookahead_ngram_size": 1,
                "lookahead_verification_set_size": 0,
            },
            {},
            "does not speculate",
        ),
        ({"mode": "lookahead"}, {}, "needs 'lookahead_window_size'"),
        (
            {
                "mode": "eagle",
                "eagle_model_dir": "/e",
                "eagle_choices": [[0]],
                "max_draft_len": 4,
                "num_eagle_layers": 1,
                "max_non_leaves_per_layer": 99999999999999999999,
            },
            {"precision": {"quantization": "none", "kv_cache_dtype": "auto"}},
            "key 'speculative.max_non_leaves_per_layer': must be between 1 and 256",
        ),
    ],
)
def test_bad_speculative_specs_refused_in_one_line(
    tmp_path: Path, section: dict[str, Any], over: dict[str, Any], message: str
) -> None:
    with pytest.raises(SpecError, match=None) as info:
        _load(tmp_path, section, **over)
    text = str(info.value)
    assert message in text and "\n" not in text and "spec.toml:" in text


def test_draft_with_another_vocabulary_refused(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "d", vocab_size=32000)
    section = {
        "mode": "draft_target",
        "draft_hf_model_dir": str(tmp_path / "d"),
        "max_draft_len": 4,
    }
    with pytest.raises(
        SpecError, match="draft's vocab_size 32000 differs from the target's 128256"
    ):
        _load(tmp_path, section, kv_cache={"enable_reuse": True})


def test_draft_with_another_tokenizer_refused(tmp_path: Path) -> None:
    (make_checkpoint(tmp_path / "d") / "tokenizer.json").write_text("{}")
    section = {
        "mode": "draft_target",
        "draft_hf_model_dir": str(tmp_path / "d"),
        "max_draft_len": 4,
    }
    with pytest.raises(SpecError, match=r"tokenizer\.json differs"):
        _load(tmp_path, section, kv_cache={"enable_reuse": True})
    (tmp_path / "d" / "tokenizer.json").write_bytes(
        (tmp_path / "target" / "tokenizer.json").read_bytes()
    )
    assert _load(tmp_path, section, kv_cache={"enable_reuse": True}).speculative.draft_len == 4


@pytest.mark.parametrize(
    ("choices", "message"),
    [
        ([[0] * k for k in range(1, 300)], "299 paths; at most 256"),
        ([[0], [0] * 300], "a path of 300 indices; at most 256"),
        ([[2**31]], "index 2147483648 is larger than 2147483647"),
    ],
)
def test_choices_trees_are_bounded_before_they_are_walked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, choices: list[list[int]], message: str
) -> None:
    """Checking a tree's parents costs paths x depth; a spec with thousands of deep paths
    must be refused by its size, not walked."""
    walked: list[int] = []
    real = tree_problem

    def counting(tree: tuple[tuple[int, ...], ...], what: str) -> str | None:
        walked.append(len(tree))
        return real(tree, what)

    monkeypatch.setattr(spec_module, "tree_problem", counting)
    section = {"mode": "medusa", "medusa_model_dir": "/h", "medusa_choices": choices}
    over = {"precision": {"quantization": "none", "kv_cache_dtype": "auto"}}
    with pytest.raises(
        SpecError, match=r"key 'speculative\.medusa_choices': .*" + re.escape(message)
    ):
        _load(tmp_path, section, **over)
    assert walked == []


@pytest.mark.parametrize("mode", MODES)
def test_attention_window_covers_the_engine_sequence_with_its_drafts(mode: str) -> None:
    """trtllm-build adds the draft length (and EAGLE's layers) to the engine's max_seq_len
    because draft tokens are written to the KV cache past the request's last token; a window
    of the spec's max_seq_len makes the cache cyclic for the last tokens of a full request."""
    s, kw = MODES[mode]
    target = spec(s, **kw)
    cfg = pbtxt.model_config(repo.repo_params(target, ENGINE, Path("/r/tensorrt_llm")))
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params["max_attention_window_size"] == str(target.engine_max_seq_len)
    assert params["max_seq_len"] == str(target.max_seq_len)  # what requests may use
    engine = {
        "max_batch_size": 1,
        "max_input_len": target.max_input_len,
        "max_seq_len": target.engine_max_seq_len,
        "max_draft_len": s.draft_len,
        "num_eagle_layers": s.num_eagle_layers if mode == "eagle" else 0,
        "use_paged_context_fmha": True,
        "world_size": 1,
    }
    assert cross_check_engine(cfg, params, engine) == []
    # A window short of the engine's sequence (a repository written before) is a problem.
    params["max_attention_window_size"] = str(target.max_seq_len)
    assert any("max_attention_window_size" in p for p in cross_check_engine(cfg, params, engine))
    draft = repo.draft_repo_params(target) if mode == "draft_target" else None
    if draft is not None:
        draft_params = pbtxt.parameters(draft)
        assert draft_params["max_attention_window_size"] == str(target.max_seq_len)
