"""`appliance keys` and the configuration of secrets: a key is printed once and only its hash is
stored; secrets come from systemd's credentials directory."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from appliance.config import ConfigError, load_config
from appliance.security import api_keys
from appliance.security.api_keys import KeyRing, RateLimits, read_entries
from appliance.security.secretfile import write_secret
from appliance.tools import keys_cli as keyscli


def keys(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "appliance", "keys", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_add_list_revoke(tmp_path: Path) -> None:
    pepper, path = tmp_path / "pepper", tmp_path / "keys.json"
    assert keys("secret", str(pepper)).returncode == 0
    assert pepper.stat().st_mode & 0o777 == 0o600
    refused = keys("secret", str(pepper))
    assert refused.returncode == 2 and "never overwritten" in refused.stderr
    add = keys(
        "--keys-file", str(path), "add", "--pepper-file", str(pepper),
        "--namespace", "acme", "--scope", "generate", "--scope", "admin",
        "--identity", "client-a.example", "--rate-per-s", "5", "--note", "acme's batch jobs",
    )  # fmt: skip
    assert add.returncode == 0, add.stderr
    token = add.stdout.strip()
    assert token.startswith("ak_") and "only time the key is shown" in add.stderr
    stored = path.read_text()
    assert token not in stored and token[16:] not in stored
    assert path.stat().st_mode & 0o777 == 0o640
    from appliance.security.secretfile import PEPPER_PURPOSE, read_secret

    ring = KeyRing(path, read_secret(pepper, PEPPER_PURPOSE), RateLimits())
    principal = ring.by_token(token)
    assert principal is not None and principal.namespaces == {"acme"}
    assert principal.limits.rate_per_s == 5 and principal.scopes == {"generate", "admin"}
    assert ring.by_identity(["client-a.example"]) == principal
    listed = keys("--keys-file", str(path), "list")
    key_id = token[3:15]
    assert listed.stdout.startswith(f"{key_id} namespaces=acme scopes=admin,generate")
    assert token[16:] not in listed.stdout
    gone = keys("--keys-file", str(path), "revoke", "000000000000")
    assert gone.returncode == 2 and "no key '000000000000'" in gone.stderr
    assert keys("--keys-file", str(path), "revoke", key_id).returncode == 0
    assert json.loads(path.read_text())["keys"] == []


def test_a_short_pepper_is_refused(tmp_path: Path) -> None:
    pepper = tmp_path / "pepper"
    pepper.write_text("short\n")
    add = keys("--keys-file", str(tmp_path / "k.json"), "add", "--pepper-file", str(pepper),
               "--namespace", "a")  # fmt: skip
    assert add.returncode == 2
    assert add.stderr.count("\n") == 1 and "needs at least 32" in add.stderr


def test_a_pepper_that_never_ends_is_refused_after_a_bounded_read() -> None:
    """/dev/zero as the pepper: one line, not a read that fills the memory."""
    add = keys("--keys-file", "/nonexistent/k.json", "add", "--pepper-file", "/dev/zero",
               "--namespace", "a")  # fmt: skip
    assert add.returncode == 2
    assert add.stderr.count("\n") == 1 and "not a secret file" in add.stderr, add.stderr


@pytest.mark.parametrize(
    ("option", "says"),
    [
        (["--namespace", ""], "argument --namespace: an empty namespace; give one"),
        (["--namespace", "a", "--identity", " "], "an empty certificate name; give one"),
        (["--namespace", "a", "--rate-per-s", "nan"], "must be a number greater than 0"),
        (["--namespace", "a", "--rate-per-s", "inf"], "must be a number greater than 0"),
        (["--namespace", "a", "--burst", "1" + "0" * 400], "and at most 1e+09, got 1000"),
    ],
)
def test_a_key_no_reader_would_take_is_never_written(
    tmp_path: Path, option: list[str], says: str
) -> None:
    pepper, path = tmp_path / "pepper", tmp_path / "keys.json"
    assert keys("secret", str(pepper)).returncode == 0
    add = keys("--keys-file", str(path), "add", "--pepper-file", str(pepper), *option)
    assert add.returncode == 2 and says in add.stderr, add.stderr
    assert not path.exists()


def _one_key_file(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A keys file `keys add` wrote with one key, and its contents to edit and write back."""
    pepper, path = tmp_path / "pepper", tmp_path / "keys.json"
    assert keys("secret", str(pepper)).returncode == 0
    add = keys("--keys-file", str(path), "add", "--pepper-file", str(pepper), "--namespace", "a")
    assert add.returncode == 0, add.stderr
    return path, json.loads(path.read_text())


