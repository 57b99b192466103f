"""Buffered asynchronous aggregation (algorithm.mode = "async", FedBuff) at cells and cloud."""

from __future__ import annotations

import contextlib
import copy
import json
import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from cloud import async_server
from protocols import params as P
from protocols import runfiles
from protocols.algorithms.base import Rejected
from protocols.algorithms.fedavg import FedAvgCloud, FedAvgParams
from protocols.algorithms.fedbuff import FedBuffCell, FedBuffCloud
from protocols.algorithms.staleness import Entry, StalenessBuffer
from protocols.checkpoint import Journal
from protocols.config import ConfigError, parse_config
from protocols.transport.broker import EmbeddedBroker, find_mosquitto
from protocols.wire import topics
from protocols.wire.envelope import decode_message
from protocols.wire.messenger import Messenger
from protocols.wire.payload import Payload
from sim.emulation import Emulation, Faults
from sim.launcher import SimHierarchy, run_simulation
from tests.conftest import small_config


def test_buffer_applies_staleness_weights_and_the_bound_as_computed_directly():
    g = np.random.default_rng(0)
    buf = StalenessBuffer(size=3, exponent=0.5, max_staleness=4)
    items = [("d2", 6, 10.0), ("d0", 3, 20.0), ("d1", 5, 5.0)]
    deltas = {d: {"w": g.standard_normal(5).astype(np.float32)} for d, _, _ in items}
    for device, base, weight in items:
        assert buf.admit(6, base, device) == 6 - base
        buf.add(device, base, weight, deltas[device])
        assert buf.full == (device == "d1")
    step, total, info = buf.flush(6)
    want = sum(w * (1 + 6 - b) ** -0.5 * deltas[d]["w"].astype(np.float64) for d, b, w in items) / 35.0
    np.testing.assert_allclose(step["w"], want.astype(np.float32), rtol=1e-6)
    assert total == 35.0 and info["senders"] == ["d0", "d1", "d2"] and info["staleness_max"] == 3
    assert buf.entries == []
    with pytest.raises(Rejected, match="stale: version 1 is 5 versions old"):
        buf.admit(6, 1, "result of d9")
    with pytest.raises(Rejected, match="future"):
        buf.admit(6, 7, "result of d9")
    for bad in ("3", -1, True, 2.0):
        with pytest.raises(Rejected, match="not a version"):
            buf.admit(6, bad, "result of d9")
    flat = StalenessBuffer(size=1, exponent=0.0, max_staleness=9)  # exponent 0: no discount
    flat.add("d0", 0, 4.0, {"w": np.ones(2, np.float32)})
    assert flat.flush(5)[0]["w"].tolist() == [1.0, 1.0]


def test_cell_keeps_unpushed_progress_when_it_adopts_a_new_cloud_model():
    params = FedAvgParams(name="fedavg", local_steps=1, mode="async", async_buffer=2)
    cell = FedBuffCell(params, "c0")
    cell.adopt(0, {"w": np.zeros(3, np.float32)})
    assert cell.version == 0
    for device, value in (("d0", 1.0), ("d1", 3.0)):
        result = Payload({"weight": 1}, {"w": np.full(3, value, np.float32)})
        assert cell.check(device, 0, result) == 0
        cell.offer(device, 0, result)
    cell.aggregate()  # mean 2.0, no staleness
    assert cell.version == 1 and cell.model["w"].tolist() == [2.0] * 3
    pushed = cell.report()
    assert pushed.tensors["w"].tolist() == [2.0] * 3 and pushed.meta["weight"] == 2
    cell.offer("d0", 1, Payload({"weight": 1}, {"w": np.full(3, 1.0, np.float32)}))
    cell.offer("d1", 1, Payload({"weight": 1}, {"w": np.full(3, 1.0, np.float32)}))
    cell.aggregate()  # +1, not pushed yet
    cell.adopt(1, {"w": np.full(3, 10.0, np.float32)})
    assert cell.model["w"].tolist() == [11.0] * 3 and cell.version == 3
    with pytest.raises(Rejected, match="already at"):
        cell.adopt(1, {"w": np.zeros(3, np.float32)})
    with pytest.raises(Rejected, match="future"):
        cell.check("d0", 4, Payload({"weight": 1}, {"w": np.zeros(3, np.float32)}))


def _cfg(mode: str, rounds: int, **algo) -> dict:
    return {
        "run": {"name": "async", "seed": 4, "rounds": rounds},
        "topology": {"cells": 2, "devices_per_cell": 4},
        "algorithm": {"name": "fedavg", "local_steps": 10, "batch_size": 16, "lr": 0.1, "mode": mode, **algo},
        "model": {"name": "mlp", "hidden": [32]},
        "data": {"dataset": "digits", "partition": "iid"},
        "clock": {"device_steps_per_s": 10.0, "latency_s": 0.01},
    }


def _run(cfg: dict, slow: str | None = None):
    sim = SimHierarchy(parse_config(cfg), write_output=False)
    if slow is not None:
        sim.clock.speed[slow] /= 10  # one device 10x slower than the rest
    return sim.run()


def test_async_is_deterministic_and_beats_sync_with_a_straggler():
    sync = _run(_cfg("sync", 5), slow="c0-d0")
    target, sync_time = sync.history[-1]["accuracy"], sync.history[-1]["clock_s"]
    cfg = _cfg("async", 40, async_buffer=2, max_staleness=4)
    first, again = _run(cfg, slow="c0-d0"), _run(cfg, slow="c0-d0")
    assert all(first.params[k].tobytes() == again.params[k].tobytes() for k in first.params)
    assert [(h["clock_s"], h["accuracy"]) for h in first.history] == [
        (h["clock_s"], h["accuracy"]) for h in again.history
    ]
    reached = [h["clock_s"] for h in first.history if h["accuracy"] >= target]
    assert reached and reached[0] < sync_time, (
        target,
        sync_time,
        [(h["clock_s"], h["accuracy"]) for h in first.history],
    )
    # the straggler's results are too stale for max_staleness = 4: dropped, and logged with the reason
    dropped = [x for r in first.cell_records for x in r["rejected"] if x["device"] == "c0-d0"]
    assert dropped and all("stale" in x["reason"] for x in dropped)
    assert all("c0-d0" not in r["answered"] for r in first.cell_records)
    assert len(first.history) == 40 and all(r["closed_by"] == "buffer full" for r in first.history)


def test_each_cloud_version_counts_its_own_push_and_reaches_the_cells_it_used(tmp_path):
    """Pushes that each fill the cloud's buffer before the first new version went out (a version now takes them
    all): each version's record counts the bytes of its own pushes (the second record counted the first push's bytes
    again, and the next one three times: a run's cumulative bytes came out ~2x the traffic), and each version goes
    to the cells whose pushes made it (the later version went twice to one cell, which refused it as stale, 'already
    at', and the other cell never heard of the version its push made)."""
    cfg = small_config(tmp_path, run={"rounds": 8}, algorithm={"mode": "async", "async_buffer": 2, "edge_rounds": 1})
    result = run_simulation(cfg)
    took = [r["metrics"]["pushes"] for r in result.history]
    assert max(took) > 1, took  # two pushes waiting together: one version takes both (cloud.async_server)
    pushes = [r["bytes"]["cell_to_cloud"] / n for r, n in zip(result.history, took)]
    assert max(pushes) - min(pushes) < 64, pushes  # a push is the cell's dense delta: the same size each time
    refused = [x for r in result.cell_records for x in r["rejected"] if x["device"] == "cloud"]
    assert not refused, refused


def test_async_config_is_refused_where_it_does_not_apply(tmp_path):
    with pytest.raises(ConfigError, match="fedavg"):
        parse_config({"algorithm": {"name": "hist", "mode": "async"}})
    with pytest.raises(ConfigError, match="mean"):
        parse_config({"algorithm": {"name": "fedavg", "mode": "async", "cell_aggregator": "median"}})
    cfg = _cfg("async", 2)
    cfg["run"]["output"] = str(tmp_path / "{name}")
    rounds = len(run_simulation(parse_config(cfg)).history)
    cfg["run"]["rounds"] = rounds + 2  # an async run resumes (it was refused): two more versions
    resumed = run_simulation(parse_config(cfg), resume=True)
    assert [h["round"] for h in resumed.history] == [rounds, rounds + 1]


def test_async_over_mqtt_completes_with_a_killed_device(tmp_path):
    """c0-d1's worker is killed on its first task. An asynchronous task carries the cell's model version as
    its round, so the fault targets the first task whatever its version: a worker that came online late
    (a loaded machine) gets a later version first, and a fault pinned to version 0 then never fired (a
    flake)."""
    cfg = small_config(
        tmp_path,
        run={"rounds": 4},
        topology={"cells": 2, "devices_per_cell": 3},
        algorithm={"mode": "async", "async_buffer": 2, "edge_rounds": 1},
    )
    with EmbeddedBroker() as broker:
        result = Emulation(cfg, broker_url=broker.url, faults=Faults(crash={"c0-d1": (None, 0)})).run()
    assert [r["round"] for r in result.history] == [0, 1, 2, 3]
    assert np.isfinite(result.history[-1]["accuracy"])
    assert all("c0-d1" not in r["answered"] for r in result.cell_records)
    assert {r["cell"] for r in result.cell_records} == {"c0", "c1"}


def test_the_summary_states_the_device_bytes_no_round_record_counts(tmp_path):
    """An async run's summary.json: device_traffic (what the devices sent and received) exceeded the records'
    cumulative_bytes by ~59 kB (results still in flight at the end, traffic a cell took after its last push), with
    nothing saying so. unrecorded_device_bytes states that difference per tier; a synchronous run has none."""
    cfg = small_config(tmp_path, run={"rounds": 4}, algorithm={"mode": "async", "async_buffer": 2})
    summary = run_simulation(cfg).summary()
    sent = sum(t["bytes_out"] for t in summary["device_traffic"].values())
    received = sum(t["bytes_in"] for t in summary["device_traffic"].values())
    unrecorded, recorded = summary["unrecorded_device_bytes"], summary["cumulative_bytes"]
    assert unrecorded["device_to_cell"] > 0 and unrecorded["cell_to_device"] > 0
    assert sent == recorded["device_to_cell"] + unrecorded["device_to_cell"]
    assert received == recorded["cell_to_device"] + unrecorded["cell_to_device"]
    sync = run_simulation(small_config(tmp_path / "sync", run={"rounds": 2})).summary()
    assert "unrecorded_device_bytes" not in sync and sync["device_traffic"]
    # a resumed run: device_traffic counts this command, cumulative_bytes the whole run; the earlier rounds cancel out
    resumed = run_simulation(small_config(tmp_path / "sync", run={"rounds": 3}), resume=True).summary()
    assert "unrecorded_device_bytes" not in resumed and resumed["resumed_after_round"] == 1


