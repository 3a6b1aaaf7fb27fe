"""Sends guided Generates through a gateway and prints what came back as JSON (run inside the
test's netns): an answer under a small JSON Schema, then a guide the gateway lets through (it does
not compile EBNF grammars) that the engine's compile refuses."""

from __future__ import annotations

import asyncio
import json
import sys

import grpc

from appliance.client import connect, generate
from appliance.v1 import inference_pb2 as pb

# Every string and number bounded: with random weights only the grammar makes the answer valid.
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["city", "rank"],
    "additionalProperties": False,
}
# A grammar whose start rule names a rule it never defines.
UNDEFINED_RULE = "root ::= undefined"


def _request(guide: pb.Guide, seed: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        model="tiny-llama",
        prompt="Answer in JSON.",
        max_tokens=256,
        temperature=1.0,
        seed=seed,
        cache_policy=pb.CACHE_POLICY_BYPASS,
        guide=guide,
    )


async def main(address: str) -> None:
    channel, stub = connect(address)
    async with channel:
        schema = pb.Guide(type=pb.GUIDE_TYPE_JSON_SCHEMA, guide=json.dumps(SCHEMA))
        answer = await generate(stub, _request(schema, seed=3), timeout=120.0)
        hostile = pb.Guide(type=pb.GUIDE_TYPE_EBNF_GRAMMAR, guide=UNDEFINED_RULE)
        try:
            await generate(stub, _request(hostile, seed=3), timeout=120.0)
            refused = {"code": "OK", "details": ""}
        except grpc.aio.AioRpcError as exc:
            refused = {"code": exc.code().name, "details": exc.details() or ""}
    print(
        json.dumps(
            {
                "schema": SCHEMA,
                "text": answer.text,
                "finish_reason": pb.FinishReason.Name(answer.final.finish_reason),
                "refused": refused,
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
