"""API keys: the keys file, how a key is hashed, and the in-memory ring the gateway checks keys with.

A key is `ak_<id>_<secret>`: the id (12 hex digits) names the key in the file, in logs and in
messages; the secret (32 random bytes, base64url) is shown once, when the key is made, and never
stored. The file keeps, per key, a random salt and BLAKE2b-256(secret, key=pepper, salt=salt):
the pepper is a secret of its own (a systemd credential), so the file alone, leaked or read by a
backup, verifies nothing. Secrets are 256 random bits, so a slow password hash would add nothing
against guessing. A token is checked once against the file's hash (keyed BLAKE2b and a
constant-time comparison, docs/PERFORMANCE.md#security-tls-and-api-keys; a token naming an unknown id is hashed against a dummy record so both
refusals take the same time); a token that verified is remembered, so the next requests with it
cost one dictionary lookup. Only verified tokens are remembered (at most one per key), and a reload
forgets them all, so a revoked key stops working at once.

The keys file is JSON (written by `appliance keys add|revoke`, readable by people):

    {"version": 1, "keys": [{"id": "3f9a2b1c0d4e", "salt": HEX, "hash": HEX,
      "namespaces": ["acme"], "scopes": ["generate"], "identities": ["client-a.example"],
      "rate_per_s": 20.0, "burst": 40, "max_streams": 8, "note": "...", "created": "..."}]}

`namespaces` may hold "*" (any namespace: operators and trusted services); `identities` are client
certificate names (subject CN or a DNS/URI SAN) that stand for this key under mutual TLS; the limits
are optional (absent: the gateway's `[auth]` defaults).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import os
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import namespace
from appliance.textfile import TextFileError, read_bytes
from appliance.wholefile import write_whole

ANY_NAMESPACE = "*"
SCOPES = ("generate", "cache:read-only-policy", "admin")
TOKEN_PREFIX = "ak_"
ID_HEX = 12
# Longest token looked at: anything longer is refused before it is hashed.
MAX_TOKEN_CHARS = 128
_PERSON = b"appliance-apikey"
FILE_VERSION = 1
# An entry is a few hundred bytes: this holds over a hundred thousand keys. Larger is no keys file.
MAX_KEYS_FILE_BYTES = 64 << 20
# The largest rate, burst or stream count a key may hold: past any gateway's throughput.
LIMIT_MAX = 1e9


class KeysFileError(ValueError):
    """A keys file that cannot be used; the message names the file, the key and what is wrong."""


@dataclass(frozen=True, slots=True)
class RateLimits:
    """Per-key rate limits; None: unlimited."""

    rate_per_s: float | None = None
    burst: int | None = None
    max_streams: int | None = None


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request comes from: a key's id, the namespaces and scopes it holds, its limits."""

    key_id: str
    namespaces: frozenset[str]
    scopes: frozenset[str]
    limits: RateLimits = field(default_factory=RateLimits)
    identities: tuple[str, ...] = ()

    @property
    def any_namespace(self) -> bool:
        return ANY_NAMESPACE in self.namespaces


# No keys file (loopback only): every request may do everything, as before keys existed.
ANONYMOUS = Principal("anonymous", frozenset({ANY_NAMESPACE}), frozenset(SCOPES))


@dataclass(frozen=True, slots=True)
class KeyRecord:
    principal: Principal
    salt: bytes
    digest: bytes


def hash_secret(secret: str, salt: bytes, pepper: bytes) -> bytes:
    return hashlib.blake2b(
        secret.encode(), digest_size=32, key=pepper, salt=salt, person=_PERSON
    ).digest()


def parse_token(token: str) -> tuple[str, str] | None:
    """(id, secret) of a well-formed token, else None. A token is ASCII: a header's bytes that
    are not UTF-8 reach here as lone surrogates (aiohttp), which no encoder takes."""
    if (
        len(token) > MAX_TOKEN_CHARS
        or not token.isascii()
        or not token.startswith(TOKEN_PREFIX)
        or token[3 + ID_HEX : 4 + ID_HEX] != "_"
    ):
        return None
    return token[3 : 3 + ID_HEX], token[4 + ID_HEX :]


_DUMMY = KeyRecord(ANONYMOUS, b"\0" * 16, b"\0" * 32)


