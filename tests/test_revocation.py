"""A cell revoked while a job runs: the cloud's side (the cell's side, a device revoked mid-round, is in
``tests/test_membership.py``). In memory on a virtual clock, and once over Mosquitto, with signed messages: cells
that answer their tasks with signed reports (a constant delta each, so the aggregate is known), and the cloud as a
job's server or as the long-lived service that learns the roster on its topic. A revoked cell is not waited for
(no deadline runs out), its report is not aggregated (taken before the revocation or sent after it, with its
real key: refused as ``revoked``), it is never planned again, also after the cloud restarts, and a job left
without cells fails saying so."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud.node import build_cloud
from monitor.state import MonitorState
from protocols.records import RoundRecord
from protocols.transport.base import Transport
from protocols.transport.broker import find_mosquitto
from protocols.transport.memory import MemoryHub
from protocols.wire import topics
from protocols.wire.envelope import decode_message
from protocols.wire.keys import KeyRing, Trust, generate_keys, write_keys
from protocols.wire.messenger import Messenger
from protocols.wire.payload import Payload
from sim.launcher import RunResult
from tests.conftest import small_config, wait_until, with_keys

CELLS = ["c0", "c1", "c2"]


def _signed_config(tmp_path: Path, **sections: dict[str, Any]) -> tuple[Any, KeyRing]:
    """3 cells of 1 device, signed (a keys file), a cell deadline of 100 s (what a revoked cell must not cost)."""
    runtime = {"cell_deadline": 100.0, "startup_wait": 0.0, **sections.pop("runtime", {})}
    cfg = small_config(tmp_path, topology={"cells": 3, "devices_per_cell": 1}, runtime=runtime, **sections)
    return with_keys(cfg, tmp_path)


def _delta(cell: str, rnd: int, like: dict[str, np.ndarray]) -> Payload:
    """Cell ``cell``'s report of round ``rnd``: a constant delta of its own (so which cells count shows)."""
    value = 0.01 * (1, 7, 2)[CELLS.index(cell)] * (rnd + 1)  # c1's moves the mean of the three
    return Payload({"weight": 10.0, "loss": 0.0}, {k: np.full_like(v, value) for k, v in like.items()})


class Cells:
    """The job's cells on ``peer`` (a connection): each answers its task at once with its signed report unless
    ``silent`` says not; ``tasks`` lists (cell, round) of every task that came."""

    def __init__(self, peer: Transport, run: str, ring: KeyRing, like: dict[str, np.ndarray]) -> None:
        self.peer, self.run, self.like = peer, run, like
        self.tasks: list[tuple[str, int]] = []
        self.silent: Callable[[str, int], bool] = lambda cell, rnd: False
        self.on_task: Callable[[str, int], None] = lambda cell, rnd: None
        self.session: str | None = None
        self.messengers = {c: Messenger(self.peer, run, c, trust=Trust(c, ring.private[c], ring.public)) for c in CELLS}
        for cell in CELLS:
            self.peer.subscribe(topics.cell_task(run, cell), partial(self._task, cell))

    def _task(self, cell: str, topic: str, data: bytes) -> None:
        header = decode_message(data)[0]
        self.session = header.session
        self.tasks.append((cell, header.round))
        self.on_task(cell, header.round)
        if not self.silent(cell, header.round):
            self.report(cell, header.round)

    def report(self, cell: str, rnd: int, on: str | None = None) -> None:
        """Send ``cell``'s signed report of round ``rnd`` (on its own report topic, or on ``on``'s)."""
        m = self.messengers[cell]
        m.session = self.session
        m.send(
            topics.cell_report(self.run, on or cell),
            "cell_report",
            _delta(cell, rnd, self.like),
            round=rnd,
            cell=on or cell,
        )