def _journaled_c0(sim: SimHierarchy, *, resume: bool = False, samples: bool = True, will: bool = False) -> Any:
    """Cell c0 of ``sim`` as ``fedtier cell`` builds it on the sim's hub, with its journal (resumed from it with
    ``resume``; its devices' sample counts as the sim gives them, unless not ``samples``; with ``will``, its last
    will, as deployed: a crash leaves its retained status offline)."""
    from cell_server.node import build_cell
    from edge_agent.broker import offline_will
    from sim.launcher import device_samples

    return build_cell(
        sim.cfg,
        "c0",
        sim.hub.connect("cell.c0", will=offline_will(sim.cfg.run.name, "cell.c0") if will else None),
        sim.algorithm,
        output_dir=sim.output_dir,
        assume_online=True,
        journal=True,
        resume=resume,
        samples=device_samples(sim.prep.device_data, sim.cfg.topology.device_ids("c0")) if samples else None,
    )


def _c0_dies_at_version_3_and_restarts(sim: SimHierarchy, first: Any, *, resume: bool) -> list[float | None]:
    """``first`` (c0) dies on taking cloud version 3 or later, before anything of it is journaled, and a new c0
    (``_journaled_c0(sim, resume=resume)``) starts 3 s later. Returns the list that gets None at the death, then
    the restart's virtual time."""
    take, back = first._on_cell_task, []

    def restart() -> None:
        back.append(sim.hub.loop.now())
        sim.cells["c0"] = again = _journaled_c0(sim, resume=resume)
        again.start()

    def on_cell_task(topic: str, data: bytes) -> None:
        if first.fb.global_version < 3 or back:
            return take(topic, data)
        first.transport.crash()  # taken, and dead before anything of it was journaled
        first.stop()
        back.append(None)
        sim.hub.loop.call_later(3.0, restart)

    first._on_cell_task = on_cell_task
    return back


def test_an_async_cell_restarted_after_losing_a_cloud_version_is_sent_the_current_one(tmp_path):
    """In memory, with the virtual clock: c0 dies on taking cloud version 4 (acknowledged to the broker: nothing of
    it is journaled) and comes back 3 s later with --resume: it adopts its journaled cloud model (3) and sends
    its last push again. That repeat tells the cloud, which sent c0 version 4 and has had nothing from it since,
    that c0 may have lost it: it sends c0 the current version at once, so c0's pushes count again. Before,
    an async cell could not resume, and one restarted afresh was never sent a model again (its devices also
    refused its tasks, numbered from 0 again, as replays); without the cloud's resend, c0's pushes from version
    3 were 7 versions old by then (max_staleness 4): refused for ever."""

    cfg = small_config(
        tmp_path,
        run={"rounds": 12},
        algorithm={"mode": "async", "async_buffer": 2, "edge_rounds": 1, "max_staleness": 4},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
    )
    sim = SimHierarchy(cfg)
    first = sim.cells["c0"] = _journaled_c0(sim)
    back = _c0_dies_at_version_3_and_restarts(sim, first, resume=True)
    result = sim.run()
    assert back[0] is None and back[1] is not None, back
    resumed = sim.cells["c0"]
    assert resumed is not first and resumed.fb.global_version > 4  # it was sent a version after its restart
    later = [h for h in result.history if h["clock_s"] > back[1]]
    assert any("c0" in h["cells_reported"] for h in later), [(h["clock_s"], h["cells_reported"]) for h in later]
    refused = [x for r in result.cell_records for x in r["rejected"] if x["device"] == "cloud"]
    assert not refused, refused  # the cell never refused a model (a resend it had: 'already at')


def test_an_async_cell_restarted_afresh_asks_for_the_model_and_numbers_its_tasks_past_its_journal(tmp_path):
    """In memory, virtual clock: c0 dies on taking cloud version 4 and comes back 3 s later WITHOUT --resume. Its
    status asks for a model (needs_model): the cloud sends it the current version at once (once a version,
    RoundCounts.first_resend), and it numbers its model versions past every one its journal says a task carried,
    so its devices take its tasks. Before, the fresh cell was never sent a model (the async cloud sends a version
    only to the cells whose pushes it used, and a fresh cell has no push to repeat) and its devices refused its
    tasks, numbered from version 0 again, as replays: c0 absent from every later version."""

    cfg = small_config(
        tmp_path,
        run={"rounds": 12},
        algorithm={"mode": "async", "async_buffer": 2, "edge_rounds": 1, "max_staleness": 4},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
    )
    sim = SimHierarchy(cfg)
    first = sim.cells["c0"] = _journaled_c0(sim)
    back = _c0_dies_at_version_3_and_restarts(sim, first, resume=False)  # a fresh start: no --resume
    result = sim.run()
    assert back[0] is None and back[1] is not None, back
    fresh = sim.cells["c0"]
    assert fresh is not first and fresh.fb.global_version > 4  # it was sent a version after its restart
    assert fresh.records, "its devices refused every task of the fresh cell"
    assert min(r["edge_round"] for r in fresh.records) > first.fb.version  # numbered past the first's versions
    later = [h for h in result.history if h["clock_s"] > back[1]]
    assert any("c0" in h["cells_reported"] for h in later), [(h["clock_s"], h["cells_reported"]) for h in later]
    refused = [x for r in result.cell_records for x in r["rejected"] if x["device"] == "cloud"]
    assert not refused, refused  # the cell never refused a model


def _c0_restarts_without_its_journal(
    tmp_path, rounds: int, cells: int = 2, then_resumes: bool = False
) -> tuple[SimHierarchy, Any, list]:
    """In memory: c0 dies after cloud version 3 and comes back afresh 3 s later with its journal deleted; returns the
    sim, the run's result and c0's statuses as published (topic, bytes). With ``then_resumes``, its journal was only
    put aside: once c0 refused, the operator stops it, puts the journal back and starts it with ``--resume``."""
    cfg = small_config(
        tmp_path,
        run={"rounds": rounds},
        algorithm={"mode": "async", "async_buffer": 2, "edge_rounds": 1},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
        topology={"cells": cells},
    )
    sim = SimHierarchy(cfg)

    def journaled_c0():
        return _journaled_c0(sim, samples=False)

    first = sim.cells["c0"] = journaled_c0()
    take = first._on_cell_task

    kept = tmp_path / "kept"
    kept.mkdir()

    def restart() -> None:
        for path in sim.output_dir.glob("cell-c0.journal*"):
            path.rename(kept / path.name)
        sim.cells["c0"] = again = journaled_c0()
        again.start()
        if then_resumes:
            sim.hub.loop.call_later(1.0, resume)

    def resume() -> None:
        refused = sim.cells["c0"]
        if refused.refused is None:
            if not sim.cloud.finished:
                sim.hub.loop.call_later(1.0, resume)
            return
        refused.transport.close()
        refused.stop()
        for path in kept.iterdir():
            path.rename(sim.output_dir / path.name)
        sim.cells["c0"] = again = _journaled_c0(sim, samples=False, resume=True)
        again.start()

    def on_cell_task(topic: str, data: bytes) -> None:
        if first.fb.global_version < 3:
            return take(topic, data)
        first.transport.crash()
        first.stop()
        first._on_cell_task = lambda topic, data: None  # type: ignore[method-assign]
        sim.hub.loop.call_later(3.0, restart)

    first._on_cell_task = on_cell_task  # type: ignore[method-assign]
    statuses: list[tuple[str, bytes]] = []
    status = topics.status(cfg.run.name, "cell.c0")
    sim.hub.connect("watch").subscribe(status, lambda topic, data: statuses.append((topic, bytes(data))))
    result = sim.run()
    assert sim.cells["c0"] is not first
    return sim, result, statuses


def test_an_async_cell_restarted_without_its_journal_refuses_to_work_saying_to_resume(tmp_path):
    """c0 dies after cloud version 3 and comes back afresh with its journal deleted. It cannot number its tasks past
    the versions its devices had (they would refuse them as replays, as deployed: 0 of 232 versions), so when the
    cloud, which heard it hold a model before, sends it the current version marked ``held``, it takes no model and
    says why and what to do (``fedtier cell`` exits 1 with it): its status says so (``fedtier fleet``), and its
    "failed" push has the cloud leave it out (listed in the record's ``cells_failed``: the monitor alerts); the job
    goes on with c1. Before, a ``--serve`` cell that refused only logged it: its status still asked for a model."""
    from monitor.fleet import Fleet, render
    from monitor.state import MonitorState
    from protocols.failures import MAX_REASON
    from protocols.records import parse_record

    sim, result, statuses = _c0_restarts_without_its_journal(tmp_path, 10)
    fresh = sim.cells["c0"]
    assert fresh.refused is not None and "--resume" in fresh.refused, fresh.refused
    assert not fresh.fb.ready and not fresh.records  # it took no model and tasked no device
    assert len(result.history) == 10 and "c1" in result.history[-1]["cells_reported"] and not sim.cloud.failed
    why = fresh.refused[:MAX_REASON]  # as a failed push carries it
    failed = [h["cells_failed"] for h in result.history if h.get("cells_failed")]
    assert failed == [{"c0": why}], failed  # once, in the version open when it refused
    assert sim.cloud.refusing == {"c0": why} and "--resume" in why
    fleet = Fleet(run=sim.cfg.run.name)
    fleet.on_status(*[s for s in statuses if b"online" in s[1]][-1])  # its last while it ran
    row = next(v for v in fleet.rows() if v.node == "c0")
    assert row.as_dict(fleet.clock())["refused"] == why and "needs_model" not in row.record
    assert "refuses to work" in str(render(fleet).columns[-1]._cells[0])
    monitor = MonitorState()
    monitor.add_all(parse_record(h) for h in result.history)
    assert f"cell c0 failed, left out by the cloud: {why}" in monitor.alerts(0.0), monitor.alerts(0.0)


def test_an_async_cell_that_refused_to_work_is_back_in_the_job_once_restarted_with_its_journal(tmp_path):
    """c0 refuses to work (started without its journal) and its reason says to restart it with its journal and
    --resume; the operator does: the cloud takes it back (it works again: its status holds a model, no refusal), sends
    it the current version, and later versions count its pushes. Before, it stayed left out of the job for good (no
    version went to it, as its reason said to do), while the pushes of its journaled model were still aggregated."""
    from monitor.state import MonitorState
    from protocols.records import parse_record

    sim, result, _ = _c0_restarts_without_its_journal(tmp_path, 16, then_resumes=True)
    back = sim.cells["c0"]
    assert back.refused is None and back.fb.ready, back.refused
    assert not sim.cloud.refusing and not sim.cloud.failed, (sim.cloud.refusing, sim.cloud.failed)
    refused_at = next(h["round"] for h in result.history if h.get("cells_failed"))
    later = [h["round"] for h in result.history if h["round"] > refused_at and "c0" in h["cells_reported"]]
    assert later and back.fb.global_version > refused_at, (refused_at, later, back.fb.global_version)
    monitor = MonitorState()
    monitor.add_all(parse_record(h) for h in result.history)
    assert not [a for a in monitor.alerts(0.0) if "left out by the cloud" in a], monitor.alerts(0.0)  # back in it


