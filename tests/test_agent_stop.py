"""``AgentProcess.stop`` is final: a heartbeat in flight when it stops schedules no further beat, and a beat whose
timer fired as it stopped announces nothing. Real Mosquitto; the beat is held mid-announce by the test, so the
interleaving is forced, not hoped for."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from protocols.transport.broker import MosquittoBroker, find_mosquitto
from tests.test_twin_agent import agents_of

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
DEVICE = "c0-d0"


def test_a_heartbeat_in_flight_at_stop_schedules_no_beat_after_it(tmp_path: Path) -> None:
    with MosquittoBroker() as broker:
        # no beat of its own: the test starts the one in flight
        agents = agents_of(tmp_path, broker.url, None, heartbeat=3600.0).start()
        agent, reactor = agents.agents[DEVICE], agents.links.reactor
        in_beat, release, cancelled = threading.Event(), threading.Event(), threading.Event()
        beats: list[str] = []  # what the heartbeat announced
        scheduled_after_stop: list[Any] = []
        announce, call_later, cancel = agent.announce, reactor.call_later, reactor.cancel

        def held_announce(state: str, qos: int = 1, heartbeat: float = 0.0) -> None:
            if qos == 0:  # a heartbeat: the first is held until the test lets it go
                beats.append(state)
                in_beat.set()
                assert release.wait(10.0)
            announce(state, qos, heartbeat)

        def watched_call_later(delay: float, fn: Any) -> Any:
            if cancelled.is_set() and fn == agents._beat:
                scheduled_after_stop.append(fn)
            return call_later(delay, fn)

        def watched_cancel(handle: Any) -> None:
            cancel(handle)
            cancelled.set()  # stop has cancelled the beat timer it knows of

        agent.announce, reactor.call_later, reactor.cancel = held_announce, watched_call_later, watched_cancel
        reactor.run_soon(agents._beat)  # a beat, on the I/O thread as its timer runs it
        assert in_beat.wait(10.0)
        stopping = threading.Thread(target=agents.stop, name="stop")
        stopping.start()
        assert cancelled.wait(10.0)  # stop is under way, the beat still in flight
        release.set()
        stopping.join(20.0)
        assert not stopping.is_alive()
        assert beats == ["online"] and scheduled_after_stop == []
        agents._beat()  # a beat whose timer fired just as stop cancelled it: it says nothing
        assert beats == ["online"] and scheduled_after_stop == []


def test_a_device_whose_broker_lost_its_session_says_online_anew_so_its_cell_sends_its_task_again(
    tmp_path: Path,
) -> None:
    """Walk-through (a provisioned fleet's Mosquitto killed -9 mid-job and started again before its autosave): the task
    the broker held for a device went with it; the device reconnected, found no session and re-announced itself online
    with its last record repeated (the same order), which its cell took for a heartbeat, not a return: the edge round
    waited out its device deadline (60 s). It now says it anew (a newer order: ``StatusChange.renewed``, the task
    again, ``cell_server.edge_liveness.on_status``). And a broker restored from its last autosave resumes the device's
    session without what it took since (walked: a task lost so, an edge round waited out its 60 s deadline for both
    devices): a reconnect that resumes its session says it online anew too (here a clean stop: the state is saved)."""
    from protocols.status import decode_status
    from protocols.transport.mqtt import MqttTransport
    from protocols.transport.threadloop import ThreadLoop
    from protocols.wire import topics
    from tests.conftest import wait_until

    loop = ThreadLoop("cell").start()

    def reconnected(broker: MosquittoBroker) -> tuple[list[float], Any]:
        """The order of each online record of the device its cell reads, across a restart of ``broker``; its link."""
        orders: list[float] = []

        def heard(topic: str, data: bytes) -> None:
            record = decode_status(data, topic, None) if data else None
            if record is not None and record["state"] == "online":
                orders.append(record["order"])

        agents = agents_of(tmp_path, broker.url, None, heartbeat=3600.0).start()
        cell = MqttTransport.from_url(broker.url, "cell", loop, persistent=True).connect(10.0)
        try:
            cell.subscribe(topics.device_status(agents.cfg.run.name, "c0", DEVICE), heard)
            assert wait_until(lambda: len(orders) == 1, 10.0), orders
            broker.stop()
            broker.start()
            link = agents.transports[DEVICE]
            assert wait_until(lambda: link.reconnects >= 1 and len(orders) >= 2 and orders[-1] > orders[0], 15.0), (
                orders
            )
            return orders, link
        finally:
            cell.close()
            agents.stop()

    try:
        with MosquittoBroker() as broker:  # no persistence: every session, and what it held, is gone
            assert reconnected(broker)[1].sessions_lost == 1
        with MosquittoBroker(persistence=tmp_path / "db") as broker:  # a clean stop saves the sessions
            assert reconnected(broker)[1].sessions_lost == 0
    finally:
        loop.stop()
