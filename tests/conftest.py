"""Shared fixtures: small, fast configs on scikit-learn digits."""

from __future__ import annotations

import ast
import errno
import functools
import os
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from hypothesis import settings as hypothesis_settings

from protocols.config import RunConfig, parse_config
from protocols.fast_exit import skip_exit_collection

torch.set_num_threads(1)
skip_exit_collection()  # the test process too holds a torch-sized heap: no final collections over it

# Property tests draw the same examples on every run (CI must not depend on luck); set
# HYPOTHESIS_PROFILE=explore to search with fresh random examples.
hypothesis_settings.register_profile("ci", derandomize=True, database=None)
hypothesis_settings.register_profile("explore", max_examples=1000)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


ROOT = Path(__file__).resolve().parents[1]
PRODUCT = tuple(  # the product packages: import-linter's root packages (a new one is scanned as it is added there)
    tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]["root_packages"]
)


@functools.cache
def product_trees() -> tuple[tuple[str, ast.Module], ...]:
    """Every module of the product packages, parsed once for all the tests that read the product's code (they only
    read the trees): ``(its path from the repository root, its tree)``, in path order."""
    return tuple(
        (str(path.relative_to(ROOT)), ast.parse(path.read_text(), str(path)))
        for pkg in PRODUCT
        for path in sorted((ROOT / pkg).rglob("*.py"))
    )


def small_config(tmp_path: Path, **sections: dict[str, Any]) -> RunConfig:
    """A 2-cell x 3-device hierarchical FedAvg run on digits; ``sections`` override keys per section."""
    data: dict[str, dict[str, Any]] = {
        "run": {"name": "t", "seed": 0, "rounds": 3, "output": str(tmp_path / "run")},
        "topology": {"cells": 2, "devices_per_cell": 3},
        "algorithm": {"name": "fedavg", "edge_rounds": 2, "local_steps": 10, "batch_size": 16, "lr": 0.1},
        "model": {"name": "mlp", "hidden": [32]},
        "data": {"dataset": "digits", "partition": "iid"},
        "runtime": {"device_deadline": 5.0},
    }
    if sections.get("model", {}).get("name", "mlp") != "mlp" and "hidden" not in sections["model"]:
        del data["model"]["hidden"]  # the default's mlp width shapes no other model (refused if set)
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return parse_config(data)


def with_keys(cfg: RunConfig, tmp_path: Path) -> tuple[RunConfig, Any]:
    """``cfg`` signed: a fresh key ring of its topology written to ``tmp_path/keys.toml``, which its
    ``security.keys`` names; ``(cfg, ring)``."""
    from protocols.wire.keys import generate_keys, write_keys

    ring = generate_keys(cfg.topology)
    write_keys(tmp_path / "keys.toml", ring)
    return cfg.model_copy(
        update={"security": cfg.security.model_copy(update={"keys": str(tmp_path / "keys.toml")})}
    ), ring


def overflow_devices(sim: Any, which: Callable[[str], bool] = lambda device: True) -> Any:
    """Make the devices of ``sim`` (a ``SimHierarchy``) that ``which`` selects train on inputs that
    overflow float32 (their loss is inf/NaN: their training diverges); returns ``sim``."""
    import numpy as np

    from protocols.trainer import LocalData

    configure = sim.agents.configure

    def overflowing(agent: Any) -> None:
        configure(agent)
        if which(agent.device):
            agent.data = LocalData(np.full_like(agent.data.x, 3e38), agent.data.y)

    sim.agents.configure = overflowing
    return sim


@pytest.fixture
def make_config(tmp_path: Path):
    def make(**sections: dict[str, Any]) -> RunConfig:
        return small_config(tmp_path, **sections)

    return make


WALL = ("time", "duration_s")  # real-time fields of the records; everything else must match between two runs


def same_run(a: Any, b: Any) -> None:
    """Assert two :class:`sim.launcher.RunResult` are the same run: the final model bit for bit, the round and cell
    records but their real-time fields (:data:`WALL`), the devices' traffic."""
    assert a.params.keys() == b.params.keys()
    assert all(a.params[k].tobytes() == b.params[k].tobytes() for k in a.params)
    strip = lambda recs: [{k: v for k, v in r.items() if k not in WALL} for r in recs]  # noqa: E731
    assert strip(a.history) == strip(b.history)
    assert strip(a.cell_records) == strip(b.cell_records)
    assert a.device_traffic == b.device_traffic


def wait_until(cond: Callable[[], bool], timeout: float = 30.0, period: float = 0.02) -> bool:
    """Poll ``cond`` until it holds (True) or ``timeout`` seconds passed (False). Every caller waits for something
    that should happen (none for something that should not), so a generous default costs nothing when it holds: 30 s,
    for CI's loaded machine (10 s failed one there, test_async's resumed cloud)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(period)
    return True


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive TCP ports that were free a moment ago, for a provisioning that gives cells
    consecutive ports (``--cell-port``): :func:`protocols.transport.broker.free_port`, below the kernel's ephemeral
    range, where no outgoing connection of another test takes its local port."""
    from protocols.transport.broker import free_port

    return free_port(host, count)


T = TypeVar("T")
U = TypeVar("U")


