"""Liveness around restarts (issue #14), in memory on a virtual clock: a started cell waits for the first
statuses of its devices before it counts one offline; a device that comes back while its result is
pending gets its task again; the cloud still plans a cell that went offline less than a cell deadline
ago (it is likely restarting; its session keeps the task)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from cell_server.node import STATUS_WAIT, build_cell
from cloud.node import build_cloud
from cloud.parts import CellPresence
from edge_agent.broker import device_will
from edge_agent.node import build_agent
from monitor.record_metrics import CellHealth
from protocols.records import CellRecord
from protocols.session import CloudSession, encode_manifest
from protocols.status import beating_idle_status, decode_status, encode_status, idle_status
from protocols.trainer import LocalData
from protocols.transport.memory import MemoryHub
from protocols.wire import topics
from protocols.wire.envelope import decode_message
from sim.hierarchy import prepare
from tests.conftest import small_config

DEVICES = ["c0-d0", "c0-d1", "c0-d2"]


class Cell:
    """Cell c0 and the cloud on a memory hub; the test plays the devices' statuses and watches their tasks."""

    def __init__(self, tmp_path: Path) -> None:
        cfg = small_config(tmp_path, runtime={"heartbeat": 0.0, "heartbeat_timeout": 0.0, "device_deadline": 50.0})
        algorithm = cfg.build_algorithm(prepare(cfg).spec)
        self.run, self.hub = cfg.run.name, MemoryHub()
        self.cell = build_cell(cfg, "c0", self.hub.connect("cell.c0"), algorithm, heartbeats=True)
        self.cloud = build_cloud(cfg, self.hub.connect("cloud"), algorithm)
        self.devices = self.hub.connect("devices")
        self.tasks: list[tuple[str, int, int]] = []  # (device, round, edge round) of each task sent
        for d in DEVICES:
            self.devices.subscribe(topics.device_task(self.run, "c0", d), self._on_task)
        self.cell.start()
        self.cloud.start()
        self.hub.loop.run(until=lambda: self.cell.in_round)

    def _on_task(self, topic: str, data: bytes) -> None:
        header, _ = decode_message(data)
        self.tasks.append((topic.split("/")[-2], header.round, header.edge_round))

    def status(self, device: str, state: str) -> None:
        topic = topics.device_status(self.run, "c0", device)
        self.devices.publish(topic, encode_status(state, topic=topic, cell="c0", samples=10), retain=True)

    def run_until(self, cond) -> None:
        self.hub.loop.run(until=cond)


def test_a_started_cell_waits_for_its_devices_first_statuses(tmp_path: Path) -> None:
    """The cloud's task reaches c0 before any device status (as when a restarted cell's journal or session
    lets it plan at once): it plans nothing until the statuses arrive, then all three at once; a device
    silent for the whole window is then planned as offline."""
    c = Cell(tmp_path)
    assert c.tasks == [] and c.cell._unknown == set(DEVICES)
    for d in DEVICES:
        c.status(d, "online")
    c.run_until(lambda: len(c.tasks) == 3)
    assert c.hub.loop.now() < STATUS_WAIT and sorted(d for d, _, _ in c.tasks) == DEVICES
    assert c.cell.planned == DEVICES and not c.cell.absent


def test_a_device_silent_through_the_window_is_planned_offline(tmp_path: Path) -> None:
    c = Cell(tmp_path)
    c.status("c0-d0", "online")
    c.status("c0-d1", "online")
    c.run_until(lambda: len(c.tasks) == 2)
    assert c.hub.loop.now() >= STATUS_WAIT  # it waited the window for c0-d2
    assert c.cell.absent == {"c0-d2": "offline"} and c.cell.planned == ["c0-d0", "c0-d1"]


def test_a_device_back_while_its_result_is_pending_gets_its_task_again(tmp_path: Path) -> None:
    """c0-d1's agent dies (its will says offline) and restarts (online) while c0 waits for its result:
    the task it was given may have died with it, so c0 sends it again; the others' tasks are not repeated."""
    c = Cell(tmp_path)
    for d in DEVICES:
        c.status(d, "online")
    c.run_until(lambda: len(c.tasks) == 3)  # a first status (online) is no return: each task went once
    c.status("c0-d1", "offline")
    c.status("c0-d1", "online")
    c.run_until(lambda: len(c.tasks) == 4)
    assert c.tasks[3] == ("c0-d1", *c.tasks[0][1:]) and c.cell.answers.pending == set(DEVICES)


