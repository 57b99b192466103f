"""A sim worker's result is framed in place (``protocols.wire.payload.Headroom``): the worker leaves room before it
in its ring record, the main process writes the envelope there, and the message is the lent record itself, the
payload not copied. The bytes are :meth:`Messenger.frame`'s, signed or not; a message kept past the ring's reuse
reads as it was; a header that does not fit, a changed payload or a second framing is framed by copying instead,
never written over anything."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from protocols.transport.memory import MemoryHub
from protocols.wire import messenger as messenger_module
from protocols.wire.envelope import ENVELOPE_ROOM, Header, envelope_head
from protocols.wire.keys import Trust, new_seed, public_of
from protocols.wire.messenger import Messenger
from protocols.wire.payload import Lent, Payload, decode_payload, parts_size, payload_parts
from sim import result_ring
from sim.launcher import SimHierarchy, run_simulation
from sim.result_ring import RingReader, RingWriter
from tests.conftest import same_run, while_workers_start
from tests.test_sim_workers_wire import SECTIONS

TOPIC = "fedtier/t/cell/c0/up/c0-d0/result"


def _payload(fill: int, n: int = 50_000) -> Payload:
    """Every tensor shape the codec carries: float32, int64, a scalar, an empty one."""
    return Payload(
        {"fill": fill, "name": "é", "loss": 0.25},
        {
            "w": np.full(n, fill, np.float32),
            "steps": np.arange(3, dtype=np.int64),
            "s": np.float64(fill),
            "none": np.zeros((0, 4), np.float32),
        },
    )


def _lent(reader: RingReader, writer: RingWriter, payload: Payload, room: int = ENVELOPE_ROOM) -> tuple[Payload, int]:
    """``payload`` as the main process has a worker's result: decoded as views of its lent ring record; and where
    in the ring's segment its bytes start."""
    where = writer.put(payload_parts(payload), room)
    assert where is not None
    body = reader.take(*where, room)
    return decode_payload(body, require_finite=False, views=True, checked=True), result_ring._CONTROL + where[0]


def _messenger(trust: Trust | None = None) -> Messenger:
    return Messenger(MemoryHub().connect("c0-d0"), "t", "c0-d0", trust=trust)


def _fixed_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = iter(f"{i:016x}" for i in range(10**6))
    monkeypatch.setattr(messenger_module, "new_msg_id", lambda: next(ids))


def _ring_address(reader: RingReader, view: memoryview) -> int:
    """Where ``view`` lies in the ring's segment (``-1``: elsewhere, a copy)."""
    start = np.frombuffer(reader.shm.buf, np.uint8).ctypes.data
    at = np.frombuffer(view, np.uint8).ctypes.data - start
    return at if 0 <= at < reader.shm.size else -1


def _frame_once(m: Messenger, payload: Payload) -> bytes | memoryview:
    return m.frame_once("device_result", payload, round=2, edge_round=1, cell="c0", topic=TOPIC)


def _frame(m: Messenger, payload: Payload) -> bytes:
    return m.frame("device_result", payload, round=2, edge_round=1, cell="c0", topic=TOPIC)


def _in_place(message: bytes | memoryview) -> bool:
    return isinstance(message, memoryview) and isinstance(message.obj, Lent) and message.readonly


@pytest.mark.parametrize("signed", [False, True])
def test_a_result_framed_in_place_is_the_message_frame_would_copy_byte_for_byte(ring, monkeypatch, signed):
    reader, writer = ring
    seed = new_seed()
    trust = Trust("c0-d0", seed, {"c0-d0": public_of(seed)}) if signed else None
    framing, copying = _messenger(trust), _messenger(trust)
    framing.session = copying.session = "s1"
    result, at = _lent(reader, writer, _payload(3))
    assert result.headroom is not None
    _fixed_ids(monkeypatch)
    message = _frame_once(framing, result)
    _fixed_ids(monkeypatch)  # the same message id again
    expected = _frame(copying, _payload(3))
    assert _in_place(message)
    assert bytes(message) == expected  # header, payload, lengths: the same bytes
    head = len(expected) - parts_size(payload_parts(_payload(3)))
    assert _ring_address(reader, message) == at - head  # the header right before the payload: nothing copied
    got = copying.receive(TOPIC, message)  # a cell reads it as it reads bytes (the signature checked where signed)
    assert got is not None and got.nbytes == len(expected)
    assert got.payload.meta == _payload(3).meta
    assert all(got.payload.tensors[k].tobytes() == np.asarray(v).tobytes() for k, v in _payload(3).tensors.items())


