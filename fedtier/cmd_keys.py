"""``fedtier keys``: per-node signing keys for a topology, and the ``--keys`` option of the launchers."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import click

from .cli import CONFIG, SET, main
from .console import console, load_or_exit, print_error

KEYS_HELP = (
    "Signing keys file (sets security.keys): every node signs what it sends and verifies its peers. "
    "fedtier sim/run generate it in the run folder when the file does not exist."
)


NODE_KEYS_HELP = (
    "Signing keys file (sets security.keys): this node's private key and its peers' public keys (its bundle's "
    "keys.toml from fedtier provision, or its share of fedtier keys); it signs what it sends and verifies its peers."
)
"""``--keys`` of a deployed node (fedtier cloud|cell|agent), which reads the file and makes none."""


def node_keys_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`keys_option` with :data:`NODE_KEYS_HELP`."""
    return keys_option(fn, NODE_KEYS_HELP)


def keys_option(fn: Callable[..., Any], help_text: str = KEYS_HELP) -> Callable[..., Any]:
    """``--keys PATH`` for a command with ``--set``: the same as ``--set security.keys=PATH``.
    Apply it directly below ``@main.command()``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, keys_path: str | None = None, **kwargs: Any) -> Any:
        if keys_path:
            kwargs["overrides"] = (*kwargs.get("overrides", ()), f"security.keys={json.dumps(keys_path)}")
        return fn(*args, **kwargs)

    return click.option(
        "--keys", "keys_path", type=click.Path(dir_okay=False), default=None, metavar="PATH", help=help_text
    )(wrapper)


@main.command()
@CONFIG
@SET
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="The keys file to write.")
@click.option(
    "--node",
    default=None,
    metavar="NODE",
    help="Write only what NODE needs (cloud, c0, c0-d1...): its private key and its peers' public "
    "keys (a device: the cloud's and its cell's; a cell: the cloud's and its devices'; the cloud: "
    "everyone's).",
)
@click.option(
    "--from",
    "from_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="With --node: the full keys file to take the keys from (default: security.keys).",
)
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
def keys(
    config: str, overrides: tuple[str, ...], out_path: str, node: str | None, from_path: str | None, force: bool
) -> None:
    """Generate an Ed25519 identity per node of CONFIG's topology (private and public keys), or extract
    one node's share of a keys file with --node. Use the file with [security] keys or --keys."""
    from protocols.config import ConfigError
    from protocols.wire.keys import generate_keys, load_keys, node_subset, write_keys

    cfg = load_or_exit(config, overrides)
    try:
        if node is None:
            if from_path:
                raise ConfigError("--from: only with --node (to extract one node's keys)")
            chosen = generate_keys(cfg.topology)
            comment = f"all nodes of run {cfg.run.name!r}"
        else:
            source = from_path or cfg.security.keys
            if not source:
                raise ConfigError("--node: give the full keys file with --from (or set security.keys)")
            chosen = node_subset(load_keys(source), cfg.topology, node)
            comment = f"node {node!r} of run {cfg.run.name!r}: its private key and its peers' public keys"
        path = write_keys(out_path, chosen, comment=comment, overwrite=force)
    except ConfigError as exc:
        print_error(exc)
        raise SystemExit(2) from exc
    except OSError as exc:  # --out under a file, read-only
        print_error(f"--out {out_path}: cannot write it: {exc.strerror or exc}")
        raise SystemExit(2) from exc
    names = ", ".join(list(chosen.private)[:6]) + (", ..." if len(chosen.private) > 6 else "")
    console.print(
        f"wrote {len(chosen.private)} private keys ({names}) and {len(chosen.public)} public keys to {path} (mode 600)"
    )
