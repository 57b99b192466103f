"""A long-lived node between jobs re-publishes its idle status every ``monitoring.idle_heartbeat`` seconds
(declared in the record), so a reader tells a live idle node from one that died with its will lost (a
broker restarted without its sessions): ``fedtier fleet`` and ``fedtier monitor`` show the dead one offline
within three heartbeats. Real Mosquitto, a real :class:`~cell_server.service.CellService`."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from rich.console import Console

from cell_server.service import CellService
from monitor.fleet import Fleet
from monitor.live import LiveView
from monitor.sources import TelemetryFeed
from monitor.state import MonitorState
from monitor.view import CellFilter
from protocols.transport.broker import MosquittoBroker, find_mosquitto
from protocols.transport.mqtt import MqttTransport
from protocols.transport.threadloop import ThreadLoop
from sim.local_federation import federation_bundle
from tests.conftest import small_config, wait_until

PERIOD = 0.5
pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")


@dataclass
class IdleCell:
    """Cell c0 serving idle on a real Mosquitto, connected without a will (as if the broker had lost it), and the
    watchers a test opened on its own loop (closed at the end)."""

    run: str
    url: str
    watching: ThreadLoop
    made: list[MqttTransport] = field(default_factory=list)
    watchers: list[MqttTransport] = field(default_factory=list)

    def watcher(self, name: str) -> MqttTransport:
        self.watchers.append(MqttTransport.from_url(self.url, name, self.watching).connect())
        return self.watchers[-1]

    def crash(self) -> None:
        """The cell's process dies; no will says offline."""
        self.made[0].crash()


@pytest.fixture
def idle_cell(tmp_path: Path) -> Iterator[IdleCell]:
    bundle = federation_bundle(small_config(tmp_path, monitoring={"idle_heartbeat": PERIOD}))
    with MosquittoBroker() as broker:
        loop = ThreadLoop("cell-c0")
        cell = IdleCell(bundle.run.name, broker.url, ThreadLoop("watch").start())

        def connect() -> MqttTransport:  # no will
            cell.made.append(MqttTransport.from_url(broker.url, "cell-c0", loop))
            return cell.made[-1].connect()

        service = CellService(bundle, "c0", loop, connect, lambda *_: None, None)
        thread = threading.Thread(target=service.serve, name="cell-service", daemon=True)
        try:
            thread.start()
            yield cell
        finally:
            service.stop()
            thread.join(10)
            for w in cell.watchers:
                w.close()
            cell.watching.stop()


def test_an_idle_cell_beats_and_one_that_dies_without_its_will_turns_offline(idle_cell: IdleCell) -> None:
    watcher = idle_cell.watcher("watcher")
    fleet = Fleet(idle_cell.run).start(watcher)
    feed = TelemetryFeed(watcher, idle_cell.run).start()
    monitor = MonitorState()

    def monitor_state() -> str:
        _, _, statuses = feed.poll()
        for node, state, heartbeat, age in statuses:
            monitor.add_status(node, state, time.monotonic() - age, heartbeat)
        view = monitor.cells.get("c0")
        return monitor.state_of(view, time.monotonic()) if view is not None else "none"

    # idle, and again every heartbeat: shown online and idle, with the period it declared
    assert wait_until(lambda: "c0" in fleet.nodes and fleet.nodes["c0"].updates >= 3, 10 * PERIOD)
    row = fleet.nodes["c0"].as_dict(time.monotonic())
    assert (row["state"], row["online"], fleet.nodes["c0"].record["heartbeat"]) == ("idle", True, PERIOD)
    assert wait_until(lambda: monitor_state() == "idle", 10 * PERIOD)
    idle_cell.crash()
    died = time.monotonic()
    gone = lambda: fleet.nodes["c0"].as_dict(time.monotonic())["state"] == "offline"  # noqa: E731
    assert wait_until(gone, 10 * PERIOD)
    assert time.monotonic() - died <= 3 * PERIOD + 1.0  # within three heartbeats (and a bit)
    assert fleet.nodes["c0"].as_dict(time.monotonic())["idle_heartbeat_missed"]
    assert wait_until(lambda: monitor_state() == "offline", 10 * PERIOD)
    assert "cell c0 is offline (idle, its heartbeat missed)" in monitor.alerts(time.monotonic())


def test_a_fleet_view_opened_after_an_idle_node_died_shows_it_offline(idle_cell: IdleCell) -> None:
    """`fedtier fleet` opens a fresh view each time and listens a few seconds: a dead idle node's retained record
    arrives at once, as if just heard. The record says when it was published, so a fresh view shows the node
    offline at once, and a live idle node's idle (its newest beat is recent); so does `fedtier monitor --once`."""

    def fresh_view(name: str) -> Fleet:  # as one `fedtier fleet` run: its own connection and view
        view = Fleet(idle_cell.run).start(idle_cell.watcher(name))
        assert wait_until(lambda: "c0" in view.nodes, 10 * PERIOD)
        return view

    early = fresh_view("early")
    assert wait_until(lambda: early.nodes["c0"].updates >= 3, 10 * PERIOD)  # beating
    assert fresh_view("alive").nodes["c0"].as_dict(time.monotonic())["state"] == "idle"
    idle_cell.crash()
    gone = lambda: early.nodes["c0"].as_dict(time.monotonic())["state"] == "offline"  # noqa: E731
    assert wait_until(gone, 10 * PERIOD)  # three heartbeats missed
    row = fresh_view("late").nodes["c0"].as_dict(time.monotonic())
    assert (row["state"], row["online"], row["idle_heartbeat_missed"]) == ("offline", False, True)
    # `fedtier monitor --once` started now: its first pull of the retained statuses says so too
    feed = TelemetryFeed(idle_cell.watcher("monitor"), idle_cell.run).start()
    view = LiveView(0.5, None, CellFilter(), Console())

    def pulled() -> bool:  # the retained statuses in the monitor's state
        view.pull(feed)
        return "c0" in view.state.cells and view.state.cells["c0"].online is not None

    assert wait_until(pulled, 10 * PERIOD)
    assert view.state.state_of(view.state.cells["c0"], time.time()) == "offline"
