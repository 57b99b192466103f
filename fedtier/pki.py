"""The certificate authority of a provisioning: keys, X.509 certificates and revocation lists (PEM files).

``fedtier provision`` makes one CA per deployment (``OUT/ca``); it signs every broker's server certificate,
every bridge's and node's client certificate, and the revocation list the brokers read (``ca.crl``).
``fedtier provision renew`` (``renewal.py``) and membership changes (``membership.py``) load it again with
:func:`load_pki`.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from protocols.config import ConfigError

VALID_DAYS = 365
CRL_DAYS = 10 * 365


def new_key() -> ec.EllipticCurvePrivateKey:
    """A fresh P-256 private key (of a CA, a broker, a bridge or a node's TLS client)."""
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: str,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    hosts: tuple[str, ...] = (),
    days: int = VALID_DAYS,
) -> x509.Certificate:
    """A certificate for ``key`` with common name ``subject``, signed by ``issuer_key`` (``hosts``: its
    subject alternative names, IP addresses or DNS names), valid from five minutes ago for ``days``."""
    now = dt.datetime.now(dt.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if hosts:
        names: list[x509.GeneralName] = []
        for h in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                names.append(x509.DNSName(h))
        b = b.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def write_file(path: Path, data: bytes | str, secret: bool = False) -> None:
    """Replace ``path`` whole and durably (``protocols.checkpoint.write_durably``: a crash or a full disk leaves the
    old file, never a truncated one, and a revocation list written survives a power loss), keeping the owner and
    mode of the file it replaces; a new one is mode 600 when ``secret``, else 644."""
    from protocols.checkpoint import write_durably

    def keep(tmp: Path) -> None:
        try:
            st = path.stat()
        except FileNotFoundError:
            if not secret:
                os.chmod(tmp, 0o644)
            return
        os.chmod(tmp, st.st_mode & 0o7777)
        try:
            os.chown(tmp, st.st_uid, st.st_gid)
        except PermissionError:
            pass  # not root: the file is ours, as it was

    write_durably(path, data.encode() if isinstance(data, str) else data, private=secret, before_rename=keep)


def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    """``key`` as unencrypted PKCS#8 PEM."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def pem_cert(cert: x509.Certificate) -> bytes:
    """``cert`` as PEM."""
    return cert.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class CertificateAuthority:
    """A deployment's CA: its name (the issuer's common name), key and self-signed certificate."""

    name: str
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    def issue(self, folder: Path, stem: str, cn: str, hosts: tuple[str, ...] = ()) -> None:
        """Write ``stem.key`` (mode 600), ``stem.crt`` signed by this CA, and ``ca.crt`` into ``folder``."""
        key = new_key()
        write_file(folder / f"{stem}.key", pem_key(key), secret=True)
        write_file(folder / f"{stem}.crt", pem_cert(certificate(cn, key, self.name, self.key, hosts=hosts)))
        write_file(folder / "ca.crt", pem_cert(self.cert))

    def crl(self, revoked: list[int]) -> bytes:
        """A PEM revocation list of the certificate serial numbers ``revoked``, signed by this CA (valid for
        ``CRL_DAYS``: a broker refuses every client once its list has expired)."""
        now = dt.datetime.now(dt.UTC)
        b = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(self.cert.subject)
            .last_update(now - dt.timedelta(minutes=5))
            .next_update(now + dt.timedelta(days=CRL_DAYS))
        )
        for serial in sorted(set(revoked)):
            b = b.add_revoked_certificate(
                x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
            )
        return b.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def load_pki(out: str | Path) -> CertificateAuthority:
    """The CA of the provisioning in ``out`` (``OUT/ca``), to issue or revoke certificates with."""
    ca = Path(out) / "ca"
    key = serialization.load_pem_private_key((ca / "ca.key").read_bytes(), None)
    cert = x509.load_pem_x509_certificate((ca / "ca.crt").read_bytes())
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{ca / 'ca.key'}: not the EC key fedtier provision writes")
    name = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    return CertificateAuthority(str(name), key, cert)