def test_a_device_that_announces_itself_online_anew_while_its_result_is_pending_gets_its_task_again(
    tmp_path: Path,
) -> None:
    """c0-d1 left to sit rounds out and said offline, but the cell never got it (amqtt 0.12.1 drops what a client
    sent just before its DISCONNECT while that client's session is busy), so when c0-d1 takes part again the cell
    still thinks it online and sends its task at once, to no connection (tests/test_decomfl.py's onnx emulation under
    load: c0-d1 'back for round 3', its task lost, the round closed by its deadline). Its rejoin says online anew (a
    newer order of its process): it gets its task again. Its heartbeat (the same record again) gets none; a device
    saying online anew again and again gets it at most ``MAX_RESENDS`` times an edge round, as a status flipper."""
    from cell_server.edge_liveness import MAX_RESENDS

    c = Cell(tmp_path)

    def online(device: str, order: float) -> None:
        topic = topics.device_status(c.run, "c0", device)
        record = encode_status("online", topic=topic, cell="c0", samples=10, instance="agents-0", order=order)
        c.devices.publish(topic, record, retain=True)

    for d in DEVICES:
        online(d, 1.0)
    c.run_until(lambda: len(c.tasks) == 3)
    online("c0-d1", 1.0)  # a heartbeat: its last record again
    c.hub.loop.run_due()
    assert len(c.tasks) == 3
    online("c0-d1", 2.0)  # back (its offline, order 1.5, lost): online anew
    c.hub.loop.run_due()
    assert c.tasks[3:] == [("c0-d1", *c.tasks[0][1:])] and c.cell.answers.pending == set(DEVICES)

    for n in range(20):  # a device that says online anew again and again (a newer order each time): bounded too
        online("c0-d1", 3.0 + n)
    c.run_until(lambda: bool(c.cell.records))  # no device answers: the edge round closes at its deadline
    first = c.tasks[0][1:]
    assert [t for t in c.tasks[3:] if t[1:] == first] == [("c0-d1", *first)] * MAX_RESENDS, c.tasks


def test_the_cloud_plans_a_cell_offline_for_less_than_a_cell_deadline(tmp_path: Path) -> None:
    """c0 goes offline (its will) 20 s into round 0: round 1, planned at 30 s, still sends it its task; round
    2, planned at 60 s, no longer does (offline for longer than the 30 s cell deadline); c1 gets every round."""
    cfg = small_config(tmp_path, runtime={"cell_deadline": 30.0, "startup_wait": 5.0})
    algorithm = cfg.build_algorithm(prepare(cfg).spec)
    run, hub = cfg.run.name, MemoryHub()
    cloud = build_cloud(cfg, hub.connect("cloud"), algorithm, startup_wait=cfg.runtime.startup_wait)
    cells = hub.connect("cells")
    tasks: list[tuple[str, int]] = []
    for c in ("c0", "c1"):
        cells.subscribe(topics.cell_task(run, c), lambda t, data, c=c: tasks.append((c, decode_message(data)[0].round)))

    def status(cell: str, state: str) -> None:
        topic = topics.status(run, topics.cell_node(cell))
        cells.publish(topic, encode_status(state, topic=topic, devices_online=3, devices_total=3), retain=True)

    status("c0", "online")
    status("c1", "online")
    cloud.start()
    hub.loop.call_later(20.0, lambda: status("c0", "offline"))
    hub.loop.run(until=lambda: cloud.finished)
    assert tasks == [("c0", 0), ("c1", 0), ("c0", 1), ("c1", 1), ("c1", 2)]


