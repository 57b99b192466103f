"""Decoding without a copy (issue #33, the host side): a received message's tensors are read-only views of its
bytes, equal to what the copying decoder returns, checked the same way, and never views of a buffer that could
change (a ``bytearray``) or of a byte order that is not the host's."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from protocols.transport.memory import MemoryHub
from protocols.wire.envelope import WireError, decode_message
from protocols.wire.messenger import Messenger
from protocols.wire.payload import Payload, all_finite, decode_payload, encode_payload


def payload() -> Payload:
    rng = np.random.default_rng(3)
    return Payload(
        {"weight": 60},
        {
            "w": rng.normal(size=(200, 784)).astype(np.float32),
            "b": rng.normal(size=200).astype(np.float32),
            "i": np.arange(7, dtype=np.int64),
            "be": rng.normal(size=(3, 5)).astype(">f4"),  # sent little-endian: decoded as the host's floats
        },
    )


def test_views_equal_the_copying_decoder_and_share_the_message_bytes() -> None:
    data = encode_payload(payload())
    copied, viewed = decode_payload(data), decode_payload(data, views=True)
    assert list(viewed.tensors) == list(copied.tensors) and viewed.meta == copied.meta
    for k, v in viewed.tensors.items():
        assert v.dtype == copied.tensors[k].dtype and v.shape == copied.tensors[k].shape
        assert v.tobytes() == copied.tensors[k].tobytes()
        assert not v.flags.writeable  # a receiver cannot change a message
        assert np.shares_memory(v, np.frombuffer(data, np.uint8))
        with pytest.raises(ValueError, match="read-only"):
            v[...] = 0
    assert copied.tensors["w"].flags.writeable and not np.shares_memory(
        copied.tensors["w"], np.frombuffer(data, np.uint8)
    )


def test_viewing_decoder_allocates_nothing_of_the_tensors_size() -> None:
    data = encode_payload(Payload({}, {"x": np.ones(2 << 20, np.float32)}))  # 8 MiB
    decode_payload(data, views=True)  # warm up
    tracemalloc.start()
    try:
        back = decode_payload(data, views=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak
    assert back.tensors["x"].sum() == 2 << 20


def test_a_mutable_buffer_is_still_copied() -> None:
    """A view of a bytearray could change after its values were checked: such data is decoded into copies."""
    data = bytearray(encode_payload(payload()))
    back = decode_payload(memoryview(data), views=True)
    for v in back.tensors.values():
        assert v.flags.writeable and not np.shares_memory(v, np.frombuffer(data, np.uint8))
    before = back.tensors["w"].copy()
    data[:] = bytes(len(data))
    np.testing.assert_array_equal(back.tensors["w"], before)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_views_are_checked_like_copies(bad: float) -> None:
    x = np.linspace(-1, 1, 5000, dtype=np.float32)
    x[4321] = bad
    with pytest.raises(WireError, match="non-finite"):
        decode_payload(encode_payload(Payload({}, {"x": x})), views=True)
    with pytest.raises(WireError, match="truncated"):
        decode_payload(encode_payload(Payload({}, {"x": np.ones(9, np.float32)}))[:-1], views=True)


def test_messenger_hands_roles_read_only_views_of_the_frame() -> None:
    hub = MemoryHub()
    sender, receiver = Messenger(hub.connect("a"), "run", "c0-d1"), Messenger(hub.connect("b"), "run", "c0")
    sent = payload()
    data = sender.frame("device_result", sent, round=1, cell="c0", topic="t")
    msg = receiver.receive("t", data)
    assert msg is not None and msg.nbytes == len(data)
    header, raw = decode_message(data)
    for k, v in msg.payload.tensors.items():
        np.testing.assert_array_equal(v, sent.tensors[k])
        assert not v.flags.writeable
        assert v.dtype.isnative and np.shares_memory(v, np.frombuffer(data, np.uint8))
    assert header.payload_len == len(raw)


def test_checked_views_are_known_finite_and_nothing_else_is() -> None:
    """A view the decoder checked is answered without another pass (the cell's role checks results again);
    an unchecked view, a copy, or an array derived from a checked view is checked for real."""
    from protocols.params import check_like
    from protocols.rejections import Rejected
    from protocols.wire import payload as wire_payload

    x = np.linspace(-1, 1, 4000, dtype=np.float32)
    good = decode_payload(encode_payload(Payload({}, {"x": x})), views=True).tensors["x"]
    assert wire_payload._known_finite(good) and all_finite(good)
    assert not wire_payload._known_finite(good[1:]) and all_finite(good[1:])
    assert not wire_payload._known_finite(decode_payload(encode_payload(Payload({}, {"x": x}))).tensors["x"])
    x[17] = np.nan
    unchecked = decode_payload(encode_payload(Payload({}, {"x": x})), views=True, require_finite=False).tensors["x"]
    assert not wire_payload._known_finite(unchecked) and not all_finite(unchecked)
    with pytest.raises(Rejected, match="non-finite"):
        check_like({"x": unchecked}, {"x": x})
    check_like({"x": good}, {"x": x})


def test_a_received_results_update_norm_takes_the_decoders_sum_of_squares_with_the_same_bits() -> None:
    """The cell's update norm of each result it aggregates (``largest_updates``) reuses the sum of squares the
    decoder's finiteness check took of a checked view, instead of reading the result again: the same bits as
    summing it afresh; a copy, a slice or an unchecked view is summed for real."""
    from protocols.divergence import update_norm
    from protocols.wire.payload import known_squares

    rng = np.random.default_rng(5)
    sent = {"w": rng.normal(size=(200, 784)).astype(np.float32), "b": rng.normal(size=200).astype(np.float64)}
    got = decode_payload(encode_payload(Payload({}, sent)), views=True).tensors
    assert known_squares(got["w"]) == float(np.vdot(sent["w"], sent["w"]))
    assert update_norm(got) == update_norm({k: v.copy() for k, v in got.items()})
    assert known_squares(got["w"][1:]) is None and known_squares(got["w"].copy()) is None
    unchecked = decode_payload(encode_payload(Payload({}, sent)), views=True, require_finite=False).tensors
    assert known_squares(unchecked["w"]) is None and update_norm(unchecked) == update_norm(got)


def test_known_finite_entries_leave_with_their_arrays() -> None:
    import gc

    from protocols.wire import payload as wire_payload

    data = encode_payload(Payload({}, {"a": np.ones(1024, np.float32), "b": np.zeros(600, np.float64)}))
    tiny = encode_payload(Payload({}, {"c": np.ones(10, np.float32)}))  # checked again rather than remembered
    kept = [decode_payload(data, views=True) for _ in range(200)]
    small = decode_payload(tiny, views=True).tensors["c"]
    ids = {id(a) for p in kept for a in p.tensors.values()}
    assert len(ids) == 400 and ids <= set(wire_payload._FINITE) and id(small) not in wire_payload._FINITE
    del kept
    gc.collect()
    assert not ids & set(wire_payload._FINITE)


def test_immutable_is_true_only_for_views_of_bytes() -> None:
    from protocols.wire.payload import immutable

    data = encode_payload(Payload({}, {"w": np.ones((4, 5), np.float32)}))
    view = decode_payload(data, views=True).tensors["w"]
    assert immutable(view) and immutable(view.reshape(-1)) and immutable(view[1:, ::2])
    assert not immutable(decode_payload(data).tensors["w"])  # a copy: writable
    owned = np.ones(5, np.float32)
    frozen = owned.view()
    frozen.flags.writeable = False  # read-only, but its owner can still change it
    assert not immutable(owned) and not immutable(frozen)
    assert not immutable(decode_payload(bytearray(data), views=True).tensors["w"])


def test_cohort_trainer_keeps_an_immutable_task_and_copies_anything_else() -> None:
    """set_params is a snapshot: a received task's views cannot change, so they are kept as they are; a
    writable array is copied (changing it afterwards does not reach the trainer)."""
    from protocols.cohort_device import CohortDeviceTrainer

    task = decode_payload(encode_payload(Payload({}, {"w": np.ones((4, 5), np.float32)})), views=True).tensors
    trainer = CohortDeviceTrainer(None, lambda req: None)  # type: ignore[arg-type]  # no compute is asked
    trainer.set_params(task)
    assert trainer.params["w"] is task["w"]
    mine = {"w": np.ones((4, 5), np.float32)}
    trainer.set_params(mine)
    mine["w"][0, 0] = 7.0
    assert trainer.params["w"][0, 0] == 1.0 and trainer.get_params()["w"][0, 0] == 1.0
    trainer.set_params({"w": np.ones((4, 5), np.float64)})  # converted to float32: a copy
    assert trainer.params["w"].dtype == np.float32


def test_a_payload_framed_once_is_not_kept_alive_by_its_messenger() -> None:
    """A device's result is framed once (``frame_once``): its messenger keeps neither it nor views of its arrays for
    a next message (1,000 devices kept their last results alive, 800 MB); a payload framed for many receivers
    is kept and encoded once."""
    import gc
    import weakref

    messenger = Messenger(MemoryHub().connect("d"), "r", "d")
    sent, kept = payload(), payload()
    first = messenger.frame("device_result", kept, round=0)
    assert messenger.frame("device_result", kept, round=0)[-1000:] == first[-1000:]  # the same encoding again
    gone, alive = weakref.ref(sent), weakref.ref(kept)
    messenger.frame_once("device_result", sent, round=0)
    del sent, kept
    gc.collect()
    assert gone() is None and alive() is None  # the once-framed one went; it also replaced the kept one
    kept = payload()
    messenger.frame("device_result", kept, round=0)
    alive = weakref.ref(kept)
    del kept
    gc.collect()
    assert alive() is not None  # kept for its next receiver


def test_a_table_decoded_before_is_compared_not_parsed_and_any_other_bytes_are_parsed(monkeypatch) -> None:
    """A payload whose tensor table has the descriptor bytes of one decoded before (a model's next task or result)
    reuses its parse; a table of the same length with other names, shapes or dtypes, or a defect, is parsed as it
    is: each decoding equals the copying decoder's, and a defect is refused as before."""
    from protocols.wire import payload as wire_payload

    first = payload()
    decode_payload(encode_payload(first), views=True)  # parsed, kept
    again = Payload({"weight": 61, "loss": 0.5}, {k: np.asarray(v) + 1 for k, v in first.tensors.items()})

    def not_parsed(*_args: object) -> None:
        raise AssertionError("parsed again")

    with monkeypatch.context() as patched:
        patched.setattr(wire_payload, "_parse_table", not_parsed)
        got = decode_payload(encode_payload(again), views=True)
    expected = decode_payload(encode_payload(again), views=False)
    assert list(got.tensors) == list(expected.tensors) and got.meta == expected.meta
    assert all(
        got.tensors[k].tobytes() == v.tobytes() and got.tensors[k].shape == v.shape for k, v in expected.tensors.items()
    )
    # the same length after the metadata, other descriptors: parsed as they are
    swapped = {"b": first.tensors["w"], "w": first.tensors["b"], "i": first.tensors["i"], "be": first.tensors["be"]}
    reshaped = {**first.tensors, "w": np.asarray(first.tensors["w"]).reshape(784, 200)}
    retyped = {**first.tensors, "i": np.arange(7, dtype=np.int64).view(np.float64)}
    for tensors in (swapped, reshaped, retyped):
        got = decode_payload(encode_payload(Payload({"weight": 60}, tensors)), views=True)
        assert [(k, v.shape, v.dtype) for k, v in got.tensors.items()] == [
            (k, np.shape(v), np.dtype(v.dtype).newbyteorder("=")) for k, v in tensors.items()
        ]
    data = bytearray(encode_payload(first))
    data[data.index(b"\x01\x00w") + 3] = 99  # the first tensor's dtype code, in a table of a known length
    with pytest.raises(WireError, match="unknown dtype code 99"):
        decode_payload(bytes(data), views=True)


def test_the_tables_kept_are_bounded_whatever_a_peer_sends() -> None:
    """Tables kept for the next decoding are bounded in number and size: a peer's payloads of ever new tables, or
    of one table with huge names, keep at most 64 tables of at most 16 KiB of descriptors (each decoded right)."""
    from protocols.wire import payload as wire_payload

    for i in range(200):  # a new table each time: one more tensor's name
        got = decode_payload(encode_payload(Payload({}, {f"t{i}": np.ones(i % 7 + 1, np.float32)})), views=True)
        assert list(got.tensors) == [f"t{i}"] and got.tensors[f"t{i}"].shape == (i % 7 + 1,)
        assert len(wire_payload._TABLES) <= 64
    huge = Payload({}, {"x" * 60_000: np.ones(1, np.float32), "y" * 60_000: np.ones(2, np.float32)})
    wire_payload._TABLES.clear()
    assert list(decode_payload(encode_payload(huge), views=True).tensors) == list(huge.tensors)
    assert not wire_payload._TABLES  # parsed, not kept
