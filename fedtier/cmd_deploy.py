"""Deployment commands, one per tier, each able to run on its own machine over a broker:
``fedtier cloud``, ``fedtier cell``, ``fedtier agent``."""

from __future__ import annotations

import json
from typing import NoReturn

import click

from protocols.rejections import RejectKind

from .cli import CONFIG, SET, VERBOSE, auth_options, main
from .cmd_keys import keys_option
from .console import (
    JOB_FAILED,
    console,
    exit_if_failed,
    load_deployment_or_exit,
    print_summary,
    round_progress,
    setup_logging,
)
from .metrics import linger, metrics_options, port_override, serve_metrics

BROKER = click.option(
    "--broker", "broker_url", metavar="mqtt://HOST:PORT", help="The broker (default: the config's [broker] url)."
)


INSECURE = click.option(
    "--insecure",
    is_flag=True,
    help="Run without [security] keys: nothing signed, so anyone the broker lets publish can forge the "
    "cloud's, a cell's or a device's messages (a test bed only).",
)


def _require_signed(cfg, insecure: bool) -> None:
    """Refuse (exit 2, saying why) to run an unsigned deployment node unless ``--insecure``; warn when it is."""
    if cfg.security.keys is not None:
        return
    if not insecure:
        _fail(
            ValueError(
                "unsigned deployment refused: the config has no [security] keys, so nothing this node sends "
                "or receives is signed and any client the broker admits could forge the cloud's, a cell's or "
                "a device's messages. Give --keys FILE (fedtier keys; fedtier provision writes one per "
                "bundle), or --insecure to run unsigned anyway (a test bed only)"
            ),
            2,
        )
    import logging

    logging.getLogger("fedtier").warning("--insecure: running unsigned; any broker client can forge messages")


def _check_keys(cfg, node: str) -> None:
    """With [security] keys: fail now (exit 2) if the file lacks what ``node`` needs."""
    from protocols.wire.keys import node_trust

    node_trust(cfg, node)


def _broker(cfg, broker_url, auth):
    from edge_agent.runner import BrokerOptions

    return BrokerOptions.from_config(cfg, broker_url, **auth)


def _spec(cfg, source=None):
    """``(model spec, data of source or None)``: the model's geometry from the data source when it records
    it, else from the config's dataset name (known without loading the dataset)."""
    from sim.datasets import dataset_geometry

    shape, classes = dataset_geometry(cfg.data.dataset, **cfg.data.loader_params())
    data = None
    if source is not None:
        from edge_agent.runner import load_device_data

        data, own_shape, own_classes = load_device_data(source, input_shape=shape)
        shape, classes = own_shape or shape, own_classes or classes
    return cfg.model_spec(shape, classes), data


def watch_cloud(node):
    """A :class:`CloudSession` fed by ``node``'s transport: the cloud's status and ``finished`` records
    (a cell leaves on the ``finished`` of the cloud's current session only, never on a stale one)."""
    from protocols.session import CloudSession
    from protocols.status import decode_status
    from protocols.wire import topics
    from protocols.wire.messenger import Messenger

    trust = getattr(node, "trust", None)
    own = getattr(node, "cloud", None)  # a cell's own view, fed by its status handler: share it (a second
    cloud = own if isinstance(own, CloudSession) else CloudSession()  # handler could miss the retained status)
    control = Messenger(node.transport, node.run, "watcher", trust=trust)

    def on_control(topic: str, data: bytes) -> None:
        msg = control.receive(topic, data, kinds=("control",)) if data else None
        if msg is not None and trust is not None and msg.header.sender != "cloud":
            control.reject(
                topic, RejectKind.WRONG_SENDER, f"control record signed by {msg.header.sender!r}, not the cloud", None
            )
            return
        if msg is not None and msg.payload.meta.get("event") == "finished":
            cloud.on_finished(msg.payload.meta.get("session"))

    node.transport.subscribe(topics.control(node.run), on_control)
    if cloud is not own:
        node.transport.subscribe(
            topics.status(node.run, "cloud"),
            lambda t, data: cloud.on_status(decode_status(data, t, trust) if data else None),
        )
    return cloud