def test_a_cloud_up_before_its_cells_waits_a_cell_deadline_for_them_not_milliseconds(tmp_path: Path) -> None:
    """A deployed cloud started before its cells: after ``startup_wait`` (5 s) no cell is online. Round 0 used
    to close at once with no cells, and the job failed after ``max_stalled_rounds`` empty rounds within
    milliseconds. Now the round waits up to its cell deadline (30 s) for a cell to come online: c0 arrives at
    12 s and gets round 0's task then, c1 at 14 s joins from round 1; no round closes empty, the job goes on."""
    cfg = small_config(tmp_path, runtime={"cell_deadline": 30.0, "startup_wait": 5.0, "max_stalled_rounds": 2})
    algorithm = cfg.build_algorithm(prepare(cfg).spec)
    run, hub = cfg.run.name, MemoryHub()
    cloud = build_cloud(cfg, hub.connect("cloud"), algorithm, startup_wait=cfg.runtime.startup_wait)
    cells = hub.connect("cells")
    tasks: list[tuple[str, int, float]] = []
    for c in ("c0", "c1"):
        cells.subscribe(
            topics.cell_task(run, c),
            lambda t, data, c=c: tasks.append((c, decode_message(data)[0].round, hub.loop.now())),
        )

    def status(cell: str) -> None:
        topic = topics.status(run, topics.cell_node(cell))
        cells.publish(topic, encode_status("online", topic=topic, devices_online=3, devices_total=3), retain=True)

    cloud.start()
    hub.loop.call_later(12.0, lambda: status("c0"))
    hub.loop.call_later(14.0, lambda: status("c1"))
    hub.loop.run(until=lambda: cloud.finished or len(tasks) >= 3)
    assert not cloud.failed, cloud.failed
    assert [(c, r) for c, r, _ in tasks[:3]] == [("c0", 0), ("c0", 1), ("c1", 1)]
    assert tasks[0][2] == 12.0  # sent the moment c0 came online, inside round 0's deadline
    first = cloud.history[0]  # c0 was planned (and, with no devices here, closed by the deadline)
    assert (first["cells_planned"], first["clock_start_s"], first["closed_by"]) == (["c0"], 12.0, "deadline")


def test_the_cloud_waits_for_cells_serving_its_own_job(tmp_path: Path) -> None:
    """`fedtier run --resume` after the launcher was killed (-9): its broker kept the killed job's cells
    retained 'online, every device online'. The resumed job's cloud (another job, another session) must not
    take those for its own cells, or it sends the round before the cells serve the job and the round is lost
    to the deadline. It starts once the cells announce its session: a pinned cell names it in its status."""
    cfg = small_config(tmp_path, runtime={"startup_wait": 30.0})
    algorithm = cfg.build_algorithm(prepare(cfg).spec)
    run, hub = cfg.run.name, MemoryHub()
    cells = hub.connect("cells")
    sent: list[float] = []
    for c in ("c0", "c1"):
        cells.subscribe(topics.cell_task(run, c), lambda t, data: sent.append(hub.loop.now()))

    def status(cell: str, session: str) -> None:
        topic = topics.status(run, topics.cell_node(cell))
        record = encode_status("online", topic=topic, devices_online=3, devices_total=3, session=session)
        cells.publish(topic, record, retain=True)

    status("c0", "job-killed.hash")
    status("c1", "job-killed.hash")
    cloud = build_cloud(cfg, hub.connect("cloud"), algorithm, startup_wait=30.0, session="job-new.hash")
    cloud.start()
    hub.loop.call_later(4.0, lambda: (status("c0", "job-new.hash"), status("c1", "job-new.hash")))
    hub.loop.run(until=lambda: len(sent) == 2)
    assert 4.0 <= min(sent) < 30.0  # not at once on the stale statuses, nor only at the startup wait

    cell = build_cell(cfg, "c0", hub.connect("cell.c0"), algorithm)
    cell.cloud.pin("job-new.hash")  # as cell_server.service does for the job it serves
    seen: list[bytes] = []
    watcher = hub.connect("watcher")
    watcher.subscribe(topics.status(run, topics.cell_node("c0")), lambda t, data: seen.append(data))
    hub.loop.run(until=lambda: len(seen) == 1)  # the status the test published for c0 (retained)
    cell.start()
    hub.loop.run(until=lambda: len(seen) == 2)
    assert (decode_status(seen[-1]) or {}).get("session") == "job-new.hash"


