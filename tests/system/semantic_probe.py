"""Asks a question and then a paraphrase of it through a provisioned gateway's semantic tier and
prints what answered each, as JSON (run inside the test's netns). Waits, bounded, on the gateway's
own metrics: the tier in step with Redis before the question, the question's entry stored before
the paraphrase."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from appliance.client import connect, generate
from appliance.v1 import inference_pb2 as pb

QUESTION = "How do I get rid of acne?"
PARAPHRASE = "How can I get rid of acne?"


def metrics(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("appliance_semantic_")
    }


async def until(address: str, name: str, value: float, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    seen: dict[str, float] = {}
    while time.monotonic() < deadline:
        seen = await asyncio.to_thread(metrics, address)
        if seen.get(name, -1) >= value:
            return
        await asyncio.sleep(0.2)
    raise SystemExit(f"{name} did not reach {value} in {timeout_s:.0f} s: {seen}")


async def main(address: str, metrics_address: str) -> None:
    await until(metrics_address, "appliance_semantic_in_sync", 1)
    channel, stub = connect(address)
    answers = []
    async with channel:
        for text in (QUESTION, PARAPHRASE):
            request = pb.GenerateRequest(
                model="tiny-llama",
                prompt=text,
                max_tokens=8,
                temperature=0.0,
                semantic_cache=True,
            )
            answers.append(await generate(stub, request, timeout=60.0))
            await until(metrics_address, "appliance_semantic_stored_total", 1)
    first, second = answers
    print(
        json.dumps(
            {
                "question": pb.CacheTier.Name(first.final.cache_tier),
                "paraphrase": pb.CacheTier.Name(second.final.cache_tier),
                "same_text": first.text == second.text,
                "similarity": second.final.similarity,
                "cache_entry": second.final.cache_entry,
                "metrics": metrics(metrics_address),
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
