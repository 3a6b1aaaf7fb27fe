"""The bench's settings, checked before anything is sent: a wrong value is one `BenchInputError`
naming the option and what to write instead."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from appliance.cliargs import integer, number
from appliance.client import API_KEY_ENV, ClientCredentials, client_credentials
from appliance.grpc_limits import MAX_REQUEST_BYTES


class BenchInputError(Exception):
    """A command-line value or input file the bench cannot use (exit status 2)."""


PLAINTEXT = ClientCredentials(None, False, (), None)


@dataclass(frozen=True)
class Level:
    """One load level: a closed loop of `value` concurrent clients, or Poisson arrivals at `value`
    requests per second (open loop: arrivals do not wait for answers)."""

    mode: str  # "concurrency" | "rate"
    value: float

    @property
    def label(self) -> str:
        if self.mode == "concurrency":
            return f"concurrency {int(self.value)}"
        return f"rate {self.value:g}/s"

    @property
    def short(self) -> str:
        return f"c={int(self.value)}" if self.mode == "concurrency" else f"r={self.value:g}/s"


MAX_LENGTH = 1_000_000


@dataclass(frozen=True)
class Lengths:
    """A distribution of lengths (tokens): fixed, normal (mean, stddev) or uniform (low, high),
    always drawn as whole numbers from 1 to `most`."""

    kind: str  # "fixed" | "normal" | "uniform"
    a: float
    b: float = 0.0
    most: int = MAX_LENGTH

    def draw(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "normal":
            return min(self.most, max(1, round(float(rng.normal(self.a, self.b)))))
        return int(rng.integers(int(self.a), int(self.b), endpoint=True))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{int(self.a)}"
        if self.kind == "normal":
            return f"normal(mean {self.a:g}, stddev {self.b:g})"
        return f"uniform({int(self.a)}..{int(self.b)})"


LENGTH_FORMS = "N, normal:MEAN,STDDEV or uniform:LOW,HIGH"
CACHE_POLICIES = ("bypass", "default", "refresh")


def parse_lengths(option: str, text: str, most: int = MAX_LENGTH, why: str = "") -> Lengths:
    """Lengths from 1 to `most` (`why`: the reason for that bound, said when it is exceeded)."""
    kind, _, rest = text.partition(":")
    try:
        if not rest:
            n = int(text)
            if not 1 <= n <= most:
                raise ValueError
            return Lengths("fixed", n, most=most)
        a_text, _, b_text = rest.partition(",")
        if kind == "normal":
            mean, std = float(a_text), float(b_text)
            if not (1 <= mean <= most and 0 <= std <= MAX_LENGTH):
                raise ValueError
            return Lengths("normal", mean, std, most)
        if kind == "uniform":
            low, high = int(a_text), int(b_text)
            if not 1 <= low <= high <= most:
                raise ValueError
            return Lengths("uniform", low, high, most)
    except ValueError:
        pass
    raise BenchInputError(
        f"{option} {text!r}: expected {LENGTH_FORMS} with lengths from 1 to {most}{why} "
        "(and LOW <= HIGH)"
    )


def parse_levels(option: str, text: str) -> list[Level]:
    """A comma-separated list of positive concurrencies (whole numbers) or rates (per second)."""
    mode = option.removeprefix("--")
    levels = []
    for part in text.split(","):
        try:
            value = int(part) if mode == "concurrency" else float(part)
        except ValueError:
            value = 0
        if not (math.isfinite(value) and 0 < value <= 10_000):
            what = (
                "whole numbers from 1 to 10000"
                if mode == "concurrency"
                else "requests per second, > 0 and <= 10000"
            )
            raise BenchInputError(f"{option} {text!r}: expected a comma-separated list of {what}")
        levels.append(Level(mode, float(value)))
    return levels


def parse_address(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BenchInputError(f"--address {text!r}: expected HOST:PORT, e.g. 127.0.0.1:50051")
    return text


@dataclass(frozen=True)
class Target:
    """Where the bench sends requests, and how it connects and presents itself there."""

    address: str
    connect_timeout_s: float
    credentials: ClientCredentials = PLAINTEXT
    # Where the API key came from, as the operator gave it: "--api-key-file PATH" or
    # "$APPLIANCE_API_KEY" (None: no key).
    key_source: str | None = None

    @property
    def tls_mode(self) -> str:
        """How it connects: "none" (plaintext), "server" (TLS) or "mutual" (TLS with a client
        certificate)."""
        if self.credentials.tls is None:
            return "none"
        return "mutual" if self.credentials.mutual else "server"


def credentials(a: argparse.Namespace) -> ClientCredentials:
    """The API key and TLS options (`client.add_credential_options`), checked and read."""
    names = ("api_key_file", "ca_file", "cert_file", "key_file")
    files = {getattr(a, name): "--" + name.replace("_", "-") for name in names}
    try:
        return client_credentials(a)
    except OSError as exc:
        option = files.get(exc.filename, "")
        raise BenchInputError(f"{option} {exc.filename}: {exc.strerror or exc}".strip()) from None
    except ValueError as exc:
        raise BenchInputError(str(exc)) from None


@dataclass(frozen=True)
class Settings:
    target: Target
    model: str
    levels: list[Level]
    requests: int | None  # per level; None: run for `duration_s`
    duration_s: float | None
    warmup: int
    prompt_tokens: Lengths
    output_tokens: Lengths
    prompts_file: Path | None
    cache_policy: str
    temperature: float
    seed: int
    timeout_s: float
    out: Path | None
    max_in_flight: int = 1000  # open loop: outstanding requests at most
    # Requests in a row that got no message within timeout_s that end the run (0: never).
    stop_after_timeouts: int = 3


NUMBERS: dict[str, Callable[[str], float]] = {
    "requests": integer,
    "duration": number,
    "warmup": integer,
    "temperature": number,
    "seed": integer,
    "timeout": number,
    "connect_timeout": number,
    "max_in_flight": integer,
    "stop_after_timeouts": integer,
}


def _numbers(a: argparse.Namespace) -> argparse.Namespace:
    """The numeric options as numbers: the command line gives them as text, defaults as numbers
    (read here rather than by argparse, whose refusal prints the whole usage block)."""
    values = dict(vars(a))
    for name, parse in NUMBERS.items():
        text = values.get(name)
        if isinstance(text, str):
            try:
                values[name] = parse(text)
            except argparse.ArgumentTypeError as exc:
                raise BenchInputError(f"--{name.replace('_', '-')}: {exc}") from None
    return argparse.Namespace(**values)


def settings(a: argparse.Namespace) -> Settings:
    """Checks every option of `appliance bench` (see `command.add_arguments`); the first problem
    found is raised."""
    from appliance.loadgen.workload import MAX_SYNTHETIC_WORDS  # it imports this

    a = _numbers(a)
    if a.address is None:
        raise BenchInputError("--address: give the gateway's HOST:PORT, e.g. 127.0.0.1:50051")
    if a.model is None or not a.model.strip():
        raise BenchInputError("--model: give the model name the deployment serves")
    given = credentials(a)
    source = None
    if given.metadata:
        source = f"--api-key-file {a.api_key_file}" if a.api_key_file else f"${API_KEY_ENV}"
    target = Target(parse_address(a.address), a.connect_timeout, given, source)
    levels = []
    if a.concurrency is not None:
        levels += parse_levels("--concurrency", a.concurrency)
    if a.rate is not None:
        levels += parse_levels("--rate", a.rate)
    if not levels:
        levels = [Level("concurrency", 1)]
    requests, duration = a.requests, a.duration
    if requests is not None and duration is not None:
        raise BenchInputError("--requests and --duration: give one of them (per load level)")
    if requests is None and duration is None:
        requests = 20
    if requests is not None and not 1 <= requests <= 1_000_000:
        raise BenchInputError(f"--requests {requests}: expected 1 to 1000000 per level")
    if duration is not None and not (math.isfinite(duration) and 0 < duration <= 86_400):
        raise BenchInputError(f"--duration {duration}: expected seconds in (0, 86400]")
    if not 0 <= a.warmup <= 10_000:
        raise BenchInputError(f"--warmup {a.warmup}: expected 0 to 10000 requests")
    if a.prompts is not None and a.prompt_tokens is not None:
        raise BenchInputError(
            "--prompts and --prompt-tokens: the prompt file sets the prompts; give one of them"
        )
    for name, value in (("--timeout", a.timeout), ("--connect-timeout", a.connect_timeout)):
        if not (math.isfinite(value) and 0 < value <= 3600):
            raise BenchInputError(f"{name} {value}: expected seconds in (0, 3600]")
    if not (math.isfinite(a.temperature) and 0 <= a.temperature <= 100):
        raise BenchInputError(f"--temperature {a.temperature}: expected 0 (greedy) to 100")
    if a.cache_policy not in CACHE_POLICIES:
        raise BenchInputError(
            f"--cache-policy {a.cache_policy!r}: expected one of {', '.join(CACHE_POLICIES)}"
        )
    if not 1 <= a.max_in_flight <= 100_000:
        raise BenchInputError(
            f"--max-in-flight {a.max_in_flight}: expected 1 to 100000 outstanding requests"
        )
    if not 0 <= a.stop_after_timeouts <= 1_000_000:
        raise BenchInputError(
            f"--stop-after-timeouts {a.stop_after_timeouts}: expected 0 (never) to 1000000"
        )
    if not 0 <= a.seed < 2**63:
        raise BenchInputError(f"--seed {a.seed}: expected 0 to 2**63-1")
    return Settings(
        target=target,
        model=a.model,
        levels=levels,
        requests=requests,
        duration_s=duration,
        warmup=a.warmup,
        prompt_tokens=parse_lengths(
            "--prompt-tokens",
            a.prompt_tokens or "128",
            MAX_SYNTHETIC_WORDS,
            f" (the most words a request of {MAX_REQUEST_BYTES // 2**20} MiB carries)",
        ),
        output_tokens=parse_lengths("--output-tokens", a.output_tokens),
        prompts_file=Path(a.prompts) if a.prompts is not None else None,
        cache_policy=a.cache_policy,
        temperature=a.temperature,
        seed=a.seed,
        timeout_s=a.timeout,
        out=Path(a.out) if a.out is not None else None,
        max_in_flight=a.max_in_flight,
        stop_after_timeouts=a.stop_after_timeouts,
    )
