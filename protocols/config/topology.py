"""``[topology]``: the cells and their devices, and the device-id sequences that cost no memory."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator, Sequence
from typing import overload

from pydantic import Field, PrivateAttr, field_validator, model_validator

from ..limits import MAX_DEVICES
from ..wire.topics import check_name
from .sections import Section


class TopologySection(Section):
    cells: int = Field(default=2, ge=1, description="cells, with ids c0, c1, ...")
    devices_per_cell: int = Field(default=5, ge=1, description="devices in each cell, with ids c0-d0, c0-d1, ...")

    members: dict[str, list[str]] | None = Field(
        default=None,
        description="Explicit membership, each cell id -> its device ids (cells may differ in size); replaces "
        "cells x devices_per_cell. `fedtier provision add-device|add-cell|revoke` keep it, and the signed roster "
        "carries the same to the running nodes.",
    )
    _cell_index: dict[str, str] | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _bounded(self) -> TopologySection:
        if self.members is None and self.cells * self.devices_per_cell > MAX_DEVICES:
            raise ValueError(
                f"cells x devices_per_cell = {self.cells * self.devices_per_cell:,} devices; at most {MAX_DEVICES:,}"
            )
        return self

    @field_validator("members")
    @classmethod
    def _possible_members(cls, members: dict[str, list[str]] | None) -> dict[str, list[str]] | None:
        if members is None:
            return None
        if not members:
            raise ValueError("at least one cell")
        seen: set[str] = set()
        for cell, devices in members.items():
            check_name("cell", cell)
            for d in devices:
                check_name("device", d)
                if d in seen or d in members:
                    raise ValueError(f"{d!r} appears twice")
                seen.add(d)
        return members

    @model_validator(mode="after")
    def _explicit_members(self) -> TopologySection:
        if self.members is None:
            return self
        # the counts follow the members (what code that sizes things by them sees)
        object.__setattr__(self, "cells", len(self.members))
        object.__setattr__(self, "devices_per_cell", max((len(d) for d in self.members.values()), default=0) or 1)
        return self

    def uniform(self) -> bool:
        """Every cell ``c{i}`` holds ``c{i}-d0 ...`` of the same count (the simulator's partitioners need it)."""
        return self.members is None

    def cell_ids(self) -> list[str]:
        if self.members is not None:
            return list(self.members)
        return [f"c{i}" for i in range(self.cells)]

    def device_ids(self, cell: str) -> list[str]:
        if self.members is not None:
            return list(self.members.get(cell, ()))
        return [f"{cell}-d{j}" for j in range(self.devices_per_cell)]

    def all_devices(self) -> list[str]:
        return [d for c in self.cell_ids() for d in self.device_ids(c)]

    def devices(self, cell: str | None = None) -> Sequence[str]:
        """The ids of every device (or of one cell's) in topology order, computed on access."""
        if self.members is not None:
            if cell is not None and cell not in self.members:
                raise ValueError(f"cell {cell!r} is not in the topology")
            return MemberIds(self.all_devices() if cell is None else self.device_ids(cell))
        if cell is None:
            return DeviceIds(range(self.cells), self.devices_per_cell)
        if self.cell_of(f"{cell}-d0") is None:
            raise ValueError(f"cell {cell!r} is not in the topology")
        i = int(cell[1:])
        return DeviceIds(range(i, i + 1), self.devices_per_cell)

    def cell_of(self, device: str) -> str | None:
        """The cell of a device id of this topology, or ``None``; O(1) (no table for ``c{i}-d{j}`` ids)."""
        if self.members is not None:
            if self._cell_index is None:
                self._cell_index = {d: c for c, devs in self.members.items() for d in devs}
            return self._cell_index.get(device) if isinstance(device, str) else None
        at = DeviceIds(range(self.cells), self.devices_per_cell).position(device)
        return None if at is None else f"c{at // self.devices_per_cell}"


class MemberIds(list[str]):
    """Device ids of an explicit membership, in topology order, with :meth:`position` as :class:`DeviceIds`."""

    def position(self, device: object) -> int | None:
        if not hasattr(self, "_at"):
            self._at = {d: i for i, d in enumerate(self)}
        return self._at.get(device) if isinstance(device, str) else None


class PositionedIds(Sequence[str]):
    """Distinct ids that a sequence finds without a scan (:meth:`position`); membership and :meth:`index` follow
    from it."""

    not_found = "is not in the device ids"
    """What :meth:`index` says of an id it lacks."""

    @abstractmethod
    def position(self, device: object) -> int | None:
        """Where ``device`` is in this sequence, or ``None``."""

    def __contains__(self, device: object) -> bool:
        return self.position(device) is not None

    def index(self, device: object, start: int = 0, stop: int | None = None) -> int:
        at = self.position(device)
        if at is None or at < start or (stop is not None and at >= stop):
            raise ValueError(f"{device!r} {self.not_found}")
        return at


class DeviceIds(PositionedIds):
    """Device ids ``c{i}-d{j}`` of consecutive cells, in topology order, made when read: a sequence of a
    million ids that costs no memory (``position`` is the inverse of indexing)."""

    def __init__(self, cells: range, devices_per_cell: int) -> None:
        self.cells, self.per_cell = cells, devices_per_cell

    def __len__(self) -> int:
        return len(self.cells) * self.per_cell

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"device {i} of {n}")
        cell, j = divmod(i % n, self.per_cell)
        return f"c{self.cells[cell]}-d{j}"

    def __iter__(self) -> Iterator[str]:
        return (f"c{c}-d{j}" for c in self.cells for j in range(self.per_cell))

    def position(self, device: object) -> int | None:
        """Where ``device`` is in this sequence, or ``None``."""
        if not isinstance(device, str):
            return None
        cell, sep, j = device.rpartition("-d")
        i = cell[1:]
        if (
            not (sep and cell[:1] == "c" and _index(i, self.cells.stop) and _index(j, self.per_cell))
            or int(i) < self.cells.start
        ):
            return None
        return (int(i) - self.cells.start) * self.per_cell + int(j)


def _index(text: str, n: int) -> bool:
    """``text`` is a canonical decimal in ``range(n)`` ("0", "12"; not "012", "+1" or " 1")."""
    return text.isdigit() and text.isascii() and (text == "0" or text[0] != "0") and int(text) < n
