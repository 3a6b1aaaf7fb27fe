"""Facts + profile -> plan. Pure: no I/O, so every choice is unit-testable on fixture facts."""

from __future__ import annotations

from dataclasses import dataclass

from host_tuning.cores import CorePlan, choose
from host_tuning.facts.model import Facts
from host_tuning.items import Advice, Conflict, Item
from host_tuning.plugins.cmdline import conflicts
from host_tuning.profile import Profile
from host_tuning.registry import PLUGINS


@dataclass(frozen=True)
class TuningPlan:
    cores: CorePlan
    items: tuple[Item, ...]
    advice: tuple[Advice, ...]
    conflicts: tuple[Conflict, ...] = ()


def make_plan(facts: Facts, profile: Profile) -> TuningPlan:
    cores = choose(facts, profile)
    items: list[Item] = []
    advice: list[Advice] = []
    for plugin in PLUGINS:
        got_items, got_advice = plugin.plan(facts, profile, cores)
        items += got_items
        advice += got_advice
    keys = [i.key for i in items]
    if len(keys) != len(set(keys)):
        raise AssertionError("plan keys must be unique")  # a plugin bug, not an operator error
    return TuningPlan(cores, tuple(items), tuple(advice), tuple(conflicts(facts, profile, cores)))
