"""The ``--metrics-port`` / ``--metrics-linger`` options of ``fedtier cloud``, ``cell``, ``run`` and ``agent``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from .cli_types import SECONDS
from .console import console, print_error


def metrics_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--metrics-port`` and ``--metrics-linger`` (passed as ``metrics_port``, ``metrics_linger``)."""
    fn = click.option(
        "--metrics-linger",
        type=SECONDS,
        default=0.0,
        show_default=True,
        metavar="SECONDS",
        help="When done, keep serving /metrics until a scraper stored the final values, at most this long.",
    )(fn)
    return click.option(
        "--metrics-port",
        type=click.IntRange(0, 65535),
        default=None,
        metavar="PORT",
        help="Serve Prometheus metrics on http://HOST:PORT/metrics (default: [monitoring] "
        "metrics_port; 0: a free port; HOST: [monitoring] metrics_host).",
    )(fn)


def port_override(port: int | None) -> tuple[str, ...]:
    """The ``--set`` override that ``--metrics-port`` stands for."""
    return () if port is None else (f"monitoring.metrics_port={port}",)


def serve_metrics(cfg: Any, agents: Any = None, follow: bool = False) -> Any:
    """A :class:`monitor.exporter.MetricsExporter` serving ``/metrics`` when the config asks for it, else None
    (``agents``: an ``edge_agent.runner.AgentProcess`` whose counters it serves too; ``follow``: one given
    later, to ``exporter.agents.follow``, as a long-lived agent starts its process with its first job)."""
    if cfg.monitoring.metrics_port is None:
        return None
    from monitor.exporter import AgentCollector, MetricsExporter

    exporter = MetricsExporter(cfg.run.name, devices=cfg.monitoring.device_metrics)
    if agents is not None or follow:
        exporter.agents = AgentCollector(cfg.run.name, agents)
        exporter.registry.register(exporter.agents)
    if cfg.broker.certfile and cfg.broker.username:  # a provisioned node: its certificate's days to expiry
        exporter.watch_certificate(cfg.broker.username, cfg.broker.certfile)
    try:
        port = exporter.serve(cfg.monitoring.metrics_port, cfg.monitoring.metrics_host)
    except OSError as exc:
        print_error(f"cannot serve metrics on {cfg.monitoring.metrics_host}:{cfg.monitoring.metrics_port}: {exc}")
        raise SystemExit(1) from exc
    console.print(f"metrics on http://{cfg.monitoring.metrics_host}:{port}/metrics")
    return exporter


def linger(exporter: Any, seconds: float) -> None:
    """``--metrics-linger``: wait until the final values were scraped (or ``seconds`` passed), then stop serving."""
    if exporter is None:
        return
    if seconds > 0 and not exporter.linger(seconds):
        console.print(f"metrics: no scrape of the final values within {seconds:g} s")
    exporter.close()
