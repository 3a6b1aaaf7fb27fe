"""TLS of the public API: the server certificate, optionally mutual TLS, and reloading the files.

One set of `[tls]` settings serves every front end: `ServerTls.grpc_credentials()` for the gRPC
server, `ServerTls.ssl_context()` for an asyncio/aiohttp server. The files are checked at start-up
(the certificate must match its key; the client CA must parse). A renewed certificate is picked
up without a restart and without touching open connections: before each new handshake the files'
sizes and modification times are compared with the loaded ones (a few stat calls), and changed
files are loaded and checked first; a half-written or mismatched pair, or an expired certificate
replacing one that is not, is logged and the previous certificate stays in use. Replace files atomically (write a new file, then rename it over the old).

A reload replaces everything the files hold, the client CAs included: an SSLContext can add trusted
CAs but never drop one, so the HTTP listener's context is rebuilt from the files on every change, and
each new handshake is switched onto the newest context as it starts (the SNI callback, which OpenSSL
calls for every ClientHello, with or without a server name). gRPC is handed the whole new
configuration. A CA removed from `client_ca_file` is refused by both listeners from the next
handshake on.

The HTTP listener offers only `http/1.1` in ALPN: its server speaks HTTP/1.1, and a client that
negotiated `h2` would send frames it cannot read.

Mutual TLS (`client_ca_file` set) requires every client to present a certificate the CA signed;
gRPC's Python API has no "optional client certificate" mode, so neither does this.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from appliance.logline import Throttled
from appliance.textfile import TextFileError, read_bytes

log = logging.getLogger(__name__)
_throttled = Throttled(log)
# A CA bundle, a certificate chain or a private key; the largest public CA bundles are ~250 KiB.
MAX_PEM_BYTES = 4 << 20


class TlsError(ValueError):
    """Certificate files that cannot be used; the message names the file and what is wrong,
    `setting` the TlsSettings field of the file at fault."""

    def __init__(self, message: str, setting: str = "cert_file") -> None:
        super().__init__(message)
        self.setting = setting


@dataclass(frozen=True)
class TlsSettings:
    cert_file: Path
    key_file: Path
    # Set: mutual TLS; every client presents a certificate this CA bundle verifies.
    client_ca_file: Path | None = None

    @property
    def files(self) -> tuple[Path, ...]:
        paths = (self.cert_file, self.key_file)
        return (*paths, self.client_ca_file) if self.client_ca_file else paths


@dataclass(frozen=True)
class _Material:
    cert: bytes
    key: bytes
    client_ca: bytes | None
    stamp: tuple[tuple[int, int, int], ...]
    # The certificate's notAfter (seconds since the epoch); None: not known.
    not_after: float | None = None

    def expired(self) -> bool:
        return self.not_after is not None and self.not_after < time.time()


def _not_after(cert_file: Path) -> float | None:
    """The notAfter of the file's first certificate (the server's own; a chain follows it).
    Read with CPython's certificate decoder, the one getpeercert() uses; None without it."""
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:
        return None
    try:
        return float(ssl.cert_time_to_seconds(decode(str(cert_file))["notAfter"]))
    except (ssl.SSLError, OSError, KeyError, TypeError, ValueError):
        return None


def _stamp(paths: tuple[Path, ...]) -> tuple[tuple[int, int, int], ...]:
    stamps = []
    for p in paths:
        st = os.stat(p)
        stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(stamps)


def _pem(path: Path, named: dict[str, str]) -> bytes:
    """The file's bytes, read at most MAX_PEM_BYTES + 1 of them (a wrong path costs a bounded
    read, and OpenSSL is handed no file larger)."""
    try:
        return read_bytes(path, MAX_PEM_BYTES)
    except TextFileError as exc:
        raise TlsError(f"cannot read {path}: {exc}", named.get(str(path), "cert_file")) from None


def _load(settings: TlsSettings) -> tuple[_Material, ssl.SSLContext]:
    """Reads and checks the files: their bytes (what gRPC is handed) and the HTTP listener's
    context of them. TlsError says which one is wrong."""
    named = {str(path): name for name, path in vars(settings).items() if path is not None}
    try:
        stamp = _stamp(settings.files)
        cert, key = _pem(settings.cert_file, named), _pem(settings.key_file, named)
        ca = _pem(settings.client_ca_file, named) if settings.client_ca_file else None
        # The check reads the files again: what it proves holds for the bytes above only
        # when no file was replaced in between (a renewal renames one file, then the other).
        context = _http_context(settings)
        not_after = _not_after(settings.cert_file)
        if _stamp(settings.files) != stamp:
            raise TlsError(
                f"{settings.cert_file} or {settings.key_file} changed while being read "
                "(a renewal under way); they are read again at the next handshake"
            )
    except OSError as exc:
        raise TlsError(
            f"cannot read {exc.filename}: {exc.strerror or exc}",
            named.get(str(exc.filename), "cert_file"),
        ) from None
    return _Material(cert, key, ca, stamp, not_after), context


