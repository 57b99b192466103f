"""Envelope and payload codec: exact round trips, and every malformed input rejected with a reason."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from protocols.config import TopologySection
from protocols.wire import Header, Payload, WireError, decode_message, decode_payload, encode_message, encode_payload
from protocols.wire.dedup import SeenIds
from protocols.wire.envelope import MAGIC, verify_signature
from protocols.wire.keys import Trust, generate_keys, new_seed


def header(**kw) -> Header:
    base = dict(
        run="r", kind="device_result", round=3, edge_round=1, cell="c0", sender="c0-d1", msg_id="m1", payload_len=0
    )
    base.update(kw)
    return Header(**base)


def sample_payload() -> Payload:
    return Payload(
        {"weight": 600, "loss": 0.5},
        {
            "w": np.arange(12, dtype=np.float32).reshape(3, 4),
            "mask": np.array([255, 1], dtype=np.uint8),
            "idx": np.array([1, 2, 3], dtype=np.int64),
            "scalar": np.float64(2.5) * np.ones((), np.float64),
        },
    )


def test_payload_round_trip_is_exact_and_sized_by_content():
    p = sample_payload()
    data = encode_payload(p)
    q = decode_payload(data)
    assert q.meta == p.meta
    assert list(q.tensors) == list(p.tensors)
    for k in p.tensors:
        assert q.tensors[k].dtype == p.tensors[k].dtype and q.tensors[k].shape == p.tensors[k].shape
        assert q.tensors[k].tobytes() == p.tensors[k].tobytes()
    raw = sum(a.nbytes for a in p.tensors.values())
    assert raw < len(data) <= raw + 100  # raw arrays plus a small, fixed overhead


def test_big_endian_input_is_sent_little_endian():
    a = np.arange(5, dtype=">f4")
    q = decode_payload(encode_payload(Payload({}, {"a": a})))
    assert np.array_equal(q.tensors["a"], a.astype("<f4"))


@pytest.mark.parametrize("bad", [np.float32("nan"), np.float32("inf")])
def test_non_finite_tensor_rejected(bad):
    data = encode_payload(Payload({}, {"w": np.array([1.0, bad], dtype=np.float32)}))
    with pytest.raises(WireError, match="non-finite"):
        decode_payload(data)


def test_truncated_and_trailing_payloads_rejected():
    data = encode_payload(sample_payload())
    for cut in (1, 10, len(data) - 1):
        with pytest.raises(WireError):
            decode_payload(data[:cut])
    with pytest.raises(WireError, match="trailing"):
        decode_payload(data + b"\0")


def test_shape_larger_than_data_rejected():
    data = bytearray(encode_payload(Payload({}, {"w": np.zeros(4, np.float32)})))
    # meta "{}" (2 bytes) -> count at 6; name len at 8; name 'w' at 10; code, ndim at 11-12; shape at 13
    struct.pack_into("<I", data, 13, 1_000_000)
    with pytest.raises(WireError, match="truncated"):
        decode_payload(bytes(data))


def test_unknown_dtype_and_object_arrays_rejected():
    data = bytearray(encode_payload(Payload({}, {"w": np.zeros(1, np.float32)})))
    data[11] = 99
    with pytest.raises(WireError, match="dtype"):
        decode_payload(bytes(data))
    with pytest.raises(WireError, match="cannot be sent"):
        encode_payload(Payload({}, {"o": np.array([object()], dtype=object)}))


def test_metadata_must_be_a_json_object_without_nan():
    with pytest.raises(WireError):
        decode_payload(struct.pack("<I", 3) + b"[1]" + struct.pack("<H", 0))
    with pytest.raises(WireError):
        decode_payload(struct.pack("<I", 3) + b"NaN" + struct.pack("<H", 0))
    with pytest.raises(ValueError):
        encode_payload(Payload({"x": float("nan")}, {}))


def test_envelope_round_trip_and_signature():
    """Ed25519 over header, payload and topic: a tampered byte, another key, another topic, a changed
    session or no signature at all fail; the sender's own key verifies."""
    ring = generate_keys(TopologySection(cells=1, devices_per_cell=1))
    me = Trust("c0-d0", ring.private["c0-d0"], ring.public)
    liar = Trust("c0-d0", new_seed(), ring.public)  # claims to be c0-d0 with a key of its own
    body = encode_payload(sample_payload())
    topic = "fedtier/r/cell/c0/up/c0-d0/result"
    msg = encode_message(header(sender="c0-d0", session="s1"), body, me.sign, topic)
    h, raw = decode_message(msg)
    assert h.payload_len == len(body) and bytes(raw) == body and h.sig and h.session == "s1"
    verify_signature(h, raw, topic, me.verify)
    with pytest.raises(WireError, match="signature"):
        verify_signature(h, raw, "fedtier/r/cell/c0/up/c0-d1/result", me.verify)  # moved to another topic
    with pytest.raises(WireError, match="signature"):
        verify_signature(h.model_copy(update={"session": "s2"}), raw, topic, me.verify)  # rebound session
    tampered = bytearray(msg)
    tampered[-1] ^= 1
    h2, raw2 = decode_message(bytes(tampered))
    with pytest.raises(WireError, match="signature"):
        verify_signature(h2, raw2, topic, me.verify)
    h3, raw3 = decode_message(encode_message(header(sender="c0-d0"), body, liar.sign, topic))
    with pytest.raises(WireError, match="signature"):
        verify_signature(h3, raw3, topic, me.verify)
    h4, raw4 = decode_message(encode_message(header(sender="c0-d0"), body))
    with pytest.raises(WireError, match="unsigned"):
        verify_signature(h4, raw4, topic, me.verify)


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "magic"),
        (b"XXXX" + b"\0" * 10, "magic"),
        (MAGIC + struct.pack("<I", 10**6) + b"{}", "header length"),
        (MAGIC + struct.pack("<I", 4) + b"nope", "invalid header"),
        (MAGIC + struct.pack("<I", 2) + b"{}", "invalid header"),
    ],
)
def test_malformed_envelopes_rejected(data, reason):
    with pytest.raises(WireError, match=reason):
        decode_message(data)


def test_header_fields_validated():
    h = header().model_dump()
    h["round"] = -1
    import json

    head = json.dumps(h).encode()
    with pytest.raises(WireError, match="round"):
        decode_message(MAGIC + struct.pack("<I", len(head)) + head)
    h = header().model_dump() | {"surprise": 1}
    head = json.dumps(h).encode()
    with pytest.raises(WireError):
        decode_message(MAGIC + struct.pack("<I", len(head)) + head)


def test_payload_length_must_match_and_respect_limit():
    body = b"x" * 100
    msg = encode_message(header(), body)
    with pytest.raises(WireError, match="header says"):
        decode_message(msg[:-1])
    with pytest.raises(WireError, match="exceeds"):
        decode_message(msg, max_payload=99)


def test_seen_ids_bounded():
    seen = SeenIds(capacity=3)
    assert seen.first_time("a") and not seen.first_time("a")
    for x in "bcd":
        assert seen.first_time(x)
    assert seen.first_time("a")  # forgotten once capacity is exceeded
