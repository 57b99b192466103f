"""Build a cell server of a run from its config."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from protocols import runfiles
from protocols.algorithms.base import Algorithm
from protocols.algorithms.fedbuff import FedBuffCell
from protocols.algorithms.staleness import AsyncParams
from protocols.algorithms.traits import Trait
from protocols.config import ConfigError, RunConfig
from protocols.transport.base import Transport
from protocols.wire.keys import node_trust

from .async_server import AsyncCellServer
from .server import Availability, CellServer

STATUS_WAIT = 2.0
"""Seconds (at least; else one heartbeat) a started cell waits for its devices' first statuses before
it counts a silent one offline (its retained status normally comes within milliseconds)."""


def build_cell(
    cfg: RunConfig,
    cell: str,
    transport: Transport,
    algorithm: Algorithm,
    *,
    availability: Availability | None = None,
    output_dir: Path | None = None,
    heartbeats: bool = False,
    assume_online: bool = False,
    samples: Mapping[str, int] | None = None,
    journal: bool = False,
    resume: bool = False,
) -> CellServer:
    """``heartbeats``: use the config's MQTT liveness settings, ``runtime.heartbeat``, ``heartbeat_timeout``
    and ``rejoin_wait``, and wait for the devices' first statuses after the start (``STATUS_WAIT``) (the
    sim has none: nobody disconnects there). ``assume_online``: devices count as
    online until their status says otherwise (the sim's devices do not announce themselves). ``samples``:
    the devices' known sample counts (a result claiming a larger weight is refused; else
    ``security.max_device_weight``). ``journal``: keep the current round crash-consistently in the output
    folder (``fedtier cell``); ``resume``: continue the round found there."""
    if cell not in cfg.topology.cell_ids():
        raise ValueError(f"cell {cell!r} is not in the topology (cells: {', '.join(cfg.topology.cell_ids())})")
    trust = node_trust(cfg, cell)  # [security] keys: sign, and require the cloud's and the devices' signatures
    server, extra = _server_kind(cfg, cell, algorithm, resume)
    if journal and output_dir is not None and cfg.secagg_settings() is None:
        extra["journal_path"] = output_dir / runfiles.CELL_JOURNAL.format(cell=cell)
    return server(
        transport,
        run=cfg.run.name,
        cell=cell,
        devices=cfg.topology.device_ids(cell),
        **extra,
        algorithm=algorithm.name,
        device_deadline=cfg.runtime.device_deadline,
        quorum=cfg.runtime.quorum,
        availability=availability,
        log_path=str(output_dir / runfiles.AGGREGATION) if output_dir else None,
        max_record_bytes=cfg.runtime.max_record_bytes,
        heartbeat=cfg.runtime.heartbeat if heartbeats else 0.0,
        heartbeat_timeout=cfg.runtime.heartbeat_timeout if heartbeats else 0.0,
        rejoin_wait=cfg.runtime.rejoin_wait if heartbeats else 0.0,
        assume_online=assume_online,
        status_wait=max(cfg.runtime.heartbeat, STATUS_WAIT) if heartbeats else 0.0,
        absent_ids=cfg.runtime.absent_ids,
        trust=trust,
        max_message_bytes=cfg.max_message_bytes(algorithm.model),
        max_weights=samples,
        max_weight=cfg.security.max_device_weight,
        secagg=cfg.secagg_settings(),
        secagg_deadline=cfg.secagg_deadline(),
        requirements=None if cfg.requirements.nothing_required() else cfg.requirements,
    )


def _server_kind(
    cfg: RunConfig, cell: str, algorithm: Algorithm, resume: bool
) -> tuple[type[CellServer], dict[str, Any]]:
    """The server class of ``algorithm`` and its role arguments: FedBuff (keep devices busy, push every M
    updates or T seconds) or rounds."""
    train = cfg.train
    if (why := algorithm.tier_refusal("cell")) is not None:  # what the cell holds (a device holds none of it)
        raise ConfigError(why)
    if resume and cfg.secagg_settings() is not None:
        raise ConfigError(
            "--resume: a cell under secure aggregation does not resume its round (the masks' "
            "key shares are not journaled); start it afresh"
        )
    if Trait.ASYNC in algorithm.stack_traits():
        assert isinstance(train, AsyncParams)  # the asynchronous layer is AsyncParams
        role = FedBuffCell(train, cell)
        return AsyncCellServer, {
            "role": role,
            "push_every": train.async_push_every,
            "push_seconds": train.async_push_seconds,
            "resume": resume,
        }
    return CellServer, {"role": algorithm.cell(cell), "resume": resume}
