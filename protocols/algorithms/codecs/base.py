"""The uplink codec contract, the dense (identity) codec and the bit-packing helpers all codecs share.

A codec turns a model delta (``name -> float32 array``, in model order) into a :class:`Payload` and
back. The decoder knows the layout from its reference model (the cell model the delta applies to), so
names and shapes never travel for compressed codecs: only the packed data does. Bits are packed 8
per byte with ``np.packbits(..., bitorder="little")`` (element ``i`` is bit ``i % 8`` of byte
``i // 8``); padding bits must be zero and are checked.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from ... import params as P
from ...rejections import Rejected, RejectKind
from ...wire.payload import Payload, all_finite, payload_size

Delta = "OrderedDict[str, np.ndarray]"
SEED_RE = re.compile(r"^[0-9a-f]{16}$")


def seed_hex(seed: int) -> str:
    """A 63-bit seed as 16 lowercase hex digits (fixed width, so message sizes do not depend on it)."""
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed {seed} is not a 64-bit unsigned integer")
    return f"{seed:016x}"


def parse_seed(value: Any, what: str) -> int:
    """The seed of ``seed_hex``; :class:`Rejected` if malformed."""
    if not isinstance(value, str) or not SEED_RE.match(value):
        raise Rejected(RejectKind.MALFORMED, f"{what}: seed must be 16 hex digits, got {value!r}")
    return int(value, 16)


def pack_bits(bits: np.ndarray) -> np.ndarray:
    """Pack a flat 0/1 array 8 per byte (little bit order); ``ceil(len/8)`` bytes."""
    return np.packbits(np.asarray(bits, dtype=np.uint8).ravel(), bitorder="little")


def unpack_bits(packed: np.ndarray, count: int, what: str) -> np.ndarray:
    """Inverse of :func:`pack_bits`; :class:`Rejected` on a wrong length or non-zero padding bits."""
    expect_array(packed, np.uint8, (math.ceil(count / 8),), what)
    bits = np.unpackbits(packed, bitorder="little")
    if bits[count:].any():
        raise Rejected(RejectKind.MALFORMED, f"{what}: padding bits are not zero")
    return bits[:count]


def pack_codes(codes: np.ndarray, width: int) -> np.ndarray:
    """Pack non-negative integers of ``width`` bits each (LSB first) into ``ceil(n*width/8)`` bytes."""
    codes = np.asarray(codes, dtype=np.uint32).ravel()
    bits = (codes[:, None] >> np.arange(width, dtype=np.uint32)) & 1
    return pack_bits(bits.ravel())


def unpack_codes(packed: np.ndarray, count: int, width: int, what: str) -> np.ndarray:
    """Inverse of :func:`pack_codes` (uint32 codes)."""
    bits = unpack_bits(packed, count * width, what).reshape(count, width).astype(np.uint32)
    return (bits << np.arange(width, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)


def expect_array(arr: Any, dtype: type, shape: tuple[int, ...], what: str) -> np.ndarray:
    """Check an incoming array's dtype and shape (and finiteness for floats)."""
    if not isinstance(arr, np.ndarray) or arr.dtype != np.dtype(dtype) or arr.shape != shape:
        got = f"{arr.dtype}{list(arr.shape)}" if isinstance(arr, np.ndarray) else type(arr).__name__
        raise Rejected(RejectKind.SHAPE, f"{what}: expected {np.dtype(dtype)}{list(shape)}, got {got}")
    if arr.dtype.kind == "f" and not all_finite(arr):
        raise Rejected(RejectKind.NON_FINITE, f"{what}: non-finite values")
    return arr


def expect_names(payload: Payload, names: list[str], what: str) -> None:
    if list(payload.tensors) != names:
        raise Rejected(RejectKind.SHAPE, f"{what}: expected tensors {names}, got {list(payload.tensors)[:5]}")


def flatten(delta: Mapping[str, np.ndarray]) -> np.ndarray:
    """All tensors of ``delta`` in order, as one float32 vector."""
    if not delta:
        return np.zeros(0, np.float32)
    return np.concatenate([np.asarray(v, dtype=np.float32).ravel() for v in delta.values()])


