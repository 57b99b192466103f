"""``fedtier provision add-device|add-cell|revoke``: change a provisioned federation's members while it
runs (``fedtier/membership.py``)."""

from __future__ import annotations

import click

from .cli_types import Finite
from .cmd_provision import provision
from .console import console, fail

OUT = click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="The provisioned folder (fedtier provision --out).",
)
PUBLISH = click.option(
    "--publish/--no-publish",
    default=True,
    show_default=True,
    help="Publish the new roster on the broker with the operator's bundle, so the running cloud and cells take it now.",
)


def _done(
    change, out_dir: str, publish: bool, what: str, published: str | None = None, unreached: Exception | None = None
) -> None:
    """Say ``change`` and publish its roster (``published``: how publishing it already went; ``unreached``: why it
    could not, a broker it could not reach: not tried again)."""
    for line in change.brokers:
        console.print(line)
    console.print(f"{what}; roster version {change.version} in {out_dir}/roster.json")
    if published is not None:
        console.print(published)
    elif publish:
        _publish(out_dir, unreached)
    else:
        console.print(f"not published: `fedtier provision publish --out {out_dir}` publishes it")


def _publish(out_dir: str, unreached: Exception | None = None) -> None:
    """Publish OUT's roster (``unreached``: a try that could not reach the broker already), or exit 1 saying how to
    do it later."""
    from .membership import publish_roster

    try:
        if unreached is not None:
            raise unreached
        console.print(publish_roster(out_dir))
    except (ConnectionError, OSError, ValueError) as exc:  # ValueError: a ConfigError of the operator's bundle
        fail(
            f"could not publish the roster ({exc}); run `fedtier provision publish --out {out_dir}` with the "
            f"broker up (the cloud also takes roster.json from its bundle at its next start)",
            1,
        )


@provision.command("add-device")
@OUT
@click.option("--cell", required=True, help="The cell the device joins.")
@click.option("--device", required=True, help="The new device's id (never one revoked before).")
@click.option(
    "--max-samples",
    type=Finite(min=0, min_open=True, max=None),
    metavar="N",
    help="Its weight bound, in samples (default: the federation's).",
)
@PUBLISH
def add_device(out_dir: str, cell: str, device: str, max_samples: float | None, publish: bool) -> None:
    """Enroll a device: identity, certificate, bundle (OUT/nodes/DEVICE), broker login and ACL (the running
    broker reloaded), and a new roster version."""
    from .membership import MembershipError
    from .membership import add_device as add

    try:
        change = add(out_dir, cell, device, max_samples)
    except (MembershipError, ValueError) as exc:
        fail(str(exc), 2)
    _done(change, out_dir, publish, f"enrolled {device} in {cell}: its bundle is {change.bundle}")


@provision.command("add-cell")
@OUT
@click.option("--cell", required=True, help="The new cell's id.")
@PUBLISH
def add_cell(out_dir: str, cell: str, publish: bool) -> None:
    """Enroll a cell (then its devices with add-device)."""
    from .membership import MembershipError
    from .membership import add_cell as add

    try:
        change = add(out_dir, cell)
    except (MembershipError, ValueError) as exc:
        fail(str(exc), 2)
    _done(change, out_dir, publish, f"enrolled cell {cell}: its bundle is {change.bundle}")


@provision.command("revoke")
@OUT
@click.option("--node", "named", metavar="NODE", help="The device, or the cell with its devices, to revoke.")
@click.argument("node", required=False, metavar="[NODE]")
@PUBLISH
def revoke(out_dir: str, named: str | None, node: str | None, publish: bool) -> None:
    """Revoke --node NODE (a device, or a cell with its devices; `revoke NODE` too): its login and ACL removed, its
    certificate in the revocation list, its key dropped, a roster without it; cells refuse its messages."""
    from .membership import MembershipError, publish_roster
    from .membership import revoke as rv

    if named is not None and node is not None and named != node:
        fail(f"two nodes to revoke: --node {named} and {node} (one at a time)", 2)
    node = named or node
    if node is None:
        fail("which node? `fedtier provision revoke --out DIR --node NODE` (a device, or a cell with its devices)", 2)

    said: list[str] = []  # published before the brokers reload: the revoked node's connection still reads it then
    unreached: list[Exception] = []  # a broker it could not reach (~10 s of retries): not tried again after the reload

    def publish_first() -> None:
        try:
            said.append(publish_roster(out_dir))
        except (ConnectionError, OSError) as exc:
            unreached.append(exc)
        except ValueError:  # (a ConfigError of the operator's bundle: tried again after the reload, said then: _done)
            pass

    try:
        change = rv(out_dir, node, publish_first if publish else None)
    except (MembershipError, ValueError) as exc:
        fail(str(exc), 2)
    _done(change, out_dir, publish, f"revoked {node}", said[0] if said else None, unreached[0] if unreached else None)


@provision.command("publish")
@OUT
def publish(out_dir: str) -> None:
    """Publish OUT's current roster (OUT/roster.json, signed) on the broker with the operator's bundle, so the
    running cloud and cells take it: after a change made with --no-publish, or one whose publishing failed."""
    _publish(out_dir)
