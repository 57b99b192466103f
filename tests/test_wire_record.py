"""A device's delta made where its message will be (``protocols.wire.wire_record.WireRecord``): the role subtracts into
the record's table, the agent seals it (read-only, each float checked once), the framing writes the envelope before the
table. The message is the bytes a copy would make, signed or not, without the copy; its cell reads no float again where
the device's check passed, and reads them (and refuses the message) where it did not; anything else is framed by
copying, as before."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from protocols import params as P
from protocols.divergence import nonfinite
from protocols.transport.memory import MemoryHub
from protocols.wire import messenger as messenger_module
from protocols.wire.keys import Trust, new_seed, public_of
from protocols.wire.messenger import Messenger
from protocols.wire.payload import Lent, Payload, known_squares
from protocols.wire.wire_record import WireRecord
from sim.launcher import SimHierarchy
from tests.conftest import same_run

TOPIC = "fedtier/t/cell/c0/up/c0-d0/result"
# names of every length mod 4 (the values' alignment in the table varies), a scalar and an empty tensor
SHAPES = {"fc1.weight": (200, 78), "b": (200,), "fc2.w": (7, 13), "odd_": (3,), "s": (), "none": (0, 4)}


def _params(seed: int) -> OrderedDict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return OrderedDict((k, rng.standard_normal(s).astype(np.float32)) for k, s in SHAPES.items())


def _messenger(monkeypatch: pytest.MonkeyPatch, signed: bool) -> Messenger:
    ids = iter(f"{i:016x}" for i in range(10**6))
    monkeypatch.setattr(messenger_module, "new_msg_id", lambda: next(ids))
    seed = new_seed()
    trust = Trust("c0-d0", seed, {"c0-d0": public_of(seed)}) if signed else None
    return Messenger(MemoryHub().connect("c0-d0"), "t", "c0-d0", trust=trust)


def _result(a: OrderedDict, b: OrderedDict) -> tuple[Payload, WireRecord]:
    """A dense FedAvg result as its role makes it: the delta where its message will be, then its metadata."""
    delta, record = P.sub_for_wire(a, b)
    assert record is not None and record.holds(delta)
    return Payload({"weight": 600, "loss": 0.25, "steps": 19}, delta, headroom=record), record


@pytest.mark.parametrize("signed", [False, True])
def test_a_delta_made_where_its_message_will_be_is_framed_there_the_bytes_a_copy_makes(monkeypatch, signed):
    a, b = _params(1), _params(2)
    result, record = _result(a, b)
    assert all(result.tensors[k].tobytes() == (a[k] - b[k]).tobytes() for k in a)  # sub's values, bit for bit
    record.seal(result)
    assert nonfinite(result) is None and record.checked
    with pytest.raises(ValueError):  # sealed: the delta cannot change before or after it leaves
        result.tensors["fc1.weight"][0, 0] = 1.0
    device = _messenger(monkeypatch, signed)
    message = device.frame_once("device_result", result, round=1, cell="c0", topic=TOPIC)
    copy = Payload(dict(result.meta), OrderedDict((k, v.copy()) for k, v in result.tensors.items()))
    monkeypatch.setattr(messenger_module, "new_msg_id", lambda: "0" * 16)  # the first message's id again
    expected = _messenger(monkeypatch, signed)
    expected.trust = device.trust
    assert isinstance(message, memoryview) and isinstance(message.obj, Lent) and message.readonly
    assert bytes(message) == expected.frame_once("device_result", copy, round=1, cell="c0", topic=TOPIC)
    for arr in (np.frombuffer(message, np.uint8), result.tensors["b"]):
        with pytest.raises(ValueError):  # numpy refuses to make the message or a sealed tensor writable again
            arr.flags.writeable = True
    cell = Messenger(MemoryHub().connect("c0"), "t", "c0", trust=device.trust)
    got = cell.receive(TOPIC, message)
    assert got is not None and got.payload.meta == result.meta
    for k, v in got.payload.tensors.items():  # views of the record itself (nothing copied), its sums the device's
        assert (v.size == 0 or np.shares_memory(v, record.arrays[k])) and v.tobytes() == result.tensors[k].tobytes()
        if v.nbytes >= 4096:
            assert known_squares(v) == float(np.vdot(v, v))
    again = device.frame_once("device_result", result, round=1, cell="c0", topic=TOPIC)  # a second framing: copied
    assert type(again) is bytes and len(again) == len(message) and again.endswith(message[-1000:])


def test_a_delta_its_device_found_not_finite_is_read_and_refused_by_its_cell(monkeypatch):
    """The device's check finds the NaN (its agent sends a "diverged" result instead); framed anyway, the message does
    not say its floats were checked, and the cell reads them and refuses it."""
    a, b = _params(1), _params(2)
    a["fc2.w"][3, 4] = np.nan
    result, record = _result(a, b)
    record.seal(result)
    assert not record.checked and nonfinite(result) == "tensor 'fc2.w' has 1 non-finite values"
    message = _messenger(monkeypatch, False).frame_once("device_result", result, round=1, cell="c0", topic=TOPIC)
    assert isinstance(message, memoryview) and not message.obj.checked
    assert Messenger(MemoryHub().connect("c0"), "t", "c0").receive(TOPIC, message) is None


def test_other_tensors_or_a_large_metadata_are_framed_by_copying(monkeypatch):
    """A codec that sends other tensors than the delta (or a role that changed one), a metadata larger than the room:
    framed by copying, the same bytes; the record is not written."""
    device = _messenger(monkeypatch, False)
    result, record = _result(_params(1), _params(2))
    result.tensors["b"] = result.tensors["b"] * 2
    assert not record.holds(result.tensors)
    framed = device.frame_once("device_result", result, round=1, cell="c0", topic=TOPIC)
    assert type(framed) is bytes
    result, record = _result(_params(1), _params(2))
    result.meta["note"] = "x" * 8000
    framed = device.frame_once("device_result", result, round=1, cell="c0", topic=TOPIC)
    assert type(framed) is bytes and record.arrays["b"].flags.writeable  # not framed there, not sealed


def test_a_cohort_runs_results_are_framed_in_place_and_the_run_is_the_run_with_copies(make_config, monkeypatch):
    """A cohort sim's results reach their cell as records framed in place, their floats checked by their devices;
    the run (model bits, records, traffic) is the run whose results are framed by copying."""
    cfg = make_config(run={"rounds": 2}, runtime={"engine": "cohort"})
    sim = SimHierarchy(cfg, write_output=False)
    results: list[object] = []
    sim.hub.tap = lambda topic, data, retain, sender: results.append(data) if topic.endswith("/result") else None
    in_place = sim.run()
    assert len(results) == 2 * 2 * 2 * 3  # rounds x edge rounds x cells x devices
    assert all(isinstance(m, memoryview) and isinstance(m.obj, Lent) and m.obj.checked for m in results)
    monkeypatch.setattr(P, "sub_for_wire", lambda a, b: (P.sub(a, b), None))
    copied = SimHierarchy(cfg, write_output=False).run()
    same_run(in_place, copied)


def test_a_cohort_devices_result_is_sealed_as_its_role_returns_it(make_config, monkeypatch):
    """In a cohort each device's result is sealed (read-only, its floats checked, their sums kept) as soon as its role
    returned it, while the delta it just wrote is in cache, not when its agent takes it after the cohort's other devices
    wrote theirs (the agent's own seal then has nothing left to do)."""
    from edge_agent.agent import DeviceAgent

    sealed: list[bool] = []
    trained = DeviceAgent._trained

    def taken(self, topic, h, result, error):  # what the agent gets, before its own seal
        record = result.headroom if result is not None else None
        sealed.append(
            record is not None and record.checked and not any(a.flags.writeable for a in record.arrays.values())
        )
        return trained(self, topic, h, result, error)

    monkeypatch.setattr(DeviceAgent, "_trained", taken)
    SimHierarchy(make_config(run={"rounds": 1}, runtime={"engine": "cohort"}), write_output=False).run()
    assert len(sealed) == 2 * 2 * 3 and all(sealed)  # edge rounds x cells x devices
