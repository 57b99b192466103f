"""The tensor payload codec ``tensors/v1``: a JSON metadata object plus named raw arrays.

Layout (little-endian)::

    u32 meta length | meta JSON (an object)
    u16 tensor count
    per tensor: u16 name length | name (utf-8) | u8 dtype code | u8 ndim | u32 * ndim shape | raw data

Arrays travel as their raw little-endian bytes: a float32 tensor of n values costs 4n bytes plus
its name and shape. Packed bit masks are ``uint8`` tensors, seeds and scalars go in the metadata.
Decoding checks every length, the dtype, the shape, and (by default) that floats are finite.
"""

from __future__ import annotations

import json
import math
import struct
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..jsonl import loads, nested_deeper
from ..rejections import RejectKind
from .envelope import WireError

DTYPES: dict[int, np.dtype] = {
    1: np.dtype("<f4"),
    2: np.dtype("<f8"),
    3: np.dtype("<f2"),
    4: np.dtype("<i8"),
    5: np.dtype("<i4"),
    6: np.dtype("<i2"),
    7: np.dtype("i1"),
    8: np.dtype("u1"),
    9: np.dtype("<u2"),
    10: np.dtype("<u4"),
    11: np.dtype("<u8"),
}
_CODES = {dt.str.lstrip("<|="): code for code, dt in DTYPES.items()}
_WIRE_CODES = {dt: code for code, dt in DTYPES.items()}  # dtype -> code, for dtypes already as on the wire
MAX_NDIM = 8
MAX_META_BYTES = 1024 * 1024
MAX_META_DEPTH = 32
"""Metadata nests at most this deep (fedtier's own nests 3 or 4): what a peer nests to the parser's limit (~1000)
would leave a receiver's own recursive walks and re-encodings (journals, records) a few frames from raising."""


@dataclass
class Payload:
    """What a role sends: JSON-able metadata and named numpy arrays. ``headroom``: where the payload was decoded
    from lent bytes with room before them (a sim worker's result, :class:`Headroom`), its message is framed there,
    without a copy of its bytes (:meth:`~protocols.wire.messenger.Messenger.frame_once`)."""

    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    headroom: Headroom | None = field(default=None, repr=False, compare=False)
    layout: Layout | None = field(default=None, repr=False, compare=False)
    """With ``headroom``: the decoding's end of the metadata and its tensors as decoded (name, the read-only view,
    its shape and dtype), which :meth:`Headroom.encodes` compares against (a payload changed since is encoded)."""


Layout = tuple[int, tuple[tuple[str, np.ndarray, tuple[int, ...], np.dtype], ...]]


def _code(arr: np.ndarray) -> int:
    key = arr.dtype.newbyteorder("<").str.lstrip("<|=") if arr.dtype.byteorder not in "|" else arr.dtype.str.lstrip("|")
    try:
        return _CODES[key]
    except KeyError:
        raise WireError(RejectKind.SHAPE, f"dtype {arr.dtype} cannot be sent") from None


META_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
"""A payload's metadata as JSON: ``json.dumps(meta, separators=(",", ":"), allow_nan=False)``, whose encoder is made
once (``json.dumps`` with arguments makes one a call: ~3 us of every message)."""

Parts = list[bytes | np.ndarray]
"""A payload's encoding as buffers in order (headers as ``bytes``, each tensor's data as a byte view of
its array): joined once (``b"".join``), they are its bytes."""


def payload_parts(payload: Payload) -> Parts:
    """The encoding of ``payload`` as buffers, without copying any tensor's data (a tensor that is not
    contiguous, little-endian and of a wire dtype is converted once). Join them with the frame's header
    (:func:`~protocols.wire.envelope.encode_message`) for a message built with one copy of the data."""
    meta = META_JSON.encode(payload.meta).encode()
    parts: Parts = [struct.pack("<I", len(meta)), meta, struct.pack("<H", len(payload.tensors))]
    for name, arr in payload.tensors.items():
        arr = np.asarray(arr)
        code = _WIRE_CODES.get(arr.dtype)  # a wire dtype as it is (little-endian): no conversion to look up
        if code is not None and arr.flags.c_contiguous:
            le = arr
        else:
            code = code or _code(arr)
            le = arr.astype(DTYPES[code], order="C", copy=False)  # (ascontiguousarray would make 0-d arrays 1-d)
        parts.append(tensor_descriptor(name, code, le.shape))
        parts.append(le.reshape(-1).view(np.uint8))  # a view: its bytes are the array's (C order, little-endian)
    return parts


