"""The bytes between ``fedtier sim``'s main process and its cohort workers (``sim/executors.py``): a task goes to
its worker as the bytes it arrived in, a result comes back through the worker's shared-memory ring
(``sim/result_ring.py``), and the run stays the one without workers, bit for bit; no segment outlives the run,
a worker's death or the main process's."""

from __future__ import annotations

import multiprocessing.connection
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from protocols.wire.messenger import Messenger, Received
from protocols.wire.payload import Payload, encode_payload, payload_parts
from sim import result_ring
from sim.executors import WorkerError
from sim.launcher import SimHierarchy, run_simulation
from sim.result_ring import RingReader, RingWriter
from sim.worker_frames import batch_frame, batch_items, unframe
from tests.conftest import kill_worker_at_task, same_run, wait_until, while_workers_start

SECTIONS = dict(
    run={"rounds": 2},
    topology={"cells": 2, "devices_per_cell": 3},
    algorithm={"local_steps": 0, "local_epochs": 1.0, "batch_size": 32, "edge_rounds": 2},
)


def _segment(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name.lstrip('/')}")


def test_tasks_go_as_they_arrived_results_come_through_the_rings_and_the_run_is_the_one_without_workers(
    make_config, monkeypatch
):
    def refuse(payload: Payload) -> bytes:
        raise AssertionError("a received task was encoded again for its worker")

    sections = {**SECTIONS, "run": {"rounds": 1}}
    sim = SimHierarchy(make_config(runtime={"engine": "cohort", "sim_workers": 2}, **sections), write_output=False)
    names = [ring.name for ring in sim.executor.rings]
    assert len(names) == 2 and all(_segment(name) for name in names)
    inline = while_workers_start(
        sim, lambda: run_simulation(make_config(runtime={"engine": "cohort"}, **sections), write_output=False)
    )
    monkeypatch.setattr("sim.executors.encode_payload", refuse)  # the main process's; the workers are spawned
    taken: list[int] = []
    take = RingReader.take
    monkeypatch.setattr(RingReader, "take", lambda self, at, n, room=0: taken.append(n) or take(self, at, n, room))
    in_place: list[bool] = []  # each result's message: its ring record (framed in place, protocols.wire.payload)
    frame_once = Messenger.frame_once
    monkeypatch.setattr(
        Messenger, "frame_once", lambda *a, **k: in_place.append(isinstance(m := frame_once(*a, **k), memoryview)) or m
    )
    parallel = sim.run()
    same_run(inline, parallel)
    assert sim.executor.largest_batch == 3  # 6 devices over 2 workers, a batch per edge round
    assert len(taken) == 6 * 2  # every result of 6 devices in 2 edge rounds, through a ring
    assert in_place == [True] * 6 * 2  # and framed there, not copied (the same bytes: the run is the same)
    assert not any(_segment(name) for name in names)  # unlinked when the run ended


def test_a_worker_killed_mid_round_ends_the_run_and_leaves_no_segment(make_config):
    sections = {**SECTIONS, "algorithm": {**SECTIONS["algorithm"], "edge_rounds": 1}}
    sim = SimHierarchy(make_config(runtime={"engine": "cohort", "sim_workers": 2}, **sections), write_output=False)
    names = [ring.name for ring in sim.executor.rings]
    kill_worker_at_task(sim, "c1-d0")
    with pytest.raises(WorkerError, match=r"\(round 2\.1\).*died with exit code -9"):
        sim.run()
    assert all(not p.is_alive() for p in sim.executor.procs)
    assert not any(_segment(name) for name in names)


