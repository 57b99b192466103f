"""Certificate renewal of a provisioned deployment (``fedtier provision renew``), without re-provisioning it.

Provisioned certificates last ``VALID_DAYS``. :func:`renew` re-issues the client certificates of some node
bundles (or of all, with the brokers' server and bridge certificates), each with a new key (the node's TLS key
is rotated), from the deployment's CA (``OUT/ca``), with the same common name and host names. The replaced
certificates are revoked: their serial numbers join the CA's revocation list (``OUT/ca/ca.crl``), copied into
every broker folder (``crlfile``). Running provisioned brokers are then reloaded (SIGHUP: Mosquitto rereads
its revocation list and its server certificate and key), so a copy of an old key and certificate no longer
logs in, while live connections stay. Ed25519 identities are unchanged. Each renewed bundle's
``client.crt``/``client.key`` go to their node, which takes them on ``systemctl reload`` (SIGHUP,
``protocols.transport.tls_reload``) without a restart. A revoked node's credentials are never re-issued
(:func:`revoked_nodes`): renewing all passes them over, naming them; renewing one by name is refused.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import NameOID

from protocols.config import ConfigError

from .broker_files import broker_folders, reload_brokers
from .pki import VALID_DAYS, certificate, load_pki, new_key, pem_cert, pem_key, write_file

CRL = "ca.crl"


@dataclass(frozen=True)
class Renewed:
    """What :func:`renew` re-issued (``folder/stem.crt`` files), the serial numbers it revoked, and what it did
    to each broker (one line each: reloaded, or not running)."""

    certificates: list[Path]
    revoked: list[int]
    brokers: list[str]
    passed_over: list[str] = field(default_factory=list)
    """The revoked nodes whose certificates were left as they are (renewing all)."""


def _hosts(cert: x509.Certificate) -> tuple[str, ...]:
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    return tuple(str(n.value) for n in names if isinstance(n, (x509.DNSName, x509.IPAddress)))


def _keep_owner(path: Path, stat: os.stat_result) -> None:
    """Give ``path`` the owner of the file it replaced (a broker that drops to its own user must still read it)."""
    if os.geteuid() == 0 and (stat.st_uid, stat.st_gid) != (0, 0):
        os.chown(path, stat.st_uid, stat.st_gid)


def certificates(out: Path, nodes: list[str] | None, revoked: frozenset[str] | None = None) -> list[Path]:
    """The certificate files :func:`renew` replaces: the named nodes' ``client.crt``, or every bundle's and the
    brokers' ``server.crt`` and ``bridge.crt``, those of ``revoked`` nodes (default: :func:`revoked_nodes`) left
    out. Naming a revoked node raises :class:`ConfigError`."""
    bundles = out / "nodes"
    revoked = revoked_nodes(out) if revoked is None else revoked
    if nodes is not None:
        missing = [n for n in nodes if not (bundles / n / "client.crt").exists()]
        if missing:
            raise ConfigError(f"no bundle with a certificate in {bundles} for: {', '.join(missing)}")
        if refused := [n for n in nodes if n in revoked]:
            raise ConfigError(
                f"{', '.join(refused)} {'was' if len(refused) == 1 else 'were'} revoked: a revoked node's "
                "certificate is never re-issued (its id is never reused: enroll a new node with fedtier provision "
                "add-device or add-cell)"
            )
        return [bundles / n / "client.crt" for n in nodes]
    found = [crt for crt in sorted(bundles.glob("*/client.crt")) if crt.parent.name not in revoked]
    for broker in broker_folders(out):
        if broker.parent.name == "cells" and broker.name in revoked:
            continue  # a revoked cell's broker: its bridge login and its server certificate both stay as they are
        found += [broker / name for name in ("server.crt", "bridge.crt") if (broker / name).exists()]
    return found


def revoked_nodes(out: Path) -> frozenset[str]:
    """The nodes of ``out`` that were revoked: those its federation's roster lists as revoked, and those whose
    bundle's certificate is on the revocation list (:func:`revoked_serials`; renewal revokes only the certificates
    it replaced, so a current one listed there was revoked with its node, whatever roster the folder has)."""
    from .federation import MembershipError, load_federation

    try:
        named = set(load_federation(out).roster.revoked)
    except MembershipError:  # a provisioning without a roster (or of an older fedtier): the revocation list says
        named = set()
    serials = set(revoked_serials(out))
    for crt in (out / "nodes").glob("*/client.crt"):
        try:
            serial = x509.load_pem_x509_certificate(crt.read_bytes()).serial_number
        except (OSError, ValueError) as exc:  # whether its node was revoked is unknown: renew nothing
            raise ConfigError(
                f"{crt} is not a readable certificate ({exc}): whether {crt.parent.name} was revoked is unknown, so "
                "nothing is renewed; put its bundle's client.crt back"
            ) from None
        if serial in serials:
            named.add(crt.parent.name)
    return frozenset(named)


def revoked_serials(out: Path) -> list[int]:
    """The serial numbers the deployment's revocation list holds (none before the first renewal or revocation),
    with those a federation's state lists (a revocation made before both shared ``OUT/ca/ca.crl``)."""
    import json

    from .federation import STATE_FILE

    path, state = out / "ca" / CRL, out / STATE_FILE
    found = [r.serial_number for r in x509.load_pem_x509_crl(path.read_bytes())] if path.exists() else []
    if state.exists():
        found += [int(s) for s in json.loads(state.read_text()).get("revoked_serials", [])]
    return sorted(set(found))


