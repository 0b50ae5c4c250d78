"""Certificates and keys for a Flower deployment with TLS and SuperNode authentication.

Writes into OUT:

* ``ca.crt`` / ``ca.key``: a self-signed certificate authority (every SuperNode and ``flwr``
  verify the SuperLink against ``ca.crt``);
* ``server.pem`` / ``server.key``: the SuperLink's TLS certificate, signed by the CA, valid for
  every ``--host`` given (IP addresses or DNS names) plus ``localhost`` and ``127.0.0.1``;
* ``node-<i>`` / ``node-<i>.pub`` for i = 0..N-1: each SuperNode's ECDSA P-384 key pair in
  OpenSSH format (what ``flower-supernode --auth-supernode-private-key`` reads and
  ``flwr supernode register`` takes).

Uses the ``cryptography`` package that Flower already depends on. For tests and prototypes: in
production, certificates come from the site's own CA and keys are made on each node.

Usage: fedadapt-deploy certs OUT --nodes N [--host HOST ...] [--days 30]
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedadapt deployment"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM,
                             serialization.PrivateFormat.TraditionalOpenSSL,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    path.chmod(0o600 if private else 0o644)


def make_ca(out: Path, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA certificate and key."""
    key = ec.generate_private_key(ec.SECP384R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name("fedadapt CA"))
            .issuer_name(_name("fedadapt CA")).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    _write(out / "ca.crt", cert.public_bytes(serialization.Encoding.PEM))
    _write(out / "ca.key", _pem_key(key), private=True)
    return cert, key


def make_server(out: Path, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
                hosts: list[str], days: int) -> None:
    """The SuperLink's certificate for ``hosts`` (+ localhost, 127.0.0.1), signed by the CA."""
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys([*hosts, "localhost", "127.0.0.1"]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP384R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(hosts[0] if hosts else "localhost"))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write(out / "server.pem", cert.public_bytes(serialization.Encoding.PEM))
    _write(out / "server.key", _pem_key(key), private=True)


def make_node_keys(out: Path, n: int) -> None:
    """``node-<i>`` (OpenSSH private key) and ``node-<i>.pub`` for each SuperNode."""
    for i in range(n):
        key = ec.generate_private_key(ec.SECP384R1())
        _write(out / f"node-{i}", key.private_bytes(serialization.Encoding.PEM,
                                                    serialization.PrivateFormat.OpenSSH,
                                                    serialization.NoEncryption()), private=True)
        _write(out / f"node-{i}.pub", key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--nodes", type=int, required=True, help="SuperNode key pairs to make")
    parser.add_argument("--host", action="append", default=[],
                        help="the SuperLink's address as the SuperNodes reach it (repeatable)")
    parser.add_argument("--days", type=int, default=30)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ca, ca_key = make_ca(args.out, args.days)
    make_server(args.out, ca, ca_key, args.host, args.days)
    make_node_keys(args.out, args.nodes)
    print(f"{args.out}: ca.crt, server.pem/key for {args.host + ['localhost', '127.0.0.1']}, "
          f"{args.nodes} SuperNode key pairs")


if __name__ == "__main__":
    main()
