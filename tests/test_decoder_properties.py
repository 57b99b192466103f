"""Property-based tests (hypothesis) of every decoder of untrusted bytes: the envelope, signed records,
the ``tensors/v1`` payload, the uplink codecs, chunk reassembly, status and telemetry records, the round
manifest, checkpoint files and config files.

Each decoder, given arbitrary or mutated genuine bytes, returns a value or raises its documented
rejection (``WireError``, ``Rejected``, ``ValueError``, ``ConfigError``), never any other exception, never allocates
more than its bound, and decodes what its encoder wrote to the same value. Examples are few and
small so the whole file runs in a few seconds.
"""

from __future__ import annotations

import json
import math
import struct
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols.algorithms.base import Rejected
from protocols.algorithms.codecs import FedMRNCodec, QSGDCodec, SignSGDCodec, TopKCodec
from protocols.algorithms.codecs.base import DenseCodec, pack_bits, pack_codes, unpack_bits, unpack_codes
from protocols.algorithms.fedavg import check_delta
from protocols.checkpoint import load_payload, save_payload
from protocols.config import ConfigError, load_config
from protocols.jsonl import loads
from protocols.records import parse_record
from protocols.session import decode_manifest, encode_manifest
from protocols.status import decode_status, encode_status
from protocols.wire import chunking
from protocols.wire.envelope import (
    MAGIC,
    MAX_HEADER_BYTES,
    Header,
    WireError,
    decode_message,
    encode_message,
    verify_signature,
)
from protocols.wire.keys import Trust, new_seed, public_of
from protocols.wire.payload import DTYPES, MAX_META_BYTES, Payload, decode_payload, encode_payload
from protocols.wire.signed import MAX_RECORD_BYTES, open_record, seal_record

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SEED = new_seed()
TRUST = Trust("c0-d0", SEED, {"c0-d0": public_of(SEED)})
TOPIC = "fedtier/fz/cell/c0/up/c0-d0/result"


