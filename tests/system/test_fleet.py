"""A fleet of two appliance hosts (booted Debian containers, CPU profile), each in a network namespace of its
own, bridged to a client namespace where a load of deterministic and sampled requests runs through one
`connect_fleet` channel (round_robin over the gateways whose health is SERVING).

Steps, in order (they share the two containers):
  provision -> site.yml on both hosts at once: gateways SERVING; host a's Redis the primary, host b's
               its replica, a Sentinel on each naming a's; both gateways use L2 through the Sentinels;
               what fleet-a caches fleet-b answers (L2), an invalidation through fleet-a empties
               fleet-b's L1, a question asked of fleet-a answers its paraphrase on fleet-b
               (the semantic tier, on for one namespace)
  roll      -> a new build of the package; upgrade.yml --check reports it and restarts nothing; then
               upgrade.yml under load, one host at a time (drain, upgrade, restart, SERVING): every
               gateway restarted, no request failed; TTFT during the roll against the steady state
  again     -> upgrade.yml with nothing new: changed=0, nothing restarted
  failover  -> under the same load, fleet-a's Redis (the primary) is killed and stays down: the
               Sentinels promote fleet-b's, both gateways write to L2 again (their cache counters,
               read between questions nobody asked before), no request failed; restarted,
               fleet-a's Redis rejoins as a replica of the new primary

Redis runs with ACL users only (the role turns `default` off): the gateways', the replication user
every server uses with its primary, and the Sentinels'. Their passwords, and the cache MAC key, are
controller files the test writes once and gives both hosts, as a fleet's inventory must.
Redis TLS is on (redis_tls_port, the number of redis_port): every Redis-protocol link between the
hosts is TLS (gateway -> Redis and Sentinels, replication, Sentinel -> Redis and Sentinel ->
Sentinel), and neither Redis nor a Sentinel answers in plaintext. The certificate (both hosts'
addresses) and its CA are the test's, bound read-only into each container at TLS_DIR.

Needs root, systemd-nspawn, debootstrap, nsenter, ip and .venv-ansible (tests/prereqs.py stops the run
naming what is missing); the Debian root and the dependency wheels are the ones test_e2e.py uses
(cached). APPLIANCE_E2E_KEEP=1 keeps the work directory.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.security.certs import CA
from tests.system import containers
from tests.system.containers import REPO, Machine

pytestmark = pytest.mark.timeout(1200)

SUBNET = "10.77.0"
HOSTS = {"fleet-a": f"{SUBNET}.2", "fleet-b": f"{SUBNET}.3"}
GATEWAYS = ",".join(f"{ip}:50051" for ip in HOSTS.values())
GATEWAY = "appliance-gateway.service"
# Requests of the load before the roll: the first COLD fill the cache, the next STEADY are measured.
COLD, STEADY = 100, 500
# The fleet's shared secrets (controller files) and the host variable that installs each.
SECRETS = {
    "cache-mac-key": "appliance_cache_mac_key_src",
    "redis-password": "appliance_redis_password_src",
    "redis-replication-password": "redis_replication_password_src",
    "redis-sentinel-password": "redis_sentinel_password_src",
}
SENTINEL_PASSWORD = "/etc/appliance/credentials/redis-sentinel-password"
# The containers' Redis certificate, key and CA (a test's key: world-readable, read-only).
TLS_DIR = "/srv/redis-tls"
TLS_CA = f"{TLS_DIR}/ca.pem"
# What redis-cli in a container needs to talk to Redis or a Sentinel (TLS only).
TLS_CLI = f"--tls --cacert {TLS_CA}"


@dataclass
class Fleet:
    workdir: Path
    wheels: Path
    client_ns: str
    machines: dict[str, Machine]
    embedder_dir: Path  # `appliance semantic-setup`'s export, on the controller

    def inventory(self) -> Path:
        sentinels = [f"{ip}:26379" for ip in HOSTS.values()]
        primary = f"{HOSTS['fleet-a']} 6379"
        shared = {var: str(self.workdir / "secrets" / name) for name, var in SECRETS.items()}
        hosts = {
            name: m.host_vars(
                **shared,
                redis_bind="0.0.0.0",
                redis_protected_mode=False,
                redis_replicaof="" if name == "fleet-a" else primary,
                redis_sentinel=True,
                redis_sentinel_primary=primary,
                redis_sentinel_quorum=1,
                # Two Sentinels that see the primary down at the same moment may each vote for
                # itself; neither wins, and the next election waits twice the failover timeout.
                redis_sentinel_failover_timeout_ms=10000,
                redis_tls_port=6379,
                redis_tls_cert_file=f"{TLS_DIR}/redis.crt",
                redis_tls_key_file=f"{TLS_DIR}/redis.key",
                redis_tls_ca_file=TLS_CA,
                appliance_redis_sentinels=sentinels,
                appliance_redis_url="rediss://_/0",
                appliance_redis_tls_ca_file=TLS_CA,
                # A loaded 2-core CI machine: a call that sets up a TLS connection (a handshake
                # with the Sentinel and one with the primary) can take more than 20 ms.
                appliance_redis_timeout_ms=200,
                appliance_roll_min_ready_s=3,
                # The hosts' own addresses on the test's private bridge: clients in another
                # namespace reach the gateways there, in plaintext and without keys.
                appliance_listen="0.0.0.0:50051",
                appliance_allow_plaintext=True,
                appliance_allow_anonymous=True,
                # The semantic tier for one namespace only: the load of the tests below uses
                # another, so their requests never wait on an embedding.
                appliance_semantic_embedder_src=str(self.embedder_dir),
                appliance_semantic_namespaces=["sem"],
                # Guided decoding under the engine's unit is test_e2e.py's; off here, neither
                # host installs xgrammar (about 1 GB with its dependencies) nor loads it.
                appliance_engine_guided_decoding=False,
            )
            for name, m in self.machines.items()
        }
        return containers.write_inventory(self.workdir, hosts)

    def playbook(self, play: str, check: bool = False) -> str:
        result = containers.playbook(self.workdir, self.inventory(), 900, check, play)
        out = result.stdout + result.stderr
        if result.returncode != 0:
            # A unit a handler failed to restart says why only in its journal.
            journals = "".join(
                f"\n--- {m.name} {unit}:\n{m.journal(unit)[-2000:]}"
                for m in self.machines.values()
                for unit in ("redis-server.service", "redis-sentinel.service")
            )
            raise AssertionError(out[-5000:] + journals)
        return out

    def in_client_ns(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return containers.run(
            ["ip", "netns", "exec", self.client_ns, sys.executable, *argv],
            timeout=timeout,
            cwd=REPO,
        )

    def gateway_pids(self) -> dict[str, str]:
        return {name: m.show(GATEWAY, "MainPID") for name, m in self.machines.items()}

    def in_client_ns_background(self, name: str, *argv: str) -> subprocess.Popen[bytes]:
        """A module of tests.system run in the client namespace until SIGTERM; its stdout goes to
        NAME.jsonl in the work directory, its stderr to NAME.err."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.client_ns, sys.executable, "-m", *argv],
            cwd=REPO,
            stdout=(self.workdir / f"{name}.jsonl").open("w"),
            stderr=(self.workdir / f"{name}.err").open("w"),
        )

    def records(self, name: str) -> list[dict[str, Any]]:
        return [
            json.loads(line) for line in (self.workdir / f"{name}.jsonl").read_text().splitlines()
        ]

    def stop(self, name: str, process: subprocess.Popen[bytes]) -> None:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        assert process.returncode == 0, (self.workdir / f"{name}.err").read_text()[-3000:]


