"""The quality measures: per-position logits agree with the serving path; agreement counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from appliance.engine.quality import greedy, measure, token_logits
from appliance.engine.quantized import GroupQuant
from appliance.engine.random_weights import random_model
from bench import quality as cli
from tests.conftest import Tiny


def test_token_logits_match_the_serving_path() -> None:
    model = random_model("tiny", seed=1)
    ids = [5, 9, 200, 31, 7, 7, 64]
    every = token_logits(model, ids)
    for n in (1, 4, len(ids)):
        last = model.forward(ids[:n], model.new_cache(16), 0)
        torch.testing.assert_close(every[n - 1], last, rtol=1e-4, atol=1e-4)


def test_reference_against_itself_agrees_fully_and_int4_less() -> None:
    ids = list(range(3, 300, 7))
    prompts = [ids[:5], ids[10:16]]
    ref_model = random_model("tiny", seed=2)
    ref, own = measure("float32", ref_model, ids, prompts, 6, 16, None)
    assert ref.top1_agreement is None and ref.scored_tokens == len(ids) - 3  # 3 windows' firsts
    same, _ = measure("again", random_model("tiny", seed=2), ids, prompts, 6, 16, own)
    assert same.top1_agreement == 1.0 and same.greedy_agreement == 1.0
    assert same.perplexity == pytest.approx(ref.perplexity, rel=1e-5)
    int4, _ = measure(
        "int4", random_model("tiny", fp8=GroupQuant(4, 32), seed=2), ids, prompts, 6, 16, own
    )
    assert int4.weight_bytes < ref.weight_bytes
    assert int4.top1_agreement is not None and int4.top1_agreement < 1.0


def test_greedy_is_deterministic_and_bounded() -> None:
    model = random_model("tiny", seed=4)
    assert greedy(model, [1, 2, 3], 5) == greedy(model, [1, 2, 3], 5)
    with pytest.raises(ValueError, match="a window holds"):
        token_logits(model, [])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--formats", "int3"], "--formats: unknown ['int3']"),
        (["--weight-group", "100"], "--weight-group 100: expected one of 32, 64, 128, 256"),
        (["--tokens", "0"], "--tokens 0: expected 2..65536"),
        (["--formats", "float32,bfloat16:32"], "--formats bfloat16:32: a group"),
        (["--formats", "int4:48"], "--formats int4:48: a group (32, 64, 128, 256)"),
        (["--formats", "float32,awq"], "--formats awq: awq takes the checkpoint, awq:DIR"),
        (["--formats", "float32,awq-bf16:/nonexistent"], "--formats awq-bf16:/nonexistent: "),
    ],
)
def test_cli_refuses_bad_arguments_in_one_line(
    tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "t.txt"
    text.write_text("hello")
    base = ["--repository", str(tmp_path / "none"), "--text", str(text)]
    assert cli.main([*base, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench.quality: ") and message in err and err.count("\n") == 1


def test_cli_refuses_a_missing_repository(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--repository", str(tmp_path / "none"), "--text", "x"]) == 2
    assert "model repository directory not found" in capsys.readouterr().err


def test_cli_scores_an_awq_checkpoint(
    tiny: Tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from appliance.engine.awq_calibrate import quantize_checkpoint

    text = Path(__file__).parents[2] / "appliance" / "data" / "calibration.txt"
    awq_dir = tmp_path / "awq"
    quantize_checkpoint(tiny.model_dir, text, awq_dir, group=32, samples=1, tokens=32, grid=2)
    argv = ["--repository", str(tiny.repo), "--text", str(text), "--tokens", "48"]
    argv += ["--window", "24", "--prompts", "1", "--prompt-tokens", "8", "--steps", "2"]
    assert cli.main([*argv, "--formats", f"float32,awq:{awq_dir}"]) == 0
    out = capsys.readouterr().out
    assert "| awq g32 (awq) |" in out