def _memory_job(cfg: Any, ring: KeyRing) -> tuple[Any, dict[str, np.ndarray], MemoryHub, Any, Cells]:
    """The job's cloud (session ``job.0``) and its scripted :class:`Cells` on one in-memory hub: the algorithm, its
    global parameters (what a report is like), the hub, the cloud and the cells."""
    algorithm = cfg.build_algorithm(cfg.model_spec((64,), 10))
    like = dict(algorithm.cloud().global_params())
    hub = MemoryHub()
    cloud = build_cloud(cfg, hub.connect("cloud"), algorithm, session="job.0")
    return algorithm, like, hub, cloud, Cells(hub.connect("cells"), cfg.run.name, ring, like)


def _reference(algorithm: Any, like: dict[str, np.ndarray], rounds: list[list[str]]) -> dict[str, np.ndarray]:
    """The global model a cloud role gives when round ``r`` aggregates the reports of ``rounds[r]``."""
    role = algorithm.cloud()
    for rnd, cells in enumerate(rounds):
        role.plan(rnd, list(cells))
        role.aggregate(rnd, {c: _delta(c, rnd, like) for c in cells})
    return dict(role.global_params())


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _logs_row(record: dict[str, Any]) -> str:
    """The record's row in ``fedtier logs``."""
    from fedtier.cmd_logs import _round_row
    from protocols.records import RoundRecord

    return " | ".join(str(cell) for cell in _round_row(RoundRecord.model_validate(record)))


def _service_without_jobs(cfg: Any, tmp_path: Path, **kw: Any) -> Any:
    """The cloud's long-lived service for ``cfg``, with no loop, broker or job runner: for calling its roster handling
    directly (``roster``, ``roster_path`` as :class:`cloud.service.CloudService` takes them)."""
    from cloud.jobs import JobQueue
    from cloud.service import CloudService
    from protocols.wire.keys import node_trust

    return CloudService(
        cfg,
        None,
        lambda: None,
        JobQueue(tmp_path / "jobs.json"),
        None,
        trust=node_trust(cfg, "cloud"),
        operator=None,
        **kw,
    )  # type: ignore[arg-type]


def _rejected(record: dict[str, Any]) -> list[str]:
    return [r["kind"] for r in record["rejected"]]


def test_a_cell_revoked_mid_round_is_not_waited_for_and_what_it_sends_is_refused(tmp_path: Path) -> None:
    """Round 1 waits for c1 (deadline 100 s) when the federation revokes it: the round closes at once with c0's
    and c2's reports (the model is exactly their aggregate), c1 is never planned again, and its reports, signed
    with its real key (on its topic, or on c0's), are refused as ``revoked`` and listed in the next record."""
    cfg, ring = _signed_config(tmp_path)
    algorithm, like, hub, cloud, cells = _memory_job(cfg, ring)
    cells.silent = lambda cell, rnd: cell == "c1" and rnd == 1
    cloud.start()
    hub.loop.run(until=lambda: cloud.round == 1 and set(cloud.answers.received) == {"c0", "c2"})
    assert cloud.answers.pending == {"c1"}
    start = hub.loop.now()
    cloud.revoke(["c1", "c1-d0"], "revoked (roster version 2)")  # the roster lists its devices too
    assert len(cloud.history) == 2 and hub.loop.now() == start  # closed at once: no deadline waited
    closed = cloud.history[1]
    assert (closed["cells_reported"], closed["cells_absent"]) == (["c0", "c2"], ["c1"])
    assert closed["cells_revoked"] == {"c1": "revoked (roster version 2)"} and closed["closed_by"] == "all reported"
    assert "revoked c1" in _logs_row(closed) and "absent" not in _logs_row(closed)  # fedtier logs says why
    cells.report("c1", 1)  # just after the revocation: refused
    cells.report("c1", 2)
    cells.report("c1", 2, on="c0")  # its key no longer verifies anywhere
    hub.loop.run(until=lambda: cloud.finished)
    assert not cloud.failed and [r for c, r in cells.tasks if c == "c1"] == [0, 1]  # never again
    last = cloud.history[2]
    assert last["cells_planned"] == ["c0", "c2"] and last["cells_revoked"] == {"c1": "revoked (roster version 2)"}
    assert _rejected(last) == ["revoked"] * 3, last["rejected"]
    expected = _reference(algorithm, like, [CELLS, ["c0", "c2"], ["c0", "c2"]])
    assert _same(dict(cloud.role.global_params()), expected)
    assert not _same(expected, _reference(algorithm, like, [CELLS, CELLS, ["c0", "c2"]]))  # c1 would show
    monitor = MonitorState()  # fedtier monitor, from these records: c1 revoked, not a cell the round went without
    monitor.add_all(RoundRecord.model_validate(r) for r in cloud.history)
    alerts, now = monitor.alerts(now=cloud.history[-1]["time"]), cloud.history[-1]["time"]
    assert monitor.state_of(monitor.cells["c1"], now) == "revoked" and not any("without" in a for a in alerts)
    assert "cell c1 revoked (roster version 2) by the federation: out of the job" in alerts
    summary = RunResult.of_cloud(cfg, cloud, None, 1.0).summary()  # summary.json's: the cells revoked, and why
    assert summary["cells_revoked"] == {"c1": "revoked (roster version 2)"} and summary["status"] == "finished"


