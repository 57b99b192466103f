"""A cell's devices in a compact form: ~13 bytes a device instead of ~100.

The ids are kept sorted (in the order ``sorted`` gives strings) in one fixed-width byte array, and the
online flags in a boolean array beside it; a device's position is a binary search. A cell of a
simulated population of 10^6 devices then holds no string, list slot or dict entry per device.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterable, Iterator, MutableMapping, ValuesView
from typing import overload

import numpy as np

from protocols.config.topology import PositionedIds

__all__ = ["DeviceList", "OnlineFlags"]


class DeviceList(PositionedIds):
    """Device ids, sorted and unique, as one byte array (UTF-8 bytes sort as the strings do)."""

    not_found = "is not a device of this cell"

    def __init__(self, devices: Iterable[str]) -> None:
        ids = list(devices)
        if any(not isinstance(d, str) or "\0" in d for d in ids):
            raise ValueError("device ids must be strings without NUL characters")
        ids.sort()
        self._ids = np.array([d.encode() for d in ids], dtype=np.bytes_)
        if len(ids) > 1 and bool((self._ids[1:] == self._ids[:-1]).any()):
            raise ValueError("device ids must be unique")

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [d.decode() for d in self._ids[i].tolist()]
        return self._ids[i].decode()

    def __iter__(self) -> Iterator[str]:
        return (d.decode() for d in self._ids.tolist())

    def position(self, device: object) -> int | None:
        """Where ``device`` is, or ``None``."""
        if not isinstance(device, str):
            return None
        key = device.encode("utf-8", "surrogatepass")  # never equal to a stored (valid UTF-8) id
        i = int(self._ids.searchsorted(key))
        return i if i < len(self._ids) and self._ids[i] == key else None

    def among(self, devices: Iterable[object]) -> list[str]:
        """Those of ``devices`` that are in this list, sorted (one vectorised search)."""
        keys = [d.encode("utf-8", "surrogatepass") for d in devices if isinstance(d, str) and "\0" not in d]
        if not keys or not len(self._ids):
            return []
        wanted = np.array(keys, dtype=np.bytes_)
        at = np.minimum(self._ids.searchsorted(wanted), len(self._ids) - 1)
        return sorted(k.decode() for k in wanted[self._ids[at] == wanted].tolist())


class OnlineFlags(MutableMapping[str, bool]):
    """Whether each device of a :class:`DeviceList` is online; its keys are fixed (a device that is not
    in the list can be neither set nor added)."""

    def __init__(self, devices: DeviceList, online: bool) -> None:
        self.devices = devices
        self._flags = np.full(len(devices), bool(online))

    def _at(self, device: object) -> int:
        at = self.devices.position(device)
        if at is None:
            raise KeyError(device)
        return at

    def __getitem__(self, device: str) -> bool:
        return bool(self._flags[self._at(device)])

    def __setitem__(self, device: str, online: bool) -> None:
        self._flags[self._at(device)] = bool(online)

    def __delitem__(self, device: str) -> None:
        raise TypeError("a cell's devices are fixed")

    def __iter__(self) -> Iterator[str]:
        return iter(self.devices)

    def __len__(self) -> int:
        return len(self.devices)

    def __contains__(self, device: object) -> bool:
        return device in self.devices

    def values(self) -> ValuesView[bool]:
        return _Values(self)

    def items(self) -> ItemsView[str, bool]:
        return _Items(self)

    def count(self) -> int:
        """Devices online."""
        return int(np.count_nonzero(self._flags))


class _Values(ValuesView):
    """The flags read in one pass (a snapshot: setting flags while iterating is safe)."""

    _mapping: OnlineFlags

    def __iter__(self) -> Iterator[bool]:
        return iter(self._mapping._flags.tolist())


class _Items(ItemsView):
    _mapping: OnlineFlags

    def __iter__(self) -> Iterator[tuple[str, bool]]:
        return zip(self._mapping.devices, self._mapping._flags.tolist())
