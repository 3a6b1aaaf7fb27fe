"""A real redis-server on a free loopback port, which a test can kill and restart."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from appliance.tools.processes import free_port
from tests.security.certs import CA
from tests.support import until


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server not found: apt-get install redis-server (make test does)"
            )
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        # The ACL user and password the test's own clients log in as (none: the default user).
        self.auth: dict[str, str] = {}
        # With TLS: the server's certificate, key and CA (its port then takes TLS only).
        self.tls: TlsFiles | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self, extra: list[str] | None = None) -> None:
        ports = ["--port", str(self.port)]
        if self.tls is not None:
            ports = ["--port", "0", "--tls-port", str(self.port), *self.tls.server_args()]
        self.proc = subprocess.Popen(
            [
                self.binary,
                *ports,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                *(extra or []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = self.client()

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        until(answers, "redis-server did not answer PING", timeout=5.0)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def pause(self) -> None:
        """Freezes the server: connections stay open, commands hang (a stalled Redis)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def client(self) -> redis.Redis:
        return redis.Redis(
            port=self.port,
            username=self.auth.get("username"),
            password=self.auth.get("password"),
            **(self.tls.client_kwargs() if self.tls else {}),
        )

    def keys(self, pattern: str) -> list[bytes]:
        """The keys matching `pattern`, as stored: the client does not decode responses."""
        found: list[bytes] = []
        for key in self.client().keys(pattern):
            assert isinstance(key, bytes), key
            found.append(key)
        return found


@dataclass(frozen=True)
class TlsFiles:
    """A CA and the certificate (for loopback) every server and Sentinel of a test presents."""

    cert: Path
    key: Path
    ca: Path

    @classmethod
    def make(cls, directory: Path) -> TlsFiles:
        directory.mkdir(parents=True, exist_ok=True)
        ca = CA(directory, "redis-ca")
        issued = ca.issue("redis", "redis", hosts=("127.0.0.1", "localhost"))
        return cls(issued.cert, issued.key, ca.path)

    def directives(self) -> dict[str, str]:
        """The redis role's TLS directives of redis.conf and sentinel.conf besides the ports
        (replicas and Sentinels connect over TLS too), with these files: as the role writes
        them (paths quoted)."""
        block = re.search(
            r"^__redis_tls_directives:\n((?:  \S.*\n)+)",
            (ROLE / "vars" / "main.yml").read_text(),
            re.M,
        )
        assert block is not None
        # Each `key: value`, the value a quoted YAML scalar ('...' or "...").
        role = dict(line.strip().split(": ", 1) for line in block.group(1).splitlines())
        role = {k: v[1:-1].replace("''", "'") if v[0] == "'" else v[1:-1] for k, v in role.items()}
        files = {
            "redis_tls_cert_file": str(self.cert),
            "redis_tls_key_file": str(self.key),
            "redis_tls_ca_file": str(self.ca),
        }
        return {k: jinja2.Template(v).render(files) for k, v in role.items()}

    def server_args(self) -> list[str]:
        # On the command line, as Redis reads each line of its file.
        return [arg for k, v in self.directives().items() for arg in (f"--{k}", v.strip('"'))]

    def client_kwargs(self) -> dict[str, Any]:
        return {"ssl": True, "ssl_ca_certs": str(self.ca)}


