"""Provisioning a deployment: a CA, certificates, node identities, Mosquitto config with ACLs, bundles.

:func:`provision` writes, for a run config::

    OUT/ca/ca.crt, ca.key            the CA (keep ca.key offline)
    OUT/keys.toml                    every node's Ed25519 identity (keep offline; `fedtier keys`)
    OUT/broker/                      mosquitto.conf (TLS listener), listener.conf (its options alone),
                                     server.crt/.key, ca.crt, passwd (PBKDF2-SHA512, as mosquitto_passwd),
                                     acl (per node: what it may read and write)
    OUT/nodes/{node}/                one bundle per node (cloud, each cell, each device, monitor):
                                     config.toml (broker URL, credentials, TLS files, keys), keys.toml
                                     (its private key, its peers' public keys), client.crt/.key, ca.crt

The ACL follows the README's Topics table: a device reads only its own task and the run's control
records (``cloud/control``, ``cloud/round``, ``status/cloud``) and writes only its own result and
status (under its cell); a cell reads its cell task, its devices' results and statuses and the cloud's
status, and writes its devices' tasks, its report, its status and telemetry; the cloud what it orchestrates. Bridged per-cell
brokers (the fleet-scale layout) take ``extra_broker_config`` (e.g. the bridge sections of a cell
broker) appended to ``mosquitto.conf``.
"""
from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from protocols.config import RunConfig
from protocols.wire import topics
from protocols.wire.chunking import DEFAULT_MAX_CHUNK
from protocols.wire.keys import generate_keys, node_subset, write_keys

MONITOR = "monitor"
VALID_DAYS = 365


@dataclass(frozen=True)
class Provisioned:
    """What :func:`provision` wrote: the output folder, the broker's folder and each node's bundle."""

    out: Path
    broker: Path
    bundles: dict[str, Path]
    passwords: dict[str, str]