@pytest.mark.parametrize("checked", [True, False])
def test_a_cell_reads_a_result_framed_in_place_again_only_where_its_floats_were_not_checked(ring, checked):
    """The message framed in place of a result decoded as checked (its worker checked every float finite) is
    decoded by its cell without reading the floats again: a NaN the worker let through (here: a record written
    without its check) goes unread, as its agent's own check let it. A result decoded unchecked and the same
    message's bytes copied are read: the NaN is refused."""
    reader, writer = ring
    poisoned = Payload({"loss": 0.25}, {"w": np.full(50_000, np.nan, np.float32), "b": np.ones(3, np.float32)})
    where = writer.put(payload_parts(poisoned), ENVELOPE_ROOM)
    assert where is not None
    result = decode_payload(reader.take(*where, ENVELOPE_ROOM), require_finite=False, views=True, checked=checked)
    message = _frame_once(_messenger(), result)
    assert _in_place(message)
    cell = _messenger()
    got = cell.receive(TOPIC, message)
    assert (got is not None) == checked
    if got is not None:
        assert np.isnan(got.payload.tensors["w"]).all()  # its bytes, as they are (decoded, not read for the check)
    assert cell.receive(TOPIC, bytes(message)) is None  # the same bytes copied: read, refused
    del result, message, got


def test_a_lent_result_and_its_message_framed_in_place_cannot_be_made_writable(ring, monkeypatch):
    """A lent record's views are as immutable as a message's bytes: numpy refuses to make them writable (it let any
    holder flip ``writeable`` back on, the ring's segment being writable in the main process, and so change a
    result a cell still held, or write into the ring), also for a result copied out of a full ring."""
    reader, writer = ring
    for lend_share in (result_ring.LEND_SHARE, 0.0):  # lent, then copied out (nothing lent at once)
        monkeypatch.setattr(result_ring, "LEND_SHARE", lend_share)
        result, _ = _lent(reader, writer, _payload(7))
        message = _frame_once(_messenger(), result)
        assert _in_place(message)
        w = result.tensors["w"]
        for arr in (w, w[1:], w.view(np.uint8), np.frombuffer(message, np.uint8)):
            with pytest.raises(ValueError):
                arr.flags.writeable = True
        assert w.tobytes() == np.full(50_000, 7, np.float32).tobytes()
        del result, message, w, arr


def test_a_message_kept_past_the_rings_reuse_reads_as_it_was(ring):
    """Results framed in place and kept (a cell holds them until its edge round closes) pin their records, and
    the decoded payload of one whose message is dropped still pins its record; around them the ring is written
    over many times; every kept message and payload reads as it was, and each record is freed with the last
    thing read from it."""
    reader, writer = ring
    m, cell = _messenger(), _messenger()
    kept = []
    for i in range(10, 13):  # (fills of two digits: every record of the same size)
        message = _frame_once(m, _lent(reader, writer, _payload(i, 25_000))[0])
        assert _in_place(message)
        kept.append((message, bytes(message)))
    record = ENVELOPE_ROOM + parts_size(payload_parts(_payload(10, 25_000)))
    assert reader.lent == 3 * record  # pinned by the messages alone (their payloads are gone)
    got = cell.receive(TOPIC, kept[2][0])
    assert got is not None
    read = got.payload
    del kept[2], got  # its message dropped; its decoding (views of it) kept
    middle = writer.live[1]
    del kept[1]
    assert reader.lent == 2 * record
    places = []
    for i in range(13, 50):  # 37 x 100 KB through the 1 MiB ring's free room
        result, at = _lent(reader, writer, _payload(i, 25_000))
        places.append(at - ENVELOPE_ROOM - result_ring._CONTROL)
        message = _frame_once(m, result)
        got = cell.receive(TOPIC, message)
        assert _in_place(message) and got is not None and got.payload.meta["fill"] == i
        del result, message, got
    assert middle in places  # the dropped one's room was written again meanwhile
    assert bytes(kept[0][0]) == kept[0][1]  # reads as it was
    assert read.meta["fill"] == 12 and read.tensors["w"].tobytes() == np.full(25_000, 12, np.float32).tobytes()
    assert reader.lent == 2 * record
    del kept, read
    assert reader.lent == 0


