"""``fedtier export``: the run's model as ONNX (parameters as graph inputs) for forward-only agents."""

from __future__ import annotations

import click

from fedtier.cli import CONFIG, SET, main
from fedtier.console import console, fail, load_or_exit


@main.command()
@CONFIG
@SET
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False), help="Where to write the .onnx file.")
def export(config: str, overrides: tuple[str, ...], out: str) -> None:
    """Export CONFIG's model, with the run's initial parameters x_0, to ONNX for onnxruntime devices."""
    from protocols.config import ConfigError, check_forward_only
    from protocols.onnx_export import export_onnx
    from sim.hierarchy import prepare

    cfg = load_or_exit(config, overrides)
    try:
        check_forward_only(cfg, "fedtier export")  # was written, and refused later by every onnx agent
        spec = prepare(cfg).spec  # the data set fixes the input shape and the number of classes
        path = export_onnx(spec, cfg.build_algorithm(spec).initial_params(), out, cfg.x0_origin())
    except (ConfigError, ValueError) as exc:
        fail(str(exc), 2)
    except OSError as exc:  # --out in a missing or read-only folder
        fail(f"--out: cannot write {out}: {exc.strerror or exc}", 2)
    console.print(f"wrote {path} ({spec.name}, {path.stat().st_size:,} bytes; start agents with --backend onnx)")
