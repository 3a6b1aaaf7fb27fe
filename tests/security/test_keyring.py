"""The key ring and the keys file's limits, without a gateway: what a hostile token or a
hand-edited file does to them."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from appliance.gateway.errors import RequestError
from appliance.security.api_keys import KeyRing, KeysFileError, RateLimits, new_key, read_entries
from appliance.security.ratelimit import RateLimiter

PEPPER = b"p" * 32


def ring_with_key(tmp_path: Path) -> tuple[KeyRing, str]:
    token, entry = new_key(PEPPER, ["a"], ["generate"])
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"version": 1, "keys": [entry]}))
    return KeyRing(path, PEPPER, RateLimits()), token


def test_a_token_that_is_not_ascii_is_refused_not_an_error(tmp_path: Path) -> None:
    """aiohttp decodes header bytes that are not UTF-8 as lone surrogates, which no encoder
    takes: such a token is an unknown key, never an exception (HTTP 500)."""
    ring, token = ring_with_key(tmp_path)
    key_id = token[3:15]
    for secret in ("\udcff" * 43, "é" * 43, token[16:-1] + "\udc80"):
        assert ring.by_token(f"ak_{key_id}_{secret}") is None
    assert ring.by_token(token) is not None


@pytest.mark.parametrize(
    ("name", "value"), [("burst", 0.5), ("burst", 2.5), ("max_streams", 0.5), ("max_streams", 1.5)]
)
def test_a_burst_or_stream_count_that_is_not_a_whole_number_is_refused(
    tmp_path: Path, name: str, value: float
) -> None:
    """A burst under 1 never holds the one token a request takes (the key would be refused
    forever, told to retry); a fractional stream count is no count of streams."""
    _, entry = new_key(PEPPER, ["a"], ["generate"])
    entry[name] = value
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"version": 1, "keys": [entry]}))
    with pytest.raises(KeysFileError, match=f"'{name}' must be a whole number"):
        read_entries(path)


def test_a_rate_too_small_to_wait_for_is_refused_with_a_bounded_hint() -> None:
    """The keys file takes any rate above 0: one so small that the wait overflows a float must
    still be a RESOURCE_EXHAUSTED refusal (not an OverflowError: INTERNAL, HTTP 500)."""
    limiter = RateLimiter()
    limits = RateLimits(rate_per_s=5e-324)
    limiter.take("000000000001", limits)  # the burst
    with pytest.raises(RequestError) as refused:
        limiter.take("000000000001", limits)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.value.retry_after_ms is not None
    assert 0 < refused.value.retry_after_ms <= 86_400_000
