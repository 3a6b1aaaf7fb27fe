"""appliance.textfile: a user-named text file is read whole only within its bound, whatever it is,
and every refusal is one line the caller puts its option before."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.loadgen.options import BenchInputError
from appliance.loadgen.workload import load_prompts
from appliance.textfile import TextFileError, read_text
from appliance.tools.warm import WarmInputError, read_prompts


def test_a_file_at_the_bound_is_read_and_one_byte_more_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("héllo", encoding="utf-8")  # 6 bytes
    assert read_text(path, 6) == "héllo"
    with pytest.raises(TextFileError, match=r"^more than 5 bytes$"):
        read_text(path, 5)


def test_an_endless_file_costs_a_bounded_read() -> None:
    with pytest.raises(TextFileError, match=r"^more than 1,048,576 bytes$"):
        read_text(Path("/dev/zero"), 1 << 20)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda d: d / "absent.txt", "No such file or directory"),
        (lambda d: d, "Is a directory"),
    ],
    ids=["missing", "directory"],
)
def test_a_path_that_is_no_file_says_why(make: object, reason: str, tmp_path: Path) -> None:
    with pytest.raises(TextFileError) as err:
        read_text(make(tmp_path), 100)  # type: ignore[operator]
    assert str(err.value) == reason


def test_bytes_that_are_not_utf8_name_their_offset(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("abc é".encode("latin-1"))
    with pytest.raises(TextFileError, match=r"^not UTF-8 text \(byte 4\)$"):
        read_text(path, 100)


def test_the_callers_put_their_option_or_path_first(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_bytes(b"\xff\n")
    with pytest.raises(BenchInputError, match=rf"^--prompts {path}: not UTF-8 text \(byte 0\)$"):
        load_prompts(path)
    with pytest.raises(WarmInputError, match=rf"^{path}: not UTF-8 text \(byte 0\)$"):
        read_prompts(path, "tiny", None)
