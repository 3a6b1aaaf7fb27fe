"""`appliance keys add|list|revoke|secret`: the API keys file and the secrets beside it.

`add` prints the new key once, on stdout, and stores only its salted, peppered hash; the running
gateway picks the change up on `systemctl reload appliance-gateway` (SIGHUP).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from appliance import namespace
from appliance.cliargs import positive, utf8_text
from appliance.logline import escape
from appliance.security.api_keys import (
    LIMIT_MAX,
    SCOPES,
    KeysFileError,
    RateLimits,
    check_entry,
    new_key,
    read_entries,
)
from appliance.security.api_keys import write_entries as write_keys
from appliance.security.secretfile import PEPPER_PURPOSE, SecretFileError, read_secret, write_secret

DEFAULT_KEYS_FILE = "/etc/appliance/api-keys.json"
DEFAULT_PEPPER_FILE = "/etc/appliance/credentials/api-key-pepper"
RELOAD_HINT = "the gateway uses it after `systemctl reload appliance-gateway` (SIGHUP)"


class _Refused(Exception):
    """One line for stderr; exit status 2 (fix the input and rerun)."""


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Holds the lock of the keys file's folder while a command reads and rewrites the file, so
    two commands at once (`add` and `add`, `add` and `revoke`) each keep the other's change."""
    try:
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise _Refused(f"cannot write keys file {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _entries(path: Path, create: bool) -> list[dict[str, Any]]:
    if create and not path.exists():
        return []
    try:
        return list(read_entries(path))
    except KeysFileError as exc:
        raise _Refused(str(exc)) from None


def _add(args: argparse.Namespace) -> int:
    try:
        pepper = read_secret(Path(args.pepper_file), PEPPER_PURPOSE)
    except SecretFileError as exc:
        raise _Refused(f"--pepper-file: {exc}") from None
    path = Path(args.keys_file)
    limits = RateLimits(args.rate_per_s, args.burst, args.max_streams)
    token, entry = new_key(
        pepper, args.namespace, args.scope or ["generate"], args.identity, limits, args.note
    )
    try:
        check_entry(path, entry)  # nothing is written that the file's readers would refuse
        with _locked(path):
            write_keys(path, [*_entries(path, create=True), entry])
    except KeysFileError as exc:
        raise _Refused(str(exc)) from None
    print(token)
    print(
        escape(
            f"appliance keys: added key {entry['id']} to {path}; this is the only time the key "
            f"is shown; {RELOAD_HINT}"
        ),
        file=sys.stderr,
    )
    return 0


def _list(args: argparse.Namespace) -> int:
    for e in _entries(Path(args.keys_file), create=False):
        limits = " ".join(f"{k}={e[k]}" for k in ("rate_per_s", "burst", "max_streams") if k in e)
        identities = ",".join(e.get("identities", [])) or "-"
        print(
            f"{e['id']} namespaces={','.join(e['namespaces'])} "
            f"scopes={','.join(e['scopes'])} identities={identities} "
            f"created={e.get('created', '-')} {limits} note={e.get('note', '')!r}".rstrip()
        )
    return 0


def _revoke(args: argparse.Namespace) -> int:
    path = Path(args.keys_file)
    with _locked(path):
        entries = _entries(path, create=False)
        kept = [e for e in entries if e["id"] != args.key_id]
        if len(kept) == len(entries):
            raise _Refused(f"no key {args.key_id!r} in {path} (`appliance keys list` shows them)")
        try:
            write_keys(path, kept)
        except KeysFileError as exc:
            raise _Refused(str(exc)) from None
    print(escape(f"appliance keys: revoked key {args.key_id}; {RELOAD_HINT}"), file=sys.stderr)
    return 0


def _secret(args: argparse.Namespace) -> int:
    try:
        write_secret(Path(args.file))
    except FileExistsError:
        raise _Refused(f"{args.file} exists; a secret is never overwritten") from None
    except OSError as exc:
        raise _Refused(f"cannot write {args.file}: {exc.strerror or exc}") from None
    print(escape(f"appliance keys: wrote a new secret to {args.file} (mode 0600)"), file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        code: int = args.keys_func(args)
    except _Refused as exc:
        print(escape(f"appliance keys: {exc}"), file=sys.stderr)
        return 2
    except OSError as exc:
        print(escape(f"appliance keys: {exc.filename}: {exc.strerror or exc}"), file=sys.stderr)
        return 1
    return code


def _identity(text: str) -> str:
    if not utf8_text(text).strip():
        raise argparse.ArgumentTypeError("an empty certificate name; give one")
    if not text.isprintable():
        raise argparse.ArgumentTypeError("holds a control or other unprintable character")
    return text


def _namespace(text: str) -> str:
    """A namespace a request can name: the gateway refuses any other."""
    if not utf8_text(text).strip():
        raise argparse.ArgumentTypeError("an empty namespace; give one")
    if (problem := namespace.problem(text)) is not None:
        raise argparse.ArgumentTypeError(f"{problem}, which no request's namespace may")
    return text


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    k = sub.add_parser("keys", help="API keys: add, list, revoke; write a secret file")
    k.add_argument("--keys-file", default=DEFAULT_KEYS_FILE, help=f"default {DEFAULT_KEYS_FILE}")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    a = ksub.add_parser("add", help="make a key; prints it once, stores only its hash")
    a.add_argument(
        "--pepper-file", default=DEFAULT_PEPPER_FILE, help=f"default {DEFAULT_PEPPER_FILE}"
    )
    a.add_argument(
        "--namespace",
        action="append",
        required=True,
        type=_namespace,
        help="a namespace the key may use; repeat; * for any",
    )
    a.add_argument("--scope", action="append", choices=SCOPES, help="repeat; default generate")
    a.add_argument(
        "--identity",
        action="append",
        type=_identity,
        help="a client certificate name (mutual TLS) that stands for the key; repeat",
    )
    a.add_argument("--rate-per-s", type=positive(float, LIMIT_MAX), help="requests per second")
    a.add_argument("--burst", type=positive(int, LIMIT_MAX), help="requests at once above the rate")
    a.add_argument(
        "--max-streams", type=positive(int, LIMIT_MAX), help="requests in flight at once"
    )
    a.add_argument("--note", default="", help="who the key is for")
    a.set_defaults(keys_func=_add)
    ksub.add_parser("list", help="the keys (ids, namespaces, scopes; never secrets)").set_defaults(
        keys_func=_list
    )
    r = ksub.add_parser("revoke", help="remove a key")
    r.add_argument("key_id", help="the key's id, as `list` shows it")
    r.set_defaults(keys_func=_revoke)
    s = ksub.add_parser("secret", help="write a new random secret file (pepper, cache MAC key)")
    s.add_argument("file", help="where to write it (never overwritten; mode 0600)")
    s.set_defaults(keys_func=_secret)
    k.set_defaults(func=run)
