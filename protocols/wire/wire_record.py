"""A payload's tensors made where its message will be: :class:`WireRecord`.

A device's result is a model-sized delta that its role computes (``params.sub_for_wire``) and its agent frames once
(``Messenger.frame_once``). Framing copied it into the message (800 KB a device a round), and the cell read every
float of that copy again for its finiteness check, which the device's agent had just made of the delta. A
:class:`WireRecord` lays the payload's tensor table out first, with room before it: the role computes the delta into
the table's arrays; the agent seals them (:meth:`WireRecord.seal`: read-only from then on, each checked finite once,
its sum of squares kept); the framing writes the envelope and the metadata into the room right before the table, so the
message is the record itself (a read-only :class:`~protocols.wire.payload.Lent` view), the same bytes as a message
framed by copying, and tells its receiver that its floats were checked, with the sums (``Lent.checked``,
``Lent.squares``), as a sim worker's result framed in place does. A receiver of another process gets the bytes copied
(a socket) and reads them as ever.
"""

from __future__ import annotations

import functools
import math
import struct
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .envelope import ENVELOPE_ROOM
from .payload import (
    _WIRE_CODES,
    META_JSON,
    Headroom,
    Lent,
    Parts,
    Payload,
    _finite_squares,
    _remember_finite,
    tensor_descriptor,
)

META_ROOM = 4096
"""Bytes of metadata a record leaves room for (a result's: ~60); a payload with more is framed by copying."""
ALIGN = 64
"""The largest tensor's values start at an address that is a multiple of this (a cache line: whole SIMD loads)."""

Spec = tuple[str, tuple[int, ...], np.dtype]


