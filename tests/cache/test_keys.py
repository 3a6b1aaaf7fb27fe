"""The cache key: stable for the same request, different whenever anything output-changing differs."""

from __future__ import annotations

import dataclasses

import pytest

from appliance.cache.keys import ModelIdentity, SamplingKey, cache_key, is_deterministic

MODEL = ModelIdentity("tiny", "engine-fp-1", "tok-fp-1", "tpl-1")
GREEDY = SamplingKey(64, True, 1.0, 1.0, 1, None, ("\n\n",))
SEEDED = SamplingKey(64, False, 0.7, 0.9, 40, 7, ())


def key(
    namespace: str = "default",
    model: ModelIdentity = MODEL,
    prompt: str | None = "def f(x):\n    return x",
    messages: tuple[tuple[str, str], ...] = (),
    sampling: SamplingKey = GREEDY,
) -> bytes:
    return cache_key(namespace, model, prompt, messages, sampling)


# key() with the fields above, as computed by the key schema 1 encoding (README: the key).
KNOWN_DIGEST = "b6071f96ccf7dced78471c24edd78d31"


def test_stable() -> None:
    """The key is a documented function of its fields, the same in every process and release: a
    changed digest would orphan every entry in a shared Redis (bump KEY_SCHEMA instead)."""
    assert len(key()) == 16
    assert key().hex() == KNOWN_DIGEST


@pytest.mark.parametrize(
    "change",
    [
        {"namespace": "tenant-b"},
        {"model": dataclasses.replace(MODEL, name="other")},
        {"model": dataclasses.replace(MODEL, engine_fingerprint="engine-fp-2")},
        {"model": dataclasses.replace(MODEL, tokenizer_fingerprint="tok-fp-2")},
        {"model": dataclasses.replace(MODEL, template_version="tpl-2")},
        {"prompt": "def f(x):\n  return x"},  # whitespace inside content is significant
        {"prompt": "DEF f(x):\n    return x"},  # so is case
        {"prompt": None, "messages": (("user", "def f(x):\n    return x"),)},
        {"sampling": dataclasses.replace(GREEDY, max_tokens=65)},
        {"sampling": dataclasses.replace(GREEDY, stops=("\n",))},
        {"sampling": SEEDED},
        {"sampling": dataclasses.replace(GREEDY, min_tokens=8)},
        {"sampling": dataclasses.replace(GREEDY, ignore_eos=True)},
    ],
)
def test_every_field_changes_the_key(change: dict[str, object]) -> None:
    assert key(**change) != key()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change",
    [
        {"temperature": 0.8},
        {"top_p": 0.5},
        {"top_k": 10},
        {"seed": 8},
    ],
)
def test_every_sampling_field_of_a_seeded_request_changes_the_key(
    change: dict[str, object],
) -> None:
    assert key(sampling=dataclasses.replace(SEEDED, **change)) != key(sampling=SEEDED)  # type: ignore[arg-type]


def test_greedy_ignores_what_cannot_change_a_greedy_answer() -> None:
    other = dataclasses.replace(GREEDY, temperature=0.3, top_p=0.2, seed=99)
    assert key(sampling=other) == key()


def test_stop_list_is_a_set() -> None:
    a = dataclasses.replace(GREEDY, stops=("b", "a", "a"))
    b = dataclasses.replace(GREEDY, stops=("a", "b"))
    assert key(sampling=a) == key(sampling=b)


def test_message_order_and_roles_matter() -> None:
    one = (("user", "a"), ("assistant", "b"), ("user", "c"))
    assert key(prompt=None, messages=one) != key(prompt=None, messages=tuple(reversed(one)))
    swapped = (("system", "a"), ("assistant", "b"), ("user", "c"))
    assert key(prompt=None, messages=one) != key(prompt=None, messages=swapped)


def test_field_boundaries_cannot_collide() -> None:
    assert key(prompt=None, messages=(("user", "ab"),)) != key(
        prompt=None, messages=(("user", "a"), ("b", ""))
    )
    assert key(namespace="a:b") != key(
        namespace="a", model=dataclasses.replace(MODEL, name="b:tiny")
    )


def test_only_deterministic_requests_are_cacheable() -> None:
    assert is_deterministic(GREEDY)
    assert is_deterministic(SEEDED)
    assert not is_deterministic(dataclasses.replace(SEEDED, seed=None))


def test_min_tokens_and_ignore_eos_keep_their_own_keys() -> None:
    """Neither is folded into another field: each combination is its own answer."""
    keys = {
        key(sampling=dataclasses.replace(GREEDY, min_tokens=m, ignore_eos=e))
        for m in (0, 1, 8)
        for e in (False, True)
    }
    assert len(keys) == 6
