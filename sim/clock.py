"""The virtual clock of ``fedtier sim``: what a run would take on real devices and links.

The in-memory hub delivers a data message ``latency_s + bytes / bandwidth`` virtual seconds after it
is sent, with the bandwidth of the link it crosses (by its tier, ``protocols.wire.topics.tier_of``): cell ->
device (``downlink_bytes_per_s``), device -> cell (``uplink_bytes_per_s``) and cell <-> cloud
(``backhaul_bytes_per_s``). Each message has its own link (no queueing between devices). A device's
result leaves ``steps / speed`` virtual seconds after its task arrived, ``steps`` being what the
device reported (``meta["steps"]``), else the simulator's own count for it (``steps_of``: a device under
DP reports none), else the configured local steps, and ``speed`` the configured
steps per second times a seeded per-device log-normal factor (``device_speed_spread``: stragglers).

Deadlines run on the same clock, so a slow device misses them as it would in the field; the records'
``clock_s`` fields and the report's time axes show the virtual times. A zero rate means "instant".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from protocols.config import ClockSection, RunConfig
from protocols.seeding import rng
from protocols.wire.payload import Payload
from protocols.wire.topics import tier_of


def clock_modelled(clock: ClockSection) -> bool:
    """True when ``[clock]`` asks for any time to be modelled."""
    return any(v > 0 for v in clock.model_dump().values())


class ClockModel:
    """Link and compute delays for one run (deterministic in the run seed)."""

    def __init__(
        self,
        clock: ClockSection,
        devices: Sequence[str],
        seed: int,
        default_steps: int = 1,
        steps_of: Callable[[str], int] | None = None,
    ) -> None:
        self.c = clock
        self._enabled = clock_modelled(clock)  # (asked by every agent a simulation builds)
        self.default_steps = max(1, default_steps)
        self.steps_of = steps_of
        self.rates = {
            "cell_to_device": clock.downlink_bytes_per_s,
            "device_to_cell": clock.uplink_bytes_per_s,
            "cloud_to_cell": clock.backhaul_bytes_per_s,
            "cell_to_cloud": clock.backhaul_bytes_per_s,
        }
        spread = clock.device_speed_spread
        factors = (
            np.exp(rng(seed, "clock", "device-speed").normal(0.0, spread, len(devices)))
            if spread
            else np.ones(len(devices))
        )
        self.speed = {d: clock.device_steps_per_s * float(f) for d, f in zip(devices, factors)}

    @property
    def enabled(self) -> bool:
        return self._enabled

    def link_delay(self, topic: str, nbytes: int) -> float:
        tier = tier_of(topic)
        if tier is None:
            return 0.0
        rate = self.rates[tier]
        return self.c.latency_s + (nbytes / rate if rate > 0 else 0.0)

    def compute_delay(self, device: str, result: Payload) -> float:
        speed = self.speed.get(device, 0.0)
        if speed <= 0:
            return 0.0
        steps = result.meta.get("steps")
        if not (isinstance(steps, (int, float)) and steps > 0):
            steps = self.steps_of(device) if self.steps_of is not None else self.default_steps
        return float(steps) / speed


def device_steps(cfg: RunConfig, prep: Any) -> Callable[[str], int]:
    """``device -> local steps per edge round`` from the simulator's own bookkeeping (its sample count and
    the algorithm's ``local_steps`` / ``local_epochs``): the virtual clock's count for devices that report
    none (DP devices keep their data's size to themselves)."""
    from protocols.trainer import num_steps

    t = cfg.train
    return lambda d: num_steps(len(prep.device_data.indices(d)), t.batch_size, t.local_steps, t.local_epochs)


def sim_clock(cfg: RunConfig, prep: Any) -> ClockModel:
    """The clock model of run ``cfg`` whose data ``prep`` (:class:`sim.hierarchy.Prepared`) built: the same in
    every process of a run (the main one, each cell process)."""
    return ClockModel(
        cfg.clock,
        cfg.topology.all_devices() if clock_modelled(cfg.clock) else [],
        cfg.run.seed,
        cfg.train.local_steps,
        steps_of=device_steps(cfg, prep) if cfg.privacy.dp != "off" else None,  # DP devices report none
    )
