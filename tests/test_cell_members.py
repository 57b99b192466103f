"""A cell's device list and online flags: what a sorted list and a dict did, in ~13 bytes a device."""

from __future__ import annotations

import tracemalloc

import pytest

from cell_server.members import DeviceList, OnlineFlags


def test_device_list_is_the_sorted_list_and_finds_its_devices():
    ids = ["c0-d10", "c0-d2", "c0-d1", "c0-d100", "cé-d3", "c0-d0"]
    devices = DeviceList(ids)
    assert list(devices) == sorted(ids) and devices[:2] == sorted(ids)[:2] and devices[-1] == sorted(ids)[-1]
    assert len(devices) == 6 and all(devices.index(d) == sorted(ids).index(d) for d in ids)
    for stranger in ("c0-d", "c0-d1000", "c0-d1\0", "", 3, None, "c0-d\udc80"):
        assert stranger not in devices and devices.position(stranger) is None
    allowed = {"c0-d2", "c1-d2", "c0-d1\0", "cé-d3", 7, "c0-d0"}
    assert devices.among(allowed) == sorted(d for d in allowed if isinstance(d, str) and d in ids)
    assert devices.among([]) == [] and DeviceList([]).among(["c0-d0"]) == [] and list(DeviceList([])) == []
    with pytest.raises(ValueError, match="unique"):
        DeviceList(["a", "b", "a"])
    with pytest.raises(ValueError, match="NUL"):
        DeviceList(["a", "b\0"])


def test_both_compact_id_sequences_index_as_a_list_does():
    """A cell's DeviceList and a topology's DeviceIds (one ``index`` on their ``position``): ``index`` with a
    window answers as ``list.index`` does, and an id outside the window or the sequence is a ValueError."""
    from protocols.config import DeviceIds

    for seq, lacks in (
        (DeviceList(["c0-d2", "c0-d0", "c0-d1"]), "is not a device of this cell"),
        (DeviceIds(range(1), 3), "is not in the device ids"),
    ):
        plain = list(seq)
        assert plain == ["c0-d0", "c0-d1", "c0-d2"] and "c0-d1" in seq and "c0-d3" not in seq
        assert [seq.index(d) for d in plain] == [0, 1, 2] and seq.index("c0-d2", 1, 3) == plain.index("c0-d2", 1, 3)
        for bad, window in (("c0-d3", ()), ("c0-d0", (1,)), ("c0-d2", (0, 2))):
            with pytest.raises(ValueError, match=lacks):
                seq.index(bad, *window)


def test_online_flags_behave_as_the_dict_they_replace():
    ids = [f"c0-d{j}" for j in range(12)]
    online = OnlineFlags(DeviceList(ids), False)
    as_dict = dict.fromkeys(sorted(ids), False)
    assert online == as_dict and online.count() == 0 and list(online) == list(as_dict)
    online["c0-d3"] = as_dict["c0-d3"] = True
    online["c0-d11"] = as_dict["c0-d11"] = True
    assert online == as_dict and online.count() == 2 == sum(online.values())
    assert online.get("c0-d3") is True and online.get("c9-d0", "?") == "?" and "c9-d0" not in online
    for d, up in online.items():  # setting while iterating is safe (a snapshot of the flags)
        online[d] = not up
    assert online.count() == 10 and not online["c0-d3"]
    with pytest.raises(KeyError):
        online["c9-d0"] = True  # the keys are the cell's devices: an unknown one is refused, not added
    with pytest.raises(TypeError):
        del online["c0-d0"]
    assert len(online) == 12


def test_a_large_cell_holds_no_string_or_entry_per_device():
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        devices = DeviceList(f"c0-d{j}" for j in range(100_000))
        online = OnlineFlags(devices, True)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert online.count() == 100_000 and "c0-d99999" in devices
    assert held < 20 * 100_000  # a list of the ids and a dict of flags: ~100 bytes a device