def tensor_descriptor(name: str, code: int, shape: tuple[int, ...]) -> bytes:
    """A tensor's descriptor in a payload's table: name length, name, dtype code, ndim, shape (its values follow)."""
    name_b = name.encode()
    return struct.pack(f"<H{len(name_b)}sBB{len(shape)}I", len(name_b), name_b, code, len(shape), *shape)


def parts_size(parts: Parts) -> int:
    """The bytes that ``parts`` join to."""
    return sum(p.nbytes if isinstance(p, np.ndarray) else len(p) for p in parts)


BYTES_ALIGN = 16
"""The alignment of a large ``bytes`` object's first byte in CPython (its header is 32 bytes long, and malloc's
blocks are 16-byte aligned)."""


def aligned_start(parts: Parts) -> int:
    """The bytes (fewer than :data:`BYTES_ALIGN`) to put before ``parts`` in a ``bytes`` object so that the most of
    their tensors' values start on a multiple of 4 bytes (float32's size) and, among those, the largest on a multiple
    of :data:`BYTES_ALIGN`: numpy reads an unaligned float32 array through a buffer (a model-sized delta against a
    received task took 1.6x the time of aligned)."""
    at, tensors = 0, []
    for part in parts:
        size = part.nbytes if isinstance(part, np.ndarray) else len(part)
        if isinstance(part, np.ndarray) and size:
            tensors.append((size, at))
        at += size
    if not tensors:
        return 0
    largest = max(tensors)[1]

    def score(pad: int) -> tuple[int, bool]:
        return sum(size for size, at in tensors if (at + pad) % 4 == 0), (largest + pad) % BYTES_ALIGN == 0

    return max(range(BYTES_ALIGN), key=score)


def encode_payload(payload: Payload) -> bytes:
    """Serialise a :class:`Payload` (metadata must be JSON-serialisable, floats finite): one copy of
    each tensor's data (:func:`payload_parts` joined)."""
    return b"".join(payload_parts(payload))  # type: ignore[arg-type]  # arrays are buffers; typeshed does not say so


def payload_size(payload: Payload) -> int:
    """The exact bytes :func:`encode_payload` would return, without building them."""
    return parts_size(payload_parts(payload))


_FINITE: dict[int, tuple[weakref.ReferenceType[np.ndarray], float | None]] = {}
"""id -> (array, its sum of squares or None), for the arrays :func:`decode_payload` checked finite that can never
change (read-only views of a message's immutable bytes): :func:`all_finite` answers True for them without reading
them again (a cell's role checks each result against its model, after the wire checked it), and
:func:`known_squares` gives the sum of squares that check took (a cell's update norm of a result,
``protocols.divergence.update_norm``). Entries leave with their arrays."""


def _remember_finite(arr: np.ndarray, squares: float | None) -> None:
    key = id(arr)

    def forget(ref: weakref.ReferenceType[np.ndarray], key: int = key) -> None:
        entry = _FINITE.get(key)
        if entry is not None and entry[0] is ref:  # (runs as the array dies, before its id can be reused)
            del _FINITE[key]

    _FINITE[key] = (weakref.ref(arr, forget), squares)


def _known_finite(arr: np.ndarray) -> bool:
    entry = _FINITE.get(id(arr))
    return entry is not None and entry[0]() is arr


def known_squares(arr: np.ndarray) -> float | None:
    """``float(np.vdot(arr, arr))`` as :func:`decode_payload` took it when it checked ``arr`` finite (a view it
    remembers: the same bits as summing it again), else ``None``: a caller's pass of it saved."""
    entry = _FINITE.get(id(arr))
    return entry[1] if entry is not None and entry[0]() is arr else None


