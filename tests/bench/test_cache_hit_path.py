"""bench.cache's in-process hit path (h) runs the gateway's own Python for an L1 hit: it must keep
working as the check stage reads more of the backend."""

from __future__ import annotations

import argparse
import logging

from appliance.text.tokenizer import ModelText
from appliance.v1 import inference_pb2 as pb
from bench.cache import hit_path
from bench.common import MODEL
from tests.conftest import Tiny


async def test_the_in_process_hit_path_answers_from_l1(tiny: Tiny) -> None:
    text = ModelText.load(tiny.tokenizer_dir)
    request = pb.GenerateRequest(model=MODEL, prompt="a question", max_tokens=8, temperature=0)
    hit = pb.CompleteResponse(text=" an answer", token_ids=[5, 6, 7])

    out = await hit_path(
        argparse.Namespace(iterations=3), text, tiny.tokenizer_dir, "fp", request, hit
    )

    (times,) = out.values()
    assert len(times) == 3


async def test_the_in_process_hit_path_writes_an_access_line_per_hit(tiny: Tiny) -> None:
    """(h) counts the access line whatever logging the caller set up, and leaves it as it was."""
    text = ModelText.load(tiny.tokenizer_dir)
    request = pb.GenerateRequest(model=MODEL, prompt="a question", max_tokens=8, temperature=0)
    hit = pb.CompleteResponse(text=" an answer", token_ids=[5, 6, 7])
    access = logging.getLogger("appliance.access")
    before = access.handlers, access.level, access.propagate
    lines: list[logging.LogRecord] = []

    def count(record: logging.LogRecord) -> bool:
        lines.append(record)
        return True

    access.addFilter(count)
    try:
        await hit_path(
            argparse.Namespace(iterations=3), text, tiny.tokenizer_dir, "fp", request, hit
        )
    finally:
        access.removeFilter(count)

    assert len(lines) == 1 + 3  # the check's hit, then the timed ones
    assert (access.handlers, access.level, access.propagate) == before
