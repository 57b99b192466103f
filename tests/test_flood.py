"""A flood of bad messages costs a node little: its rejections are logged at a bounded rate and its
records list a bounded number of them (the rest counted), and the run is unchanged."""

from __future__ import annotations

import logging

import numpy as np

from protocols.records import MAX_LISTED_REJECTIONS, parse_record
from protocols.wire import topics
from protocols.wire.ratelog import RateLimitedLog
from sim.launcher import SimHierarchy, run_simulation


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_rate_limited_log_keeps_a_burst_per_window_and_says_how_many_it_left_out(caplog) -> None:
    clock = FakeClock()
    log = RateLimitedLog(logging.getLogger("test.flood"), burst=5, window=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.flood"):
        for i in range(12):
            log.warning("bad %d", i)
        assert [r.getMessage() for r in caplog.records] == [f"bad {i}" for i in range(5)]
        assert log.suppressed == 7
        clock.t = 10.0
        log.warning("bad %d", 12)
    assert [r.getMessage() for r in caplog.records[5:]] == [
        "7 more rejections were not logged (at most 5 lines per 10 s)",
        "bad 12",
    ]


def test_flood_of_garbage_is_bounded_in_records_and_logs_and_changes_nothing(make_config, tmp_path, caplog) -> None:
    clean = run_simulation(make_config(run={"rounds": 2, "output": str(tmp_path / "clean")}))
    sim = SimHierarchy(make_config(run={"rounds": 2, "output": str(tmp_path / "flood")}))
    intruder = sim.hub.connect("intruder")
    n = 3 * MAX_LISTED_REJECTIONS

    def flood(record: dict) -> None:  # after round 0: garbage for the cell and for the cloud
        if record["round"] == 0:
            for i in range(n):
                intruder.publish(topics.device_result("t", "c0", "c0-d0"), b"FTW1" + bytes([i % 256]) * 40)
                intruder.publish(topics.cell_report("t", "c0"), b"\x00garbage %d" % i)

    sim.cloud.on_round = flood
    with caplog.at_level(logging.WARNING):
        result = sim.run()
    cell = next(r for r in result.cell_records if r["cell"] == "c0" and r["rejected"])
    assert len(cell["rejected"]) == MAX_LISTED_REJECTIONS and cell["rejected_more"] == n - MAX_LISTED_REJECTIONS
    cloud = result.history[1]
    assert len(cloud["rejected"]) == MAX_LISTED_REJECTIONS and cloud["rejected_more"] == n - MAX_LISTED_REJECTIONS
    assert parse_record(cell).rejected_more == n - MAX_LISTED_REJECTIONS  # valid records
    lines = [r for r in caplog.records if "rejected a message" in r.getMessage()]
    assert len(lines) <= 2 * 100  # one rate limiter per node: the cell's and the cloud's messengers
    for k in clean.params:
        assert np.array_equal(clean.params[k], result.params[k])


def test_weight_beyond_float_range_is_a_logged_rejection(make_config) -> None:
    from protocols.wire.messenger import Messenger
    from protocols.wire.payload import Payload

    sim = SimHierarchy(make_config(run={"rounds": 1}))
    forger = Messenger(sim.hub.connect("intruder"), "t", "c0-d0")
    topic = topics.device_result("t", "c0", "c0-d0")

    def forge(round_: int) -> None:
        forger.send(topic, "device_result", Payload({"weight": 10**400}), round=round_)

    original = sim.cells["c0"].messenger.send

    def send_then_forge(t, kind, payload, **kw):  # as the cell sends its first device task, the forgery
        n = original(t, kind, payload, **kw)
        if kind == "device_task":
            forge(kw["round"])
        return n

    sim.cells["c0"].messenger.send = send_then_forge
    result = sim.run()
    reasons = [x["reason"] for r in result.cell_records if r["cell"] == "c0" for x in r["rejected"]]
    assert any("weight 100000000000... exceeds" in why for why in reasons), reasons
    assert len(result.history) == 1