def _listed_after(path: Path, data: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    path.write_text(json.dumps(data))  # Python writes NaN, which its reader takes
    return keys("--keys-file", str(path), "list")


def test_a_keys_file_with_a_rate_that_is_not_a_number_is_refused(tmp_path: Path) -> None:
    path, data = _one_key_file(tmp_path)
    for value in (float("nan"), 10**400):
        data["keys"][0]["rate_per_s"] = value
        listed = _listed_after(path, data)
        assert listed.returncode == 2
        assert "'rate_per_s' must be a number greater than 0" in listed.stderr


def test_a_keys_file_namespace_no_request_could_name_is_refused(tmp_path: Path) -> None:
    path, data = _one_key_file(tmp_path)
    for name, says in (
        ("n" * 65, "is longer than 64 characters"),
        ("a\nb", "holds a control or other unprintable character"),
    ):
        data["keys"][0]["namespaces"] = [name]
        listed = _listed_after(path, data)
        assert listed.returncode == 2 and says in listed.stderr, listed.stderr
        assert len(listed.stderr.splitlines()) == 1
    data["keys"][0]["namespaces"] = ["a"]
    data["keys"][0]["identities"] = ["client\x1b[2K"]
    listed = _listed_after(path, data)
    assert listed.returncode == 2 and "certificate names (printable" in listed.stderr


def test_a_keys_file_in_a_missing_folder_is_named_not_its_temporary_file(tmp_path: Path) -> None:
    pepper, path = tmp_path / "pepper", tmp_path / "nowhere" / "keys.json"
    assert keys("secret", str(pepper)).returncode == 0
    add = keys("--keys-file", str(path), "add", "--pepper-file", str(pepper), "--namespace", "a")
    assert add.returncode == 2
    assert add.stderr == (
        f"appliance keys: cannot write keys file {path}: No such file or directory\n"
    )


def _config(tmp_path: Path, extra: str) -> Path:
    tok = tmp_path / "tok"
    tok.mkdir(exist_ok=True)
    path = tmp_path / "g.toml"
    path.write_text(f'[models.m]\nbackend = "127.0.0.1:1"\ntokenizer_dir = "{tok}"\n' + extra)
    return path


def test_secrets_come_from_the_credentials_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "cache-mac-key").write_text("x" * 64)
    (creds / "api-key-pepper").write_text("y" * 64)
    (tmp_path / "keys.json").write_text('{"version": 1, "keys": []}')
    text = (
        '[cache.redis]\nurl = "redis://127.0.0.1:1/0"\n'
        'mac_key_file = "$CREDENTIALS_DIRECTORY/cache-mac-key"\n'
        '[auth]\nkeys_file = "keys.json"\npepper_file = "$CREDENTIALS_DIRECTORY/api-key-pepper"\n'
    )
    path = _config(tmp_path, text)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    with pytest.raises(
        ConfigError, match=r"key 'auth.pepper_file': \$CREDENTIALS_DIRECTORY is not set"
    ):
        load_config(path)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    config = load_config(path)
    assert config.cache.redis is not None and config.cache.redis.mac_key
    assert config.auth.pepper and config.auth.keys_file == tmp_path / "keys.json"


