"""Provisioning a deployment: a CA, certificates, node identities, Mosquitto config with ACLs, bundles.

:func:`provision` writes, for a run config::

    OUT/ca/ca.crt, ca.key            the CA (keep ca.key offline)
    OUT/keys.toml                    every node's Ed25519 identity (keep offline; `fedtier keys`)
    OUT/broker/                      mosquitto.conf (TLS listener), listener.conf (its options alone),
                                     server.crt/.key, ca.crt, passwd (PBKDF2-SHA512, as mosquitto_passwd),
                                     acl (per node: what it may read and write)
    OUT/cells/{cell}/                with per_cell: that cell's broker (the same files, plus bridge.crt/.key)
    OUT/nodes/{node}/                one bundle per node (cloud, each cell, each device, monitor):
                                     config.toml (broker URL, credentials, TLS files, keys), keys.toml
                                     (its private key, its peers' public keys; the monitor's: every
                                     node's public key), client.crt/.key, ca.crt

The ACL follows the topic map (docs/reference/topics.md): a device reads only its own task and the run's control
records (``cloud/control``, ``cloud/round``, ``status/cloud``) and writes only its own result and
status (under its cell); a cell reads its cell task, its devices' results and statuses and the cloud's
status, and writes its devices' tasks, its report, its status and telemetry; the cloud what it orchestrates.

With ``per_cell`` (the fleet-scale layout of ``protocols/transport/bridge.py``), ``OUT/cells/{cell}/``
holds one more broker per cell (its own server certificate, password file and ACL for the cell server
and its devices only, and a TLS bridge to the cloud broker with its own user, password and client
certificate); the cloud broker in ``OUT/broker`` then knows only ``cloud``, ``monitor`` and the bridges,
each allowed exactly its cell's bridged topics. Cell and device bundles point at their cell broker.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from protocols.config import RunConfig, RunSection, deployment_config, dump_toml
from protocols.jobs import OPERATOR
from protocols.roster import roster_topic
from protocols.transport.bridge import bridge_config, bridge_topics
from protocols.wire import topics
from protocols.wire.chunking import DEFAULT_MAX_CHUNK
from protocols.wire.keys import KeyRing, generate_keys, new_seed, node_subset, public_of, write_keys

MONITOR = "monitor"
PERSISTENCE = "persistence true\npersistence_location {data}/\nautosave_interval 1\npersistent_client_expiration 7d\n"
"""A provisioned broker keeps its sessions, subscriptions, queued and retained messages across a restart
(``data/mosquitto.db``, saved every second and at a clean stop), as the broker of ``fedtier run`` does:
with the nodes' persistent sessions a broker restart loses nothing but what it queued in its last
second before a crash. A session unused for 7 days is dropped (a device gone for good)."""
VALID_DAYS = 365
CRL_DAYS = 10 * 365
MAX_QUEUED_BYTES = 512 * 1024 * 1024
"""What a broker queues at most for one client that is away (``max_queued_bytes``, besides
``max_queued_messages``): a node that floods an offline peer's topics costs the broker this much, not gigabytes."""


@dataclass(frozen=True)
class Provisioned:
    """What :func:`provision` wrote: the output folder, the broker's folder and each node's bundle."""

    out: Path
    broker: Path
    bundles: dict[str, Path]
    passwords: dict[str, str]
    cell_brokers: dict[str, Path] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    """What the operator should fix or know (e.g. root without a broker user)."""