def test_an_async_cell_that_refuses_to_work_fails_the_job_it_was_the_last_cell_of(tmp_path):
    """As above with c0 the job's only cell: no cell is left to work, so the job fails at once saying why (c0's
    reason), rather than wait for c0 for ever (before: no push ever came again, and the cloud waited)."""
    sim, result, _ = _c0_restarts_without_its_journal(tmp_path, 10, cells=1)
    assert sim.cells["c0"].refused is not None
    assert sim.cloud.failed is not None and sim.cloud.failed.startswith("c0 refused to work"), sim.cloud.failed
    assert "--resume" in sim.cloud.failed and "no cell of the job remains" in sim.cloud.failed
    assert len(result.history) < 10


def test_an_async_cell_whose_pushes_are_too_stale_is_sent_the_current_version(tmp_path):
    """In memory: c0 misses cloud versions 2 to 7 (dropped on arrival: a lost connection, or a cell restarted
    afresh that got an old version from its session's queue, as deployed), so it keeps pushing from version 1, which
    grows too stale (max_staleness 2). A push refused as too stale gets its cell the current version (once a version):
    c0 counts again. Before, the async cloud sent versions only to the cells whose pushes it used, and c0's pushes
    were refused for ever: absent from every later version (found deployed, after a fresh restart of c0)."""
    cfg = small_config(
        tmp_path,
        run={"rounds": 16},
        algorithm={"mode": "async", "async_buffer": 2, "edge_rounds": 1, "max_staleness": 2},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
    )
    sim = SimHierarchy(cfg)
    c0 = sim.cells["c0"]
    take, missed = c0._on_cell_task, []

    def lossy(topic: str, data: bytes) -> None:
        version = decode_message(data)[0].round
        if 2 <= version <= 7:
            missed.append(version)
            return
        take(topic, data)

    c0._on_cell_task = lossy  # type: ignore[method-assign]
    result = sim.run()
    assert missed  # c0 did miss versions
    refused = [x for h in result.history for x in h["rejected"] if x.get("from") == "c0" and x["kind"] == "stale"]
    assert refused, "c0's pushes were never too stale: the test proves nothing"
    assert c0.fb.global_version > 7 and any("c0" in h["cells_reported"] for h in result.history[-4:]), [
        h["cells_reported"] for h in result.history
    ]


class _Killed(Exception):
    """The async cloud's process ends here (its report handler catches it: the in-memory loop goes on)."""


def _dies_after_journaling(sim: SimHierarchy, version: int, restart: Callable[[], None], after: float) -> list[Any]:
    """Make ``sim``'s async cloud die (crashed, stopped) just after it journals a push of ``version``, once, and call
    ``restart`` ``after`` seconds later; returns the list the dying push's cell is appended to."""
    cloud, killed = sim.cloud, []
    taken = cloud.journal.taken

    def dies_after(v: int, topic: str, data: bytes) -> None:
        taken(v, topic, data)
        if v == version and not killed:  # journaled, not yet counted: the cloud dies
            killed.append(topic.split("/")[-2])
            cloud.transport.crash()
            cloud.stop()
            sim.hub.loop.call_later(after, restart)
            raise _Killed

    cloud.journal.taken = dies_after  # type: ignore[method-assign]
    _survives_its_death(cloud)
    return killed


def _survives_its_death(cloud: Any) -> None:
    """``cloud``'s report handler catches the :class:`_Killed` its process ended with."""
    on_report = cloud._on_report

    def report(topic: str, data: bytes) -> None:
        with contextlib.suppress(_Killed):
            on_report(topic, data)

    cloud._on_report = report  # type: ignore[method-assign]


def test_a_killed_async_cloud_resumes_its_version_with_the_pushes_it_had_buffered(tmp_path):
    """In memory, virtual clock: the async cloud dies just after it journaled a push of version 3 (buffer 3: the
    push waits in the buffer), and comes back 2 s later with --resume: it continues at version 3 with that push
    buffered again (so version 3 applies it), keeps its session, and every version is recorded once. Before,
    `fedtier cloud --resume` under algorithm.mode = "async" was refused."""
    cfg = small_config(
        tmp_path,
        run={"rounds": 6},
        algorithm={"mode": "async", "async_buffer": 2, "async_cloud_buffer": 3, "edge_rounds": 1},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
    )
    sim = SimHierarchy(cfg)
    first = sim.cloud
    session = first.session
    offered: list[tuple[int, str, float]] = []  # (version, cell, clock) of each push the resumed cloud buffers

    def restart() -> None:
        sim.cloud = again = sim._build_cloud(None, resume=True)
        offer = again.fb.offer
        again.fb.offer = lambda cell, base, report: (
            offered.append((again.round, cell, sim.hub.loop.now())),
            offer(cell, base, report),
        )
        killed.append(sim.hub.loop.now())
        again.start()

    killed = _dies_after_journaling(sim, 3, restart, 2.0)
    result = sim.run()
    resumed = sim.cloud
    assert killed and resumed is not first and resumed.resumed and resumed.session == session
    # the journaled push, buffered again at the start, in version 3 (the copy its cell sends again on getting
    # version 3 anew, which alone would cover a push the cloud had not journaled, arrives later: a repeat, dropped)
    assert offered[0] == (3, killed[0], killed[1]), (offered, killed)
    assert [h["round"] for h in result.history] == [3, 4, 5]  # the resumed cloud's records
    lines = (sim.output_dir / runfiles.METRICS).read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [0, 1, 2, 3, 4, 5]
    refused = [x for r in result.cell_records for x in r["rejected"] if x["device"] == "cloud"]
    assert not refused, refused  # no cell refused the resent version it held


def test_a_resumed_async_cloud_takes_its_journaled_pushes_before_those_its_broker_session_held(tmp_path):
    """The cloud dies just after journaling a push of version 3 (buffer 2); the cells push on while it is down, and
    its persistent broker session holds those pushes, handed to its report handler as it subscribes (before its
    start). The journaled push goes first, into version 3, as in an uninterrupted run. Before, the held pushes came
    first: they filled version 3 before the start, the journal was reset to version 4 without the journaled push,
    which went into version 4 instead, journaled nowhere (a second crash lost it); and the versions made before the
    start shared one count of devices (version 4's record counted version 3's as well)."""

    cfg = small_config(
        tmp_path,
        run={"rounds": 6},
        algorithm={"mode": "async", "async_buffer": 2, "async_cloud_buffer": 2, "edge_rounds": 1},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
    )
    sim = SimHierarchy(cfg)
    first, held = sim.cloud, []

    def broker_session(topic: str, data: bytes) -> None:  # what the cloud's persistent session queues while down
        if killed and sim.cloud is first:
            held.append((topic, bytes(data)))

    sim.hub.connect("session-of-cloud").subscribe(topics.cell_reports(cfg.run.name), broker_session)
    offered: list[tuple[int, str]] = []  # (version, cell) of each push the resumed cloud buffers

    def restart() -> None:
        sim.cloud = again = sim._build_cloud(None, resume=True)
        offer, subscribe = again.fb.offer, again.transport.subscribe
        again.fb.offer = lambda cell, base, report: (offered.append((again.round, cell)), offer(cell, base, report))

        def subscribing(pattern: str, handler, **kw) -> None:  # the held messages go to the first handler
            subscribe(pattern, handler, **kw)
            if pattern == topics.cell_reports(cfg.run.name):
                for topic, data in held:
                    sim.hub.loop.post(lambda t=topic, d=data: handler(t, d))

        again.transport.subscribe = subscribing
        again.start()

    killed = _dies_after_journaling(sim, 3, restart, 2.0)
    result = sim.run()
    assert killed and len(held) >= 2, held  # enough held pushes to fill a version before the start
    assert offered[0] == (3, killed[0]), offered  # the journaled push first, in version 3
    assert [h["round"] for h in result.history] == [3, 4, 5]
    # each version held before the start counts its own pushes' devices (not the versions' before it as well)
    assert all(set(h["devices"]) == set(h["cells_reported"]) for h in result.history), result.history


def test_a_resumed_async_cloud_whose_job_is_done_makes_no_version_of_a_push_held_for_it(tmp_path):
    """A finished async job's cloud started again with --resume (no more rounds) finishes: a push its broker session
    held for it, handed over as it subscribes (before its posted finish), makes no version past run.rounds and
    sends no cell a model."""
    cfg = small_config(
        tmp_path,
        run={"rounds": 3},
        algorithm={"mode": "async", "async_buffer": 2, "async_cloud_buffer": 1, "edge_rounds": 1},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
    )
    sim = SimHierarchy(cfg)
    pushes: list[tuple[str, bytes]] = []
    sim.hub.connect("session-of-cloud").subscribe(
        topics.cell_reports(cfg.run.name), lambda t, d: pushes.append((t, bytes(d)))
    )
    sim.run()
    assert pushes
    again = sim._build_cloud(None, resume=True)
    assert again.round == 3
    subscribe, sent = again.transport.subscribe, []

    def subscribing(pattern: str, handler, **kw) -> None:  # the held push goes to the first handler
        subscribe(pattern, handler, **kw)
        if pattern == topics.cell_reports(cfg.run.name):
            sim.hub.loop.post(lambda: handler(*pushes[-1]))

    again.transport.subscribe = subscribing
    again._send_task = sent.append  # type: ignore[method-assign]
    again.start()
    sim.hub.loop.run(until=lambda: again.finished, max_steps=10_000)
    assert again.finished and again.round == 3 and not sent, (again.round, sent)
    lines = (sim.output_dir / runfiles.METRICS).read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [0, 1, 2]


def test_a_resumed_async_cell_sent_its_held_version_again_sends_its_journaled_push_again(tmp_path):
    """c0 dies right after it journaled (and sent) a push from the cloud version it holds, and resumes from its
    journal. A resumed cloud that then sends it that version again (a cloud task of the version it holds, in its
    session: it may have lost the push, taken by the broker and not journaled) gets the push again, as from a cell
    that never stopped. Before, a resumed cell knew no last push (only its start sent the journaled one) and sent
    nothing."""

    cfg = small_config(
        tmp_path,
        run={"rounds": 6},
        algorithm={"mode": "async", "async_buffer": 2, "edge_rounds": 1},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
    )
    sim = SimHierarchy(cfg)

    first = sim.cells["c0"] = _journaled_c0(sim)
    pushed, journaled = first.push_journal.pushed, []

    def dies_after(message: bytes, version: int) -> None:
        pushed(message, version)
        if first.fb.global_version >= 1 and not journaled:
            journaled.append((first.fb.global_version, bytes(message)))
            sim.hub.loop.post(lambda: (first.transport.crash(), first.stop()))

    first.push_journal.pushed = dies_after  # type: ignore[method-assign]
    sim.run()  # (the job goes on without c0)
    assert journaled
    again = _journaled_c0(sim, resume=True)
    again.start()
    assert again.fb.global_version == journaled[0][0]
    sent: list[bytes] = []
    again.transport.publish = lambda topic, data, **kw: sent.append(bytes(data))  # type: ignore[method-assign]
    cloud, topic = (
        Messenger(sim.hub.connect("cloud-again"), cfg.run.name, "cloud"),
        topics.cell_task(cfg.run.name, "c0"),
    )
    task = Payload({}, {k: np.asarray(v) for k, v in again.fb.pushed.items()})
    again._on_cell_task(topic, cloud.frame("cell_task", task, round=journaled[0][0], cell="c0", topic=topic))
    assert sent == [journaled[0][1]]  # the version it holds, again (a resumed cloud's start): its push again