def test_a_cell_serving_a_job_counts_only_devices_serving_it(tmp_path: Path) -> None:
    """The device side of the same resume: the killed run's agents' statuses are still retained 'online'.
    A cell serving the resumed job must not plan them on those (it would send a task before the agent is
    back and subscribed, and wait a whole device deadline for it); it counts a device once its agent
    announces the job's session (long-lived agents pin it, and name it in every status)."""
    cfg = small_config(tmp_path, runtime={"heartbeat": 0.0, "heartbeat_timeout": 0.0})
    algorithm = cfg.build_algorithm(prepare(cfg).spec)
    run, hub = cfg.run.name, MemoryHub()
    devices = hub.connect("devices")

    def status(device: str, session: str) -> None:
        topic = topics.device_status(run, "c0", device)
        devices.publish(
            topic, encode_status("online", topic=topic, cell="c0", samples=10, session=session), retain=True
        )

    for d in DEVICES:
        status(d, "job-killed.hash")
    cell = build_cell(cfg, "c0", hub.connect("cell.c0"), algorithm, heartbeats=True)
    cell.cloud.pin("job-new.hash")
    cell.start()
    status("c0-d1", "job-new.hash")
    hub.loop.run(until=lambda: cell.online.count() > 0)
    hub.loop.run(until=lambda: hub.loop.now() > 1.0)
    assert [d for d in DEVICES if cell.online[d]] == ["c0-d1"]

    agent = build_agent(  # a long-lived agent of the job: its status names the job's session
        cfg,
        "c0-d0",
        hub.connect("agent.c0-d0"),
        algorithm,
        LocalData(np.zeros((1, 64), np.float32), np.zeros(1, np.int64)),
        None,
        cloud=CloudSession(pinned="job-new.hash"),
        caps={},
    )
    agent.start()
    hub.loop.run(until=lambda: cell.online["c0-d0"])
    assert [d for d in DEVICES if cell.online[d]] == ["c0-d0", "c0-d1"]


def test_a_devices_idle_and_will_of_its_watch_connection_delivered_after_its_online_are_not_taken(
    tmp_path: Path,
) -> None:
    """An agent process says its devices idle on a watch connection (the first device's id, its will: offline),
    learns the job there, closes it, and its devices' own connections say them online. A broker need not deliver
    records of two connections in the order they were said: amqtt delivered the idle (or the watch's will, fired
    by the takeover of its client id) after the online when the agents started as the cells took the job (fork
    server workers start within 0.1 s: fedtier run's devices 'offline' every round of a short job, e.g.
    test_async's killed device, test_privacy's DP run). The cell takes no record of a process older than one it
    took (their ``order``); the process's newer word, and another process's, it still takes."""
    cfg = small_config(tmp_path, runtime={"heartbeat": 0.0, "heartbeat_timeout": 0.0})
    algorithm = cfg.build_algorithm(prepare(cfg).spec)
    run, hub = cfg.run.name, MemoryHub()
    topic, instance = topics.device_status(run, "c0", "c0-d0"), "a1b2c3d4e5f60718"
    will = device_will(run, "c0", "c0-d0", cfg, instance, ordered=True)  # the watch connection's, as it connects
    idle = beating_idle_status(topic, None, 30.0, cell="c0", instance=instance)  # said on it, before the job came
    cell = build_cell(cfg, "c0", hub.connect("cell.c0"), algorithm, heartbeats=True)
    cell.cloud.pin("job.hash")
    cell.start()
    data = LocalData(np.zeros((1, 64), np.float32), np.zeros(1, np.int64))
    pinned = CloudSession(pinned="job.hash")
    agent = build_agent(
        cfg, "c0-d0", hub.connect("agent.c0-d0"), algorithm, data, None, pinned, caps={}, instance=instance
    )
    agent.start()  # the device's own connection: online
    hub.loop.run(until=lambda: cell.online["c0-d0"])
    watch = hub.connect("watch.c0-d0")
    watch.publish(topic, idle, retain=True)  # delivered only now, after the online
    watch.publish(will.topic, will.payload, retain=True)
    start = hub.loop.now()
    hub.loop.run(until=lambda: hub.loop.now() > start + 1.0)
    assert cell.online["c0-d0"]

    agent.announce("offline")  # newer: taken
    hub.loop.run(until=lambda: not cell.online["c0-d0"])
    restarted = encode_status("online", topic=topic, cell="c0", session="job.hash", instance="another", order=0.0)
    watch.publish(topic, restarted, retain=True)  # another process (a restarted agent): its own order
    hub.loop.run(until=lambda: cell.online["c0-d0"])


