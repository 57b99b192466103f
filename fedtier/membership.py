"""A provisioned federation's membership, changed while it runs: enroll a device or a cell, revoke a node.

``fedtier provision`` records what it provisioned in ``OUT/federation.json`` (the deployment config, with
its membership, and the provisioning parameters) and the first signed roster in ``OUT/roster.json`` (and
the cloud's bundle). :func:`add_device`, :func:`add_cell` and :func:`revoke` change one member:

- identities: a new Ed25519 key (``keys.toml``), a client certificate, a bundle (``OUT/nodes/{node}``);
  revoking drops the node's key from every peer's keys file and lists its certificate in the CA's
  revocation list (``ca.crl`` of every broker);
- broker: the node's ACL entries added or removed (its login is its certificate), then the running Mosquitto
  reloaded (SIGHUP to the pid in its ``mosquitto.pid``; Mosquitto rereads its ACL and CRL files);
- roster: a new version, signed with the cloud's key (``protocols.roster``), written to ``OUT/roster.json``
  and the cloud's bundle, and published retained on the roster topic with the operator's login
  (:func:`publish_roster`): the running cloud takes it, so the next job plans the new membership and the
  running job drops a revoked cell at once (``cloud.server.CloudServer.revoke``), and cells refuse a revoked
  device at once.

Ids are never reused: a revoked id stays revoked (the roster lists it), so an old key or certificate can
never come back under it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from protocols.config import TopologySection
from protocols.roster import roster_topic
from protocols.wire import topics
from protocols.wire.chunking import DEFAULT_MAX_CHUNK
from protocols.wire.keys import new_seed, public_of, write_keys

from .broker_files import broker_folders, reload_brokers
from .federation import (
    ROSTER_FILE,
    Federation,
    MembershipError,
    _members,
    _save,
    _write,
    check_roster_fits,
    load_federation,
)
from .renewal import revoke_serials


# ------------------------------------------------------------------------------------------ brokers
def _broker_dirs(fed: Federation, cell: str | None) -> list[Path]:
    """The broker folders whose login and ACL files name ``cell``'s members (the cloud broker's when shared)."""
    if fed.params.get("per_cell") and cell is not None:
        return [fed.out / "cells" / cell]
    return [fed.out / "broker"]


def _rewrite_broker(fed: Federation, folder: Path, users: list[str]) -> None:
    """``folder``'s ACL becomes that of ``users``: a user not in it may use no topic there (and its certificate
    is revoked by the caller)."""
    from .acl import acl_file, acl_rules, bridge_rules, bridge_user

    rules = acl_rules(fed.cfg)
    for cell in fed.cfg.topology.cell_ids():
        rules[bridge_user(cell)] = bridge_rules(fed.name, cell)
    wanted = {u: rules[u] for u in users if u in rules}
    _write(folder / "acl", acl_file(wanted))


def _users(folder: Path) -> list[str]:
    """The users ``folder``'s broker knows: those its ACL names."""
    return [line[len("user ") :] for line in (folder / "acl").read_text().splitlines() if line.startswith("user ")]


# ------------------------------------------------------------------------------------------ changes
@dataclass(frozen=True)
class Change:
    """What a membership change did: the bundle written (if any), the roster's new version, the brokers."""

    node: str
    bundle: Path | None
    version: int
    brokers: list[str]


def _url(fed: Federation, cell: str) -> str:
    p = fed.params
    if p.get("per_cell"):
        port = p.get("cell_ports", {}).get(cell, p["cell_port"])  # older provisionings: one port for all
        return f"mqtts://{str(p['cell_host']).replace('{cell}', cell)}:{port}"
    return f"mqtts://{p['host']}:{p['port']}"


def _refresh_keys(fed: Federation, nodes: list[str]) -> None:
    """Rewrite the keys files of ``nodes``' bundles (their peers' public keys follow the membership)."""
    from .bundles import key_subset

    for node in nodes:
        path = fed.out / "nodes" / node / "keys.toml"
        if path.parent.is_dir():
            write_keys(
                path, key_subset(fed.ring, fed.cfg, node), comment=f"node {node!r} of {fed.name!r}", overwrite=True
            )


def _check_new(fed: Federation, node: str) -> None:
    topics.check_name("node", node)
    if node in fed.roster.revoked:
        raise MembershipError(f"{node!r} was revoked; a revoked id is never reused (choose another)")
    if node in fed.ring.public or fed.cfg.topology.cell_of(node) is not None or node in fed.cfg.topology.cell_ids():
        raise MembershipError(f"{node!r} is already a node of federation {fed.name!r}")


