"""Certificates a test makes: a CA, server and client certificates (valid, expired, for another
host, signed by another CA), written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NOW = datetime.datetime.now(datetime.UTC)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


@dataclass
class Issued:
    cert: Path
    key: Path

    @property
    def cert_pem(self) -> bytes:
        return self.cert.read_bytes()

    @property
    def key_pem(self) -> bytes:
        return self.key.read_bytes()


class CA:
    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.name = name
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(NOW - datetime.timedelta(days=1))
            .not_valid_after(NOW + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.path = directory / f"{name}.pem"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    @property
    def pem(self) -> bytes:
        return self.path.read_bytes()

    def issue(
        self,
        file_name: str,
        cn: str,
        *,
        hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
        client: bool = False,
        expired: bool = False,
        emails: tuple[str, ...] = (),
        uris: tuple[str, ...] = (),
    ) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = []
        for host in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        sans.extend(x509.RFC822Name(email) for email in emails)
        sans.extend(x509.UniformResourceIdentifier(uri) for uri in uris)
        start, end = (
            (NOW - datetime.timedelta(days=10), NOW - datetime.timedelta(days=1))
            if expired
            else (NOW - datetime.timedelta(hours=1), NOW + datetime.timedelta(days=10))
        )
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        issued = Issued(self.directory / f"{file_name}.crt", self.directory / f"{file_name}.key")
        issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        issued.key.write_bytes(_key_pem(key))
        return issued
