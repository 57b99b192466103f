"""Byzantine devices for ``fedtier sim`` (``[attack]``): tests and ``benchmarks/robust.py`` use it to measure
robust aggregation (``algorithm.cell_aggregator``). Never part of a deployment: the runtimes know nothing
of it; the simulator swaps the device role of the chosen devices for :class:`ByzantineDevice`.

In each cell, ``floor(fraction * devices_per_cell)`` devices, drawn with the run seed, train honestly and
then corrupt their delta before sending it: ``scale`` sends ``factor x delta``, ``sign_flip`` sends
``-factor x delta``. Their claimed weight (sample count) is left as it is.
"""

from __future__ import annotations

import math

from protocols.algorithms.base import DeviceContext, DeviceRole
from protocols.algorithms.compose import needs
from protocols.algorithms.traits import Trait
from protocols.config import AttackSection, ConfigError, RunConfig
from protocols.seeding import rng
from protocols.trainer import LocalData, Trainer
from protocols.wire.payload import Payload


def byzantine_devices(cfg: RunConfig) -> list[str]:
    """The attacking devices of the run (sorted), the same in every process for a given seed."""
    a = cfg.attack
    if a.kind == "none" or a.fraction == 0:
        return []
    why = needs(cfg.train, Trait.PLAIN_DELTA_UPLINK)
    if why is not None:
        raise ConfigError(f"attack: Byzantine devices corrupt the dense deltas devices send; {why}")
    topo = cfg.topology
    k = int(math.floor(a.fraction * topo.devices_per_cell + 1e-9))
    if k == 0:
        raise ConfigError(
            f"attack.fraction = {a.fraction:g} of {topo.devices_per_cell} devices per cell rounds down to no "
            f"attacker: set fraction >= {1 / topo.devices_per_cell:.3g} (or 0 for a run without attackers)"
        )
    chosen: list[str] = []
    for cell in topo.cell_ids():
        devices = topo.device_ids(cell)
        picks = rng(cfg.run.seed, "attack", cell).choice(len(devices), size=k, replace=False)
        chosen += [devices[i] for i in picks]
    return sorted(chosen)


def attacked(role: DeviceRole, device: str, byzantine: set[str] | list[str], attack: AttackSection) -> DeviceRole:
    """``role`` as ``device`` runs it: wrapped in :class:`ByzantineDevice` when the device is Byzantine
    (the one place the sim process and its workers decide it)."""
    return ByzantineDevice(role, attack) if device in byzantine else role


class ByzantineDevice(DeviceRole):
    """Trains like ``inner``, then sends its delta scaled by ``factor`` (``scale``) or ``-factor`` (``sign_flip``)."""

    def __init__(self, inner: DeviceRole, attack: AttackSection) -> None:
        self.inner = inner
        self.writes_task = inner.writes_task  # it writes into none of the task itself
        self.scale = attack.factor if attack.kind == "scale" else -attack.factor

    def train(self, task: Payload, data: LocalData, trainer: Trainer, ctx: DeviceContext) -> Payload:
        out = self.inner.train(task, data, trainer, ctx)
        return Payload(out.meta, {k: (v * self.scale).astype(v.dtype) for k, v in out.tensors.items()})
