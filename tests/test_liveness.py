"""Dead devices cost no deadline: a device that went offline (its will, or a heartbeat older than
``heartbeat_timeout``) leaves the open edge round; the round closes once every remaining planned device
answered, and the device is not planned in the next one. In memory on a virtual clock, then over MQTT with a
device whose worker is SIGKILLed mid-round."""

from __future__ import annotations

from pathlib import Path

from cell_server.node import build_cell
from protocols.status import encode_status
from protocols.transport.memory import MemoryHub
from protocols.wire import topics
from protocols.wire.envelope import decode_message
from protocols.wire.messenger import Messenger
from protocols.wire.payload import Payload
from sim.hierarchy import prepare
from tests.conftest import small_config

DEVICES = ["c0-d0", "c0-d1", "c0-d2"]
DEADLINE, TIMEOUT, BEAT = 100.0, 4.0, 1.0


class Cell:
    """Cell c0 alone on a memory hub; the test plays the cloud's task, the devices' statuses and results."""

    def __init__(self, tmp_path: Path) -> None:
        cfg = small_config(
            tmp_path,
            algorithm={"edge_rounds": 2},
            runtime={"heartbeat": BEAT, "heartbeat_timeout": TIMEOUT, "device_deadline": DEADLINE},
        )
        self.algorithm = cfg.build_algorithm(prepare(cfg).spec)
        self.run, self.hub = cfg.run.name, MemoryHub()
        self.cell = build_cell(cfg, "c0", self.hub.connect("cell.c0"), self.algorithm, heartbeats=True)
        self.peer = self.hub.connect("peer")
        self.tasks: list[tuple[str, int, int]] = []
        for d in DEVICES:
            self.peer.subscribe(topics.device_task(self.run, "c0", d), self._on_task)
        self.cell.start()
        self.beating = set(DEVICES)  # devices whose agents send a heartbeat every BEAT seconds
        self._beat()
        task = self.algorithm.cloud().plan(0, ["c0"])["c0"]
        Messenger(self.peer, self.run, "cloud").send(
            topics.cell_task(self.run, "c0"), "cell_task", task, round=0, cell="c0"
        )
        self.run_until(lambda: len(self.tasks) == 3)

    def _beat(self) -> None:
        for d in sorted(self.beating):
            self.status(d, "online")
        self.hub.loop.call_later(BEAT, self._beat)

    def _on_task(self, topic: str, data: bytes) -> None:
        header, _ = decode_message(data)
        self.tasks.append((topic.split("/")[-2], header.round, header.edge_round))

    def status(self, device: str, state: str) -> None:
        topic = topics.device_status(self.run, "c0", device)
        self.peer.publish(topic, encode_status(state, topic=topic, cell="c0", samples=10), retain=True)

    def answer(self, device: str, edge_round: int) -> None:
        """``device`` answers with a diverged result (settles it: answered, nothing to aggregate)."""
        Messenger(self.peer, self.run, device).send(
            topics.device_result(self.run, "c0", device),
            "device_result",
            Payload({"diverged": "test"}),
            round=0,
            edge_round=edge_round,
            cell="c0",
        )

    def run_until(self, cond) -> None:
        self.hub.loop.run(until=cond)


def test_a_device_gone_offline_leaves_the_round_after_heartbeat_timeout(tmp_path: Path) -> None:
    """c0-d1's will says offline mid-round; the others answered: the edge round closes heartbeat_timeout later
    plus one heartbeat (it may have been restarting), not at the 100 s deadline; the next edge round does not
    plan it."""
    c = Cell(tmp_path)
    start = c.hub.loop.now()
    c.answer("c0-d0", 0)
    c.answer("c0-d2", 0)
    c.beating.discard("c0-d1")
    c.status("c0-d1", "offline")
    c.run_until(lambda: len(c.cell.records) == 1)
    record = c.cell.records[0]
    assert record["closed_by"] == "all answered" and record["absent"] == {"c0-d1": "offline"}
    assert c.hub.loop.now() - start <= TIMEOUT + BEAT + 0.01
    c.run_until(lambda: len(c.tasks) == 5)
    assert sorted(d for d, _, e in c.tasks if e == 1) == ["c0-d0", "c0-d2"]