def own_views(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """New view objects of read-only decoded ``tensors`` (a shared payload's decoding, for one of its receivers): one
    that reshapes or retypes its own in place (``arr.shape = ...`` changes the array object, not its bytes) changes
    nobody else's; each known finite, with its sum of squares, where its original is (nothing read again)."""
    out: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        out[name] = view = arr.view()
        squares = known_squares(arr)
        if squares is not None:
            _remember_finite(view, squares)
    return out


def all_finite(arr: np.ndarray) -> bool:
    """True when every value of a float array is finite. A contiguous float32/float64 array is summed
    squared (one BLAS pass, no temporary): the squares cannot cancel, so a finite sum proves every value
    finite; otherwise (a NaN, an infinity, or finite values whose squares overflow) its minimum and maximum
    decide (a NaN propagates into both, an infinity is one of them): exact either way, and 2-3x faster
    than the two passes alone on the float32 tensors every message carries. The sum is ``np.vdot``'s,
    which reports no floating-point errors (an overflow or a NaN is an answer here), so no error-state
    context is entered per call (2 us of ~5 on a small tensor, ~25 calls a device a round). A view that
    :func:`decode_payload` checked (immutable, see ``_FINITE``) is answered without reading it again."""
    if arr.size == 0 or (not arr.flags.writeable and _known_finite(arr)):
        return True
    return _finite_squares(arr)[0]


def _finite_squares(arr: np.ndarray) -> tuple[bool, float | None]:
    """:func:`all_finite`'s check of a non-empty array, and the finite sum of squares it took (``None``: none)."""
    if arr.dtype.char in "fd" and arr.dtype.isnative and arr.flags.c_contiguous:  # float32/64 for BLAS
        try:
            squares = float(np.vdot(arr, arr))
            if math.isfinite(squares):  # (math's: numpy's costs 1.6 us on a scalar)
                return True, squares
        except FloatingPointError:  # only where a caller made numpy raise: the exact check decides
            pass
    return bool(np.isfinite(arr.min()) and np.isfinite(arr.max())), None


_U32, _U16, _BB = struct.Struct("<I"), struct.Struct("<H"), struct.Struct("<BB")
_SHAPES = [struct.Struct(f"<{n}I") for n in range(MAX_NDIM + 1)]
_MAX_INTP = int(np.iinfo(np.intp).max)  # the largest array numpy can describe, in bytes
_REMEMBER_BYTES = 4096  # smaller tensors are checked again rather than remembered (a check costs ~1 us)


def _need(pos: int, n: int, end: int) -> int:
    """``pos + n``, the end of the ``n`` bytes at ``pos``; :class:`WireError` if the payload ends first."""
    if pos + n > end:
        raise WireError(RejectKind.MALFORMED, "payload truncated")
    return pos + n


def _read(fmt: struct.Struct, buf: memoryview, pos: int, end: int) -> tuple[tuple[Any, ...], int]:
    """The values ``fmt`` unpacks at ``pos`` and the position after them (:func:`_need`'s check first)."""
    after = _need(pos, fmt.size, end)
    return fmt.unpack_from(buf, pos), after


class Lent(np.ndarray):
    """Read-only bytes (``uint8``) lent by their owner, which frees them only once no array made from them is left
    (a sim worker's result in its ring, ``sim/result_ring.py``): while any lives they never change, as a ``bytes``
    object's do not, so :func:`decode_payload` views them as it views a message's bytes. ``headroom``: the room
    its owner left before them for a message's envelope (this very array's, not a view's of it)."""

    headroom: Headroom | None = None
    checked: bool = False
    """A message framed in place (:meth:`Headroom.frame`) whose payload is bytes decoded as checked finite (their
    sender, a process of this run, checked every float, or the decoding read them): its receiver need not read them
    again (:meth:`~protocols.wire.messenger.Messenger.receive`; they never change while the message exists)."""
    squares: dict[int, float] | None = None
    """With ``checked``: the sum of squares the sender's check took of each float tensor, by where its values start
    in the payload (:class:`~protocols.wire.wire_record.WireRecord`: the same memory the receiver views), which the
    decoding remembers as :func:`known_squares` (a cell's update norm of the result needs no pass of it either)."""


class Headroom:
    """Room before an encoded payload's lent bytes, for its message's envelope (a sim worker's result in its ring,
    ``sim/result_ring.py``): :meth:`frame` writes the envelope there, right before the payload, so the message is
    the lent record itself and the payload is not copied. The room is written once at most, before any message of
    it exists, and nothing reads it before (the payload's views start after it): a message never changes while
    anything can read it; it is a view of the record, which stays lent as long as it does."""

    def __init__(self, record: np.ndarray, room: memoryview) -> None:
        """``record``: the lent record, read-only ``uint8``: ``room.nbytes`` bytes of room, then the payload's
        bytes; ``room``: a writable view of its first bytes (given up at the first :meth:`frame`)."""
        self._record, self.size = record, room.nbytes
        self._room: memoryview | None = room
        self._payload_at = record.ctypes.data + self.size  # where the payload's bytes start (its address)
        self._lock = threading.Lock()
        self.checked = False  # every float of the payload is known finite (decode_payload, checked or read)
        self._whole: np.ndarray | None = None  # the payload's bytes as the part encodes() gave

    def encodes(self, payload: Payload) -> np.ndarray | None:
        """The lent payload's bytes (one part for :meth:`frame`) where ``payload``, decoded from them, still encodes to
        them exactly: its tensors the views decoded, in order, with their names, shapes and dtypes, and its metadata
        the same JSON; else ``None`` (encode it). Reads none of its arrays and builds none of its parts."""
        layout = payload.layout
        if layout is None or payload.headroom is not self or len(payload.tensors) != len(layout[1]):
            return None
        for (name, arr, shape, dtype), (k, v) in zip(layout[1], payload.tensors.items()):
            if v is not arr or k != name or v.shape != shape or v.dtype != dtype:
                return None
        meta = META_JSON.encode(payload.meta).encode()  # (payload_parts')
        record: Any = self._record  # (numpy's stubs do not say that an array is a buffer)
        if layout[0] != 4 + len(meta) or memoryview(record)[self.size + 4 : self.size + layout[0]] != meta:
            return None
        self._whole = self._record[self.size :]
        return self._whole

    def seal(self, payload: Payload) -> None:
        """Nothing to do: a lent payload's floats were checked where it was decoded (a record made for a message,
        ``protocols.wire.wire_record.WireRecord``, checks its own here)."""

    def parts_of(self, payload: Payload) -> Parts | None:
        """``payload``'s encoding for :meth:`frame` where it is still the lent bytes (:meth:`encodes`); else None."""
        whole = self.encodes(payload)
        return None if whole is None else [whole]

    def frame(self, head: bytes, parts: Parts) -> memoryview | None:
        """The message ``head`` (an envelope, ``envelope_head``) + the payload, framed in place (a read-only view of
        the record): the bytes ``head`` and ``parts`` join to. ``None`` (frame it by copying) unless ``parts``
        are exactly the lent payload's bytes (each array a view of them at its place, each other part equal to
        them there: a payload changed since it was decoded is not) and ``head`` fits in the room; the room is
        written at the first call only (the next ones are ``None``)."""
        with self._lock:
            room, self._room = self._room, None
        if room is None or len(head) > self.size or not self._holds(parts):
            return None
        at = self.size - len(head)
        room[at:] = head
        room.release()
        message: Any = self._record[at:].view(Lent)  # (numpy's stubs do not say that an array is a buffer)
        message.checked = self.checked  # (the payload is exactly the bytes decoded: _holds)
        return memoryview(message)

    def _holds(self, parts: Parts) -> bool:
        """Whether ``parts`` join to the lent payload's bytes without reading its arrays: each array part is the
        payload's memory at its place (the same bytes by definition), each other part compares equal there."""
        if len(parts) == 1 and parts[0] is self._whole:
            return True  # encodes(): the payload's own bytes
        record: Any = self._record  # (numpy's stubs do not say that an array is a buffer)
        payload = memoryview(record)[self.size :]
        start, pos, end = self._payload_at, 0, payload.nbytes
        for part in parts:
            if isinstance(part, np.ndarray):
                n = part.nbytes
                same = part.flags.c_contiguous and (n == 0 or part.ctypes.data == start + pos)
            else:
                n = len(part)
                same = payload[pos : pos + n] == part
            pos += n
            if not same or pos > end:
                return False
        return pos == end


def checked_in_place(message: object) -> bool:
    """Whether ``message`` is a whole message framed in place (:meth:`Headroom.frame`) of a payload whose floats are
    known finite (:attr:`Lent.checked`): its receiver decodes its payload without reading them again."""
    return (
        isinstance(message, memoryview)
        and isinstance(message.obj, Lent)
        and message.obj.checked
        and message.readonly
        and message.nbytes == message.obj.nbytes
    )


def immutable(arr: np.ndarray) -> bool:
    """True when ``arr``'s values can never change: a read-only view (of views) of a ``bytes`` object, such as a
    received message's tensor (:func:`decode_payload` with ``views``). A holder needs no copy of it as a snapshot."""
    base = arr.base
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, bytes) and not arr.flags.writeable


