"""The numbers the cache's parts report, each declared with one line of help.

A part (a tier, the invalidation feed, the counters every tier shares) declares in a `series` class
attribute every number its `counters()` reports: CacheAdmin.Stats reports them under these names,
the metrics collector exports them with this help, and start-up refuses a part whose numbers and
declarations differ, so no number is dropped or exported without saying what it counts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

_KEY = re.compile(r"[a-z][a-z0-9_]{0,63}")
_METRIC = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


class CounterError(ValueError):
    """A declaration that cannot be used; the message is one line saying what to fix."""


@dataclass(frozen=True, slots=True)
class Series:
    """One number: its help line, whether it is a gauge (a level) rather than a counter (only
    grows), and its Prometheus name ("" → `appliance_cache_<name>`; a counter gets `_total` on the
    wire)."""

    help: str
    gauge: bool = False
    metric: str = ""


# Number name (its key in `counters()` and in CacheAdmin.Stats) → its help line, or a Series.
Described = Mapping[str, str | Series]


def described(owner: str, series: Described) -> dict[str, Series]:
    """The declared numbers with their Prometheus names filled in; CounterError for a name that
    is not one, or a number without its one line of help."""
    found: dict[str, Series] = {}
    for key, value in series.items():
        s = value if isinstance(value, Series) else Series(value)
        if not (isinstance(key, str) and _KEY.fullmatch(key)):
            raise CounterError(f"{owner}: counter {key!r} must be lowercase letters, digits and _")
        text = s.help.strip() if isinstance(s.help, str) else ""
        if not text or "\n" in text:
            raise CounterError(f"{owner}: counter {key!r} needs a description (one line of help)")
        metric = s.metric or f"appliance_cache_{key}"
        if not _METRIC.fullmatch(metric):
            raise CounterError(f"{owner}: counter {key!r}: {metric!r} is not a Prometheus name")
        found[key] = Series(text, s.gauge, metric)
    return found