# ----------------------------------------------------------------------------------------------- ACL
def acl_rules(cfg: RunConfig) -> dict[str, list[tuple[str, str]]]:
    """Per broker user (node id): ``[(access, topic pattern)]``, ``access`` in read, write, readwrite."""
    run = cfg.run.name
    r = topics.root(run)
    rules: dict[str, list[tuple[str, str]]] = {
        "cloud": [
            ("write", f"{r}/cell/+/down/task"),
            ("read", topics.cell_reports(run)),
            ("readwrite", topics.control(run)),
            ("readwrite", topics.round_manifest(run)),
            ("read", topics.statuses(run)),
            ("write", topics.status(run, "cloud")),
            ("write", topics.telemetry_cloud(run)),
            ("read", topics.telemetry_cell(run, "+")),  # every cell's records, into the cloud's run folder
            ("write", topics.state(run, "cloud")),
            ("read", topics.job_submit(run)),
            ("write", topics.job_replies(run)),
            ("write", topics.job_list(run)),
            ("write", topics.current_job(run)),
            ("readwrite", roster_topic(run)),
        ],
        OPERATOR: [
            ("write", topics.job_submit(run)),
            ("readwrite", roster_topic(run)),
            ("read", topics.job_replies(run)),
            ("read", topics.job_list(run)),
            ("read", topics.current_job(run)),
            ("read", roster_topic(run)),
        ],
        MONITOR: [
            ("read", f"{r}/telemetry/#"),
            ("read", topics.states(run)),
            ("read", topics.statuses(run)),
            ("read", topics.device_statuses(run)),
            ("read", topics.round_manifest(run)),
            ("read", topics.control(run)),
            ("read", topics.current_job(run)),
            ("read", topics.job_list(run)),
            ("read", roster_topic(run)),
        ],
    }
    for cell in cfg.topology.cell_ids():
        rules[cell] = [
            ("read", topics.cell_task(run, cell)),
            ("write", f"{r}/cell/{cell}/down/+/task"),
            ("read", topics.device_results(run, cell)),
            ("write", topics.cell_report(run, cell)),
            ("read", topics.control(run)),
            ("read", topics.round_manifest(run)),
            ("readwrite", topics.device_statuses(run, cell)),  # write: clears a revoked device's status
            ("read", topics.status(run, "cloud")),
            ("write", topics.status(run, topics.cell_node(cell))),
            ("write", topics.telemetry_cell(run, cell)),
            ("write", topics.state(run, topics.cell_node(cell))),
            ("read", topics.current_job(run)),
            ("read", roster_topic(run)),
        ]
        for device in cfg.topology.device_ids(cell):
            rules[device] = [
                ("read", topics.device_task(run, cell, device)),
                ("write", topics.device_result(run, cell, device)),
                ("read", topics.control(run)),
                ("read", topics.round_manifest(run)),
                ("read", topics.status(run, "cloud")),
                ("write", topics.device_status(run, cell, device)),
                ("read", topics.current_job(run)),
                ("read", roster_topic(run)),
            ]
    return rules


def acl_file(rules: dict[str, list[tuple[str, str]]]) -> str:
    """Mosquitto ``acl_file`` text: anything not granted is denied."""
    lines = ["# fedtier ACL (fedtier provision): anything not listed is denied"]
    for user, grants in rules.items():
        lines += ["", f"user {user}", *(f"topic {access} {pattern}" for access, pattern in grants)]
    return "\n".join(lines) + "\n"


def password_line(user: str, password: str, salt: bytes | None = None) -> str:
    """One ``password_file`` line in Mosquitto 2's format (``$7$``: PBKDF2-SHA512, 101 iterations)."""
    salt = salt or os.urandom(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, 101)
    return f"{user}:$7$101${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def listener_options(max_packet_size: int) -> str:
    """The options that follow the ``listener`` line (paths relative to the broker folder's files:
    the caller substitutes absolute paths).

    A login is tied to its node: the broker takes the user name from the client certificate's common name
    (the node id, ``use_identity_as_username``: the certificate's private key is the credential) and the
    client id from the user name (``use_username_as_clientid``), so a node's persistent session (client id
    ``fedtier-{run}-{node}`` on the wire) is keyed by the node's own identity at the broker: no other
    node's credentials can connect under it, kick it off or inherit or wipe its session. A certificate
    listed in the CA's revocation list (``ca.crl``, :func:`renew`) is refused."""
    return (
        "cafile {dir}/ca.crt\ncertfile {dir}/server.crt\nkeyfile {dir}/server.key\ncrlfile {dir}/ca.crl\n"
        "require_certificate true\nuse_identity_as_username true\nuse_username_as_clientid true\n"
        "password_file {dir}/passwd\nacl_file {dir}/acl\n"
        f"max_packet_size {max_packet_size}\n"
    )