def renew(out: str | Path, nodes: list[str] | None = None, *, days: int | None = None) -> Renewed:
    """Re-issue the certificates :func:`certificates` lists (a new key each, ``days`` of validity, default the
    provisioning's), revoke the replaced ones, write the revocation list into ``OUT/ca`` and every broker and
    reload the running brokers."""

    out = Path(out)
    if not (out / "ca" / "ca.key").exists():
        raise ConfigError(f"{out} holds no provisioned CA (ca/ca.key): run fedtier provision first")
    pki = load_pki(out)
    revoked: list[int] = []
    renewed: list[Path] = []
    gone = revoked_nodes(out)
    passed_over = sorted(gone & {p.name for p in (out / "nodes").iterdir()}) if nodes is None else []
    for crt in certificates(out, nodes, gone):
        old = x509.load_pem_x509_certificate(crt.read_bytes())
        cn = str(old.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)
        key_path = crt.with_suffix(".key")
        owner = os.stat(crt)
        key = new_key()
        cert = certificate(cn, key, pki.name, pki.key, hosts=_hosts(old), days=days or VALID_DAYS)
        write_file(key_path, pem_key(key), secret=True)
        write_file(crt, pem_cert(cert))
        for f in (crt, key_path):
            _keep_owner(f, owner)
        revoked.append(old.serial_number)
        renewed.append(crt)
    revoked = revoke_serials(out, revoked)
    return Renewed(renewed, revoked, reload_brokers(broker_folders(out)), passed_over)


def revoke_serials(out: Path, serials: Iterable[int]) -> list[int]:
    """Add ``serials`` to the deployment's one revocation list (``OUT/ca/ca.crl``, what it held kept) and copy
    it into every broker folder (the caller reloads the brokers); returns every serial it now holds. Renewal
    and membership (``fedtier provision revoke``) both revoke through it, so neither undoes the other's."""
    revoked = sorted(set(revoked_serials(out)) | set(serials))
    crl = load_pki(out).crl(revoked)
    write_file(out / "ca" / CRL, crl)
    for broker in broker_folders(out):
        owner = os.stat(broker / "mosquitto.conf")
        write_file(broker / CRL, crl)
        _keep_owner(broker / CRL, owner)
    return revoked


def rotate_identity(out: str | Path, node: str) -> list[Path]:
    """Give ``node`` a new Ed25519 identity: its private key in ``OUT/keys.toml`` and its bundle, its public key
    in every bundle that knows it (its peers, the monitor). Returns the keys files rewritten. Peers must get
    their rewritten ``keys.toml`` too (a message signed with the old key is refused from then on); a
    federation's cloud keeps its signed roster, which must be re-issued with the new key."""
    from protocols.wire.keys import KeyRing, load_keys, new_seed, public_of, write_keys

    out = Path(out)
    ring = load_keys(out / "keys.toml")
    if node not in ring.private:
        raise ConfigError(f"{out / 'keys.toml'} has no identity for {node!r}")
    seed = new_seed()
    files = [out / "keys.toml", *sorted((out / "nodes").glob("*/keys.toml"))]
    written: list[Path] = []
    for path in files:
        held = load_keys(path, need_private=False)
        if node not in held.private and node not in held.public:
            continue
        owner = os.stat(path)
        private = {n: seed if n == node else k for n, k in held.private.items()}
        public = {n: public_of(seed) if n == node else k for n, k in held.public.items()}
        write_keys(path, KeyRing(private, public), comment=f"identity of {node!r} rotated", overwrite=True)
        _keep_owner(path, owner)
        written.append(path)
    return written


def next_steps(renewed: list[Path], brokers: list[str]) -> list[str]:
    """What the operator does after :func:`renew`, one step a line: each renewed node bundle's certificate and
    key copied to its node and the node told to reload (its systemd unit, SIGHUP); a broker that was not
    running here takes its files when it starts; a cell broker whose bridge certificate was renewed restarts
    (its bridge connects with the certificate it read at start)."""
    from .bundles import INSTALL_DIR, unit_name

    steps = []
    for crt in renewed:
        folder, node = crt.parent, crt.parent.name
        if crt.name == "client.crt" and folder.parent.name == "nodes":
            unit = folder / unit_name(node)
            how = (
                f"systemctl reload {unit_name(node)} (SIGHUP: no restart)"
                if unit.exists()
                else f"restart its fedtier {node} command (a one-job node reads them when it starts)"
            )
            steps.append(
                f"copy {crt} and {crt.with_suffix('.key')} to {INSTALL_DIR}/{node}/ on {node}'s host, then {how}"
            )
        elif crt.name == "bridge.crt":
            steps.append(f"restart the broker of {folder} (its bridge to the cloud broker presents {crt})")
    steps += [
        f"{line.split(': ', 1)[0]}: start it with its renewed files, or copy them to where it runs and reload it"
        for line in brokers
        if "not running" in line
    ]
    return steps
