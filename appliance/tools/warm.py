"""`appliance cache warm`: puts the answers of likely questions into the cache through a gateway, so a
new host or a new engine build starts with them (the L2 tier is shared: one warm-up serves every
gateway on the same Redis).

Only deterministic requests are sent (temperature 0 unless a seed is given): a sampled answer is never
cached. Each question is first asked with cache_policy ONLY, which never reaches the engine: an answer
means it is cached already and is skipped, so an interrupted run is simply run again. A question not
cached is sent with cache_policy DEFAULT (a rebuilt engine has a new fingerprint, hence new keys:
nothing needs REFRESH) and a small TTFT budget, so the gateway's admission refuses it at once
(RESOURCE_EXHAUSTED) whenever a client's request is running or waiting; it is then sent again after
the `grpc-retry-pushback-ms` the gateway asked for. Client traffic always goes first.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf import json_format

from appliance.cliargs import INTERRUPTED_EXIT
from appliance.client import ClientCredentials, Metadata
from appliance.logline import escape
from appliance.textfile import TextFileError, numbered_lines, read_text
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc

# A prompts file larger than this is refused before anything is sent.
MAX_FILE_BYTES = 64 * 1024 * 1024
# Bounds of the wait after a refusal (the gateway's pushback, else the smallest).
BACKOFF_S = (0.05, 5.0)


class WarmInputError(Exception):
    """A prompts file that cannot be used; the message names the file and line."""


@dataclass
class Tally:
    total: int
    warmed: int = 0
    cached: int = 0  # cached before this run
    refused: int = 0  # times the gateway was busy with clients (each then retried)
    failed: int = 0

    @property
    def done(self) -> int:
        return self.warmed + self.cached + self.failed

    def line(self) -> str:
        return (
            f"{self.done}/{self.total}: {self.warmed} warmed, {self.cached} already cached,"
            f" {self.failed} failed, {self.refused} deferred to clients"
        )


def read_prompts(path: Path, model: str, max_tokens: int | None) -> list[pb.GenerateRequest]:
    """The requests of a prompts file: a JSON object a line (GenerateRequest fields, as in the
    proto's JSON form) or a plain prompt a line; blank lines are skipped."""
    try:
        text = read_text(path, MAX_FILE_BYTES)
    except TextFileError as exc:
        raise WarmInputError(f"{path}: {exc}") from None
    requests = []
    for number, line in numbered_lines(text):
        if not line.strip():
            continue
        try:
            requests.append(_request(line, model, max_tokens))
        except WarmInputError as exc:
            raise WarmInputError(f"{path}:{number}: {exc}") from None
    if not requests:
        raise WarmInputError(f"{path}: no prompts")
    return requests


def _request(line: str, model: str, max_tokens: int | None) -> pb.GenerateRequest:
    request = pb.GenerateRequest(model=model)
    if line.lstrip().startswith("{"):
        try:
            json_format.Parse(line, request)
        except (json_format.ParseError, json.JSONDecodeError) as exc:
            raise WarmInputError(f"not a GenerateRequest: {exc}") from None
        if request.cache_policy != pb.CACHE_POLICY_DEFAULT:
            raise WarmInputError("cache_policy is chosen by the warm-up; leave it out")
    else:
        request.prompt = line
    if not request.HasField("temperature"):
        request.temperature = 0.0
    if request.temperature > 0 and not request.HasField("seed"):
        raise WarmInputError(
            "a sampled request (temperature > 0, no seed) is never cached; use temperature 0"
        )
    if max_tokens is not None and not request.HasField("max_tokens"):
        request.max_tokens = max_tokens
    return request


def _pushback_s(exc: grpc.RpcError) -> float | None:
    """How long the gateway asked to wait before asking again, within BACKOFF_S; None when it
    did not ask (a RESOURCE_EXHAUSTED of gRPC's own, such as a message over the server's limit,
    which no retry gets past)."""
    for key, value in exc.trailing_metadata() or ():
        if key == "grpc-retry-pushback-ms":
            try:
                return min(max(int(value) / 1000, BACKOFF_S[0]), BACKOFF_S[1])
            except ValueError:
                return BACKOFF_S[0]
    return None


# Answers that every further question would get too.
UNUSABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
}