def _finite(arr: np.ndarray, name: str, read: bool, remember: bool, known: float | None = None) -> None:
    """``decode_payload``'s finiteness of a float tensor: ``read`` it (:class:`WireError` if not finite), or take
    it as checked by its sender (with the sum of squares it took, where ``known``); ``remember`` it as finite (a view
    of immutable bytes: checked once for good)."""
    finite, squares = _finite_squares(arr) if read and arr.size else (True, known)
    if not finite:
        raise WireError(RejectKind.NON_FINITE, f"tensor {name!r} has non-finite values")
    if remember:
        _remember_finite(arr, squares)


def _decode_meta(buf: memoryview, end: int) -> tuple[dict[str, Any], int]:
    """A payload's metadata (a JSON object of at most :data:`MAX_META_BYTES`, nested at most
    :data:`MAX_META_DEPTH` levels, finite numbers) and the position after it."""
    (meta_len,), pos = _read(_U32, buf, 0, end)
    if meta_len > MAX_META_BYTES:
        raise WireError(RejectKind.OVERSIZED, f"metadata of {meta_len} bytes is too large")
    pos = _need(pos, meta_len, end)
    try:
        meta = loads(bytes(buf[4:pos]), finite=True)
    except ValueError as exc:
        raise WireError(RejectKind.MALFORMED, f"bad metadata: {exc}") from None
    if not isinstance(meta, dict):
        raise WireError(RejectKind.MALFORMED, "metadata is not an object")
    if nested_deeper(meta, MAX_META_DEPTH):
        raise WireError(RejectKind.MALFORMED, f"metadata nested deeper than {MAX_META_DEPTH} levels")
    return meta, pos


