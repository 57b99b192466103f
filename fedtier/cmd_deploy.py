"""Deployment commands, one per tier, each able to run on its own machine over a broker:
``fedtier cloud``, ``fedtier cell``, ``fedtier agent``."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from protocols.config import RunConfig

from .cli import CONFIG, SET, VERBOSE, auth_options, main
from .cmd_keys import node_keys_option
from .console import (
    JOB_FAILED,
    console,
    exit_if_failed,
    print_error,
    print_summary,
    round_progress,
    run_folder_lock,
    setup_logging,
)
from .deploy_setup import (
    BROKER,
    INSECURE,
    Auth,
    broker_options,
    check_keys,
    fail_with,
    node_config,
    spec_and_data,
)
from .metrics import linger, metrics_options, port_override, serve_metrics
from .node_loop import serve_node

if TYPE_CHECKING:
    from cloud.server import CloudServer
    from edge_agent.broker import BrokerOptions
    from edge_agent.datasources import DataSource
    from protocols.algorithms.base import ModelSpec
    from protocols.transport.mqtt import MqttTransport
    from protocols.transport.threadloop import ThreadLoop


@main.command()
@node_keys_option
@CONFIG
@SET
@BROKER
@auth_options
@click.option(
    "--test-data",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="A .npz (x, y) held-out set for the cloud's central evaluation.",
)
@click.option("--resume", is_flag=True, help="Continue from the run's last checkpoint.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option(
    "--serve",
    is_flag=True,
    help="Long-lived cloud of a provisioned federation: queue the jobs the operator submits (fedtier submit, "
    "signed) and run one after another until SIGTERM; each job's config is the job's own, the bundle's training "
    "sections are ignored.",
)
@metrics_options
@INSECURE
@VERBOSE
def cloud(
    config: str,
    overrides: tuple[str, ...],
    broker_url: str | None,
    test_data: str | None,
    resume: bool,
    serve: bool,
    no_progress: bool,
    metrics_port: int | None,
    metrics_linger: float,
    insecure: bool,
    verbose: int,
    **auth,
) -> None:
    """Run the cloud aggregator of CONFIG; outputs go to the config's run folder."""
    setup_logging(verbose)
    cfg = node_config(config, overrides + port_override(metrics_port), insecure, serve, "cloud")
    if serve:
        _serve_cloud(cfg, broker_url, auth, test_data)
    else:
        _run_cloud(cfg, broker_url, auth, test_data, resume, not no_progress, metrics_linger)


def _serve_cloud(cfg: RunConfig, broker_url: str | None, auth: Auth, test_data: str | None) -> None:
    """``fedtier cloud --serve``: one submitted job after another (``fedtier/serve.py``)."""
    from cloud.jobs import JobQueueError
    from protocols.config import ConfigError
    from protocols.twin import TwinError

    from .serve import serve_cloud

    try:
        with run_folder_lock(cfg, "cloud"):
            opts = broker_options(cfg, broker_url, auth)
            say_serving("cloud", cfg, opts, f"its job queue and job folders in {cfg.output_dir().resolve()}")
            served = serve_cloud(cfg, opts, test_data, spec_and_data)
    except (
        ConfigError,
        TwinError,
    ) as exc:  # TwinError: another cloud is live, elsewhere (as the lock's: not restarted)
        fail_with(exc, 2)
    except JobQueueError as exc:
        fail_with(exc, 1)
    say_served(served)


def say_serving(node: str, cfg: RunConfig, opts: BrokerOptions, what: str) -> None:
    """A long-lived node's first line (its keys checked before: an id its bundle does not hold is refused first); from
    then on, its line as each job is taken and ends (``protocols.joblog``), plain as this one."""
    from protocols.joblog import show_job_lines

    check_keys(cfg, node.split()[-1])  # ("cloud", "cell c0", "device c0-d0")
    show_job_lines(say_served)
    console.print(
        f"{node} of federation {cfg.run.name!r} ({what}): connecting to {opts.url}, then serving the federation's "
        "jobs until SIGTERM or Ctrl-C (a line as each job is taken and ends; -v: each round's)",
        highlight=False,
        soft_wrap=True,  # one line, not broken at 80 columns: a journal's entry, a log file's line
    )


def say_served(line: str) -> None:
    """A long-lived node's line, one line as it is (no markup: a job's reason may hold brackets): its job lines and
    its last, the jobs it served (``fedtier.serve.served_summary``)."""
    console.print(line, highlight=False, markup=False, soft_wrap=True)