class SentinelGroup:
    """A primary, a replica and three Sentinels (quorum 2) watching them as service `name`, all
    real processes on loopback; `down_after_ms` is how long a silent primary takes to be down."""

    # The passwords of the redis role's users (the gateways', replication's, the Sentinels') and
    # of the test's own user of every server.
    PASSWORDS: ClassVar[dict[str, str]] = {
        "appliance": "gateway-password",
        "replication": "replication-password",
        "sentinel": "sentinel-password",
        "admin": "admin-password",
    }

    def __init__(
        self,
        workdir: Path,
        name: str = "appliance",
        down_after_ms: int = 1000,
        tls: TlsFiles | None = None,
    ) -> None:
        self.name = name
        self.primary = RedisServer(workdir / "primary")
        self.replica = RedisServer(workdir / "replica")
        # With TLS every port (servers' and Sentinels') takes TLS only, and every link is TLS.
        self.tls = tls
        for server in (self.primary, self.replica):
            server.auth = {"username": "admin", "password": self.PASSWORDS["admin"]}
            server.tls = tls
        self.workdir = workdir
        self.down_after_ms = down_after_ms
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(f"127.0.0.1:{port}" for port in self.sentinel_ports)

    @property
    def gateway_auth(self) -> dict[str, str]:
        """The gateways' ACL user, at the servers and at the Sentinels."""
        return {"username": "appliance", "password": self.PASSWORDS["appliance"]}

    def sentinel(self, port: int, **auth: str) -> redis.Redis:
        """A client of the Sentinel at `port`, logged in as `auth` (the gateways' user unless
        given; {"username": "", "password": ""} for none)."""
        auth = auth or self.gateway_auth
        # Each refusal at once, not after redis-py's retries.
        return redis.Redis(
            port=port,
            retry=Retry(NoBackoff(), 0),
            username=auth.get("username") or None,
            password=auth.get("password") or None,
            **(self.tls.client_kwargs() if self.tls else {}),
        )

    def kill_sentinel(self, port: int) -> None:
        proc = self.sentinels[self.sentinel_ports.index(port)]
        proc.kill()
        proc.wait()

    def start(self) -> None:
        """As the redis role configures them: on every server the role's users (with the
        default user off), on every Sentinel the role's Sentinel ACL, and each logs in."""
        pw = self.PASSWORDS
        users = self.workdir / "users.acl"
        users.write_text(
            "user default off\n"
            f"user appliance on >{pw['appliance']} {gateway_acl_rules()}\n"
            f"user replication on >{pw['replication']} {role_rules('__redis_replication_rules')}\n"
            f"user sentinel on >{pw['sentinel']} {role_rules('__redis_sentinel_rules')}\n"
            f"user admin on >{pw['admin']} ~* &* +@all\n"
        )
        sentinel_users = self.workdir / "sentinel-users.acl"
        sentinel_users.write_text(
            "user default off resetpass -@all\n"
            f"user appliance on >{pw['appliance']} {role_rules('__redis_sentinel_client_rules')}\n"
            f"user sentinel on >{pw['sentinel']} {role_rules('__redis_sentinel_peer_rules')}\n"
        )
        for server in (self.primary, self.replica):
            server.workdir.mkdir(parents=True, exist_ok=True)
        servers = ["--aclfile", str(users), "--masteruser", "replication"]
        servers += ["--masterauth", pw["replication"]]
        # The replica's first sync starts at once, not after the default 5 s delay.
        self.primary.start([*servers, "--repl-diskless-sync-delay", "0"])
        self.replica.start([*servers, "--replicaof", "127.0.0.1", str(self.primary.port)])
        for port in self.sentinel_ports:
            conf = self.workdir / f"sentinel-{port}.conf"
            ports = f"port {port}\n"
            if self.tls is not None:
                ports = f"port 0\ntls-port {port}\n" + "".join(
                    f"{k} {v}\n" for k, v in self.tls.directives().items()
                )
            # Sentinel rewrites its own file (the replicas and peers it learns): one file each.
            conf.write_text(
                f"{ports}bind 127.0.0.1\ndaemonize no\ndir {self.workdir}\n"
                f'protected-mode yes\naclfile "{sentinel_users}"\n'
                f"sentinel monitor {self.name} 127.0.0.1 {self.primary.port} 2\n"
                f"sentinel down-after-milliseconds {self.name} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.name} 10000\n"
                f"sentinel auth-user {self.name} sentinel\n"
                f"sentinel auth-pass {self.name} {pw['sentinel']}\n"
                f"sentinel sentinel-user sentinel\nsentinel sentinel-pass {pw['sentinel']}\n"
            )
            self.sentinels.append(
                subprocess.Popen(
                    [self.binary_sentinel(), str(conf)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        until(
            lambda: all(self._knows_replica(port) for port in self.sentinel_ports),
            "the Sentinels did not find the replica",
            timeout=30.0,
            interval=0.1,
        )
        # In step: an invalidation waits for the replica to take its generation.
        until(
            lambda: self.replica.client().info("replication")["master_link_status"] == "up",
            "the replica did not finish its first sync",
            timeout=30.0,
            interval=0.1,
        )

    @staticmethod
    def binary_sentinel() -> str:
        binary = shutil.which("redis-sentinel")
        if binary is None:
            raise RuntimeError("redis-sentinel not found: apt-get install redis-sentinel")
        return binary

    def _knows_replica(self, port: int) -> bool:
        try:
            replicas = self.sentinel(port).sentinel_slaves(self.name)
        except redis.RedisError:
            return False
        return any(r.get("port") == self.replica.port for r in replicas)

    def primary_port(self) -> int:
        """The port of the server the Sentinels now name as primary."""
        sentinel = self.sentinel(self.sentinel_ports[0])
        address = sentinel.execute_command(  # type: ignore[no-untyped-call]
            "SENTINEL GET-MASTER-ADDR-BY-NAME", self.name
        )
        return int(address[1])

    def stop(self) -> None:
        for proc in self.sentinels:
            proc.kill()
            proc.wait()
        self.primary.kill()
        self.replica.kill()


ROLE = Path(__file__).resolve().parents[2] / "ansible" / "roles" / "redis"


def role_rules(variable: str) -> str:
    """The ACL rules the redis role's tasks hold in `variable` (a plain or folded scalar)."""
    for tasks in sorted((ROLE / "tasks").glob("*.yml")):
        text = tasks.read_text()
        # A folded scalar (>-): its lines, indented under the variable, joined by spaces.
        found = re.search(rf"^( *){variable}: >-\n((?:\1 +\S.*\n)+)", text, re.M)
        found = found or re.search(rf"^ *{variable}: ()(\S.*)$", text, re.M)
        if found is not None:
            return " ".join(found.group(2).split())
    raise AssertionError(f"no {variable} in {ROLE / 'tasks'}")


def gateway_acl_rules(*without: str) -> str:
    """The Redis ACL rules the redis role gives the gateways' user, with the role's key prefix;
    `without`: those rules left out (an ACL of an older release)."""
    prefix = re.search(
        r"^redis_acl_key_prefix: (\S+)$", (ROLE / "defaults" / "main.yml").read_text(), re.M
    )
    assert prefix is not None
    rules = role_rules("__redis_gateway_rules")
    rules = rules.replace("{{ redis_acl_key_prefix }}", prefix.group(1))
    return " ".join(rule for rule in rules.split() if rule not in without)