@pytest.mark.parametrize("room, name", [(16, "t"), (ENVELOPE_ROOM, "€" * 128)])
def test_a_header_larger_than_the_room_is_framed_by_copying_and_the_room_is_not_written(ring, monkeypatch, room, name):
    """Room for 16 bytes, or the usual room and names of 128 three-byte characters (a header of ~1.2 KB)."""
    reader, writer = ring
    reader.room = room  # the room this ring's worker leaves
    result, at = _lent(reader, writer, _payload(5), room)
    before = bytes(reader.shm.buf[at - room : at])
    _fixed_ids(monkeypatch)
    message = Messenger(MemoryHub().connect(name), name, name).frame_once(
        "device_result", result, round=2, edge_round=1, cell=name, topic=TOPIC
    )
    _fixed_ids(monkeypatch)
    expected = Messenger(MemoryHub().connect(name), name, name).frame(
        "device_result", _payload(5), round=2, edge_round=1, cell=name, topic=TOPIC
    )
    assert type(message) is bytes and message == expected
    assert len(expected) - parts_size(payload_parts(_payload(5))) > room  # it did not fit
    assert bytes(reader.shm.buf[at - room : at]) == before


def test_a_changed_payload_or_a_second_framing_is_framed_by_copying(ring, monkeypatch):
    reader, writer = ring
    m = _messenger()
    for change in ("meta", "meta as other JSON", "tensor", "reshaped", "retyped", "renamed", "dropped", "added"):
        result = _lent(reader, writer, _payload(7))[0]
        changed = _payload(7)
        if change == "meta":
            result.meta["fill"] = changed.meta["fill"] = 8
        elif change == "meta as other JSON":  # equal as a dict (7 == 7.0), not as bytes
            result.meta["fill"] = changed.meta["fill"] = 7.0
        elif change == "reshaped":  # the same array object, its shape set in place
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                result.tensors["w"].shape = changed.tensors["w"].shape = (2, 25_000)
        elif change == "retyped":  # the same array object, its dtype set in place: other bytes on the wire
            result.tensors["w"].dtype = changed.tensors["w"].dtype = np.dtype("<i4")
        elif change == "renamed":
            result.tensors = {("v" if k == "w" else k): v for k, v in result.tensors.items()}
            changed.tensors = {("v" if k == "w" else k): v for k, v in changed.tensors.items()}
        elif change == "tensor":
            result.tensors["w"] = changed.tensors["w"] = np.full(50_000, 8, np.float32)  # same size, other memory
        elif change == "dropped":
            del result.tensors["none"], changed.tensors["none"]
        else:
            result.tensors["more"] = changed.tensors["more"] = np.ones(2, np.float32)
        _fixed_ids(monkeypatch)
        message = _frame_once(m, result)
        _fixed_ids(monkeypatch)
        assert type(message) is bytes and message == _frame(m, changed), change
    result = _lent(reader, writer, _payload(9))[0]
    first = _frame_once(m, result)
    copy = bytes(first)
    again = _frame_once(m, result)  # the room is written once: a second message is a copy
    assert _in_place(first) and type(again) is bytes
    size = parts_size(payload_parts(result))
    assert again[-size:] == copy[-size:] and len(again) == len(copy)  # the same payload, another message id
    assert bytes(first) == copy


def test_a_result_unchanged_since_its_decoding_is_framed_without_encoding_its_payload_again(ring, monkeypatch):
    """A result framed as it was decoded (its tensors the views decoded, its metadata the same JSON) is framed in
    place from its lent bytes as they are: no payload parts built, nothing read; the message is frame()'s bytes."""
    reader, writer = ring
    result, _ = _lent(reader, writer, _payload(4))
    _fixed_ids(monkeypatch)
    expected = _frame(_messenger(), _payload(4))

    def refuse(_payload: Payload) -> None:
        raise AssertionError("the payload was encoded again")

    monkeypatch.setattr(messenger_module, "payload_parts", refuse)
    _fixed_ids(monkeypatch)
    message = _frame_once(_messenger(), result)
    assert _in_place(message) and bytes(message) == expected


