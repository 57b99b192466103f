"""A cell says itself online *anew* at each (re)connect (an order stamp, ``protocols.status.order_stamp``), its
heartbeats repeat that order; the cloud sends the open round's task again to an awaited cell said online anew
(``cloud.parts.CellPresence``), once per new order: a broker that lost every session and that the cloud reconnected
to before a cell no longer costs the round its cell deadline."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cell_server.node import build_cell
from cloud.node import build_cloud
from edge_agent.runner import AgentProcess, BrokerOptions, make_trainer, offline_will
from protocols.status import decode_status, encode_status
from protocols.transport.broker import MosquittoBroker, find_mosquitto
from protocols.transport.memory import MemoryHub
from protocols.transport.threadloop import ThreadLoop
from protocols.wire import topics
from sim.hierarchy import prepare
from tests.conftest import exported_cell, small_config, wait_until

DEVICE = "c0-d0"
CELL_DEADLINE = 30.0
"""The cloud's wait for a cell: the round the broker's crash hits closed by it before the cell said itself anew."""


def _tails(caplog: pytest.LogCaptureFixture, broker: MosquittoBroker, lines: int = 40) -> str:
    """What the nodes of the test (one process) and the broker said last: printed when the test fails."""
    said = [f"{r.name} {r.levelname} {r.getMessage()}" for r in caplog.records][-lines:]
    return "\n".join([*said, "-- mosquitto:", broker.log_text(1000)])


def _hold_reconnects(transport: Any, release: threading.Event) -> None:
    """``transport``'s (an ``MqttTransport`` on paho's own thread) reconnects wait for ``release`` first: the cell
    comes back after the cloud."""
    client = transport._client
    wait = client._reconnect_wait

    def held() -> None:
        release.wait(60.0)
        wait()

    client._reconnect_wait = held


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_cell_back_after_the_cloud_on_a_broker_that_lost_every_session_gets_the_open_rounds_task_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Mosquitto without persistence killed -9 as round 1 is due and started again on its port; the cell's reconnect
    held until the cloud is back and has sent round 1's task (queued while it was down) and its tasks again
    (``CloudServer.tasks_again``, as ``CloudService`` does at a reconnect): both reached no subscription of the
    cell. Before, the cell's status after its reconnect repeated its heartbeat's (no order): the round waited out
    its cell deadline. Now it says itself online anew and the cloud sends it the task again: round 1 closes with
    every cell reported, well before the deadline."""
    caplog.set_level(logging.INFO, logger="fedtier")
    cfg = small_config(
        tmp_path,
        run={"rounds": 2},
        topology={"cells": 1, "devices_per_cell": 1},
        algorithm={"name": "fedavg", "edge_rounds": 1, "local_steps": 2, "batch_size": 16, "lr": 0.1},
        runtime={"cell_deadline": CELL_DEADLINE, "device_deadline": 20.0},
    )
    run, prep = cfg.run.name, prepare(cfg)
    algorithm = cfg.build_algorithm(prep.spec)
    release, crashed = threading.Event(), threading.Event()
    loops = [ThreadLoop("cell").start(), ThreadLoop("cloud").start()]
    with MosquittoBroker() as broker:
        opts = BrokerOptions(broker.url)
        cell_t = opts.transport(topics.cell_node("c0"), run, loops[0], will=offline_will(run, "cell.c0")).connect()
        cell = build_cell(cfg, "c0", cell_t, algorithm, heartbeats=True)
        loops[0].post(cell.start)
        agents = AgentProcess(
            cfg, algorithm, {DEVICE: prep.device_data[DEVICE]}, make_trainer("torch", prep.spec, cfg), opts
        ).start()
        cloud_t = opts.transport("cloud", run, loops[1], will=offline_will(run, "cloud")).connect()

        def crash(record: dict[str, Any]) -> None:  # on the cloud's loop, round 0 recorded: before round 1's task
            if record["round"] == 0:
                _hold_reconnects(cell_t, release)
                broker.kill()
                broker.start()
                crashed.set()

        cloud = build_cloud(cfg, cloud_t, algorithm, startup_wait=cfg.runtime.startup_wait, on_round=crash)
        cloud_t.on_reconnected = lambda: loops[1].post(cloud.tasks_again)  # as cloud.service.CloudService does
        loops[1].post(cloud.start)
        try:
            assert wait_until(crashed.is_set, 60.0), _tails(caplog, broker)
            # the cloud is back, and round 1's task and its resend went to the broker before the cell subscribed
            assert wait_until(lambda: cloud_t.reconnects >= 1 and bool(cloud.counts.resent), 30.0), _tails(
                caplog, broker
            )
            assert cloud_t.flush(10.0) and cloud.history[-1]["round"] == 0, _tails(caplog, broker)
            back = time.monotonic()
            release.set()
            assert wait_until(lambda: len(cloud.history) == 2, CELL_DEADLINE - 5.0), _tails(caplog, broker)
            took = time.monotonic() - back
        finally:
            release.set()
            agents.stop()
            loops[1].post(cloud.stop)
            loops[0].post(cell.stop)
            wait_until(lambda: not cloud_t.connected and not cell_t.connected, 5.0)
            for loop in loops:
                loop.stop()
    last = cloud.history[1]
    assert last["closed_by"] == "all reported" and last["cells_reported"] == ["c0"], (last, _tails(caplog, broker))
    print(f"round 1 closed {took:.2f} s after the cell was let reconnect (cell deadline {CELL_DEADLINE:g} s)")


