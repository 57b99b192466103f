"""``fedtier fleet``: every node of a run or federation, from the broker's retained status records."""

from __future__ import annotations

import json
import time

import click

from fedtier.cli import auth_options, main
from fedtier.cli_types import Finite
from fedtier.console import fail, live_connection, live_target, output_console, public_keys_or_exit


@main.command()
@click.option("--broker", metavar="URL", help="The broker (mqtt://host:port or mqtts://...).")
@click.option("--run", "run_name", metavar="NAME", help="The run or federation name.")
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    metavar="FILE",
    help="A bundle's config.toml (e.g. the monitor's, run from inside the bundle): broker, credentials, TLS "
    "files, name and keys; the flags override it.",
)
@auth_options
@click.option(
    "--keys",
    "keys_file",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="Public keys of the nodes: a status counts only if the node its topic names signed it.",
)
@click.option(
    "--wait",
    type=Finite(min=0.1),
    default=3.0,
    show_default=True,
    metavar="SECONDS",
    help="Seconds to listen: retained statuses come at once, heartbeats say who is alive now.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per node instead of the table.")
def fleet(
    broker: str | None,
    run_name: str | None,
    config_path: str | None,
    keys_file: str | None,
    wait: float,
    as_json: bool,
    **auth: str | None,
) -> None:
    """List every node (cloud, cells, devices): online (serving a job, or idle between jobs) or not, when
    last heard, fedtier and wire versions, capabilities (cores, memory, accelerator, backends), the cloud's
    current job. Exit 1 if no node answered."""
    from monitor.fleet import Fleet, render

    target = live_target(config_path, broker, run_name, keys_file, auth)
    if config_path is not None and not target.broker:  # as fedtier monitor --config says it
        fail(f"{config_path} names no broker ([broker] url): give --broker URL, or the monitor bundle's config", 2)
    if not target.broker or not target.run:
        fail("give --broker URL --run NAME, or --config with both in it", 2)
    view = Fleet(target.run, public_keys_or_exit(target.keys_file))
    with live_connection(target, "fleet", wait) as transport:
        view.start(transport)
        time.sleep(wait)
    if not view.nodes:
        where = f"{target.run!r} has a status on {target.broker}"
        fail(f"no node of {where} (wrong name or broker, or nothing ever started)", 1)
    if as_json:
        now = view.clock()
        for row in view.rows():
            click.echo(json.dumps(row.as_dict(now), sort_keys=True))
        return
    output_console().print(render(view))  # stdout, as `fedtier jobs`' table: `fedtier fleet > file` wrote nothing
