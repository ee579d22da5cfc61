"""The cluster CA of the internal plane's mutual TLS: made by a launcher (`kvferry up`'s process, the
Ray controller), whose memory alone holds its key; every process it starts gets the CA certificate and
a leaf of its own (kvferry.auth.TlsMaterial, handed on by environment).

The CA is an EC P-256 key with a self-signed certificate (a CA for leaves only: path length 0). A leaf
is an EC P-256 key with a certificate for both ends of a connection (clientAuth + serverAuth), naming
`kvferry.auth.CLUSTER_NAME` as a DNS name (and the process's IP address when known): clients verify
every server against that name, so any address works. Both are valid `VALIDITY` from their making; a
leaf never outlives its CA.
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
from collections.abc import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvferry.auth import CLUSTER_NAME, TlsMaterial

VALIDITY = datetime.timedelta(days=30)
CLOCK_SKEW = datetime.timedelta(minutes=5)  # certificates are valid from a little before their making


class ClusterCA:
    """A CA key and certificate in memory; `issue` signs a leaf for one process."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate):
        self._key = key
        self.cert = cert

    @classmethod
    def create(cls, validity: datetime.timedelta = VALIDITY) -> ClusterCA:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{CLUSTER_NAME} CA")])
        now = _now()
        public = key.public_key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + validity)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(cert_sign=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self, ip: str | Sequence[str] | None = None, validity: datetime.timedelta = VALIDITY
    ) -> TlsMaterial:
        """A new key and leaf certificate for one process: CLUSTER_NAME, plus `ip` (an address or a host
        name, or several: kvferry's clients check CLUSTER_NAME; other users, e.g. Ray's TLS, the
        address they dial)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        hosts = [ip] if isinstance(ip, str) else list(ip or [])
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CLUSTER_NAME)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(min(now + validity, self.cert.not_valid_after_utc))
            .add_extension(x509.SubjectAlternativeName(_names(hosts)), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(cert_sign=False), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return TlsMaterial(ca=self.cert_pem, cert=cert.public_bytes(serialization.Encoding.PEM), key=key_pem)


@functools.cache
def launcher_ca() -> ClusterCA:
    """The CA of every TLS cluster this process launches (made on first use), as one cluster secret
    serves every cluster a process runs: the leaf this process takes talks to each of them."""
    return ClusterCA.create()


def _names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName(CLUSTER_NAME)]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _key_usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)
