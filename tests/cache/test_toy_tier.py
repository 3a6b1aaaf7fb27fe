"""A cache tier of one's own, named in the configuration only: the final message, the HTTP answer's
`appliance` object, the Prometheus text and CacheAdmin.Stats report it with no other code edit."""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import ClassVar

import aiohttp
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.cache.entry import CachedAnswer
from appliance.cache.series import Described, Series
from appliance.cache.tiers import CacheQuery, CacheTier
from appliance.config import ConfigError, HttpConfig, MetricsConfig, ServerConfig, load_config
from appliance.gateway.models import StartupError, load_models
from appliance.gateway.server import RunningGateway, make_cache, start_server
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Engine, Tiny

HERE = "tests.cache.test_toy_tier"


class ToyTier(CacheTier):
    """Keeps answers in a dict; asked before L1, so the second identical request is its hit."""

    name = "toy"
    series: ClassVar[Described] = {
        "toy_lookups": "Lookups the toy tier made.",
        "toy_entries": Series("Answers the toy tier holds.", gauge=True),
    }

    def __init__(self) -> None:
        self.answers: dict[bytes, CachedAnswer] = {}
        self.lookups = 0

    async def lookup(self, query: CacheQuery) -> CachedAnswer | None:
        self.lookups += 1
        return self.answers.get(query.key)

    def store(self, query: CacheQuery, answer: CachedAnswer) -> None:
        self.answers[query.key] = answer

    def counters(self) -> dict[str, int]:
        return {"toy_lookups": self.lookups, "toy_entries": len(self.answers)}


class UndescribedTier(ToyTier):
    name = "undescribed"
    series: ClassVar[Described] = {"undescribed_lookups": ""}


class UndeclaredTier(ToyTier):
    """Reports toy_lookups and toy_entries but declares only one of them."""

    name = "undeclared"
    series: ClassVar[Described] = {"toy_lookups": "Lookups."}


def write_config(tmp_path: Path, tiny: Tiny, engine_address: str, tiers: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(
        f"""
[models.tiny]
backend = "{engine_address}"
tokenizer_dir = "{tiny.tokenizer_dir}"

[cache]
tiers = {tiers}
"""
    )
    return path


@pytest.fixture
async def gateway(tiny: Tiny, engine: Engine, tmp_path: Path) -> AsyncIterator[RunningGateway]:
    path = write_config(tmp_path, tiny, engine.address, f'["{HERE}:ToyTier", "l1"]')
    config = dataclasses.replace(
        load_config(path),
        server=ServerConfig(listen="127.0.0.1:0"),
        metrics=MetricsConfig(listen="127.0.0.1:0"),
        http=HttpConfig(listen="127.0.0.1:0"),
    )
    running = await start_server(config, await load_models(config))
    yield running
    await running.drain(0.5)


Labels = tuple[tuple[str, str], ...]


def scrape(port: int) -> dict[str, tuple[str, dict[Labels, float]]]:
    """Family name → (help, value by its sorted (label, value) pairs)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        family.name: (
            family.documentation,
            {
                tuple(sorted(s.labels.items())): s.value
                for s in family.samples
                if "_created" not in s.name
            },
        )
        for family in text_string_to_metric_families(text)
    }


async def test_a_configured_tier_is_reported_everywhere(gateway: RunningGateway) -> None:
    request = pb.GenerateRequest(model="tiny", prompt="what is a toy", max_tokens=4, temperature=0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        first = await stub.Complete(request)
        second = await stub.Complete(request)
        body = {
            "model": "tiny",
            "prompt": "what is a toy, asked over HTTP",
            "max_tokens": 4,
            "temperature": 0,
        }
        assert gateway.http is not None
        url = f"http://127.0.0.1:{gateway.http.port}/v1/completions"
        replies = []
        async with aiohttp.ClientSession() as session:
            for _ in range(2):
                async with session.post(url, json=body) as r:
                    assert r.status == 200
                    replies.append(await r.json())
        stats = dict((await pb_grpc.CacheAdminStub(channel).Stats(pb.CacheStatsRequest())).counters)

    assert (first.final.cache_tier_name, first.final.cache_tier) == ("miss", pb.CACHE_TIER_MISS)
    assert (second.final.cache_tier_name, second.final.cache_tier) == ("toy", pb.CACHE_TIER_OTHER)
    assert second.text == first.text
    assert [reply["appliance"]["cache_tier"] for reply in replies] == ["miss", "toy"]

    assert stats["toy_hits"] == 2 and stats["l1_hits"] == 0
    assert stats["toy_lookups"] == 4 and stats["toy_entries"] == 2

    families = await asyncio.to_thread(scrape, gateway.metrics_port)
    assert families["appliance_cache_hits"][1][(("tier", "toy"),)] == 2
    assert families["appliance_cache_toy_lookups"] == ("Lookups the toy tier made.", {(): 4.0})
    assert families["appliance_cache_toy_entries"] == ("Answers the toy tier holds.", {(): 2.0})
    requests = families["appliance_requests"][1]
    assert sum(n for labels, n in requests.items() if ("tier", "toy") in labels) == 2


def test_a_counter_without_a_description_is_refused_at_load(tmp_path: Path, tiny: Tiny) -> None:
    path = write_config(tmp_path, tiny, "127.0.0.1:1", f'["l1", "{HERE}:UndescribedTier"]')
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    message = str(refused.value)
    assert "\n" not in message
    assert "key 'cache.tiers'" in message and "'undescribed_lookups' needs a description" in message


def test_a_reported_counter_that_is_not_declared_is_refused_at_start(
    tmp_path: Path, tiny: Tiny
) -> None:
    path = write_config(tmp_path, tiny, "127.0.0.1:1", f'["l1", "{HERE}:UndeclaredTier"]')
    with pytest.raises(StartupError, match="counter 'toy_entries' has no description"):
        make_cache(load_config(path).cache)