def _serve(node, loop, cloud=None) -> None:
    """Run a server node's loop in this thread until the run is finished or Ctrl-C; then stop it.
    A cell watches the cloud (``cloud``: a :func:`watch_cloud` of it, made here if not given)."""
    try:
        if not hasattr(node, "finished") and cloud is None:  # a cell: leaves when the run is finished
            cloud = watch_cloud(node)
        loop.post(node.start)
        loop.run(until=lambda: (cloud is not None and cloud.finished) or getattr(node, "finished", False))
    except KeyboardInterrupt:
        console.print("interrupted")
    finally:
        loop.stop()
        node.stop()


def _fail(exc: Exception, code: int) -> NoReturn:
    console.print(f"[bold red]error:[/] {exc}")
    raise SystemExit(code)


@main.command()
@keys_option
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
    help="Long-lived node of a provisioned federation: serve one submitted job after another (each job's "
    "config comes from the cloud, signed; the bundle's training sections are ignored) until SIGTERM.",
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
    from cloud.node import build_cloud
    from edge_agent.runner import offline_will
    from protocols.config import ConfigError
    from protocols.jsonl import StorageError
    from protocols.transport.threadloop import ThreadLoop
    from sim.hierarchy import fresh_output, make_evaluator
    from sim.launcher import RunResult, write_final

    setup_logging(verbose)
    cfg = load_deployment_or_exit(config, overrides + port_override(metrics_port))
    _require_signed(cfg, insecure)
    if serve:
        from cloud.jobs import JobQueueError

        from .serve import serve_cloud

        try:
            serve_cloud(cfg, _broker(cfg, broker_url, auth), test_data, _spec)
        except ConfigError as exc:
            _fail(exc, 2)
        except JobQueueError as exc:
            _fail(exc, 1)
        return
    try:
        spec, test = _spec(cfg, test_data)
        opts = _broker(cfg, broker_url, auth)
        _check_keys(cfg, "cloud")
        out = fresh_output(cfg, resume)
        loop = ThreadLoop("cloud")
        transport = opts.transport("cloud", cfg.run.name, loop, will=offline_will(cfg.run.name, "cloud", cfg)).connect()
    except ConfigError as exc:
        _fail(exc, 2)
    except ConnectionError as exc:
        _fail(exc, 1)
    evaluator = make_evaluator(spec, test.x, test.y, cfg.runtime.device) if test is not None else None
    import time

    t0 = time.perf_counter()
    with round_progress(cfg, not no_progress) as on_round:
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
        exporter = serve_metrics(cfg)
        if exporter is not None:
            exporter.watch_cloud(node)
        _serve(node, loop)
    linger(exporter, metrics_linger)
    if node.finished:
        result = RunResult(
            cfg,
            node.role.global_params(),
            node.history,
            [],
            out,
            time.perf_counter() - t0,
            stopped=node.stopped,
            failed=node.failed,
        )
        try:
            write_final(out, result)
        except StorageError as exc:  # a full disk: the job's files are incomplete, say so
            console.print(f"[bold red]job failed:[/] {exc}")
            raise SystemExit(JOB_FAILED) from exc
        print_summary(result.summary(), out)
        exit_if_failed(result)


