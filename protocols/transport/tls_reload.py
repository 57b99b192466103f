"""Renewed TLS client certificates taken by a running node, without a restart (SIGHUP).

Every MQTT client with a client certificate registers its TLS context here (:func:`track`, from
``paho_client.new_client``). :func:`reload_all` re-reads each context's certificate and key files into it,
after :func:`check_material` found them usable (the key is the certificate's, the certificate is signed by
the node's CA file and valid now); unusable files are reported and the context keeps what it had. A live
connection stays as it is (the broker authenticated it at its handshake): every later (re)connect presents
the new certificate. A connection opened later (the next job's) reads the files anyway.
"""

from __future__ import annotations

import logging
import os
import ssl
import tempfile
import threading
import weakref
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
_live: weakref.WeakKeyDictionary[ssl.SSLContext, tuple[str, str, str | None]] = weakref.WeakKeyDictionary()


def track(client: Any, certfile: str | None, keyfile: str | None, ca_certs: str | None) -> None:
    """Register the TLS context of paho ``client`` (set by its ``tls_set``) for :func:`reload_all`."""
    context = getattr(client, "_ssl_context", None)
    if context is None or not certfile:
        return
    with _lock:
        _live[context] = (certfile, keyfile or certfile, ca_certs)


@dataclass(frozen=True)
class Reloaded:
    """The outcome of one certificate file's reload: ``error`` is ``None`` when its contexts took it."""

    certfile: str
    contexts: int
    serial: int | None = None
    not_after: datetime | None = None
    error: str | None = None


def check_material(certfile: str, keyfile: str, ca_certs: str | None) -> tuple[int, datetime]:
    """The serial number and end of validity of ``certfile`` if it is usable with ``keyfile``: its key, valid
    now, signed by one of the certificates in ``ca_certs`` (when given). Raises ``ValueError`` saying why not."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    try:
        cert = x509.load_pem_x509_certificate(Path(certfile).read_bytes())
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(certfile, keyfile)  # the key is the cert's
    except (OSError, ValueError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load {certfile} with {keyfile}: {exc}") from None
    now = datetime.now(UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        span = f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} to {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
        raise ValueError(f"{certfile} is not valid now (valid {span})")
    if ca_certs:
        try:
            cas = x509.load_pem_x509_certificates(Path(ca_certs).read_bytes())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the CA certificates in {ca_certs}: {exc}") from None
        why = "no CA certificate"
        for ca in cas:  # a CA file may hold several (a CA rotation: the old and the new), as TLS reads it
            try:
                cert.verify_directly_issued_by(ca)
                break
            except (ValueError, TypeError, InvalidSignature) as exc:
                why = str(exc) or "bad signature"
        else:
            raise ValueError(f"{certfile} is not signed by a CA in {ca_certs} ({why})")
    return cert.serial_number, cert.not_valid_after_utc


def reload_all() -> list[Reloaded]:
    """Load each tracked context's certificate and key files again (checked first); one outcome a file."""
    with _lock:
        by_files: dict[tuple[str, str, str | None], list[ssl.SSLContext]] = {}
        for context, files in list(_live.items()):
            by_files.setdefault(files, []).append(context)
    done = []
    for (certfile, keyfile, ca_certs), contexts in by_files.items():
        try:
            serial, not_after = _take(certfile, keyfile, ca_certs, contexts)
        except (ValueError, OSError, ssl.SSLError) as exc:
            done.append(Reloaded(certfile, len(contexts), error=str(exc)))
            continue
        done.append(Reloaded(certfile, len(contexts), serial, not_after))
    return done


def _take(certfile: str, keyfile: str, ca_certs: str | None, contexts: list[ssl.SSLContext]) -> tuple[int, datetime]:
    """Read the pair once, check that copy (:func:`check_material`) and load that copy into ``contexts``: files
    replaced meanwhile (the operator copying the next pair) cannot give a context a certificate with another
    key, which a failed load would leave it with, and no key (no handshake at all)."""
    pem = Path(certfile).read_bytes(), Path(keyfile).read_bytes()
    with tempfile.TemporaryDirectory(prefix="fedtier-tls-") as tmp:  # mode 0700, removed at once
        crt, key = Path(tmp) / "client.crt", Path(tmp) / "client.key"
        for path, data in ((crt, pem[0]), (key, pem[1])):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(data)
        try:
            found = check_material(str(crt), str(key), ca_certs)
        except ValueError as exc:  # named by the node's files, not the copy's
            raise ValueError(str(exc).replace(str(crt), certfile).replace(str(key), keyfile)) from None
        for context in contexts:
            context.load_cert_chain(crt, key)
    return found


def reload_and_log() -> list[Reloaded]:
    """:func:`reload_all`, each outcome logged (an error for files that could not be taken)."""
    done = reload_all()
    for r in done:
        if r.error is not None:
            log.error("TLS reload: %s; %d connection(s) keep their current certificate", r.error, r.contexts)
        else:
            log.warning(
                "TLS reload: %d connection(s) now present %s (serial %x, valid until %s) at their next (re)connect",
                r.contexts,
                r.certfile,
                r.serial,
                r.not_after,
            )
    if not done:
        log.warning("TLS reload: no connection with a client certificate to reload")
    return done
