"""A small Python client of the public API that also measures what a client sees.

Timings follow genai-perf: TTFT = first non-empty response − request sent;
inter-token latency = (request latency − TTFT) / (output tokens − 1).

A fleet of gateways is one channel (`connect_fleet`): gRPC balances requests round-robin over every
gateway whose `appliance.v1.Inference` health is SERVING, from the service config in
appliance/data/fleet-service-config.json (any gRPC client can use the same file), so a draining,
dead or unready host receives no new request.

The client commands (`appliance cache`, `appliance bench`) take the same credentials the same way:
the API key from `--api-key-file` or $APPLIANCE_API_KEY, never the command line (which `ps` shows);
TLS with `--ca-file`, mutual TLS with `--cert-file` and `--key-file` (`api_key_metadata`,
`channel_credentials`).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources

import grpc

from appliance.security.api_keys import parse_token
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
    stub: pb_grpc.InferenceStub,
    request: pb.GenerateRequest,
    timeout: float | None = 60.0,
    metadata: Metadata = (),
    result: StreamResult | None = None,
) -> StreamResult:
    """Streams one request to completion and measures it, into `result` when given (what it
    holds tells how far a failed stream got)."""
    result = StreamResult() if result is None else result
    parts: list[str] = []
    sent = time.perf_counter()
    last = 0.0
    async for message in stub.Generate(request, timeout=timeout, metadata=metadata):
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


Metadata = tuple[tuple[str, str], ...]
API_KEY_ENV = "APPLIANCE_API_KEY"
MAX_KEY_FILE_BYTES = 1024  # a key and whitespace around it; the gateway reads 128 characters
MAX_PEM_BYTES = 4 * 2**20  # a CA bundle, a certificate chain or a private key


def add_credential_options(p: argparse.ArgumentParser, key: str) -> None:
    """The options of a client command's credentials (see `client_credentials`); `key` says what
    the API key is for."""
    p.add_argument("--api-key-file", help=f"file holding {key} ($APPLIANCE_API_KEY)")
    add_tls_options(p)


def add_tls_options(p: argparse.ArgumentParser) -> None:
    """The TLS options of `add_credential_options`, for a command that presents no API key
    (`client_credentials` with `with_key` False)."""
    p.add_argument("--ca-file", help="CA bundle of the gateway's certificate: connect with TLS")
    p.add_argument("--cert-file", help="client certificate (mutual TLS)")
    p.add_argument("--key-file", help="client certificate's private key (mutual TLS)")
    p.add_argument("--server-name", help="name to verify in the gateway's certificate")


@dataclass(frozen=True)
class ClientCredentials:
    """How a client command connects and presents itself to a gateway."""

    tls: grpc.ChannelCredentials | None  # None: plaintext
    mutual: bool  # a client certificate is presented
    options: tuple[tuple[str, str], ...]  # the channel's options (the server name to verify)
    key_id: str | None  # the API key's id (ak_ID_...; not secret), None without a key
    metadata: Metadata = field(default=(), repr=False)  # presents the key with every call


def client_credentials(args: argparse.Namespace, with_key: bool = True) -> ClientCredentials:
    """The credentials of `add_credential_options`' options (`add_tls_options`' without
    `with_key`: no key is read). The key comes from --api-key-file, else $APPLIANCE_API_KEY,
    never the command line (which `ps` shows). The files are checked first (gRPC would take any
    bytes and fail each connection with its own log lines): OSError for a file that cannot be
    read; ValueError naming the option for one that holds no key, CA bundle or certificate and
    key, and for TLS options without --ca-file. No message holds the key."""
    key = _api_key(args.api_key_file) if with_key else ""
    parsed = parse_token(key)
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    key_id = parsed[0] if parsed else None
    if not args.ca_file:
        given = [o for o in ("cert_file", "key_file", "server_name") if getattr(args, o)]
        if given:
            option = "--" + given[0].replace("_", "-")
            raise ValueError(f"{option}: a TLS option; give --ca-file too (connect with TLS)")
        return ClientCredentials(None, False, (), key_id, metadata)
    # Read first: an OSError of open() names its file (ssl's do not).
    ca = _bounded("--ca-file", args.ca_file)
    private_key = _bounded("--key-file", args.key_file) if args.key_file else None
    cert = _bounded("--cert-file", args.cert_file) if args.cert_file else None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=args.ca_file)
    except ssl.SSLError:
        raise ValueError(f"--ca-file {args.ca_file}: holds no PEM certificate") from None
    if bool(args.cert_file) != bool(args.key_file):
        raise ValueError("--cert-file and --key-file go together (mutual TLS)")
    if args.cert_file:
        try:
            context.load_cert_chain(args.cert_file, args.key_file)
        except ssl.SSLError:
            raise ValueError(
                f"--cert-file {args.cert_file} and --key-file {args.key_file}: not a PEM "
                "certificate and its private key"
            ) from None
    tls = grpc.ssl_channel_credentials(ca, private_key, cert)
    options = (("grpc.ssl_target_name_override", args.server_name),) if args.server_name else ()
    return ClientCredentials(tls, bool(args.cert_file), options, key_id, metadata)


def _bounded(option: str, path: str, limit: int = MAX_PEM_BYTES) -> bytes:
    """The file's bytes, read at most `limit` + 1 of them (a wrong path costs a bounded read)."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{option} {path}: more than {limit:,} bytes; not what {option} takes")
    return data


def _api_key(api_key_file: str | None) -> str:
    """The key in `api_key_file`, else $APPLIANCE_API_KEY's, else "" (none); ValueError, naming
    where it came from, for one that is not a key."""
    if api_key_file:
        where = f"--api-key-file {api_key_file}"
        try:
            key = _bounded("", api_key_file, MAX_KEY_FILE_BYTES).decode("ascii").strip()
        except (ValueError, UnicodeDecodeError):  # too long, or not text: not a key
            key = ""
    else:
        where = f"${API_KEY_ENV}"
        key = os.environ.get(API_KEY_ENV, "").strip()
        if not key:
            return ""
    if parse_token(key) is None or not key.isprintable() or " " in key:
        raise ValueError(f"{where}: not an API key")
    return key


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