def _new_identity(fed: Federation, node: str) -> bytes:
    """A fresh Ed25519 identity for ``node`` in the federation's keys; its public key."""
    seed = new_seed()
    fed.ring.private[node], fed.ring.public[node] = seed, public_of(seed)
    return fed.ring.public[node]


def _enroll(fed: Federation, node: str, cell: str, folders: list[Path], peers: list[str]) -> Change:
    """The rest of enrolling ``node`` (its identity and roster entry made): a login and ACL on ``folders``'
    brokers, its certificate and bundle, the saved state and roster, its ``peers``' keys files, the reload."""
    from .bundles import write_bundle
    from .pki import load_pki

    p = fed.params
    check_roster_fits(fed.ring, fed.roster, int(p.get("max_chunk") or DEFAULT_MAX_CHUNK))  # before a file changes
    for folder in folders:
        _rewrite_broker(fed, folder, [*_users(folder), node])
    bundle = write_bundle(
        fed.out,
        load_pki(fed.out),
        fed.ring,
        fed.cfg,
        node,
        _url(fed, cell),
        p.get("max_device_weight"),
        bool(p.get("federation")),
        p.get("fedtier_bin") or "fedtier",
    )
    _save(fed)
    _refresh_keys(fed, peers)
    return Change(node, bundle, fed.roster.version, reload_brokers(folders))


def add_device(out: str | Path, cell: str, device: str, max_weight: float | None = None) -> Change:
    """Enroll ``device`` in ``cell``: identity, certificate, bundle, broker login and ACL, roster."""

    fed = load_federation(out)
    if cell not in fed.cfg.topology.cell_ids():
        raise MembershipError(f"no cell {cell!r} in federation {fed.name!r} ({', '.join(fed.cfg.topology.cell_ids())})")
    _check_new(fed, device)
    members = _members(fed.cfg.topology)
    members[cell].append(device)
    fed.cfg = fed.cfg.model_copy(update={"topology": TopologySection(members=members)})
    bound = float(max_weight or fed.params.get("max_device_weight") or fed.cfg.security.max_device_weight or 1e12)
    fed.roster = fed.roster.with_device(cell, device, _new_identity(fed, device), bound)
    return _enroll(fed, device, cell, _broker_dirs(fed, cell), ["cloud", cell, "monitor"])


def add_cell(out: str | Path, cell: str) -> Change:
    """Enroll a new cell (no devices yet: add them with :func:`add_device`). Shared-broker federations only:
    a per-cell broker is provisioned with the federation."""

    fed = load_federation(out)
    if fed.params.get("per_cell"):
        raise MembershipError("add-cell: this federation has a broker per cell; provision the new cell's broker anew")
    _check_new(fed, cell)
    members = {**_members(fed.cfg.topology), cell: []}
    fed.cfg = fed.cfg.model_copy(update={"topology": TopologySection(members=members)})
    fed.roster = fed.roster.with_cell(cell, _new_identity(fed, cell))
    return _enroll(fed, cell, cell, _broker_dirs(fed, None), ["cloud", "monitor"])


