"""A small Python client of the public API that also measures what a client sees.

Timings follow genai-perf: TTFT = first non-empty response − request sent;
inter-token latency = (request latency − TTFT) / (output tokens − 1).

A fleet of gateways is one channel (`connect_fleet`): gRPC balances requests round-robin over every
gateway whose `appliance.v1.Inference` health is SERVING, from the service config in
appliance/data/fleet-service-config.json (any gRPC client can use the same file), so a draining,
dead or unready host receives no new request.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources

import grpc

from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc


@dataclass
class StreamResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    final: pb.Final = field(default_factory=pb.Final)
    request_id: str = ""
    messages: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    # Gap before every message after the first non-empty one (vLLM's ITL samples).
    gaps_s: list[float] = field(default_factory=list)

    @property
    def inter_token_s(self) -> float:
        itl = inter_token_latency(self.latency_s, self.ttft_s, len(self.token_ids))
        return 0.0 if itl is None else itl


def inter_token_latency(latency_s: float, ttft_s: float, tokens: int) -> float | None:
    """genai-perf's inter-token latency of one answer; None when it has fewer than two tokens."""
    return (latency_s - ttft_s) / (tokens - 1) if tokens > 1 else None


async def generate(
    stub: pb_grpc.InferenceStub, request: pb.GenerateRequest, timeout: float | None = 60.0
) -> StreamResult:
    """Streams one request to completion and measures it."""
    result = StreamResult()
    parts: list[str] = []
    sent = time.perf_counter()
    last = 0.0
    async for message in stub.Generate(request, timeout=timeout):
        now = time.perf_counter()
        result.messages += 1
        result.request_id = message.request_id
        if message.text or message.token_ids:
            if not result.ttft_s:
                result.ttft_s = now - sent
            else:
                result.gaps_s.append(now - last)
            last = now
        parts.append(message.text)
        result.token_ids.extend(message.token_ids)
        if message.HasField("final"):
            result.final = message.final
    result.latency_s = time.perf_counter() - sent
    result.text = "".join(parts)
    return result


def connect(address: str) -> tuple[grpc.aio.Channel, pb_grpc.InferenceStub]:
    channel = grpc.aio.insecure_channel(address)
    return channel, pb_grpc.InferenceStub(channel)


def fleet_service_config() -> str:
    """The service config (JSON) of a channel to a fleet: round_robin over the gateways whose
    health is SERVING, waiting for one to be ready, a retry on UNAVAILABLE."""
    return (resources.files("appliance") / "data" / "fleet-service-config.json").read_text()


# A gateway back from a restart is used again within this long (gRPC's default backoff grows to
# 120 s, which would leave a restarted host idle long after it is serving).
RECONNECT_BACKOFF_MS = (200, 2000)


def fleet_target(addresses: str | Sequence[str]) -> str:
    """A gRPC target naming every gateway: a `dns:///NAME:PORT` target (every A/AAAA record is a
    gateway) is kept; a list of HOST:PORT becomes `ipv4:` or `ipv6:` addresses (names resolved
    once, now). ValueError says what is wrong."""
    if isinstance(addresses, str):
        if addresses.startswith("dns:"):
            return addresses
        addresses = [a for a in addresses.split(",") if a]
    if not addresses:
        raise ValueError("no gateway address given")
    v4: list[str] = []
    v6: list[str] = []
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"gateway address {address!r}: expected HOST:PORT")
        host = host.strip("[]")
        try:
            ips = [ipaddress.ip_address(host)]
        except ValueError:
            try:
                infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                raise ValueError(f"gateway address {address!r}: {exc.strerror}") from None
            ips = list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))
        for ip in ips:
            (v4 if ip.version == 4 else v6).append(
                f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}"
            )
    if v4 and v6:
        raise ValueError("gateway addresses mix IPv4 and IPv6; use one family or a dns:/// target")
    return f"ipv4:{','.join(v4)}" if v4 else f"ipv6:{','.join(v6)}"


def connect_fleet(
    addresses: str | Sequence[str],
) -> tuple[grpc.aio.Channel, pb_grpc.InferenceStub]:
    """One channel to every gateway of a fleet (see fleet_target), balancing on health."""
    options = [
        ("grpc.service_config", fleet_service_config()),
        ("grpc.enable_retries", 1),
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
        ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
    ]
    channel = grpc.aio.insecure_channel(fleet_target(addresses), options=options)
    return channel, pb_grpc.InferenceStub(channel)