def test_a_report_taken_before_the_revocation_is_dropped_and_a_job_without_cells_fails(tmp_path: Path) -> None:
    """c1 reported round 0 before it was revoked: its report is not aggregated (the round still waits for c2,
    then aggregates c0 and c2). Revoking the last cells while round 1 is open fails the job with the reason, and
    round 1 aggregates nothing (c0's report in hand is not a model update of a job that lost its cells)."""
    cfg, ring = _signed_config(tmp_path)
    algorithm, like, hub, cloud, cells = _memory_job(cfg, ring)
    cells.silent = lambda cell, rnd: cell == "c2" or (cell == "c0" and rnd == 1)
    cloud.start()
    hub.loop.run(until=lambda: set(cloud.answers.received) == {"c0", "c1"})
    cloud.revoke(["c1"])
    assert cloud.round == 0 and cloud.answers.pending == {"c2"} and set(cloud.answers.received) == {"c0"}
    cells.report("c2", 0)
    hub.loop.run(until=lambda: cloud.round == 1 and ("c0", 1) in cells.tasks)
    assert cloud.history[0]["cells_reported"] == ["c0", "c2"] and cloud.history[0]["cells_absent"] == ["c1"]
    after_round_0 = _reference(algorithm, like, [["c0", "c2"]])
    assert _same(dict(cloud.role.global_params()), after_round_0)
    cells.report("c0", 1)
    hub.loop.run(until=lambda: "c0" in cloud.answers.received)
    cloud.revoke(["c0", "c2"])
    assert cloud.finished and cloud.failed == "c0, c2 revoked by the federation: no cell of the job remains"
    assert len(cloud.history) == 1 and _same(dict(cloud.role.global_params()), after_round_0)
    summary = RunResult.of_cloud(cfg, cloud, None, 1.0).summary()  # all three, though no record lists c0 and c2
    assert summary["status"] == "failed" and sorted(summary["cells_revoked"]) == CELLS