class WireRecord(Headroom):
    """Tensors ``specs`` (name, shape, wire dtype, in order) laid out as a payload's table with room before it for the
    envelope and metadata: :attr:`arrays`, writable until the message is framed (:meth:`frame`, once)."""

    def __init__(self, specs: Sequence[Spec], room: int = ENVELOPE_ROOM + META_ROOM) -> None:
        layout = _layout(tuple(specs))
        self._record = np.empty(room + layout.end + ALIGN, dtype=np.uint8)
        self._table = room + (-(self._record.__array_interface__["data"][0] + room + layout.first) % ALIGN)
        self._end = self._table + layout.end
        record: Any = self._record  # (numpy's stubs do not say an array is a buffer)
        whole = memoryview(record)
        for at, piece in layout.descriptors:  # the count, and each descriptor right before its tensor's values
            whole[self._table + at : self._table + at + len(piece)] = piece
        self.arrays: OrderedDict[str, np.ndarray] = OrderedDict(
            (name, np.ndarray(shape, dtype, record, self._table + start))  # (the role writes the values)
            for (name, shape, dtype), start in zip(specs, layout.starts)
        )
        starts = layout.starts
        self._starts = starts  # where each array's values start in the table
        self.size = self._table
        self.checked = False  # sealed with every float finite (seal): its message says so (Lent.checked)
        self._squares: dict[int, float] = {}  # the sums of squares seal() took, by where the values start
        self._sealed = False
        self._lock = threading.Lock()
        self._framing: tuple[bytes, np.ndarray] | None = None  # the parts parts_of() gave: (metadata, the table)
        self._framed = False

    def holds(self, tensors: Mapping[str, np.ndarray]) -> bool:
        """Whether ``tensors`` are exactly :attr:`arrays`: the same objects, names, order, shapes and dtypes."""
        if len(tensors) != len(self.arrays):
            return False
        for (name, arr), (k, v) in zip(self.arrays.items(), tensors.items()):
            if v is not arr or k != name or v.shape != arr.shape or v.dtype != arr.dtype:
                return False
        return True

    def seal(self, payload: Payload) -> None:
        """Make ``payload``'s tensors (this record's arrays, not framed yet) read-only and check each float one finite,
        once, taking its sum of squares: the device's own check of its result (``DeviceAgent._trained``), after
        which ``protocols.divergence.nonfinite`` reads none of them again (:func:`all_finite` knows them) and, all
        finite, what its message tells its receiver, with those sums (``Lent.checked``, ``Lent.squares``): the
        values cannot change from here on, and the receiver views this very memory."""
        if self._sealed or self._framed or payload.headroom is not self or not self.holds(payload.tensors):
            return
        self._sealed, finite = True, True
        for arr, start in zip(self.arrays.values(), self._starts):
            arr.flags.writeable = False
            if arr.dtype.kind != "f" or arr.size == 0:
                continue
            ok, squares = _finite_squares(arr)
            finite = finite and ok
            if ok:
                _remember_finite(arr, squares)
                if squares is not None:
                    self._squares[start] = squares
        self.checked = finite

    def encodes(self, payload: Payload) -> np.ndarray | None:
        return None  # (a lent payload's whole bytes: this record holds no metadata before framing)

    def parts_of(self, payload: Payload) -> Parts | None:
        """``payload``'s encoding as two parts, its metadata's bytes and this record's table (no copy of a value),
        where its tensors are still exactly :attr:`arrays` (the same objects, names, order, shapes and dtypes) and
        the record was not framed yet; else ``None`` (encode it by copying)."""
        if self._framed or payload.headroom is not self or not self.holds(payload.tensors):
            return None
        meta = META_JSON.encode(payload.meta).encode()  # (payload_parts')
        table = self._record[self._table : self._end]
        self._framing = (struct.pack("<I", len(meta)) + meta, table)
        return list(self._framing)

    def frame(self, head: bytes, parts: Parts) -> memoryview | None:
        """The message ``head`` + ``parts`` (those :meth:`parts_of` gave) framed in place: ``head`` and the metadata
        written into the room before the table, the record and its arrays made read-only, and a read-only view of
        the message returned; ``None`` (frame it by copying) for other parts, a second framing, or a head and
        metadata larger than the room."""
        with self._lock:
            framing, self._framing = self._framing, None
            if self._framed or framing is None or len(parts) != 2 or parts[0] is not framing[0]:
                return None
            if parts[1] is not framing[1] or len(head) + len(framing[0]) > self._table:
                return None
            self._framed = True
        at = self._table - len(framing[0]) - len(head)
        self._record[at : self._table] = np.frombuffer(head + framing[0], dtype=np.uint8)
        for arr in self.arrays.values():
            arr.flags.writeable = False
        self._record.flags.writeable = False
        record: Any = self._record  # (numpy's stubs do not say an array is a buffer)
        # the message over a read-only view of the record: numpy refuses to make it, or a view of it, writable again
        message: Any = np.frombuffer(memoryview(record), dtype=np.uint8)[at : self._end].view(Lent)
        if self.checked:  # (sealed: by where each tensor's values start in the payload, after its metadata)
            message.checked = True
            message.squares = {len(framing[0]) + start: squares for start, squares in self._squares.items()}
        return memoryview(message)


class _Layout(NamedTuple):
    """A table's layout: each descriptor (the count first) by where it goes, where each tensor's values start, where
    the table ends and where its largest tensor's values start (all from the table's start)."""

    descriptors: tuple[tuple[int, bytes], ...]
    starts: tuple[int, ...]
    end: int
    first: int


@functools.lru_cache(maxsize=64)
def _layout(specs: tuple[Spec, ...]) -> _Layout:
    """The layout of ``specs``' table (a model's results all share one: computed once)."""
    descriptors, starts, sizes, end = [(0, struct.pack("<H", len(specs)))], [], [], 2
    for name, shape, dtype in specs:
        piece = tensor_descriptor(name, _WIRE_CODES[dtype], shape)
        descriptors.append((end, piece))
        end += len(piece)
        starts.append(end)
        sizes.append(math.prod(shape) * dtype.itemsize)
        end += sizes[-1]
    first = starts[max(range(len(specs)), key=sizes.__getitem__)] if specs else 0
    return _Layout(tuple(descriptors), tuple(starts), end, first)


def wire_record(specs: Sequence[Spec]) -> WireRecord | None:
    """A :class:`WireRecord` for ``specs``, or ``None`` where a dtype is not one the wire carries as it is."""
    if not all(dtype in _WIRE_CODES for _, _, dtype in specs):
        return None
    return WireRecord(specs)
