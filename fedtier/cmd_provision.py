"""``fedtier provision``: a CA, certificates, node identities, a Mosquitto config with ACLs, and one
bundle per node (``fedtier/provisioning.py``)."""
from __future__ import annotations

import click

from .cli import CONFIG, SET, main
from .console import console, load_or_exit


@main.command()
@CONFIG
@SET
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder to write.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="The broker's host name or IP (in its certificate and the nodes' broker URL).")
@click.option("--port", default=8883, show_default=True, type=int, help="The broker's TLS port.")
@click.option("--max-chunk", default=256 * 1024, show_default=True, type=int,
              help="The nodes' MQTT chunk size (--max-chunk of fedtier run/agent): the broker refuses larger packets.")
@click.option("--force", is_flag=True, help="Replace an earlier provisioning in --out.")
def provision(config: str, overrides: tuple[str, ...], out_dir: str, host: str, port: int, max_chunk: int,
              force: bool) -> None:
    """Provision a deployment of CONFIG: a CA and per-node certificates, Ed25519 identities, a Mosquitto
    config (TLS listener, password_file, ACL file) and a bundle per node in OUT/nodes/NODE."""
    from protocols.config import ConfigError

    from .provisioning import provision as write

    cfg = load_or_exit(config, overrides)
    try:
        done = write(cfg, out_dir, host=host, port=port, max_chunk=max_chunk, overwrite=force)
    except ConfigError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise SystemExit(2)
    console.print(f"provisioned run {cfg.run.name!r} in {done.out}: broker config in {done.broker} "
                  f"(mosquitto -c {done.broker / 'mosquitto.conf'}), {len(done.bundles)} node bundles in "
                  f"{done.out / 'nodes'}; keep {done.out / 'ca'} and {done.out / 'keys.toml'} offline")