def test_redis_needs_a_mac_key(tmp_path: Path) -> None:
    path = _config(tmp_path, '[cache.redis]\nurl = "redis://127.0.0.1:1/0"\n')
    with pytest.raises(
        ConfigError, match=r"key 'cache.redis': missing required key 'mac_key_file'"
    ):
        load_config(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another owner needs root")
def test_a_rewrite_keeps_the_owner_and_group_the_gateway_reads_it_as(tmp_path: Path) -> None:
    # /etc/appliance/api-keys.json is root:appliance 0640; `sudo appliance keys revoke` must leave
    # it readable by the gateway's group, or the reload keeps the revoked key in use.
    pepper, path = tmp_path / "pepper", tmp_path / "keys.json"
    assert keys("secret", str(pepper)).returncode == 0
    add = keys("--keys-file", str(path), "add", "--pepper-file", str(pepper), "--namespace", "a")
    assert add.returncode == 0, add.stderr
    os.chown(path, 4242, 4243)
    add = keys("--keys-file", str(path), "add", "--pepper-file", str(pepper), "--namespace", "b")
    assert add.returncode == 0, add.stderr
    assert (path.stat().st_uid, path.stat().st_gid) == (4242, 4243)
    revoke = keys("--keys-file", str(path), "revoke", add.stdout.strip()[3:15])
    assert revoke.returncode == 0, revoke.stderr
    assert (path.stat().st_uid, path.stat().st_gid) == (4242, 4243)
    assert path.stat().st_mode & 0o777 == 0o640


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another group needs root")
def test_a_new_keys_file_made_by_root_takes_its_folders_group(tmp_path: Path) -> None:
    # /etc/appliance is root:appliance 0750: the gateway reads a new keys file through its group.
    pepper, folder = tmp_path / "pepper", tmp_path / "appliance"
    folder.mkdir()
    os.chown(folder, 0, 4243)
    assert keys("secret", str(pepper)).returncode == 0
    path = folder / "keys.json"
    add = keys("--keys-file", str(path), "add", "--pepper-file", str(pepper), "--namespace", "a")
    assert add.returncode == 0, add.stderr
    assert (path.stat().st_uid, path.stat().st_gid) == (0, 4243)


def test_two_adds_at_once_keep_both_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pepper, path = tmp_path / "pepper", tmp_path / "keys.json"
    write_secret(pepper)
    first_writing, first_may_write, second_waits = (threading.Event() for _ in range(3))
    real_write, real_flock = api_keys.write_entries, fcntl.flock

    def write(p: Path, entries: list[dict[str, Any]]) -> None:
        if threading.current_thread().name == "first":
            first_writing.set()
            assert first_may_write.wait(30)
        real_write(p, entries)

    def flock(fd: int, op: int) -> None:
        if threading.current_thread().name == "second" and op & fcntl.LOCK_EX:
            second_waits.set()
        real_flock(fd, op)

    monkeypatch.setattr(keyscli, "write_keys", write)
    monkeypatch.setattr(fcntl, "flock", flock)

    def add(namespace: str) -> None:
        args = argparse.Namespace(
            keys_file=str(path), pepper_file=str(pepper), namespace=[namespace], scope=None,
            identity=None, rate_per_s=None, burst=None, max_streams=None, note="",
        )  # fmt: skip
        assert keyscli._add(args) == 0

    first = threading.Thread(target=add, args=("a",), name="first")
    first.start()
    assert first_writing.wait(30)

    def add_second() -> None:
        add("b")
        second_waits.set()

    second = threading.Thread(target=add_second, name="second")
    second.start()
    assert second_waits.wait(30)  # blocked on the keys file's lock, or (unlocked) done
    first_may_write.set()
    first.join(30)
    second.join(30)
    assert sorted(e["namespaces"][0] for e in read_entries(path)) == ["a", "b"]
    assert len(capsys.readouterr().out.split()) == 2


def test_a_rewrite_that_would_change_the_owner_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "keys.json"
    api_keys.write_entries(path, [])
    st = path.stat()
    monkeypatch.setattr(os, "geteuid", lambda: st.st_uid + 1)  # another user, not root
    with pytest.raises(api_keys.KeysFileError) as refused:
        api_keys.write_entries(path, [])
    assert str(refused.value) == (
        f"cannot write keys file {path}: a rewrite keeps its owner {st.st_uid} and group "
        f"{st.st_gid}, which only root or its owner in that group can: run as one of them"
    )


def test_a_keys_file_nested_too_deeply_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text('{"version": 1, "keys": ' + "[" * 100_000 + "\n")
    listed = keys("--keys-file", str(path), "list")
    assert listed.returncode == 2
    assert listed.stderr == f"appliance keys: {path}: not a JSON keys file: nested too deeply\n"
