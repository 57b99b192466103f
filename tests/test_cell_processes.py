"""``runtime.cell_processes`` (``sim/cell_processes.py``): the cells in processes of their own, the same run byte
for byte."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from protocols import runfiles
from protocols.config import ConfigError
from protocols.execution import execution_plan, idle_settings
from protocols.transport.memory import MemoryHub
from protocols.transport.virtual_loop import CELLS, MAIN, VirtualLoop
from sim.cell_processes import CellProcessError, plan_line
from sim.cell_share import CellShare, deliver, share_plan
from sim.launcher import SimHierarchy, run_simulation
from tests.conftest import WALL, same_run, while_workers_start

STRAGGLERS = {  # a virtual clock whose devices run at seeded speeds a factor e^N(0, 1) apart
    "device_steps_per_s": 10.0,
    "device_speed_spread": 1.0,
    "downlink_bytes_per_s": 2e5,
    "uplink_bytes_per_s": 5e4,
    "backhaul_bytes_per_s": 1e6,
    "latency_s": 0.01,
}
DECOMFL = {"name": "decomfl", "edge_rounds": 1, "perturbations": 4, "lr": 0.02, "momentum": 0.5, "batch_size": 16}
FEDBUFF = {"mode": "async", "async_buffer": 2, "async_cloud_buffer": 2, "edge_rounds": 1, "local_steps": 5}


def _log_lines(out: Path | None) -> list[str]:
    """The aggregation log's records without their real-time fields, sorted (its line order is the processes')."""
    assert out is not None
    lines = (out / runfiles.AGGREGATION).read_text().splitlines()
    return sorted(json.dumps({k: v for k, v in json.loads(x).items() if k not in WALL}, sort_keys=True) for x in lines)


@pytest.mark.parametrize(
    "sections",
    [
        {},
        {  # hist; stragglers miss the cells' deadlines: virtual time moves, messages cross with their link delays
            "run": {"rounds": 2},
            "algorithm": {"name": "hist", "edge_rounds": 2, "local_steps": 5, "batch_size": 16, "lr": 0.1},
            "topology": {"cells": 3, "devices_per_cell": 2},
            "clock": STRAGGLERS,
            "runtime": {"device_deadline": 0.6},
        },
        {  # FedBuff, every device as fast: the 3 cells push at the same instants (c0 and c2 from one process, c1
            # from the other); a version takes two pushes, the third goes into the next (versions interleave)
            "run": {"rounds": 4},
            "algorithm": FEDBUFF,
            "topology": {"cells": 3, "devices_per_cell": 2},
            "clock": {**STRAGGLERS, "device_speed_spread": 0.0},
        },
        {  # DeComFL on the cohort engine, directions in 2 threads: the cloud draws a round's directions ahead in the
            # main process, each cell for its devices in its own; devices replay what they missed (2 of 4 a round)
            "run": {"rounds": 4},
            "algorithm": DECOMFL,
            "participation": {"model": "uniform", "per_round": 2},
            "runtime": {"engine": "cohort", "direction_threads": 2},
        },
    ],
    ids=["fedavg", "hist-clock", "fedbuff-ties", "decomfl"],
)
def test_two_cell_processes_give_the_one_process_run_byte_for_byte(
    make_config, tmp_path: Path, sections: dict[str, Any], caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="fedtier.sim")
    runtime = {**sections.get("runtime", {}), "cell_processes": 2}
    run = {**sections.get("run", {}), "output": str(tmp_path / "split")}
    sim = SimHierarchy(make_config(**{**sections, "runtime": runtime, "run": run}))  # its cell processes start...
    if hasattr(sim.cloud.role, "idle"):  # the cloud's role hears when its turn is over (CloudRole.idle)
        assert sim.split is not None and sim.cloud.role.idle_calls and sim.split.waiting == sim.cloud.role.idle
    one = while_workers_start(sim, lambda: run_simulation(make_config(**sections)))  # ...while this runs
    split = sim.run()
    same_run(one, split)
    logged = [_log_lines(r.output_dir) for r in (one, split)]  # the main process writes the cells' log
    assert logged[0] == logged[1] and len(logged[0]) == len(one.cell_records)
    if sections.get("algorithm") is FEDBUFF:  # pushes of the three cells at one instant; some from older versions
        pushed_at = [r["clock_end_s"] for r in one.cell_records if r["edge_round"] == 1]
        assert len(pushed_at) == 3 and len(set(pushed_at)) == 1, pushed_at
        assert max(r["metrics"]["staleness_max"] for r in one.history) >= 1
    elif "clock" in sections:  # some devices were late, and the cells moved on at their deadlines
        assert [d for r in one.cell_records for d, why in r["absent"].items() if why == "deadline"]
        assert split.history[-1]["clock_s"] > 1.0
    elif sections.get("algorithm") is DECOMFL:  # devices that missed rounds caught up (so their models agreed)
        assert max(r["metrics"]["history_rounds"] for r in one.history) > 1
    else:
        assert one.final_accuracy is not None and one.final_accuracy > 0.5  # it learns
    assert {r["cell"] for r in split.cell_records} == set(split.config.topology.cell_ids())
    assert sum(r.getMessage().startswith("cell processes: 2 (cells ") for r in caplog.records) == 1  # the plan, once


def test_cell_processes_share_cohort_threads_unless_set_per_process(make_config):
    """Each cell process's cohorts compute with its share of cohort_threads (5 over 2 processes: 2 each, not 5
    each: 10 threads on 5 cores), at least one, unless runtime.cell_process_threads sets it; the plan says so."""
    cohort = {"engine": "cohort", "cohort_threads": 5, "cell_processes": 2}
    cfg = make_config(runtime=cohort)
    share = CellShare(cfg.to_toml(), ["c0"])  # what a cell process builds
    try:
        assert share.executor.runner.engine.threads == 2
    finally:
        share.executor.close()
    assert execution_plan(cfg).eval_threads == 5  # the cloud's evaluation, in the main process while they wait
    assert share_plan(make_config(runtime={**cohort, "cohort_threads": 1})).threads == 1
    own = make_config(runtime={**cohort, "cell_process_threads": 3})
    assert share_plan(own).threads == 3
    assert plan_line(cfg, [["c0"], ["c1"]]) == (
        "cell processes: 2 (cells c0; c1), 2 torch threads each for its cohorts (runtime.cohort_threads = 5 shared; "
        "runtime.cell_process_threads sets it); each loads the whole data set"
    )
    assert "3 torch threads each for its cohorts (runtime.cell_process_threads)" in plan_line(own, [["c0"], ["c1"]])
    alone = make_config(runtime={"engine": "cohort", "cell_process_threads": 3})
    assert any(
        "cell_process_threads = 3 has no effect without runtime.cell_processes" in w
        for w in idle_settings(alone, "sim")
    )


def test_a_cell_process_tells_its_cells_roles_it_waits_once_it_answered(make_config):
    """After each answer (its turn over), a cell process calls its cells' roles' ``idle`` (``CellRole.idle``: DeComFL
    then draws its next round's directions while the cloud closes the round, not among the handlers of its turn);
    a role without the hook (an asynchronous cell's) is left alone."""
    share = CellShare(make_config().to_toml(), ["c0"])
    seen: list[str] = []

    class Conn:
        def send_bytes(self, data: bytes) -> None:
            seen.append("answer")

    try:
        role = share.cells["c0"].role  # (a CellRole: its idle hook declared by the base class)
        role.idle = lambda: seen.append("idle")  # type: ignore[method-assign]
        share.answer(Conn())
        share.cells["c0"].role = object()  # type: ignore[assignment]
        share.answer(Conn())
    finally:
        share.executor.close()
    assert seen == ["answer", "idle", "answer"]


def test_a_resumed_run_in_cell_processes_ends_as_the_uninterrupted_run(make_config, tmp_path: Path):
    part = {"output": str(tmp_path / "resumed")}
    run_simulation(make_config(run={**part, "rounds": 2}))  # "crashes" after round 1 (one process)
    sim = SimHierarchy(make_config(run={**part, "rounds": 4}, runtime={"cell_processes": 2}), resume=True)
    straight = while_workers_start(sim, lambda: run_simulation(make_config(run={"rounds": 4}), write_output=False))
    resumed = sim.run()  # goes on in cell processes
    assert [r["round"] for r in resumed.history] == [2, 3]
    assert all(straight.params[k].tobytes() == resumed.params[k].tobytes() for k in straight.params)
    strip = lambda recs: [{k: v for k, v in r.items() if k not in WALL} for r in recs]  # noqa: E731
    assert strip(resumed.history) == strip(straight.history[2:])
    assert strip(resumed.cell_records) == strip([r for r in straight.cell_records if r["round"] >= 2])


def test_a_resumed_async_run_in_cell_processes_is_the_resumed_run_of_one_process(make_config, tmp_path: Path):
    """FedBuff with stragglers stopped after 2 versions (its push journal holds what it took since), resumed to 4:
    in cell processes as in one process (the cells start afresh either way, and are sent the current version)."""
    sections = {"algorithm": FEDBUFF, "topology": {"cells": 3, "devices_per_cell": 2}, "clock": STRAGGLERS}
    run_simulation(make_config(run={"rounds": 2, "output": str(tmp_path / "one")}, **sections))
    shutil.copytree(tmp_path / "one", tmp_path / "split")
    sim = SimHierarchy(
        make_config(run={"rounds": 4, "output": str(tmp_path / "split")}, runtime={"cell_processes": 2}, **sections),
        resume=True,
    )  # its cell processes start while the one-process run resumes
    one = while_workers_start(
        sim,
        lambda: run_simulation(
            make_config(run={"rounds": 4, "output": str(tmp_path / "one")}, **sections), resume=True
        ),
    )
    split = sim.run()
    assert [r["round"] for r in split.history] == [2, 3] and split.history[0]["clock_start_s"] > 0
    same_run(one, split)


def test_unsupported_settings_are_refused_naming_them(make_config):
    cfg = make_config(runtime={"cell_processes": 3, "sim_workers": 1})
    with pytest.raises(ConfigError) as err:
        SimHierarchy(cfg, write_output=False)
    message = str(err.value)
    for what in ("more processes than cells (2)", "runtime.sim_workers"):
        assert what in message
    untimed = make_config(algorithm={"mode": "async", "async_buffer": 2}, runtime={"cell_processes": 2})
    with pytest.raises(
        ConfigError, match=r"asynchronous algorithm whose devices train in no virtual time \(set \[clock"
    ):
        SimHierarchy(untimed, write_output=False)


@pytest.mark.parametrize(
    "sig, why",
    [
        (signal.SIGKILL, r"died with exit code -9"),
        (signal.SIGSTOP, r"sent nothing, no answer and no progress beat, for 2 s \(runtime.worker_stall_s\)"),
    ],
    ids=["killed", "stopped"],
)
def test_a_dead_or_hung_cell_process_ends_the_run_naming_it(
    make_config, monkeypatch: pytest.MonkeyPatch, sig: signal.Signals, why: str
):
    """A cell process that dies, or stops answering, ends the run naming it; and a run without output never opens
    the cells' records for the aggregation log it does not write (before, the main process parsed each cell's record
    every round, for nothing)."""
    import sim.cell_processes as split_module

    opened: list[str] = []
    monkeypatch.setattr(split_module, "open_record", lambda data, topic, *a: opened.append(topic))
    sim: SimHierarchy | None = None

    def after_first_round(record: dict[str, Any]) -> None:
        if record["round"] == 0:
            assert sim is not None and sim.split is not None
            os.kill(sim.split.procs[1].pid, sig)

    cfg = make_config(runtime={"cell_processes": 2, "worker_stall_s": 2.0})
    sim = SimHierarchy(cfg, on_round=after_first_round, write_output=False)
    with pytest.raises(CellProcessError, match=r"cell process 1 \(pid \d+; cells c1\) " + why):
        sim.run()
    assert sim.cloud.round == 1  # it stopped at once
    assert all(not p.is_alive() for p in sim.split.procs)
    assert not opened  # (round 0's records crossed, unread)


def test_a_loop_runs_what_is_due_now_and_moves_only_when_told():
    loop, seen = VirtualLoop(), []
    loop.call_later(0.0, lambda: seen.append(("due", loop.now())))
    loop.call_later(2.0, lambda: seen.append(("later", loop.now())))
    loop.post(lambda: seen.append(("posted", loop.now())))
    loop.run_due()
    assert seen == [("posted", 0.0), ("due", 0.0)] and loop.next_timer() == 2.0  # the clock stayed
    loop.advance(2.0)
    loop.run_due()
    assert seen[-1] == ("later", 2.0) and loop.next_timer() is None


def test_messages_crossing_at_one_instant_arrive_by_sender_and_the_clouds_timers_fire_first():
    """The order both a one-process run (the loop's sides) and cell processes (``deliver``) give what crosses between
    the cloud's side and the cells' at one virtual instant: by sender, each sender's in the order it sent them;
    at one instant the cloud's timers fire before the cells'. Set up against it: cell.b's timer set first, then the
    cloud's, then cell.a's, all due at 1 s; their pushes arrive together at 1.5 s."""
    loop, seen = VirtualLoop(), []
    hub = MemoryHub(loop, link_delay=lambda _t, _n: 0.5, side_of=lambda client: CELLS if "cell." in client else MAIN)
    hub.connect("cloud").subscribe("up/+", lambda _t, data: seen.append((loop.now(), bytes(data))))
    b, a = hub.connect("cell.b"), hub.connect("cell.a")
    with loop.acting(CELLS):
        loop.call_later(1.0, lambda: [b.publish("up/b", x) for x in (b"b1", b"b2")])
    loop.call_later(1.0, lambda: seen.append((loop.now(), b"cloud timer")))
    with loop.acting(CELLS):
        loop.call_later(1.0, lambda: a.publish("up/a", b"a1"))
    loop.run()
    assert seen == [(1.0, b"cloud timer"), (1.5, b"a1"), (1.5, b"b1"), (1.5, b"b2")]
    # the main process delivers the processes' answers (c2's from process 0, then c1's) in the same order
    main, got = MemoryHub(), []
    main.connect("cloud").subscribe("up/+", lambda topic, _d: got.append(topic))
    deliver(
        main, [("up/c2", b"", False, "cell.c2"), ("up/c1", b"1", False, "cell.c1"), ("up/c1", b"2", False, "cell.c1")]
    )
    main.loop.run()
    assert got == ["up/c1", "up/c1", "up/c2"]


def test_the_gpu_benchmark_names_its_cell_process_sides():
    from benchmarks.gpu import SIDES, cell_processes, cohort_side

    assert {"cohort-cpu-c2", "cohort-cuda-c4", "cohort-cuda-c10"} <= set(SIDES)
    assert cell_processes("cohort-cuda-c10") == 10 and cell_processes("cohort-cuda-w4") == 0
    assert cohort_side("cohort-cuda-c4") == ("cuda", 64, 0, "auto")


def test_an_observer_of_neither_side_gets_each_message_once_whichever_side_sent_it():
    """A client of neither side (a monitor's tap, an observer: ``side_of`` None) subscribed to both directions
    gets every message exactly once, at the time it arrives where it was sent (a message crossing to the other side
    is not delivered to it again there), and a retained one when it subscribes; the sides get theirs once each."""
    loop, seen = VirtualLoop(), []
    sides = {"cloud": MAIN, "cell.a": CELLS}
    hub = MemoryHub(loop, link_delay=lambda _t, _n: 0.5, side_of=sides.get)
    cloud, cell = hub.connect("cloud"), hub.connect("cell.a")
    cloud.subscribe("up/+", lambda t, d: seen.append(("cloud", t, bytes(d), loop.now())))
    cell.subscribe("down/+", lambda t, d: seen.append(("cell", t, bytes(d), loop.now())))
    hub.connect("monitor").subscribe("#", lambda t, d: seen.append(("monitor", t, bytes(d), loop.now())))
    cloud.publish("down/a", b"task", retain=True)
    with loop.acting(CELLS):
        loop.call_later(1.0, lambda: cell.publish("up/a", b"push"))
    loop.run()
    assert sorted(seen) == [
        ("cell", "down/a", b"task", 0.5),
        ("cloud", "up/a", b"push", 1.5),
        ("monitor", "down/a", b"task", 0.5),
        ("monitor", "up/a", b"push", 1.5),
    ], seen
    hub.connect("late").subscribe("down/+", lambda t, d: seen.append(("late", t, bytes(d), loop.now())))
    loop.run()
    assert seen[-1][:3] == ("late", "down/a", b"task"), seen