def _expired(settings: TlsSettings, material: _Material) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(material.not_after or 0))
    return f"TLS certificate {settings.cert_file} expired on {when}: clients refuse it"


def _check(settings: TlsSettings) -> ssl.SSLContext:
    """An SSL server context of the files: proves the certificate matches its key and the CA
    parses, with the error of the file at fault."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(settings.cert_file, settings.key_file)
    except (ssl.SSLError, OSError) as exc:
        raise TlsError(
            f"{settings.cert_file} with key {settings.key_file}: not a certificate and its "
            f"private key ({exc})"
        ) from None
    if settings.client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=settings.client_ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise TlsError(
                f"{settings.client_ca_file}: not a CA bundle ({exc})", "client_ca_file"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _http_context(settings: TlsSettings) -> ssl.SSLContext:
    context = _check(settings)
    context.set_alpn_protocols(["http/1.1"])
    return context


class ServerTls:
    """The certificate files of one listener, reloaded when they change."""

    def __init__(self, settings: TlsSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()  # gRPC asks for certificates from its own threads
        self._material, current = _load(settings)
        if self._material.expired():
            log.warning("%s; renew it", _expired(settings, self._material))
        self.generation = 0
        # The stamp of files refused as a whole (an expired certificate): not read again until
        # they change once more.
        self._refused: tuple[tuple[int, int, int], ...] | None = None
        # The context new HTTP handshakes are switched onto; rebuilt from the files on each change.
        self._current = current

    @property
    def mutual(self) -> bool:
        return self.settings.client_ca_file is not None

    def refresh(self) -> bool:
        """Loads the files if they changed since they were loaded; True when a new certificate
        is in use. A file that cannot be used is logged; the previous certificate stays."""
        with self._lock:
            try:
                stamp = _stamp(self.settings.files)
                if stamp in (self._material.stamp, self._refused):
                    return False
                material, current = _load(self.settings)
            except (OSError, TlsError) as exc:
                _throttled.warning("TLS files not reloaded, the previous ones stay: %s", exc)
                return False
            if material.expired() and not self._material.expired():
                _throttled.warning(
                    "%s; not reloaded, the previous one stays", _expired(self.settings, material)
                )
                self._refused = material.stamp
                return False
            self._material = material
            self._current = current
            self.generation += 1
        log.info("TLS certificate reloaded from %s", self.settings.cert_file)
        return True

    def _grpc_config(self) -> Any:
        m = self._material
        return grpc.ssl_server_certificate_configuration([(m.key, m.cert)], m.client_ca)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Server credentials whose certificate follows the files (checked before each handshake)."""
        served = [self.generation]

        def fetch() -> Any:
            self.refresh()
            if served[0] == self.generation:
                return None  # unchanged: gRPC keeps the configuration it has
            served[0] = self.generation
            return self._grpc_config()

        return grpc.dynamic_ssl_server_credentials(
            self._grpc_config(), fetch, require_client_authentication=self.mutual
        )

    def ssl_context(self) -> ssl.SSLContext:
        """A server SSLContext for an asyncio/aiohttp listener. Each handshake it starts continues
        on the context of the files as last loaded: `refresh()` (on SIGHUP) rebuilds that one."""
        context = _http_context(self.settings)
        context.sni_callback = self._switch
        return context

    def _switch(self, connection: ssl.SSLObject, server_name: str | None, _: object) -> None:
        self.refresh()
        connection.context = self._current


def certificate_names(common_names: list[str], dns: list[str], uris: list[str]) -> tuple[str, ...]:
    """A client certificate's names that may stand for an API key, in the order they are tried."""
    return (*common_names, *dns, *uris)


def grpc_peer_names(context: grpc.aio.ServicerContext) -> tuple[str, ...]:
    """The verified client certificate's names of a gRPC call (empty without mutual TLS)."""
    auth = context.auth_context() or {}

    def names(prop: str) -> list[str]:
        return [v.decode(errors="replace") for v in auth.get(prop, ())]

    # Not x509_subject_alternative_name: it holds the email and IP address SANs too.
    return certificate_names(names("x509_common_name"), names("peer_dns"), names("peer_uri"))


def peercert_names(peercert: dict[str, Any] | None) -> tuple[str, ...]:
    """The same names from `ssl.SSLObject.getpeercert()` (an HTTP front end's transport
    `get_extra_info("peercert")`)."""
    if not peercert:
        return ()
    cns = [v for rdn in peercert.get("subject", ()) for k, v in rdn if k == "commonName"]
    dns = [v for k, v in peercert.get("subjectAltName", ()) if k == "DNS"]
    uris = [v for k, v in peercert.get("subjectAltName", ()) if k == "URI"]
    return certificate_names(cns, dns, uris)