def _run_cloud(
    cfg: RunConfig,
    broker_url: str | None,
    auth: Auth,
    test_data: str | None,
    resume: bool,
    progress: bool,
    metrics_linger: float,
) -> None:
    """``fedtier cloud``: the one job of the config, to its end (or Ctrl-C); its result in the run folder."""
    from cloud.node import build_cloud
    from edge_agent.runner import offline_will
    from protocols.config import ConfigError
    from protocols.transport.threadloop import ThreadLoop
    from sim.hierarchy import fresh_output, make_evaluator

    try:
        spec, test = spec_and_data(cfg, test_data)
        opts = broker_options(cfg, broker_url, auth)
        check_keys(cfg, "cloud")
        loop = ThreadLoop("cloud")
        transport = opts.transport("cloud", cfg.run.name, loop, will=offline_will(cfg.run.name, "cloud", cfg)).connect()
    except ConfigError as exc:
        fail_with(exc, 2)
    except ConnectionError as exc:
        fail_with(exc, 1)
    try:  # once the broker answered: a cloud that cannot start leaves the last run's files as they were
        out = fresh_output(cfg, resume)
    except ConfigError as exc:
        transport.close()
        fail_with(exc, 2)
    evaluator = make_evaluator(spec, test.x, test.y, cfg.runtime.device) if test is not None else None
    t0 = time.perf_counter()
    with round_progress(cfg, progress) as on_round:
        try:  # what the cloud holds (e.g. DeComFL's log) is checked against this machine's memory
            node = build_cloud(
                cfg,
                transport,
                cfg.build_algorithm(spec),
                evaluator=evaluator,
                output_dir=out,
                resume=resume,
                startup_wait=cfg.runtime.startup_wait,
                on_round=on_round,
                collect_cell_records=True,
            )
        except ConfigError as exc:
            transport.close()
            fail_with(exc, 2)
        exporter = serve_metrics(cfg)
        if exporter is not None:
            exporter.watch_cloud(node)
        serve_node(node, loop)
    linger(exporter, metrics_linger)
    if node.finished:
        _finish_cloud(cfg, node, out, time.perf_counter() - t0)


def _finish_cloud(cfg: RunConfig, node: CloudServer, out: Path, wall_s: float) -> None:
    """The finished job's final files and summary; exit :data:`JOB_FAILED` if it failed or cannot be saved."""
    from protocols.jsonl import StorageError
    from sim.launcher import RunResult, write_final

    result = RunResult.of_cloud(cfg, node, out, wall_s)
    try:
        write_final(out, result)
    except StorageError as exc:  # a full disk: the job's files are incomplete, say so
        print_error(exc, "job failed")
        raise SystemExit(JOB_FAILED) from exc
    print_summary(result.summary(), out)
    exit_if_failed(result)


@main.command()
@node_keys_option
@CONFIG
@SET
@click.option("--cell", "cell_id", required=True, help="This cell's id (c0, c1, ...).")
@click.option("--resume", is_flag=True, help="Continue the round the cell was in when it stopped (its journal).")
@click.option(
    "--serve",
    is_flag=True,
    help="Long-lived node of a provisioned federation: serve one submitted job after another (each job's "
    "config comes from the cloud, signed; the bundle's training sections are ignored) until SIGTERM.",
)
@BROKER
@auth_options
@metrics_options
@INSECURE
@VERBOSE
def cell(
    config: str,
    overrides: tuple[str, ...],
    cell_id: str,
    resume: bool,
    serve: bool,
    broker_url: str | None,
    metrics_port: int | None,
    metrics_linger: float,
    insecure: bool,
    verbose: int,
    **auth,
) -> None:
    """Run the edge server of one cell of CONFIG (its aggregation log goes to the config's run folder)."""
    from protocols.config import ConfigError

    setup_logging(verbose)
    cfg = node_config(config, overrides + port_override(metrics_port), insecure, serve, "cell")
    if cell_id not in cfg.topology.cell_ids():
        fail_with(ConfigError(f"--cell {cell_id!r} is not in the topology ({', '.join(cfg.topology.cell_ids())})"), 2)
    if serve:
        from protocols.twin import TwinError

        from .serve import serve_cell

        try:
            with run_folder_lock(cfg, f"cell {cell_id}"):
                opts = broker_options(cfg, broker_url, auth)
                say_serving(f"cell {cell_id}", cfg, opts, f"its job folders in {cfg.output_dir().resolve()}")
                served = serve_cell(cfg, cell_id, opts, spec_and_data)
        except (ConfigError, TwinError) as exc:  # TwinError: another process of the cell is live (not restarted)
            fail_with(exc, 2)
        except ConnectionError as exc:
            fail_with(exc, 1)
        say_served(served)
    else:
        _run_cell(cfg, cell_id, broker_url, auth, resume, metrics_linger)


