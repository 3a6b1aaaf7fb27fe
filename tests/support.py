"""Scaffolding the suites share: waiting on a condition (a bounded poll, or the engine's own
condition variable), a gateway configuration with test defaults, and a small tokenizer.json.

Only the standard library and pytest are imported at module level: host_tuning's tests use `until`
without loading the gateway's dependencies.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, overload

import pytest

if TYPE_CHECKING:
    from appliance.config import (
        AuthConfig,
        CacheConfig,
        GatewayConfig,
        HttpConfig,
        MetricsConfig,
        ServerConfig,
    )
    from appliance.engine.runner import EngineStats
    from appliance.security.tls import TlsSettings

T = TypeVar("T")

Message = str | Callable[[], str]


def byte_level_tokenizer(
    vocab: dict[str, int], added_tokens: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A tokenizer.json of a BPE vocabulary without merges, with Llama 3's byte-level
    pre-tokenizer and decoder: one a gateway loads and can stream (engine-build verifies that)."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    return {
        "version": "1.0",
        "added_tokens": added_tokens or [],
        "model": {"type": "BPE", "vocab": vocab, "merges": []},
        "pre_tokenizer": {**byte_level, "use_regex": True},
        "decoder": {**byte_level, "use_regex": True},
    }


def _fail(message: Message, timeout: float) -> NoReturn:
    text = message() if callable(message) else message
    pytest.fail(f"{text} (waited {timeout:g} s)")


def until(
    condition: Callable[[], T | None],
    message: Message = "condition not met in time",
    timeout: float = 30.0,
    interval: float = 0.02,
) -> T:
    """Calls `condition` until it returns a true value and returns that value; past `timeout`
    seconds the test fails with `message` (a callable is called then, to show the last state).

    Blocks the calling thread: from a coroutine, use :func:`until_async`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            _fail(message, timeout)
        time.sleep(interval)


@overload
async def until_async(
    condition: Callable[[], Awaitable[T | None]],
    message: Message = ...,
    timeout: float = ...,
    interval: float = ...,
) -> T: ...
@overload
async def until_async(
    condition: Callable[[], T | None],
    message: Message = ...,
    timeout: float = ...,
    interval: float = ...,
) -> T: ...
async def until_async(
    condition: Callable[[], Any],
    message: Message = "condition not met in time",
    timeout: float = 30.0,
    interval: float = 0.01,
) -> Any:
    """:func:`until` for a coroutine: `condition` may be a plain function or a coroutine function,
    and the event loop runs between the calls."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            _fail(message, timeout)
        await asyncio.sleep(interval)


async def until_engine(
    stats: EngineStats, predicate: Callable[[], bool], timeout: float = 30.0
) -> None:
    """Waits on the engine's own state (its condition variable, not a poll) for `predicate`."""

    def block() -> bool:
        with stats.changed:
            return stats.changed.wait_for(predicate, timeout=timeout)

    assert await asyncio.to_thread(block), "engine state did not change"


# The model fields every test gateway gets unless it says otherwise: room for long generations,
# and a short wait for the engine (it is already up, on loopback).
MODEL_DEFAULTS: dict[str, Any] = {"max_output_tokens": 2000, "ready_timeout_s": 5.0}


def gateway_config(
    tokenizer_dir: Path,
    backends: str | Mapping[str, str],
    *,
    per_model: Mapping[str, Mapping[str, Any]] | None = None,
    server: ServerConfig | None = None,
    cache: CacheConfig | None = None,
    http: HttpConfig | None = None,
    metrics: MetricsConfig | None = None,
    tls: TlsSettings | None = None,
    auth: AuthConfig | None = None,
    **model: Any,
) -> GatewayConfig:
    """A gateway on a free loopback port serving one model per backend: `backends` is the address
    of the one model "tiny", or model name -> address. `model`: ModelConfig fields every model
    gets (over :data:`MODEL_DEFAULTS`); `per_model`: fields of one model (over those)."""
    from appliance.config import (
        AuthConfig,
        CacheConfig,
        GatewayConfig,
        HttpConfig,
        MetricsConfig,
        ModelConfig,
        ServerConfig,
    )

    addresses = {"tiny": backends} if isinstance(backends, str) else dict(backends)
    models = {
        name: ModelConfig(
            name=name,
            backend=address,
            **{
                "tokenizer_dir": tokenizer_dir,
                **MODEL_DEFAULTS,
                **model,
                **(per_model or {}).get(name, {}),
            },
        )
        for name, address in addresses.items()
    }
    return GatewayConfig(
        server=server or ServerConfig(listen="127.0.0.1:0"),
        models=models,
        cache=cache or CacheConfig(),
        metrics=metrics or MetricsConfig(),
        http=http or HttpConfig(),
        tls=tls,
        auth=auth or AuthConfig(),
    )