def test_an_async_cells_journal_keeps_its_model_newest_version_and_last_push_and_a_push_leaves_the_model(tmp_path):
    """What a resumed async cell continues from: the cloud model it adopted last, the newest model version it used
    and its last push, kept across a newer cloud model; a push rewrites the small journal only, never the model file
    (it was a full model write and fsync a push)."""
    from cell_server.async_recovery import AsyncJournal

    path = tmp_path / "cell-c0.journal"
    journal = AsyncJournal(path)
    journal.adopted(2, "s", {"w": np.zeros(3, np.float32)}, version=4)
    journal.updated(5)
    model_file = path.with_name(path.name + ".model")
    written = model_file.stat().st_ino
    journal.pushed(b"push-of-version-2", version=5)
    assert model_file.stat().st_ino == written  # the push did not write the model again
    journal.adopted(3, "s", {"w": np.ones(3, np.float32)}, version=6)
    journal.close()
    assert [e.meta["k"] for e in Journal(path).read()] == ["version", "push"]
    resumed = AsyncJournal(path).load(resume=True)
    assert resumed is not None and (resumed.global_version, resumed.session, resumed.version) == (3, "s", 6)
    assert resumed.push == b"push-of-version-2" and resumed.model["w"].tolist() == [1.0] * 3
    fresh = AsyncJournal(path)
    assert fresh.load(resume=False) is None and fresh.used == 6  # afresh: both files go, the newest version stays
    assert not path.exists() and not model_file.exists()


_JOURNALED = [  # what an async cell journals: adoptions (cloud version), updates, pushes (after the update they carry)
    ("adopted", 1, 0),
    ("updated", None, 1),
    ("pushed", b"p1", 2),
    ("adopted", 2, 3),
    ("updated", None, 4),
    ("pushed", b"p2", 5),
    ("adopted", 3, 6),
    ("pushed", b"p3", 7),
]


def _journal_until_killed(path, kill_at: int, monkeypatch) -> list[tuple]:
    """Journal :data:`_JOURNALED` at ``path``, killed (OSError) at the ``kill_at``-th write point: before a file is
    written or appended to, before an fsync, before a rename; the state (cloud version, push, version) once each
    operation returned, from before the first."""
    import os

    from cell_server.async_recovery import AsyncJournal
    from protocols import checkpoint

    calls = [0]

    def killable(real):
        def call(*args):
            calls[0] += 1
            if calls[0] == kill_at:
                raise OSError("killed")
            return real(*args)

        return call

    monkeypatch.setattr(os, "fsync", killable(os.fsync))
    monkeypatch.setattr(os, "replace", killable(os.replace))
    monkeypatch.setattr(checkpoint, "private_file", killable(checkpoint.private_file))
    monkeypatch.setattr(Journal, "append", killable(Journal.append))
    journal, done, g, push = AsyncJournal(path), [(None, None, -1)], None, None
    try:
        for what, arg, version in _JOURNALED:
            if what == "adopted":
                journal.adopted(arg, f"s{arg}", {"w": np.full(3, float(arg), np.float32)}, version)
                g = arg
            elif what == "updated":
                journal.updated(version)
            else:
                journal.pushed(arg, version)
                push = arg
            done.append((g, push, version))
    except OSError:
        pass
    finally:
        monkeypatch.undo()
        journal.close()
    return done


def test_an_async_cell_killed_at_any_write_of_its_journal_resumes_from_a_consistent_one(tmp_path, monkeypatch):
    """A kill at each write point of the journal (between two writes, a file written but not renamed, an append
    not yet durable, the model file written but not the journal file): the resumed cell holds a cloud model it
    adopted, with its session, the push it made last or the one it was writing, and a version past every one a
    task could have carried, no newer than it reached."""
    from cell_server.async_recovery import AsyncJournal

    kill_at = 1
    while len(done := _journal_until_killed(tmp_path / f"k{kill_at}" / "c.journal", kill_at, monkeypatch)) <= len(
        _JOURNALED
    ):
        before = done[-1]  # the state committed; the operation in progress would make ``after``
        what, arg, version = _JOURNALED[len(done) - 1]
        after = (arg if what == "adopted" else before[0], arg if what == "pushed" else before[1], version)
        resumed = AsyncJournal(tmp_path / f"k{kill_at}" / "c.journal").load(resume=True)
        if before[0] is None:  # killed in the first adoption: nothing to resume, or that model
            assert resumed is None or (resumed.global_version, resumed.push, resumed.version) == (1, None, 0), kill_at
        else:
            assert resumed is not None, kill_at
            g = resumed.global_version
            assert g in {before[0], after[0]} and resumed.session == f"s{g}", kill_at
            assert resumed.model["w"].tolist() == [float(g)] * 3, kill_at
            assert resumed.push in {before[1], after[1]}, kill_at
            assert before[2] <= resumed.version <= after[2], kill_at
        kill_at += 1
    assert kill_at > 20  # every adoption's two writes (model file, then the journal file's first), append, push


def test_an_async_cell_restarted_without_its_journal_after_the_cloud_resumed_refuses_saying_to_resume(tmp_path):
    """The async cloud dies (after journaling a push of version 3) and resumes 2 s later; c0 dies while it is down
    and comes back just after, its journal deleted. The resumed cloud still knows c0 held a model (its journal keeps
    who did), so the version it sends c0 says ``held`` and c0 refuses it saying to resume, as from a cloud that never
    stopped. Before, the resumed cloud had forgotten, c0 took the version as a first model, tasked its devices from
    version 0 again, they refused every task as a replay, and c0 stalled without a word."""

    cfg = small_config(
        tmp_path,
        run={"rounds": 8},
        algorithm={"mode": "async", "async_buffer": 2, "async_cloud_buffer": 3, "edge_rounds": 1},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
    )
    sim = SimHierarchy(cfg)
    first_cell = sim.cells["c0"] = _journaled_c0(sim, samples=False, will=True)
    cloud = sim.cloud

    def restart_c0() -> None:
        for path in sim.output_dir.glob("cell-c0.journal*"):
            path.unlink()
        sim.cells["c0"] = again = _journaled_c0(sim, samples=False, will=True)
        again.start()

    def restart_cloud() -> None:
        sim.cloud = again = sim._build_cloud(None, resume=True)
        again.start()
        sim.hub.loop.call_later(0.5, restart_c0)

    def c0_dies_while_the_cloud_is_down() -> None:  # 1 s after the cloud, which restarts 1 s later
        first_cell.transport.crash()
        first_cell.stop()
        sim.hub.loop.call_later(1.0, restart_cloud)

    killed = _dies_after_journaling(sim, 3, c0_dies_while_the_cloud_is_down, 1.0)
    result = sim.run()
    fresh = sim.cells["c0"]
    assert killed and sim.cloud is not cloud and fresh is not first_cell
    assert fresh.refused is not None and "--resume" in fresh.refused, (fresh.refused, fresh.fb.ready)
    assert not fresh.fb.ready and not fresh.records  # it took no model and tasked no device
    assert [h["round"] for h in result.history][-1] == 7 and "c1" in result.history[-1]["cells_reported"]


def test_a_resumed_async_cloud_refuses_a_push_from_a_version_it_never_sent_that_cell(tmp_path):
    """In memory, one cell of the two drawn a version (cell participation): the async cloud dies after taking a push of
    version 2 and resumes 1 s later. The cell not drawn for version 2 was never sent it; a node with its credentials
    pushes from version 2 (no staleness discount). The resumed cloud assumed every cell had been sent its version,
    and took it; now it journals the versions it sends each cell (before sending), and refuses it as never sent."""

    cfg = small_config(
        tmp_path,
        run={"rounds": 4},
        algorithm={"mode": "async", "async_buffer": 2, "edge_rounds": 1},
        participation={"model": "uniform", "level": "cell", "per_round": 1},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
    )
    sim = SimHierarchy(cfg)
    claims: list[tuple[str, int]] = []

    def claim() -> None:  # the cell not drawn for the resumed version pushes from it
        again = sim.cloud
        liar = next(c for c in again.cells if c not in again.availability(again.round))
        zeros = {k: np.zeros_like(v) for k, v in again.role.global_params().items()}
        topic = topics.cell_report(cfg.run.name, liar)
        push = Payload({"weight": 1.0, "updates": 1, "devices": 1}, zeros)
        claims.append((liar, again.round))
        again._on_report(
            topic, sim.cells[liar].messenger.frame("cell_report", push, round=again.round, cell=liar, topic=topic)
        )

    def restart_cloud() -> None:
        sim.cloud = again = sim._build_cloud(None, resume=True)
        again.start()
        claim()

    _dies_after_journaling(sim, 2, restart_cloud, 1.0)
    result = sim.run()
    ((liar, version),) = claims
    assert [h["round"] for h in result.history] == [2, 3] and version == 2  # (the resumed cloud's records)
    refused = [x for h in result.history for x in h.get("rejected") or [] if x["from"] == liar]
    assert any(f"from version {version}, which was never sent to it" in x["reason"] for x in refused), refused
    assert not any(e.sender == liar and e.base == version for e in sim.cloud.fb.buffer.entries)


