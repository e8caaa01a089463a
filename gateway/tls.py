"""The ingress's TLS key and certificate: ``pubcomp gateway make-cert``.

A node pins one certificate (docs/firmware.md): by default the gateway's own
self-signed one, made here with an ECDSA P-256 key (the cheapest handshake
for an ESP32 or a Pico W's mbedTLS). A site that runs its own CA passes
``--ca-cert/--ca-key``: the certificate is then signed by the CA, and nodes
pin the CA (``ingress.tls_ca``) so the gateway's certificate can be renewed
without touching them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .errors import CertError

DEFAULT_DAYS = 3650  # a field gateway is visited rarely; rotate with a new make-cert


def _names(names: list[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for n in dict.fromkeys(names):
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return out


def make_cert(
    out_dir: Path,
    gateway_id: str,
    names: list[str],
    *,
    days: int = DEFAULT_DAYS,
    ca_cert: Path | None = None,
    ca_key: Path | None = None,
    force: bool = False,
) -> tuple[Path, Path]:
    """Write ``ingress.key`` (mode 0600) and ``ingress.crt`` in ``out_dir``; their paths.

    The certificate names the gateway id first (nodes check it as the server
    name), then every host name or IP address in ``names``.
    """
    key_path, cert_path = out_dir / "ingress.key", out_dir / "ingress.crt"
    if not force:
        for p in (key_path, cert_path):
            if p.exists():
                raise CertError(f"{p}: exists; pass --force to replace it (nodes pin the old one)")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, gateway_id)])
    now = dt.datetime.now(dt.UTC)
    if ca_cert is not None:
        if ca_key is None:
            raise CertError("--ca-cert needs --ca-key")
        try:
            issuer_cert = x509.load_pem_x509_certificate(ca_cert.read_bytes())
            issuer_key = serialization.load_pem_private_key(ca_key.read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise CertError(f"{ca_cert} / {ca_key}: cannot load the site CA: {exc}") from None
        issuer, signer, is_ca = issuer_cert.subject, issuer_key, False
        aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key())  # type: ignore[arg-type]
    else:
        # Self-signed: the certificate is its own trust anchor, so it is marked as a
        # CA (path length 0) for verifiers that want an anchor to be one.
        issuer, signer, is_ca = subject, key, True
        aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key())
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(_names([gateway_id, *names])), critical=False)
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=0 if is_ca else None), True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=is_ca,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .add_extension(aki, critical=False)
    )
    cert = builder.sign(signer, hashes.SHA256())  # type: ignore[arg-type]
    out_dir.mkdir(parents=True, exist_ok=True)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    tmp = key_path.with_suffix(".key.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_pem)
    os.replace(tmp, key_path)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def fingerprint(cert_pem: bytes) -> str:
    cert = x509.load_pem_x509_certificate(cert_pem)
    return cert.fingerprint(hashes.SHA256()).hex(":")


def server_name(cert_pem: bytes) -> str | None:
    """The first DNS name of a certificate (make-cert puts the gateway id there)."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    dns = san.get_values_for_type(x509.DNSName)
    return dns[0] if dns else None


def first_certificate(pem: bytes, where: str) -> bytes:
    """The first certificate of a PEM file, as PEM (a node pins exactly one)."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        raise CertError(f"{where}: not a PEM certificate") from None
    return cert.public_bytes(serialization.Encoding.PEM)


def make_cert_command(args: argparse.Namespace) -> int:
    try:
        key_path, cert_path = make_cert(
            Path(args.out_dir),
            args.gateway,
            args.name or [],
            days=args.days,
            ca_cert=Path(args.ca_cert) if args.ca_cert else None,
            ca_key=Path(args.ca_key) if args.ca_key else None,
            force=args.force,
        )
    except CertError as exc:
        print(f"pubcomp gateway make-cert: {exc}", file=sys.stderr)
        return 1
    fp = fingerprint(cert_path.read_bytes())
    print(f"key:         {key_path} (mode 0600: chgrp pubcomp, chmod 0640 for the service)")
    print(f"certificate: {cert_path}")
    print(f"sha256:      {fp}")
    print("in the fleet file, under the gateway's ingress:")
    print(f"  tls_cert: {cert_path.resolve()}")
    print(f"  tls_key: {key_path.resolve()}")
    if args.ca_cert:
        print(f"  tls_ca: {Path(args.ca_cert).resolve()}")
    return 0