def test_an_idle_node_is_never_planned_by_a_job(tmp_path: Path) -> None:
    """Long-lived nodes say 'idle' between jobs (up, with their capabilities, no job session), retained. A
    job's cloud must not count an idle cell ready (even one claiming every device online), nor a job's cell
    an idle device online: each counts a node once it announces the job's own session."""
    cfg = small_config(tmp_path, runtime={"startup_wait": 30.0, "heartbeat": 0.0, "heartbeat_timeout": 0.0})
    algorithm = cfg.build_algorithm(prepare(cfg).spec)
    run, hub = cfg.run.name, MemoryHub()
    peers = hub.connect("peers")
    sent: list[float] = []
    for c in ("c0", "c1"):
        peers.subscribe(topics.cell_task(run, c), lambda t, data: sent.append(hub.loop.now()))

    def cell_status(cell: str, record: Callable[..., bytes]) -> None:
        topic = topics.status(run, topics.cell_node(cell))
        peers.publish(topic, record(topic, None, devices_online=3, devices_total=3), retain=True)

    serving = lambda topic, trust, **kw: encode_status("online", topic=topic, session="job-new.hash", **kw)  # noqa: E731
    for c in ("c0", "c1"):
        cell_status(c, idle_status)
    cloud = build_cloud(cfg, hub.connect("cloud"), algorithm, startup_wait=30.0, session="job-new.hash")
    cloud.start()
    hub.loop.call_later(4.0, lambda: (cell_status("c0", serving), cell_status("c1", serving)))
    hub.loop.run(until=lambda: len(sent) == 2)
    assert 4.0 <= min(sent) < 30.0  # not at once on the idle statuses, nor only at the startup wait

    for d in DEVICES:
        topic = topics.device_status(run, "c0", d)
        peers.publish(topic, idle_status(topic, None, cell="c0", samples=10), retain=True)
    cell = build_cell(cfg, "c0", hub.connect("cell.c0"), algorithm, heartbeats=True)
    cell.cloud.pin("job-new.hash")
    cell.start()
    start = hub.loop.now()
    hub.loop.run(until=lambda: hub.loop.now() > start + 1.0)  # the retained idle statuses came at once
    assert cell.online.count() == 0
    topic = topics.device_status(run, "c0", "c0-d2")
    peers.publish(topic, serving(topic, None, cell="c0", samples=10), retain=True)
    hub.loop.run(until=lambda: cell.online.count() > 0)
    assert [d for d in DEVICES if cell.online[d]] == ["c0-d2"]


def _revoked_in_startup_wait(tmp_path: Path, unfit: str | None = None) -> tuple[MemoryHub, Any, Any, Callable]:
    """Cell c0 (3 devices, c0-d1 revoked as the job starts, having said it cannot serve the job for ``unfit``) and
    the cloud (a 100 s startup wait) on a memory hub, not started; ``online(device)`` publishes its status."""
    cfg = small_config(
        tmp_path,
        topology={"cells": 1, "devices_per_cell": 3},
        runtime={"startup_wait": 100.0, "heartbeat": 0.0, "heartbeat_timeout": 0.0},
    )
    algorithm = cfg.build_algorithm(prepare(cfg).spec)
    run, hub = cfg.run.name, MemoryHub()
    cloud = build_cloud(cfg, hub.connect("cloud"), algorithm, startup_wait=cfg.runtime.startup_wait)
    cell = build_cell(cfg, "c0", hub.connect("cell.c0"), algorithm, heartbeats=True)
    if unfit is not None:
        cell.liveness.cannot_serve("c0-d1", unfit)  # as its idle status said
    cell.revoke_members(["c0-d1"])  # the roster of the job's start no longer lists it
    devices = hub.connect("devices")

    def online(device: str) -> None:
        topic = topics.device_status(run, "c0", device)
        devices.publish(topic, encode_status("online", topic=topic, cell="c0", samples=10), retain=True)

    return hub, cell, cloud, online


def test_a_job_does_not_wait_for_a_device_revoked_before_it_started(tmp_path: Path) -> None:
    """Seen on a running federation: job-L2, queued before c1-d1 was revoked, waited its whole startup wait
    for c1-d1 (its cell counted a revoked device among those to wait for: "1/2 devices online"). A revoked
    device is not waited for: the cloud plans round 0 the moment the cell's other devices are online."""
    hub, cell, cloud, online = _revoked_in_startup_wait(tmp_path)
    for d in ("c0-d0", "c0-d2"):
        online(d)
    cell.start()
    cloud.start()
    hub.loop.run(until=lambda: cell.in_round or hub.loop.now() > 200.0)
    assert cell.in_round and hub.loop.now() < 100.0, hub.loop.now()  # not the startup wait