@pytest.mark.skipif(not find_mosquitto(), reason="mosquitto not installed")
@pytest.mark.parametrize("max_chunk", [256 * 1024, 1024], ids=["whole", "chunked"])
def test_a_push_the_async_cloud_died_on_before_journaling_comes_again_after_resume_and_counts_once(tmp_path, max_chunk):
    """Over a real broker: the async cloud (persistent session) is killed in its push handler before the push is
    journaled; ``--resume`` (the same client id) gets that push again from the broker and version 0 counts it once,
    with the other cell's. Before, the push was acknowledged before its handler ran: the broker forgot it, and
    version 0 never had it (note13). The same for a push of 11 chunks (9,911 bytes in chunks of 1,024): its first
    chunks were acknowledged as they came, so the resumed cloud got only the last one again, which expired."""
    from cloud.node import build_cloud
    from protocols.transport.broker import MosquittoBroker
    from protocols.transport.mqtt import MqttTransport
    from protocols.transport.threadloop import ThreadLoop
    from tests.conftest import wait_until

    cfg = small_config(
        tmp_path,
        run={"rounds": 1},
        algorithm={"mode": "async", "async_buffer": 2, "async_cloud_buffer": 2, "edge_rounds": 1},
    )
    sim = SimHierarchy(cfg)  # in memory first: one real push of version 0 from each cell
    pushes: dict[str, bytes] = {}
    sim.hub.connect("tap").subscribe(
        topics.cell_reports(cfg.run.name), lambda t, d: pushes.setdefault(t.split("/")[-2], bytes(d))
    )
    sim.run()
    assert set(pushes) == {"c0", "c1"}
    out, loop = tmp_path / "cloud", ThreadLoop("cloud").start()

    def cloud(broker: MosquittoBroker, resume: bool) -> Any:
        transport = MqttTransport.from_url(broker.url, "fedtier-async-cloud", loop, persistent=True).connect(10.0)
        return build_cloud(cfg, transport, sim.algorithm, output_dir=out, resume=resume)

    try:
        with MosquittoBroker() as broker:
            first = cloud(broker, resume=False)

            class Killed(Exception):
                pass

            def dies_before_journaling(version: int, topic: str, data: bytes) -> None:
                first.transport.publish(f"{cfg.run.name}/probe", b"alive")  # the broker answers it after all this
                assert first.transport.flush(10.0)  # client sent before it (as a cloud that lived a little longer)
                first.transport.crash()  # killed here: nothing of the push journaled
                raise Killed  # the process ends here (caught below: the loop goes on)

            def report(topic: str, data: bytes, on_report=first._on_report) -> None:
                with contextlib.suppress(Killed):
                    on_report(topic, data)

            first.journal.taken = dies_before_journaling  # type: ignore[method-assign]
            first._on_report = report  # type: ignore[method-assign]
            loop.post(first.start)
            assert wait_until(lambda: first.started)
            cells = MqttTransport.from_url(broker.url, "cells", loop, max_chunk=max_chunk).connect(10.0)
            cells.publish(topics.cell_report(cfg.run.name, "c0"), pushes["c0"])
            assert wait_until(lambda: first.transport.closed), "the cloud never took the push"
            assert first.transport.stats.packets_in >= (11 if max_chunk == 1024 else 1)
            first.stop()
            again = cloud(broker, resume=True)  # its next session: the broker hands the push again
            records: list[dict] = []
            again.observers.append(records.append)
            loop.post(again.start)
            assert wait_until(lambda: bool(again.fb.buffer.entries)), "the push never came again"
            cells.publish(topics.cell_report(cfg.run.name, "c1"), pushes["c1"])
            assert wait_until(lambda: bool(records)), "version 0 was never made"
            assert records[0]["round"] == 0 and records[0]["cells_reported"] == ["c0", "c1"], records[0]
            cells.close()
            again.stop()
    finally:
        loop.stop()


_PUSHING = {"mode": "async", "async_buffer": 2, "edge_rounds": 1}
"""An async run pushing fast: a push every 2 device results, one edge round a push."""


def _pushes_of_version_0(tmp_path, cloud_buffer: int) -> dict[str, list[bytes]]:
    """The real pushes of each cell of an in-memory run of one version, of ``cloud_buffer`` pushes (from version 0)."""
    algorithm = {**_PUSHING, "async_cloud_buffer": cloud_buffer}
    sim_cfg = small_config(tmp_path / "sim", run={"rounds": 1}, algorithm=algorithm)
    sim = SimHierarchy(sim_cfg, write_output=False)
    pushes: dict[str, list[bytes]] = {"c0": [], "c1": []}
    tap = sim.hub.connect("tap")
    for cell, got in pushes.items():
        tap.subscribe(topics.cell_report(sim_cfg.run.name, cell), lambda t, d, got=got: got.append(bytes(d)))
    sim.run()
    return {cell: [p for p in got if decode_message(p)[0].round == 0] for cell, got in pushes.items()}


def _cloud_killed_at_version_0(tmp_path, pushes: list[tuple[str, bytes]], share: int, check) -> None:
    """Over a real broker, an async cloud (2 versions, ``async_cloud_buffer`` 2, ``share`` pushes a cell a version)
    is sent ``pushes`` (cell, push): ``share`` of c0's and of c1's first, the others past it. All are handed to its
    loop before it takes the first: the version they make due comes behind them, and the cloud dies making it.
    ``check(again, records)`` on the cloud resumed in its place."""
    from cloud.node import build_cloud
    from protocols.transport.broker import MosquittoBroker
    from protocols.transport.mqtt import MqttTransport
    from protocols.transport.threadloop import ThreadLoop
    from tests.conftest import wait_until

    cfg = small_config(tmp_path, run={"rounds": 2}, algorithm={**_PUSHING, "async_cloud_buffer": 2})
    sim = SimHierarchy(cfg, write_output=False)  # (its roles only)
    out, loop = tmp_path / "cloud", ThreadLoop("cloud").start()

    def cloud(broker: MosquittoBroker, resume: bool) -> Any:
        transport = MqttTransport.from_url(broker.url, "fedtier-async-cloud", loop, persistent=True).connect(10.0)
        built = build_cloud(cfg, transport, sim.algorithm, output_dir=out, resume=resume)
        built.take_per_cell = share
        return built

    try:
        with MosquittoBroker() as broker:
            first = cloud(broker, resume=False)

            def dies() -> None:  # the version due, the pushes past their share waiting behind it: the process ends
                first.transport.crash()
                first._on_report = lambda topic, data: None  # type: ignore[method-assign]

            first._make_version = dies  # type: ignore[method-assign]
            loop.post(first.start)
            assert wait_until(lambda: first.started)
            ready = loop._ready  # every push handed to the loop before it takes the first: a version due behind them
            loop.post(lambda: wait_until(lambda: len(ready) >= len(pushes), timeout=10.0))
            cells = MqttTransport.from_url(broker.url, "cells", loop).connect(10.0)
            for cell, push in pushes:
                cells.publish(topics.cell_report(cfg.run.name, cell), push)
            assert wait_until(lambda: first.transport.closed), "no version came due"
            drained = threading.Event()  # the loop past what it had when the cloud died (a waiting push's hand-back)
            loop.post(drained.set)
            assert drained.wait(10.0), "the cloud's loop is stuck"
            taken = first.fb.buffer.held
            shares = sum(min(share, [c for c, _ in pushes].count(c)) for c in ("c0", "c1"))
            assert taken == shares and not any(first._waiting.values()), (taken, first._waiting)
            first.stop()
            again = cloud(broker, resume=True)
            records: list[dict] = []
            again.observers.append(records.append)
            loop.post(again.start)
            assert wait_until(lambda: bool(records)), "version 0 was never made"
            assert records[0]["metrics"]["pushes"] == taken, records[0]  # those journaled
            check(again, records)
            cells.close()
            again.stop()
    finally:
        loop.stop()


def test_a_push_waiting_past_its_cells_share_comes_again_to_a_resumed_async_cloud(tmp_path):
    """Over a real broker: c0's third push of version 0 comes while its first two (its share, 2) made a version due:
    it waits behind the version, and the cloud dies before it takes it. It was acknowledged as it was put back to
    wait, not journaled: the broker forgot it, and the resumed cloud never had it. Now it waits unacknowledged (one
    of ``UNACKED_WAITING``): the resumed cloud, after version 0 of the two journaled, gets it from the broker and
    takes it."""
    from tests.conftest import wait_until

    c0 = _pushes_of_version_0(tmp_path, 6)["c0"]
    assert len(c0) >= 3, len(c0)

    def check(again: Any, records: list[dict]) -> None:
        assert wait_until(lambda: again.fb.buffer.held == 1), "the waiting push never came again"

    _cloud_killed_at_version_0(tmp_path, [("c0", p) for p in c0[:3]], 2, check)


def test_a_flooding_cell_leaves_an_unacknowledged_place_for_another_cells_push_waiting_at_a_cloud_killed(tmp_path):
    """Over a real broker, 4 pushes a cell a version (its share): c0's and c1's first 4 make version 0 due; c0 (a node
    with its credentials) floods 4 more (one push, again) before it is made, then c1's fifth comes, all waiting behind
    the version; the cloud dies making it. The ``UNACKED_WAITING`` (4) places for waiting pushes unacknowledged were
    shared: c0's flood took them all, so c1's push waited acknowledged, and the broker never handed it to the resumed
    cloud (lost). Now a cell holds at most ``UNACKED_PER_CELL`` of them: c1's push comes again to the resumed cloud,
    which makes version 1 of it and c0's fifth."""
    from tests.conftest import wait_until

    pushes = _pushes_of_version_0(tmp_path, 12)
    c0, c1 = pushes["c0"], pushes["c1"]
    assert len(c0) >= 5 and len(c1) >= 5, (len(c0), len(c1))
    sent = [*(("c0", p) for p in c0[:4]), *(("c1", p) for p in c1[:4]), *[("c0", c0[4])] * 4, ("c1", c1[4])]

    def check(again: Any, records: list[dict]) -> None:
        assert wait_until(lambda: len(records) == 2), "c1's waiting push never came again: no version 1"
        assert records[1]["cells_reported"] == ["c0", "c1"], records[1]

    _cloud_killed_at_version_0(tmp_path, sent, 4, check)


def test_an_async_device_flipping_its_status_gets_a_bounded_number_of_tasks_per_version_and_still_works(tmp_path):
    """In memory, virtual clock: a node with c0-d1's credentials flips its status offline/online 100 times at once.
    Each return had the async cell send a fresh task (a whole model) at once: 100 tasks in one version, counted as the
    job's traffic. Now a device back without its result gets at most ``MAX_RESENDS`` tasks per cell version, counted
    in ``bytes_resent`` (not ``bytes_out``); past that it is held back until the next version, which it gets: the
    honest agent goes on answering and the job finishes."""
    from cell_server.edge_liveness import MAX_RESENDS
    from protocols.status import encode_status

    cfg = small_config(
        tmp_path,
        run={"rounds": 6},
        topology={"cells": 1, "devices_per_cell": 3},
        algorithm={"mode": "async", "async_buffer": 2, "edge_rounds": 1},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
    )
    sim = SimHierarchy(cfg, write_output=False)
    run, liar = cfg.run.name, sim.hub.connect("liar")
    tasks: list[tuple[float, int, int]] = []  # (time, cell version, task number) of each task c0-d1 was sent
    sizes: list[int] = []
    topic = topics.device_status(run, "c0", "c0-d1")

    def flip() -> None:
        for _ in range(100):
            for state in ("offline", "online"):
                liar.publish(topic, encode_status(state, topic=topic, cell="c0", samples=10), retain=True)

    def on_task(_: str, data: bytes) -> None:
        tasks.append((sim.hub.loop.now(), *_version_and_number(data)))
        sizes.append(len(data))
        if len(tasks) == 1:  # while c0-d1 trains its first task
            sim.hub.loop.call_later(0.1, flip)

    liar.subscribe(topics.device_task(run, "c0", "c0-d1"), on_task)
    result = sim.run()
    assert len(result.history) == 6 and not sim.cloud.failed
    per_version: dict[int, int] = {}
    for _, version, _ in tasks:
        per_version[version] = per_version.get(version, 0) + 1
    assert per_version[tasks[0][1]] == 1 + MAX_RESENDS, tasks  # its first task, then 3 on its returns (was 101)
    records = sim.cells["c0"].records
    resent = sum(r.get("bytes_resent") or 0 for r in records)
    # the 3 tasks of its returns, then the one of the next version (it was held back): apart from bytes_out
    assert resent == sum(sizes[1 : MAX_RESENDS + 2]), (resent, sizes, tasks)
    later = [r for r in records if r["clock_end_s"] > tasks[0][0] + 0.1 and "c0-d1" in r["answered"]]
    assert later, [(r["clock_end_s"], r["answered"]) for r in records]  # held back, then it worked again