def test_a_device_back_within_the_grace_stays_in_the_round(tmp_path: Path) -> None:
    """A restart (offline then online within heartbeat_timeout): the device gets its task again and the round
    still waits for it."""
    c = Cell(tmp_path)
    c.beating.discard("c0-d1")
    c.status("c0-d1", "offline")
    c.run_until(lambda: c.hub.loop.now() >= TIMEOUT / 2)
    c.beating.add("c0-d1")
    c.run_until(lambda: len(c.tasks) == 4)
    c.run_until(lambda: c.hub.loop.now() >= 3 * TIMEOUT)
    assert c.cell.answers.pending == set(DEVICES) and not c.cell.records


def test_a_silent_device_leaves_at_heartbeat_timeout_plus_one_beat(tmp_path: Path) -> None:
    """No will at all (a partitioned device): its heartbeat goes stale, it is deemed offline within one beat
    after heartbeat_timeout and leaves the round at once."""
    c = Cell(tmp_path)
    start = c.hub.loop.now()
    for d in ("c0-d0", "c0-d2"):
        c.answer(d, 0)
    c.beating.discard("c0-d1")  # silent from now on, no will
    c.run_until(lambda: len(c.cell.records) == 1)
    assert c.cell.records[0]["absent"] == {"c0-d1": "offline"}
    assert c.hub.loop.now() - start <= TIMEOUT + BEAT + 0.01


def test_a_device_killed_mid_round_costs_heartbeat_timeout_not_the_deadline(tmp_path: Path) -> None:
    """Over MQTT: c0-d1's worker is SIGKILLed on its task of round 1 (no restart). Its will says offline at
    once; edge round 1.0 of c0 closes heartbeat_timeout later (plus at most one heartbeat), not at the 120 s
    device deadline, and edge round 1.1 does not plan it."""
    from protocols.transport.broker import EmbeddedBroker
    from sim.emulation import Emulation, Faults

    timeout, beat = 2.0, 0.5
    cfg = small_config(
        tmp_path,
        run={"rounds": 2},
        topology={"cells": 1, "devices_per_cell": 2},
        algorithm={"local_steps": 2},
        runtime={"device_deadline": 120.0, "heartbeat": beat, "heartbeat_timeout": timeout},
    )
    with EmbeddedBroker() as broker:
        result = Emulation(cfg, broker_url=broker.url, faults=Faults(crash={"c0-d1": (1, 0)})).run()
    rec = {(r["round"], r["edge_round"]): r for r in result.cell_records}
    assert rec[1, 0]["closed_by"] == "all answered" and rec[1, 0]["absent"] == {"c0-d1": "offline"}
    assert rec[1, 0]["clock_s"] < timeout + beat + 6.0  # + the survivor's training on a loaded machine; deadline 120
    assert rec[1, 1]["planned"] == ["c0-d0"] and rec[1, 1]["absent"] == {"c0-d1": "offline"}
    assert result.status == "finished" and len(result.history) == 2


def test_a_revoked_device_leaves_at_once_and_stays_out(tmp_path: Path) -> None:
    """Revoked mid-round (its heartbeats go on: it lies with valid credentials): out of the round at once, the
    round closes as the others answered, its later 'online' statuses change nothing, the next round skips it."""
    c = Cell(tmp_path)
    start = c.hub.loop.now()
    c.answer("c0-d0", 0)
    c.answer("c0-d2", 0)
    c.run_until(lambda: not c.cell.answers.pending - {"c0-d1"})
    c.cell.revoke("c0-d1")
    assert c.cell.records[0]["absent"] == {"c0-d1": "revoked"} and c.hub.loop.now() == start
    c.run_until(lambda: len(c.tasks) == 5)
    c.run_until(lambda: c.hub.loop.now() >= start + 3 * BEAT)  # c0-d1 keeps beating "online"
    assert sorted(d for d, _, e in c.tasks if e == 1) == ["c0-d0", "c0-d2"] and not c.cell.online["c0-d1"]