def test_a_task_sent_again_is_counted_apart_from_the_first_sends(tmp_path: Path) -> None:
    """A task sent again (c0-d1 back while its result is pending: a restart, or a reconnect under load, as amqtt's
    take-overs caused in CI) is retransmission: its bytes go to the record's ``bytes_resent``, and ``bytes_out`` (what
    the cloud's cell_to_device counts) stays the first sends, the same in every run of the job. Before, the resend
    was in ``bytes_out``: +9,817 cell_to_device bytes made an emulated run's byte counts differ from the sim's."""
    c = Cell(tmp_path)
    sent: list[tuple[str, int]] = []
    send = c.cell.messenger.send

    def counting(topic: str, *args, **kwargs) -> int:  # type: ignore[no-untyped-def]
        nbytes = send(topic, *args, **kwargs)
        sent.append((topic.split("/")[-2], nbytes))
        return nbytes

    c.cell.messenger.send = counting  # type: ignore[method-assign]
    for d in DEVICES:
        c.status(d, "online")
    c.run_until(lambda: len(c.tasks) == 3)
    c.status("c0-d1", "offline")
    c.status("c0-d1", "online")
    c.run_until(lambda: len(c.tasks) == 4)
    c.run_until(lambda: bool(c.cell.records))  # no device answers: the edge round closes at its deadline
    record = c.cell.records[0]
    sent = sent[:4]  # (then the next edge round's tasks)
    assert [d for d, _ in sent] == [*DEVICES, "c0-d1"] and sent[3][1] > 0
    assert record["bytes_out"] == sum(n for _, n in sent[:3]), (record["bytes_out"], sent)
    assert record["bytes_resent"] == sent[3][1]
    registry = CollectorRegistry()  # the operator's view: its own counter (/metrics)
    CellHealth(registry).observe("t", CellRecord.model_validate(record))
    assert registry.get_sample_value("fedtier_cell_bytes_resent_total", {"run": "t", "cell": "c0"}) == sent[3][1]
    assert registry.get_sample_value(
        "fedtier_cell_bytes_total", {"run": "t", "cell": "c0", "tier": "cell_to_device"}
    ) == sum(n for _, n in sent[:3])


def test_a_device_flipping_its_status_gets_its_task_again_a_bounded_number_of_times(tmp_path: Path) -> None:
    """Each return of a device while its result is pending costs the cell its whole task again (a model): a device
    with valid credentials that flips its status offline/online (a few hundred bytes each) had it sent again at each
    flip, unbounded (20 flips: 20 tasks). At most ``MAX_RESENDS`` an edge round now; an honest return still gets it."""
    from cell_server.edge_liveness import MAX_RESENDS

    c = Cell(tmp_path)
    for d in DEVICES:
        c.status(d, "online")
    c.run_until(lambda: len(c.tasks) == 3)
    for _ in range(20):
        c.status("c0-d1", "offline")
        c.status("c0-d1", "online")
    c.run_until(lambda: bool(c.cell.records))  # no device answers: the edge round closes at its deadline
    record = c.cell.records[0]
    first = c.tasks[0][1:]  # (round, edge round): then the next edge round's tasks
    assert [t for t in c.tasks[3:] if t[1:] == first] == [("c0-d1", *first)] * MAX_RESENDS, c.tasks
    assert record["bytes_resent"] == MAX_RESENDS * record["bytes_out"] // 3, record  # the 3 tasks are the same size