def test_an_async_cell_whose_devices_all_flap_in_one_version_works_on_and_a_liar_stays_bounded(tmp_path):
    """In memory, virtual clock, one cell: every device flips offline/online 5 times at once while it trains its
    first task, and c0-d1 (a node with its credentials) flips again on every task it gets, 100 flips at most. Each
    device got ``MAX_RESENDS`` tasks on its returns, then was held back until the next version: with every device
    held back no result came, so no version: the job stalled ("no events left"). Now a cell left with no task
    outstanding sends its held-back devices one more task after ``device_deadline``: the job finishes, and the liar
    costs at most ``MAX_RESENDS`` + 2 tasks a cell version (its first, its returns', the idle one), not 100."""
    from cell_server.edge_liveness import MAX_RESENDS
    from protocols.status import encode_status

    cfg = small_config(
        tmp_path,
        run={"rounds": 6},
        topology={"cells": 1, "devices_per_cell": 3},
        algorithm={"mode": "async", "async_buffer": 2, "edge_rounds": 1},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
    )
    sim = SimHierarchy(cfg, write_output=False)
    run, net, loop = cfg.run.name, sim.hub.connect("net"), sim.hub.loop
    devices = ["c0-d0", "c0-d1", "c0-d2"]
    tasks: dict[str, list[tuple[float, int]]] = {d: [] for d in devices}  # (time, cell version) of each task
    flips = {"c0-d1": 0}

    def flip(device: str, times: int) -> None:
        topic = topics.device_status(run, "c0", device)
        for _ in range(times):
            for state in ("offline", "online"):
                net.publish(topic, encode_status(state, topic=topic, cell="c0", samples=10), retain=True)

    def flap() -> None:
        for device in devices:
            flip(device, 5)

    def on_task(device: str, data: bytes) -> None:
        tasks[device].append((loop.now(), _version_and_number(data)[0]))
        if sum(map(len, tasks.values())) == len(devices):  # while each trains its first task
            loop.call_later(0.1, flap)
        elif device == "c0-d1" and flips["c0-d1"] < 100 and len(tasks[device]) > 1 + MAX_RESENDS:
            flips["c0-d1"] += 1
            loop.call_later(0.01, lambda: flip(device, 1))

    for device in devices:
        net.subscribe(topics.device_task(run, "c0", device), lambda _, data, d=device: on_task(d, data))
    result = sim.run()
    assert len(result.history) == 6 and not sim.cloud.failed  # was: stalled, no events left
    flapped = tasks["c0-d0"][1][0]
    for device in devices:  # its first task, then MAX_RESENDS on its returns; the next one device_deadline later
        at_once = [t for t, _ in tasks[device] if t <= flapped]
        assert len(at_once) == 1 + MAX_RESENDS, (device, tasks[device])
        assert tasks[device][len(at_once)][0] >= flapped + cfg.runtime.device_deadline, (device, tasks[device])
    per_version: dict[int, int] = {}
    for _, version in tasks["c0-d1"]:
        per_version[version] = per_version.get(version, 0) + 1
    assert max(per_version.values()) <= MAX_RESENDS + 2, per_version
    assert flips["c0-d1"] >= 6, flips  # it lied on every version it had a task of


def _version_and_number(data: bytes) -> tuple[int, int]:
    header, _ = decode_message(data)
    return header.round, header.edge_round


def _c1_aggregation_raises(tmp_path, cells: int = 2, **runtime) -> tuple[SimHierarchy, Any]:
    """An async sim (8 cloud versions) whose cell c1 (or c0, the only cell) raises KeyError on its second update."""
    cfg = small_config(
        tmp_path,
        run={"rounds": 8},
        topology={"cells": cells, "devices_per_cell": 3},
        algorithm={"mode": "async", "async_buffer": 2, "edge_rounds": 1},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
        runtime=runtime,
    )
    sim = SimHierarchy(cfg, write_output=False)
    cell = sim.cells["c1" if cells > 1 else "c0"]
    flush = cell._flush

    def broken() -> None:
        if cell.fb.version >= 2:
            raise KeyError("weight")
        flush()

    cell._flush = broken
    return sim, sim.run()


def test_an_async_cell_whose_handler_raises_fails_the_job(tmp_path):
    """c1's aggregation raises (a bug): it sends a "failed" push with the reason, and the cloud fails the job with it
    (``runtime.fail_on_cell_failure``, on by default), as the cloud of rounds does. Before, the async cell sent
    nothing (its failure waited for a round it never enters) and the async cloud ignored the setting: the job
    'finished' with c0 alone."""
    sim, result = _c1_aggregation_raises(tmp_path)
    c1 = sim.cells["c1"]
    assert c1.failure is not None and "raised KeyError: 'weight'" in c1.failure
    assert result.status == "failed" and len(result.history) < 8, (result.status, len(result.history))
    assert re.fullmatch(r"cell c1 failed at version \d+: cell c1: .+ raised KeyError: 'weight'", result.failed)


def test_an_async_cell_that_failed_is_left_out_when_the_job_must_not_depend_on_one_cell(tmp_path):
    """runtime.fail_on_cell_failure = false: c1 fails (its aggregation raises), its "failed" push has the cloud leave
    it out of the job with the reason (``cells_failed``, once; no version goes to it: its status says it failed) and
    the job finishes with c0; with c0 the only cell, the job fails saying no cell remains (runtime.min_cells)."""
    sim, result = _c1_aggregation_raises(tmp_path, fail_on_cell_failure=False)
    c1 = sim.cells["c1"]
    assert result.status == "finished" and len(result.history) == 8, result.failed
    failed = [(h["round"], h["cells_failed"]) for h in result.history if h.get("cells_failed")]
    assert len(failed) == 1 and failed[0][1] == {"c1": c1.failure[:200]}, failed
    later = [h["cells_reported"] for h in result.history if h["round"] > failed[0][0]]
    assert later and all(cells == ["c0"] for cells in later), later
    assert c1.fb.global_version <= failed[0][0] and sim.cloud.refusing == {"c1": c1.failure[:200]}
    sim, result = _c1_aggregation_raises(tmp_path / "one", cells=1, fail_on_cell_failure=False)
    assert result.status == "failed" and result.failed.startswith("c0 failed (cell c0: "), result.failed
    assert "no cell of the job remains" in result.failed


class _SlowCloud:
    """The cloud busy ``cost`` virtual seconds after each version it makes (its evaluation and checkpoint): a push
    that comes meanwhile waits, and when the cloud is free every push that waited is handed to its loop at once, as
    a real loop's queue holds them (``ThreadLoop``: the MQTT thread posts each push as it comes)."""

    def __init__(self, cloud: Any, cost: float) -> None:
        self.cloud, self.cost, self.free_at, self.waiting = cloud, cost, 0.0, []
        self.take, cloud._on_report = cloud._on_report, self.on_report
        record = cloud._record_round

        def recorded(*args: Any) -> None:
            record(*args)
            self.free_at = cloud.loop.now() + cost

        cloud._record_round = recorded

    def on_report(self, topic: str, data: bytes) -> None:
        loop = self.cloud.loop
        if loop.now() >= self.free_at:
            self.take(topic, data)
            return
        if not self.waiting:
            loop.call_later(self.free_at - loop.now(), self.hand_over)
        self.waiting.append((topic, data))

    def hand_over(self) -> None:
        waiting, self.waiting = self.waiting, []
        for topic, data in waiting:
            self.cloud.loop.post(lambda t=topic, d=data: self.on_report(t, d))


def _stale_refusals(history: list[dict]) -> list[dict]:
    return [x for h in history for x in h["rejected"] if x["kind"] == "stale"]


def test_an_async_cloud_slower_than_its_cells_pushes_takes_every_push_waiting_and_stays_fresh():
    """The cloud is busy 0.6 s (virtual) after each version while its 2 cells push 4 times a second, with the
    defaults (async_cloud_buffer = 1, async_push_every = 1). A version takes every push waiting when it is made,
    so staleness stays near sim's and no push is refused as too stale. Before, the cloud made one version a push:
    pushes queued ever later, staleness sat at max_staleness (6) from version 6 on, 24 pushes were refused and
    accuracy was 0.81 after 30 versions, 0.88 now (found deployed: 54 refused over 150 versions)."""
    cfg = parse_config(_cfg("async", 30, async_buffer=2, max_staleness=6))
    fast = SimHierarchy(cfg, write_output=False).run()
    sim = SimHierarchy(cfg, write_output=False)
    _SlowCloud(sim.cloud, cost=0.6)
    slow = sim.run()
    staleness = [h["metrics"]["staleness_max"] for h in slow.history]
    took = [h["metrics"]["pushes"] for h in slow.history]
    assert max(staleness) <= max(h["metrics"]["staleness_max"] for h in fast.history) + 1, staleness
    assert not _stale_refusals(slow.history)
    assert max(took) > 1 and sum(took) > len(took) * 1.5, took  # it took what waited
    assert slow.history[-1]["accuracy"] >= fast.history[-1]["accuracy"] - 0.03