def while_workers_start(sim: Any, work: Callable[[], T]) -> T:
    """``work()`` (the run without workers to compare with, say) while the worker processes of ``sim`` (a
    ``SimHierarchy`` with ``runtime.sim_workers`` or ``runtime.cell_processes``: built, not yet run) start up: they
    were spawned when it was built, and import torch and build their devices or cells on the other core meanwhile.
    They are stopped if it fails."""
    try:
        return work()
    except BaseException:
        sim.executor.close()
        if getattr(sim, "split", None) is not None:
            sim.split.close()
        raise


def beside(background: Callable[[], T], here: Callable[[], U]) -> tuple[T, U]:
    """``(background(), here())``, ``background()`` on a thread of its own while ``here()`` runs: an emulation
    (its agent processes import torch on the other core as it starts) beside the sim run to compare it with.
    Either's error is raised once both are done (the first of them: the background's). Both run in this process:
    not for what shares unguarded global state (torch's ONNX export: a run with ``onnx_devices`` exports)."""
    import threading

    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = background()
        except BaseException as exc:  # raised below, in the test's thread
            out["error"] = exc

    thread = threading.Thread(target=run, name="beside", daemon=True)
    thread.start()
    try:
        mine = here()
    finally:
        thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"], mine


def kill_worker_at_task(sim: Any, device: str, at: tuple[int, int] = (1, 0)) -> Any:
    """SIGKILL the sim worker process that trains ``device`` when ``device``'s task of (round, edge round) ``at``
    comes: dead before that task is even sent, waited for on its sentinel without reaping it (a second joiner
    would race the executor's own join and leave it without the exit code). Returns the process."""
    import multiprocessing.connection
    import signal

    proc = sim.executor.procs[sim.executor.owner[device]]

    def kill(rnd: int, edge: int) -> None:
        if (rnd, edge) == at:
            os.kill(proc.pid, signal.SIGKILL)
            multiprocessing.connection.wait([proc.sentinel], 10)

    sim.agents[device].on_task = kill
    return proc


def exported_cell(tmp_path: Path) -> tuple[RunConfig, Any, Any, Any, Any]:
    """Cell c0 of 2 devices (heartbeat 1 s) started on an in-memory hub with a ``MetricsExporter`` watching it, and
    a peer connection to publish its devices' statuses: ``(cfg, hub, cell, exporter, peer)``."""
    from cell_server.node import build_cell
    from monitor.exporter import MetricsExporter
    from protocols.transport.memory import MemoryHub
    from sim.hierarchy import prepare

    cfg = small_config(tmp_path, topology={"cells": 1, "devices_per_cell": 2}, runtime={"heartbeat": 1.0})
    hub = MemoryHub()
    cell = build_cell(cfg, "c0", hub.connect("cell.c0"), cfg.build_algorithm(prepare(cfg).spec), heartbeats=True)
    exporter = MetricsExporter(cfg.run.name, devices=True)  # ([monitoring] device_metrics)
    exporter.watch_cell(cell)
    cell.start()
    return cfg, hub, cell, exporter, hub.connect("peer")


@pytest.fixture
def job_lines() -> Any:
    """The lines a serving node prints per job (``protocols.joblog``, as ``fedtier ... --serve`` shows them), in a list;
    undone after the test (they are log records again, for the tests after it in this process)."""
    import logging

    from protocols.joblog import job_log, show_job_lines

    lines: list[str] = []
    show_job_lines(lines.append)
    yield lines
    for handler in list(job_log.handlers):
        job_log.removeHandler(handler)
    job_log.propagate = True
    job_log.setLevel(logging.NOTSET)


@pytest.fixture
def own_plugins():
    """Plugins a test loads (``run.plugins``) leave the registries as they were, and their modules unimported
    (a later test loading one registers it again): other tests see only the built-in algorithms."""
    import sys

    from protocols import plugins
    from protocols.algorithms import ALGORITHMS

    registries = (plugins.MODELS, plugins.DATASETS, ALGORITHMS)
    saved = [dict(r) for r in registries]
    modules = set(sys.modules)
    yield
    for registry, old in zip(registries, saved):
        registry.clear()
        registry.update(old)
    for name in set(sys.modules) - modules:
        if name.startswith("tests.plugin_"):
            del sys.modules[name]


RESULT_RING_BYTES = 1 << 20


@pytest.fixture
def ring():
    """A sim worker's result ring of :data:`RESULT_RING_BYTES` (its reader, its writer), its segment gone after."""
    import threading

    from sim.result_ring import RingReader, RingWriter

    freed = threading.Semaphore(0)
    reader = RingReader(RESULT_RING_BYTES, freed)
    writer = RingWriter(reader.name, reader.size, freed)
    yield reader, writer
    writer.close()
    reader.close()
    assert not os.path.exists(f"/dev/shm/{reader.name.lstrip('/')}")


class FullDisk:
    """A file object whose every write fails as on a full disk (ENOSPC), closing the file it wraps: monkeypatch
    ``os.fdopen`` (or ``Path.open``) to return one, to see what a durable write leaves when the disk fills."""

    def __init__(self, f: Any) -> None:
        self.f = f

    def __enter__(self) -> FullDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")
