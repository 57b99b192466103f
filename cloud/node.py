"""Build the cloud server of a run from its config."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from protocols import runfiles
from protocols.algorithms.base import Algorithm
from protocols.algorithms.fedavg import ModelCloud
from protocols.algorithms.fedbuff import FedBuffCloud
from protocols.algorithms.staleness import AsyncParams
from protocols.algorithms.traits import Trait
from protocols.bounds import CellBounds
from protocols.config import ConfigError, RunConfig
from protocols.transport.base import Transport
from protocols.wire.keys import node_trust

from .async_server import AsyncCloudServer
from .server import CellAvailability, CloudServer, Evaluator


def build_cloud(
    cfg: RunConfig,
    transport: Transport,
    algorithm: Algorithm,
    *,
    evaluator: Evaluator | None = None,
    output_dir: Path | None = None,
    resume: bool = False,
    startup_wait: float = 0.0,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    availability: CellAvailability | None = None,
    devices_recreated: bool = False,
    cell_bounds: Mapping[str, float] | None = None,
    session: str | None = None,
    collect_cell_records: bool = False,
) -> CloudServer:
    """``devices_recreated``: with ``resume``, the devices are new (a launcher rebuilt them), see
    ``CloudRole.forget_devices``. ``cell_bounds``: the largest weight each cell may report (a launcher's,
    from its devices' sample counts); else :func:`config_cell_bounds`. ``session``: the job's cloud
    session. ``collect_cell_records``: write every cell's aggregation records (their telemetry) to the run
    folder's ``cells.jsonl`` (a deployed cloud: its cells write on their own machines)."""
    out = output_dir
    trust = node_trust(cfg, "cloud")  # [security] keys: sign, and require the cells' signatures
    server, extra = _server_kind(cfg, algorithm)
    built = server(
        transport,
        run=cfg.run.name,
        cells=cfg.topology.cell_ids(),
        rounds=cfg.run.rounds,
        **extra,
        cell_deadline=cfg.cell_deadline(),
        evaluator=evaluator,
        eval_every=cfg.runtime.eval_every,
        metrics_path=out / runfiles.METRICS if out else None,
        checkpoint_path=out / runfiles.CHECKPOINT if out else None,
        resume=resume,
        startup_wait=startup_wait,
        on_round=on_round,
        availability=availability,
        devices_recreated=devices_recreated,
        session=session,
        cell_records_path=out / runfiles.CELL_RECORDS if out and collect_cell_records else None,
        max_record_bytes=cfg.runtime.max_record_bytes,
        trust=trust,
        max_message_bytes=cfg.max_message_bytes(algorithm.model),
        cell_bounds=cell_bounds if cell_bounds is not None else config_cell_bounds(cfg),
        max_stalled_rounds=cfg.runtime.max_stalled_rounds,
        min_cells=cfg.runtime.min_cells,
        fail_on_cell_failure=cfg.runtime.fail_on_cell_failure,
    )
    if built.cell_records is not None:  # a cell's records name the job's devices of that cell only (revoked ones too)
        built.cell_records.cell_of = cfg.topology.cell_of
    return built


def _server_kind(cfg: RunConfig, algorithm: Algorithm) -> tuple[type[CloudServer], dict[str, Any]]:
    """The server class of ``algorithm`` and its role argument: FedBuff over cells (asynchronous) or rounds."""
    if (why := algorithm.tier_refusal("cloud")) is not None:  # what the cloud holds (a device holds none of it)
        raise ConfigError(why)
    if Trait.ASYNC not in algorithm.stack_traits():
        return CloudServer, {"role": algorithm.cloud()}
    inner = algorithm.cloud()
    assert isinstance(cfg.train, AsyncParams) and isinstance(inner, ModelCloud)  # FedAvg's (the VERSIONED one)
    return AsyncCloudServer, {"fedbuff": FedBuffCloud(cfg.train, inner)}


def config_cell_bounds(cfg: RunConfig) -> CellBounds:
    """Each cell's weight bound from ``security.max_device_weight`` (which ``fedtier provision`` writes into
    every bundle; unset: no weight bound), and the topology's devices of each cell (a report names no other)."""
    bound, topo = cfg.security.max_device_weight, cfg.topology
    per_cell = (lambda cell: [bound] * len(topo.device_ids(cell))) if bound is not None else None
    per_device = (lambda cell, device: bound if topo.cell_of(device) == cell else None) if bound is not None else None
    return CellBounds(topo.cell_ids(), cfg.train, per_cell, topo.cell_of, per_device)
