"""A payload sent to many receivers (a cell's task to each device of an edge round) exists once: each message is its
own envelope and the shared, immutable payload bytes (``protocols.wire.envelope.Segments``), which the in-memory
transport carries unjoined and its receivers decode where they are. Joined, a message is ``Messenger.frame``'s bytes,
signed or not; the payload's sha256 is computed once for all the signatures over it and its floats checked once; no
receiver (a lying device among them) can change what the others read; a handler that did not ask for segments, a
retained message and MQTT get the joined bytes."""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

import numpy as np
import pytest

from protocols.algorithms.base import DeviceContext, DeviceRole, task_for
from protocols.algorithms.fedalign import FedAlignDevice
from protocols.algorithms.fedavg import FedAvgDevice
from protocols.transport.memory import MemoryHub
from protocols.wire import envelope
from protocols.wire import messenger as messenger_module
from protocols.wire import payload as payload_module
from protocols.wire.envelope import Segments, SharedPayload, decode_message
from protocols.wire.keys import Trust, new_seed, public_of
from protocols.wire.messenger import Incoming, Messenger
from protocols.wire.payload import Payload
from sim.launcher import SimHierarchy, run_simulation
from tests.conftest import small_config

pytestmark = pytest.mark.usefixtures("own_plugins")  # its plugin algorithms are not left registered

RUN, CELL = "t", "c0"
DEVICES = ["c0-d0", "c0-d1", "c0-d2"]


def _task(n: int = 20_000) -> Payload:
    return Payload({"from": 3, "name": "é"}, {"w": np.linspace(-1, 1, n, dtype=np.float32), "b": np.ones(7)})


def _topic(device: str) -> str:
    return f"fedtier/{RUN}/cell/{CELL}/down/{device}/task"


def _fixed_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = itertools.count()
    monkeypatch.setattr(messenger_module, "new_msg_id", lambda: f"{next(ids):016x}")


def _trusts() -> dict[str, Trust]:
    seeds = {node: new_seed() for node in [CELL, *DEVICES]}
    public = {node: public_of(seed) for node, seed in seeds.items()}
    return {node: Trust(node, seed, public) for node, seed in seeds.items()}


