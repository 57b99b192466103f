"""The ``fedtier`` command line. ``fedtier --help`` lists the commands."""

from __future__ import annotations

import click

from protocols.fast_exit import skip_exit_collection

from . import __version__
from .console import (
    JOB_FAILED,
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

CONFIG = click.argument("config", type=click.Path(exists=True, dir_okay=False))
SET = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a config key, e.g. --set run.rounds=5 (repeatable).",
)


VERBOSE = click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")


def auth_options(fn):
    """The broker credential and TLS flags (each defaults to the config's ``[broker]`` value)."""
    for opt in reversed(
        (
            click.option("--username", default=None, help="Broker user name (default: [broker] username)."),
            click.option("--password", default=None, help="Broker password (default: [broker] password)."),
            click.option(
                "--ca-certs",
                type=click.Path(exists=True, dir_okay=False),
                default=None,
                help="CA bundle for TLS (passed to paho's tls_set).",
            ),
            click.option(
                "--certfile",
                type=click.Path(exists=True, dir_okay=False),
                default=None,
                help="Client certificate for TLS.",
            ),
            click.option(
                "--keyfile",
                type=click.Path(exists=True, dir_okay=False),
                default=None,
                help="Client private key for TLS.",
            ),
        )
    ):
        fn = opt(fn)
    return fn


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fedtier")
def main() -> None:
    """fedtier: federated learning over device -> cell -> cloud hierarchies."""
    skip_exit_collection()  # a process that imported torch exits in ~0.15 s, not ~1 s


@main.command()
@CONFIG
@SET
@click.option("--resume", is_flag=True, help="Continue from the run's last checkpoint.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option(
    "--workers",
    type=click.IntRange(min=0),
    default=None,
    help="Train the devices in N workers (runtime.sim_workers): processes, or Ray actors with runtime.sim_backend "
    '= "ray"; 0: in this process.',
)
@click.option(
    "--engine",
    type=click.Choice(["device", "cohort"]),
    default=None,
    help="device: each device alone (bit-identical to fedtier run); cohort: an edge round's devices "
    "as one batched model (runtime.engine).",
)
@VERBOSE
def sim(
    config: str,
    overrides: tuple[str, ...],
    resume: bool,
    no_progress: bool,
    workers: int | None,
    engine: str | None,
    verbose: int,
) -> None:
    """Simulate CONFIG in one process, without a broker (same tier code, in-memory transport).

    Or spread it: --workers N trains the devices in N workers; --set runtime.cell_processes=N runs the cells, with
    their devices, in N processes (the cloud stays here; the same model; each process loads the whole data set and
    takes its share of runtime.cohort_threads). runtime.cell_processes refuses (exit 2, naming each) an asynchronous
    algorithm whose devices train in no virtual time, runtime.sim_workers, runtime.onnx_devices and more processes
    than cells: "runtime.cell_processes = 2 does not support: an asynchronous algorithm whose devices train in no
    virtual time (set [clock] device_steps_per_s); runtime.sim_workers (each cell process trains its devices
    itself)"."""
    from protocols.config import ConfigError
    from protocols.jsonl import StorageError
    from sim.cell_processes import CellProcessError
    from sim.executors import WorkerError
    from sim.launcher import run_simulation

    setup_logging(verbose)
    flags = ((f"runtime.sim_workers={workers}",) if workers is not None else ()) + (
        (f"runtime.engine={engine}",) if engine is not None else ()
    )
    cfg = load_or_exit(config, overrides + flags)
    note_resume(cfg, resume)
    try:
        with interruptible(), run_folder_lock(cfg), round_progress(cfg, not no_progress) as on_round:
            result = run_simulation(cfg, on_round=on_round, resume=resume)
    except ConfigError as exc:
        print_error(exc)
        refused_start(cfg, exc)
        raise SystemExit(2) from exc
    except WorkerError as exc:
        print_error(exc)  # a worker's traceback may hold [brackets]
        print_error("the same command with --resume continues from the last finished round", "stopped", "bold yellow")
        raise SystemExit(1) from exc
    except CellProcessError as exc:  # runtime.cell_processes: one died
        print_error(exc)
        raise SystemExit(1) from exc
    except StorageError as exc:  # a full disk while writing the final files
        print_error(exc, "job failed")
        raise SystemExit(JOB_FAILED) from exc
    print_summary(result.summary(), result.output_dir)
    exit_if_failed(result)


for _module in (
    "cmd_keys",
    "cmd_provision",
    "cmd_membership",
    "cmd_monitor",
    "cmd_logs",
    "cmd_report",
    "cmd_export",
    "cmd_partition",
    "cmd_fleet",
    "cmd_run",
    "cmd_deploy",
    "cmd_bridge",
    "cmd_jobs",
):  # command modules register themselves on ``main`` when imported
    __import__(f"{__package__}.{_module}")

if __name__ == "__main__":  # pragma: no cover
    main()
