"""Liveness around restarts (issue #14), in memory on a virtual clock: a started cell waits for the first
statuses of its devices before it counts one offline; a device that comes back while its result is
pending gets its task again; the cloud still plans a cell that went offline less than a cell deadline
ago (it is likely restarting; its session keeps the task)."""

from __future__ import annotations

from pathlib import Path

from cell_server.node import STATUS_WAIT, build_cell
from cloud.node import build_cloud
from protocols.status import encode_status
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