def _connect_cell(
    cfg: RunConfig, cell_id: str, broker_url: str | None, auth: Auth
) -> tuple[ModelSpec, BrokerOptions, Path, ThreadLoop, MqttTransport]:
    """The cell's model spec, broker options, run folder, loop and connected transport (exit 2 on a bad config,
    1 when the broker cannot be reached)."""
    from edge_agent.runner import offline_will
    from protocols.config import ConfigError
    from protocols.transport.threadloop import ThreadLoop
    from protocols.wire import topics

    try:
        spec, _ = spec_and_data(cfg, None)
        opts = broker_options(cfg, broker_url, auth)
        check_keys(cfg, cell_id)
        out = cfg.output_dir()
        out.mkdir(parents=True, exist_ok=True)
        loop = ThreadLoop(f"cell-{cell_id}")
        node_name = topics.cell_node(cell_id)
        transport = opts.transport(
            node_name, cfg.run.name, loop, will=offline_will(cfg.run.name, node_name, cfg)
        ).connect()
    except ConfigError as exc:
        fail_with(exc, 2)
    except ConnectionError as exc:
        fail_with(exc, 1)
    return spec, opts, out, loop, transport


def _run_cell(
    cfg: RunConfig, cell_id: str, broker_url: str | None, auth: Auth, resume: bool, metrics_linger: float
) -> None:
    """``fedtier cell``: serve the cell's devices until the cloud's job is finished (or Ctrl-C); exit
    :data:`JOB_FAILED` if the cell failed, 1 if it refused to work (an async cell restarted without its journal)."""
    from cell_server.node import build_cell
    from protocols.config import ConfigError
    from sim.hierarchy import edge_availability

    spec, opts, out, loop, transport = _connect_cell(cfg, cell_id, broker_url, auth)
    # device-level participation: as in `fedtier run`, absent devices leave
    try:
        node = build_cell(
            cfg,
            cell_id,
            transport,
            cfg.build_algorithm(spec),
            output_dir=out,
            heartbeats=True,
            availability=edge_availability(cfg),
            journal=True,
            resume=resume,
        )
    except ConfigError as exc:
        transport.close()
        fail_with(exc, 2)
    exporter = serve_metrics(cfg)
    if exporter is not None:
        exporter.watch_cell(node)
    console.print(f"cell {cell_id} serving {len(node.devices)} devices on {opts.url} (Ctrl-C to stop)")
    ended = serve_node(node, loop, ended_wait=cfg.runtime.startup_wait)
    linger(exporter, metrics_linger)
    if ended is not None:  # as a device never planned: the job ended without it, not an error of this cell
        console.print(
            f"cell {cell_id}: the job was over before this cell started (the cloud finished session {ended} and "
            f"no cloud came online within runtime.startup_wait = {cfg.runtime.startup_wait:g} s); nothing to do"
        )
        return
    if (refused := getattr(node, "refused", None)) is not None:  # an async cell restarted without its journal
        print_error(refused, f"cell {cell_id} refused to work")
        raise SystemExit(1)
    if node.failure is not None:  # its handler raised: the job failed with it (the cloud says so too)
        print_error(node.failure, f"cell {cell_id} failed")
        raise SystemExit(JOB_FAILED)


@main.command()
@node_keys_option
@CONFIG
@SET
@click.option("--device", required=True, help="This device's id (c0-d0, ...).")
@click.option(
    "--data",
    "data_path",
    required=True,
    type=click.Path(exists=True),
    help="The device's local data: a .npz (x, y), a .csv with a header and a label column, or a folder of "
    "images in one sub-folder per integer label (see `fedtier partition`).",
)
@click.option("--label-column", default="label", show_default=True, help="The label column of a CSV source.")
@click.option("--loader", metavar="MODULE:FUNCTION", help="Read --data: FUNCTION(path) -> (x, y); MODULE on PYTHONPATH")
@click.option(
    "--backend",
    type=click.Choice(["torch", "onnx"]),
    default="torch",
    show_default=True,
    help="Trainer backend (onnx: forward-only on onnxruntime, no torch; e.g. for decomfl).",
)
@click.option(
    "--onnx-model",
    type=click.Path(exists=True, dir_okay=False),
    help="With --backend onnx: the device's model written by `fedtier export` (sets runtime.onnx_model); with "
    "--serve, every job's (a job's runtime.onnx_model is not read; one it cannot serve is refused).",
)
@click.option(
    "--serve",
    is_flag=True,
    help="Long-lived node of a provisioned federation: serve one submitted job after another (each job's "
    "config comes from the cloud, signed; the bundle's training sections are ignored) until SIGTERM.",
)
@BROKER
@auth_options
@metrics_options
@INSECURE
@VERBOSE
def agent(
    config: str,
    overrides: tuple[str, ...],
    device: str,
    data_path: str,
    label_column: str,
    loader: str | None,
    backend: str,
    onnx_model: str | None,
    serve: bool,
    broker_url: str | None,
    metrics_port: int | None,
    metrics_linger: float,
    insecure: bool,
    verbose: int,
    **auth,
) -> None:
    """Run one device agent of CONFIG: connect, answer tasks with the local data, exit when the run is finished."""
    from edge_agent.datasources import DataSource

    setup_logging(verbose)
    if onnx_model:
        overrides = (*overrides, f"runtime.onnx_model={json.dumps(onnx_model)}")
    cfg = node_config(config, overrides + port_override(metrics_port), insecure, serve, "agent")
    source = functools.partial(DataSource, data_path, label_column=label_column, loader=loader)
    if serve:
        _serve_agent(cfg, device, source(), backend, broker_url, auth)
    else:
        _run_agent(cfg, device, source, backend, broker_url, auth, metrics_linger)