def test_the_cloud_sends_the_task_again_to_an_awaited_cell_said_online_anew_once_per_new_order(
    tmp_path: Path,
) -> None:
    """The cloud's rule (in memory): a cell it awaits in the open round said online with a newer order than it last
    saw of it (its process reconnected), or by another instance, gets the round's task again, once per new order; its
    heartbeat (the same order), a replay of an older record of its instance, or a cell that already reported gets
    none, nor does a cell past :data:`cloud.parts.MAX_RENEWALS` renewals in the round. The first record heard of a
    cell is no return."""
    cfg = small_config(tmp_path, topology={"cells": 2, "devices_per_cell": 1}, runtime={"cell_deadline": 1000.0})
    hub = MemoryHub()
    cloud = build_cloud(cfg, hub.connect("cloud"), cfg.build_algorithm(prepare(cfg).spec))
    tasks: dict[str, int] = {"c0": 0, "c1": 0}
    peer = hub.connect("cells")
    for cell in tasks:
        peer.subscribe(topics.cell_task(cfg.run.name, cell), lambda t, d, c=cell: tasks.update({c: tasks[c] + 1}))

    def say(cell: str, order: float | None, instance: str = "i1", state: str = "online") -> dict[str, int]:
        """``cell``'s status record, published as its process would; the tasks each cell got so far."""
        topic = topics.status(cfg.run.name, topics.cell_node(cell))
        stamp = {"order": order} if order is not None else {}
        extra = {"devices_online": 1, "devices_total": 1} if state == "online" else {}
        peer.publish(topic, encode_status(state, topic=topic, instance=instance, **stamp, **extra), retain=True)
        hub.loop.run_due()
        return dict(tasks)

    say("c0", 10.0)
    say("c1", 10.0)
    cloud.start()
    hub.loop.run(until=lambda: tasks == {"c0": 1, "c1": 1})
    assert say("c0", 10.0) == {"c0": 1, "c1": 1}  # a heartbeat: the same order
    assert say("c0", 11.0) == {"c0": 2, "c1": 1}  # said anew (reconnected): the task again
    assert say("c0", 11.0) == {"c0": 2, "c1": 1}  # its heartbeats after it
    assert say("c0", 10.0) == {"c0": 2, "c1": 1}  # a replay of an older record of its process
    assert say("c0", None, state="offline") == {"c0": 2, "c1": 1}  # its will (no order)
    assert say("c0", 10.5) == {"c0": 2, "c1": 1}  # after it, a replay of an older online record
    assert say("c0", 12.0) == {"c0": 3, "c1": 1}  # back online anew after its will
    assert say("c0", 1.0, instance="i2") == {"c0": 4, "c1": 1}  # another process of the cell (its own clock)
    assert say("c0", 1.0, instance="i2") == {"c0": 4, "c1": 1}
    assert say("c0", 2.0, instance="i2") == {"c0": 4, "c1": 1}  # a 4th renewal in one round: no more (MAX_RENEWALS)
    cloud.answers.pending.discard("c1")  # as if c1 had reported: the round no longer waits for it
    assert say("c1", 11.0) == {"c0": 4, "c1": 1}
    assert cloud.counts.resent.get("cloud_to_cell", 0) > 0  # counted apart, as retransmission


