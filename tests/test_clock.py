"""The virtual clock: exact simulated time from bytes and steps, stragglers that miss deadlines."""

from __future__ import annotations

import numpy as np
import pytest

from sim.launcher import SimHierarchy, run_simulation

CLOCK = {
    "device_steps_per_s": 20.0,
    "downlink_bytes_per_s": 2e5,
    "uplink_bytes_per_s": 5e4,
    "backhaul_bytes_per_s": 1e6,
    "latency_s": 0.01,
}


def test_round_time_is_latency_plus_bytes_over_bandwidth_plus_compute(make_config):
    cfg = make_config(run={"rounds": 2}, algorithm={"edge_rounds": 2, "local_steps": 10}, clock=CLOCK)
    result = run_simulation(cfg, write_output=False)
    c = CLOCK
    start = 0.0
    for rec in result.history:
        cells = [r for r in result.cell_records if r["round"] == rec["round"]]
        per_cell = rec["bytes"]["cloud_to_cell"] / 2  # both cells get the same model
        down = c["latency_s"] + per_cell / c["backhaul_bytes_per_s"]
        up = c["latency_s"] + rec["bytes"]["cell_to_cloud"] / 2 / c["backhaul_bytes_per_s"]
        for r in cells:  # equal-sized tasks; results differ by a few bytes (the loss's digits): 2 ms here
            n = len(r["answered"])
            edge = (
                c["latency_s"]
                + r["bytes_out"] / n / c["downlink_bytes_per_s"]
                + 10 / c["device_steps_per_s"]
                + c["latency_s"]
                + r["bytes_in"] / n / c["uplink_bytes_per_s"]
            )
            assert r["clock_s"] == pytest.approx(edge, abs=2e-3)
        edges = [sum(r["clock_s"] for r in cells if r["cell"] == cell) for cell in ("c0", "c1")]
        assert rec["clock_s"] - start == pytest.approx(down + max(edges) + up, abs=1e-5)  # exact from records
        start = rec["clock_s"]


def test_the_clock_changes_time_not_the_model(make_config, tmp_path):
    plain = run_simulation(make_config(run={"output": str(tmp_path / "a")}), write_output=False)
    timed = run_simulation(make_config(run={"output": str(tmp_path / "b")}, clock=CLOCK), write_output=False)
    assert all(np.array_equal(plain.params[k], timed.params[k]) for k in plain.params)
    assert plain.history[-1]["clock_s"] == 0.0 < timed.history[-1]["clock_s"]
    assert timed.summary()["virtual_time_s"] == timed.history[-1]["clock_s"]


def test_stragglers_miss_the_deadline(make_config):
    cfg = make_config(
        run={"rounds": 2},
        algorithm={"edge_rounds": 1, "local_steps": 10},
        clock={"device_steps_per_s": 10.0, "device_speed_spread": 1.0},
        runtime={"device_deadline": 1.5},
    )
    sim = SimHierarchy(cfg, write_output=False)
    speeds = sim.clock.speed
    result = sim.run()
    slow = {d for d, s in speeds.items() if 10 / s > 1.5}  # 10 steps take longer than the deadline
    assert slow and len(slow) < len(speeds)  # the seed gives some of each
    for r in result.cell_records:
        late = {d for d, why in r["absent"].items() if why == "deadline"}
        assert late == {d for d in slow if d.startswith(r["cell"])}
        assert set(r["answered"]).isdisjoint(slow)
    again = SimHierarchy(cfg, write_output=False)
    assert again.clock.speed == speeds  # seeded: the same stragglers every time


def test_devices_a_quorum_cut_off_are_absent_for_the_quorum_and_the_sim_warns_without_a_clock(make_config, caplog):
    """An edge round closed at runtime.quorum named the devices it did not wait for absent for the 'deadline'
    (the monitor and a reader took them for stragglers). Without a [clock] the simulation has no device speeds,
    so the same devices are cut off every round and never train the model: it says so."""
    cfg = make_config(run={"rounds": 1}, runtime={"quorum": 0.5, "device_deadline": 5.0})
    with caplog.at_level("WARNING", logger="fedtier.sim"):
        result = run_simulation(cfg, write_output=False)
    assert "runtime.quorum = 0.5 without a [clock]" in caplog.text
    for record in result.cell_records:  # 3 devices per cell, quorum 2
        assert record["closed_by"] == "quorum" and len(record["answered"]) == 2
        assert list(record["absent"].values()) == ["quorum"]
    caplog.clear()
    clocked = make_config(run={"rounds": 1}, runtime={"quorum": 0.5}, clock={"device_steps_per_s": 20.0})
    with caplog.at_level("WARNING", logger="fedtier.sim"):
        run_simulation(clocked, write_output=False)
    assert "without a [clock]" not in caplog.text


def test_a_new_run_into_a_folder_that_held_one_says_it_replaces_it(make_config, caplog):
    """Running again into the same run.output silently deleted the earlier run's records, checkpoint and model."""
    cfg = make_config(run={"rounds": 1})
    with caplog.at_level("WARNING", logger="fedtier.sim"):
        run_simulation(cfg)
        assert "held a run" not in caplog.text
        run_simulation(cfg)
    assert f"{cfg.output_dir()} held a run: its records, checkpoint and model are replaced" in caplog.text


def test_a_resumed_run_goes_on_from_its_virtual_time(make_config, tmp_path):
    """The virtual clock restarted at 0 on --resume: the resumed rounds' records went back in time, the report's
    time axis with them, and the summary's virtual_time_s counted the last attempt only (3.0 s for 6 rounds)."""
    clock = {"device_steps_per_s": 10.0, "device_speed_spread": 0.5}
    whole = run_simulation(make_config(run={"rounds": 4, "output": str(tmp_path / "whole")}, clock=clock)).history
    run_simulation(make_config(run={"rounds": 2}, clock=clock))
    resumed = run_simulation(make_config(run={"rounds": 4}, clock=clock), resume=True)
    assert [r["round"] for r in resumed.history] == [2, 3]
    times = [(r["clock_start_s"], r["clock_s"]) for r in resumed.history]  # records round to the microsecond
    assert times == [pytest.approx((r["clock_start_s"], r["clock_s"]), abs=1e-5) for r in whole[2:]]
    assert resumed.summary()["virtual_time_s"] == pytest.approx(whole[-1]["clock_s"], abs=1e-5)
    assert times[0][0] >= whole[1]["clock_s"] > 0
