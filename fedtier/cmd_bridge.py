"""``fedtier bridge-config``: the Mosquitto bridge of each cell broker to the cloud broker."""

from __future__ import annotations

from pathlib import Path

import click

from .cli import CONFIG, SET, main
from .console import console, fail, load_or_exit


@main.command("bridge-config")
@CONFIG
@SET
@click.option(
    "--cloud",
    "cloud_url",
    required=True,
    metavar="mqtt://HOST:PORT",
    help="The cloud broker, as the cell brokers reach it.",
)
@click.option("--cell", "cells", multiple=True, metavar="ID", help="Only these cells (repeatable; default: all).")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Write CELL.conf per cell into this folder (default: print).",
)
@click.option("--username", default=None, help="The bridges' user name at the cloud broker.")
@click.option("--password", default=None, help="... and password.")
@click.option("--cafile", default=None, help="CA certificate of the cloud broker (TLS).")
@click.option("--certfile", default=None, help="The bridges' client certificate (TLS).")
@click.option("--keyfile", default=None, help="... and its key.")
def bridge_config_cmd(
    config: str,
    overrides: tuple[str, ...],
    cloud_url: str,
    cells: tuple[str, ...],
    out_dir: str | None,
    username: str | None,
    password: str | None,
    cafile: str | None,
    certfile: str | None,
    keyfile: str | None,
) -> None:
    """Mosquitto config lines that bridge each cell's broker to the cloud broker: only the cell <-> cloud
    topics of the run (its task, report, status, telemetry, the cloud's round manifest, control and
    status) cross; device traffic stays in the cell. Append them to the cell broker's mosquitto.conf."""
    from protocols.transport.bridge import bridge_config

    cfg = load_or_exit(config, overrides)
    known = cfg.topology.cell_ids()
    unknown = [c for c in cells if c not in known]
    if unknown:
        fail(f"unknown cell(s) {unknown}; the config has {known[0]} ... {known[-1]}", 2)
    try:
        confs = {
            c: bridge_config(
                cfg.run.name,
                c,
                cloud_url,
                username=username,
                password=password,
                cafile=cafile,
                certfile=certfile,
                keyfile=keyfile,
            )
            for c in (cells or known)
        }
    except ValueError as exc:
        fail(str(exc), 2)
    if out_dir is None:
        click.echo("\n".join(confs.values()), nl=False)
        return
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for cell, text in confs.items():
        (folder / f"{cell}.conf").write_text(text)
    console.print(f"wrote {len(confs)} bridge config(s) to {folder}/")