def unflatten(flat: np.ndarray, like: Mapping[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
    """Split a flat vector into tensors shaped like ``like`` (float32)."""
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    pos = 0
    for k, v in like.items():
        out[k] = flat[pos : pos + v.size].reshape(v.shape).astype(np.float32, copy=False)
        pos += v.size
    return out


def segments(like: Mapping[str, np.ndarray]) -> list[tuple[int, int]]:
    """``(start, stop)`` of each tensor of ``like`` in the flat vector."""
    out, pos = [], 0
    for v in like.values():
        out.append((pos, pos + v.size))
        pos += v.size
    return out


def wire_size(payload: Payload) -> int:
    """The exact bytes of ``payload`` under the ``tensors/v1`` codec (what the envelope carries)."""
    return payload_size(payload)


def tensor_header_bytes(name: str, ndim: int) -> int:
    """Per-tensor framing of ``tensors/v1``: name length, name, dtype code, ndim, shape."""
    return 2 + len(name.encode()) + 1 + 1 + 4 * ndim


class UplinkCodec(ABC):
    """Encodes a device's model delta for the device -> cell link and decodes it at the cell.

    ``encode`` may draw randomness (stochastic rounding, FedMRN noise) only from ``seed``, so the result
    is reproducible. Compressed codecs put ``"codec": name`` in the metadata; ``check`` raises
    :class:`Rejected` on anything malformed, and ``decode`` of a checked payload is a dense delta of
    ``like``'s layout.
    """

    name: ClassVar[str]
    seeded: ClassVar[bool] = True
    """Whether ``encode`` draws from its seed: a device derives one (~30 us) only for a codec that does."""

    @abstractmethod
    def encode(self, delta: Mapping[str, np.ndarray], seed: int) -> Payload:
        """The payload for ``delta`` (metadata: only the codec's own keys)."""

    @abstractmethod
    def check(self, payload: Payload, like: Mapping[str, np.ndarray], what: str) -> None:
        """Raise :class:`Rejected` unless ``payload`` decodes to a delta shaped like ``like``."""

    @abstractmethod
    def decode(self, payload: Payload, like: Mapping[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        """The dense delta a checked payload stands for."""

    @abstractmethod
    def data_bytes(self, like: Mapping[str, np.ndarray]) -> int:
        """Exact bytes of tensor data (no framing) the encoding of a delta shaped like ``like`` carries."""

    def framing_bytes(self, like: Mapping[str, np.ndarray]) -> int:
        """Exact ``tensors/v1`` framing of the encoded tensors (metadata excluded)."""
        return sum(tensor_header_bytes(n, nd) for n, nd in self.layout(like))

    @abstractmethod
    def layout(self, like: Mapping[str, np.ndarray]) -> list[tuple[str, int]]:
        """``(tensor name, ndim)`` of every tensor in the encoding, in order."""

    def _check_codec(self, payload: Payload, what: str) -> None:
        if payload.meta.get("codec") != self.name:
            raise Rejected(
                RejectKind.MALFORMED, f"{what}: expected codec {self.name!r}, got {payload.meta.get('codec')!r}"
            )


class DenseCodec(UplinkCodec):
    """No compression: the float32 delta itself (the payload FedAvg always sent; no extra metadata)."""

    name = "dense"
    seeded = False

    def encode(self, delta: Mapping[str, np.ndarray], seed: int) -> Payload:
        return Payload({}, OrderedDict(delta))

    def check(self, payload: Payload, like: Mapping[str, np.ndarray], what: str) -> None:
        P.check_like(payload.tensors, like, what)  # raises Rejected
        for k, v in payload.tensors.items():  # a float64 delta could overflow the float32 model
            if v.dtype != np.float32:
                raise Rejected(RejectKind.SHAPE, f"{what}: tensor {k!r} has dtype {v.dtype}, expected float32")

    def decode(self, payload: Payload, like: Mapping[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        return OrderedDict(payload.tensors)

    def data_bytes(self, like: Mapping[str, np.ndarray]) -> int:
        return 4 * P.num_values(like)

    def layout(self, like: Mapping[str, np.ndarray]) -> list[tuple[str, int]]:
        return [(k, v.ndim) for k, v in like.items()]
