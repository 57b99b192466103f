"""The cells of ``fedtier sim``, built on an in-memory hub: in the main process, or a share of them in each cell
process (``sim/cell_processes.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cell_server.node import build_cell
from protocols.config import RunConfig
from protocols.transport.memory import MemoryHub

from .hierarchy import DeviceData, SampleCounts, edge_availability

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