def _replication(m: Machine) -> dict[str, str]:
    """INFO replication of the container's Redis, asked as the Sentinels' ACL user (the only one
    allowed INFO; the password goes through the environment, not the command line)."""
    out = m.sh(
        "sh",
        "-c",
        f'REDISCLI_AUTH="$(cat {SENTINEL_PASSWORD})" redis-cli {TLS_CLI} --no-auth-warning'
        " --user sentinel info replication",
    ).stdout
    return dict(line.strip().split(":", 1) for line in out.splitlines() if ":" in line)


GATEWAY_PASSWORD = "/etc/appliance/credentials/redis-password"


def _primary_named(m: Machine) -> list[str]:
    """HOST PORT of the primary, as the container's Sentinel names it to the gateways' ACL user
    (the Sentinel answers nobody who does not log in)."""
    return m.sh(
        "sh",
        "-c",
        f'REDISCLI_AUTH="$(cat {GATEWAY_PASSWORD})" redis-cli {TLS_CLI} --no-auth-warning'
        " --user appliance -p 26379 sentinel get-master-addr-by-name appliance",
    ).stdout.split()


def _sentinel_refuses(m: Machine, *command: str) -> str:
    """What the container's Sentinel answers a client that does not log in."""
    argv = ["redis-cli", *TLS_CLI.split(), "-h", HOSTS[m.name], "-p", "26379", *command]
    return m.sh(*argv).stdout.strip()