class KeyRing:
    """The keys of one keys file, checked per request; `reload` re-reads the file (SIGHUP)."""

    def __init__(self, path: Path, pepper: bytes, defaults: RateLimits) -> None:
        self.path = path
        self._pepper = pepper
        self._defaults = defaults
        self._by_id: dict[str, KeyRecord] = {}
        self._by_identity: dict[str, KeyRecord] = {}
        self._verified: dict[str, Principal] = {}
        self.reload()

    def reload(self) -> int:
        """Re-reads the file; KeysFileError leaves the keys in use unchanged. Returns the count."""
        records = [self._record(entry) for entry in read_entries(self.path)]
        by_identity: dict[str, KeyRecord] = {}
        for record in records:
            for name in record.principal.identities:
                if name in by_identity:
                    raise KeysFileError(
                        f"{self.path}: identity {name!r} is given to keys "
                        f"'{by_identity[name].principal.key_id}' and '{record.principal.key_id}'"
                    )
                by_identity[name] = record
        self._by_id = {r.principal.key_id: r for r in records}
        self._by_identity = by_identity
        self._verified = {}
        return len(records)

    def _record(self, entry: dict[str, Any]) -> KeyRecord:
        d = self._defaults
        limits = RateLimits(
            rate_per_s=entry.get("rate_per_s", d.rate_per_s),
            burst=entry.get("burst", d.burst),
            max_streams=entry.get("max_streams", d.max_streams),
        )
        principal = Principal(
            key_id=entry["id"],
            namespaces=frozenset(entry["namespaces"]),
            scopes=frozenset(entry["scopes"]),
            limits=limits,
            identities=tuple(entry.get("identities", ())),
        )
        return KeyRecord(principal, bytes.fromhex(entry["salt"]), bytes.fromhex(entry["hash"]))

    def __len__(self) -> int:
        return len(self._by_id)

    def by_token(self, token: str) -> Principal | None:
        """The key's principal when `token` is a key of this ring; same work for any refusal."""
        known = self._verified.get(token)
        if known is not None:
            return known
        parsed = parse_token(token)
        if parsed is None:
            return None
        key_id, secret = parsed
        record = self._by_id.get(key_id)
        expected = (record or _DUMMY).digest
        salt = (record or _DUMMY).salt
        match = hmac.compare_digest(hash_secret(secret, salt, self._pepper), expected)
        if not match or record is None:
            return None
        # One entry per key: a key has one secret, so one token verifies.
        self._verified[token] = record.principal
        return record.principal

    def by_identity(self, identities: Iterable[str]) -> Principal | None:
        """The key a client certificate name stands for (the first name that maps to one)."""
        for name in identities:
            record = self._by_identity.get(name)
            if record is not None:
                return record.principal
        return None


# -- the file ---------------------------------------------------------------------------------


def _check_entry(path: Path, n: int, entry: object) -> dict[str, Any]:
    where = f"{path}: keys[{n}]"
    if not isinstance(entry, dict):
        raise KeysFileError(f"{where}: expected an object")
    key_id = entry.get("id")
    if not (isinstance(key_id, str) and len(key_id) == ID_HEX and is_hex(key_id)):
        raise KeysFileError(f"{where}: 'id' must be {ID_HEX} hex digits")
    where = f"{path}: key '{key_id}'"
    for name, size in (("salt", 16), ("hash", 32)):
        value = entry.get(name)
        if not (isinstance(value, str) and len(value) == 2 * size and is_hex(value)):
            raise KeysFileError(f"{where}: '{name}' must be {2 * size} hex digits")
    namespaces = entry.get("namespaces")
    if not (
        isinstance(namespaces, list)
        and namespaces
        and all(isinstance(v, str) and v for v in namespaces)
    ):
        raise KeysFileError(f"{where}: 'namespaces' must be a non-empty list of names (or \"*\")")
    for name in namespaces:
        if (problem := namespace.problem(name)) is not None:
            raise KeysFileError(f"{where}: namespace {name!r} {problem}")
    scopes = entry.get("scopes")
    if not (isinstance(scopes, list) and scopes and all(v in SCOPES for v in scopes)):
        raise KeysFileError(f"{where}: 'scopes' must be a non-empty list of {', '.join(SCOPES)}")
    identities = entry.get("identities", [])
    if not (
        isinstance(identities, list)
        and all(isinstance(v, str) and v and v.isprintable() for v in identities)
    ):
        raise KeysFileError(
            f"{where}: 'identities' must be a list of certificate names (printable characters)"
        )
    value = entry.get("rate_per_s")
    if value is not None and (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (isinstance(value, float) and not math.isfinite(value))  # Python's JSON: NaN
        or not 0 < value <= LIMIT_MAX
    ):
        raise KeysFileError(
            f"{where}: 'rate_per_s' must be a number greater than 0 and at most {LIMIT_MAX:g}"
        )
    # Counts: a burst under 1 never holds the token a request takes (refused for ever).
    for name in ("burst", "max_streams"):
        value = entry.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= LIMIT_MAX
        ):
            raise KeysFileError(f"{where}: '{name}' must be a whole number from 1 to {LIMIT_MAX:g}")
    return entry