def decode_payload(
    data: bytes | memoryview, *, require_finite: bool = True, views: bool = False, checked: bool = False
) -> Payload:
    """Parse bytes produced by :func:`encode_payload`; raise :class:`WireError` on any defect.

    Each tensor is an array of its own (writable, native byte order): one copy of its bytes. With
    ``views``, a tensor is instead a read-only view of ``data`` where that costs nothing and is safe: ``data``
    is (a view of) an immutable ``bytes`` object (or :class:`Lent` bytes) and the tensor's byte order is native;
    its values are checked as a copy's are, and cannot change after (a message's bytes never do). A receiver then keeps
    the message's bytes alive as long as it keeps the arrays, and must copy what it wants to change (the
    runtimes' :class:`~protocols.wire.messenger.Messenger` decodes so: a device's task is copied into its
    trainer and a result read once, so the decoding's copy was one pass over each message for nothing).
    ``checked`` (without ``require_finite``): the sender, a process of this run and not the network, checked every
    float finite; such views are remembered as checked (:func:`all_finite` answers without reading them). Views of
    :class:`Lent` bytes with room before them keep it (``Payload.headroom``): a message of them is framed there."""
    buf = memoryview(data)
    end = buf.nbytes
    share = views and isinstance(buf.obj, (bytes, Lent))  # not a bytearray or other buffer someone could change
    headroom = buf.obj.headroom if share and isinstance(buf.obj, Lent) else None
    squares = buf.obj.squares if checked and share and isinstance(buf.obj, Lent) else None  # (the sender's)
    meta, meta_end = _decode_meta(buf, end)
    viewed_all = True
    tensors: dict[str, np.ndarray] = {}
    for name, dtype, shape, at, nbytes in _known_table(buf, meta_end, end) or _parse_table(buf, meta_end, end):
        arr: np.ndarray = np.ndarray(shape, dtype, buf, meta_end + at)  # a view (read-only where buf is)
        viewed = share and dtype.isnative
        if not viewed:
            viewed_all = False
            # the one copy of the tensor's bytes: out of the message, into an array of its own (writable, native)
            arr = arr.astype(dtype.newbyteorder("="), copy=True)
        if arr.dtype.kind == "f" and (require_finite or checked):
            known = squares.get(meta_end + at) if squares is not None and viewed else None
            _finite(arr, name, require_finite, viewed and nbytes >= _REMEMBER_BYTES, known)
        if name in tensors:
            raise WireError(RejectKind.MALFORMED, f"tensor {name!r} appears twice")
        tensors[name] = arr
    if headroom is None:
        return Payload(meta, tensors)
    if checked or require_finite:
        headroom.checked = True  # its message, framed there, carries floats known finite (Lent.checked)
    layout = (meta_end, tuple((k, a, a.shape, a.dtype) for k, a in tensors.items())) if viewed_all else None
    return Payload(meta, tensors, headroom, layout)


