"""Provisioning a deployment: a CA, certificates, node identities, Mosquitto config with ACLs, bundles.

:func:`provision` writes, for a run config::

    OUT/ca/ca.crt, ca.key            the CA (keep ca.key offline)
    OUT/keys.toml                    every node's Ed25519 identity (keep offline; `fedtier keys`)
    OUT/broker/                      mosquitto.conf (TLS listener), listener.conf (its options alone),
                                     server.crt/.key, ca.crt, ca.crl, acl (per node: what it may read
                                     and write); a login is a client certificate, there are no passwords
    OUT/cells/{cell}/                with per_cell: that cell's broker (the same files, plus bridge.crt/.key)
    OUT/nodes/{node}/                one bundle per node (cloud, each cell, each device, monitor):
                                     config.toml (broker URL, user name, TLS files, keys), keys.toml
                                     (its private key, its peers' public keys; the monitor's: every
                                     node's public key), client.crt/.key, ca.crt

With ``per_cell`` (the fleet-scale layout of ``protocols/transport/bridge.py``), ``OUT/cells/{cell}/``
holds one more broker per cell (its own server certificate and ACL for the cell server and its devices
only, and a TLS bridge to the cloud broker that logs in with its own client certificate, user
``bridge.CELL``); the cloud broker in ``OUT/broker`` then knows only ``cloud``, ``monitor`` and the bridges,
each allowed exactly its cell's bridged topics. Cell and device bundles point at their cell broker.

The parts: ``pki.py`` (the CA and certificates), ``acl.py`` (who may use which topic), ``broker_files.py`` (a
broker's folder), ``bundles.py`` (a node's bundle and systemd unit); this module puts them together.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from protocols.config import ConfigError, RunConfig, deployment_config
from protocols.jobs import OPERATOR
from protocols.transport.bridge import bridge_config
from protocols.wire.chunking import DEFAULT_MAX_CHUNK
from protocols.wire.keys import KeyRing, generate_keys, new_seed, public_of, write_keys

from .acl import MONITOR, Grants, acl_rules, bridge_rules, bridge_user
from .broker_files import broker_user_for_root, cell_ports, write_broker
from .bundles import FEDTIER_BIN, ignored_by_federation, write_bundle
from .federation import check_roster_fits, first_roster, record_federation
from .pki import CertificateAuthority, certificate, new_key, pem_cert, pem_key, write_file


@dataclass(frozen=True)
class Provisioned:
    """What :func:`provision` wrote: the output folder, the broker's folder and each node's bundle."""

    out: Path
    broker: Path
    bundles: dict[str, Path]
    cell_brokers: dict[str, Path] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    """What the operator should fix or know (e.g. root without a broker user)."""


@dataclass(frozen=True)
class BrokerLayout:
    """Where the brokers of a provisioning listen and how they run (recorded in the federation's state, which
    membership changes read back)."""

    host: str
    """The cloud broker's host name or address (its certificate's, and the URL of the bundles that use it)."""
    port: int
    """The cloud broker's TLS port."""
    max_chunk: int
    """Every fedtier node sends messages larger than this as chunks, so a broker refuses any MQTT packet
    larger than a chunk plus room for the topic (``max_packet_size``): an oversized single payload never
    reaches a node."""
    per_cell: bool
    """One broker per cell in ``OUT/cells/CELL`` for the cell server and its devices, bridged over TLS to the
    cloud broker in ``OUT/broker`` (which then has users ``cloud``, ``operator``, ``monitor`` and one
    ``bridge.CELL`` per cell, allowed exactly that cell's bridged topics)."""
    cell_host: str
    """A cell broker's host, where ``{cell}`` is replaced by the cell id."""
    cell_port: int
    """The first cell broker's port."""
    cell_ports: dict[str, int]
    """Each cell broker's port: ``cell_port`` for the first cell, +1 for each next one, so that cell brokers
    on one host do not collide (:func:`~fedtier.broker_files.cell_ports`)."""
    broker_user: str | None
    """The user a broker started as root drops to (:func:`~fedtier.broker_files.write_broker`; as root
    without one: :func:`~fedtier.broker_files.broker_user_for_root`)."""
    bind: str
    """The brokers' listen address (default: all interfaces)."""

    @property
    def max_packet(self) -> int:
        """A chunk, its topic and the MQTT header."""
        return self.max_chunk + 4096


def _new_ca(out: Path, run: str) -> CertificateAuthority:
    """The deployment's CA, written to ``OUT/ca`` (``ca.key`` mode 600: keep it offline)."""
    name = f"fedtier {run} CA"
    key = new_key()
    pki = CertificateAuthority(name, key, certificate(name, key, name, key, ca=True))
    write_file(out / "ca" / "ca.key", pem_key(key), secret=True)
    write_file(out / "ca" / "ca.crt", pem_cert(pki.cert))
    return pki


def _new_identities(out: Path, cfg: RunConfig, max_device_weight: float | None, max_chunk: int) -> KeyRing:
    """Every node's Ed25519 identity and the operator's (it signs jobs, ``fedtier submit``), in ``OUT/keys.toml``;
    :class:`ConfigError`, with nothing written, when their roster would not fit one chunk (``check_roster_fits``)."""
    ring = generate_keys(cfg.topology)
    ring.private[OPERATOR] = new_seed()
    ring.public[OPERATOR] = public_of(ring.private[OPERATOR])
    check_roster_fits(ring, first_roster(cfg, ring, max_device_weight), max_chunk)
    write_keys(
        out / "keys.toml", ring, comment=f"all identities of run {cfg.run.name!r} (keep offline)", overwrite=True
    )
    return ring


