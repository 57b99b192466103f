"""Build a device agent of a run from its config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from protocols.algorithms.base import Algorithm
from protocols.algorithms.traits import Trait
from protocols.capabilities import machine_caps
from protocols.config import RunConfig
from protocols.session import CloudSession
from protocols.trainer import LocalData, Trainer
from protocols.transport.base import Transport
from protocols.wire.keys import node_trust

from .agent import DeviceAgent


def cell_of(cfg: RunConfig, device: str) -> str:
    """The cell a device id belongs to in the config's topology."""
    cell = cfg.topology.cell_of(device)
    if cell is not None:
        return cell
    raise ValueError(
        f"device {device!r} is not in the topology (ids look like c0-d0 ... "
        f"c{cfg.topology.cells - 1}-d{cfg.topology.devices_per_cell - 1})"
    )


def build_agent(
    cfg: RunConfig,
    device: str,
    transport: Transport,
    algorithm: Algorithm,
    data: LocalData,
    trainer: Trainer,
    cloud: CloudSession | None = None,
    keep_answer: bool = False,
    caps: Mapping[str, Any] | None = None,
    instance: str | None = None,
) -> DeviceAgent:
    """``cloud``: what the device's process knows of the cloud's session (MQTT agents), so that only
    tasks of the current session count. ``keep_answer``: send the last result again when a restarted cell
    re-sends its task (MQTT agents; see :class:`DeviceAgent`)."""
    trust = node_trust(cfg, device)  # [security] keys: sign, and require the cell's signature
    return DeviceAgent(
        transport,
        run=cfg.run.name,
        cell=cell_of(cfg, device),
        device=device,
        role=algorithm.device(device),
        data=data,
        trainer=trainer,
        seed=cfg.run.seed,
        trust=trust,
        max_message_bytes=cfg.max_message_bytes(algorithm.model),
        cloud=cloud,
        secagg=cfg.secagg_settings(),
        keep_answer=keep_answer,
        caps=machine_caps() if caps is None else caps,
        instance=instance,
        versioned=Trait.ASYNC in algorithm.stack_traits(),  # tasks number the cell's model versions
    )