# --------------------------------------------------------------------------------------------- PKI
def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: str,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    hosts: tuple[str, ...] = (),
    days: int = VALID_DAYS,
) -> x509.Certificate:
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


def _write(path: Path, data: bytes | str, secret: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def load_pki(out: str | Path) -> _Pki:
    """The CA of the provisioning in ``out`` (``OUT/ca``), to issue or revoke certificates with."""
    ca = Path(out) / "ca"
    key = serialization.load_pem_private_key((ca / "ca.key").read_bytes(), None)
    cert = x509.load_pem_x509_certificate((ca / "ca.crt").read_bytes())
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        from protocols.config import ConfigError

        raise ConfigError(f"{ca / 'ca.key'}: not the EC key fedtier provision writes")
    name = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    return _Pki(str(name), key, cert)


# ------------------------------------------------------------------------------------------ broker
def bridge_user(cell: str) -> str:
    """The user name the bridge of ``cell``'s broker logs in with at the cloud broker."""
    return f"bridge.{cell}"


def bridge_rules(run: str, cell: str) -> list[tuple[str, str]]:
    """The cloud broker's ACL for ``cell``'s bridge: exactly the bridged topics (``in``: the bridge
    subscribes, ``out``: it publishes)."""
    return [("read" if t.direction == "in" else "write", t.pattern) for t in bridge_topics(run, cell)]


@dataclass(frozen=True)
class _Pki:
    name: str
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    def issue(self, folder: Path, stem: str, cn: str, hosts: tuple[str, ...] = ()) -> None:
        """Write ``stem.key`` (mode 600), ``stem.crt`` signed by this CA, and ``ca.crt`` into ``folder``."""
        key = _key()
        _write(folder / f"{stem}.key", _pem_key(key), secret=True)
        _write(folder / f"{stem}.crt", _pem_cert(_cert(cn, key, self.name, self.key, hosts=hosts)))
        _write(folder / "ca.crt", _pem_cert(self.cert))

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


def _write_broker(
    folder: Path,
    title: str,
    pki: _Pki,
    host: str,
    port: int,
    max_packet: int,
    rules: dict[str, list[tuple[str, str]]],
    passwords: dict[str, str],
    extra: str = "",
    broker_user: str | None = None,
    bind: str = "",
) -> None:
    """One broker folder: server certificate, CA, password file, ACL, listener.conf, mosquitto.conf.
    With ``broker_user`` (as root), the broker's secrets are chowned to that user and the config says
    ``user NAME``: Mosquitto started as root drops to it and reads the bridge key after that."""
    pki.issue(folder, "server", host, hosts=tuple(dict.fromkeys((host, "127.0.0.1", "localhost"))))
    _write(folder / "ca.crl", pki.crl([]))
    _write(folder / "passwd", "\n".join(password_line(u, passwords[u]) for u in rules) + "\n", secret=True)
    _write(folder / "acl", acl_file(rules))
    options = listener_options(max_packet).replace("{dir}", str(folder.resolve()))
    _write(folder / "listener.conf", options)
    data = folder / "data"  # mosquitto.db: sessions, queued and retained messages (model updates: private)
    data.mkdir(mode=0o700, exist_ok=True)
    _write(
        folder / "mosquitto.conf",  # secret: a bridge section holds the bridge's password
        f"# {title} (fedtier provision)\n"
        + (f"user {broker_user}\n" if broker_user else "")
        + "per_listener_settings false\nallow_anonymous false\nset_tcp_nodelay true\n"
        f"max_queued_messages 100000\nmax_queued_bytes {MAX_QUEUED_BYTES}\nmax_inflight_messages 64\n"
        + PERSISTENCE.format(data=data.resolve())
        + f"pid_file {data.resolve()}/mosquitto.pid\n"  # `fedtier provision add-device|revoke` reload it (SIGHUP)
        + f"listener {port}{' ' + bind if bind else ''}\n{options}"
        + (f"\n{extra}\n" if extra else ""),
        secret=True,
    )
    if broker_user:
        try:
            for f in folder.iterdir():
                shutil.chown(f, user=broker_user)
        except (PermissionError, LookupError) as exc:
            from protocols.config import ConfigError

            raise ConfigError(
                f"cannot give {folder} to broker user {broker_user!r} ({exc}): "
                "run provision as root, with an existing user"
            ) from None


def cell_ports(cells: list[str], first: int) -> dict[str, int]:
    """Each cell broker's TLS port: ``first`` for the first cell, then +1 per cell (in topology order),
    so per-cell brokers provisioned on one host each listen on their own port."""
    ports = {cell: first + i for i, cell in enumerate(cells)}
    if ports and (first < 1 or max(ports.values()) > 65535):
        from protocols.config import ConfigError

        raise ConfigError(f"cell broker ports {first}..{first + len(cells) - 1} are outside 1..65535 (--cell-port)")
    return ports


BROKER_CONFIGS = ("mosquitto.conf", "listener.conf")
"""The files of a broker folder that name its files by absolute path (see :func:`relocate`)."""


def relocate(out: str | Path) -> list[Path]:
    """Point the broker configs of a moved provisioning folder ``out`` at where their files are now.

    Mosquitto resolves a relative path in its config against its working directory, not the config's
    folder, so provision writes absolute paths (``password_file /old/DIR/broker/passwd``); after the
    folder moved, this rewrites every broker folder's (``broker``, ``cells/*``) configs from the folder
    they name (read off their ``password_file`` line) to the broker folder's current absolute path,
    owner and mode kept. Returns the broker folders rewritten (none if nothing moved)."""
    from protocols.config import ConfigError

    out = Path(out)
    folders = [d for d in (out / "broker", *sorted((out / "cells").glob("*"))) if (d / "mosquitto.conf").is_file()]
    if not folders:
        raise ConfigError(f"{out} holds no provisioned broker (no broker/mosquitto.conf)")
    moved = []
    for folder in folders:
        conf = (folder / "mosquitto.conf").read_text()
        named = [line.split(" ", 1)[1] for line in conf.splitlines() if line.startswith("password_file ")]
        if len(named) != 1 or not named[0].endswith("/passwd"):
            raise ConfigError(f"{folder / 'mosquitto.conf'} is not a fedtier broker config (one password_file line)")
        old, new = named[0][: -len("/passwd")], str(folder.resolve())
        if old == new:
            continue
        for name in BROKER_CONFIGS:
            path = folder / name
            if path.is_file():  # _write truncates in place: the file keeps its owner (a broker user's)
                _write(path, path.read_text().replace(f"{old}/", f"{new}/"), secret=name == "mosquitto.conf")
        moved.append(folder)
    return moved


MOSQUITTO_USER = "mosquitto"
"""The service user of Debian's (and most distributions') Mosquitto package."""


def broker_user_for_root(broker_user: str | None) -> tuple[str | None, str | None]:
    """The broker user to provision for, and a warning if any. Mosquitto started as root drops to its
    service user (``mosquitto``, unless its config says ``user``) before it reads its password file,
    ACL and keys: files written by root with mode 0600 are then unreadable. So as root without
    ``--broker-user``, default to the ``mosquitto`` user when it exists, else warn with the fix."""
    import pwd

    if broker_user is not None or os.geteuid() != 0:
        return broker_user, None
    try:
        pwd.getpwnam(MOSQUITTO_USER)
    except KeyError:
        return None, (
            f"provisioning as root without --broker-user and there is no {MOSQUITTO_USER!r} user: the broker "
            "files are root's (mode 0600), and Mosquitto started as root cannot read them once it drops its "
            "privileges; give --broker-user USER (the user the broker runs as)"
        )
    return MOSQUITTO_USER, (
        f"provisioning as root without --broker-user: the broker files go to user {MOSQUITTO_USER!r} and the "
        f"configs say 'user {MOSQUITTO_USER}' (Mosquitto drops to it); give --broker-user to choose another"
    )


# ------------------------------------------------------------------------------------------ bundle
FEDTIER_BIN = "/usr/local/bin/fedtier"
INSTALL_DIR = "/etc/fedtier"
"""Where a node's bundle is installed (``INSTALL_DIR/{node}``: the unit's working directory)."""
STATE_DIR = "/var/lib/fedtier"
"""Where a long-lived node writes (``STATE_DIR/{node}``: systemd's StateDirectory, its run folders)."""
SERVICE_USER = "fedtier"


def _key_subset(ring: KeyRing, cfg: RunConfig, node: str) -> KeyRing:
    """A node's keys file: its private key and the public keys it verifies (the cloud also the operator's;
    the operator the cloud's; the monitor, which signs nothing, every node's)."""
    if node == MONITOR:
        return KeyRing({}, dict(ring.public))
    if node == OPERATOR:
        return KeyRing({OPERATOR: ring.private[OPERATOR]}, {n: ring.public[n] for n in (OPERATOR, "cloud")})
    subset = node_subset(ring, cfg.topology, node)
    if node == "cloud":
        subset.public[OPERATOR] = ring.public[OPERATOR]
    return subset


def federation_bundle(cfg: RunConfig) -> RunConfig:
    """What a long-lived node's bundle holds of the provisioning config: the federation's name, its
    topology and the node's monitoring settings (broker and keys are set per node); no training config."""
    return RunConfig(run=RunSection(name=cfg.run.name), topology=cfg.topology, monitoring=cfg.monitoring)


def federation_toml(cfg: RunConfig) -> str:
    """A long-lived node's ``config.toml``: only the sections of :func:`federation_bundle` (no defaults of
    training sections, so that nothing in the bundle looks like a job's setting)."""
    sections = ("run", "topology", "broker", "security", "monitoring")
    data = cfg.model_dump(mode="json", exclude_none=True, include=set(sections))
    data["run"] = {"name": cfg.run.name, "output": cfg.run.output}
    return dump_toml({k: data[k] for k in sections if data.get(k)})


def unit_name(node: str) -> str:
    return f"fedtier-{node}.service"


def systemd_unit(cfg: RunConfig, node: str, fedtier_bin: str = FEDTIER_BIN) -> str | None:
    """The systemd unit of a long-lived node (``None`` for the operator and the monitor: commands, not
    services). It runs ``fedtier cloud|cell|agent --serve`` from the bundle installed in
    ``INSTALL_DIR/{node}`` as the unprivileged ``SERVICE_USER``, writes only ``STATE_DIR/{node}``,
    restarts on failure and stops with SIGTERM (the node leaves cleanly; a running job resumes)."""
    state = f"{STATE_DIR}/{node}"
    out = f'--set run.output="{state}"'
    if node == "cloud":
        command, what = f"cloud config.toml --serve {out} --no-progress", "cloud"
    elif node in cfg.topology.cell_ids():
        command, what = f"cell config.toml --serve {out} --cell {node}", f"cell {node}"
    elif cfg.topology.cell_of(node) is not None:
        command, what = f"agent config.toml --serve {out} --device {node} --data {state}/data.npz", f"device {node}"
    else:
        return None
    return f"""# fedtier {what} of federation {cfg.run.name!r} (fedtier provision --federation)
# install: copy this bundle to {INSTALL_DIR}/{node} (owned by {SERVICE_USER}, mode 700), then
#   cp {unit_name(node)} /etc/systemd/system/ && systemctl daemon-reload && systemctl enable --now {unit_name(node)}
[Unit]
Description=fedtier {what} of federation {cfg.run.name}
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
User={SERVICE_USER}
Group={SERVICE_USER}
WorkingDirectory={INSTALL_DIR}/{node}
ExecStart={fedtier_bin} {command}
Restart=on-failure
RestartSec=5
KillSignal=SIGTERM
TimeoutStopSec=30
StateDirectory=fedtier/{node}
StateDirectoryMode=0700
UMask=0077
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
PrivateDevices=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
CapabilityBoundingSet=
SystemCallArchitectures=native

[Install]
WantedBy=multi-user.target
"""


def write_bundle(
    out: Path,
    pki: _Pki,
    ring: KeyRing,
    cfg: RunConfig,
    node: str,
    url: str,
    password: str,
    max_device_weight: float | None,
    federation: bool,
    fedtier_bin: str,
) -> Path:
    """One node's bundle in ``OUT/nodes/{node}``: its certificate, its keys, its config (and systemd unit)."""
    d = out / "nodes" / node
    pki.issue(d, "client", node)
    # a node's private key and its peers' public keys; the monitor signs nothing: every node's public key,
    # to check the signed telemetry and statuses it reads (`fedtier monitor --config`)
    subset = _key_subset(ring, cfg, node)
    write_keys(d / "keys.toml", subset, comment=f"node {node!r} of run {cfg.run.name!r}", overwrite=True)
    security: dict[str, object] = {"keys": "keys.toml"}
    if federation:
        security["membership"] = "roster"
    if max_device_weight is not None:
        security["max_device_weight"] = float(max_device_weight)
    node_cfg = (federation_bundle(cfg) if federation else cfg).model_copy(
        update={
            "broker": cfg.broker.model_copy(
                update={
                    "url": url,
                    "username": node,
                    "password": password,
                    "ca_certs": "ca.crt",
                    "certfile": "client.crt",
                    "keyfile": "client.key",
                }
            ),
            "security": cfg.security.model_copy(update=security),
        }
    )
    text = federation_toml(node_cfg) if federation else node_cfg.to_toml()
    _write(d / "config.toml", text, secret=True)  # holds the broker password
    if federation:
        unit = systemd_unit(cfg, node, fedtier_bin)
        if unit is not None:
            _write(d / unit_name(node), unit)
    return d


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
    """Write the CA, the broker's config and files, and one bundle per node (see the module doc).

    Every fedtier node sends messages larger than ``max_chunk`` as chunks, so the broker refuses any
    MQTT packet larger than a chunk plus room for the topic (``max_packet_size``): an oversized
    single payload never reaches a node.

    ``per_cell``: one broker per cell in ``OUT/cells/CELL`` (at ``cell_host``, where ``{cell}`` is
    replaced by the cell id, and its own port: ``cell_port`` for the first cell, +1 for each next one, so
    that cell brokers on one host do not collide, :func:`cell_ports`) for the cell server and its devices,
    bridged over TLS to
    the cloud broker in ``OUT/broker`` (which then has users ``cloud``, ``monitor`` and one
    ``bridge.CELL`` per cell, allowed exactly that cell's bridged topics). ``bind``: the brokers' listen
    address (default: all interfaces). ``broker_user``: see :func:`_write_broker` (as root without one:
    :func:`broker_user_for_root`). ``max_device_weight``:
    the samples a device may claim, written into every bundle (``security.max_device_weight``): cells refuse
    a larger device weight and the cloud a cell weight above its devices' bounds (default: the config's).
    Bundles say ``privacy.noise_seed = "system"`` unless the config sets an integer (``deployment_config``).

    ``federation``: bundles for long-lived nodes (``fedtier cloud|cell|agent --serve``): no training
    config (jobs bring it, ``protocols.jobs``), and a systemd unit per node (:func:`systemd_unit`,
    ``fedtier_bin``: the installed ``fedtier`` script). Every provisioning has the operator identity
    (``nodes/operator``: it alone may submit jobs) and the job topics in its ACL."""
    cfg, _ = deployment_config(cfg)
    out = Path(out)
    if (out / "keys.toml").exists() and not overwrite:
        from protocols.config import ConfigError

        raise ConfigError(f"{out} is already provisioned (use --force to replace it)")
    max_packet = max_chunk + 4096  # a chunk, its topic and the MQTT header
    broker_user, warning = broker_user_for_root(broker_user)
    run = cfg.run.name
    ca_key = _key()
    pki = _Pki(f"fedtier {run} CA", ca_key, _cert(f"fedtier {run} CA", ca_key, f"fedtier {run} CA", ca_key, ca=True))
    _write(out / "ca" / "ca.key", _pem_key(ca_key), secret=True)
    _write(out / "ca" / "ca.crt", _pem_cert(pki.cert))
    ring = generate_keys(cfg.topology)
    ring.private[OPERATOR] = new_seed()  # the operator identity: signs jobs (`fedtier submit`)
    ring.public[OPERATOR] = public_of(ring.private[OPERATOR])
    write_keys(out / "keys.toml", ring, comment=f"all identities of run {run!r} (keep offline)", overwrite=True)

    rules = acl_rules(cfg)
    passwords = {user: secrets.token_urlsafe(18) for user in rules}
    url = f"mqtts://{host}:{port}"
    urls = dict.fromkeys(rules, url)
    cloud_rules = rules
    cell_brokers: dict[str, Path] = {}
    ports = cell_ports(cfg.topology.cell_ids(), cell_port) if per_cell else {}
    if per_cell:
        cloud_rules = {n: rules[n] for n in ("cloud", OPERATOR, MONITOR)}
        for cell in cfg.topology.cell_ids():
            bridge = bridge_user(cell)
            passwords[bridge] = secrets.token_urlsafe(18)
            cloud_rules[bridge] = bridge_rules(run, cell)
            folder = out / "cells" / cell
            pki.issue(folder, "bridge", bridge)
            b = folder.resolve()
            extra = bridge_config(
                run,
                cell,
                url,
                username=bridge,
                password=passwords[bridge],
                cafile=f"{b}/ca.crt",
                certfile=f"{b}/bridge.crt",
                keyfile=f"{b}/bridge.key",
            )
            members = [cell, *cfg.topology.device_ids(cell)]
            chost = cell_host.replace("{cell}", cell)
            _write_broker(
                folder,
                f"fedtier broker of cell {cell}, run {run!r}, bridged to the cloud broker",
                pki,
                chost,
                ports[cell],
                max_packet,
                {n: rules[n] for n in members},
                passwords,
                extra,
                broker_user,
                bind,
            )
            urls.update(dict.fromkeys(members, f"mqtts://{chost}:{ports[cell]}"))
            cell_brokers[cell] = folder
    broker = out / "broker"
    _write_broker(
        broker,
        f"fedtier {'cloud ' if per_cell else ''}broker for run {run!r}",
        pki,
        host,
        port,
        max_packet,
        cloud_rules,
        passwords,
        extra_broker_config,
        broker_user,
        bind,
    )

    bundles = {
        node: write_bundle(
            out, pki, ring, cfg, node, urls[node], passwords[node], max_device_weight, federation, fedtier_bin
        )
        for node in rules
    }
    from .federation import record_federation

    record_federation(
        out,
        cfg,
        ring,
        {
            "host": host,
            "port": port,
            "max_chunk": max_chunk,
            "per_cell": per_cell,
            "cell_host": cell_host,
            "cell_port": cell_port,
            "cell_ports": ports,
            "broker_user": broker_user,
            "bind": bind,
            "max_device_weight": max_device_weight,
            "federation": federation,
            "fedtier_bin": fedtier_bin,
        },
    )
    return Provisioned(out, broker, bundles, passwords, cell_brokers, [warning] if warning else [])