def test_an_async_cloud_version_takes_at_most_its_bound_of_the_pushes_of_a_cell_flooding_it(monkeypatch):
    """c0 (its own key) sends each push 13 times, as 13 messages, to a cloud busy 0.6 s a version: whatever waits,
    a version takes at most ``TAKE_PER_CELL`` pushes of a cell (4 here), and the rest go into the next, so a cell
    pushing fast cannot grow one version's work without bound."""
    monkeypatch.setattr(async_server, "TAKE_PER_CELL", 4)
    cfg = parse_config(_cfg("async", 8, async_buffer=2, max_staleness=20))
    sim = SimHierarchy(cfg, write_output=False)
    _SlowCloud(sim.cloud, cost=0.6)
    c0 = sim.cells["c0"]
    frame, flooded = c0.messenger.frame, []

    def flood(kind: str, payload: Any, **kw: Any) -> bytes:
        if kind == "cell_report":
            for _ in range(12):
                c0.transport.publish(kw["topic"], frame(kind, payload, **kw), qos=1)
                flooded.append(kw["round"])
        return frame(kind, payload, **kw)

    c0.messenger.frame = flood  # type: ignore[method-assign]
    fb, held = sim.cloud.fb, []
    offer = fb.offer

    def counted(*args: Any) -> None:
        offer(*args)
        held.append((len(fb.buffer.entries), fb.buffer.held))
        of_c0.append(sum(e.pushes for e in fb.buffer.entries if e.sender == "c0"))

    fb.offer, of_c0 = counted, []  # type: ignore[method-assign]
    history = sim.run().history
    took = [h["metrics"]["pushes"] for h in history]
    assert flooded and sim.cloud.take_per_cell == 4 and max(of_c0) == 4 and max(took) <= 8, (of_c0, took)
    # its copies from one version are summed as they come: the buffer holds a model per (cell, version), not per push
    assert max(n for n, _ in held) <= 2 * len(sim.cells) < max(p for _, p in held), held
    # nor weigh c0 more in a version than its bound (its one push's, async_cloud_buffer 1): 13 copies summed, scaled
    most = sum(sim.cloud._version_bound(c) or 0.0 for c in ("c0", "c1"))
    assert most > 0 and max(h["metrics"]["weight"] for h in history) <= most * (1 + 1e-9), (most, history[0])


def test_an_async_cloud_stopped_with_a_version_posted_makes_no_version(tmp_path):
    """The cloud posts a version behind the pushes waiting (b947770); stopped before it runs (the operator stops the
    job; a ``--serve`` cloud's loop goes on), it makes none: it made one after its stop, checkpointing a version whose
    round record its closed telemetry dropped. The pushes stay buffered (journaled, for ``--resume``)."""
    cfg = small_config(
        tmp_path,
        run={"rounds": 8},
        algorithm={"mode": "async", "async_buffer": 2, "edge_rounds": 1},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
    )
    sim = SimHierarchy(cfg)
    cloud, loop, stopped, ran = sim.cloud, sim.hub.loop, [], []
    version_due, posted_version = cloud._version_due, cloud._posted_version

    def due() -> None:
        version_due()
        if cloud._version_posted and cloud.round == 2 and not stopped:
            stopped.append(cloud.round)
            cloud.stop()

    def posted() -> None:
        if stopped:
            ran.append(cloud.round)
        posted_version()

    cloud._version_due, cloud._posted_version = due, posted  # type: ignore[method-assign]
    for cell in sim.cells.values():
        cell.start()
    sim.agents.start()
    loop.run()
    cloud.start()
    loop.run(until=lambda: bool(ran), max_steps=100_000)
    sim.agents.stop()
    assert stopped == ran == [2] and cloud.round == 2 and cloud.fb.buffer.entries, (stopped, ran, cloud.round)
    assert [json.loads(line)["round"] for line in (sim.output_dir / runfiles.METRICS).read_text().splitlines()] == [
        0,
        1,
    ]


def test_a_cells_pushes_taken_by_one_cloud_version_count_as_their_sum_not_their_mean():
    """A cell pushes its progress since its last push: pushes from one version are steps in sequence. Taken by one
    cloud version (a cloud slower than its cells takes every push waiting) they move the model as one push of their
    sum would (weighing their weights' sum), not by their mean, which dropped half of the cell's progress. The cloud
    sums them as they come (bounded memory), bit for bit the version made of their sum taken at once in float64 in
    arrival order (as e9c1551 summed them when the version was made)."""
    cfg = parse_config(_cfg("async", 2, async_buffer=2))
    rng = np.random.default_rng(0)
    like = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.float32)}
    d1, d2, d3, e = ({k: rng.normal(size=v.shape).astype(np.float32) for k, v in like.items()} for _ in range(4))
    split, whole, at_once = (FedBuffCloud(cfg.train, FedAvgCloud(cfg.train, like)) for _ in range(3))  # type: ignore[arg-type]
    for cloud, pushes in (
        (split, [("c0", 2.0, d1), ("c1", 4.0, e), ("c0", 3.0, d2), ("c0", 1.5, d3)]),
        (whole, [("c0", 6.5, {k: d1[k] + d2[k] + d3[k] for k in d1}), ("c1", 4.0, e)]),
    ):
        for cell, weight, delta in pushes:
            cloud.offer(cell, 0, Payload({"weight": weight}, delta))
        assert cloud.aggregate().metrics["pushes"] == len(pushes)
    for k in like:
        np.testing.assert_allclose(split.inner.model[k], whole.inner.model[k], rtol=0, atol=1e-6)
    summed = P.weighted_sum([(1.0, d) for d in (d1, d2, d3)])
    at_once.buffer.entries = [Entry("c0", 0, 2.0 + 3.0 + 1.5, summed, 3), Entry("c1", 0, 4.0, e)]
    at_once.aggregate()
    for k in like:
        assert np.array_equal(split.inner.model[k], at_once.inner.model[k]), k


def test_an_async_cloud_holds_one_summed_push_per_cell_and_version_whatever_the_push_rate():
    """A cell flooding the cloud with pushes from one version (its own key) holds one model-sized entry in the
    buffer, not one per push: the buffer's arrays stay bounded by the cells, and every push still counts (before:
    41 entries held, each a decoded model: up to ``TAKE_PER_CELL`` x cells models)."""
    cfg = parse_config(_cfg("async", 2, async_buffer=2, async_cloud_buffer=100))
    like = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.float32)}
    cloud = FedBuffCloud(cfg.train, FedAvgCloud(cfg.train, like))  # type: ignore[arg-type]
    one = {k: np.ones_like(v) for k, v in like.items()}
    for i in range(40):
        cloud.offer("c0", 0, Payload({"weight": 1.0}, one))
        if i == 20:
            cloud.offer("c1", 0, Payload({"weight": 1.0}, one))
        assert len(cloud.buffer.entries) <= 2 and sum(len(x.delta) for x in cloud.buffer.entries) <= 2 * len(like)
    assert cloud.buffer.held == 41 and not cloud.buffer.full
    assert [(x.sender, x.pushes, x.weight) for x in cloud.buffer.entries] == [("c0", 40, 40.0), ("c1", 1, 1.0)]
    np.testing.assert_array_equal(cloud.buffer.entries[0].delta["w"], np.full((4, 3), 40.0))


def test_a_resumed_async_cloud_replays_its_journal_into_the_same_summed_buffer_and_version(tmp_path):
    """The async cloud dies just after summing a cell's second push from one version into its buffered entry
    (c6edf0b: a cell's pushes from one base are summed as they are offered); resumed, it replays its push journal
    through the same offer: the same entries (cells, bases, weights, push counts), their sums bit for bit, and the
    version made of them bit-identical to the one the dead cloud would have made."""

    cfg = small_config(
        tmp_path,
        run={"rounds": 6},
        algorithm={"mode": "async", "async_buffer": 2, "async_cloud_buffer": 4, "edge_rounds": 1},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
    )
    sim = SimHierarchy(cfg)
    first, dead, replayed = sim.cloud, [], []
    offer = first.fb.offer

    def dies_on_a_sum(cell: str, base: int, report: Payload) -> None:
        offer(cell, base, report)  # journaled before: the process dies after its sum
        if not dead and first.round >= 1 and any(e.pushes >= 2 for e in first.fb.buffer.entries):
            dead.append(copy.deepcopy(first.fb))
            first.transport.crash()
            first.stop()
            sim.hub.loop.call_later(2.0, restart)
            raise _Killed

    def restart() -> None:
        sim.cloud = again = sim._build_cloud(None, resume=True)
        replay = again._replay

        def replaying() -> None:
            replay()
            if not replayed and not again.journal.pending:
                replayed.append(copy.deepcopy(again.fb))

        again._replay = replaying  # type: ignore[method-assign]
        again.start()

    first.fb.offer = dies_on_a_sum  # type: ignore[method-assign]
    _survives_its_death(first)
    result = sim.run()
    assert dead and replayed and [h["round"] for h in result.history][-1] == 5, (dead, result.history)
    was, now = dead[0], replayed[0]
    assert now.version == was.version and now.buffer.held == was.buffer.held
    assert [(e.sender, e.base, e.weight, e.pushes) for e in now.buffer.entries] == [
        (e.sender, e.base, e.weight, e.pushes) for e in was.buffer.entries
    ]
    for a, b in zip(now.buffer.entries, was.buffer.entries, strict=True):
        assert all(np.array_equal(a.delta[k], b.delta[k]) for k in b.delta)
    bound = sim.cloud._version_bound
    assert now.aggregate(bound).metrics["pushes"] == was.aggregate(bound).metrics["pushes"]
    assert all(np.array_equal(now.inner.model[k], was.inner.model[k]) for k in was.inner.model)


def test_a_resumed_async_cells_first_status_says_it_holds_a_model(tmp_path):
    """c0 dies on taking cloud version 3 and comes back 3 s later with --resume: its first status (the start's
    announce) says what it holds, its journaled cloud model, not ``needs_model`` (before: it announced before it
    loaded its journal, so its retained status asked for a model it held until its next heartbeat, and a cloud that
    heard it hold one sent it the current version at once, as to a cell restarted afresh)."""
    from protocols.status import decode_status

    cfg = small_config(
        tmp_path,
        run={"rounds": 12},
        algorithm={"mode": "async", "async_buffer": 2, "edge_rounds": 1, "max_staleness": 4},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
    )
    sim = SimHierarchy(cfg)
    first = sim.cells["c0"] = _journaled_c0(sim)
    back = _c0_dies_at_version_3_and_restarts(sim, first, resume=True)
    statuses: list[dict[str, Any]] = []

    def heard(topic: str, data: bytes) -> None:
        if len(back) == 2 and data:  # restarted: the resumed c0's statuses
            statuses.append(decode_status(data, topic, None) or {})

    sim.hub.connect("watcher").subscribe(topics.status(cfg.run.name, topics.cell_node("c0")), heard)
    sim.run()
    assert back[0] is None and back[1] is not None and statuses, (back, statuses)
    assert statuses[0].get("state") == "online" and "needs_model" not in statuses[0], statuses[0]
    assert sim.cells["c0"].fb.global_version > 3


