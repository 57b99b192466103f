"""The parts the cell and cloud servers keep their state in, on their own: what a (lying) cell's report adds
to the cloud's round, the cloud's checkpoint round trip and the repair of its records file, a cell's view of
its devices' presence, and what a cell's round report says of its devices."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from cell_server.liveness import Liveness
from cell_server.members import DeviceList
from cell_server.parts import EdgeRound, RoundTally
from cloud.checkpoint import CloudCheckpoint, repair_metrics
from cloud.parts import RoundCounts, drop_non_finite
from protocols.wire.payload import Payload


def test_a_cells_report_figures_are_counted_only_when_they_are_plausible() -> None:
    counts = RoundCounts()
    honest = {"traffic": {"cell_to_device": 100, "device_to_cell": 40}, "devices": 3, "diverged": 1}
    assert counts.count("c0", 10, {**honest, "failed_devices": 2, "failures": {"ValueError": 2}}) == 3
    lies = {"traffic": {"cell_to_device": -5, "device_to_cell": "lots"}, "devices": -1, "diverged": True}
    assert counts.count("c1", 7, {**lies, "failed_devices": "2", "failures": {"x": -3}, "unmet": "all"}) == 0
    assert counts.count("c2", 1, {"traffic": [1, 2], "devices": 2}) == 2
    assert counts.bytes == {"cloud_to_cell": 0, "cell_to_cloud": 18, "cell_to_device": 100, "device_to_cell": 40}
    assert counts.diverged == {"c0": 1} and counts.failed == {"c0": 2}
    assert counts.failures == {"ValueError": 2} and counts.unmet == {}


def test_an_evaluation_loses_its_non_finite_numbers_and_says_which() -> None:
    evaluation = {"accuracy": 0.5, "loss": float("nan"), "f1": float("inf")}
    assert drop_non_finite(evaluation) == "f1 = inf, loss = nan" and evaluation == {"accuracy": 0.5}
    assert drop_non_finite(evaluation) is None


def test_the_cloud_checkpoint_round_trips_and_its_records_file_ends_with_the_saved_round(tmp_path: Path) -> None:
    checkpoint = CloudCheckpoint(tmp_path / "checkpoint.npz")
    assert checkpoint.load() is None
    role = Payload({"step": 7}, {"w": np.arange(4, dtype=np.float32)})
    record = {"round": 1, "closed_by": "all reported"}
    checkpoint.save(1, "s1", {"cloud_to_cell": 9}, 2, role, record)
    saved = checkpoint.load()
    assert saved is not None and (saved.round, saved.session, saved.stalled, saved.record) == (1, "s1", 2, record)
    assert saved.cumulative == {"cloud_to_cell": 9} and saved.role.meta == {"step": 7}
    assert saved.role.tensors["w"].tolist() == [0, 1, 2, 3]
    metrics = tmp_path / "metrics.jsonl"  # round 2 was written before the crash, round 1's record was not
    metrics.write_text("".join(json.dumps({"round": r}) + "\n" for r in (0, 2)))
    repair_metrics(metrics, saved.round + 1, saved.record)
    assert [json.loads(line)["round"] for line in metrics.read_text().splitlines()] == [0, 1]


def test_a_cells_view_of_its_devices_follows_their_statuses() -> None:
    live = Liveness("c0", DeviceList(["d0", "d1", "d2"]))
    assert live.device_of("device.d0") == "d0" and live.device_of("device.x9") is None
    first = live.heard("d0", {"state": "online"}, now=1.0)
    assert (first.online, first.heard, first.changed) == (True, False, True)
    again = live.heard("d0", {"state": "online"}, now=3.0)
    assert (again.heard, again.changed) == (True, False)
    live.heard("d1", {"state": "online"}, now=2.0)
    assert live.unheard(["d0", "d1", "d2"]) == {"d2"} and live.offline(["d0", "d2"]) == {"d2"}
    assert list(live.stale(now=5.5, timeout=3.0)) == ["d1"]  # silent for 3.5 s; d0 for 2.5 s
    assert not live.online["d1"] and live.unavailable("d1") == "offline"
    assert live.revoke("d0") and not live.revoke("d0") and live.device_of("device.d0") is None
    assert live.unavailable("d0") == "revoked"


def test_a_cells_round_report_counts_the_devices_that_never_made_it() -> None:
    tally = RoundTally()
    tally.add(100, 40, ["d0"], ["d1"], {"d2": "ValueError"})  # edge round 0: d1 diverged, d2 failed
    tally.add(50, 20, ["d1"], [], {"d2": "ValueError"})  # edge round 1: d1 made it, d2 failed again
    tally.unmet["d3"] = "requirements: gpu"
    meta: dict = {}
    tally.annotate(meta)
    assert meta == {
        "traffic": {"cell_to_device": 150, "device_to_cell": 60},
        "devices": 2,
        "failed_devices": 1,
        "failures": {"ValueError": 1},
        "unmet": {"requirements: gpu": 1},
    }
    edge = EdgeRound()
    edge.take("d0", Payload({"loss": 0.5}), 10, None, None)
    edge.take("d1", Payload({"loss": float("nan")}), 10, None, None)
    edge.take("d2", Payload({"loss": 9.0}), 10, "loss is nan", None)
    assert edge.bytes_in == 30 and edge.losses == {"d0": 0.5} and edge.diverged == {"d2": "loss is nan"}
    assert edge.loss_stats() == (0.5, 0.0)
