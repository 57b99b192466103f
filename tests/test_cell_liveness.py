"""A cell's view of its devices' liveness around restarts (issue #14), in memory on a virtual clock: a
started cell waits for the first statuses of its devices before it counts one offline, and a device
that comes back while its result is pending gets its task again."""
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
    c.run_until(lambda: len(c.tasks) == 3)
    c.status("c0-d1", "offline")
    c.status("c0-d1", "online")
    c.run_until(lambda: len(c.tasks) == 4)
    assert c.tasks[3] == ("c0-d1", *c.tasks[0][1:]) and c.cell.answers.pending == set(DEVICES)
