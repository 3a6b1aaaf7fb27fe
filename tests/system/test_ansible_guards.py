"""The playbook refuses to do nothing quietly: a missing required variable of any role fails the play at
its first task naming the variable, and an inventory without appliance hosts fails instead of
"skipping: no hosts matched". Cheap runs of the pinned ansible-playbook: the target host is never
reached (every failure here happens on the controller, and its address is a closed port)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "ansible"
ANSIBLE_BIN = REPO / ".venv-ansible" / "bin"

# Every required variable of the GPU profile's roles, with a value that passes validation.
GPU_REQUIRED: dict[str, object] = {
    "appliance_wheelhouse": {"dir": "/srv/wheelhouse"},
    "host_tuning_profile_src": "/srv/profile.toml",
    "engine_build_spec_src": "/srv/spec.toml",
    "triton_archive_src": "/srv/triton.tar.zst",
    "triton_archive_sha256": "0" * 64,
}


def _playbook(
    tmp_path: Path, inventory: object, playbook: str = "site.yml"
) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(inventory))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "PIP_"))}
    env.update(
        PATH=f"{ANSIBLE_BIN}:{env.get('PATH', '/usr/bin:/bin')}",
        ANSIBLE_CONFIG=str(ANSIBLE / "ansible.cfg"),
        ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"),
        ANSIBLE_NOCOLOR="1",
        HOME=str(tmp_path),
        LC_ALL="C.UTF-8",
    )
    return subprocess.run(
        [str(ANSIBLE_BIN / "ansible-playbook"), "-i", str(path), playbook, "--check"],
        cwd=ANSIBLE,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def _gpu_host(variables: dict[str, object]) -> dict[str, object]:
    host = {
        "ansible_host": "127.0.0.1",
        "ansible_port": 9,
        "ansible_connection": "ssh",
        **variables,
    }
    return {"all": {"children": {"gpu": {"hosts": {"gpu-test": host}}}}}


def _tasks(output: str) -> list[str]:
    return re.findall(r"^TASK \[(.*?)\]", output, re.M)


def _role_alone(
    tmp_path: Path, role: str, variables: dict[str, object]
) -> subprocess.CompletedProcess[str]:
    """One role on the controller itself, in check mode, with these variables."""
    play = [
        {
            "name": f"The {role} role alone",
            "hosts": "localhost",
            "connection": "local",
            "gather_facts": False,
            "vars": variables,
            "roles": [role],
        }
    ]
    (tmp_path / f"{role}.yml").write_text(json.dumps(play))
    local = {"localhost": {"ansible_python_interpreter": str(ANSIBLE_BIN / "python")}}
    return _playbook(tmp_path, {"all": {"hosts": local}}, str(tmp_path / f"{role}.yml"))


@pytest.mark.parametrize("missing", sorted(GPU_REQUIRED))
def test_missing_required_variable_fails_the_first_task(tmp_path: Path, missing: str) -> None:
    variables = {k: v for k, v in GPU_REQUIRED.items() if k != missing}
    result = _playbook(tmp_path, _gpu_host(variables))
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert f"missing required arguments: {missing}" in out, out
    # The inventory check, then the variables check of the provisioning play: nothing else ran.
    assert _tasks(out) == [
        "Fail when no host is in group gpu or cpu",
        "Validate the variables of every role this host runs",
    ], out
    assert "gpu-test                   : ok=0    changed=0    unreachable=0    failed=1" in out


@pytest.mark.parametrize("empty", sorted(k for k, v in GPU_REQUIRED.items() if isinstance(v, str)))
def test_an_empty_required_variable_fails_the_first_task(tmp_path: Path, empty: str) -> None:
    result = _playbook(tmp_path, _gpu_host({**GPU_REQUIRED, empty: ""}))
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert f"value of {empty} must be one of: a non-empty value, got: " in out, out
    assert _tasks(out) == [
        "Fail when no host is in group gpu or cpu",
        "Validate the variables of every role this host runs",
    ], out


def test_every_required_variable_set_passes_the_first_task(tmp_path: Path) -> None:
    """With every required variable set, validation passes and the play goes on to the host
    (here a closed port: unreachable, not failed)."""
    result = _playbook(tmp_path, _gpu_host(GPU_REQUIRED))
    out = result.stdout + result.stderr
    assert "missing required arguments" not in out, out
    assert "unreachable=1" in out, out


def test_an_inventory_without_appliance_hosts_fails(tmp_path: Path) -> None:
    result = _playbook(tmp_path, {"all": {"children": {"gpu": {}, "cpu": {}}}})
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "has no host in group gpu or cpu; start from inventory/example/hosts.yml" in out


def test_a_rolling_upgrade_stops_at_the_first_failed_host(tmp_path: Path) -> None:
    """upgrade.yml takes one host at a time and touches no other host once one has failed."""
    hosts = {
        name: {"ansible_host": "127.0.0.1", "ansible_port": 9, "ansible_connection": "ssh"}
        for name in ("cpu-a", "cpu-b")
    }
    inventory = {
        "all": {
            "children": {"cpu": {"hosts": hosts}},
            "vars": {"appliance_wheelhouse": {"dir": "/srv/wheelhouse"}},
        }
    }
    result = _playbook(tmp_path, inventory, "upgrade.yml")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert re.search(r"^fatal: \[cpu-a\]: UNREACHABLE", out, re.M), out
    assert "[cpu-b]" not in out, out


@pytest.mark.parametrize(
    "replicated",
    [
        {"redis_sentinel": True, "redis_sentinel_primary": "10.0.0.1 6379"},
        {"redis_replicaof": "10.0.0.1 6379"},
    ],
)
def test_a_replicated_redis_without_shared_passwords_fails_first(
    tmp_path: Path, replicated: dict[str, object]
) -> None:
    """A replica or Sentinel with passwords generated on its own host could never authenticate to
    the primary: the redis role stops at its first task, naming the variables to set."""
    result = _role_alone(tmp_path, "redis", replicated)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "set redis_replication_password_src, redis_sentinel_password_src and" in out, out
    assert _tasks(out)[-1] == "redis : Check a replicated Redis is given its shared passwords", out


@pytest.mark.parametrize(
    ("files", "variables", "why"),
    [
        (
            ["model.onnx", "tokenizer.json", "embedder.json"],
            {},
            ") lacks classifier.onnx: write it with `appliance semantic-setup --dest DIR`",
        ),
        (
            ["model.onnx", "tokenizer.json", "embedder.json", "classifier.onnx"],
            {"appliance_semantic_namespaces": []},
            'appliance_semantic_namespaces is empty: name the namespaces that take part, or "*"',
        ),
        (
            ["model.onnx", "tokenizer.json", "embedder.json", "classifier.onnx"],
            {"appliance_cache_enabled": False},
            "appliance_semantic_embedder_src needs appliance_cache_enabled",
        ),
    ],
)
def test_a_semantic_tier_the_gateway_could_not_load_fails_before_changes(
    tmp_path: Path, files: list[str], variables: dict[str, object], why: str
) -> None:
    """The gateway would start without the tier (or not at all) and say so only in its journal:
    the appliance role stops first, on the controller, naming what to fix."""
    export = tmp_path / "semantic"
    export.mkdir()
    for name in files:
        (export / name).write_bytes(b"")
    required = {"appliance_profile": "cpu", "appliance_wheelhouse": {"dir": "/srv/wheelhouse"}}
    semantic = {"appliance_semantic_embedder_src": str(export)}
    result = _role_alone(tmp_path, "appliance", {**required, **semantic, **variables})
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert why in out, out
    assert _tasks(out)[-1] == "appliance : Check the semantic tier's files are all there", out
    assert "changed=0" in out, out


@pytest.mark.parametrize(
    "listen",
    [{"appliance_http_listen": "0.0.0.0:8080"}, {"appliance_listen": "0.0.0.0:50051"}],
)
def test_a_public_front_end_without_tls_and_keys_fails_first(
    tmp_path: Path, listen: dict[str, object]
) -> None:
    """The gateway refuses to start with a non-loopback gRPC or HTTP listener that has neither
    TLS nor API keys (nor allow_plaintext/allow_anonymous): the role stops before any change,
    naming the variables, rather than leave a host whose gateway does not start."""
    required = {"appliance_profile": "cpu", "appliance_wheelhouse": {"dir": "/srv/wheelhouse"}}
    result = _role_alone(tmp_path, "appliance", {**required, **listen})
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "set appliance_tls_cert_src and" in out, out
    assert (
        _tasks(out)[-1] == "appliance : Check a non-loopback listen address has TLS and API keys"
    ), out
    assert "changed=0" in out, out


@pytest.mark.parametrize("metrics", ["", "0.0.0.0", "127.0.0.1:port", "0.0.0.0:8002", "[::]:8002"])
def test_an_inference_server_metrics_address_without_a_port_fails_first(
    tmp_path: Path, metrics: str
) -> None:
    """appliance_backend_metrics is where the engine server listens and what Prometheus is told
    to scrape: a value that is no HOST:PORT would leave an engine server that does not start,
    and a wildcard host a target no Prometheus reaches. The role stops before any change,
    naming it."""
    required = {"appliance_profile": "cpu", "appliance_wheelhouse": {"dir": "/srv/wheelhouse"}}
    result = _role_alone(tmp_path, "appliance", {**required, "appliance_backend_metrics": metrics})
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert f"appliance_backend_metrics ({metrics}) is not HOST:PORT" in out, out
    assert _tasks(out)[-1] == "appliance : Check the inference server's metrics address", out
    assert "changed=0" in out, out


SHARED_PASSWORDS = {
    "redis_replication_password_src": "/srv/replication",
    "redis_sentinel_password_src": "/srv/sentinel",
    "appliance_redis_password_src": "/srv/appliance",
}
SENTINEL = {"redis_sentinel": True, "redis_sentinel_primary": "10.0.0.1 6379", **SHARED_PASSWORDS}


def _redis_on_localhost(
    tmp_path: Path, variables: dict[str, object], others: dict[str, dict[str, object]]
) -> subprocess.CompletedProcess[str]:
    """The redis role on the controller (host vars `variables`), in an inventory that also holds
    `others` (never contacted)."""
    play = [
        {
            "name": "The redis role",
            "hosts": "localhost",
            "connection": "local",
            "gather_facts": False,
            "roles": ["redis"],
        }
    ]
    (tmp_path / "redis.yml").write_text(json.dumps(play))
    local = {"ansible_python_interpreter": str(ANSIBLE_BIN / "python"), **variables}
    hosts = {"localhost": local, **others}
    return _playbook(tmp_path, {"all": {"hosts": hosts}}, str(tmp_path / "redis.yml"))


@pytest.mark.parametrize(
    ("quorum", "others"),
    [
        (2, {}),  # one Sentinel, the default quorum 2: it never fails over
        (3, {"b": {"redis_sentinel": True}, "c": {"redis_sentinel": False}}),
        (0, {"b": {"redis_sentinel": True}}),
    ],
)
def test_a_sentinel_quorum_the_inventory_cannot_meet_fails_first(
    tmp_path: Path, quorum: int, others: dict[str, dict[str, object]]
) -> None:
    result = _redis_on_localhost(tmp_path, {**SENTINEL, "redis_sentinel_quorum": quorum}, others)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert f"redis_sentinel_quorum is {quorum} with" in out, out
    assert _tasks(out)[-1] == "redis : Check the Sentinel quorum can be met", out


def test_a_sentinel_quorum_of_the_inventorys_sentinels_passes(tmp_path: Path) -> None:
    others: dict[str, dict[str, object]] = {n: {"redis_sentinel": True} for n in ("b", "c")}
    result = _redis_on_localhost(tmp_path, {**SENTINEL, "redis_sentinel_quorum": 3}, others)
    out = result.stdout + result.stderr
    assert "redis_sentinel_quorum is" not in out, out
    tasks = _tasks(out)
    assert "redis : Check the Sentinel quorum can be met" in tasks[:-1], out


@pytest.mark.parametrize(
    ("variables", "why"),
    [
        ({"redis_acl_user": "cache"}, "redis_acl_user (cache) must be appliance_redis_user"),
        (
            {"redis_acl_key_prefix": "cache"},
            "redis_acl_key_prefix (cache) must be the gateways' key prefix",
        ),
        (
            {"redis_acl_password_file": "/srv/redis-password"},
            "redis_acl_password_file (/srv/redis-password) must be the gateway's",
        ),
    ],
)
def test_a_redis_acl_user_the_gateways_cannot_log_in_as_fails_first(
    tmp_path: Path, variables: dict[str, object], why: str
) -> None:
    """The gateways log in as appliance_redis_user with the password the appliance role installs,
    and use keys `appliance:*`: an ACL user of another name, password file or key prefix would
    refuse every L2 call (every lookup a miss, on every gateway)."""
    gateway = {"appliance_redis_user": "appliance", "appliance_config_dir": "/etc/appliance"}
    result = _role_alone(tmp_path, "redis", {**gateway, **variables})
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert why in out, out
    assert _tasks(out)[-1] == "redis : Check the gateways can log in as the ACL user", out


@pytest.mark.parametrize("primary", ["redis-1.internal 6379", "10.0.0.1", "10.0.0.1:6379"])
def test_a_sentinel_primary_sentinel_cannot_read_fails_first(tmp_path: Path, primary: str) -> None:
    """Sentinel resolves no host names (Debian's sentinel.conf: resolve-hostnames no): with one in
    its monitor line it refuses its whole configuration and never starts."""
    variables = {**SENTINEL, "redis_sentinel_primary": primary, "redis_sentinel_quorum": 1}
    result = _redis_on_localhost(tmp_path, variables, {})
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert f'redis_sentinel_primary must be "IP PORT" of the primary, got "{primary}"' in out, out
    assert _tasks(out)[-1] == "redis : Check the Sentinel's primary is given", out


TLS = {
    "redis_tls_port": 6379,
    "redis_tls_cert_file": "/etc/redis/tls/redis.crt",
    "redis_tls_key_file": "/etc/redis/tls/redis.key",
    "redis_tls_ca_file": "/etc/redis/tls/ca.crt",
}


@pytest.mark.parametrize(
    ("variables", "why"),
    [
        (
            {"redis_tls_key_file": ""},
            "redis_tls_port (6379) needs redis_tls_cert_file, redis_tls_key_file and",
        ),
        (
            {"redis_tls_port": 6380, "redis_replicaof": "10.0.0.1 6379"},
            'redis_replicaof ("10.0.0.1 6379") must name the primary\'s TLS port (6380)',
        ),
        (
            {"redis_tls_port": 6380},
            'redis_sentinel_primary ("10.0.0.1 6379") must name the primary\'s TLS port (6380)',
        ),
        (
            {"appliance_cache_enabled": True, "appliance_redis_url": "redis://10.0.0.1:6379/0"},
            "appliance_redis_url (redis://10.0.0.1:6379/0) must be rediss://",
        ),
    ],
)
def test_tls_a_plaintext_address_or_missing_file_fails_first(
    tmp_path: Path, variables: dict[str, object], why: str
) -> None:
    """With TLS on nothing listens in plaintext: a replica, Sentinel or gateway given a
    plaintext address would never connect, and Redis without its files never starts."""
    settings = {**SENTINEL, "redis_sentinel_quorum": 1, **TLS, **variables}
    result = _redis_on_localhost(tmp_path, settings, {})
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert why in out, out
    assert _tasks(out)[-1] == "redis : Check TLS has its files and every address names a TLS port"


def test_tls_with_tls_addresses_passes_its_check(tmp_path: Path) -> None:
    settings = {
        **SENTINEL,
        "redis_sentinel_quorum": 1,
        **TLS,
        "redis_replicaof": "10.0.0.1 6379",
        "appliance_cache_enabled": True,
        "appliance_redis_url": "rediss://_/0",
    }
    result = _redis_on_localhost(tmp_path, settings, {})
    out = result.stdout + result.stderr
    check = "redis : Check TLS has its files and every address names a TLS port"
    assert check in _tasks(out)[:-1], out