class GatewayUnusable(Exception):
    """The gateway cannot take warm-up requests now (down, draining, cache off)."""


def warm_one(
    stub: pb_grpc.InferenceStub,
    request: pb.GenerateRequest,
    ttft_budget_ms: int,
    timeout_s: float,
    tally: Tally,
    sleep: Callable[[float], None] = time.sleep,
    metadata: Metadata = (),
) -> str:
    """Asks the cache, then the engine when the gateway is free. Returns '' or why it failed."""
    probe = pb.GenerateRequest()
    probe.CopyFrom(request)
    probe.cache_policy = pb.CACHE_POLICY_ONLY
    failed = _complete_paced(stub, probe, timeout_s, metadata, tally, sleep)
    if failed is None:
        tally.cached += 1
        return ""
    if failed.code() == grpc.StatusCode.FAILED_PRECONDITION:
        raise GatewayUnusable(failed.details()) from None
    if failed.code() != grpc.StatusCode.NOT_FOUND:
        return _failure(failed)
    request.cache_policy = pb.CACHE_POLICY_DEFAULT
    request.ttft_budget_ms = ttft_budget_ms
    failed = _complete_paced(stub, request, timeout_s, metadata, tally, sleep)
    if failed is None:
        tally.warmed += 1
        return ""
    return _failure(failed)


def _complete_paced(
    stub: pb_grpc.InferenceStub,
    request: pb.GenerateRequest,
    timeout_s: float,
    metadata: Metadata,
    tally: Tally,
    sleep: Callable[[float], None],
) -> grpc.RpcError | None:
    """Asks `request` until it is answered (None) or refused for a reason other than the key's
    rate limit (that error): a refusal with the gateway's pushback is asked again after it."""
    while True:
        try:
            stub.Complete(request, timeout=timeout_s, metadata=metadata)
            return None
        except grpc.RpcError as exc:
            if (
                exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED
                or (wait_s := _pushback_s(exc)) is None
            ):
                return exc
            tally.refused += 1
            sleep(wait_s)


def _failure(exc: grpc.RpcError) -> str:
    """The reason of a failed question; GatewayUnusable when no other question can do better
    (the gateway is down, or refuses the API key)."""
    if exc.code() in UNUSABLE:
        hint = ""
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            hint = (
                " (the key, from --api-key-file or $APPLIANCE_API_KEY, needs the scopes generate "
                "and cache:read-only-policy)"
            )
        raise GatewayUnusable(f"{exc.code().name}: {exc.details()}{hint}")
    return f"{exc.code().name}: {exc.details()}"


def run_warm(
    gateway: str,
    requests: list[pb.GenerateRequest],
    ttft_budget_ms: int,
    timeout_s: float,
    credentials: ClientCredentials | None = None,
    progress_s: float = 1.0,
) -> int:
    """Warms every request in order; prints progress to stderr and a summary. Exit status: 0 all
    done, 1 some failed or the gateway became unusable, 130 interrupted (run again to go on)."""
    tally = Tally(len(requests))
    said = time.monotonic()
    status = 0
    tls = credentials.tls if credentials is not None else None
    metadata = credentials.metadata if credentials is not None else ()
    if tls is None:
        channel = grpc.insecure_channel(gateway)
    else:
        assert credentials is not None
        channel = grpc.secure_channel(gateway, tls, options=credentials.options)
    with channel:
        stub = pb_grpc.InferenceStub(channel)
        try:
            for number, request in enumerate(requests, start=1):
                why = warm_one(stub, request, ttft_budget_ms, timeout_s, tally, metadata=metadata)
                if why:
                    tally.failed += 1
                    status = 1
                    print(escape(f"appliance cache warm: prompt {number}: {why}"), file=sys.stderr)
                if time.monotonic() - said >= progress_s:
                    print(tally.line(), file=sys.stderr, flush=True)
                    said = time.monotonic()
        except GatewayUnusable as exc:
            print(
                escape(f"appliance cache warm: {gateway}: {exc}; run again to go on"),
                file=sys.stderr,
            )
            status = 1
        except KeyboardInterrupt:
            print("appliance cache warm: interrupted; run again to go on", file=sys.stderr)
            status = INTERRUPTED_EXIT
    print(tally.line())
    return status
