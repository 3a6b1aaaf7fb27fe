"""The Final as the wire carries it: filled in place (Complete) it is the message a Final built
whole would be, field for field and byte for byte, empty fields and sub-messages included."""

from __future__ import annotations

import pytest

from appliance.gateway import messages
from appliance.gateway.reply import Final
from appliance.gateway.tool_calls import ToolCall
from appliance.v1 import inference_pb2 as pb

BLANK = Final("", "stop", 0, 0, 0, 0, 0, "miss", "", False, None, "")
HIT = Final("r1", "length", 128, 64, 3, 40, 41, "l1", "tiny", False, None, "ab" * 16)
SEMANTIC = Final("r2", "stop", 9, 3, 0, 7, 8, "semantic", "small", True, 0.875, "cd" * 16, 5, 4)
CALL = Final("r3", "stop", 5, 9, 1, 2, 3, "miss", "tiny", False, None, "", 0, 0)
CALL.tool_call = ToolCall("lookup", {"city": "Zürich", "n": [1, 2]}, "call_1")


def built_whole(f: Final) -> pb.Final:
    """The Final as one constructor call writes it."""
    out = pb.Final(
        finish_reason=messages.FINISH[f.finish_reason],
        usage=pb.Usage(prompt_tokens=f.prompt_tokens, completion_tokens=f.completion_tokens),
        timings=pb.Timings(queue_us=f.queue_us, ttft_us=f.ttft_us, total_us=f.total_us),
        cache_tier=messages.TIERS.get(f.tier, pb.CACHE_TIER_OTHER),
        cache_tier_name=f.tier,
        model=f.model,
        degraded=f.degraded,
        similarity=f.similarity or 0.0,
        cache_entry=f.cache_entry,
        draft_tokens=f.draft_tokens,
        accepted_draft_tokens=f.accepted_draft_tokens,
    )
    if f.tool_call is not None:
        out.tool_call.CopyFrom(messages.tool_call(f.tool_call))
    return out


@pytest.mark.parametrize(
    "f", [BLANK, HIT, SEMANTIC, CALL], ids=["blank", "hit", "semantic", "call"]
)
def test_a_final_filled_in_place_is_the_final_built_whole(f: Final) -> None:
    reply = pb.CompleteResponse(request_id=f.request_id)
    messages.fill_final(reply.final, f)
    expected = pb.CompleteResponse(request_id=f.request_id, final=built_whole(f))

    assert reply == expected
    assert reply.SerializeToString(deterministic=True) == expected.SerializeToString(
        deterministic=True
    )
    assert reply.final.HasField("usage") and reply.final.HasField("timings")
    assert messages.final(f) == pb.GenerateResponse(request_id=f.request_id, final=built_whole(f))