def test_the_room_fits_any_header_of_ascii_names():
    longest = Header(
        run="r" * 128,
        kind="secagg_consent",
        round=2**63,
        edge_round=2**63,
        cell="c" * 128,
        sender="s" * 128,
        msg_id="i" * 64,
        codec="x" * 32,
        payload_len=2**63,
        session="z" * 64,
        sig="g" * 128,
    )
    assert len(envelope_head(longest, b"\0" * 10**6)) <= ENVELOPE_ROOM  # (payload_len set to the payload's)
    assert 8 + len(longest.to_json()) <= ENVELOPE_ROOM


def test_a_record_whose_room_is_not_within_the_ring_is_refused_and_its_room_given_back(ring):
    reader, writer = ring
    for room in (-1, "16", 1.5, 16, ENVELOPE_ROOM + 1):  # only 0 or the ring's own room (an envelope there could
        # cover the record before it)
        where = writer.put(payload_parts(_payload(1)), 16)
        assert where is not None
        with pytest.raises(ValueError, match="not within"):
            reader.take(*where, room)
    where = writer.put(payload_parts(_payload(1)), 0)
    with pytest.raises(ValueError, match="not within"):
        reader.take(where[0], where[1], where[0] + 1)  # room before the ring's start
    assert writer.put(payload_parts(_payload(1, 200_000)), ENVELOPE_ROOM) is not None  # 800 KB: all room given back
    assert reader.lent == 0


def test_a_signed_run_frames_its_results_in_place_and_is_the_run_without_workers(make_config, tmp_path, monkeypatch):
    """Signed (each result signed by its device's agent, in the main process: the keys stay there), 2 workers:
    every result's message is its ring record, and the run is the one without workers: the same model, records and
    bytes a device (a signature over other bytes would be refused by the cells)."""
    from protocols.wire.keys import generate_keys, write_keys

    sections = {**SECTIONS, "run": {"rounds": 1}, "algorithm": {**SECTIONS["algorithm"], "edge_rounds": 1}}
    keys = tmp_path / "keys.toml"
    write_keys(keys, generate_keys(make_config(**sections).topology))
    sections["security"] = {"keys": str(keys)}
    sim = SimHierarchy(make_config(runtime={"engine": "cohort", "sim_workers": 2}, **sections), write_output=False)
    inline = while_workers_start(
        sim, lambda: run_simulation(make_config(runtime={"engine": "cohort"}, **sections), write_output=False)
    )
    framed: list[bool] = []
    frame_once = Messenger.frame_once

    def spy(self: Messenger, *args, **kwargs) -> bytes | memoryview:
        message = frame_once(self, *args, **kwargs)
        framed.append(self.signed and _in_place(message))
        return message

    monkeypatch.setattr(Messenger, "frame_once", spy)
    parallel = sim.run()
    same_run(inline, parallel)
    assert framed == [True] * 6  # 6 devices, 1 edge round
    assert all(r["answered"] for r in parallel.cell_records)


def test_a_result_copied_out_of_a_full_ring_is_framed_in_place_in_its_copy(ring, monkeypatch):
    """Beyond the half of the ring that may be lent, a record is copied out (its room freed at once for the
    worker) after room of its own: its message is framed there, so that a result costs one copy at most."""
    reader, writer = ring
    m = _messenger()
    pinned = [_frame_once(m, _lent(reader, writer, _payload(i, 40_000))[0]) for i in range(10, 13)]  # 480 KB lent
    result, at = _lent(reader, writer, _payload(13, 40_000))
    assert _ring_address(reader, memoryview(result.tensors["w"]).cast("B")) == -1  # copied out, not lent
    assert reader.lent == 3 * (ENVELOPE_ROOM + parts_size(payload_parts(result)))  # its record was freed at once
    with pytest.raises(ValueError, match="read-only"):
        result.tensors["w"][0] = 1
    _fixed_ids(monkeypatch)
    message = _frame_once(m, result)
    _fixed_ids(monkeypatch)
    assert _in_place(message) and bytes(message) == _frame(m, _payload(13, 40_000))
    assert np.shares_memory(np.frombuffer(message, np.uint8), result.tensors["w"])  # around the copy: no other
    assert all(_in_place(p) for p in pinned)