def test_the_service_takes_a_newer_roster_mid_job_ignores_forged_and_old_ones_and_keeps_it_across_a_restart(
    tmp_path: Path,
) -> None:
    """The long-lived cloud, a job of 4 rounds. In round 1, with c0 and c2 in, a roster revoking c1 signed by c0
    (a forgery) changes nothing; the operator's, 5 s later, closes the round at once (c1's aggregation records
    are no longer written to the job's cells.jsonl); the old roster replayed after it changes nothing either.
    Stopped after round 2, the cloud restarts (a fresh broker: nothing retained) with its kept roster and resumes
    the job, whose config still lists c1 (the roster came before this cloud had the job): c1 is never planned
    again, its report is refused, and the model is the aggregate without it."""
    from cloud.jobs import Job, JobQueue
    from cloud.service import CloudService, JobParts
    from protocols.jobs import OPERATOR, canonical_job, config_hash
    from protocols.roster import Roster, roster_topic, sign_roster
    from protocols.wire.keys import node_trust
    from protocols.wire.signed import seal_record
    from sim.local_federation import job_text

    cfg, ring = _signed_config(tmp_path, run={"name": "fed", "rounds": 4})
    _, text = canonical_job(job_text(cfg), cfg)
    algorithm = cfg.build_algorithm(cfg.model_spec((64,), 10))
    like = dict(algorithm.cloud().global_params())
    topo = cfg.topology
    v1 = Roster.from_topology("fed", {c: topo.device_ids(c) for c in CELLS}, ring.public, 100.0)
    v2 = v1.without("c1")
    sign = {n: Trust(n, ring.private[n], ring.public).sign for n in ("cloud", "c0", "c1")}
    queue = JobQueue(tmp_path / "jobs.json")
    queue.submit(Job("j1", text, config_hash(text), OPERATOR))
    kept = tmp_path / "roster.json"
    ended: list[Any] = []

    def service(hub: MemoryHub, roster: bytes, on_round: Callable[[dict[str, Any]], None]) -> CloudService:
        return CloudService(
            cfg,
            hub.loop,  # type: ignore[arg-type]  (a virtual loop: the queue runner's own waits are never reached)
            lambda: hub.connect("cloud"),
            queue,
            lambda job_cfg: JobParts(job_cfg.build_algorithm(job_cfg.model_spec((64,), 10))),
            trust=node_trust(cfg, "cloud"),
            operator=None,
            on_end=lambda job, job_cfg, node, out: (ended.append(node), first.stop()),
            on_round=on_round,
            roster=roster,
            roster_path=kept,
        )

    hub = MemoryHub()
    operator = hub.connect("operator")
    cells = Cells(hub.connect("cells"), "fed", ring, like)
    cells.silent = lambda cell, rnd: cell == "c1" and rnd == 1
    revoked_at: list[float] = []

    def publish(roster: Roster, by: str = "cloud") -> None:
        operator.publish(roster_topic("fed"), sign_roster(roster, sign[by]), retain=True)

    def record(cell: str) -> None:  # a cell's aggregation record, signed, for the cloud's cells.jsonl
        topic = topics.telemetry_cell("fed", cell)
        body = {"schema": 1, "event": "aggregation", "run": "fed", "round": 1, "edge_round": 0, "cell": cell}
        body.update(algorithm="fedavg", closed_by="test", duration_s=0.1)
        operator.publish(topic, seal_record(body, topic, sign[cell]))

    def real_roster() -> None:
        revoked_at.append(hub.loop.now())
        publish(v2)
        cells.report("c1", 1)  # its report arrives just after the revocation
        record("c1")  # and its records are no longer the run's
        record("c0")
        hub.loop.call_later(1.0, lambda: publish(v1))  # a replay of the old roster, which lists c1

    def on_task(cell: str, rnd: int) -> None:
        if (cell, rnd) == ("c2", 1):  # the last of c0 and c2 to be tasked: the round now waits for c1 alone
            hub.loop.post(lambda: publish(v2.without("c2"), by="c0"))
            hub.loop.call_later(5.0, real_roster)

    cells.on_task = on_task
    first = service(hub, sign_roster(v1, sign["cloud"]), lambda r: r["round"] == 2 and first.stop())
    first.serve()
    job_folder = cfg.output_dir() / "jobs" / "j1"
    records = [json.loads(line) for line in (job_folder / "metrics.jsonl").read_text().splitlines()]
    assert queue.get("j1").state == "running" and [r["round"] for r in records] == [0, 1, 2]
    waited = records[1]["clock_s"] - records[1]["clock_start_s"]
    assert records[1]["clock_s"] == round(revoked_at[0], 6) and 5.0 <= waited < 6.0  # the forgery did not close it
    assert records[1]["cells_absent"] == ["c1"] and records[1]["cells_revoked"] == {"c1": "revoked (roster version 2)"}
    assert records[2]["cells_planned"] == ["c0", "c2"] and _rejected(records[2]) == [
        "revoked"
    ]  # the replay changed nothing
    assert first.roster == v2 and kept.read_bytes() == sign_roster(v2, sign["cloud"])
    kept_records = [json.loads(line) for line in (job_folder / "cells.jsonl").read_text().splitlines()]
    assert [r["cell"] for r in kept_records] == ["c0"]

    hub = MemoryHub()  # restarted: nothing retained on the broker, the roster comes from the kept file
    cells = Cells(hub.connect("cells"), "fed", ring, like)

    def c1_tries_anyway(cell: str, rnd: int) -> None:
        if cell == "c0":
            cells.report("c1", rnd)

    cells.on_task = c1_tries_anyway
    first = service(hub, kept.read_bytes(), lambda r: None)
    first.serve()
    assert queue.get("j1").state == "finished", queue.get("j1").reason
    records = [json.loads(line) for line in (job_folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2, 3] and records[3]["cells_planned"] == ["c0", "c2"]
    assert records[3]["cells_revoked"] == {"c1": "revoked (roster version 2)"} and _rejected(records[3]) == ["revoked"]
    assert "c1" not in [c for c, _ in cells.tasks]
    expected = _reference(algorithm, like, [CELLS, ["c0", "c2"], ["c0", "c2"], ["c0", "c2"]])
    assert _same(dict(ended[0].role.global_params()), expected)


def test_async_a_revoked_cells_buffered_push_is_dropped_and_its_next_refused(tmp_path: Path) -> None:
    """FedBuff over cells (a version every 3 pushes): c1's push waits in the buffer when c1 is revoked; it is
    dropped, c1's next push is refused as ``revoked``, and the version is made of c0's and c2's pushes alone."""
    from protocols.algorithms.fedbuff import FedBuffCloud

    cfg, ring = _signed_config(
        tmp_path, run={"rounds": 1}, algorithm={"mode": "async", "async_cloud_buffer": 3, "edge_rounds": 1}
    )
    algorithm, like, hub, cloud, cells = _memory_job(cfg, ring)
    cells.silent = lambda cell, rnd: cell == "c2"
    cloud.start()
    hub.loop.run(until=lambda: len(cloud.fb.buffer.entries) == 2)  # type: ignore[attr-defined]
    cloud.revoke(["c1"])
    assert [e.sender for e in cloud.fb.buffer.entries] == ["c0"]  # type: ignore[attr-defined]
    cells.report("c1", 0)
    cells.report("c2", 0)
    cells.report("c0", 0)
    hub.loop.run(until=lambda: cloud.finished)
    record = cloud.history[0]
    assert record["cells_reported"] == ["c0", "c2"] and record["cells_revoked"] == {"c1": "revoked"}
    assert _rejected(record) == ["revoked"]
    reference = FedBuffCloud(cfg.train, algorithm.cloud())  # type: ignore[arg-type]
    for cell in ("c0", "c2", "c0"):
        reference.offer(cell, 0, _delta(cell, 0, like))
    reference.aggregate()
    assert _same(dict(cloud.role.global_params()), dict(reference.inner.global_params()))


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_over_mosquitto_the_serving_cloud_drops_a_cell_the_operator_revokes_mid_round(tmp_path: Path) -> None:
    """The same over a real broker, in real time: the long-lived cloud serves a job on its own thread, the cells
    answer on another connection. While round 1 waits for c1 alone (cell deadline 100 s) the operator publishes the
    roster revoking c1, retained: the round closes at once with c0's and c2's reports, c1's reports that follow
    are refused as ``revoked``, round 2 plans c0 and c2, and the model is the aggregate without c1."""
    import threading

    from cloud.jobs import Job, JobQueue
    from cloud.service import CloudService, JobParts
    from protocols.jobs import OPERATOR, canonical_job, config_hash
    from protocols.roster import Roster, roster_topic, sign_roster
    from protocols.transport.broker import MosquittoBroker
    from protocols.transport.mqtt import MqttTransport
    from protocols.transport.threadloop import ThreadLoop
    from protocols.wire.keys import node_trust
    from sim.local_federation import job_text

    cfg, ring = _signed_config(tmp_path, run={"name": "fed", "rounds": 3})
    _, text = canonical_job(job_text(cfg), cfg)
    algorithm = cfg.build_algorithm(cfg.model_spec((64,), 10))
    like = dict(algorithm.cloud().global_params())
    v1 = Roster.from_topology("fed", {c: cfg.topology.device_ids(c) for c in CELLS}, ring.public, 100.0)
    sign = Trust("cloud", ring.private["cloud"], ring.public).sign
    queue = JobQueue(tmp_path / "jobs.json")
    queue.submit(Job("j1", text, config_hash(text), OPERATOR))
    records: list[dict[str, Any]] = []
    ended: list[Any] = []
    with MosquittoBroker() as broker:
        peers = ThreadLoop("cells").start()
        cells = Cells(MqttTransport("cells", peers, port=broker.port).connect(), "fed", ring, like)
        cells.silent = lambda cell, rnd: (cell, rnd) in (("c1", 1), ("c0", 2))
        assert cells.peer.wait_subscribed(10.0)  # type: ignore[attr-defined]
        loop = ThreadLoop("cloud")
        service = CloudService(
            cfg,
            loop,
            lambda: MqttTransport("fedtier-fed-cloud", loop, port=broker.port).connect(),
            queue,
            lambda job_cfg: JobParts(job_cfg.build_algorithm(job_cfg.model_spec((64,), 10))),
            trust=node_trust(cfg, "cloud"),
            operator=None,
            on_end=lambda job, job_cfg, node, out: (ended.append(node), service.stop()),
            on_round=records.append,
            roster=sign_roster(v1, sign),
        )
        serving = threading.Thread(target=service.serve, daemon=True)
        serving.start()
        try:

            def waits_for_c1_alone() -> bool:
                node = service.node
                return node is not None and node.round == 1 and node.answers.received.copy().keys() == {"c0", "c2"}

            assert wait_until(waits_for_c1_alone, 30.0)
            peers.post(
                lambda: cells.peer.publish(roster_topic("fed"), sign_roster(v1.without("c1"), sign), retain=True)
            )
            assert wait_until(lambda: len(records) == 2, 30.0)  # at once: not after the 100 s deadline
            assert records[1]["cells_absent"] == ["c1"] and records[1]["closed_by"] == "all reported"
            assert records[1]["cells_revoked"] == {"c1": "revoked (roster version 2)"}
            node = service.node
            assert node is not None
            peers.post(lambda: (cells.report("c1", 1), cells.report("c1", 2)))
            assert wait_until(lambda: len(node.telemetry.rejected) == 2, 30.0)
            peers.post(lambda: cells.report("c0", 2))
            assert wait_until(lambda: bool(ended), 30.0)
        finally:
            service.stop()
            serving.join(10.0)
            cells.peer.close()
            peers.stop()
    assert not serving.is_alive() and queue.get("j1").state == "finished"
    assert records[2]["cells_planned"] == ["c0", "c2"] and _rejected(records[2]) == ["revoked", "revoked"]
    assert ("c1", 2) not in cells.tasks
    expected = _reference(algorithm, like, [CELLS, ["c0", "c2"], ["c0", "c2"]])
    assert _same(dict(ended[0].role.global_params()), expected)


def test_the_cloud_services_kept_roster_is_written_durably(tmp_path: Path, monkeypatch) -> None:
    """The roster a cloud service adopts is kept across restarts (a revocation stays in force): its file is written,
    fsynced, renamed and its folder fsynced (``protocols.checkpoint.write_durably``). Before, it was renamed with
    neither fsync: a power loss could bring back the older roster, in which a revoked cell is a member again."""
    import os
    import stat

    from protocols.roster import Roster, verify_roster
    from protocols.wire.keys import node_trust

    cfg, ring = _signed_config(tmp_path, run={"name": "fed"})
    kept = tmp_path / "kept" / "roster.json"
    trust = node_trust(cfg, "cloud")
    service = _service_without_jobs(cfg, tmp_path, roster_path=kept)
    roster = Roster.from_topology("fed", {c: cfg.topology.device_ids(c) for c in CELLS}, ring.public, 100.0)
    events: list[tuple[str, str]] = []
    replace, fsync = os.replace, os.fsync

    def recording_replace(src: Any, dst: Any) -> None:
        replace(src, dst)
        events.append(("replace", str(dst)))

    def recording_fsync(fd: int) -> None:
        fsync(fd)
        events.append(
            ("fsync folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file", os.readlink(f"/proc/self/fd/{fd}"))
        )

    monkeypatch.setattr(os, "replace", recording_replace)
    monkeypatch.setattr(os, "fsync", recording_fsync)
    service._adopt(roster.without("c1"))
    monkeypatch.undo()
    assert events == [
        ("fsync file", str(kept) + ".tmp"),
        ("replace", str(kept)),
        ("fsync folder", str(kept.parent)),
    ], events
    assert "c1" not in verify_roster(kept.read_bytes(), trust.verify, federation="fed").cells


@pytest.mark.parametrize("planted", ["forged", "cleared", "junk", "older"], ids=["forged", "cleared", "junk", "older"])
def test_whatever_is_left_on_the_roster_topic_the_serving_cloud_puts_the_current_roster_back(
    tmp_path: Path, planted: str
) -> None:
    """The retained roster is how a node (re)started later learns who was revoked. A login that may write its topic (the
    operator's; on a broker without per-node ACLs, any) left a roster signed by a cell, an empty record or junk there:
    the serving cloud refused it and left it, so a cell restarted then held no roster and took the results of a device
    revoked after the job was queued (its key still in the cell's keys file), and `fedtier fleet` showed it as a member.
    Only an older roster was replaced. The cloud now puts its own back whatever else comes there."""
    from protocols.job_watch import JobWatch
    from protocols.roster import Roster, roster_topic, sign_roster

    cfg, ring = _signed_config(tmp_path, run={"name": "fed"})
    topo = cfg.topology
    v1 = Roster.from_topology("fed", {c: topo.device_ids(c) for c in CELLS}, ring.public, 100.0)
    v2 = v1.without("c1-d0")
    sign = {n: Trust(n, ring.private[n], ring.public).sign for n in ("cloud", "c0")}
    service = _service_without_jobs(cfg, tmp_path, roster=sign_roster(v2, sign["cloud"]))
    hub = MemoryHub()
    service.transport = hub.connect("cloud")
    service.transport.subscribe(roster_topic("fed"), service._on_roster)
    service._publish_roster(service.transport)
    hub.loop.run()
    left = {
        "forged": sign_roster(v2.without("c0-d0"), sign["c0"]),
        "cleared": b"",
        "junk": b"planted",
        "older": sign_roster(v1, sign["cloud"]),
    }[planted]
    hub.connect("operator").publish(roster_topic("fed"), left, retain=True)
    hub.loop.run()
    restarted = JobWatch(hub.connect("cell.c1"), "fed", Trust("c1", ring.private["c1"], ring.public))
    hub.loop.run()
    assert restarted.roster == v2 and "c1-d0" in restarted.roster.revoked


def test_a_cells_rotated_key_in_a_newer_roster_replaces_its_old_one_at_the_serving_cloud(tmp_path: Path) -> None:
    """`fedtier provision renew --identity --node c0` (its key leaked, say) gives the roster c0's new key. The serving
    cloud took the roster (a new version) but kept verifying c0 with the key of its keys file: c0's reports signed with
    its new key were refused ("signature") and a round waited out its 100 s deadline without it, while the old key's
    were taken, until the operator copied the cloud's keys file and a next job began. The cloud takes its cells' keys
    from the roster it adopts, as cells take their devices'."""
    from protocols.roster import Roster, roster_topic, sign_roster
    from protocols.wire.envelope import WireError
    from protocols.wire.keys import new_seed, public_of

    cfg, ring = _signed_config(tmp_path, run={"name": "fed"})
    _, _, hub, cloud, cells = _memory_job(cfg, ring)
    topo, sign = cfg.topology, Trust("cloud", ring.private["cloud"], ring.public).sign
    v1 = Roster.from_topology("fed", {c: topo.device_ids(c) for c in CELLS}, ring.public, 100.0)
    rotated = new_seed()
    service = _service_without_jobs(cfg, tmp_path, roster=sign_roster(v1, sign))
    service.node, service.transport = cloud, hub.connect("cloud-service")
    service._on_roster(roster_topic("fed"), sign_roster(v1.with_key("c0", public_of(rotated)), sign))
    cells.messengers["c0"] = Messenger(cells.peer, "fed", "c0", trust=Trust("c0", rotated, ring.public))
    cloud.start()
    hub.loop.run(until=lambda: cloud.finished)
    assert not cloud.failed and [r["cells_reported"] for r in cloud.history] == [CELLS] * len(cloud.history)
    assert [r["clock_s"] - r["clock_start_s"] for r in cloud.history] == [0.0] * len(cloud.history)  # none waited
    assert all(_rejected(r) == [] for r in cloud.history)
    with pytest.raises(WireError, match="bad signature"):  # the old key signs nothing from then on
        cloud.trust.verify("c0", b"a report", Trust("c0", ring.private["c0"], {}).sign(b"a report"))


def test_a_device_revoked_while_its_job_runs_no_longer_counts_in_its_cells_weight_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cell's weight bound at the cloud is the sum of its devices' bounds in the roster (100 each here). Revoking
    c0-d1 while the job ran left c0's bound at 200 for the rest of the job: c0 could still report (and weigh) 150
    samples with one device left. The roster adopted mid-job bounds the job from then on (100), and only the job's own
    devices count in it (none enrolled since)."""
    import sys

    from protocols.roster import Roster, roster_topic, sign_roster

    cfg, ring = _signed_config(tmp_path, run={"name": "fed", "rounds": 2})
    cfg = cfg.model_copy(update={"topology": cfg.topology.model_copy(update={"devices_per_cell": 2})})
    ring = generate_keys(cfg.topology)
    write_keys(tmp_path / "keys.toml", ring, overwrite=True)
    topo, sign = cfg.topology, Trust("cloud", ring.private["cloud"], ring.public).sign
    v1 = Roster.from_topology("fed", {c: topo.device_ids(c) for c in CELLS}, ring.public, 100.0)
    enrolled = v1.with_device("c0", "c0-d9", ring.public["c0-d0"], 100.0)  # since the job was submitted: not in it
    service = _service_without_jobs(cfg, tmp_path, roster=sign_roster(enrolled, sign))
    algorithm = cfg.build_algorithm(cfg.model_spec((64,), 10))
    like = dict(algorithm.cloud().global_params())
    hub = MemoryHub()
    bounds = service._cell_bounds(cfg)
    assert bounds is not None and bounds["c0"] == 200.0  # c0-d9 is not the job's
    cloud = build_cloud(cfg, hub.connect("cloud"), algorithm, session="job.0", cell_bounds=bounds)
    service.node, service.transport = cloud, hub.connect("cloud-service")
    claimed = lambda cell, rnd, like: Payload(  # noqa: E731
        {"weight": 150.0 if cell == "c0" else 10.0, "loss": 0.0}, {k: np.zeros_like(v) for k, v in like.items()}
    )
    monkeypatch.setattr(sys.modules[__name__], "_delta", claimed)
    cells = Cells(hub.connect("cells"), "fed", ring, like)
    cells.on_task = lambda cell, rnd: (
        rnd == 1
        and cell == "c0"
        and service._on_roster(roster_topic("fed"), sign_roster(enrolled.without("c0-d1"), sign))
    )  # c0-d1 revoked as round 1's tasks go out, before c0 reports
    cloud.start()
    hub.loop.run(until=lambda: cloud.finished)
    assert [r["cells_reported"] for r in cloud.history] == [CELLS, ["c1", "c2"]]
    assert _rejected(cloud.history[1]) == ["bound"] and "exceeds" in cloud.history[1]["rejected"][0]["reason"]