# ----------------------------------------------------------------------------------------------- ACL
def acl_rules(cfg: RunConfig) -> dict[str, list[tuple[str, str]]]:
    """Per broker user (node id): ``[(access, topic pattern)]``, ``access`` in read, write, readwrite."""
    run = cfg.run.name
    r = topics.root(run)
    rules: dict[str, list[tuple[str, str]]] = {
        "cloud": [("write", f"{r}/cell/+/down/task"), ("read", topics.cell_reports(run)),
                  ("readwrite", topics.control(run)), ("readwrite", topics.round_manifest(run)),
                  ("read", topics.statuses(run)), ("write", topics.status(run, "cloud")),
                  ("write", topics.telemetry_cloud(run))],
        MONITOR: [("read", f"{r}/telemetry/#"), ("read", topics.statuses(run)), ("read", topics.device_statuses(run)),
                  ("read", topics.round_manifest(run)), ("read", topics.control(run))],
    }
    for cell in cfg.topology.cell_ids():
        rules[cell] = [("read", topics.cell_task(run, cell)), ("write", f"{r}/cell/{cell}/down/+/task"),
                       ("read", topics.device_results(run, cell)), ("write", topics.cell_report(run, cell)),
                       ("read", topics.control(run)), ("read", topics.round_manifest(run)),
                       ("read", topics.device_statuses(run, cell)), ("read", topics.status(run, "cloud")),
                       ("write", topics.status(run, topics.cell_node(cell))),
                       ("write", topics.telemetry_cell(run, cell))]
        for device in cfg.topology.device_ids(cell):
            rules[device] = [("read", topics.device_task(run, cell, device)),
                             ("write", topics.device_result(run, cell, device)),
                             ("read", topics.control(run)), ("read", topics.round_manifest(run)),
                             ("read", topics.status(run, "cloud")),
                             ("write", topics.device_status(run, cell, device))]
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
    the caller substitutes absolute paths)."""
    return ("cafile {dir}/ca.crt\ncertfile {dir}/server.crt\nkeyfile {dir}/server.key\n"
            "require_certificate true\npassword_file {dir}/passwd\nacl_file {dir}/acl\n"
            f"max_packet_size {max_packet_size}\n")


# --------------------------------------------------------------------------------------------- PKI
def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str, issuer_key: ec.EllipticCurvePrivateKey, *,
          ca: bool = False, hosts: tuple[str, ...] = ()) -> x509.Certificate:
    now = dt.datetime.now(dt.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=VALID_DAYS))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
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
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


# ------------------------------------------------------------------------------------------ bundle
def provision(cfg: RunConfig, out: str | Path, *, host: str = "127.0.0.1", port: int = 8883,
              max_chunk: int = DEFAULT_MAX_CHUNK, extra_broker_config: str = "",
              overwrite: bool = False) -> Provisioned:
    """Write the CA, the broker's config and files, and one bundle per node (see the module doc).

    Every fedtier node sends messages larger than ``max_chunk`` as chunks, so the broker refuses any
    MQTT packet larger than a chunk plus room for the topic (``max_packet_size``): an oversized
    single payload never reaches a node."""
    out = Path(out)
    if (out / "keys.toml").exists() and not overwrite:
        from protocols.config import ConfigError

        raise ConfigError(f"{out} is already provisioned (use --force to replace it)")
    max_packet = max_chunk + 4096  # a chunk, its topic and the MQTT header
    ca_key = _key()
    ca_cert = _cert(f"fedtier {cfg.run.name} CA", ca_key, f"fedtier {cfg.run.name} CA", ca_key, ca=True)
    _write(out / "ca" / "ca.key", _pem_key(ca_key), secret=True)
    _write(out / "ca" / "ca.crt", _pem_cert(ca_cert))
    ring = generate_keys(cfg.topology)
    write_keys(out / "keys.toml", ring, comment=f"all identities of run {cfg.run.name!r} (keep offline)",
               overwrite=True)

    broker = out / "broker"
    server_key = _key()
    hosts = tuple(dict.fromkeys((host, "127.0.0.1", "localhost")))
    _write(broker / "server.key", _pem_key(server_key), secret=True)
    _write(broker / "server.crt", _pem_cert(_cert(host, server_key, f"fedtier {cfg.run.name} CA", ca_key,
                                                  hosts=hosts)))
    _write(broker / "ca.crt", _pem_cert(ca_cert))
    rules = acl_rules(cfg)
    passwords = {user: secrets.token_urlsafe(18) for user in rules}
    _write(broker / "passwd", "\n".join(password_line(u, p) for u, p in passwords.items()) + "\n", secret=True)
    _write(broker / "acl", acl_file(rules))
    options = listener_options(max_packet).replace("{dir}", str(broker.resolve()))
    _write(broker / "listener.conf", options)
    _write(broker / "mosquitto.conf",
           f"# fedtier broker for run {cfg.run.name!r} (fedtier provision)\n"
           "per_listener_settings false\nallow_anonymous false\npersistence false\nset_tcp_nodelay true\n"
           "max_queued_messages 100000\nmax_inflight_messages 64\n"
           f"listener {port}\n{options}" + (f"\n{extra_broker_config}\n" if extra_broker_config else ""))

    bundles: dict[str, Path] = {}
    url = f"mqtts://{host}:{port}"
    for node in rules:
        d = out / "nodes" / node
        key = _key()
        _write(d / "client.key", _pem_key(key), secret=True)
        _write(d / "client.crt", _pem_cert(_cert(node, key, f"fedtier {cfg.run.name} CA", ca_key)))
        _write(d / "ca.crt", _pem_cert(ca_cert))
        security: dict[str, str] = {}
        if node != MONITOR:
            write_keys(d / "keys.toml", node_subset(ring, cfg.topology, node),
                       comment=f"node {node!r} of run {cfg.run.name!r}", overwrite=True)
            security = {"keys": "keys.toml"}
        node_cfg = cfg.model_copy(update={
            "broker": cfg.broker.model_copy(update={"url": url, "username": node, "password": passwords[node],
                                                    "ca_certs": "ca.crt", "certfile": "client.crt",
                                                    "keyfile": "client.key"}),
            "security": cfg.security.model_copy(update=security)})
        _write(d / "config.toml", node_cfg.to_toml(), secret=True)  # holds the broker password
        bundles[node] = d
    return Provisioned(out, broker, bundles, passwords)