def revoke(out: str | Path, node: str, before_reload: Callable[[], None] | None = None) -> Change:
    """Revoke a device (or a cell with its devices): login and ACL removed, certificate revoked (a cell's
    broker's bridge certificate too), key dropped from its peers' keys files, roster without it (and listing it
    as revoked). ``before_reload``: called once the roster is written, before the brokers reload their logins and
    ACLs (publishing it there: the revoked node's live connection still reads it then, and its agent stops; after
    the reload its ACL lets nothing reach it)."""
    fed = load_federation(out)
    topo = fed.cfg.topology
    if node in topo.cell_ids():
        gone, cell = [node, *topo.device_ids(node)], node
    elif (home := topo.cell_of(node)) is not None:
        gone, cell = [node], home
    elif node in fed.roster.revoked:  # walked: it said "not a cell or a device" of a node revoked before
        raise MembershipError(f"{node!r} is revoked already (roster version {fed.roster.version}): nothing to do")
    else:
        raise MembershipError(f"{node!r} is not a cell or a device of federation {fed.name!r}")
    if len(topo.cell_ids()) == 1 and node == cell:
        raise MembershipError(f"{node!r} is the federation's only cell")
    members = {c: [d for d in devs if d not in gone] for c, devs in _members(topo).items() if c not in gone}
    fed.cfg = fed.cfg.model_copy(update={"topology": TopologySection(members=members)})
    fed.roster = fed.roster.without(node)
    certs = [fed.out / "nodes" / n / "client.crt" for n in gone]
    if node == cell:  # a per-cell broker's bridge logs in at the cloud broker with its own certificate
        certs.append(fed.out / "cells" / cell / "bridge.crt")
    fed.revoked_serials += [x509.load_pem_x509_certificate(c.read_bytes()).serial_number for c in certs if c.exists()]
    for n in gone:
        fed.ring.private.pop(n, None)
        fed.ring.public.pop(n, None)
    fed.revoked_serials = revoke_serials(fed.out, fed.revoked_serials)  # the one list renewals add to too
    folders = _broker_dirs(fed, cell) if node != cell else _broker_dirs(fed, None)
    for folder in folders:
        _rewrite_broker(fed, folder, [u for u in _users(folder) if u not in gone])
    _save(fed)
    _refresh_keys(fed, ["cloud", "monitor", *([cell] if node != cell else [])])
    try:
        if before_reload is not None:
            before_reload()
    finally:  # (the reload, whatever the publishing did)
        reloaded = reload_brokers(broker_folders(fed.out))
    return Change(node, None, fed.roster.version, reloaded)


def rotate_identities(out: str | Path, nodes: list[str]) -> tuple[list[Path], int | None]:
    """Give ``nodes`` new Ed25519 identities (``renewal.rotate_identity``: every keys file that knows them) and the
    roster a new version with their new public keys, signed with the cloud's key (its new one where it is among
    ``nodes``). The roster is where cells and agents learn their peers' keys, over their keys files: left with the old
    keys, every cell took a rotated device's old key back from it at each job (its new signatures refused, the old key,
    a leaked one say, still taken), and a rotated cloud key left ``OUT`` unreadable (its roster signed by the old).
    Returns the keys files rewritten and the roster's new version (to publish: :func:`publish_roster`; ``None``: a
    folder provisioned before rosters, which has none)."""
    from protocols.wire.keys import load_keys

    from .renewal import rotate_identity

    try:
        fed = load_federation(out)
    except MembershipError:
        return sorted({path for node in nodes for path in rotate_identity(out, node)}), None
    written = sorted({path for node in nodes for path in rotate_identity(fed.out, node)})
    fed.ring = load_keys(fed.out / "keys.toml")
    for node in nodes:
        fed.roster = fed.roster.with_key(node, fed.ring.public.get(node) if fed.roster.is_member(node) else None)
    _save(fed, keys=False)
    return written, fed.roster.version


# ------------------------------------------------------------------------------------------ publishing
def publish_roster(out: str | Path, timeout: float = 15.0) -> str:
    """Publish ``OUT/roster.json`` (retained) with the operator's bundle (``OUT/nodes/operator``): the running
    cloud and cells take it. Returns a line saying so; raises ``ConnectionError`` if the broker is unreachable."""
    from edge_agent.runner import BrokerOptions
    from protocols.config import load_config
    from protocols.transport.threadloop import ThreadLoop

    out = Path(out).resolve()  # absolute: it is read again from inside the bundle below
    fed = load_federation(out)
    bundle = out / "nodes" / "operator"
    cwd = os.getcwd()
    os.chdir(bundle)  # the bundle's paths (TLS files) are relative to it
    try:
        cfg = load_config(bundle / "config.toml")
        opts = BrokerOptions.from_config(cfg, None)
        loop = ThreadLoop("fedtier-roster").start()
        try:
            transport = opts.transport("operator", fed.name, loop, persistent=False).connect()
            data = (out / ROSTER_FILE).read_bytes()
            topic = roster_topic(fed.name)
            done: list[bool] = []

            def echo(_topic: str, got: bytes) -> None:  # the broker holds it once it hands it back to us
                if got == data:
                    done.append(True)

            transport.subscribe(topic, echo)
            transport.publish(topic, data, retain=True)
            end = time.monotonic() + timeout
            while not done and time.monotonic() < end:
                time.sleep(0.05)
            transport.close()
        finally:
            loop.stop()
    finally:
        os.chdir(cwd)
    if not done:
        raise ConnectionError(f"the broker did not acknowledge the roster within {timeout:.0f} s")
    return f"published roster version {fed.roster.version} on {roster_topic(fed.name)}"
