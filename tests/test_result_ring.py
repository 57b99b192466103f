"""A sim worker's result ring lends its records to the main process (``sim/result_ring.py``): a result is decoded
and framed straight from the ring, its record freed when nothing made from it is left, out of the order written;
at most half a ring is lent (the rest is copied out), so a slow worker or kept results never stall a writer; a
result kept past its free reads as it was, never as another device's bytes. A worker answers each cohort of its
batch once it is trained."""

from __future__ import annotations

import queue
import random
import threading
import time

import numpy as np
import pytest

from protocols.wire.payload import Lent, Payload, decode_payload, encode_payload, parts_size, payload_parts
from sim import result_ring
from sim.launcher import SimHierarchy, run_simulation
from sim.result_ring import RingReader, RingWriter
from tests.conftest import RESULT_RING_BYTES, same_run, while_workers_start
from tests.test_clock import CLOCK
from tests.test_sim_workers_wire import SECTIONS, _segment

RING = RESULT_RING_BYTES  # the ring fixture's (tests/conftest.py)


def _parts(n: int, fill: int) -> list:
    return payload_parts(Payload({"fill": fill}, {"w": np.full(n, fill % 251, np.uint8)}))


def _result(reader: RingReader, where: tuple[int, int] | None) -> Payload:
    assert where is not None
    return decode_payload(reader.take(*where), views=True)


def _reads_as_written(k: int, result: Payload, sizes: list[int]) -> bool:
    return result.meta["fill"] == k and result.tensors["w"].tobytes() == bytes([k % 251]) * sizes[k]


def _in_ring(reader: RingReader, arr: np.ndarray) -> bool:
    start = np.frombuffer(reader.shm.buf, np.uint8).ctypes.data
    return start <= arr.ctypes.data < start + reader.shm.size


def test_records_are_freed_out_of_order_and_a_kept_result_reads_as_it_was(ring):
    reader, writer = ring
    kept = [_result(reader, writer.put(_parts(100_000, i))) for i in range(3)]
    assert all(_in_ring(reader, p.tensors["w"]) for p in kept)  # views of the ring, not copies
    middle = writer.live[1]
    del kept[1]  # the middle one is done with first
    rng = random.Random(0)
    places = []
    for i in range(3, 300):  # hostile sizes: 1 byte to a third of the ring, each taken and dropped at once
        n = rng.choice([1, 7, 4096, 65_537, 200_000, 349_000])
        where = writer.put(_parts(n, i))
        assert where is not None  # never short of room: the kept ones pin 200 KB
        places.append(where[0])
        assert _result(reader, where).tensors["w"].tobytes() == bytes([i % 251]) * n
    assert middle in places  # its room was written again while the records around it were still kept
    assert [p.meta["fill"] for p in kept] == [0, 2]
    assert [p.tensors["w"].tobytes() for p in kept] == [bytes([0]) * 100_000, bytes([2]) * 100_000]
    w = kept[0].tensors["w"][10:20]  # a slice outlives its payload: it still pins the record
    del kept
    for i in range(300, 320):
        assert _result(reader, writer.put(_parts(300_000, i))) is not None
    assert w.tobytes() == bytes(10)
    assert reader.lent == parts_size(_parts(100_000, 0))  # its whole record (the payload's header included)
    del w
    assert reader.lent == 0


def test_a_result_kept_past_the_rings_close_reads_as_it_was():
    freed = threading.Semaphore(0)
    reader = RingReader(RING, freed)
    writer = RingWriter(reader.name, reader.size, freed)
    kept = _result(reader, writer.put(_parts(300_000, 7))).tensors["w"]
    writer.close()
    reader.close()  # the run ended (or its worker died) while a result still holds its record
    assert not _segment(reader.name)  # unlinked all the same
    assert kept.tobytes() == bytes([7]) * 300_000  # still mapped: it reads as it was
    del kept  # (the mapping goes with it)
    assert reader.lent == 0


def test_at_most_half_a_ring_is_lent_the_rest_is_copied_and_a_slow_consumer_never_stalls_the_writer(ring, monkeypatch):
    reader, writer = ring
    monkeypatch.setattr(result_ring, "WAIT_S", 30.0)  # a stall would show as a failed test, not a pipe
    held = []  # results waiting for a slower worker's: never freed during the test
    kinds = []
    for i in range(40):
        where = writer.put(_parts(90_000, i))
        assert where is not None
        body = reader.take(*where)
        kinds.append("lent" if isinstance(body, memoryview) and isinstance(body.obj, Lent) else type(body).__name__)
        held.append(decode_payload(body, views=True))
        del body
    assert kinds[:5] == ["lent"] * 5 and set(kinds[5:]) == {"bytes"}  # 5 x 90 KB is under half of 1 MiB
    assert reader.lent <= RING // 2
    assert [p.tensors["w"][0] for p in held] == [i % 251 for i in range(40)]
    with pytest.raises(ValueError, match="read-only"):
        held[0].tensors["w"][0] = 1  # a lent record cannot be written through