@main.command()
@keys_option
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
    from cell_server.node import build_cell
    from edge_agent.runner import offline_will
    from protocols.config import ConfigError
    from protocols.transport.threadloop import ThreadLoop
    from protocols.wire import topics

    setup_logging(verbose)
    cfg = load_deployment_or_exit(config, overrides + port_override(metrics_port))
    _require_signed(cfg, insecure)
    try:
        if cell_id not in cfg.topology.cell_ids():
            raise ConfigError(f"--cell {cell_id!r} is not in the topology ({', '.join(cfg.topology.cell_ids())})")
        if serve:
            from .serve import serve_cell

            served = serve_cell(cfg, cell_id, _broker(cfg, broker_url, auth), _spec)
            console.print(f"cell {cell_id}: served {len(served)} jobs ({', '.join(served)})")
            return
        spec, _ = _spec(cfg, None)
        opts = _broker(cfg, broker_url, auth)
        _check_keys(cfg, cell_id)
        out = cfg.output_dir()
        out.mkdir(parents=True, exist_ok=True)
        loop = ThreadLoop(f"cell-{cell_id}")
        node_name = topics.cell_node(cell_id)
        transport = opts.transport(
            node_name, cfg.run.name, loop, will=offline_will(cfg.run.name, node_name, cfg)
        ).connect()
    except ConfigError as exc:
        _fail(exc, 2)
    except ConnectionError as exc:
        _fail(exc, 1)
    from sim.hierarchy import edge_availability

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
        _fail(exc, 2)
    exporter = serve_metrics(cfg)
    if exporter is not None:
        exporter.watch_cell(node)
    console.print(f"cell {cell_id} serving {len(node.devices)} devices on {opts.url} (Ctrl-C to stop)")
    _serve(node, loop)
    linger(exporter, metrics_linger)
    if node.failure is not None:  # its handler raised: the job failed with it (the cloud says so too)
        from rich.markup import escape

        console.print(f"[bold red]cell {cell_id} failed:[/] {escape(node.failure)}")
        raise SystemExit(JOB_FAILED)


@main.command()
@keys_option
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
@click.option("--loader", default=None, metavar="MODULE:FUNCTION", help="Read --data with your own (x, y) loader.")
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
    help="With --backend onnx: the model written by `fedtier export` (sets runtime.onnx_model).",
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
    from edge_agent.node import cell_of
    from edge_agent.runner import AgentProcess, make_trainer
    from edge_agent.twin import twin_window
    from protocols.config import ConfigError

    setup_logging(verbose)
    if onnx_model:
        overrides = (*overrides, f"runtime.onnx_model={json.dumps(onnx_model)}")
    cfg = load_deployment_or_exit(config, overrides + port_override(metrics_port))
    _require_signed(cfg, insecure)
    if serve:
        from edge_agent.datasources import DataSource

        from .serve import serve_agent

        source = DataSource(data_path, label_column=label_column, loader=loader)
        try:
            _, data = _spec(cfg, source)
            served, tasks = serve_agent(
                cfg,
                device,
                data,
                _broker(cfg, broker_url, auth),
                lambda job_cfg, spec: make_trainer(backend, spec, job_cfg),
                lambda job_cfg, _: _spec(job_cfg, source),
            )
        except (ConfigError, ValueError) as exc:
            _fail(exc, 2)
        except ConnectionError as exc:  # e.g. another agent is live under this device id (edge_agent/twin.py)
            _fail(exc, 1)
        console.print(f"device {device}: served {len(served)} jobs ({', '.join(served)}), {tasks} tasks")
        return
    try:
        cell_of(cfg, device)
        from edge_agent.datasources import DataSource

        spec, data = _spec(cfg, DataSource(data_path, label_column=label_column, loader=loader))
        opts = _broker(cfg, broker_url, auth)
        _check_keys(cfg, device)
        from sim.hierarchy import device_availability

        agents = AgentProcess(
            cfg,
            cfg.build_algorithm(spec),
            {device: data},
            make_trainer(backend, spec, cfg),
            opts,
            availability=device_availability(cfg),
            twin_window=twin_window(cfg.runtime.heartbeat),  # a second agent under this id is refused (twin.py)
        )  # partial participation: leaves when absent
        agents.start()
    except (ConfigError, ValueError) as exc:
        _fail(exc, 2)
    except ConnectionError as exc:
        _fail(exc, 1)
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
