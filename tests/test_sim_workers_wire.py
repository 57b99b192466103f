"""The bytes between ``fedtier sim``'s main process and its cohort workers (``sim/executors.py``): a task goes to
its worker as the bytes it arrived in, and the run stays the one without workers, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from protocols.wire.messenger import Received
from protocols.wire.payload import Payload, encode_payload
from sim.launcher import RunResult, SimHierarchy, run_simulation
from sim.worker_frames import batch_frame, batch_items, unframe

WALL = ("time", "duration_s")

SECTIONS = dict(
    run={"rounds": 2},
    topology={"cells": 2, "devices_per_cell": 3},
    algorithm={"local_steps": 0, "local_epochs": 1.0, "batch_size": 32, "edge_rounds": 2},
)


def _same(a: RunResult, b: RunResult) -> None:
    assert a.params.keys() == b.params.keys()
    assert all(a.params[k].tobytes() == b.params[k].tobytes() for k in a.params)
    strip = lambda recs: [{k: v for k, v in r.items() if k not in WALL} for r in recs]  # noqa: E731
    assert strip(a.history) == strip(b.history)
    assert strip(a.cell_records) == strip(b.cell_records)
    assert a.device_traffic == b.device_traffic


def test_a_worker_gets_each_task_as_it_arrived_and_the_run_is_the_one_without_workers(make_config, monkeypatch):
    def refuse(payload: Payload) -> bytes:
        raise AssertionError("a received task was encoded again for its worker")

    inline = run_simulation(make_config(runtime={"engine": "cohort"}, **SECTIONS), write_output=False)
    monkeypatch.setattr("sim.executors.encode_payload", refuse)  # the main process's; the workers are spawned
    sim = SimHierarchy(make_config(runtime={"engine": "cohort", "sim_workers": 2}, **SECTIONS), write_output=False)
    parallel = sim.run()
    _same(inline, parallel)
    assert sim.executor.largest_batch == 3  # 6 devices over 2 workers, a batch per edge round


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