# ------------------------------------------------------------------ mutations of genuine bytes
@st.composite
def mutated(draw: st.DrawFn, genuine: bytes) -> bytes:
    """``genuine`` after one to three edits: bit flips, byte sets, truncation, extension, a deleted or
    duplicated slice, or a little-endian length field rewritten with an extreme value."""
    data = bytearray(genuine)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "set", "truncate", "extend", "delete", "duplicate", "u32"]))
        n = len(data)
        if op == "flip" and n:
            i = draw(st.integers(0, n - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and n:
            data[draw(st.integers(0, n - 1))] = draw(st.integers(0, 255))
        elif op == "truncate":
            del data[draw(st.integers(0, n)) :]
        elif op == "extend":
            data += draw(st.binary(min_size=1, max_size=64))
        elif op == "delete" and n:
            i = draw(st.integers(0, n - 1))
            del data[i : i + draw(st.integers(1, 16))]
        elif op == "duplicate" and n:
            i = draw(st.integers(0, n - 1))
            data[i:i] = data[i : i + draw(st.integers(1, 16))]
        elif op == "u32" and n >= 4:
            i = draw(st.integers(0, n - 4))
            data[i : i + 4] = struct.pack("<I", draw(st.sampled_from([0, 1, 0x7FFFFFFF, 0xFFFFFFFF])))
    return bytes(data)


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**53), 2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
names = st.text(min_size=1, max_size=12)


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    raw = draw(st.binary(min_size=math.prod(shape) * dtype.itemsize, max_size=math.prod(shape) * dtype.itemsize))
    arr = np.frombuffer(raw, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
    if arr.dtype.kind == "f":
        arr = np.nan_to_num(arr, nan=0.0, posinf=1.0, neginf=-1.0)
    return arr


payloads = st.builds(
    Payload, st.dictionaries(st.text(max_size=8), json_values, max_size=4), st.dictionaries(names, arrays(), max_size=4)
)


def same_payload(a: Payload, b: Payload) -> bool:
    return (
        a.meta == b.meta
        and list(a.tensors) == list(b.tensors)
        and all(
            a.tensors[k].dtype == b.tensors[k].dtype
            and a.tensors[k].shape == b.tensors[k].shape
            and a.tensors[k].tobytes() == b.tensors[k].tobytes()
            for k in a.tensors
        )
    )


# ------------------------------------------------------------------ tensors/v1 payload
@FAST
@given(payloads)
def test_payload_round_trip(payload: Payload) -> None:
    assert same_payload(decode_payload(encode_payload(payload)), payload)


@FAST
@given(st.data())
def test_mutated_payload_is_a_payload_or_a_wire_error(data: st.DataObject) -> None:
    genuine = encode_payload(data.draw(payloads))
    blob = data.draw(mutated(genuine))
    try:
        out = decode_payload(blob)
    except WireError:
        return
    # accepted: a well-formed payload (its canonical encoding decodes to the same payload; the JSON
    # metadata need not be canonical, e.g. "\u001F" and "\u001f"), finite floats only
    again = decode_payload(encode_payload(out))
    assert again.meta == out.meta and list(again.tensors) == list(out.tensors)
    assert all(
        again.tensors[k].dtype == v.dtype and np.array_equal(again.tensors[k], v) for k, v in out.tensors.items()
    )
    assert all(np.isfinite(v).all() for v in out.tensors.values() if v.dtype.kind == "f")
    assert sum(v.nbytes for v in out.tensors.values()) <= len(blob)


@FAST
@given(st.binary(max_size=300))
def test_arbitrary_bytes_are_a_payload_or_a_wire_error(blob: bytes) -> None:
    try:
        decode_payload(blob)
    except WireError:
        pass


def test_payload_metadata_refuses_deep_nesting_and_overflowing_floats() -> None:
    for meta in (b"[" * 100_000 + b"]" * 100_000, b'{"loss":1e999}', b'{"loss":NaN}', b'{"a":-Infinity}'):
        with pytest.raises(WireError):
            decode_payload(struct.pack("<I", len(meta)) + meta + b"\0\0")
    big = b" " * (MAX_META_BYTES + 1)
    with pytest.raises(WireError, match="too large"):
        decode_payload(struct.pack("<I", len(big)) + big + b"\0\0")


def test_payload_with_a_huge_declared_shape_allocates_nothing() -> None:
    head = struct.pack("<I", 2) + b"{}" + struct.pack("<H", 1) + struct.pack("<H", 1) + b"w"
    blob = head + struct.pack("<BB", 1, 4) + struct.pack("<4I", *[0xFFFFFFFF] * 4) + b"\0" * 16
    with pytest.raises(WireError, match="truncated"):
        decode_payload(blob)


# ------------------------------------------------------------------ envelope
headers = st.fixed_dictionaries(
    dict(
        run=st.text(min_size=1, max_size=20),
        kind=st.sampled_from(["device_result", "cell_task", "chunk"]),
        round=st.integers(0, 2**31),
        edge_round=st.integers(0, 100),
        cell=st.none() | st.text(max_size=10),
        sender=st.text(min_size=1, max_size=20),
        msg_id=st.text(min_size=1, max_size=16),
        payload_len=st.just(0),
        session=st.none() | st.text(max_size=16),
    )
).map(lambda fields: Header(**fields))


@FAST
@given(headers, st.binary(max_size=200), st.booleans())
def test_envelope_round_trip(header: Header, payload: bytes, signed: bool) -> None:
    if signed:
        header = header.model_copy(update={"sender": TRUST.node})
    blob = encode_message(header, payload, TRUST.sign if signed else None, TOPIC)
    got, raw = decode_message(blob)
    assert bytes(raw) == payload
    assert got.model_copy(update={"sig": None}) == header.model_copy(update={"payload_len": len(payload)})
    if signed:
        verify_signature(got, raw, TOPIC, TRUST.verify)


@FAST
@given(st.data())
def test_mutated_envelope_is_rejected_or_verifies_as_the_original(data: st.DataObject) -> None:
    header = data.draw(headers).model_copy(update={"sender": "c0-d0"})
    payload = data.draw(st.binary(max_size=200))
    genuine = encode_message(header, payload, TRUST.sign, TOPIC)
    blob = data.draw(mutated(genuine))
    try:
        got, raw = decode_message(blob, max_payload=1024)
        verify_signature(got, raw, TOPIC, TRUST.verify)
    except WireError:
        return
    # a signed message that survives mutation says what the genuine one said (JSON whitespace aside)
    assert bytes(raw) == payload
    assert got == decode_message(genuine)[0]


@FAST
@given(st.binary(max_size=120).map(lambda b: MAGIC + b))
def test_arbitrary_bytes_after_the_magic_are_rejected_cleanly(blob: bytes) -> None:
    try:
        decode_message(blob)
    except WireError:
        pass


def test_envelope_refuses_deep_nesting_and_oversized_headers() -> None:
    deep = b"[" * (MAX_HEADER_BYTES - 10)
    with pytest.raises(WireError, match="invalid header"):
        decode_message(MAGIC + struct.pack("<I", len(deep)) + deep)
    with pytest.raises(WireError, match="bad header length"):
        decode_message(MAGIC + struct.pack("<I", MAX_HEADER_BYTES + 1) + b"{" * (MAX_HEADER_BYTES + 1))
    with pytest.raises(WireError, match="exceeds the limit"):
        decode_message(MAGIC + struct.pack("<I", 2) + b"{}" + b"\0" * 20_000, max_payload=100)


# ------------------------------------------------------------------ signed records and status
records = st.dictionaries(st.text(max_size=8).filter(lambda k: k != "sig"), json_values, max_size=5)


@FAST
@given(records, st.booleans())
def test_signed_record_round_trip(record: dict, signed: bool) -> None:
    topic = "fedtier/fz/status/device.c0-d0"
    blob = seal_record(record, topic, TRUST.sign if signed else None)
    assert open_record(blob, topic, "c0-d0", TRUST.verify if signed else None) == record


@FAST
@given(st.data())
def test_mutated_signed_record_is_rejected_or_unchanged(data: st.DataObject) -> None:
    topic = "fedtier/fz/status/device.c0-d0"
    record = data.draw(records)
    blob = data.draw(mutated(seal_record(record, topic, TRUST.sign)))
    try:
        got = open_record(blob, topic, "c0-d0", TRUST.verify)
    except WireError:
        return
    assert got == record


@FAST
@given(st.binary(max_size=200))
def test_arbitrary_record_bytes_are_rejected_cleanly(blob: bytes) -> None:
    try:
        open_record(blob, "t", None, None)
    except WireError:
        pass


def test_records_refuse_deep_nesting_and_oversize() -> None:
    with pytest.raises(WireError, match="not a JSON record"):
        open_record(b"[" * 60_000, "t", None, None)
    with pytest.raises(WireError, match="exceeds"):
        open_record(b" " * (MAX_RECORD_BYTES + 1), "t", None, None)


@FAST
@given(
    st.sampled_from(["online", "offline", "idle"]),
    st.dictionaries(st.sampled_from(["session", "round", "cell"]), json_scalars, max_size=3),
    st.data(),
)
def test_status_round_trip_and_mutations(state: str, extra: dict, data: st.DataObject) -> None:
    topic = "fedtier/fz/status/device.c0-d0"
    blob = encode_status(state, topic=topic, trust=TRUST, **extra)
    assert decode_status(blob, topic, TRUST) == {"state": state, **extra}
    got = decode_status(data.draw(mutated(blob)), topic, TRUST)  # never raises
    assert got is None or got == {"state": state, **extra}
    unsigned = decode_status(data.draw(mutated(encode_status(state, **extra))))
    assert unsigned is None or unsigned["state"] in ("online", "offline", "idle")


# ------------------------------------------------------------------ telemetry records
def _cell_record(round_: int, edge: int, loss: float | None) -> dict:
    rec = {
        "schema": 1,
        "event": "aggregation",
        "run": "fz",
        "round": round_,
        "edge_round": edge,
        "cell": "c0",
        "algorithm": "fedavg",
        "closed_by": "all answered",
        "duration_s": 0.5,
        "planned": ["c0-d0"],
        "answered": ["c0-d0"],
        "bytes_in": 10,
        "bytes_out": 20,
    }
    if loss is not None:
        rec["loss_mean"] = loss
    return rec


finite = st.floats(allow_nan=False, allow_infinity=False, width=32)


@FAST
@given(st.integers(0, 1000), st.integers(0, 10), st.none() | finite, st.data())
def test_telemetry_record_round_trip_and_mutations(
    round_: int, edge: int, loss: float | None, data: st.DataObject
) -> None:
    text = json.dumps(_cell_record(round_, edge, loss)).encode()
    rec = parse_record(text)
    assert parse_record(rec.to_json()) == rec
    blob = data.draw(mutated(text))
    try:
        got = parse_record(blob)
    except ValueError:
        return
    json.loads(got.to_json())  # whatever is accepted serialises back to strict JSON


@pytest.mark.parametrize(
    "bad",
    [
        b"[" * 50_000,
        b'{"schema":1,"event":"round","round":1,"closed_by":"x","duration_s":1,"accuracy":1e999}',
        b'{"schema":1,"event":"round","round":1,"closed_by":"x","duration_s":1,"top5":NaN}',
    ],
)
def test_telemetry_refuses_deep_nesting_and_non_finite_numbers(bad: bytes) -> None:
    with pytest.raises(ValueError):
        parse_record(bad)


def test_loads_turns_recursion_into_value_error() -> None:
    with pytest.raises(ValueError, match="nested too deeply"):
        loads("[" * 100_000)


# ------------------------------------------------------------------ uplink codecs
LIKE = OrderedDict(w=np.zeros((3, 5), np.float32), b=np.zeros(5, np.float32), v=np.zeros((2, 2), np.float32))
CODECS = [
    DenseCodec(),
    SignSGDCodec("stochastic"),
    SignSGDCodec("scaled"),
    TopKCodec(0.3),
    QSGDCodec(3),
    FedMRNCodec("uniform", 0.01),
    FedMRNCodec("gauss", 0.01, signed=True),
]
deltas = st.lists(finite, min_size=24, max_size=24).map(
    lambda xs: OrderedDict(
        w=np.array(xs[:15], np.float32).reshape(3, 5),
        b=np.array(xs[15:20], np.float32),
        v=np.array(xs[20:], np.float32).reshape(2, 2),
    )
)


def _decoded_ok(codec, payload: Payload) -> None:
    out = codec.decode(payload, LIKE)
    assert list(out) == list(LIKE)
    for k, v in out.items():
        assert v.shape == LIKE[k].shape and v.dtype == np.float32 and np.isfinite(v).all()


@FAST
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # FedMRN masks of huge deltas
@given(st.sampled_from(CODECS), deltas, st.integers(0, 2**63 - 1))
def test_codec_round_trip_through_the_wire(codec, delta, seed: int) -> None:
    payload = decode_payload(encode_payload(codec.encode(delta, seed)))
    codec.check(payload, LIKE, "result")
    _decoded_ok(codec, payload)
    if isinstance(codec, DenseCodec):
        assert all(np.array_equal(codec.decode(payload, LIKE)[k], delta[k]) for k in delta)
    assert len(encode_payload(payload)) - len(encode_payload(Payload(payload.meta))) == codec.data_bytes(
        LIKE
    ) + codec.framing_bytes(LIKE)


def test_qsgd_of_a_tensor_whose_norm_overflows_float32_stays_finite() -> None:
    big = np.finfo(np.float32).max
    delta = {k: np.full(v.shape, big, np.float32) for k, v in LIKE.items()}
    codec = QSGDCodec()
    payload = decode_payload(encode_payload(codec.encode(delta, 3)))
    codec.check(payload, LIKE, "result")
    _decoded_ok(codec, payload)


@FAST
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@given(st.sampled_from(CODECS), deltas, st.data())
def test_mutated_codec_payload_is_rejected_or_decodes_to_the_model_layout(codec, delta, data) -> None:
    blob = data.draw(mutated(encode_payload(codec.encode(delta, 7))))
    try:
        payload = decode_payload(blob)
        codec.check(payload, LIKE, "result")
    except (WireError, Rejected):
        return
    _decoded_ok(codec, payload)


codec_like_payloads = st.builds(
    Payload,
    st.fixed_dictionaries(
        {},
        optional={
            "codec": st.sampled_from([c.name for c in CODECS]),
            "seed": st.sampled_from(["00000000000000ff", "xyz", 5]),
        },
    ),
    st.dictionaries(
        st.sampled_from(["w", "b", "v", "bits", "scale", "idx", "val", "codes", "mask"]), arrays(), max_size=3
    ),
)


@FAST
@given(st.sampled_from(CODECS), payloads | codec_like_payloads)
def test_arbitrary_payload_is_rejected_or_decodes_to_the_model_layout(codec, payload: Payload) -> None:
    try:
        codec.check(payload, LIKE, "result")
    except Rejected:
        return
    _decoded_ok(codec, payload)


@FAST
@given(st.lists(st.integers(0, 1), max_size=70), st.integers(1, 12), st.data())
def test_bit_and_code_packing_round_trip(bits: list[int], width: int, data: st.DataObject) -> None:
    arr = np.array(bits, np.uint8)
    assert unpack_bits(pack_bits(arr), arr.size, "bits").tolist() == bits
    codes = np.array(data.draw(st.lists(st.integers(0, 2**width - 1), max_size=20)), np.uint32)
    assert unpack_codes(pack_codes(codes, width), codes.size, width, "codes").tolist() == codes.tolist()


# ------------------------------------------------------------------ chunks
@FAST
@given(st.binary(min_size=1, max_size=2000), st.integers(300, 700), st.booleans(), st.permutations(range(16)))
def test_chunks_reassemble_in_any_order(data: bytes, max_chunk: int, signed: bool, order: list[int]) -> None:
    auth = TRUST if signed else None
    parts = chunking.split(data, max_chunk, topic=TOPIC, auth=auth)
    r = chunking.Reassembler(auth=auth)
    ranked = sorted(range(len(parts)), key=lambda i: order[i % 16] * 1000 + i)
    out = [w for i in ranked if (w := r.feed(TOPIC, parts[i])) is not None]
    assert out == [data]
    assert r.reserved == 0 and r.pending == 0
    if len(parts) > 1:  # late duplicate chunks of a delivered message (whole messages: the envelope de-dups)
        assert all(r.feed(TOPIC, p) is None for p in parts)


@FAST
@given(st.binary(min_size=600, max_size=3000), st.booleans(), st.data())
def test_mutated_chunks_never_deliver_anything_else_and_stay_bounded(
    data: bytes, signed: bool, draw: st.DataObject
) -> None:
    auth = TRUST if signed else None
    parts = chunking.split(data, 256, topic=TOPIC, auth=auth)
    limit = 4096
    r = chunking.Reassembler(auth=auth, max_bytes=limit, max_message=limit)
    stream = list(parts)
    for _ in range(draw.draw(st.integers(1, 12))):
        stream.insert(draw.draw(st.integers(0, len(stream))), draw.draw(mutated(draw.draw(st.sampled_from(parts)))))
    delivered = []
    for blob in stream:
        out = r.feed(TOPIC, blob)
        assert r.reserved <= limit
        if out is not None:
            delivered.append(out)
    # nothing but the genuine message gets out of reassembly (a blob whose chunk magic was broken is
    # passed on as a plain message, for the envelope to reject)
    assert all(out == data or not chunking.is_chunk(out) for out in delivered)
    if signed:  # forged chunks are dropped one by one, so the genuine set completes exactly once
        assert sum(out == data for out in delivered) == 1


@FAST
@given(st.binary(max_size=200).map(lambda b: chunking.MAGIC + b))
def test_arbitrary_chunk_bytes_are_dropped_cleanly(blob: bytes) -> None:
    r = chunking.Reassembler(max_bytes=1 << 16)
    r.feed(TOPIC, blob)
    assert r.reserved <= 1 << 16


def test_dense_codec_refuses_a_delta_that_would_overflow_the_float32_model() -> None:
    wide = Payload({}, OrderedDict((k, np.full(v.shape, 1e300)) for k, v in LIKE.items()))
    with pytest.raises(Rejected, match="float32"):
        DenseCodec().check(wide, LIKE, "result")


@FAST
@given(json_values | st.sampled_from([10**400, -(10**400), True, 0, 1e308]))
def test_delta_weight_is_a_positive_finite_number_or_rejected(weight) -> None:
    payload = Payload({"weight": weight}, OrderedDict((k, np.ones_like(v)) for k, v in LIKE.items()))
    valid = type(weight) in (int, float) and 0 < weight and abs(weight) <= 1e308
    try:
        got = check_delta(payload, LIKE, "result")
    except Rejected:
        assert not valid
        return
    assert valid and got == float(weight)


# ------------------------------------------------------------------ config files
EXAMPLES = sorted(Path(__file__).resolve().parents[1].glob("examples/*.toml"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(EXAMPLES), st.data())
def test_mutated_config_is_a_config_error_or_a_config_that_round_trips(
    tmp_path: Path, example: Path, data: st.DataObject
) -> None:
    path = tmp_path / "run.toml"
    text = example.read_bytes()
    if data.draw(st.booleans()):  # a line replaced by a plausible but maybe invalid setting
        lines = text.split(b"\n")
        i = data.draw(st.integers(0, len(lines) - 1))
        lines[i] = data.draw(
            st.sampled_from(
                [
                    b'output = "runs/{x}"',
                    b'output = "a}"',
                    b"rounds = 0",
                    b"lr = nan",
                    b"hidden = []",
                    b"devices_per_cell = 0",
                    b"seed = -1",
                    b'name = ""',
                    b"batch_size = 1e400",
                    b"edge_rounds = 99999999999999999999",
                ]
            )
        )
        text = b"\n".join(lines)
    path.write_bytes(data.draw(mutated(text)))
    try:
        cfg = load_config(path)
    except ConfigError:
        return
    cfg.output_dir()
    path.write_text(cfg.to_toml())
    again = load_config(path)  # (to_toml writes the algorithm section with its defaults filled in)
    assert again.train == cfg.train
    assert again.model_copy(update={"algorithm": {}}) == cfg.model_copy(update={"algorithm": {}})


def test_config_that_is_not_utf8_or_substitutes_unknown_names_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_bytes(b'[run]\nname = "\xff"\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(path)
    path.write_text('[run]\noutput = "runs/{run}"\n')
    with pytest.raises(ConfigError, match="only {name}"):
        load_config(path)


# ------------------------------------------------------------------ round manifest and checkpoint files
@FAST
@given(st.text(min_size=1, max_size=64), st.integers(0, 2**40), st.data())
def test_round_manifest_round_trip_and_mutations(session: str, round_: int, data: st.DataObject) -> None:
    topic = "fedtier/fz/cloud/round"
    cloud = Trust("cloud", SEED, {"cloud": public_of(SEED)})
    blob = encode_manifest(session, round_, topic=topic, trust=cloud)
    assert decode_manifest(blob, topic, cloud) == {"session": session, "round": round_}
    got = decode_manifest(data.draw(mutated(blob)), topic, cloud)
    assert got is None or got == {"session": session, "round": round_}
    plain = decode_manifest(data.draw(mutated(encode_manifest(session, round_))))
    assert plain is None or (isinstance(plain["round"], int) and plain["round"] >= 0 and plain["session"])


@FAST
@given(payloads, st.data())
def test_checkpoint_file_round_trip_and_corruption(tmp_path_factory, payload: Payload, data: st.DataObject) -> None:
    path = tmp_path_factory.mktemp("ck") / "model.ftw"
    save_payload(path, payload)
    assert same_payload(load_payload(path), payload)
    path.write_bytes(data.draw(mutated(path.read_bytes())))
    try:
        load_payload(path)
    except ValueError:  # WireError, or not a checkpoint file at all
        pass


@FAST
@given(st.data())
def test_mutated_payload_viewed_is_the_copying_decoders_payload_or_its_wire_error(data: st.DataObject) -> None:
    """The runtimes decode views of a message's bytes (at any alignment): the same values, the same
    rejections, as the copying decoder, and every accepted view read-only and over the message itself."""
    blob = data.draw(mutated(encode_payload(data.draw(payloads))))
    try:
        copied = decode_payload(blob)
    except WireError as exc:
        with pytest.raises(WireError) as viewed:
            decode_payload(blob, views=True)
        assert viewed.value.kind == exc.kind
        return
    out = decode_payload(blob, views=True)
    assert same_payload(out, copied)
    for v in out.tensors.values():
        assert not v.flags.writeable and v.dtype.isnative
        assert v.size == 0 or np.shares_memory(v, np.frombuffer(blob, np.uint8))
    assert all(np.isfinite(v).all() for v in out.tensors.values() if v.dtype.kind == "f")


@pytest.mark.parametrize("views", [False, True])
@pytest.mark.parametrize("shape", [(0, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF,) * 7 + (0,)])
def test_an_empty_tensor_with_overflowing_dimensions_is_a_wire_error(shape: tuple[int, ...], views: bool) -> None:
    """No bytes, but dimensions whose product (the zero aside) overflows numpy's sizes: refused, not a ValueError."""
    head = struct.pack("<I", 2) + b"{}" + struct.pack("<H", 1) + struct.pack("<H", 1) + b"w"
    blob = head + struct.pack("<BB", 2, len(shape)) + struct.pack(f"<{len(shape)}I", *shape)
    with pytest.raises(WireError, match="too large"):
        decode_payload(blob, views=views)


def test_a_header_is_decoded_as_its_utf8_json_validated_by_the_header_model() -> None:
    """decode_message reads a header with pydantic's JSON parser (one pass): on 3,000 random edits of a real header
    it accepts what json.loads and the Header model's validation accept, the same header, and refuses the rest as
    an invalid header; a header in another encoding than UTF-8 (a BOM, UTF-16) is refused."""
    import random

    from pydantic import ValidationError

    from protocols.wire.envelope import Header

    def reference(raw: bytes) -> Header | None:
        try:
            return Header.model_validate(loads(raw))
        except (ValueError, ValidationError):
            return None

    def decoded(raw: bytes, payload_len: int = 3) -> Header | None:
        try:
            return decode_message(MAGIC + struct.pack("<I", len(raw)) + raw + b"\0" * payload_len)[0]
        except WireError as exc:
            assert "invalid header" in str(exc) or "header says" in str(exc), exc
            return None

    base = b'{"r":"t","k":"device_result","n":3,"e":1,"c":"c0","s":"c0-d1","i":"9f2c51d07a3e4b18","l":3,"z":"s"}'
    rnd = random.Random(5)
    alphabet = b'{}[]":,0123456789.eE+-truefalsn\\ \x00\xff\xc3\xa9rksicelgzv'
    accepted = 0
    for _ in range(3000):
        raw = bytearray(base)
        for _ in range(rnd.randint(1, 3)):
            at = rnd.randrange(len(raw))
            if rnd.random() < 0.4:
                del raw[at]
            else:
                raw.insert(at, rnd.choice(alphabet))
        expected = reference(bytes(raw))
        if expected is not None and expected.payload_len > 10**6:
            continue  # (a length past the payload bound: refused for that)
        got = decoded(bytes(raw), expected.payload_len if expected is not None else 3)
        assert got == expected, bytes(raw)
        accepted += got is not None
    assert accepted > 100
    for other in (b"\xef\xbb\xbf" + base, base.decode().encode("utf-16")):
        assert decoded(other) is None
