"""Secrets kept in files (systemd credentials): read, checked, and turned into key material.

A secret file holds at least 32 characters of random text (`appliance keys secret FILE` writes one).
Its bytes, stripped of surrounding whitespace, are hashed into a 32-byte key, so any length and
encoding an operator's tooling writes gives a well-formed key.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

MIN_SECRET_CHARS = 32
# Larger is no secret file (a wrong path: a log, a device that never ends); read no further.
MAX_SECRET_BYTES = 64 * 1024
# What a secret file's key is derived for: the same file used twice gives two unrelated keys.
PEPPER_PURPOSE = b"api-key-pepper"
MAC_PURPOSE = b"cache-mac-key"


class SecretFileError(ValueError):
    """A secret file that cannot be used; the message names the file and what to do."""


def read_secret(path: Path, purpose: bytes) -> bytes:
    """The 32-byte key derived from the file's secret for `purpose` (one file, one use)."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise SecretFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_SECRET_BYTES:
        raise SecretFileError(
            f"{path} holds more than {MAX_SECRET_BYTES:,} bytes: not a secret file (write one "
            "with `appliance keys secret FILE`)"
        )
    data = data.strip()
    if len(data) < MIN_SECRET_CHARS:
        raise SecretFileError(
            f"{path} holds {len(data)} characters; a secret needs at least {MIN_SECRET_CHARS} "
            "(write one with `appliance keys secret FILE`)"
        )
    return hashlib.blake2b(data, digest_size=32, person=purpose[:16]).digest()


def write_secret(path: Path) -> None:
    """A new random secret in a new file only its owner can read; an existing file is kept."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
