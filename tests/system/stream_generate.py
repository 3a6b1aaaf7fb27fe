"""Streams one Generate through a gateway and prints the result as JSON (run inside the test's netns)."""

from __future__ import annotations

import asyncio
import json
import sys

from appliance.client import connect, generate
from appliance.v1 import inference_pb2 as pb


async def main(address: str) -> None:
    channel, stub = connect(address)
    async with channel:
        request = pb.GenerateRequest(
            model="tiny-llama",
            prompt="Hello",
            max_tokens=16,
            temperature=0.0,
            cache_policy=pb.CACHE_POLICY_BYPASS,
        )
        result = await generate(stub, request, timeout=60.0)
    print(
        json.dumps(
            {
                "messages": result.messages,
                "tokens": len(result.token_ids),
                "text": result.text,
                "finish_reason": pb.FinishReason.Name(result.final.finish_reason),
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
