"""`appliance cache warm --prompts`: lines as an editor counts them, a byte order mark ignored."""

from __future__ import annotations

from pathlib import Path

from appliance.tools.warm import read_prompts


def test_lines_are_split_at_newlines_only(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a\u2028b"}\r\nplain\x0cpage\n', newline="")
    assert [r.prompt for r in read_prompts(prompts, "m", None)] == ["a\u2028b", "plain\x0cpage"]


def test_a_byte_order_mark_is_not_part_of_the_first_line(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 3}\n')
    [request] = read_prompts(prompts, "m", None)
    assert (request.prompt, request.max_tokens) == ("hi", 3)
