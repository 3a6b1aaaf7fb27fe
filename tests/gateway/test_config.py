from __future__ import annotations

from pathlib import Path

import pytest

from appliance.config import ConfigError, load_config

GOOD = """
[server]
listen = "127.0.0.1:50051"
drain_seconds = 3

[models.tiny]
backend = "127.0.0.1:8001"
tokenizer_dir = "tok"
max_output_tokens = 256
default_max_tokens = 32
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    return path


def test_good_config_loads_with_defaults_and_relative_paths(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, GOOD))
    model = config.models["tiny"]
    assert config.server.drain_seconds == 3.0
    assert model.tokenizer_dir == tmp_path / "tok"
    assert model.triton_model == "tensorrt_llm"
    assert model.max_input_tokens is None
    assert (model.max_output_tokens, model.default_max_tokens) == (256, 32)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            GOOD.replace("max_output_tokens = 256", "max_output_tokens = -3"),
            r":9: key 'models.tiny.max_output_tokens': must be greater than 0, got -3",
        ),
        # max_tokens is an int32 on the wire to the engine: a larger default could never be sent.
        (
            GOOD.replace("max_output_tokens = 256", "max_output_tokens = 2147483648"),
            r":9: key 'models.tiny.max_output_tokens': must be at most 2147483647, got 2147483648",
        ),
        (
            GOOD.replace("max_output_tokens = 256", 'max_output_tokens = "many"'),
            r":9: key 'models.tiny.max_output_tokens': expected int, got str",
        ),
        (
            GOOD.replace("drain_seconds = 3", "drain_secs = 3"),
            r":4: key 'server.drain_secs': unknown key; known keys are access_log, allow_plaintext, drain_seconds, health_socket, idle_connection_s, listen, log_format, log_level, max_connections",
        ),
        (
            GOOD.replace('backend = "127.0.0.1:8001"', 'backend = "localhost"'),
            r":7: key 'models.tiny.backend': expected HOST:PORT, got 'localhost'",
        ),
        (
            GOOD.replace('tokenizer_dir = "tok"\n', ""),
            r":6: key 'models.tiny': missing required key 'tokenizer_dir'",
        ),
        (
            GOOD.replace("default_max_tokens = 32", "default_max_tokens = 999"),
            r":10: key 'models.tiny.default_max_tokens': 999 exceeds max_output_tokens 256",
        ),
        ('[server]\nlisten = "127.0.0.1:1"\n', r"key 'models': at least one \[models.NAME\]"),
        # TOML has nan and inf: a duration that is not a number is refused at load.
        (
            GOOD.replace("drain_seconds = 3", "drain_seconds = nan"),
            r":4: key 'server.drain_seconds': expected a finite number, got nan",
        ),
        (
            GOOD.replace("drain_seconds = 3", "drain_seconds = inf"),
            r":4: key 'server.drain_seconds': expected a finite number, got inf",
        ),
        (
            GOOD.replace(
                "max_output_tokens = 256", "max_output_tokens = 256\nready_timeout_s = -nan"
            ),
            r":10: key 'models.tiny.ready_timeout_s': expected a finite number, got nan",
        ),
        (
            GOOD.replace("drain_seconds = 3", "drain_seconds = 1" + "0" * 400),
            r":4: key 'server.drain_seconds': expected a finite number, got inf",
        ),
        (
            GOOD.replace(
                "max_output_tokens = 256", "max_output_tokens = 256\nmax_in_flight = 2000"
            ),
            r":10: key 'models.tiny.max_in_flight': must be at most 1024, got 2000",
        ),
        (
            GOOD.replace('backend = "127.0.0.1:8001"', 'backend = "127.0.0.1:\u00b2"'),
            r":7: key 'models.tiny.backend': expected HOST:PORT",
        ),
        (
            GOOD.replace("drain_seconds = 3", "drain_secs = 3\nlisen = 1"),
            r"key 'server.drain_secs': unknown key \(also unknown: lisen\); known keys are",
        ),
        ("[server\nlisten = 1\n", r"not valid TOML: .*line 1"),
    ],
)
def test_bad_config_names_line_and_key(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(_write(tmp_path, text))


def test_missing_file_is_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read configuration: No such file"):
        load_config(tmp_path / "absent.toml")


def test_latency_keys_load(tmp_path: Path) -> None:
    text = GOOD + (
        'max_in_flight = 2\nmax_queue = 0\nttft_budget_ms = 250\nfallback = "small"\n'
        '[models.small]\nbackend = "127.0.0.1:8002"\ntokenizer_dir = "tok"\n'
    )
    model = load_config(_write(tmp_path, text)).models["tiny"]
    assert (model.max_in_flight, model.max_queue, model.ttft_budget_ms) == (2, 0, 250.0)
    assert model.fallback == "small" and model.default_deadline_s == 120.0


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ('fallback = "nope"', "key 'models.tiny.fallback': must name another served model"),
        ('fallback = "tiny"', "must name another served model (configured: none)"),
        ("max_queue = -1", "key 'models.tiny.max_queue': must be 0"),
        ("ttft_budget_ms = 0", "key 'models.tiny.ttft_budget_ms'"),
        ("default_deadline_s = -3", "key 'models.tiny.default_deadline_s'"),
    ],
)
def test_latency_keys_are_checked(tmp_path: Path, extra: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        load_config(_write(tmp_path, GOOD + extra + "\n"))


def test_grpc_connection_bounds_load_and_are_checked(tmp_path: Path) -> None:
    server = load_config(_write(tmp_path, GOOD)).server
    assert (server.max_connections, server.idle_connection_s) == (4096, 300.0)
    text = GOOD.replace(
        "drain_seconds = 3", "drain_seconds = 3\nmax_connections = 10\nidle_connection_s = 60"
    )
    server = load_config(_write(tmp_path, text)).server
    assert (server.max_connections, server.idle_connection_s) == (10, 60.0)
    for key in ("max_connections = 0", "idle_connection_s = 0"):
        name = key.split(" ")[0]
        with pytest.raises(ConfigError, match=rf":5: key 'server.{name}': must be greater than 0"):
            load_config(
                _write(tmp_path, GOOD.replace("drain_seconds = 3", f"drain_seconds = 3\n{key}"))
            )


def test_http_api_is_off_unless_configured(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, GOOD)).http.listen is None
    assert load_config(_write(tmp_path, GOOD)).http.max_connections == 4096
    text = GOOD + (
        '[http]\nlisten = "127.0.0.1:8080"\nmax_body_bytes = "1MiB"\nclient_timeout_s = 5\n'
        "max_connections = 100\n"
    )
    http = load_config(_write(tmp_path, text)).http
    assert (http.listen, http.max_body_bytes, http.client_timeout_s, http.max_connections) == (
        "127.0.0.1:8080",
        2**20,
        5.0,
        100,
    )


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ('listen = "8080"', r":12: key 'http.listen': expected HOST:PORT, got '8080'"),
        ("max_body_bytes = 1000", r":12: key 'http.max_body_bytes': expected str, got int"),
        ('max_body_bytes = "0MiB"', r":12: key 'http.max_body_bytes': must be greater than 0"),
        ('max_body_bytes = "2GiB"', r":12: key 'http.max_body_bytes': .* at most 1GiB"),
        ("client_timeout_s = 0", r":12: key 'http.client_timeout_s': must be greater than 0"),
        ("max_connections = 0", r":12: key 'http.max_connections': must be greater than 0"),
        ("port = 1", r":12: key 'http.port': unknown key; known keys are client_timeout_s"),
    ],
)
def test_http_keys_are_checked(tmp_path: Path, extra: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(_write(tmp_path, GOOD + "[http]\n" + extra + "\n"))


def test_semantic_table_loads(tmp_path: Path) -> None:
    text = GOOD + (
        '\n[cache.semantic]\nenabled = true\nnamespaces = ["support", "*"]\n'
        'embedder_dir = "emb"\nmax_bytes = "64MiB"\nmin_score = 0.9\nembed_threads = 4\n'
        "overlap_engine = true\n"
    )
    semantic = load_config(_write(tmp_path, text)).cache.semantic
    assert semantic.enabled and semantic.namespaces == ("support", "*") and semantic.overlap_engine
    assert semantic.embedder_dir == tmp_path / "emb" and semantic.max_bytes == 64 * 2**20
    assert (semantic.min_score, semantic.min_similarity) == (0.9, None)
    assert semantic.embed_threads == 4
    default = load_config(_write(tmp_path, GOOD)).cache.semantic
    assert not default.enabled and not default.overlap_engine


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("enabled = true", "key 'cache.semantic.namespaces': list the namespaces"),
        ("min_score = 1.5", "key 'cache.semantic.min_score': must be in (0, 1]"),
        ("embed_threads = 0", "key 'cache.semantic.embed_threads': must be greater than 0"),
        ("threshold = 0.9", "key 'cache.semantic.threshold': unknown key"),
        ('overlap_engine = "yes"', "key 'cache.semantic.overlap_engine'"),
    ],
)
def test_semantic_table_is_checked(tmp_path: Path, extra: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=r":\d+: ") as err:
        load_config(_write(tmp_path, GOOD + f"\n[cache.semantic]\n{extra}\n"))
    assert expected in str(err.value)


def test_cache_tiers_default_to_todays_order(tmp_path: Path) -> None:
    from appliance.security.secretfile import write_secret

    write_secret(tmp_path / "mac")
    redis = '\n[cache.redis]\nmac_key_file = "mac"\n'
    semantic = '\n[cache.semantic]\nenabled = true\nnamespaces = ["*"]\n'
    assert load_config(_write(tmp_path, GOOD)).cache.order == ("l1",)
    assert load_config(_write(tmp_path, GOOD + redis)).cache.order == ("l1", "l2")
    both = load_config(_write(tmp_path, GOOD + redis + semantic)).cache
    assert both.tiers is None and both.order == ("l1", "l2", "semantic")
    listed = GOOD + '\n[cache]\ntiers = ["l2", "l1"]\n' + redis
    assert load_config(_write(tmp_path, listed)).cache.order == ("l2", "l1")


@pytest.mark.parametrize(
    ("tiers", "expected"),
    [
        ('["l1", "l3"]', "unknown cache tier 'l3': expected one of 'l1', 'l2', 'semantic'"),
        ('["l1", "l1"]', "'l1' is listed twice"),
        ("[]", "list at least one tier"),
        ('["l1", "l2"]', "'l2' needs a \\[cache.redis\\] table"),
        ('["l1", "semantic"]', "'semantic' is listed but \\[cache.semantic\\] is not enabled"),
        ('["l1", "no_such_module:Tier"]', "cannot import no_such_module"),
        ('["l1", "appliance.cache.tiers:Nothing"]', "appliance.cache.tiers has no class Nothing"),
        (
            '["l1", "appliance.cache.tiers:CacheQuery"]',
            "CacheQuery is not a subclass of appliance.cache.tiers.CacheTier",
        ),
        ('["l1", "appliance.cache.tiers:CacheTier"]', "CacheTier does not define lookup"),
        ('["l1", "appliance.cache.tiers:L1Tier"]', "two tiers are named 'l1'"),
    ],
)
def test_cache_tiers_are_checked(tmp_path: Path, tiers: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=f"key 'cache.tiers': .*{expected}") as refused:
        load_config(_write(tmp_path, GOOD + f"\n[cache]\ntiers = {tiers}\n"))
    assert "\n" not in str(refused.value)


def test_backend_kind_defaults_to_triton_and_unknown_kinds_are_refused(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, GOOD)).models["tiny"].backend_kind == "triton"
    for kind, expected in (
        ("vllm", "unknown backend kind 'vllm': expected one of 'triton', or package.module:Class"),
        ("appliance.cache.tiers:L1Tier", "backend kind '.*': L1Tier has no from_config"),
    ):
        text = GOOD.replace(
            'tokenizer_dir = "tok"', f'tokenizer_dir = "tok"\nbackend_kind = "{kind}"'
        )
        with pytest.raises(ConfigError, match=f":9: key 'models.tiny.backend_kind': {expected}"):
            load_config(_write(tmp_path, text))


def test_the_sentinels_credential_is_read_from_its_own_file(tmp_path: Path) -> None:
    from appliance.security.secretfile import write_secret

    write_secret(tmp_path / "mac")
    (tmp_path / "redis-password").write_text("data-password\n")
    (tmp_path / "sentinel-password").write_text("sentinel-password\n")
    redis = (
        '\n[cache.redis]\nmac_key_file = "mac"\nusername = "appliance"\n'
        'password_file = "redis-password"\nsentinels = ["10.0.0.2:26379"]\n'
        'sentinel_username = "gateway"\nsentinel_password_file = "sentinel-password"\n'
    )
    settings = load_config(_write(tmp_path, GOOD + redis)).cache.redis
    assert settings is not None
    assert (settings.username, settings.password) == ("appliance", "data-password")
    assert (settings.sentinel_username, settings.sentinel_password) == (
        "gateway",
        "sentinel-password",
    )
    # Neither password is shown where the settings are.
    assert "data-password" not in repr(settings)
    assert "sentinel-password" not in repr(settings)


@pytest.mark.parametrize("key", ["password_file", "sentinel_password_file"])
@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "cannot read .*: "),
        (b"", "is empty"),
        (b"\n", "is empty"),
        (b"x" * (64 * 1024 + 1), "more than 65,536 bytes"),
        (b"\xff\xfe", "not UTF-8 text"),
    ],
)
def test_a_redis_password_file_is_checked_and_bounded(
    tmp_path: Path, key: str, content: bytes | None, expected: str
) -> None:
    """A wrong path (a log, /dev/zero) costs a bounded read and one line naming the key."""
    from appliance.security.secretfile import write_secret

    write_secret(tmp_path / "mac")
    if content is not None:
        (tmp_path / "secret").write_bytes(content)
    redis = (
        f'\n[cache.redis]\nmac_key_file = "mac"\nsentinels = ["10.0.0.2:26379"]\n{key} = "secret"\n'
    )
    with pytest.raises(ConfigError, match=f"key 'cache.redis.{key}': .*{expected}") as refused:
        load_config(_write(tmp_path, GOOD + redis))
    assert "\n" not in str(refused.value)


def test_a_redis_password_file_that_never_ends_is_refused(tmp_path: Path) -> None:
    from appliance.security.secretfile import write_secret

    write_secret(tmp_path / "mac")
    redis = '\n[cache.redis]\nmac_key_file = "mac"\npassword_file = "/dev/zero"\n'
    with pytest.raises(ConfigError, match=r"key 'cache.redis.password_file': .*more than"):
        load_config(_write(tmp_path, GOOD + redis))