Entry = tuple[str, np.dtype, tuple[int, ...], int, int]
"""A tensor of a payload's table: its name, dtype, shape, where its data starts (after the metadata) and its bytes."""
_TABLES: dict[int, tuple[tuple[tuple[int, bytes], ...], tuple[Entry, ...]]] = {}
"""Tables parsed before, by the bytes after the metadata: each tensor's descriptor bytes where they were (the count
with the first) and its entry. A table's parse depends on its descriptors alone, so the same descriptor bytes at
the same places give the same entries (a model's every task and result: compared, not parsed again)."""
_MAX_TABLES, _MAX_TABLE_TENSORS, _MAX_TABLE_BYTES = 64, 256, 16384  # kept: 1 MiB of descriptors at most
# (the MLP's table: 6 tensors, ~110 bytes of descriptors)


def _known_table(buf: memoryview, pos: int, end: int) -> tuple[Entry, ...] | None:
    """The entries of the table at ``pos`` where a table parsed before has the same descriptors there; else None."""
    known = _TABLES.get(end - pos)
    if known is None:
        return None
    for at, descriptor in known[0]:
        if buf[pos + at : pos + at + len(descriptor)] != descriptor:
            return None
    return known[1]


def _parse_table(buf: memoryview, pos: int, end: int) -> Iterator[Entry]:
    """The entries of the table at ``pos`` (after the metadata), each as it is parsed (:class:`WireError` at the
    first defect: the decoding checks each tensor before the next is parsed); kept for :func:`_known_table` once
    the table is read to its end, every length checked."""
    first = pos
    (count,), pos = _read(_U16, buf, pos, end)
    descriptors: list[tuple[int, bytes]] = []
    entries: list[Entry] = []
    for _ in range(count):
        described = first if not descriptors else pos
        (name_len,), pos = _read(_U16, buf, pos, end)
        pos = _need(pos, name_len, end)
        try:
            name = bytes(buf[pos - name_len : pos]).decode()
        except UnicodeDecodeError:
            raise WireError(RejectKind.MALFORMED, "tensor name is not utf-8") from None
        (code, ndim), pos = _read(_BB, buf, pos, end)
        if code not in DTYPES:
            raise WireError(RejectKind.SHAPE, f"tensor {name!r}: unknown dtype code {code}")
        if ndim > MAX_NDIM:
            raise WireError(RejectKind.SHAPE, f"tensor {name!r}: {ndim} dimensions")
        shape, pos = _read(_SHAPES[ndim], buf, pos, end)
        dtype = DTYPES[code]
        nbytes = math.prod(shape) * dtype.itemsize
        start, pos = pos, _need(pos, nbytes, end)
        if nbytes == 0 and math.prod(d or 1 for d in shape) * dtype.itemsize > _MAX_INTP:  # numpy refuses it too
            raise WireError(RejectKind.SHAPE, f"tensor {name!r}: shape {shape} is too large")
        descriptors.append((described - first, bytes(buf[described:start])))
        entries.append((name, dtype, shape, start - first, nbytes))
        yield entries[-1]
    if pos != end:
        raise WireError(RejectKind.MALFORMED, f"{end - pos} trailing bytes after the last tensor")
    kept = 0 < count <= _MAX_TABLE_TENSORS and sum(len(d) for _, d in descriptors) <= _MAX_TABLE_BYTES
    if kept and len({e[0] for e in entries}) == count:  # (a repeated name: refused)
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        _TABLES[end - first] = (tuple(descriptors), tuple(entries))
