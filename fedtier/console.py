"""Shared terminal output for the CLI: progress over rounds, summaries, config loading with errors."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from protocols.config import ConfigError, RunConfig, load_config

console = Console(stderr=True)


def setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(
        level=level,
        format="%(message)s",
        datefmt="[%X]",
        handlers=[RichHandler(console=console, show_path=False)],
        force=True,
    )


def load_or_exit(path: str, overrides: tuple[str, ...]) -> RunConfig:
    """Load a config; on a bad one print the error (naming the keys) and exit with status 2."""
    try:
        return load_config(path, overrides)
    except ConfigError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        sys.exit(2)


def load_deployment_or_exit(path: str, overrides: tuple[str, ...]) -> RunConfig:
    """:func:`load_or_exit` for a deployment command: DP noise drawn from the OS unless the config sets an
    integer ``privacy.noise_seed`` (then a warning says who can remove the noise)."""
    from protocols.config import deployment_config

    cfg, warning = deployment_config(load_or_exit(path, overrides))
    if warning is not None:
        console.print(f"[bold yellow]warning:[/] {warning}")
    return cfg


@contextmanager
def round_progress(cfg: RunConfig, enabled: bool = True) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A progress bar over cloud rounds; yields the ``on_round`` callback that advances it."""
    if not enabled:
        yield lambda record: None
        return
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(f"{cfg.run.name} ({cfg.train.name})", total=cfg.run.rounds, status="")

        def on_round(record: dict[str, Any]) -> None:
            status = f"acc {record['accuracy']:.4f}" if "accuracy" in record else ""
            progress.update(task, completed=record["round"] + 1, status=status)

        yield on_round


def print_summary(summary: dict[str, Any], output_dir: Any) -> None:
    table = Table(title="run summary", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    keys = ("run", "status", "failed", "algorithm", "rounds", "accuracy", "loss", "epsilon", "stopped", "wall_s")
    for key in (*keys, "virtual_time_s"):
        if key not in summary:
            continue
        value = summary.get(key)
        if isinstance(value, float):
            value = f"{value:.4f}"
        table.add_row(key, str(value))
    for tier, n in summary.get("cumulative_bytes", {}).items():
        table.add_row(f"bytes {tier.replace('_', ' ')}", f"{n:,}")
    if summary.get("wire_bytes"):
        for tier, n in summary["wire_bytes"].items():
            table.add_row(f"wire {tier}", f"{n:,}")
    table.add_row("output", str(output_dir))
    Console().print(table)


def fail(message: str, code: int = 1) -> NoReturn:
    console.print(f"[bold red]error:[/] {message}")
    raise click.exceptions.Exit(code)


JOB_FAILED = 3
"""Exit status of a one-shot command (``fedtier run|sim|cloud``) whose job failed (1: an error before it ran,
2: a bad config)."""


def exit_if_failed(result: Any) -> None:
    """Exit with :data:`JOB_FAILED` and the reason when the job of ``result`` (a ``RunResult``) failed."""
    if getattr(result, "failed", None):
        from rich.markup import escape

        console.print(f"[bold red]job failed:[/] {escape(result.failed)}")
        raise SystemExit(JOB_FAILED)
