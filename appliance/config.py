"""The gateway's TOML configuration: one file, every key checked, errors that name the line and key.

The README's "Configuration" section documents each key; keep the two in step.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from appliance import tomlcheck
from appliance.backends import stream_socket
from appliance.backends.base import backend_kind
from appliance.cache.l2 import RedisSettings
from appliance.cache.tiers import CacheTier, tier_class
from appliance.grpc_limits import INT32_MAX
from appliance.listen import is_address, socket_path_problem
from appliance.security.api_keys import RateLimits
from appliance.security.secretfile import (
    MAC_PURPOSE,
    MAX_SECRET_BYTES,
    PEPPER_PURPOSE,
    SecretFileError,
    read_secret,
)
from appliance.security.tls import ServerTls, TlsError, TlsSettings
from appliance.textfile import TextFileError, read_text
from appliance.tomlcheck import Table


class ConfigError(tomlcheck.TomlError):
    """A configuration file that cannot be used; the message names the file, line and key."""


@dataclass(frozen=True)
class ServerConfig:
    listen: str = "127.0.0.1:50051"
    # Seconds in-flight requests get to finish after SIGTERM before they are cancelled.
    drain_seconds: float = 10.0
    log_level: str = "info"
    # "text": one escaped line a record; "json": one JSON object a line (for log shippers).
    log_format: str = "text"
    # One INFO line per finished request (logger appliance.access).
    access_log: bool = True
    # Plaintext on a non-loopback address (something else encrypts the traffic, a service mesh).
    allow_plaintext: bool = False
    # Connections to the gRPC port at once; one more is closed as it is accepted.
    max_connections: int = 4096
    # A gRPC connection with no call for this long is sent GOAWAY and closed (a channel connects
    # again for its next call); below a load balancer's idle timeout, the gateway closes first.
    idle_connection_s: float = 300.0
    # A Unix socket that serves the gRPC health service alone, without TLS or keys: local
    # checks (`appliance health --gateway unix:PATH`, the Ansible role) on a host whose public
    # port takes only TLS or mutual TLS. Who may connect is the socket file's permission (the
    # process umask). None: no such socket.
    health_socket: Path | None = None


@dataclass(frozen=True)
class AuthConfig:
    # The API keys (hashes only; `appliance keys add`). None: no authentication (loopback only).
    keys_file: Path | None = None
    # Key of the keys' hashes, from `pepper_file` (a systemd credential).
    pepper: bytes = field(default=b"", repr=False)
    # No keys file on a non-loopback address.
    allow_anonymous: bool = False
    # Rate limits of keys that set none of their own.
    limits: RateLimits = field(default_factory=lambda: RateLimits(100.0, 200, 32))


@dataclass(frozen=True)
class MetricsConfig:
    # HOST:PORT of the Prometheus /metrics listener; None: no listener.
    listen: str | None = None


@dataclass(frozen=True)
class HttpConfig:
    # HOST:PORT of the OpenAI-compatible HTTP API; None: no listener (the gRPC API only).
    listen: str | None = None
    # Largest request body; a larger one is refused with 413 before it is read.
    max_body_bytes: int = 4 * 1024 * 1024
    # A client that sends its body, or reads its stream, with no progress for this long is cut off;
    # a TLS handshake (HTTP and gRPC ports) that takes longer is dropped.
    client_timeout_s: float = 30.0
    # Connections held at once, idle keep-alive ones too (one more is answered 503 and closed):
    # far more than the engine answers at once, far fewer than the unit's LimitNOFILE (65536).
    max_connections: int = 4096


@dataclass(frozen=True)
class ModelConfig:
    name: str
    backend: str
    tokenizer_dir: Path
    # Which backend class talks to `backend`: a name of BACKEND_KINDS, or package.module:Class.
    backend_kind: str = "triton"
    triton_model: str = "tensorrt_llm"
    # The engine server's stream socket (`appliance engine --stream-socket`): generations go there
    # instead of over gRPC, which costs each message HTTP/2 and grpc.aio's call machinery at both
    # ends; readiness and configuration stay on gRPC at `backend`. Triton has none.
    stream_socket: Path | None = None
    # None: derived from the model's config.json (max_position_embeddings) at start-up.
    max_input_tokens: int | None = None
    max_output_tokens: int = 1024
    default_max_tokens: int = 256
    ready_timeout_s: float = 60.0
    # None: <tokenizer_dir>/../engine_fingerprint, the file `engine-build repo` writes.
    fingerprint_file: Path | None = None
    # Generations at the engine at once; None: the engine's max_batch_size (1 for a batch-1 engine).
    max_in_flight: int | None = None
    # Requests waiting for a slot at most; one more is refused at once (RESOURCE_EXHAUSTED).
    max_queue: int = 8
    # Time to first token a request accepts when it sets none; None: only its deadline bounds it.
    ttft_budget_ms: float | None = None
    # Deadline of a request whose client sets none: a hung engine never holds a client forever.
    default_deadline_s: float = 120.0
    # Another served model that answers while this one's breaker is open (one hop, never chained).
    fallback: str | None = None
    # Consecutive engine failures (errors, timeouts, TTFT over budget) that open the breaker, and
    # the seconds before a probe request is let through again.
    breaker_failures: int = 3
    breaker_reset_s: float = 5.0

    @property
    def fingerprint_path(self) -> Path:
        return self.fingerprint_file or self.tokenizer_dir.parent / "engine_fingerprint"


@dataclass(frozen=True)
class SemanticConfig:
    """`[cache.semantic]`: the semantic tier (off unless enabled, and only for listed namespaces)."""

    enabled: bool = False
    # Namespaces whose requests take part; "*" means every namespace.
    namespaces: tuple[str, ...] = ()
    # Whether a request that does not set semantic_cache asks the tier.
    request_default: bool = False
    embedder_dir: Path = Path("var/semantic")
    max_entries: int = 100_000
    max_bytes: int = 512 * 1024 * 1024
    ttl_s: float = 86400.0
    # Nearest entries the rule looks at per lookup.
    candidates: int = 4
    # Threads of one embedding (onnxruntime intra-op). One: a lookup comes after an idle gap, and
    # there a second thread made the lookup slower, not faster (it pays only when questions come
    # back to back; docs/PERFORMANCE.md#semantic-cache-tier); the core stays free for the loop.
    embed_threads: int = 1
    # Overrides of the shipped rule's cosine floor and classifier threshold (None: shipped).
    min_similarity: float | None = None
    min_score: float | None = None
    # Whether the lookup runs beside the engine's start (tokenizing, joining the single flight)
    # instead of before it; README's `[cache.semantic]` says what that trades.
    overlap_engine: bool = False
    # Longest a stream read blocks; lookups stop once the follower is this many times later.
    follow_block_ms: int = 500
    stream_max_len: int = 100_000


@dataclass(frozen=True)
class CacheConfig:
    enabled: bool = True
    l1_max_entries: int = 10000
    l1_max_bytes: int = 256 * 1024 * 1024
    l1_ttl_s: float = 300.0
    redis: RedisSettings | None = None
    semantic: SemanticConfig = field(default_factory=SemanticConfig)
    # The tiers in lookup order: built-in names (BUILTIN_TIERS) or package.module:Class; None:
    # the default order (see `order`).
    tiers: tuple[str, ...] | None = None

    @property
    def order(self) -> tuple[str, ...]:
        """The configured tiers, else l1, then l2 with [cache.redis], then semantic when enabled."""
        if self.tiers is not None:
            return self.tiers
        order = ["l1"]
        if self.redis is not None:
            order.append("l2")
        if self.semantic.enabled:
            order.append("semantic")
        return tuple(order)


@dataclass(frozen=True)
class GatewayConfig:
    server: ServerConfig
    models: dict[str, ModelConfig] = field(default_factory=dict)
    cache: CacheConfig = field(default_factory=CacheConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    # TLS of the public API; None: plaintext (loopback, or `allow_plaintext`).
    tls: TlsSettings | None = None
    auth: AuthConfig = field(default_factory=AuthConfig)


_LOG_LEVELS = ("debug", "info", "warning", "error")
_LOG_FORMATS = ("text", "json")


class _Reader(Table):
    """Pulls typed values out of one TOML table; refusals are ConfigError."""

    error = ConfigError


def is_loopback(listen: str) -> bool:
    """Whether HOST:PORT (or a unix: socket) is reachable from this host only."""
    if listen.startswith("unix:"):
        return True
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any address


def _address(reader: _Reader, key: str, default: str) -> str:
    value = str(reader.get(key, str, default))
    if not is_address(value):
        reader.fail(key, f"expected HOST:PORT, got {value!r}")
    return value


def load_config(path: Path) -> GatewayConfig:
    """Reads and validates the gateway configuration; raises ConfigError with file:line: key."""
    text, data = tomlcheck.read(path, "configuration", ConfigError)

    top = _Reader(
        path, text, "", data, {"server", "models", "cache", "metrics", "http", "tls", "auth"}
    )
    server_data = top.get("server", dict, {})
    srv = _Reader(
        path,
        text,
        "server",
        server_data,
        {
            "listen",
            "drain_seconds",
            "log_level",
            "log_format",
            "access_log",
            "allow_plaintext",
            "max_connections",
            "idle_connection_s",
            "health_socket",
        },
    )
    server = ServerConfig(
        listen=_address(srv, "listen", ServerConfig.listen),
        drain_seconds=srv.get("drain_seconds", float, ServerConfig.drain_seconds),
        log_level=srv.choice("log_level", _LOG_LEVELS, ServerConfig.log_level),
        log_format=srv.choice("log_format", _LOG_FORMATS, ServerConfig.log_format),
        access_log=srv.get("access_log", bool, True),
        allow_plaintext=srv.get("allow_plaintext", bool, False),
        max_connections=srv.positive("max_connections", int, ServerConfig.max_connections),
        idle_connection_s=srv.positive("idle_connection_s", float, ServerConfig.idle_connection_s),
        health_socket=_socket_path(srv, "health_socket", path.parent),
    )
    metrics_data = top.get("metrics", dict, {})
    met = _Reader(path, text, "metrics", metrics_data, {"listen"})
    metrics = MetricsConfig(
        listen=_address(met, "listen", "") if "listen" in metrics_data else None
    )
    if server.drain_seconds < 0:
        srv.fail("drain_seconds", "must be 0 or more")

    models_data = top.get("models", dict, {})
    if not models_data:
        top.fail("models", "at least one [models.NAME] table is required")
    models: dict[str, ModelConfig] = {}
    known = {f for f in ModelConfig.__dataclass_fields__ if f != "name"}
    for name, table in models_data.items():
        table_name = f"models.{name}"
        if not isinstance(table, dict):
            top.fail(table_name, "must be a table: [models.NAME]")
        r = _Reader(path, text, table_name, table, known)
        tokenizer_dir = Path(r.require("tokenizer_dir")).expanduser()
        if not tokenizer_dir.is_absolute():
            tokenizer_dir = path.parent / tokenizer_dir
        model = ModelConfig(
            name=name,
            backend=_address(r, "backend", "") if "backend" in table else r.require("backend"),
            tokenizer_dir=tokenizer_dir,
            backend_kind=_backend_kind(r),
            triton_model=r.get("triton_model", str, ModelConfig.triton_model),
            stream_socket=_stream_socket(r, path.parent),
            max_input_tokens=r.positive("max_input_tokens", int, None),
            # Sent to the engine as an int32 (and default_max_tokens is at most this).
            max_output_tokens=r.positive(
                "max_output_tokens", int, ModelConfig.max_output_tokens, at_most=INT32_MAX
            ),
            default_max_tokens=r.positive(
                "default_max_tokens", int, ModelConfig.default_max_tokens
            ),
            ready_timeout_s=r.positive("ready_timeout_s", float, ModelConfig.ready_timeout_s),
            fingerprint_file=r.file_path("fingerprint_file", path.parent),
            max_in_flight=_max_in_flight(r),
            max_queue=r.get("max_queue", int, ModelConfig.max_queue),
            ttft_budget_ms=r.positive("ttft_budget_ms", float, None),
            default_deadline_s=r.positive(
                "default_deadline_s", float, ModelConfig.default_deadline_s
            ),
            fallback=r.get("fallback", str, None),
            breaker_failures=r.positive("breaker_failures", int, ModelConfig.breaker_failures),
            breaker_reset_s=r.positive("breaker_reset_s", float, ModelConfig.breaker_reset_s),
        )
        if model.max_queue < 0:
            r.fail("max_queue", "must be 0 (no waiting: refuse when every slot is busy) or more")
        if model.default_max_tokens > model.max_output_tokens:
            r.fail(
                "default_max_tokens",
                f"{model.default_max_tokens} exceeds max_output_tokens {model.max_output_tokens}",
            )
        models[name] = model
    for name, model in models.items():
        if (model.fallback is not None and model.fallback not in models) or model.fallback == name:
            r = _Reader(path, text, f"models.{name}", models_data[name], known)
            others = ", ".join(sorted(set(models) - {name})) or "none"
            r.fail("fallback", f"must name another served model (configured: {others})")
    tls = _tls(top.sub("tls", {"cert_file", "key_file", "client_ca_file"}), path)
    auth = _auth(
        top.sub(
            "auth",
            {"keys_file", "pepper_file", "allow_anonymous", "rate_per_s", "burst", "max_streams"},
        ),
        path,
    )
    http_reader = top.sub(
        "http", {"listen", "max_body_bytes", "client_timeout_s", "max_connections"}
    )
    http = _http(http_reader)
    # Both public front ends: plaintext and anonymous use only on loopback, unless said so.
    for at, address in ((srv, server.listen), (http_reader, http.listen)):
        if address is None or is_loopback(address):
            continue
        if tls is None and not server.allow_plaintext:
            at.fail(
                "listen",
                f"{address} is not a loopback address, and plaintext would carry API keys "
                "and answers in the clear: add a [tls] table (cert_file, key_file), or set "
                "allow_plaintext = true when something else encrypts the traffic",
            )
        if auth.keys_file is None and not auth.allow_anonymous:
            at.fail(
                "listen",
                f"{address} is not a loopback address and anyone reaching it could use "
                "every tenant's cache: set [auth] keys_file (`appliance keys add`), or "
                "[auth] allow_anonymous = true",
            )
    return GatewayConfig(
        server=server,
        models=models,
        cache=_cache(top, path, text),
        metrics=metrics,
        http=http,
        tls=tls,
        auth=auth,
    )


# The largest request body the HTTP API may be set to take (held whole, and inflated whole).
MAX_BODY_BYTES_LIMIT = 1 << 30


def _max_in_flight(r: _Reader) -> int | None:
    value: int | None = r.positive("max_in_flight", int, None)
    if value is not None and value > stream_socket.GENERATIONS_MAX:
        r.fail("max_in_flight", f"must be at most {stream_socket.GENERATIONS_MAX}, got {value}")
    return value


def _http(r: _Reader) -> HttpConfig:
    max_body = r.size("max_body_bytes", HttpConfig.max_body_bytes)
    if not max_body or max_body > MAX_BODY_BYTES_LIMIT:
        r.fail("max_body_bytes", "must be greater than 0 and at most 1GiB")
    return HttpConfig(
        listen=_address(r, "listen", "") if "listen" in r.data else None,
        max_body_bytes=max_body,
        client_timeout_s=r.positive("client_timeout_s", float, HttpConfig.client_timeout_s),
        max_connections=r.positive("max_connections", int, HttpConfig.max_connections),
    )


def _tls(r: _Reader, path: Path) -> TlsSettings | None:
    if not r.data:
        return None
    cert = r.file_path("cert_file", path.parent) or Path(r.require("cert_file"))
    key = r.file_path("key_file", path.parent) or Path(r.require("key_file"))
    settings = TlsSettings(cert, key, r.file_path("client_ca_file", path.parent))
    try:
        ServerTls(settings)
    except TlsError as exc:
        r.fail(exc.setting, str(exc))
    return settings


def _auth(r: _Reader, path: Path) -> AuthConfig:
    keys_file = r.file_path("keys_file", path.parent)
    pepper = b""
    if keys_file is not None:
        pepper_file = r.file_path("pepper_file", path.parent)
        if pepper_file is None:
            r.fail("pepper_file", "required with keys_file: the secret the keys are hashed with")
        try:
            pepper = read_secret(pepper_file, PEPPER_PURPOSE)
        except SecretFileError as exc:
            r.fail("pepper_file", str(exc))
    elif "pepper_file" in r.data:
        r.fail("keys_file", "pepper_file is set but keys_file is not")
    d = AuthConfig().limits

    def limit(key: str, kind: type, default: float | int | None) -> float | int | None:
        value = r.get(key, kind, default)
        if value is not None and value < 0:
            r.fail(key, "must be 0 (unlimited) or more")
        return value or None

    burst = limit("burst", int, d.burst)
    return AuthConfig(
        keys_file=keys_file,
        pepper=pepper,
        allow_anonymous=r.get("allow_anonymous", bool, False),
        limits=RateLimits(
            rate_per_s=limit("rate_per_s", float, d.rate_per_s),
            burst=int(burst) if burst else None,
            max_streams=int(m) if (m := limit("max_streams", int, d.max_streams)) else None,
        ),
    )


def _stream_socket(r: _Reader, base: Path) -> Path | None:
    socket = _socket_path(r, "stream_socket", base)
    if socket is not None and r.data.get("backend_kind", "triton") != "triton":
        r.fail("stream_socket", 'needs backend_kind = "triton" (the engine server is one)')
    return socket


def _socket_path(r: _Reader, key: str, base: Path) -> Path | None:
    socket = r.file_path(key, base)
    if socket is not None and (problem := socket_path_problem(socket)) is not None:
        r.fail(key, problem)
    return socket


def _backend_kind(r: _Reader) -> str:
    kind = r.get("backend_kind", str, ModelConfig.backend_kind)
    try:
        backend_kind(kind)
    except ValueError as exc:
        r.fail("backend_kind", str(exc))
    return str(kind)


def _tiers(
    r: _Reader, redis: RedisSettings | None, semantic: SemanticConfig
) -> tuple[str, ...] | None:
    """The configured tiers, checked: each resolves to a CacheTier with its counters described,
    no tier twice, and the built-in ones agree with the tables that configure them."""
    if "tiers" not in r.data:
        return None
    specs = r.str_list("tiers")
    if not specs:
        r.fail("tiers", "list at least one tier (or set enabled = false)")
    classes: list[type[CacheTier]] = []
    for spec in specs:
        if specs.count(spec) > 1:
            r.fail("tiers", f"{spec!r} is listed twice")
        try:
            cls = tier_class(spec)
        except ValueError as exc:
            r.fail("tiers", str(exc))
        if any(other.name == cls.name for other in classes):
            r.fail("tiers", f"two tiers are named {cls.name!r} ({spec!r}): names must differ")
        classes.append(cls)

    def position(builtin: str) -> int | None:
        kind = tier_class(builtin) if any(c.name == builtin for c in classes) else None
        return next((i for i, c in enumerate(classes) if kind and issubclass(c, kind)), None)

    l2, sem = position("l2"), position("semantic")
    if l2 is not None and redis is None:
        r.fail("tiers", "'l2' needs a [cache.redis] table")
    if l2 is None and redis is not None:
        r.fail("tiers", "[cache.redis] is set but 'l2' is not listed: add it, or remove the table")
    if (sem is not None) != semantic.enabled:
        r.fail(
            "tiers",
            "'semantic' is listed but [cache.semantic] is not enabled"
            if sem is not None
            else "[cache.semantic] is enabled but 'semantic' is not listed",
        )
    if sem is not None and l2 is not None and sem < l2:
        r.fail("tiers", "'semantic' shares its entries through 'l2': list it after 'l2'")
    return specs


def _cache(top: _Reader, path: Path, text: str) -> CacheConfig:
    data = top.get("cache", dict, {})
    known = {"enabled", "l1_max_entries", "l1_max_bytes", "l1_ttl_s", "redis", "semantic", "tiers"}
    r = _Reader(path, text, "cache", data, known)
    redis_data = r.get("redis", dict, None)
    redis = None
    if redis_data is not None:
        redis = _redis(_Reader(path, text, "cache.redis", redis_data, _REDIS_KEYS), path)
    l1_entries = r.get("l1_max_entries", int, CacheConfig.l1_max_entries)
    if l1_entries < 0:
        r.fail("l1_max_entries", "must be 0 (L1 off) or more")
    semantic = _semantic(r.sub("semantic", _SEMANTIC_KEYS), path)
    return CacheConfig(
        enabled=r.get("enabled", bool, True),
        l1_max_entries=l1_entries,
        l1_max_bytes=r.positive("l1_max_bytes", int, CacheConfig.l1_max_bytes),
        l1_ttl_s=r.positive("l1_ttl_s", float, CacheConfig.l1_ttl_s),
        redis=redis,
        semantic=semantic,
        tiers=_tiers(r, redis, semantic),
    )


_SEMANTIC_KEYS = {
    "enabled",
    "namespaces",
    "request_default",
    "embedder_dir",
    "max_entries",
    "max_bytes",
    "ttl_s",
    "candidates",
    "embed_threads",
    "min_similarity",
    "min_score",
    "overlap_engine",
}


def _semantic(r: _Reader, path: Path) -> SemanticConfig:
    d = SemanticConfig()
    config = SemanticConfig(
        enabled=r.get("enabled", bool, d.enabled),
        namespaces=r.str_list("namespaces", d.namespaces),
        request_default=r.get("request_default", bool, d.request_default),
        embedder_dir=r.file_path("embedder_dir", path.parent) or d.embedder_dir,
        max_entries=r.positive("max_entries", int, d.max_entries),
        max_bytes=r.size("max_bytes", d.max_bytes) or d.max_bytes,
        ttl_s=r.positive("ttl_s", float, d.ttl_s),
        candidates=r.positive("candidates", int, d.candidates),
        embed_threads=r.positive("embed_threads", int, d.embed_threads),
        min_similarity=r.get("min_similarity", float, None),
        min_score=r.get("min_score", float, None),
        overlap_engine=r.get("overlap_engine", bool, d.overlap_engine),
    )
    for key in ("min_similarity", "min_score"):
        value = getattr(config, key)
        if value is not None and not 0.0 < value <= 1.0:
            r.fail(key, f"must be in (0, 1], got {value!r}")
    if config.enabled and not config.namespaces:
        r.fail("namespaces", 'list the namespaces that use the tier ("*" for all)')
    return config


_REDIS_KEYS = {
    "url",
    "username",
    "password_file",
    "tls_ca_file",
    "key_prefix",
    "ttl_s",
    "timeout_ms",
    "max_connections",
    "breaker_failures",
    "breaker_reset_s",
    "mac_key_file",
    "sentinels",
    "sentinel_service",
    "sentinel_username",
    "sentinel_password_file",
}


def _password(r: _Reader, key: str, base: Path) -> str | None:
    """The password in the file `key` names (surrounding whitespace dropped); None without one."""
    path = r.file_path(key, base)
    if path is None:
        return None
    try:
        password = read_text(path, MAX_SECRET_BYTES).strip()
    except TextFileError as exc:
        r.fail(key, f"cannot read {path}: {exc}")
    if not password:
        r.fail(key, f"{path} is empty: it must hold the password")
    return password


def _sentinels(r: _Reader) -> tuple[str, ...]:
    addresses = r.get("sentinels", list, [])
    for address in addresses:
        if not is_address(address):
            r.fail("sentinels", f"expected a list of HOST:PORT strings, got {address!r}")
    return tuple(addresses)


def _redis(r: _Reader, path: Path) -> RedisSettings:
    d = RedisSettings()
    url = r.get("url", str, d.url)
    if not url.startswith(("redis://", "rediss://", "unix://")):
        r.fail("url", f"expected redis://, rediss:// (TLS) or unix:// URL, got {url!r}")
    password = _password(r, "password_file", path.parent)
    ca = r.file_path("tls_ca_file", path.parent)
    if ca is not None and not ca.is_file():
        r.fail("tls_ca_file", f"{ca} not found")
    mac_file = r.file_path("mac_key_file", path.parent)
    if mac_file is None:
        r.fail(
            None,
            "missing required key 'mac_key_file': the secret every gateway on this Redis shares "
            "to authenticate entries (`appliance keys secret FILE` writes one)",
        )
    try:
        mac_key = read_secret(mac_file, MAC_PURPOSE)
    except SecretFileError as exc:
        r.fail("mac_key_file", str(exc))
    prefix = r.get("key_prefix", str, d.key_prefix)
    if not prefix or ":" in prefix:
        r.fail("key_prefix", "must be non-empty and contain no ':'")
    return RedisSettings(
        url=url,
        username=r.get("username", str, None),
        password=password,
        tls_ca_file=str(ca) if ca else None,
        key_prefix=prefix,
        ttl_s=r.positive("ttl_s", int, d.ttl_s),
        timeout_ms=r.positive("timeout_ms", float, d.timeout_ms),
        max_connections=r.positive("max_connections", int, d.max_connections),
        breaker_failures=r.positive("breaker_failures", int, d.breaker_failures),
        breaker_reset_s=r.positive("breaker_reset_s", float, d.breaker_reset_s),
        mac_key=mac_key,
        sentinels=_sentinels(r),
        sentinel_service=r.get("sentinel_service", str, d.sentinel_service)
        or r.fail("sentinel_service", "must be the non-empty name the Sentinels monitor"),
        sentinel_username=r.get("sentinel_username", str, None) or None,
        sentinel_password=_password(r, "sentinel_password_file", path.parent),
    )