def test_a_cells_heartbeats_repeat_the_order_it_said_itself_online_at(tmp_path: Path) -> None:
    """A cell's status carries its process's instance and the order it said itself online at (its start; its
    reconnects, above); its heartbeats and other announcements repeat it (a cloud would send its task again at each
    otherwise), and its last status as it stops is newer."""
    cfg, hub, cell, _, peer = exported_cell(tmp_path)
    said: list[dict[str, Any]] = []
    topic = topics.status(cfg.run.name, topics.cell_node("c0"))
    peer.subscribe(topic, lambda t, d: said.append(decode_status(d, t) or {}))
    hub.loop.run(until=lambda: hub.loop.now() > 3.5)  # 3 heartbeats of 1 s
    cell.revoke("c0-d1")  # an announcement of another count
    hub.loop.run_due()
    cell.stop()
    hub.loop.run_due()
    online = [(r["state"], r.get("instance"), r.get("order")) for r in said[:-1]]
    assert len(online) >= 4 and len(set(online)) == 1 and isinstance(online[0][1], str), said
    assert said[-1]["state"] == "offline" and said[-1]["order"] > online[0][2], said


def test_a_cell_sent_its_task_again_as_it_says_itself_anew_trains_it_once_and_sends_a_lost_report_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """In memory, signed: journaled c0 says itself online anew (as at a reconnect) while at work on round 1's task,
    and again once its report of round 2 was lost on the way: the cloud sends it the task each time. At work, it
    carries on (its devices get no task twice, its journal takes nothing more); reported, it sends the same report
    again, which the cloud takes. Model, cell records (but their virtual clock: c0's devices' results take a virtual
    second to arrive, so that it is at work a while) and device traffic are the undisturbed run's."""
    from sim.launcher import SimHierarchy, run_simulation
    from tests.conftest import WALL
    from tests.test_resume import journaled_c0

    def config(name: str) -> Any:
        return small_config(
            tmp_path / name,
            algorithm={"edge_rounds": 2},
            runtime={"device_deadline": 50.0},
            security={"keys": "k.toml"},
        )

    straight = run_simulation(config("straight"))
    sim = SimHierarchy(config("renewed"))
    c0 = sim.cells["c0"] = journaled_c0(sim, resume=False)
    journal_result, publish, lost = c0.journal.result, c0.transport.publish, []

    def result(edge_round: int, device: str, msg: Any) -> None:  # its first result of round 1: at work on it
        journal_result(edge_round, device, msg)
        if (c0.round, edge_round, len(c0.answers.received)) == (1, 0, 1):
            c0._announce_anew()

    def report(topic: str, data: Any, **kw: Any) -> None:  # its first report of round 2 lost on the way
        if topic == topics.cell_report(sim.cfg.run.name, "c0") and c0.round == 2 and not lost:
            lost.append(topic)
            sim.hub.loop.post(c0._announce_anew)
            return
        publish(topic, data, **kw)

    c0.journal.result, c0.transport.publish = result, report  # type: ignore[method-assign]
    results = {topics.device_result(sim.cfg.run.name, "c0", d) for d in sim.cfg.topology.device_ids("c0")}
    sim.hub.link_delay = lambda topic, nbytes: 1.0 if topic in results else 0.0  # c0 at work for a while
    with caplog.at_level(logging.INFO, logger="fedtier"):
        renewed = sim.run()
    said = [r.getMessage() for r in caplog.records]
    assert "cell c0: task for round 2 again, still working on it" in said, said
    assert "cell c0: round 3's task again (its report lost?): re-sending its report" in said, said
    assert [m for m in said if "online anew" in m] == [
        "cloud: c0 is online anew while round 2 waits for it: its task again",
        "cloud: c0 is online anew while round 3 waits for it: its task again",
    ], said
    assert lost and [bool(r.get("bytes_resent")) for r in renewed.history] == [False, True, True], renewed.history
    assert all(np.array_equal(straight.params[k], renewed.params[k]) for k in straight.params)
    strip = lambda recs: [{k: v for k, v in r.items() if k not in WALL and "clock" not in k} for r in recs]  # noqa: E731
    assert strip(renewed.cell_records) == strip(straight.cell_records)
    assert renewed.device_traffic == straight.device_traffic  # no task sent to a device twice
    assert [m["cells_reported"] for m in renewed.history] == [["c0", "c1"]] * 3