def test_a_writer_that_waited_in_vain_does_not_wait_again_until_its_ring_has_room(ring, monkeypatch):
    """No room within WAIT_S: that result and the next ones go by pipe at once (not WAIT_S each: a stalled main
    process would cost a worker seconds a result); once a record is freed, results go through the ring again."""
    reader, writer = ring
    monkeypatch.setattr(result_ring, "WAIT_S", 0.3)
    untaken = [writer.put(_parts(400_000, i)) for i in range(2)]  # 800 KB of the 1 MiB, not taken yet
    start = time.monotonic()
    assert writer.put(_parts(400_000, 2)) is None  # waited WAIT_S in vain
    assert time.monotonic() - start >= 0.3
    start = time.monotonic()
    assert all(writer.put(_parts(400_000, i)) is None for i in range(3, 13))  # ten more, none waiting
    assert time.monotonic() - start < 10 * 0.3 / 2  # (waiting, they would take 3 s)
    assert writer.put(_parts(1_000, 13)) is not None  # one that fits goes through the ring at once
    assert _result(reader, untaken[0]).meta["fill"] == 0  # taken and dropped: freed
    assert writer.put(_parts(399_000, 14)) is not None  # room again (where #0 was): the ring's


def test_a_slow_out_of_order_consumer_with_hostile_sizes_never_deadlocks_the_writer(ring):
    """A writer thread puts records of hostile sizes (empty to as large as the ring, and larger) while the consumer
    keeps up to 12 results and frees them in a shuffled order, also while no new result comes (results are
    delivered in submission order across workers: a kept one waits for another worker, not for this one); every
    record but the one larger than the ring goes through it, and every result reads as written."""
    reader, writer = ring
    rng = random.Random(1)
    header = parts_size(_parts(0, 100))
    sizes = [RING - header, RING + 1] + [rng.choice([0, 1, 100, 30_000, 250_000, 400_000]) for _ in range(300)]
    out: queue.Queue[tuple[int, tuple[int, int] | None]] = queue.Queue()
    thread = threading.Thread(target=lambda: [out.put((i, writer.put(_parts(n, i)))) for i, n in enumerate(sizes)])
    thread.start()
    kept: list[tuple[int, Payload]] = []
    piped = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            i, where = out.get(timeout=0.005)
        except queue.Empty:  # no result now: a kept one is delivered meanwhile
            if kept:
                kept.pop(rng.randrange(len(kept)))
            if not thread.is_alive() and out.empty():
                break
            continue
        if where is None:
            piped.append(i)
            continue
        kept.append((i, _result(reader, where)))
        if len(kept) > 12:
            assert _reads_as_written(*kept.pop(rng.randrange(len(kept))), sizes)  # kept while others were written
    thread.join(10)
    assert not thread.is_alive(), "the writer stalled"
    assert piped == [1]  # larger than the ring
    assert all(_reads_as_written(k, p, sizes) for k, p in kept)
    kept.clear()
    assert reader.lent == 0


def test_a_run_with_small_rings_lends_and_copies_results_kept_by_the_clock_and_stays_the_run_without_workers(
    make_config, monkeypatch
):
    """1 MiB rings and ~180 KB results: two results lent at a time, the others copied out; with the clock model a
    delivered result is kept until its device's compute time has passed (virtual time moves once the round's
    results are in), so a ring's lent records are pinned while the worker writes the rest."""
    sections = {**SECTIONS, "model": {"name": "mlp", "hidden": [600]}, "clock": CLOCK}
    monkeypatch.setattr(result_ring, "RING_BYTES", RING)
    sim = SimHierarchy(make_config(runtime={"engine": "cohort", "sim_workers": 2}, **sections), write_output=False)
    inline = while_workers_start(
        sim, lambda: run_simulation(make_config(runtime={"engine": "cohort"}, **sections), write_output=False)
    )
    kinds: list[str] = []
    take = RingReader.take

    def spy(self: RingReader, at: int, n: int, room: int = 0) -> memoryview | bytes:
        body = take(self, at, n, room)
        kinds.append("lent" if _in_ring(self, np.frombuffer(body, np.uint8)) else "copied")
        return body

    monkeypatch.setattr(RingReader, "take", spy)
    parallel = sim.run()
    same_run(inline, parallel)
    assert len(kinds) == 6 * 2 * 2 and {"lent", "copied"} <= set(kinds)  # 6 devices, 2 edge rounds, 2 rounds


def test_a_worker_answers_each_cohort_once_it_is_trained_with_the_same_bytes(make_config):
    """A worker's batch of 5 devices in cohorts of 2: the first cohort's results leave before the second cohort
    trains (the main process takes them in meanwhile), each the bytes the whole batch's answers would be."""
    from sim.device_worker import DeviceWorker

    sections = {**SECTIONS, "topology": {"cells": 1, "devices_per_cell": 5}}
    cfg = make_config(runtime={"engine": "cohort", "cohort_size": 2}, **sections)
    devices = [f"c0-d{i}" for i in range(5)]
    ctx = {"seed": 0, "round": 0, "edge_round": 0, "cell": "c0"}

    def batch(worker: DeviceWorker) -> list:
        task = encode_payload(Payload({}, worker.algorithm.initial_params()))
        return [({**ctx, "device": d}, task) for d in devices]

    whole = DeviceWorker(cfg.to_toml(), devices)
    expected = [(b"".join(parts), error) for parts, error in whole.train_many(batch(whole))]
    worker = DeviceWorker(cfg.to_toml(), devices)
    emitted: list[tuple[int, int, bytes, str]] = []  # (item, cohorts trained by then, its bytes, error)
    left = worker.train_many(
        batch(worker), lambda i, parts, error: emitted.append((i, worker.runner.cohorts, b"".join(parts), error))
    )
    assert [(i, cohorts) for i, cohorts, *_ in emitted] == [(0, 1), (1, 1), (2, 2), (3, 2), (4, 3)]
    assert [(data, error) for *_, data, error in emitted] == expected and all(error == "" for _, error in expected)
    assert all(parts == [] for parts, _ in left)  # emitted, not kept