def test_a_killed_main_process_leaves_no_segment():
    code = (
        "import threading, time\n"
        "from sim.result_ring import RingReader\n"
        "ring = RingReader(1 << 20, threading.Semaphore(0))\n"
        "print(ring.name, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        name = proc.stdout.readline().strip()
        assert name and _segment(name)
    finally:
        proc.kill()
        proc.wait()
    assert wait_until(lambda: not _segment(name), timeout=10)  # the resource tracker unlinks it


def _parts(n: int, fill: int) -> list:
    return payload_parts(Payload({"n": n}, {"w": np.full(n, fill, np.uint8)}))


def test_a_ring_carries_records_in_order_wraps_and_bounds_what_it_takes(monkeypatch):
    freed = threading.Semaphore(0)
    reader = RingReader(1 << 20, freed)
    writer = RingWriter(reader.name, reader.size, freed)
    try:
        sizes = [300_000, 500_000, 400_000, 200_000, 700_000, 1_000, 600_000]  # wraps several times
        for i, n in enumerate(sizes):
            at, length = writer.put(_parts(n, i))
            assert bytes(reader.take(at, length)) == b"".join(_parts(n, i))  # type: ignore[arg-type]
        assert writer.put(_parts(2 << 20, 0)) is None  # larger than the ring: the pipe's
        monkeypatch.setattr(result_ring, "WAIT_S", 0.05)
        assert writer.put(_parts(600_000, 1)) is not None
        assert writer.put(_parts(600_000, 2)) is None  # no room given back in time: the pipe's
        for at, n in [(-1, 10), (0, (1 << 20) + 1), ((1 << 20) - 5, 10), ("0", 10), (0, 1.5)]:
            with pytest.raises(ValueError, match="not within"):
                reader.take(at, n)
        assert writer.put(_parts(600_000, 3)) is not None  # each refused record still gave its room back
    finally:
        writer.close()
        reader.close()
    assert not _segment(reader.name)


def test_no_ring_where_shared_memory_is_short(tmp_path):
    assert result_ring.ring_bytes(2) == result_ring.RING_BYTES  # this machine's /dev/shm has room
    assert result_ring.ring_bytes(2, str(tmp_path / "missing")) == result_ring.RING_BYTES
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    assert result_ring.ring_bytes(free // result_ring.MIN_RING_BYTES) == 0  # too many workers for its room


def test_a_ring_holds_a_workers_results_of_an_edge_round_within_its_bounds():
    """Twice a worker's results of an edge round (at most half a ring is lent), between RING_BYTES and
    MAX_RING_BYTES; the large workload's 250 results of 800 KB a worker: ~380 MiB, so that none is copied out."""
    ring = result_ring.ring_bytes
    assert ring(4, results=0) == ring(4, results=result_ring.RING_BYTES // 4) == result_ring.RING_BYTES
    big = 250 * (796_840 + 1024)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    st = os.statvfs("/dev/shm")
    assert ring(4, results=big) == min(2 * big, memory // 32, st.f_bavail * st.f_frsize // 8)
    assert ring(1, results=10 * result_ring.MAX_RING_BYTES) <= result_ring.MAX_RING_BYTES
    assert ring(2, "/nonexistent-shm", results=big) == min(2 * big, memory // 16)  # no tmpfs: memory bounds it


def test_a_batch_sends_the_same_payload_of_different_messages_once():
    model = encode_payload(Payload({"round": 1}, {"w": np.arange(300, dtype=np.float32)}))
    other = encode_payload(Payload({"round": 1}, {"w": np.arange(1, 301, dtype=np.float32)}))
    assert len(model) == len(other)
    # three messages (headers of different lengths) carrying two distinct payloads, and one task encoded here
    tasks = [Received(b"head-1" + model, 6), Received(b"header-22" + other, 9), Received(b"h" + model, 1), model]
    data = batch_frame([(i, {"device": f"d{i}"}, t) for i, t in enumerate(tasks)])
    assert len(data) < 2 * len(model) + 300  # two payloads travel, not four
    header, body = unframe(data)
    assert [item.get("same") for item in header["batch"]] == [None, None, 0, 0]
    assert [bytes(task) for _, task in batch_items(header, body)] == [model, other, model, model]


@pytest.mark.parametrize("cut", [0, 1])
def test_received_payloads_compare_their_bytes_only(cut):
    a, b = Received(b"xx" + b"payload", 2), Received(b"y" + b"payload"[: 7 - cut] + b"?" * cut, 1)
    assert a.same(b) == (cut == 0) and b.same(a) == (cut == 0)
    assert not a.same(Received(b"xx" + b"payload!", 2))  # a longer one is not the same


def test_diverged_devices_in_workers_are_recorded_as_without_workers(make_config):
    """A worker sends a diverged device's result as its agent would (the same reason), having checked every
    float of the others finite; the run is the one without workers, records of the divergence included."""
    sections = {**SECTIONS, "run": {"rounds": 1}, "algorithm": {**SECTIONS["algorithm"], "lr": 1e30, "edge_rounds": 1}}
    sim = SimHierarchy(make_config(runtime={"engine": "cohort", "sim_workers": 2}, **sections), write_output=False)
    inline = while_workers_start(
        sim, lambda: run_simulation(make_config(runtime={"engine": "cohort"}, **sections), write_output=False)
    )
    parallel = sim.run()
    same_run(inline, parallel)
    diverged = [d for r in inline.cell_records for d in r.get("diverged", {})]
    assert len(diverged) == 6  # every device


def test_a_result_checked_by_its_worker_is_not_read_again_for_finiteness():
    from protocols.wire.payload import all_finite, decode_payload

    data = encode_payload(Payload({}, {"w": np.full(2048, 0.5, np.float32)}))
    poisoned = data.replace(np.float32(0.5).tobytes() * 2, np.float32(np.nan).tobytes() * 2, 1)  # a NaN it never reads
    assert not all_finite(decode_payload(poisoned, require_finite=False, views=True).tensors["w"])
    assert all_finite(decode_payload(poisoned, require_finite=False, views=True, checked=True).tensors["w"])
    with pytest.raises(Exception, match="non-finite"):  # the network's bytes are always read
        decode_payload(poisoned, views=True, checked=True)


def test_a_ring_without_room_in_shared_memory_is_refused_at_once_and_leaves_nothing(monkeypatch):
    import errno

    from sim.executors import ProcessExecutor

    made: list[str] = []
    create = result_ring.SharedMemory

    def shm(*args, **kwargs):
        made.append((segment := create(*args, **kwargs)).name)
        return segment

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(result_ring, "SharedMemory", shm)
    monkeypatch.setattr(result_ring.os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space"):
        RingReader(1 << 20, threading.Semaphore(0))
    assert made and not _segment(made[0])  # unlinked, not left behind
    assert ProcessExecutor._ring(1 << 20, multiprocessing.get_context("spawn")) is None  # results by pipe


def test_a_worker_logs_each_diverged_device_of_a_cohort_by_its_own_name(make_config, caplog):
    """Each result of a cohort is judged as its own device's: a diverged one is logged with its device and round
    (it named the last device the batch decoded for every one of them)."""
    from sim.device_worker import DeviceWorker

    sections = {**SECTIONS, "topology": {"cells": 1, "devices_per_cell": 3}}
    cfg = make_config(runtime={"engine": "cohort"}, **{**sections, "algorithm": {**SECTIONS["algorithm"], "lr": 1e30}})
    devices = ["c0-d0", "c0-d1", "c0-d2"]
    worker = DeviceWorker(cfg.to_toml(), devices)
    task = encode_payload(Payload({}, worker.algorithm.initial_params()))
    ctx = {"seed": 0, "round": 0, "edge_round": 0, "cell": "c0"}
    with caplog.at_level("WARNING", logger="fedtier.sim"):
        out = worker.train_many([({**ctx, "device": d}, task) for d in devices])
    assert all(parts and not error for parts, error in out)
    logged = sorted(r.getMessage().split()[1] for r in caplog.records if "diverged" in r.getMessage())
    assert logged == devices


def test_a_workers_kept_samples_stay_within_its_bound(make_config, monkeypatch):
    """A worker keeps its devices' samples up to ``LOCAL_DATA_BYTES``, all told: its data set's own LRU of copies
    (``DeviceData``, 99618e1) is that one bound, not a second one beside it. With room for 4 devices' samples (and
    2 in the data set's), devices p, q, r, x trained, p, q, r again, then w: 5 devices' samples were held (x
    dropped by the worker, still kept by the data set), over the bound."""
    import gc

    import sim.device_worker as W
    import sim.hierarchy as H
    from protocols.trainer import LocalData
    from sim.device_worker import DeviceWorker

    devices = [f"c0-d{i}" for i in range(5)]
    cfg = make_config(**{**SECTIONS, "topology": {"cells": 1, "devices_per_cell": 5}})
    probe = DeviceWorker(cfg.to_toml(), devices)
    ds = probe.data.ds
    row = ds.x_train[0].nbytes + ds.y_train[0].nbytes
    unit = max(len(probe.data.indices(d)) for d in devices) * row
    assert min(len(probe.data.indices(d)) for d in devices) * row * 5 > unit * 4  # any 4 fit, never 5
    monkeypatch.setattr(W, "LOCAL_DATA_BYTES", 4 * unit)
    monkeypatch.setattr(H, "KEPT_DATA_BYTES", 2 * unit)
    worker = DeviceWorker(cfg.to_toml(), devices)
    before = [o for o in gc.get_objects() if isinstance(o, LocalData)]  # (held: their ids are not reused)
    ctx = {"seed": 0, "round": 0, "edge_round": 0, "cell": "c0"}
    p, q, r, x, w = devices
    for d in (p, q, r, x, p, q, r, w):
        worker._device({**ctx, "device": d})
    gc.collect()
    held = [o for o in gc.get_objects() if isinstance(o, LocalData) and not any(o is b for b in before)]
    assert sum(o.x.nbytes + o.y.nbytes for o in held) <= 4 * unit, len(held)
    assert worker._device({**ctx, "device": r})[2] is worker._device({**ctx, "device": r})[2]  # kept: no copy