def check_entry(path: Path, entry: dict[str, Any]) -> None:
    """KeysFileError unless `entry` is one `read_entries` of `path` would accept."""
    _check_entry(path, 0, entry)


def is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def read_entries(path: Path) -> list[dict[str, Any]]:
    """The checked entries of a keys file; KeysFileError names what is wrong."""
    try:
        data = json.loads(read_bytes(path, MAX_KEYS_FILE_BYTES).decode("utf-8"))
    except TextFileError as exc:
        raise KeysFileError(f"cannot read keys file {path}: {exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KeysFileError(f"{path}: not a JSON keys file: {exc}") from None
    except RecursionError:
        raise KeysFileError(f"{path}: not a JSON keys file: nested too deeply") from None
    if not isinstance(data, dict) or data.get("version") != FILE_VERSION:
        raise KeysFileError(f'{path}: expected an object with "version": {FILE_VERSION}')
    entries = data.get("keys", [])
    if not isinstance(entries, list):
        raise KeysFileError(f"{path}: 'keys' must be a list")
    checked = [_check_entry(path, n, e) for n, e in enumerate(entries)]
    ids = [e["id"] for e in checked]
    if len(set(ids)) != len(ids):
        raise KeysFileError(f"{path}: a key id appears twice")
    return checked


def write_entries(path: Path, entries: list[dict[str, Any]]) -> None:
    """Replaces the file atomically (a reader sees the old or the new file, never half of one),
    readable by its owner and group only. The gateway reads it through its group
    (root:appliance): a file that exists keeps its owner and group, whoever rewrites it, and a new
    one made by root takes its folder's group (/etc/appliance is root:appliance)."""
    text = json.dumps({"version": FILE_VERSION, "keys": entries}, indent=2) + "\n"
    owner: tuple[int, int] | None = None
    try:
        st = path.stat()
    except FileNotFoundError:
        with contextlib.suppress(OSError):  # a missing folder: the write says so
            if os.geteuid() == 0:
                owner = (0, path.parent.stat().st_gid)
    except OSError as exc:
        raise KeysFileError(f"cannot write keys file {path}: {exc.strerror or exc}") from None
    else:
        owner = (st.st_uid, st.st_gid)
        if os.geteuid() != 0 and (
            st.st_uid != os.geteuid() or st.st_gid not in {os.getegid(), *os.getgroups()}
        ):
            raise KeysFileError(
                f"cannot write keys file {path}: a rewrite keeps its owner {st.st_uid} and group "
                f"{st.st_gid}, which only root or its owner in that group can: run as one of them"
            )
    try:
        write_whole(path, text.encode(), 0o640, owner)
    except OSError as exc:
        raise KeysFileError(f"cannot write keys file {path}: {exc.strerror or exc}") from None


def new_key(
    pepper: bytes,
    namespaces: list[str],
    scopes: list[str],
    identities: list[str] | None = None,
    limits: RateLimits | None = None,
    note: str = "",
) -> tuple[str, dict[str, Any]]:
    """A new key: (the token, shown once; the file entry, which holds only its hash)."""
    key_id = secrets.token_hex(ID_HEX // 2)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_bytes(16)
    entry: dict[str, Any] = {
        "id": key_id,
        "salt": salt.hex(),
        "hash": hash_secret(secret, salt, pepper).hex(),
        "namespaces": sorted(set(namespaces)),
        "scopes": sorted(set(scopes)),
    }
    if identities:
        entry["identities"] = sorted(set(identities))
    for name in ("rate_per_s", "burst", "max_streams"):
        value = getattr(limits, name, None) if limits is not None else None
        if value is not None:
            entry[name] = value
    if note:
        entry["note"] = note
    entry["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return f"{TOKEN_PREFIX}{key_id}_{secret}", entry
