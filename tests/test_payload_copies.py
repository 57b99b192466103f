"""Copy-free payload encoding (issue #33, item 2): the same bytes as before, one copy of the data.

The reference encoder below is ``encode_payload`` as it was before the copy-free one (each tensor's
``tobytes()`` joined, then the frame joined again): the new encoding must give the same bytes, the
same signatures and the same sizes, with at most one copy of a tensor's data held at once."""

from __future__ import annotations

import hashlib
import json
import struct
import tracemalloc

import numpy as np
import pytest

from protocols.wire.envelope import MAGIC, Header, WireError, decode_message, encode_message, signed_bytes
from protocols.wire.payload import (
    DTYPES,
    Payload,
    _code,
    all_finite,
    decode_payload,
    encode_payload,
    payload_parts,
    payload_size,
)


def reference_encode(payload: Payload) -> bytes:
    """``encode_payload`` before the copy-free encoding (verbatim but for its name)."""
    meta = json.dumps(payload.meta, separators=(",", ":"), allow_nan=False).encode()
    parts = [struct.pack("<I", len(meta)), meta, struct.pack("<H", len(payload.tensors))]
    for name, arr in payload.tensors.items():
        arr = np.asarray(arr)
        code = _code(arr)
        le = arr.astype(DTYPES[code], order="C", copy=False)
        name_b = name.encode()
        parts.append(struct.pack(f"<H{len(name_b)}sBB{le.ndim}I", len(name_b), name_b, code, le.ndim, *le.shape))
        parts.append(le.tobytes())
    return b"".join(parts)


def reference_frame(header: Header, payload: bytes, sign, topic: str) -> bytes:
    header = header.model_copy(update={"payload_len": len(payload), "sig": None})
    if sign is not None:
        from protocols.wire.envelope import encode_sig

        header = header.model_copy(update={"sig": encode_sig(sign(signed_bytes(topic, header.to_json(), payload)))})
    head = header.to_json()
    return b"".join((MAGIC, struct.pack("<I", len(head)), head, payload))


def payloads() -> list[Payload]:
    rng = np.random.default_rng(0)
    big_endian = rng.normal(size=(3, 5)).astype(">f4")
    return [
        Payload(),
        Payload({"seed": 7, "scalars": [0.5, -1.0], "name": "é"}, {}),
        Payload({}, {"w": rng.normal(size=(200, 784)).astype(np.float32), "b": np.zeros(200, np.float32)}),
        Payload({}, {"scalar": np.array(1.5, np.float32), "empty": np.zeros((0, 4), np.float64)}),
        Payload({}, {"t": rng.normal(size=(6, 4)).astype(np.float64).T}),  # not contiguous
        Payload({}, {"be": big_endian, "i8": np.arange(-5, 5, dtype=np.int8), "h": np.ones(3, np.float16)}),
        Payload({"k": 1}, {"bits": np.packbits(rng.integers(0, 2, 1001)), "u64": np.arange(4, dtype=np.uint64)}),
        Payload({}, {"ints": np.arange(12, dtype=np.int64).reshape(2, 3, 2), "i32": np.arange(3, dtype=np.int32)}),
    ]


@pytest.mark.parametrize("i", range(len(payloads())))
def test_payload_bytes_identical_to_the_reference_encoder(i: int) -> None:
    payload = payloads()[i]
    want = reference_encode(payload)
    assert encode_payload(payload) == want
    assert b"".join(payload_parts(payload)) == want
    assert payload_size(payload) == len(want)
    back = decode_payload(want)
    assert back.meta == payload.meta and list(back.tensors) == list(payload.tensors)
    for k, v in payload.tensors.items():
        assert back.tensors[k].shape == np.asarray(v).shape
        np.testing.assert_array_equal(back.tensors[k], v)
        assert back.tensors[k].flags.writeable and back.tensors[k].dtype.isnative


@pytest.mark.parametrize("signed", [False, True])
def test_messages_identical_framed_from_parts_or_bytes(signed: bool) -> None:
    sign = (lambda data: hashlib.sha512(data).digest()[:64]) if signed else None  # deterministic stand-in
    header = Header(run="r", kind="device_result", round=3, sender="c0-d1", msg_id="m1", payload_len=0)
    for payload in payloads():
        want = reference_frame(header, reference_encode(payload), sign, "fedtier/r/cell/c0/up/c0-d1")
        assert encode_message(header, payload_parts(payload), sign, "fedtier/r/cell/c0/up/c0-d1") == want
        assert encode_message(header, encode_payload(payload), sign, "fedtier/r/cell/c0/up/c0-d1") == want
        got, raw = decode_message(want)
        assert got.payload_len == len(reference_encode(payload)) and bytes(raw) == reference_encode(payload)


def test_a_message_costs_one_copy_of_its_tensors() -> None:
    """Framing an 8 MB tensor holds at most ~one extra copy of it (the message); decoding too (the array)."""
    x = np.random.default_rng(1).normal(size=2 << 20).astype(np.float32)  # 8 MiB
    header = Header(run="r", kind="device_result", round=1, sender="c0-d0", msg_id="m", payload_len=0)
    payload = Payload({"n": 1}, {"x": x})
    encode_message(header, payload_parts(payload))  # warm up (imports, caches)
    tracemalloc.start()
    try:
        msg = encode_message(header, payload_parts(payload))
        _, peak_encode = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        _, raw = decode_message(msg)
        back = decode_payload(raw)
        _, peak_decode = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_encode < 1.25 * x.nbytes, peak_encode / x.nbytes  # the old path held 3 copies at once
    assert peak_decode - base < 1.25 * x.nbytes, (peak_decode - base) / x.nbytes
    np.testing.assert_array_equal(back.tensors["x"], x)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_anywhere_are_refused(dtype, bad) -> None:
    for where in (0, 500, 999):
        x = np.linspace(-1, 1, 1000).astype(dtype)
        x[where] = bad
        with pytest.raises(WireError, match="non-finite"):
            decode_payload(encode_payload(Payload({}, {"x": x})))
    assert decode_payload(encode_payload(Payload({}, {"x": np.linspace(-1, 1, 1000).astype(dtype)})))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_huge_finite_values_are_accepted_and_checks_are_exact(dtype) -> None:
    """The finiteness check's fast path (a sum of squares) overflows on huge finite values: they are still
    finite (the exact check decides), and a NaN or an infinity in a strided array is still found."""
    huge = np.full((30, 40), np.finfo(dtype).max / 2, dtype)
    huge[::2] *= -1
    assert all_finite(huge)
    assert decode_payload(encode_payload(Payload({}, {"x": huge}))).tensors["x"].tobytes() == huge.tobytes()
    for bad in (np.nan, np.inf, -np.inf):
        strided = np.ones((30, 40), dtype)[:, ::3]
        strided[7, 2] = bad
        assert not all_finite(strided)
        x = huge.copy()
        x[29, 39] = bad
        assert not all_finite(x)
