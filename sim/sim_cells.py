"""The cells of ``fedtier sim``, built on an in-memory hub: in the main process, or a share of them in each cell
process (``sim/cell_processes.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cell_server.node import build_cell
from protocols.algorithms.traits import Trait
from protocols.config import RunConfig
from protocols.transport.memory import MemoryHub
from protocols.transport.virtual_loop import CELLS, MAIN
from protocols.wire import topics

from .hierarchy import DeviceData, SampleCounts, edge_availability
from .population import LISTENER

if TYPE_CHECKING:
    from cell_server.server import CellServer
    from protocols.algorithms.base import Algorithm


def device_samples(device_data: DeviceData, devices: Sequence[str]) -> SampleCounts:
    """Each device's sample count (``DeviceData.indices``, no copy, read when asked for): the largest
    weight a cell accepts."""
    return SampleCounts(device_data, devices)


def build_sim_cells(
    cfg: RunConfig,
    hub: MemoryHub,
    algorithm: Algorithm,
    device_data: DeviceData,
    output_dir: Path | None,
    cells: Sequence[str] | None = None,
) -> dict[str, CellServer]:
    """The ``cells`` (all of the topology's by default) on ``hub``, their devices deemed online from the start,
    each bounded by its samples."""
    availability = edge_availability(cfg)
    return {
        c: build_cell(
            cfg,
            c,
            hub.connect(f"cell.{c}"),
            algorithm,
            availability=availability,
            output_dir=output_dir,
            assume_online=True,
            samples=device_samples(device_data, cfg.topology.devices(c)),
        )
        for c in (cfg.topology.cell_ids() if cells is None else cells)
    }


def untimed_async(cfg: RunConfig, algorithm: Algorithm) -> bool:
    """Whether ``cfg`` runs asynchronous cells whose devices train in no virtual time (no ``[clock]
    device_steps_per_s``): such cells never run out of work at a virtual instant (a push, the next tasks, their
    results, the next push, all at once), so the cells' side of a loop would never end its turn."""
    return Trait.ASYNC in algorithm.stack_traits() and not cfg.clock.device_steps_per_s > 0


CLOUD = "cloud"
"""The cloud's client id on a one-process ``fedtier sim``'s hub."""


def loop_sides(cfg: RunConfig, algorithm: Algorithm) -> Callable[[str], int | None] | None:
    """The side of a one-process ``fedtier sim``'s loop each client of its hub is on (``MemoryHub.side_of``): the
    cloud's side (:data:`CLOUD`), the cells' (the cells, the devices and the devices'
    :class:`~sim.population.Population`: what a cell process runs, ``sim/cell_processes.py``), or neither (an observer
    or a test's intruder: it takes messages where they are sent). The loop runs the sides in the turns a split run's
    processes take (``protocols.transport.memory.VirtualLoop``), so one process and cell processes make the same run.
    ``None`` (one side: every call in the order it was posted) for :func:`untimed_async` runs, which cell processes
    refuse."""
    if untimed_async(cfg, algorithm):
        return None
    cells = {topics.cell_node(c) for c in cfg.topology.cell_ids()}
    device = topics.device_node("")

    def side_of(client_id: str) -> int | None:
        if client_id == CLOUD:
            return MAIN
        if client_id in cells or client_id == LISTENER:
            return CELLS
        if client_id.startswith(device) and cfg.topology.cell_of(client_id[len(device) :]) is not None:
            return CELLS
        return None

    return side_of
