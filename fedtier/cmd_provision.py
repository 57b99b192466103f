"""``fedtier provision``: a CA, certificates, node identities, a Mosquitto config with ACLs, and one
bundle per node (``fedtier/provisioning.py``)."""

from __future__ import annotations

import click

from .cli import CONFIG, SET, main
from .cli_types import Finite
from .console import console, fail, load_deployment_or_exit, print_error


class _ProvisionGroup(click.Group):
    """``fedtier provision CONFIG --out DIR`` provisions (the ``create`` command); ``fedtier provision
    add-device|add-cell|revoke ...`` change a provisioned federation's membership."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["create", *args]
        return super().parse_args(ctx, args)


@main.group(cls=_ProvisionGroup)
def provision() -> None:
    """Provision a deployment (`fedtier provision CONFIG --out DIR`), then change its membership while it
    runs (`add-device`, `add-cell`, `revoke`)."""


@provision.command("renew")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, exists=True), help="The folder.")
@click.option(
    "--node",
    "nodes",
    multiple=True,
    metavar="NODE",
    help="Renew this node's certificate only (repeatable); default: every bundle's, the brokers' and bridges'.",
)
@click.option("--days", type=click.IntRange(1, 36_500), default=None, help="Validity (default: the provisioning's).")
@click.option(
    "--identity",
    is_flag=True,
    help="Also give each --node a new Ed25519 identity (its keys.toml, and its public key in every bundle "
    "that knows it: copy those keys.toml files to their nodes too), and the roster a new version with the new "
    "keys (publish it: fedtier provision publish).",
)
def renew(out_dir: str, nodes: tuple[str, ...], days: int | None, identity: bool) -> None:
    """Re-issue certificates of the provisioning in OUT with new keys and revoke the old ones; running brokers
    of OUT are reloaded (SIGHUP) and refuse the old ones from then on. Ed25519 identities stay. Prints the
    next steps: copy each renewed bundle's client.crt and client.key to its node, then `systemctl reload`
    its unit (no restart)."""
    from protocols.config import ConfigError

    from .membership import rotate_identities
    from .renewal import next_steps
    from .renewal import renew as write

    if identity and not nodes:
        fail("--identity rotates the identities of the --node NODEs given (none given)", 2)
    try:
        done = write(out_dir, list(nodes) or None, days=days)
        rotated, version = rotate_identities(out_dir, list(nodes)) if identity else ([], None)
    except ConfigError as exc:
        fail(str(exc), 2)
    if rotated:
        console.print(
            f"new Ed25519 identity for {', '.join(nodes)}: copy these keys files to their nodes: "
            + ", ".join(str(p.relative_to(out_dir)) for p in rotated)
        )
    if version is not None:
        console.print(
            f"roster version {version} in {out_dir}/roster.json holds the new keys: `fedtier provision publish --out "
            f"{out_dir}` publishes it (until then every cell takes the old keys back from the roster it holds)"
        )
    console.print(
        f"renewed {len(done.certificates)} certificates in {out_dir} "
        f"({', '.join(p.parent.name + '/' + p.name for p in done.certificates[:6])}"
        f"{', ...' if len(done.certificates) > 6 else ''}); {len(done.revoked)} revoked in ca/ca.crl and "
        "every broker folder"
    )
    if done.passed_over:
        console.print(
            f"passed over the revoked {', '.join(done.passed_over)}: a revoked node's certificate is never re-issued",
            soft_wrap=True,
        )
    for line in done.brokers:
        console.print(line)
    for step in next_steps(done.certificates, done.brokers):
        console.print(f"next: {step}", soft_wrap=True)


@provision.command("relocate")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, exists=True), help="The folder.")
def relocate(out_dir: str) -> None:
    """Point a moved provisioning folder's broker configs at where their files are now (Mosquitto resolves
    relative paths against its working directory, so the configs hold absolute ones); then restart the
    brokers."""
    from protocols.config import ConfigError

    from .broker_files import relocate as rewrite

    try:
        moved = rewrite(out_dir)
    except ConfigError as exc:
        fail(str(exc), 2)
    if not moved:
        console.print(f"{out_dir}: the broker configs already name their folders; nothing to do")
    for folder in moved:
        console.print(f"{folder / 'mosquitto.conf'}: paths now under {folder.resolve()}")


@provision.command("create")
@CONFIG
@SET
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder to write.")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="The broker's host name or IP (in its certificate and the nodes' broker URL).",
)
@click.option("--port", default=8883, show_default=True, type=click.IntRange(1, 65535), help="The broker's TLS port.")
@click.option(
    "--max-chunk",
    default=256 * 1024,
    show_default=True,
    type=click.IntRange(1024, 256 << 20),
    help="The nodes' MQTT chunk size (--max-chunk of fedtier run/agent): the broker refuses larger packets.",
)
@click.option(
    "--brokers",
    type=click.Choice(["shared", "per-cell"]),
    default="shared",
    show_default=True,
    help="per-cell: also a broker per cell in OUT/cells/CELL for its server and devices, bridged over "
    "TLS to the cloud broker (as fedtier run --brokers per-cell).",
)
@click.option(
    "--cell-host",
    default="{cell}",
    show_default=True,
    help="With --brokers per-cell: each cell broker's host ({cell} is replaced by the cell id).",
)
@click.option(
    "--cell-port",
    default=8883,
    show_default=True,
    type=click.IntRange(1, 65535),
    help="... and TLS port of the first cell's broker: each next cell's is one more (brokers on one host "
    "do not collide).",
)
@click.option(
    "--broker-user",
    default=None,
    metavar="USER",
    help="Give the brokers' files to this user (as root; e.g. mosquitto): Mosquitto started as root "
    "drops to it and must still read its keys. As root without it: the mosquitto user if it exists, "
    "else a warning.",
)
@click.option("--bind", default="", metavar="ADDRESS", help="The brokers' listen address (default: all interfaces).")
@click.option(
    "--max-device-samples",
    type=Finite(min=0, min_open=True, max=None),
    default=None,
    metavar="N",
    help="The most samples a device may claim (security.max_device_weight in every bundle: a cell refuses "
    "a larger device weight, the cloud a cell weight above its devices' bounds). Default: the config's, "
    "else the largest device of the config's data partition.",
)
@click.option("--force", is_flag=True, help="Replace an earlier provisioning in --out.")
@click.option(
    "--federation",
    is_flag=True,
    help="Bundles for long-lived nodes (fedtier cloud|cell|agent --serve, jobs via fedtier submit): no "
    "training config, and a systemd unit per node.",
)
@click.option(
    "--fedtier-bin",
    default="/usr/local/bin/fedtier",
    show_default=True,
    help="With --federation: the fedtier script the systemd units run.",
)
def create(
    config: str,
    overrides: tuple[str, ...],
    out_dir: str,
    host: str,
    port: int,
    max_chunk: int,
    brokers: str,
    cell_host: str,
    cell_port: int,
    broker_user: str | None,
    bind: str,
    max_device_samples: float | None,
    force: bool,
    federation: bool,
    fedtier_bin: str,
) -> None:
    """Provision a deployment of CONFIG: a CA and per-node certificates, Ed25519 identities, a Mosquitto
    config (TLS listener: client certificates are the logins; ACL file) and a bundle per node in OUT/nodes/NODE.
    `fedtier provision renew --out OUT [--node NODE]` re-issues certificates later (see its --help)."""
    from protocols.config import ConfigError

    from .provisioning import provision as write

    cfg = load_deployment_or_exit(config, overrides)
    if brokers == "per-cell" and cell_port + cfg.topology.cells - 1 > 65535:
        fail(f"--cell-port {cell_port}: the last of {cfg.topology.cells} cell brokers would listen past port 65535", 2)
    try:
        bound = max_device_samples or cfg.security.max_device_weight or partition_bound(cfg)
        done = write(
            cfg,
            out_dir,
            host=host,
            port=port,
            max_chunk=max_chunk,
            overwrite=force,
            per_cell=brokers == "per-cell",
            cell_host=cell_host,
            cell_port=cell_port,
            broker_user=broker_user,
            bind=bind,
            max_device_weight=bound,
            federation=federation,
            fedtier_bin=fedtier_bin,
        )
    except ConfigError as exc:
        fail(str(exc), 2)
    except OSError as exc:  # --out under a file, read-only, full
        fail(f"--out {out_dir}: cannot write {exc.filename or 'it'}: {exc.strerror or exc}", 2)
    for warning in done.warnings:
        print_error(warning, "warning", "yellow")
    console.print(
        f"provisioned {'federation' if federation else 'run'} {cfg.run.name!r} in {done.out}: "
        f"broker config in {done.broker} "
        f"(mosquitto -c {done.broker / 'mosquitto.conf'}), {len(done.bundles)} node bundles in "
        f"{done.out / 'nodes'}"
        + (f", {len(done.cell_brokers)} cell brokers in {done.out / 'cells'}" if done.cell_brokers else "")
        + f"; devices may claim at most {bound:g} samples"
        + f"; keep {done.out / 'ca'} and {done.out / 'keys.toml'} offline"
    )


def partition_bound(cfg) -> int:
    """The sample count of the largest device of ``cfg``'s data partition (what `fedtier run` gives it)."""
    from protocols.config import ConfigError
    from sim.hierarchy import prepare

    try:
        prep = prepare(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (or give --max-device-samples)") from None
    return max(len(prep.device_data.indices(d)) for d in cfg.topology.devices())