def test_an_async_cells_bad_pushes_are_refused_before_they_reach_its_running_sum():
    """c0 (its own key) sends with each push three bad copies from the same version: a non-finite tensor, a tensor of
    the wrong shape, a version never sent to it. Each is refused (logged, in the version's record) before it is
    offered: the cloud's running sum of c0's pushes from that version (c6edf0b) holds its good pushes only, bit for
    bit their sum, and the job goes on (a bad push merged, then refused, would have corrupted the sum)."""
    cfg = parse_config(_cfg("async", 6, async_buffer=2))
    sim = SimHierarchy(cfg, write_output=False)
    _SlowCloud(sim.cloud, cost=0.6)  # pushes wait: a version sums several of a cell
    c0, fb = sim.cells["c0"], sim.cloud.fb
    frame, publish = c0.messenger.frame, c0.transport.publish

    def bad_copies(kind: str, payload: Any, **kw: Any) -> bytes:
        if kind == "cell_report" and "weight" in payload.meta:
            t = dict(payload.tensors)
            name = next(iter(t))
            nan = {**t, name: np.full_like(t[name], np.nan)}
            shape = {**t, name: np.zeros((*t[name].shape, 2), np.float32)}
            for tensors, base in ((nan, kw["round"]), (shape, kw["round"]), (t, kw["round"] + 50)):
                publish(kw["topic"], frame(kind, Payload(payload.meta, tensors), **{**kw, "round": base}), qos=1)
        return frame(kind, payload, **kw)

    c0.messenger.frame = bad_copies  # type: ignore[method-assign]
    offer, good = fb.offer, {}

    def offered(cell: str, base: int, report: Payload) -> None:
        assert all(np.isfinite(v).all() and v.shape == fb.inner.model[k].shape for k, v in report.tensors.items())
        offer(cell, base, report)
        entry = next(e for e in fb.buffer.entries if (e.sender, e.base) == (cell, base))
        steps = good[cell, base] = [*good.get((cell, base), [])[: entry.pushes - 1], report.tensors]
        assert entry.pushes == len(steps)
        total = P.weighted_sum([(1.0, d) for d in steps])
        assert all(np.array_equal(np.asarray(entry.delta[k], np.float64), total[k]) for k in total)

    fb.offer = offered  # type: ignore[method-assign]
    history = sim.run().history
    kinds = [x["kind"] for h in history for x in h["rejected"] if "c0" in x["from"]]
    assert {"non_finite", "shape", "stale"} <= set(kinds), kinds
    assert len(history) == 6 and kinds.count("shape") >= 2, kinds  # refused push after push, the job went on
    assert any(len(v) >= 2 for v in good.values()), {k: len(v) for k, v in good.items()}  # sums were made


def test_a_resumed_async_clouds_journal_replays_its_pushes_one_at_a_time(tmp_path):
    """A version may hold ``TAKE_PER_CELL`` x cells pushes, each journaled (c6edf0b sums them as they come, so the
    buffer holds a model per cell and version); a resumed cloud read the whole journal into memory, then copied each
    push (about 4 x the pushes' bytes at once: 32 pushes x 100 cells of an 800 KB model, ~10 GB). It reads them
    one at a time now: the same pushes in the same order, the holders, a torn tail cut, and its memory a push's, not
    the journal's (here 20 pushes of 1 MB: a peak of 4.2 MB, before 84 MB)."""
    import tracemalloc

    from cloud.async_journal import PushJournal

    path, push = tmp_path / "journal", 1 << 20
    first = PushJournal(path, None)
    sent = [(f"t/c{i % 2}", bytes([i]) * push) for i in range(20)]
    first.holding("c0")
    for topic, data in sent:
        first.taken(3, topic, data)
    first.holding("c1")
    first.close()
    with path.open("ab") as fh:
        fh.write(b"\x00\x01torn")  # a crash mid-append
    tracemalloc.start()
    try:
        again = PushJournal(path, 3)
        assert again.pending and again.holders == {"c0", "c1"}
        replayed = [(topic, data[0], len(data)) for topic, data in again.replay()]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert replayed == [(t, d[0], len(d)) for t, d in sent] and not again.pending
    assert peak < 6 * push, peak  # a few copies of one push (read, decoded, handed on)
    again.taken(3, "t/c0", b"x")  # the torn tail is cut before it: the journal reads whole again
    again.close()
    assert [t for t, _ in PushJournal(path, 3).replay()] == [*(t for t, _ in sent), "t/c0"]
    assert not PushJournal(path, 4).pending  # a later version: its pushes are in the checkpoint, skipped


def test_a_cell_flooding_an_async_cloud_never_passes_over_an_honest_cells_waiting_push(monkeypatch):
    """c0 (its own key) sends each push 13 times to a cloud busy 0.6 s a version, so whenever the cloud is free its
    loop holds c0's copies ahead of c1's push. A version takes at most ``TAKE_PER_CELL`` pushes of a cell (4 here): c0's
    next copies wait behind the version, and c1's push that waited when the version came due is taken by it, never
    left for a later one (before: a version was made at once of 8 pushes, c0's alone, and c1's waiting push went into
    a later one: 4 of c1's pushes taken in 10 versions, each passed over by 3 to 5 versions). c0's pushes past its
    share wait, at most 4 at a time (acknowledged, so the broker's window no longer holds c0 back: more would pile up
    in memory), the rest refused."""
    monkeypatch.setattr(async_server, "TAKE_PER_CELL", 4)
    cfg = parse_config(_cfg("async", 10, async_buffer=2, max_staleness=40))
    sim = SimHierarchy(cfg, write_output=False)
    slow, cloud = _SlowCloud(sim.cloud, cost=0.6), sim.cloud
    c0 = sim.cells["c0"]
    frame = c0.messenger.frame

    def flood(kind: str, payload: Any, **kw: Any) -> bytes:
        if kind == "cell_report":
            for _ in range(12):
                c0.transport.publish(kw["topic"], frame(kind, payload, **kw), qos=1)
        return frame(kind, payload, **kw)

    c0.messenger.frame = flood  # type: ignore[method-assign]
    waiting: dict[bytes, tuple[int, bool]] = {}  # c1's push -> the version open when it was handed over, one due
    passed_over, taken, per_version = [], [], []
    hand_over, take = slow.hand_over, slow.take

    def handed() -> None:
        for topic, data in slow.waiting:
            if topic.split("/")[-2] == "c1":
                waiting.setdefault(data, (cloud.round, cloud._version_posted))  # the first time it waited
        hand_over()

    def took(topic: str, data: bytes) -> None:
        take(topic, data)
        if data in waiting:
            version, due = waiting.pop(data)
            taken.append(data)
            if cloud.round > version + due:  # a version made since it waited, with it left out
                passed_over.append((version, due, cloud.round))

    slow.hand_over, slow.take = handed, took  # type: ignore[method-assign]
    offer = cloud.fb.offer

    def counted(cell: str, base: int, report: Payload) -> None:
        offer(cell, base, report)
        per_version.append((cloud.round, cell, sum(e.pushes for e in cloud.fb.buffer.entries if e.sender == cell)))
        held.append(len(slow.waiting) + len(sim.hub.loop._ready))  # pushes (and other calls) waiting for the cloud

    cloud.fb.offer, held = counted, []  # type: ignore[method-assign]
    history = sim.run().history
    assert len(taken) >= 5 and not passed_over, (len(taken), passed_over)
    assert max(n for _, cell, n in per_version if cell == "c0") == 4, per_version  # c0 took its share, no more
    # at most 4 (TAKE_PER_CELL) of c0's pushes wait behind a version, beside those just handed over (26 copies of 2
    # pushes at most) and c1's; the rest are refused as past its share (before: they piled up, 124 waiting)
    refused = [x for h in history for x in h["rejected"] if x["kind"] == "bound" and "past its share" in x["reason"]]
    assert refused and max(held) <= 40, (len(refused), max(held))


def test_pushes_on_a_cells_topic_signed_by_another_cell_take_none_of_its_waiting_places(tmp_path):
    """Signed run; c1 is past its share of the version (its pushes wait behind it, as a cloud slower than its cells'
    pushes has them). A node with c0's key, on a broker without the provisioned ACL, publishes its signed pushes on
    c1's topic: the cloud counted them as c1's waiting pushes (and kept c1's unacknowledged place for them) before
    it checked who signed them, so c1's own next push was refused as 'pushing too fast' (lost). Now a push waiting
    past its cell's share must be signed by that cell first: the forged ones are refused at once, c1's waits."""
    from cloud.node import build_cloud
    from protocols.transport.memory import MemoryHub
    from protocols.wire.keys import Trust
    from tests.test_revocation import _signed_config

    cfg, ring = _signed_config(tmp_path, algorithm=_PUSHING)
    algorithm = cfg.build_algorithm(cfg.model_spec((64,), 10))
    hub = MemoryHub()
    cloud = build_cloud(cfg, hub.connect("cloud"), algorithm, session="job.0")
    cloud.take_per_cell = 2
    cloud._over_share = lambda cell: cell == "c1"  # type: ignore[method-assign]  # (its share taken already)
    refused: list[tuple[str, str | None]] = []
    cloud.messenger.reject = lambda topic, kind, why, sender: refused.append((str(kind), why))  # type: ignore
    topic = topics.cell_report(cfg.run.name, "c1")

    def push(signer: str) -> bytes:
        m = Messenger(hub.connect(signer), cfg.run.name, signer, trust=Trust(signer, ring.private[signer], ring.public))
        m.session = "job.0"
        return bytes(m.frame("cell_report", Payload({"weight": 1.0}), round=0, cell="c1", topic=topic))

    for _ in range(2):
        cloud._on_report(topic, push("c0"))
    assert cloud._waiting.get("c1", 0) == 0 and len(refused) == 2, (cloud._waiting, refused)
    cloud._on_report(topic, push("c1"))
    assert cloud._waiting["c1"] == 1 and len(refused) == 2, (cloud._waiting, refused)


def test_every_kept_acknowledgement_of_a_waiting_push_goes_at_a_refusal_and_at_the_jobs_end(tmp_path):
    """c1's pushes past its share wait behind the version: the first keeps its acknowledgement (``UNACKED_PER_CELL``),
    the next waits acknowledged, one past ``take_per_cell`` waiting is refused with none kept. The job then fails
    (a ``--serve`` cloud's loop goes on): each waiting push comes back to a finished job and its kept acknowledgement
    goes (else the broker holds it in the cloud's in-flight window for ever)."""
    from cloud.node import build_cloud
    from protocols.transport.memory import MemoryHub

    cfg = small_config(tmp_path, algorithm=_PUSHING)
    hub = MemoryHub()
    cloud = build_cloud(cfg, hub.connect("cloud"), cfg.build_algorithm(cfg.model_spec((64,), 10)))
    cloud.take_per_cell = 2
    cloud._over_share = lambda cell: not cloud.finished  # type: ignore[method-assign]  # (its share taken)
    kept, acked = [], []
    cloud.transport.keep_ack = lambda: kept.append(1) or (lambda: acked.append(1))  # type: ignore[method-assign]
    topic = topics.cell_report(cfg.run.name, "c1")
    cloud.start()
    for _ in range(3):
        cloud._on_report(topic, b"push")
    assert cloud._waiting == {"c1": 2} and len(kept) == 1 and cloud._unacked == {"c1": 1}, (cloud._waiting, kept)
    cloud.fail("a test ends the job")
    hub.loop.run()
    assert acked == [1] and cloud._unacked == {"c1": 0} and cloud._waiting == {"c1": 0}, (acked, cloud._unacked)