def test_an_ended_jobs_cloud_server_is_let_go_before_its_startup_wait_would_have_ended(tmp_path: Path) -> None:
    """A long-lived ``--serve`` cloud runs jobs one after another on one loop. A job whose cells were all online at
    once began without waiting out ``runtime.startup_wait`` (600 s), but the wait's timer stayed armed, holding the
    job's server (its model, its records) until it fired, long after the job ended. Here the job ends (its one round
    stalls: no cell answers) and its server is stopped: nothing holds it any more."""
    import gc
    import weakref

    cfg = small_config(
        tmp_path, runtime={"startup_wait": 600.0, "cell_deadline": 1.0, "max_stalled_rounds": 1}, run={"rounds": 5}
    )
    algorithm = cfg.build_algorithm(prepare(cfg).spec)
    run, hub = cfg.run.name, MemoryHub()
    cells = hub.connect("cells")
    for c in ("c0", "c1"):
        topic = topics.status(run, topics.cell_node(c))
        cells.publish(topic, encode_status("online", topic=topic, devices_online=3, devices_total=3), retain=True)
    job = [build_cloud(cfg, hub.connect("cloud"), algorithm, startup_wait=cfg.runtime.startup_wait)]
    job[0].start()
    hub.loop.run(until=lambda: job[0].finished)
    assert job[0].failed is not None and hub.loop.now() < 10.0, (job[0].failed, hub.loop.now())  # began at once
    job[0].stop()  # as the service does once the job ended; its loop goes on (what stop posted runs, not the wait)
    ran: list[float] = []
    hub.loop.post(lambda: ran.append(hub.loop.now()))
    hub.loop.run(until=lambda: bool(ran))
    ended = weakref.ref(job.pop())
    gc.collect()
    assert ended() is None, [type(r).__name__ for r in gc.get_referrers(ended())]


def test_an_ended_async_jobs_cloud_server_is_let_go_before_its_ask_wait_would_have_ended(tmp_path: Path) -> None:
    """The async cloud answers a cell's new ask for a model (``needs_model``) after ``ASK_WAIT``; a job that ends
    (here: failed) before that wait is over is let go at once by its ``--serve`` loop, not held by the wait's timer
    until it fires."""
    import gc
    import weakref

    cfg = small_config(
        tmp_path, runtime={"startup_wait": 0.0}, algorithm={"mode": "async", "async_buffer": 2, "edge_rounds": 1}
    )
    algorithm = cfg.build_algorithm(prepare(cfg).spec)
    run, hub = cfg.run.name, MemoryHub()
    cells = hub.connect("cells")
    job = [build_cloud(cfg, hub.connect("cloud"), algorithm)]
    assert type(job[0]).__name__ == "AsyncCloudServer"
    job[0].start()
    hub.loop.run(until=lambda: job[0].started)
    topic = topics.status(run, topics.cell_node("c0"))
    ask = encode_status("online", topic=topic, devices_total=3, needs_model=True, session=job[0].session)
    cells.publish(topic, ask)
    hub.loop.run(until=lambda: "c0" in job[0]._asking)  # the ask is taken: its wait is armed
    start = hub.loop.now()
    job[0].fail("ended for the test")  # the job ends before the wait is over (as a stalled or a cancelled one)
    job[0].stop()
    ran: list[float] = []
    hub.loop.post(lambda: ran.append(hub.loop.now()))
    hub.loop.run(until=lambda: bool(ran))
    assert job[0].finished and ran[0] - start < 1.0
    ended = weakref.ref(job.pop())
    gc.collect()
    assert ended() is None, [type(r).__name__ for r in gc.get_referrers(ended())]


def test_a_cell_counts_the_devices_sitting_its_round_out_without_a_pass_over_its_devices(monkeypatch) -> None:
    """``devices_away`` (offline, not taking part, neither revoked nor unfit) is said at every status change: a cell
    of 10^5 devices counts it from its flags, never decoding each id (40 ms a count at 10^4 devices, 4 s of a
    10^6-device sim's 100 cells at start, when it walked them)."""
    from cell_server.liveness import Liveness
    from cell_server.members import DeviceList

    devices = DeviceList(f"c0-d{i}" for i in range(100_000))
    live = Liveness("c0", devices)  # all offline
    for d in ("c0-d1", "c0-d2", "c0-d3"):
        live.online[d] = True
    live.revoke("c0-d4")
    live.cannot_serve("c0-d5", "no data")
    monkeypatch.setattr(DeviceList, "__iter__", lambda self: pytest.fail("walked the cell's devices"))
    # taking part: two online, one offline, one unfit, and another cell's device
    part = frozenset({"c0-d1", "c0-d2", "c0-d6", "c0-d5", "c1-d0"})
    assert live.sitting_out(part) == 100_000 - 3 - 1 - 1 - 1  # the online, revoked, unfit and c0-d6 are not away
    assert live.sitting_out(frozenset()) == 100_000 - 3 - 1 - 1