def _in_plaintext(client: Machine, server: str, port: int) -> str:
    """What `server`'s `port` answers a PING without TLS from `client`'s redis-cli."""
    said = client.sh("redis-cli", "-h", HOSTS[server], "-p", str(port), "ping", timeout=30)
    return (said.stdout + said.stderr).strip()


def _ip(*argv: str) -> None:
    result = containers.run(["ip", *argv])
    assert result.returncode == 0, f"ip {' '.join(argv)}: {result.stderr}"


def _network(tag: str) -> tuple[str, list[str]]:
    """A client namespace with a bridge, and a namespace per host wired to it (HOSTS addresses)."""
    client = f"fleet-c-{tag}"
    _ip("netns", "add", client)
    _ip("-n", client, "link", "set", "lo", "up")
    _ip("-n", client, "link", "add", "br0", "type", "bridge")
    _ip("-n", client, "addr", "add", f"{SUBNET}.1/24", "dev", "br0")
    _ip("-n", client, "link", "set", "br0", "up")
    spaces = [client]
    for n, ip in enumerate(HOSTS.values()):
        ns = f"fleet-{n}-{tag}"
        port = f"fl{n}-{tag}"[:15]
        _ip("netns", "add", ns)
        spaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", port, "netns", client)
        _ip("-n", client, "link", "set", port, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
    return client, spaces


def _redis_tls(directory: Path) -> Path:
    """A CA and one certificate for both hosts' Redis and Sentinel (their addresses: the gateways
    verify the host they connect to), readable by the containers' redis user."""
    directory.mkdir()
    ca = CA(directory, "ca")
    issued = ca.issue("redis", "redis", hosts=(*HOSTS.values(), "127.0.0.1"))
    for path in (ca.path, issued.cert, issued.key):
        path.chmod(0o644)
    directory.chmod(0o755)
    return directory


@pytest.fixture(scope="module")
def fleet(embedder_dir: Path) -> Iterator[Fleet]:
    started = time.monotonic()
    root_src = containers.root_source()
    workdir = Path(tempfile.mkdtemp(prefix="appliance-fleet-", dir="/var/tmp"))
    tag = str(os.getpid() % 100000)
    spaces: list[str] = []
    machines: dict[str, Machine] = {}
    try:
        wheels = containers.wheelhouse(workdir / "wheels")
        (workdir / "secrets").mkdir(mode=0o700)
        for name in SECRETS:
            (workdir / "secrets" / name).write_text(secrets.token_hex(32) + "\n")
        tls = _redis_tls(workdir / "redis-tls")
        client, spaces = _network(tag)
        for (name, _), ns in zip(HOSTS.items(), spaces[1:], strict=True):
            root = containers.copy_root(root_src, workdir / f"root-{name}")
            binds = [f"{wheels}:/srv/wheelhouse", f"{tls}:{TLS_DIR}"]
            machines[name] = containers.boot(name, workdir, root, ns, binds)
        containers.say(f"two containers booted in {time.monotonic() - started:.0f} s")
        yield Fleet(workdir, wheels, client, machines, embedder_dir)
    finally:
        for m in machines.values():
            containers.stop(m.nspawn)
        for ns in spaces:
            containers.run(["ip", "netns", "delete", ns])
        if os.environ.get("APPLIANCE_E2E_KEEP"):
            print(f"kept {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def test_provision_two_hosts(fleet: Fleet) -> None:
    t0 = time.monotonic()
    out = fleet.playbook("site.yml")
    containers.say(f"site.yml on two hosts: {time.monotonic() - t0:.0f} s")
    for name in HOSTS:
        assert containers.recap(out, name)["failed"] == 0
    for ip in HOSTS.values():
        health = fleet.in_client_ns("-m", "appliance", "health", "--gateway", f"{ip}:50051")
        assert health.returncode == 0, health.stderr
    replica, a_ip = fleet.machines["fleet-b"], HOSTS["fleet-a"]
    replica.wait_for(
        "fleet-b's Redis replicating fleet-a's",
        lambda: _replication(replica).get("master_link_status") == "up",
        60,
    )
    assert _replication(replica)["master_host"] == a_ip
    for m in fleet.machines.values():
        assert _primary_named(m) == [a_ip, "6379"]
        assert _sentinel_refuses(m, "sentinel", "remove", "appliance").startswith("NOAUTH")
    # Replication and the Sentinels' links above are TLS: nothing answers in plaintext (a
    # NOAUTH or PONG would be an answer), from the other host as from the host itself.
    for client, server in itertools.product(fleet.machines.values(), HOSTS):
        for port in (6379, 26379):
            said = _in_plaintext(client, server, port)
            assert "NOAUTH" not in said and "PONG" not in said, (client.name, server, port, said)
    _warm_up_on_one_host_is_cached_for_the_other(fleet)
    _a_question_on_one_host_answers_its_paraphrase_on_the_other(fleet)


def _a_question_on_one_host_answers_its_paraphrase_on_the_other(fleet: Fleet) -> None:
    """The semantic tier across hosts: fleet-a's entry reaches fleet-b's index through the Redis
    primary the Sentinels name, as the role's ACL user."""
    asked = fleet.in_client_ns(
        "-c", _ASK_SEMANTIC, f"{HOSTS['fleet-a']}:50051", f"{HOSTS['fleet-b']}:50051"
    )
    assert asked.returncode == 0, asked.stderr
    answer = json.loads(asked.stdout)
    assert answer["question"] == "CACHE_TIER_MISS", answer
    assert answer["paraphrase"] == "CACHE_TIER_SEMANTIC", answer
    assert answer["same_text"] and answer["similarity"] > 0.8, answer


def _warm_up_on_one_host_is_cached_for_the_other(fleet: Fleet) -> None:
    """Both hosts serve the same model bytes, hence one engine fingerprint: what a warm-up
    through fleet-a stores in the shared Redis, fleet-b answers from it."""
    prompts = fleet.workdir / "warm-prompts.txt"
    prompts.write_text("Which host answers this?\nWhat is a fleet of appliances for?\n")

    def warm(ip: str) -> str:
        done = fleet.in_client_ns(
            "-m", "appliance", "cache", "--gateway", f"{ip}:50051", "warm",
            "--prompts", str(prompts), "--model", "tiny-llama", "--max-tokens", "8",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().splitlines()[-1]

    assert warm(HOSTS["fleet-a"]).startswith("2/2: 2 warmed, 0 already cached, 0 failed")

    def asked_of_b() -> list[str]:
        asked = fleet.in_client_ns("-c", _ASK_CACHE_ONLY, f"{HOSTS['fleet-b']}:50051", str(prompts))
        assert asked.returncode == 0, asked.stderr
        return asked.stdout.split()

    # fleet-a writes to L2 in the background, right after answering.
    fleet.machines["fleet-b"].wait_for(
        "fleet-b to find fleet-a's answers in L2",
        lambda: asked_of_b() == ["CACHE_TIER_EXACT_L2"] * 2,
        30,
    )
    assert warm(HOSTS["fleet-b"]).startswith("2/2: 0 warmed, 2 already cached, 0 failed")
    assert asked_of_b() == ["CACHE_TIER_EXACT_L1"] * 2
    # Invalidated through fleet-a: fleet-b's L1 drops them too (it follows fleet-a's message on
    # the replicated Redis); then warmed again for the tests after this one.
    gone = fleet.in_client_ns(
        "-m", "appliance", "cache", "--gateway", f"{HOSTS['fleet-a']}:50051", "invalidate", "--all"
    )
    assert gone.returncode == 0 and "2 from Redis" in gone.stdout, (gone.stdout, gone.stderr)
    fleet.machines["fleet-b"].wait_for(
        "fleet-b's L1 to drop what fleet-a invalidated",
        lambda: asked_of_b() == ["NOT_FOUND"] * 2,
        10,
    )
    assert warm(HOSTS["fleet-a"]).startswith("2/2: 2 warmed, 0 already cached, 0 failed")


# argv: GATEWAY PROMPTS_FILE; prints the tier that answered each prompt as the warm-up asked it,
# NOT_FOUND where no tier did. Asked with cache_policy ONLY: it never generates an answer.
_ASK_CACHE_ONLY = """
import sys, grpc
from appliance.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
stub = pb_grpc.InferenceStub(grpc.insecure_channel(sys.argv[1]))
for prompt in open(sys.argv[2]).read().splitlines():
    request = pb.GenerateRequest(model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0.0,
                                 cache_policy=pb.CACHE_POLICY_ONLY)
    try:
        print(pb.CacheTier.Name(stub.Complete(request, timeout=10).final.cache_tier))
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.NOT_FOUND:
            raise
        print("NOT_FOUND")
"""


# argv: GATEWAY_A GATEWAY_B; asks a question of A, then polls B with a paraphrase under cache_policy
# ONLY (never generated) until its semantic tier answers or 60 s pass; prints what answered, as JSON.
# UNAVAILABLE (a tier over its time budget on this loaded host: "try again later") is polled again.
_ASK_SEMANTIC = """
import json, sys, time, grpc
from appliance.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
def ask(address, text, policy):
    request = pb.GenerateRequest(model="tiny-llama", prompt=text, max_tokens=8, temperature=0.0,
                                 namespace="sem", semantic_cache=True, cache_policy=policy)
    return pb_grpc.InferenceStub(grpc.insecure_channel(address)).Complete(request, timeout=30)
first = ask(sys.argv[1], "How do I get rid of acne?", pb.CACHE_POLICY_DEFAULT)
deadline = time.monotonic() + 60
while True:
    try:
        second = ask(sys.argv[2], "How can I get rid of acne?", pb.CACHE_POLICY_ONLY)
        break
    except grpc.RpcError as exc:
        again = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)
        if exc.code() not in again or time.monotonic() > deadline:
            raise
        time.sleep(0.1)
print(json.dumps({"question": pb.CacheTier.Name(first.final.cache_tier),
                  "paraphrase": pb.CacheTier.Name(second.final.cache_tier),
                  "same_text": first.text == second.text,
                  "similarity": second.final.similarity}))
"""


def _new_build(wheels: Path) -> None:
    """Another build of the same version (as a rebuilt wheel is): same files, other bytes."""
    (wheel,) = wheels.glob("llm_appliance-*.whl")
    with zipfile.ZipFile(wheel, "a") as z:
        z.comment = f"build {time.time_ns()}".encode()


def _percentiles(values: list[float]) -> str:
    if len(values) < 2:
        return "n/a"
    q = statistics.quantiles(values, n=100, method="inclusive")
    return f"P50 {q[49] * 1000:.1f} ms, P99 {q[98] * 1000:.1f} ms (n={len(values)})"


def test_rolling_upgrade_under_load_fails_no_request(fleet: Fleet) -> None:
    _new_build(fleet.wheels)
    pids = fleet.gateway_pids()

    checked = fleet.playbook("upgrade.yml", check=True)
    assert "appliance : Record which wheel is installed" in containers.changed_tasks(checked)
    assert fleet.gateway_pids() == pids  # check mode restarts nothing

    load = fleet.in_client_ns_background("load", "tests.system.fleet_load", GATEWAYS)
    try:
        # Steady state first: both hosts serving, the cache warm for the repeated questions
        # (the first COLD requests fill it and are left out of the figures).
        # A bound, not a speed: the load shares the cores with the other half of the suite.
        fleet.machines["fleet-a"].wait_for(
            "the steady state before the roll",
            lambda: len(fleet.records("load")) >= COLD + STEADY,
            600,
        )
        roll_start = time.time()
        t0 = time.monotonic()
        out = fleet.playbook("upgrade.yml")
        roll_s = time.monotonic() - t0
        roll_end = time.time()
    finally:
        fleet.stop("load", load)

    # One host at a time: every task of fleet-a's batch before any of fleet-b's.
    play = out[out.index("PLAY [Provision") :]
    assert play.rindex("[fleet-a]") < play.index("[fleet-b]"), play[-3000:]
    after = fleet.gateway_pids()
    for name, m in fleet.machines.items():
        assert after[name] != pids[name], f"{name}'s gateway was not restarted"
        journal = m.journal(GATEWAY)
        assert "drained: no request in flight" in journal, journal[-3000:]
        # The restarted gateway answered clients again (fleet-a before fleet-b drained).
        since_start = journal[journal.rindex("gateway listening on") :]
        assert " appliance.access " in since_start, since_start[-2000:]

    records = fleet.records("load")
    failed = [r for r in records if r["status"] != "OK"]
    steady = [r for r in records[COLD:] if r["sent"] < roll_start]
    rolling = [r for r in records if roll_start <= r["sent"] <= roll_end]

    def ttft(window: list[dict[str, Any]], kind: str) -> str:
        return _percentiles([r["ttft"] for r in window if r["kind"] == kind and "ttft" in r])

    containers.say(
        f"rolling upgrade of 2 hosts in {roll_s:.0f} s: {len(rolling)} requests during the roll"
        f" ({sum(r['kind'] == 'sampled' for r in rolling)} sampled), {len(failed)} failed;"
        f" {len(records)} in all\n"
        f"  TTFT greedy (cache hits once warm), steady : {ttft(steady, 'greedy')}\n"
        f"  TTFT greedy (cache hits once warm), rolling: {ttft(rolling, 'greedy')}\n"
        f"  TTFT sampled (the engine), steady : {ttft(steady, 'sampled')}\n"
        f"  TTFT sampled (the engine), rolling: {ttft(rolling, 'sampled')}"
    )
    assert failed == [], failed[:5]
    assert len(rolling) >= 20, len(rolling)


def test_an_upgrade_with_nothing_new_changes_nothing(fleet: Fleet) -> None:
    pids = fleet.gateway_pids()
    out = fleet.playbook("upgrade.yml")
    for name in HOSTS:
        assert containers.recap(out, name)["changed"] == 0, containers.changed_tasks(out)
    assert fleet.gateway_pids() == pids
    assert not re.search(r"RUNNING HANDLER \[appliance : Drain the gateway\]", out)


def _l2_back(probes: list[dict[str, Any]], gateway: str, since: float) -> float | None:
    """When `gateway` had written to L2 again after `since`: the first of its probe turns whose
    counters show a successful L2 write of a question asked after `since`, or None."""
    turns = [r for r in probes if r["gateway"] == gateway and r["at"] > since and "l2_written" in r]
    for before, after in itertools.pairwise(turns):
        if after["l2_written"] > before["l2_written"]:
            return float(after["at"])
    return None


def test_a_killed_redis_primary_fails_over_to_the_replica(fleet: Fleet) -> None:
    a, b = fleet.machines["fleet-a"], fleet.machines["fleet-b"]
    b_ip = HOSTS["fleet-b"]
    gateways = [f"{ip}:50051" for ip in HOSTS.values()]
    load = fleet.in_client_ns_background("load-failover", "tests.system.fleet_load", GATEWAYS)
    probe = fleet.in_client_ns_background("probe", "tests.system.fleet_l2_probe", *gateways)

    def l2_back(since: float) -> dict[str, float | None]:
        probes = fleet.records("probe")
        return {g: _l2_back(probes, g, since) for g in gateways}

    try:
        started = time.time()
        a.wait_for("both gateways writing to L2", lambda: all(l2_back(started).values()), 60)
        # The primary stays down (as its host would): without this, systemd restarts it at once.
        norestart = "/run/systemd/system/redis-server.service.d"
        assert a.sh("mkdir", "-p", norestart).returncode == 0
        dropin = f"printf '[Service]\\nRestart=no\\n' > {norestart}/kill.conf"
        assert a.sh("sh", "-c", dropin).returncode == 0
        assert a.sh("systemctl", "daemon-reload").returncode == 0
        pid = a.show("redis-server.service", "MainPID")
        killed = time.time()
        assert a.sh("kill", "-KILL", pid).returncode == 0
        try:
            b.wait_for(
                "the Sentinels to promote fleet-b's Redis",
                lambda: _primary_named(b) == [b_ip, "6379"],
                60,
            )
        except BaseException:  # what the Sentinels decided, for whoever reads the failure
            for m in (a, b):
                print(
                    f"{m.name} redis-sentinel:\n{m.journal('redis-sentinel.service')}",
                    file=sys.stderr,
                )
            raise
        promoted = time.time()
        # Each gateway's writes reach the new primary, as the ACL user it knows too.
        b.wait_for(
            "both gateways writing to L2 on the new primary",
            lambda: all(l2_back(killed).values()),
            60,
        )
    finally:
        fleet.stop("probe", probe)
        fleet.stop("load-failover", load)
    assert _replication(b)["role"] == "master"
    assert _primary_named(a) == [b_ip, "6379"]

    back = l2_back(killed)
    records = fleet.records("load-failover")
    failed = [r for r in records if r["status"] != "OK"]
    probe_failed = [r for r in fleet.records("probe") if r["status"] != "OK"]
    last = max(t for t in back.values() if t is not None)
    during = [r for r in records if killed <= r["sent"] <= last]
    gaps = ", ".join(f"{g} {t - killed:.1f} s" for g, t in back.items() if t is not None)
    containers.say(
        f"redis primary killed (down-after 5000 ms): the Sentinels named the replica after"
        f" {promoted - killed:.1f} s (polled every 0.5 s); no L2 write until {gaps} after the kill;"
        f" {len(during)} requests meanwhile; {len(failed)} of {len(records)} failed"
        f" ({len(probe_failed)} probe questions failed)"
    )
    assert failed == [], failed[:5]
    assert probe_failed == [], probe_failed[:5]

    # Back again, the old primary is made a replica of the new one, and authenticates to it.
    assert a.sh("rm", "-r", norestart).returncode == 0
    assert a.sh("systemctl", "daemon-reload").returncode == 0
    assert a.sh("systemctl", "start", "redis-server.service").returncode == 0
    a.wait_for(
        "fleet-a's Redis replicating fleet-b's",
        lambda: _replication(a).get("master_link_status") == "up",
        60,
    )
    assert _replication(a)["master_host"] == b_ip
