"""A node's bundle (``OUT/nodes/{node}``): its TLS certificate, its keys, its ``config.toml`` and, for a
long-lived federation node, its systemd unit.

``config.toml`` names the broker URL, the node's login and TLS files and ``keys.toml``; ``keys.toml`` holds
the node's private key and the public keys it verifies (the monitor's: every node's).
"""

from __future__ import annotations

from pathlib import Path

from protocols.config import RunConfig, RunSection, dump_toml
from protocols.jobs import OPERATOR
from protocols.wire.keys import KeyRing, node_subset, write_keys

from .acl import MONITOR
from .pki import CertificateAuthority, write_file

FEDTIER_BIN = "/usr/local/bin/fedtier"
INSTALL_DIR = "/etc/fedtier"
"""Where a node's bundle is installed (``INSTALL_DIR/{node}``: the unit's working directory)."""
STATE_DIR = "/var/lib/fedtier"
"""Where a long-lived node writes (``STATE_DIR/{node}``: systemd's StateDirectory, its run folders)."""
SERVICE_USER = "fedtier"


def key_subset(ring: KeyRing, cfg: RunConfig, node: str) -> KeyRing:
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


def ignored_by_federation(cfg: RunConfig, own: tuple[str, ...] = ()) -> list[str]:
    """The settings of a provisioning config that no federation bundle keeps and no job inherits (each job
    brings its own): its training sections and run keys set to other than their defaults. ``[data]`` is
    kept out of it (`fedtier partition` and the devices' weight bound read it), and the ``own`` keys
    (``section.key``: a node's own, e.g. a forward-only device's ``runtime.onnx_model``)."""
    kept = ("topology", "broker", "security", "monitoring", "data")
    set_ = cfg.model_dump(mode="json", exclude_defaults=True)
    for section, _, key in (k.partition(".") for k in own):
        if not {**set_.get(section, {})}.keys() - {key}:
            set_.pop(section, None)
    run = [f"run.{k}" for k in set_.get("run", {}) if k not in ("name", "output")]
    return run + [f"[{s}]" for s in set_ if s not in (*kept, "run")]


def federation_toml(cfg: RunConfig) -> str:
    """A long-lived node's ``config.toml``: only the sections of :func:`federation_bundle` (no defaults of
    training sections, so that nothing in the bundle looks like a job's setting)."""
    sections = ("run", "topology", "broker", "security", "monitoring")
    data = cfg.model_dump(mode="json", exclude_none=True, include=set(sections))
    data["run"] = {"name": cfg.run.name, "output": cfg.run.output}
    return dump_toml({k: data[k] for k in sections if data.get(k)})


def unit_name(node: str) -> str:
    """The systemd unit file name of ``node``."""
    return f"fedtier-{node}.service"


# The unit's sandbox: a node reads its bundle, writes only its state directory, talks IP and nothing else.
_SANDBOX = """UMask=0077
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
"""


def systemd_unit(cfg: RunConfig, node: str, fedtier_bin: str = FEDTIER_BIN) -> str | None:
    """The systemd unit of a long-lived node (``None`` for the operator and the monitor: commands, not services):
    ``fedtier cloud|cell|agent --serve`` from the bundle in ``INSTALL_DIR/{node}`` as ``SERVICE_USER``, writing
    only ``STATE_DIR/{node}``; restarted on failure, not on exit 2 (a wrong config, certificate or data: no
    restart mends it); SIGTERM stops it cleanly (a running job resumes), SIGHUP takes renewed TLS files."""
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
ExecReload=/bin/kill -HUP $MAINPID
Restart=on-failure
RestartSec=5
RestartPreventExitStatus=2
KillSignal=SIGTERM
TimeoutStopSec=30
StateDirectory=fedtier/{node}
StateDirectoryMode=0700
{_SANDBOX}
[Install]
WantedBy=multi-user.target
"""


def write_bundle(
    out: Path,
    pki: CertificateAuthority,
    ring: KeyRing,
    cfg: RunConfig,
    node: str,
    url: str,
    max_device_weight: float | None,
    federation: bool,
    fedtier_bin: str,
) -> Path:
    """One node's bundle in ``OUT/nodes/{node}``: its certificate, its keys, its config (and systemd unit)."""
    d = out / "nodes" / node
    pki.issue(d, "client", node)
    # a node's private key and its peers' public keys; the monitor signs nothing: every node's public key,
    # to check the signed telemetry and statuses it reads (`fedtier monitor --config`)
    subset = key_subset(ring, cfg, node)
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
                    "username": node,  # informative: the broker takes the user from the certificate
                    "password": None,
                    "ca_certs": "ca.crt",
                    "certfile": "client.crt",
                    "keyfile": "client.key",
                }
            ),
            "security": cfg.security.model_copy(update=security),
        }
    )
    text = federation_toml(node_cfg) if federation else node_cfg.to_toml()
    write_file(d / "config.toml", text, secret=True)
    if federation:
        unit = systemd_unit(cfg, node, fedtier_bin)
        if unit is not None:
            write_file(d / unit_name(node), unit)
    return d