def _hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes fed to sha256 (anyone's: the signatures' own hashes of the small signed bytes too) from now on, a
    call at a time."""
    fed: list[int] = []
    real = hashlib.sha256

    class Counting:
        def __init__(self, data: Any = b"") -> None:
            self.h = real()
            self.update(data)

        def update(self, data: Any) -> None:
            fed.append(memoryview(data).nbytes)
            self.h.update(data)

        def digest(self) -> bytes:
            return self.h.digest()

    monkeypatch.setattr(envelope.hashlib, "sha256", Counting)
    return fed


@pytest.mark.parametrize("signed", [False, True])
def test_a_task_framed_as_segments_joins_to_the_bytes_frame_makes_and_is_hashed_once(monkeypatch, signed):
    """The first message of a task is framed joined; the next ones are their envelopes and its payload's bytes,
    shared: joined, each is the message ``frame`` makes. Signed, the payload is hashed once for the three signatures,
    and once more by the receiver of the joined message (the others check theirs over the same digest)."""
    trusts = _trusts() if signed else {}
    hub = MemoryHub()
    cell = Messenger(hub.connect(CELL), RUN, CELL, trust=trusts.get(CELL))
    cell.session = "s1" if signed else None
    task = _task()
    size = payload_module.payload_size(task)
    fed = _hashed(monkeypatch)
    _fixed_ids(monkeypatch)
    first = cell.frame("device_task", task, round=2, edge_round=1, cell=CELL, topic=_topic(DEVICES[0]))
    segs = [
        cell.frame_shared("device_task", task, round=2, edge_round=1, cell=CELL, topic=_topic(d)) for d in DEVICES[1:]
    ]
    assert all(s.body.data is first and bytes(s.body.view()) == first[-size:] for s in segs)  # its payload's bytes
    assert sum(fed) == (size if signed else 0)
    _fixed_ids(monkeypatch)
    joined = [cell.frame("device_task", task, round=2, edge_round=1, cell=CELL, topic=_topic(d)) for d in DEVICES]
    assert [first, *(bytes(s) for s in segs)] == joined and [len(s) for s in segs] == [len(j) for j in joined[1:]]
    fed.clear()
    for device, message in zip(DEVICES, [first, *segs], strict=True):  # each device checks its own message
        got = Messenger(hub.connect(device), RUN, device, trust=trusts.get(device)).receive(_topic(device), message)
        assert got is not None and got.nbytes == len(message) and got.header == decode_message(bytes(message))[0]
        np.testing.assert_array_equal(got.payload.tensors["w"], task.tensors["w"])
    assert [n for n in fed if n >= size] == ([size] if signed else [])  # the joined message's receiver's only
    if signed:  # a signature still binds its topic and its header: another device's message is refused
        thief = Messenger(hub.connect("c0-d2"), RUN, "c0-d2", trust=trusts["c0-d2"])
        assert thief.receive(_topic("c0-d2"), segs[0]) is None
        forged = Segments(segs[0].head.replace(b'"n":2', b'"n":3'), segs[0].body)
        victim = Messenger(hub.connect("c0-d1"), RUN, "c0-d1", trust=trusts["c0-d1"])
        assert victim.receive(_topic("c0-d1"), forged) is None


def _receivers(hub: MemoryHub) -> tuple[dict[str, list[Incoming]], list[bytes]]:
    """Three devices' agents' messengers on their task topics (taking segments), and a plain handler (bytes)."""
    got: dict[str, list[Incoming]] = {d: [] for d in DEVICES}
    raw: list[bytes] = []
    for d in DEVICES:
        m = Messenger(hub.connect(d), RUN, d)
        m.transport.subscribe(_topic(d), lambda t, data, m=m, d=d: got[d].append(m.receive(t, data)), segments=True)
    hub.connect("spy").subscribe(_topic("+"), lambda t, data: raw.append(data))
    return got, raw


def test_receivers_of_a_shared_task_read_one_buffer_that_none_of_them_can_change(monkeypatch):
    hub = MemoryHub()
    got, raw = _receivers(hub)
    cell = Messenger(hub.connect(CELL), RUN, CELL)
    checks: list[int] = []
    finite_squares = payload_module._finite_squares  # every read of an array for finiteness (decoding's too)
    monkeypatch.setattr(payload_module, "_finite_squares", lambda a: checks.append(a.size) or finite_squares(a))
    decodes: list[int] = []  # the shared payloads decoded (by their bytes' length)
    decode = messenger_module.decode_payload
    monkeypatch.setattr(messenger_module, "decode_payload", lambda d, **k: decodes.append(len(d)) or decode(d, **k))
    task = _task()
    sent = [cell.send(_topic(d), "device_task", task, round=1, cell=CELL) for d in DEVICES]
    hub.loop.run()
    first, second = got["c0-d0"][0], got["c0-d1"][0]
    shared = first.received.message  # the first message: the others' payload is its bytes
    assert all(g[0].received.message is shared and g[0].received.start == first.received.start for g in got.values())
    assert [g[0].nbytes for g in got.values()] == sent == [len(r) for r in raw]
    assert all(type(r) is bytes and decode_message(r)[1] == first.received.view() for r in raw)  # joined for a spy
    assert checks == [20_000, 7] * 2  # read by the joined message's receiver and the first of the shared bytes
    w = first.payload.tensors["w"]
    with pytest.raises(ValueError):
        w[0] = 5.0
    with pytest.raises(ValueError):
        w.setflags(write=True)
    with pytest.raises(ValueError):
        np.frombuffer(shared, np.uint8)[0] = 1
    with pytest.raises(TypeError):
        memoryview(shared)[0] = 1  # type: ignore[index]
    # the shared bytes' next receivers take their first receiver's decoding (views of the same bytes, not parsed
    # again), each with views, a metadata and a table of its own: what one changes there, the others do not see
    third = got["c0-d2"][0]
    assert third.payload.tensors["w"] is not second.payload.tensors["w"] and len(decodes) == 2  # the joined, the shared
    assert np.shares_memory(third.payload.tensors["w"], second.payload.tensors["w"])
    second.payload.tensors["w"].shape = (-1, 2)  # its own array object, reshaped in place
    assert third.payload.tensors["w"].shape == (20_000,)
    first.payload.tensors["w"] = np.zeros_like(w)  # its own decoding: the others' are not it
    second.payload.tensors["w"], second.payload.meta["from"] = np.zeros_like(w), 9
    np.testing.assert_array_equal(third.payload.tensors["w"], task.tensors["w"])
    assert third.payload.meta == task.meta
    with pytest.raises(TypeError):  # segments are immutable bytes, nothing writable lent in their place
        Segments(bytearray(b"FTW1"), SharedPayload(b""))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        SharedPayload(bytearray(shared))  # type: ignore[arg-type]


def test_a_task_sent_as_shared_reaches_every_device_as_segments_its_largest_tensor_aligned(monkeypatch):
    """``send(shared=True)`` (a cell's task to its devices): the first message too is its envelope and the shared
    bytes, decoded once for all its receivers; the bytes start where the largest tensor's values are 16-byte aligned
    (numpy reads unaligned float32 through a buffer), the same message bytes as ``frame``'s."""
    hub = MemoryHub()
    got, raw = _receivers(hub)
    cell = Messenger(hub.connect(CELL), RUN, CELL)
    decodes: list[int] = []
    decode = messenger_module.decode_payload
    monkeypatch.setattr(messenger_module, "decode_payload", lambda d, **k: decodes.append(len(d)) or decode(d, **k))
    task = Payload(
        {"from": 3, "name": "abc"}, {"b": np.ones(7, np.float32), "w": np.linspace(-1, 1, 20_001, dtype=np.float32)}
    )
    _fixed_ids(monkeypatch)
    sent = [cell.send(_topic(d), "device_task", task, round=1, cell=CELL, shared=True) for d in DEVICES]
    hub.loop.run()
    _fixed_ids(monkeypatch)
    framed = [cell.frame("device_task", task, round=1, cell=CELL, topic=_topic(d)) for d in DEVICES]
    assert raw == framed and sent == [len(f) for f in framed]  # the bytes, joined for a plain handler
    assert len(decodes) == 1  # the first receiver's decoding, for all three
    for device in DEVICES:
        w = got[device][0].payload.tensors["w"]
        assert w.flags.aligned and w.__array_interface__["data"][0] % 16 == 0
        np.testing.assert_array_equal(w, task.tensors["w"])


def test_a_shared_payload_that_is_not_finite_is_refused_by_every_receiver():
    hub = MemoryHub()
    got, _ = _receivers(hub)
    cell = Messenger(hub.connect(CELL), RUN, CELL)
    bad = _task()
    bad.tensors["w"][5] = np.nan
    for d in DEVICES:
        cell.send(_topic(d), "device_task", bad, round=1, cell=CELL)
    hub.loop.run()
    assert all(g == [None] for g in got.values())  # each one refused it: none took it as checked


class _Liar(DeviceRole):
    """A device that tries to change the task it received in place (every way numpy and Python offer) before it
    trains, then trains on its own copy: refused each time, it cannot change what the other devices train on."""

    refused: list[str] = []
    writes_task = False  # it says so (handed the shared views): they refuse it all the same

    def __init__(self, inner: DeviceRole) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def train(self, task: Payload, data: Any, trainer: Any, ctx: DeviceContext) -> Payload:
        own = {k: np.array(v) for k, v in task.tensors.items()}
        for name, arr in task.tensors.items():
            base = arr
            while isinstance(base, np.ndarray) and base.base is not None:
                base = base.base
            for how, attempt in {
                "assign": lambda arr=arr: arr.fill(1e6),
                "setflags": lambda arr=arr: arr.setflags(write=True),
                "frombuffer": lambda base=base: np.frombuffer(base, np.uint8).fill(0),
                "memoryview": lambda base=base: memoryview(base).__setitem__(0, 0),
            }.items():
                try:
                    attempt()
                except (ValueError, TypeError):
                    self.refused.append(f"{name}:{how}")
        for arr in task.tensors.values():  # its own views of the bytes: reshaped, retyped, only for itself
            arr.shape, arr.dtype = (-1,), np.uint8
        task.tensors.update({k: np.full_like(v, 1e6) for k, v in own.items()})  # its own decoding, not the others'
        return self.inner.train(Payload(dict(task.meta), own), data, trainer, ctx)


def test_a_lying_device_cannot_change_the_task_its_cells_other_devices_train_on(tmp_path, monkeypatch):
    sections: dict[str, Any] = {"run": {"rounds": 1}, "algorithm": {"edge_rounds": 1}}
    honest = run_simulation(small_config(tmp_path / "h", **sections), write_output=False)
    sim = SimHierarchy(small_config(tmp_path / "l", **sections), write_output=False)
    configure = sim.agents.configure
    _Liar.refused = []

    def lying(agent: Any) -> None:
        configure(agent)
        if agent.device == "c0-d0":
            agent.role = _Liar(agent.role)

    sim.agents.configure = lying
    buffers: dict[str, set[int]] = {}  # cell -> the payload buffers its devices' tasks were read from
    receive = Messenger.receive

    def spy(self: Messenger, topic: str, data: Any, **kw: Any) -> Incoming | None:
        got = receive(self, topic, data, **kw)
        if got is not None and got.header.kind == "device_task" and got.received is not None:
            buffers.setdefault(got.header.sender, set()).add(id(got.received.message))
        return got

    monkeypatch.setattr(Messenger, "receive", spy)
    lied = sim.run()
    assert sorted(buffers) == ["c0", "c1"] and all(len(b) == 1 for b in buffers.values())  # one buffer a cell round
    tensors = 2 * 2  # the MLP's two layers, weights and biases
    assert len(_Liar.refused) == 4 * tensors  # every attempt on every tensor
    assert set(lied.params) == set(honest.params)
    for k in honest.params:  # the other devices trained on the cell's model: the run is the honest one
        np.testing.assert_array_equal(lied.params[k], honest.params[k])


def test_a_plugin_writing_into_its_task_through_torch_cannot_change_what_its_cells_other_devices_read(tmp_path):
    """``torch.from_numpy`` of a task's read-only view only warns, and an in-place op then writes into the bytes the
    cell's devices share in sim. A plugin's device role (which declares no ``writes_task = False``) is handed a task
    of its own: one that writes into it runs as one that copied first, byte for byte; so does a plugin subclassing
    FedAvg's device role (``writes_task = False``) with a ``train`` of its own that writes (it declares for itself)."""
    runs = {}
    for name in ("fedavg_writes_task", "fedavg_subclass_writes_task", "fedavg_copies_task"):
        cfg = small_config(
            tmp_path / name,
            run={"rounds": 2, "plugins": ["tests.plugin_writes_task"]},
            algorithm={"name": name, "edge_rounds": 1},
        )
        runs[name] = run_simulation(cfg, write_output=False)
    wrote, copied = runs["fedavg_writes_task"], runs["fedavg_copies_task"]
    assert set(wrote.params) == set(copied.params) and wrote.history and copied.history
    for k in copied.params:
        np.testing.assert_array_equal(wrote.params[k], copied.params[k])
    assert [r["loss"] for r in wrote.history] == [r["loss"] for r in copied.history]
    sub = runs["fedavg_subclass_writes_task"]
    for k in copied.params:
        np.testing.assert_array_equal(sub.params[k], copied.params[k])


def test_a_device_role_declares_writes_task_for_the_train_it_runs():
    """``writes_task`` speaks of a ``train``: a subclass of a built-in role that runs a ``train`` of its own, or a
    mixin's, is handed a copy unless it declares ``False`` again; one that runs its base's inherits its declaration."""

    class Writes:
        def train(self, task: Payload, data: Any, trainer: Any, ctx: Any) -> Payload:
            return task

    class Own(FedAvgDevice):
        def train(self, task: Payload, data: Any, trainer: Any, ctx: Any) -> Payload:
            return task

    class Mixed(Writes, FedAvgDevice):
        pass

    class Declared(Own):
        writes_task = False

    class Keeps(FedAvgDevice):
        pass

    assert (Own.writes_task, Mixed.writes_task, Declared.writes_task, Keeps.writes_task) == (True, True, False, False)
    assert (FedAlignDevice.writes_task, FedAvgDevice.writes_task) == (False, False)
    task = Payload({}, {"w": np.frombuffer(np.ones(3, np.float32).tobytes(), np.float32)})  # read-only, as decoded
    mine = task_for(Mixed.__new__(Mixed), task)
    mine.tensors["w"] += 1  # its own copy, writable
    assert task.tensors["w"].tolist() == [1.0, 1.0, 1.0] and task_for(Keeps.__new__(Keeps), task) is task


def test_segments_that_do_not_make_a_message_are_refused_as_their_joined_bytes_would_be():
    cell = Messenger(MemoryHub().connect(CELL), RUN, CELL)
    task = _task(100)
    cell.frame("device_task", task, round=1, cell=CELL, topic=_topic("c0-d0"))
    good = cell.frame_shared("device_task", task, round=1, cell=CELL, topic=_topic("c0-d1"))
    longer = SharedPayload(good.body.data + b"\0")  # one byte more than the header says
    bad = {
        "bad magic": Segments(b"FTW2" + good.head[4:], good.body),
        "bad header length": Segments(good.head + b" ", good.body),
        "payload length": Segments(good.head, SharedPayload(good.body.data, good.body.start + 1)),
        "payload length ": Segments(good.head, longer),
    }
    for why, seg in bad.items():
        with pytest.raises(envelope.WireError):
            decode_message(seg)
        with pytest.raises(envelope.WireError):
            decode_message(bytes(seg))  # the same message joined: refused as well
        assert Messenger(MemoryHub().connect("c0-d1"), RUN, "c0-d1").receive(_topic("c0-d1"), seg) is None, why
    with pytest.raises(envelope.WireError, match="exceeds"):
        decode_message(good, max_payload=100)
    with pytest.raises(ValueError):
        SharedPayload(b"abc", 4)


def test_a_cell_shares_a_task_of_several_devices_or_a_large_one_and_sends_a_small_one_of_its_own_as_bytes(
    make_config,
):
    """A cell's task goes as a shared payload where sharing pays: planned for several devices (one decoding for
    all) or large (its values aligned for their reads). A device's own small task (DeComFL's history, a few hundred
    bytes) goes as plain bytes, the same message: before, each paid the shared path (~25 us a device: the bytes
    copied aligned, the decoding's metadata deep-copied for its one receiver)."""
    from cell_server.parts import SHARED_TASK_BYTES, EdgeRound

    edge = EdgeRound()
    common, own, large = _task(10), Payload({"from": 2}, {"g": np.zeros((2, 1, 10), np.float32)}), _task()
    assert large.tensors["w"].nbytes >= SHARED_TASK_BYTES > common.tensors["w"].nbytes
    edge.tasks = {"c0-d0": common, "c0-d1": common, "c0-d2": own, "c0-d3": large}
    assert [edge.shared(t) for t in edge.tasks.values()] == [True, True, False, True]
    edge.tasks = {"c0-d0": common}  # the next edge round's plan: looked at anew
    assert not edge.shared(common)

    cfg = make_config(
        run={"rounds": 2},
        algorithm={"name": "decomfl", "edge_rounds": 1, "local_steps": 1, "perturbations": 2, "lr": 0.02},
        runtime={"device_deadline": 5.0},
    )
    sim = SimHierarchy(cfg, write_output=False)
    kinds: list[type] = []
    spy = sim.hub.connect("spy")  # (taking segments: it sees how each message travels)
    spy.subscribe(f"fedtier/{cfg.run.name}/cell/+/down/+/task", lambda t, d: kinds.append(type(d)), segments=True)
    assert sim.run().history
    assert kinds and set(kinds) == {bytes}, kinds