@dataclass
class _Brokers:
    """The brokers of one provisioning being written: their users' ACL rules and their folders."""

    cfg: RunConfig
    out: Path
    layout: BrokerLayout
    pki: CertificateAuthority
    rules: dict[str, Grants]
    cell_folders: dict[str, Path] = field(default_factory=dict)

    def write(self, folder: Path, title: str, host: str, port: int, rules: dict[str, Grants], extra: str) -> None:
        """One broker folder (:func:`~fedtier.broker_files.write_broker`) for the users of ``rules``."""
        layout = self.layout
        write_broker(
            folder,
            title,
            self.pki,
            host,
            port,
            layout.max_packet,
            rules,
            extra,
            layout.broker_user,
            layout.bind,
        )

    def cell(self, cell: str, cloud_url: str) -> str:
        """``cell``'s broker in ``OUT/cells/CELL``, bridged to the cloud broker at ``cloud_url``; its URL."""
        run = self.cfg.run.name
        bridge = bridge_user(cell)
        folder = self.cell_folders[cell] = self.out / "cells" / cell
        self.pki.issue(folder, "bridge", bridge)
        b = folder.resolve()
        extra = bridge_config(
            run,
            cell,
            cloud_url,
            username=bridge,
            cafile=f"{b}/ca.crt",
            certfile=f"{b}/bridge.crt",
            keyfile=f"{b}/bridge.key",
        )
        members = [cell, *self.cfg.topology.device_ids(cell)]
        host, port = self.layout.cell_host.replace("{cell}", cell), self.layout.cell_ports[cell]
        title = f"fedtier broker of cell {cell}, run {run!r}, bridged to the cloud broker"
        self.write(folder, title, host, port, {n: self.rules[n] for n in members}, extra)
        return f"mqtts://{host}:{port}"

    def all(self, extra_cloud_config: str) -> dict[str, str]:
        """Every broker (the cloud's in ``OUT/broker``, with ``per_cell`` also each cell's); each node's
        broker URL."""
        layout, run = self.layout, self.cfg.run.name
        url = f"mqtts://{layout.host}:{layout.port}"
        urls = dict.fromkeys(self.rules, url)
        cloud_rules = self.rules
        if layout.per_cell:
            cloud_rules = {n: self.rules[n] for n in ("cloud", OPERATOR, MONITOR)}
            for cell in self.cfg.topology.cell_ids():
                cloud_rules[bridge_user(cell)] = bridge_rules(run, cell)
                urls.update(dict.fromkeys([cell, *self.cfg.topology.device_ids(cell)], self.cell(cell, url)))
        title = f"fedtier {'cloud ' if layout.per_cell else ''}broker for run {run!r}"
        self.write(self.out / "broker", title, layout.host, layout.port, cloud_rules, extra_cloud_config)
        return urls


def provision(
    cfg: RunConfig,
    out: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8883,
    max_chunk: int = DEFAULT_MAX_CHUNK,
    extra_broker_config: str = "",
    per_cell: bool = False,
    cell_host: str = "{cell}",
    cell_port: int = 8883,
    broker_user: str | None = None,
    bind: str = "",
    overwrite: bool = False,
    max_device_weight: float | None = None,
    federation: bool = False,
    fedtier_bin: str = FEDTIER_BIN,
) -> Provisioned:
    """Write the CA, the brokers' configs and files, and one bundle per node (see the module doc); the broker
    settings are those of :class:`BrokerLayout` (``extra_broker_config``: appended to the cloud broker's).

    ``max_device_weight``: the samples a device may claim, written into every bundle
    (``security.max_device_weight``): cells refuse a larger device weight and the cloud a cell weight above
    its devices' bounds (default: the config's). Bundles say ``privacy.noise_seed = "system"`` unless the
    config sets an integer (``deployment_config``). ``federation``: bundles for long-lived nodes
    (``fedtier cloud|cell|agent --serve``): no training config (jobs bring it, ``protocols.jobs``), and a
    systemd unit per node (:func:`~fedtier.bundles.systemd_unit`, ``fedtier_bin``: the installed ``fedtier``
    script). Every provisioning has the operator identity (``nodes/operator``: it alone may submit jobs) and
    the job topics in its ACL."""
    ignored = ignored_by_federation(cfg) if federation else []  # (before the deployment's own settings)
    cfg, _ = deployment_config(cfg)
    out = Path(out)
    if (out / "keys.toml").exists() and not overwrite:
        raise ConfigError(f"{out} is already provisioned (use --force to replace it)")
    broker_user, warning = broker_user_for_root(broker_user)
    ports = cell_ports(cfg.topology.cell_ids(), cell_port) if per_cell else {}
    layout = BrokerLayout(host, port, max_chunk, per_cell, cell_host, cell_port, ports, broker_user, bind)
    ring = _new_identities(out, cfg, max_device_weight, max_chunk)
    pki = _new_ca(out, cfg.run.name)
    brokers = _Brokers(cfg, out, layout, pki, acl_rules(cfg))
    urls = brokers.all(extra_broker_config)
    bundles = {
        node: write_bundle(out, pki, ring, cfg, node, urls[node], max_device_weight, federation, fedtier_bin)
        for node in brokers.rules
    }
    extra = {"max_device_weight": max_device_weight, "federation": federation, "fedtier_bin": fedtier_bin}
    record_federation(out, cfg, ring, {**asdict(layout), **extra})
    warnings = [warning] if warning else []
    if ignored:
        warnings.append(
            f"{', '.join(ignored)}: no job takes these from the federation's config (each job sets its own, "
            "e.g. its [runtime] deadlines and startup wait), so they apply to nothing here"
        )
    return Provisioned(out, out / "broker", bundles, brokers.cell_folders, warnings)
