"""``fedtier run``: the emulated hierarchy (cloud, cells, agent processes) over a real MQTT broker."""

from __future__ import annotations

import click

from .cli import CONFIG, SET, VERBOSE, main
from .cli_types import PROCESSES
from .cmd_keys import keys_option
from .console import (
    JOB_FAILED,
    console,
    exit_if_failed,
    interruptible,
    load_or_exit,
    note_resume,
    print_error,
    print_summary,
    refused_start,
    round_progress,
    run_folder_lock,
    setup_logging,
)
from .metrics import linger, metrics_options, port_override, serve_metrics


@main.command()
@keys_option
@CONFIG
@SET
@click.option(
    "--broker",
    "broker_url",
    metavar="mqtt://HOST:PORT",
    help="An external broker; default: [broker] url, else a Mosquitto started for the run "
    "(the embedded amqtt broker where Mosquitto is not installed).",
)
@click.option(
    "--brokers",
    type=click.Choice(["shared", "per-cell"]),
    default="shared",
    show_default=True,
    help="per-cell: a Mosquitto per cell, bridged to a cloud Mosquitto (only cell <-> cloud "
    "topics cross); prints the bytes through each broker.",
)
@click.option(
    "--workers",
    type=PROCESSES,
    default=None,
    help="Agent worker processes; devices are dealt round-robin over them "
    "(default: one per 100 agents, at most one per core).",
)
@click.option("--process-per-agent", is_flag=True, help="One worker process per device.")
@click.option(
    "--engine",
    type=click.Choice(["device", "cohort"]),
    default=None,
    help="device: each agent trains alone (bit-identical to fedtier sim); cohort: each worker trains "
    "its agents' queued tasks as one batched model (runtime.engine; large emulated fleets).",
)
@click.option(
    "--max-chunk",
    type=click.IntRange(1024, 256 << 20),
    default=None,
    metavar="BYTES",
    help="MQTT chunk size (default 256 KiB).",
)
@click.option("--resume", is_flag=True, help="Continue from the run's last checkpoint.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@metrics_options
@VERBOSE
def run(
    config: str,
    overrides: tuple[str, ...],
    broker_url: str | None,
    brokers: str,
    workers: int | None,
    process_per_agent: bool,
    engine: str | None,
    max_chunk: int | None,
    resume: bool,
    no_progress: bool,
    metrics_port: int | None,
    metrics_linger: float,
    verbose: int,
) -> None:
    """Emulate CONFIG on this machine over MQTT: the cloud and cells in this process, the device agents
    in worker processes, each device with its own broker connection. Same final model as `fedtier sim`
    (with the cohort engine: within float tolerance). Ctrl-C or SIGTERM stops it cleanly (exit 130); --resume
    continues it from its last round."""
    from protocols.config import ConfigError
    from protocols.jsonl import StorageError
    from protocols.wire import chunking
    from sim.emulation import Emulation

    setup_logging(verbose)
    engine_flag = (f"runtime.engine={engine}",) if engine is not None else ()
    cfg = load_or_exit(config, overrides + engine_flag + port_override(metrics_port))
    exporter = serve_metrics(cfg)
    note_resume(cfg, resume)
    try:
        with interruptible(), run_folder_lock(cfg), round_progress(cfg, not no_progress) as on_round:
            emulation = Emulation(
                cfg,
                broker_url=broker_url,
                brokers=brokers,
                workers=workers,
                process_per_agent=process_per_agent,
                on_round=on_round,
                resume=resume,
                max_chunk=max_chunk or chunking.DEFAULT_MAX_CHUNK,
                metrics=exporter,
            )
            result = emulation.run(check_live=True)  # on an external broker: a live run of this name refuses it
    except ConfigError as exc:
        print_error(exc)
        refused_start(cfg, exc)
        raise SystemExit(2) from exc
    except (ConnectionError, RuntimeError, TimeoutError) as exc:
        print_error(exc)
        raise SystemExit(1) from exc
    except StorageError as exc:  # a full disk while writing the final files
        print_error(exc, "job failed")
        raise SystemExit(JOB_FAILED) from exc
    print_summary(result.summary(), result.output_dir)
    for name, counts in emulation.broker_bytes.items():
        console.print(f"broker {name}: {counts['received']:,} bytes received, {counts['sent']:,} sent")
    linger(exporter, metrics_linger)
    exit_if_failed(result)