def _serve_agent(
    cfg: RunConfig, device: str, source: DataSource, backend: str, broker_url: str | None, auth: Auth
) -> None:
    """``fedtier agent --serve``: train for one submitted job after another with ``source``'s data, on ``backend``
    with the device's own onnx model (the bundle's ``runtime.onnx_model``, ``--onnx-model``), whatever a job says."""
    from edge_agent.backends import DeviceBackend
    from edge_agent.datasources import load_device_data
    from protocols.config import ConfigError
    from protocols.twin import TwinError

    from .serve import serve_agent

    own = DeviceBackend(backend, cfg.runtime.onnx_model)
    try:
        own.check()  # a model it cannot load is refused now, not at each job
        data = load_device_data(source)[0]  # its format now; each job checks it against the job's model
        opts = broker_options(cfg, broker_url, auth)
        say_serving(f"device {device}", cfg, opts, f"{len(data)} samples")
        served = serve_agent(
            cfg,
            device,
            data,
            opts,
            own.trainer,  # a job it cannot serve (gradients, another model) is refused for that job
            lambda job_cfg, _: spec_and_data(job_cfg, source),
        )
    except (ConfigError, ValueError, TwinError) as exc:  # TwinError: a live agent has this id (not restarted)
        fail_with(exc, 2)
    except ConnectionError as exc:
        fail_with(exc, 1)
    say_served(served)


def _run_agent(
    cfg: RunConfig,
    device: str,
    open_source: Callable[[], DataSource],
    backend: str,
    broker_url: str | None,
    auth: Auth,
    metrics_linger: float,
) -> None:
    """``fedtier agent``: answer the config's job's tasks with the data of ``open_source()`` until the run is
    finished (or Ctrl-C)."""
    from edge_agent.backends import DeviceBackend
    from edge_agent.node import cell_of
    from edge_agent.runner import AgentProcess
    from protocols.config import ConfigError, check_forward_only
    from protocols.twin import TwinError, twin_window
    from sim.hierarchy import device_availability

    try:
        cell_of(cfg, device)
        if backend == "onnx":
            check_forward_only(cfg, "--backend onnx")
        spec, data = spec_and_data(cfg, open_source())
        opts = broker_options(cfg, broker_url, auth)
        check_keys(cfg, device)
        agents = AgentProcess(
            cfg,
            cfg.build_algorithm(spec),
            {device: data},
            DeviceBackend(backend, cfg.runtime.onnx_model).trainer(cfg, spec),  # onnx: the config's model (checked)
            opts,
            availability=device_availability(cfg),
            twin_window=twin_window(cfg.runtime.heartbeat),  # a second agent under this id is refused (twin.py)
        )  # partial participation: leaves when absent
        agents.start()
    except (ConfigError, ValueError, TwinError) as exc:  # TwinError: a live agent has this id (not restarted)
        fail_with(exc, 2)
    except ConnectionError as exc:
        fail_with(exc, 1)
    exporter = serve_metrics(cfg, agents)
    console.print(f"device {device} ({len(data)} samples) connected to {opts.url}; waiting for tasks (Ctrl-C to stop)")
    try:
        agents.wait()
    except KeyboardInterrupt:
        console.print("interrupted")
    finally:
        agents.stop()
    linger(exporter, metrics_linger)
    stats = agents.stats()[device]
    console.print(
        f"device {device}: {stats['tasks']} tasks, {stats['wire']['bytes_out']:,} bytes sent, "
        f"{stats['wire']['bytes_in']:,} received"
    )