def test_a_revoked_device_that_had_said_it_cannot_serve_the_job_is_counted_once(tmp_path: Path) -> None:
    """c0-d1 said (its idle status's unfit) that it cannot serve the job, then was revoked: its cell counted it in
    devices_unfit as well as leaving it out of devices_total, so the cloud, which wants online + unfit (+ away) to
    equal the total, took the cell as ready with one of its two remaining devices online (and as not ready with
    both). The cloud begins only once both are online, before its startup wait ends."""
    hub, cell, cloud, online = _revoked_in_startup_wait(tmp_path, unfit="no data for this job")
    cell.start()
    cloud.start()
    online("c0-d0")
    hub.loop.call_later(50.0, lambda: None)  # a moment well inside the startup wait to look at
    hub.loop.run(until=lambda: cell.in_round or hub.loop.now() >= 50.0)
    assert not cell.in_round, "the cloud began with c0-d2 offline"
    online("c0-d2")
    hub.loop.run(until=lambda: cell.in_round or hub.loop.now() > 200.0)
    assert cell.in_round and hub.loop.now() < 100.0, hub.loop.now()  # not the startup wait


def test_a_cell_counts_away_the_devices_that_sit_out_the_round_the_cloud_announced(tmp_path: Path) -> None:
    """The devices go and come on the cloud's round manifest; the cell's round follows the cloud's task. A cloud
    SIGKILLed between round 2's manifest and its tasks (CI, tests/test_decomfl_resume.py) left cell c0 at round 1,
    counting c0-d0 (gone: it sits round 2 out) as a device to wait for, so the resumed cloud, which re-opens its round
    once every cell is ready, waited out its startup wait (62.9 s). The cell counts away the devices that sit out the
    manifest's round, here with no task at all, and says so again when that round moves without a device status
    (c0-d2, offline while it takes part in round 1, sits round 2 out)."""
    cfg = small_config(
        tmp_path, topology={"cells": 1, "devices_per_cell": 3}, runtime={"heartbeat": 0.0, "heartbeat_timeout": 0.0}
    )
    takes_part = [frozenset(DEVICES), frozenset({"c0-d1", "c0-d2"}), frozenset({"c0-d1"})]  # rounds 0, 1, 2
    hub, run = MemoryHub(), cfg.run.name
    cell = build_cell(
        cfg,
        "c0",
        hub.connect("cell.c0"),
        cfg.build_algorithm(prepare(cfg).spec),
        availability=lambda rnd, edge_round: takes_part[rnd],
        heartbeats=True,
    )
    nodes, said = hub.connect("nodes"), []
    status = topics.status(run, topics.cell_node("c0"))
    nodes.subscribe(status, lambda topic, data: said.append(decode_status(data, topic)))

    def publish(topic: str, record: bytes) -> None:
        nodes.publish(topic, record, retain=True)
        hub.loop.run_due()

    def device(d: str, state: str) -> None:
        publish(topics.device_status(run, "c0", d), encode_status(state, topic=topics.device_status(run, "c0", d)))

    def ready() -> bool:  # the cloud's reading of the cell's latest status
        presence = CellPresence(["c0"])
        presence.heard("c0", said[-1], 0.0)
        return presence.ready["c0"]

    def manifest(rnd: int) -> None:
        topic = topics.round_manifest(run)
        publish(topic, encode_manifest("s1", rnd, topic=topic))

    cloud = topics.status(run, "cloud")
    publish(cloud, encode_status("online", topic=cloud, session="s1"))
    for d in DEVICES:
        device(d, "online")
    cell.start()
    hub.loop.run_due()
    assert ready()
    manifest(1)  # round 1: c0-d0 sits it out and leaves; c0-d2 goes offline (it takes part: it is waited for)
    device("c0-d0", "offline")
    assert ready() and said[-1]["devices_away"] == 1, said[-1]
    device("c0-d2", "offline")
    assert not ready(), said[-1]
    manifest(2)  # c0-d2 sits round 2 out: away, without a status of its own
    assert ready() and said[-1]["devices_away"] == 2 and cell.round == -1, said[-1]
