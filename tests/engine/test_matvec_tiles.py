"""bench.matvec_tiles on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py): every tile of every format gives the first tile's products (checked inside the
sweep), and the tables name the current tile and the best."""

from __future__ import annotations

import pytest

from appliance.engine import kernels
from bench import matvec_tiles


def test_the_sweep_checks_and_tabulates_every_format_on_the_tiny_shape(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--device", "cpu", "--shape", "tiny", "--rows", "8,16", "--cols", "1024,2048"]
    assert matvec_tiles.main(argv) == 0
    out = capsys.readouterr().out
    tables = {}
    for label in ("bf16", "fp8", "int8", "int4"):
        assert f"{label}: GB/s of weight read" in out
        tables[label] = out.split(f"{label}: GB/s of weight read")[1].split("best: ")[0]
    # Each format's table marks its own kernel's tile (kernels.MATVEC_TILES).
    read_by: tuple[tuple[str, kernels.MatvecKernel], ...] = (
        ("bf16", "matvec"),
        ("fp8", "matvec"),
        ("int8", "int8"),
        ("int4", "int4"),
    )
    for label, kernel in read_by:
        rows, cols = kernels.MATVEC_TILES[kernel]
        assert tables[label].count("(current)") == 1
        assert f"| {rows} x {cols} (current) |" in tables[label]
    assert out.count("| 16 x 2048 |") == 0  # over MAX_TILE values: not swept
    assert out.count("best: ") == 4
    assert "| tile (rows x cols) | qkv | o | gate-up | down | block µs |" in out


def test_with_tokens_the_row_tile_kernel_is_swept_beside_torchs_product(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--device", "cpu", "--shape", "tiny", "--formats", "fp8,int4", "--tokens", "16"]
    assert matvec_tiles.main([*argv, "--rows", "64", "--cols", "64"]) == 0
    out = capsys.readouterr().out
    _, outs, ins = kernels.ROWS_TILE
    for label in ("fp8", "int4"):
        table = out.split(f"{label}: GB/s of weight read")[1].split("best: ")[0]
        assert f"| {outs} x {ins} (current) |" in table
        assert "| torch's own product |" in table
    assert out.count("; torch's own product / best: ") == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--formats", "bf16,int3"], "unknown format(s) ['int3']; known: bf16, fp8, int8, int4"),
        (["--rows", "12"], "--rows and --cols take powers of two"),
        (["--cols", "a"], "--rows and --cols take comma-separated integers"),
        (["--rows", "64", "--cols", "1024"], "no tile of --rows x --cols holds at most 16384"),
        (["--tokens", "2", "--rows", "8"], "--rows take at least 16 and --cols at least 32"),
        (["--tokens", "129"], "--tokens takes 1 to 128 (the most rows of a fused step)"),
    ],
)
def test_bad_arguments_are_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        matvec_tiles.main(["--device", "cpu", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
