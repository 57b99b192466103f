"""``fedtier partition``: per-device data sources from a known dataset, for trials and tests.

Writes what a real device would hold: ``OUT/<device>.npz`` (or ``.csv``, or a folder of images by
class), the held-out set ``OUT/test.npz`` for the cloud's evaluation, and ``OUT/sources.toml`` naming
each device's source. The split is the config's partition, so a deployment fed these files trains
exactly as ``fedtier sim`` does (byte for byte with npz and csv; images are 8-bit).
"""

from __future__ import annotations

import json

import click

from fedtier.cli import CONFIG, SET, main
from fedtier.console import console, fail, load_or_exit


@main.command()
@CONFIG
@SET
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="Folder to write the sources to.")
@click.option(
    "--format",
    "kind",
    type=click.Choice(["npz", "csv", "images"]),
    default="npz",
    show_default=True,
    help="What each device's source is: a .npz, a .csv with a label column, or a folder of images by class.",
)
@click.option("--force", is_flag=True, help="Write into a folder that already holds sources.")
def partition(config: str, overrides: tuple[str, ...], out: str, kind: str, force: bool) -> None:
    """Split CONFIG's dataset over its devices as the run would, one data source per device."""
    from pathlib import Path

    from edge_agent.datasources import DataSourceError, write_source
    from protocols.config import ConfigError
    from protocols.trainer import LocalData
    from sim.hierarchy import prepare

    cfg = load_or_exit(config, overrides)
    root = Path(out)
    if (root / "sources.toml").exists() and not force:
        fail(f"{root} already holds sources (sources.toml); pass --force to overwrite them", 2)
    try:
        prep = prepare(cfg)
        spec = prep.spec
        suffix = {"npz": ".npz", "csv": ".csv", "images": ""}[kind]
        lines = [f"# data sources of run {cfg.run.name!r}: {cfg.data.dataset}, partition {cfg.data.partition}", ""]
        lines.append("[sources]")
        total = 0
        for device, data in prep.device_data.items():
            path = write_source(root / f"{device}{suffix}", data, spec.input_shape, spec.num_classes, kind)
            lines.append(f"{json.dumps(device)} = {json.dumps(path.name)}")
            total += len(data)
        ds = prep.dataset
        write_source(root / "test.npz", LocalData(ds.x_test, ds.y_test), spec.input_shape, spec.num_classes, "npz")
    except (ConfigError, DataSourceError, ValueError, OSError) as exc:
        fail(str(exc), 2)
    (root / "sources.toml").write_text("\n".join(lines) + "\n")
    console.print(
        f"wrote {len(prep.device_data)} {kind.removesuffix('s')} sources ({total:,} samples) and test.npz to {root}; "
        f"start each agent with --data {root}/<device>{suffix}"
    )
