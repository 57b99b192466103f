"""Fleet scale: many agents per worker process cost sockets, not threads; reconnects back off with jitter."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cell_server.server import CellServer
from protocols import runfiles
from protocols.algorithms import get_algorithm
from protocols.algorithms.base import ModelSpec
from protocols.status import decode_status, encode_status
from protocols.transport.broker import MosquittoBroker, find_mosquitto, free_port
from protocols.transport.memory import MemoryHub
from protocols.transport.mqtt import MqttTransport
from protocols.transport.reactor import Reactor
from protocols.transport.threadloop import ThreadLoop
from protocols.wire import topics
from sim.emulation import Emulation, agent_workers
from sim.launcher import run_simulation
from tests.conftest import beside, small_config, wait_until

needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")


def proc_counts(pid: int) -> tuple[int, int]:
    """(threads, open file descriptors) of process ``pid``."""
    with open(f"/proc/{pid}/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return threads, len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def watcher():
    """``open(url, pattern, handler)``: an MQTT client on its own loop watching ``pattern``; all are
    closed at teardown."""
    opened: list[tuple[MqttTransport, ThreadLoop]] = []

    def open_(url: str, pattern: str, handler: Any) -> MqttTransport:
        loop = ThreadLoop("watcher").start()
        w = MqttTransport.from_url(url, "watcher", loop)
        w.subscribe(pattern, handler)
        opened.append((w, loop))
        return w.connect()

    yield open_
    for w, loop in opened:
        w.close(flush_timeout=0)
        loop.stop()


@needs_mosquitto
def test_300_agents_share_one_worker_process(tmp_path: Path) -> None:
    """300 devices in 3 cells, all in one worker process: every device answers every edge round, and
    the worker holds a handful of threads (a thread per agent would be 300+) and about one socket per
    agent (paho's own loop costs 3 descriptors each)."""
    cfg = small_config(
        tmp_path,
        run={"rounds": 1},
        topology={"cells": 3, "devices_per_cell": 100},
        algorithm={"edge_rounds": 2, "local_steps": 1, "batch_size": 4},
        model={"name": "logreg"},
        runtime={"device_deadline": 60.0, "heartbeat": 1.0},
    )
    seen: list[tuple[int, int]] = []

    def sample(_record: dict[str, Any]) -> None:
        seen.extend(proc_counts(p.pid) for p in em.procs if p.is_alive())

    with MosquittoBroker() as broker:
        em = Emulation(cfg, broker_url=broker.url, workers=1, on_round=sample)
        result = em.run()
    assert len(em.procs) == 1 and seen, "the worker was sampled during the run"
    threads, fds = max(seen)
    assert threads <= 12, f"{threads} threads for 300 agents"
    assert 300 <= fds <= 400, f"{fds} file descriptors for 300 agents"
    assert [r["closed_by"] for r in result.history] == ["all reported"]
    assert len(result.cell_records) == 3 * 2
    assert all(len(r["answered"]) == 100 and not r["absent"] for r in result.cell_records)
    assert sum(t["tasks"] for t in result.device_traffic.values()) == 300 * 2


def test_worker_pool_sizing() -> None:
    assert agent_workers(6, cores=2) == 1
    assert agent_workers(150, cores=2) == 2
    assert agent_workers(2000, cores=2) == 2
    assert agent_workers(2000, cores=64) == 20
    assert agent_workers(5000, cores=2, fd_limit=1024) == 6  # a socket per agent: 960 per worker


@needs_mosquitto
def test_agents_retry_a_broker_that_refuses_them(tmp_path: Path) -> None:
    """A broker that admits 20 connections refuses the rest by hanging up before the CONNACK: the
    transports of a reactor with ``retry_refused`` back off (jitter seeded per client) and all
    connect once the broker makes room; the backoff sequence replays from its seed."""
    port = free_port()
    # Mosquitto 2.0 admits max_connections + 1 clients
    limited = MosquittoBroker(port, extra_config="max_connections 19\n").start()
    reactor, loop = Reactor("test-io").start(), ThreadLoop("test").start()
    first: list[MqttTransport] = []
    rest: list[MqttTransport] = []
    try:
        first = [MqttTransport(f"a{i}", loop, "127.0.0.1", port, reactor=reactor).connect() for i in range(20)]
        rest = [
            MqttTransport(f"b{i}", loop, "127.0.0.1", port, reactor=reactor, retry_refused=True, backoff_seed=i)
            for i in range(10)
        ]
        for t in rest:
            t.start_connect(30.0)
        refused = lambda: all(t._attempts >= 1 for t in rest)  # noqa: E731  (each hung up on, backing off)
        assert wait_until(refused, 30), [t._attempts for t in rest]
        assert not any(t.connected for t in rest), "the broker is full"
        for t in first:
            t.close()
        for t in rest:
            t.finish_connect()
        assert all(t.connected for t in rest)
        assert all(t._attempts == 0 for t in rest)  # reset by the CONNACK
    finally:
        for t in first + rest:
            t.close(flush_timeout=0)
        reactor.close()
        loop.stop()
        limited.stop()
    a, b = (MqttTransport("x", loop, backoff_seed=7) for _ in range(2))
    delays = [a.next_backoff() for _ in range(6)]
    assert delays == [b.next_backoff() for _ in range(6)]
    assert all(0.1 <= d < 0.3 for d in delays[:1]) and delays[-1] > delays[0]


@needs_mosquitto
def test_reactor_reconnects_after_a_broker_restart() -> None:
    """A transport on a reactor resubscribes after the broker comes back and receives again."""
    with MosquittoBroker() as broker:
        reactor, loop = Reactor("test-io").start(), ThreadLoop("test").start()
        got: list[bytes] = []
        arrived = threading.Event()
        sub = MqttTransport(
            "sub",
            loop,
            "127.0.0.1",
            broker.port,
            reactor=reactor,
            reconnect_min_delay=0.1,
            reconnect_max_delay=0.5,
            backoff_seed=1,
        )
        sub.subscribe("t/#", lambda _t, b: (got.append(b), arrived.set()))
        sub.connect()
        assert sub.wait_subscribed()
        try:
            broker.stop()
            deadline = time.monotonic() + 10
            while sub.connected and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not sub.connected
            broker.start()
            assert sub.wait_subscribed(15.0)
            pub = MqttTransport("pub", loop, "127.0.0.1", broker.port, reactor=reactor).connect()
            pub.publish("t/x", b"after")
            assert arrived.wait(10.0) and got == [b"after"]
            pub.close()
        finally:
            sub.close(flush_timeout=0)
            reactor.close()
            loop.stop()


def test_a_cell_receives_only_its_devices_statuses() -> None:
    """Device statuses travel under their cell: each cell's status handler sees its own devices only,
    and the cloud's ``status/+`` carries no device status at all."""
    hub = MemoryHub()
    spec = ModelSpec(name="logreg", input_shape=(4,), num_classes=2)
    fedavg = get_algorithm("fedavg")
    algorithm = fedavg(fedavg.Params(name="fedavg"), spec, 0)
    seen: dict[str, list[str]] = {"c0": [], "c1": []}
    cells = {}
    for c in seen:
        cell = CellServer(
            hub.connect(f"cell-{c}"),
            run="r",
            cell=c,
            devices=[f"{c}-d0", f"{c}-d1"],
            role=algorithm.cell(c),
            algorithm="fedavg",
            device_deadline=5.0,
        )
        handler = cell._on_status
        cell._on_status = lambda t, b, c=c, h=handler: (seen[c].append(t.rsplit("/", 1)[-1]), h(t, b))
        cell.start()
        cells[c] = cell
    cloud_seen: list[str] = []
    hub.connect("cloud").subscribe(topics.statuses("r"), lambda t, b: cloud_seen.append(t))
    for c in seen:
        for d in (f"{c}-d0", f"{c}-d1"):
            hub.connect(d).publish(topics.device_status("r", c, d), encode_status("online", cell=c), retain=True)
    hub.loop.run(until=lambda: all(all(cell.online.values()) for cell in cells.values()))
    assert seen == {c: [f"device.{c}-d0", f"device.{c}-d1"] for c in seen}
    assert not any("device." in t for t in cloud_seen)


@needs_mosquitto
def test_bridged_cell_brokers_are_bit_identical_to_sim(tmp_path: Path, watcher: Any) -> None:
    """``brokers="per-cell"``: two cell Mosquittos bridged to a cloud Mosquitto. The final model is the
    sim's byte for byte; the cloud broker sees the cells' tasks, reports and statuses but no device
    topic, and carries a fraction of the cell brokers' bytes."""
    cfg = small_config(tmp_path / "run", run={"rounds": 2})
    at_cloud: list[str] = []

    def watch(record: dict[str, Any]) -> None:
        if record["round"] == 0:  # round 1 then runs under the watcher's eyes
            watcher(em.started_brokers["cloud"].url, "fedtier/#", lambda t, _b: at_cloud.append(t)).wait_subscribed()

    em = Emulation(cfg, brokers="per-cell", on_round=watch)
    result, sim = beside(em.run, lambda: run_simulation(small_config(tmp_path / "sim", run={"rounds": 2})))
    assert (result.output_dir / runfiles.FINAL_MODEL).read_bytes() == (
        sim.output_dir / runfiles.FINAL_MODEL
    ).read_bytes()
    assert all(r["closed_by"] == "all reported" for r in result.history)
    run = cfg.run.name
    seen = set(at_cloud)
    assert {topics.cell_task(run, c) for c in ("c0", "c1")} <= seen
    assert {topics.cell_report(run, c) for c in ("c0", "c1")} <= seen
    assert not [
        t
        for t in seen
        if "/up/c" in t and t.endswith("/result") or "/status/device." in t or t.endswith("/task") and t.count("/") > 5
    ], sorted(seen)
    traffic = em.broker_bytes
    assert set(traffic) == {"cloud", "c0", "c1"}
    cells_in = traffic["c0"]["received"] + traffic["c1"]["received"]
    assert 0 < traffic["cloud"]["received"] < cells_in


def test_bridge_config_command(tmp_path: Path) -> None:
    """``fedtier bridge-config`` writes one Mosquitto bridge per cell that names only that cell's
    cell <-> cloud topics; an unknown cell is a clear error."""
    from click.testing import CliRunner

    from fedtier.cli import main

    cfg = tmp_path / "run.toml"
    cfg.write_text('[run]\nname = "f"\n[topology]\ncells = 2\ndevices_per_cell = 2\n[data]\ndataset = "digits"\n')
    res = CliRunner().invoke(
        main, ["bridge-config", str(cfg), "--cloud", "mqtt://cloud.example:1884", "--out", str(tmp_path / "bridges")]
    )
    assert res.exit_code == 0, res.output
    conf = (tmp_path / "bridges" / "c1.conf").read_text()
    lines = conf.splitlines()
    assert "address cloud.example:1884" in lines and "cleansession false" in lines
    crossing = {tuple(line.split()[1:3]) for line in lines if line.startswith("topic ")}
    assert crossing == {
        ("fedtier/f/cell/c1/down/task", "in"),
        ("fedtier/f/cloud/round", "in"),
        ("fedtier/f/cloud/control", "in"),
        ("fedtier/f/status/cloud", "in"),
        ("fedtier/f/cloud/job", "in"),
        ("fedtier/f/roster", "in"),
        ("fedtier/f/cloud/up/c1/report", "out"),
        ("fedtier/f/status/cell.c1", "out"),
        ("fedtier/f/state/cell.c1", "out"),
        ("fedtier/f/telemetry/cell/c1", "out"),
    }
    assert "c0" not in conf.replace("fedtier-f-bridge", "")
    bad = CliRunner().invoke(main, ["bridge-config", str(cfg), "--cloud", "mqtt://x:1", "--cell", "c7"])
    assert bad.exit_code == 2 and "unknown cell" in bad.output


@needs_mosquitto
def test_a_cell_broker_restart_mid_run_is_survived_and_recorded(tmp_path: Path, watcher: Any) -> None:
    """Bridged brokers; after round 0 cell c1's broker restarts (its bridge, cell server and agents all
    drop; its retained statuses are gone). The agents and the cell server reconnect with backoff, the
    bridge comes back, and the rounds go on: meanwhile c1 is left out of the cloud's plan (offline) or
    closed out as absent on the deadline, and c1 takes part again, with all its devices, before the end."""
    cfg = small_config(
        tmp_path,
        run={"rounds": 30},
        algorithm={"edge_rounds": 1, "local_steps": 2},
        runtime={"device_deadline": 5.0, "cell_deadline": 10.0, "heartbeat": 0.3},
    )
    run = cfg.run.name

    def restart(record: dict[str, Any]) -> None:
        if record["round"] != 0:
            return
        broker = em.started_brokers["c1"]
        broker.stop()
        broker.start()  # same port, same bridge
        online: set[str] = set()
        back = threading.Event()

        def on_status(topic: str, data: bytes) -> None:
            status = decode_status(data)
            if status and status["state"] == "online":
                online.add(topic)
                if len(online) == 3:
                    back.set()

        watcher(broker.url, topics.device_statuses(run, "c1"), on_status)
        # the agents (another process) reconnect by themselves; the cells wait on this loop meanwhile
        assert back.wait(30.0), "c1's agents did not reconnect to the restarted broker"

    em = Emulation(cfg, brokers="per-cell", on_round=restart)
    result = em.run()
    h = result.history
    assert [r["round"] for r in h] == list(range(30))
    out = [r["round"] for r in h if "c1" not in r["cells_reported"]]
    assert out == list(range(1, 1 + len(out))) and len(out) < 29, out  # from round 1 until back
    assert all("c1" not in r["cells_planned"] or r["cells_absent"] == ["c1"] for r in h if r["round"] in out)
    back = [r for r in result.cell_records if r["cell"] == "c1" and r["round"] > 1 + len(out)]
    assert back and all(len(r["answered"]) == 3 and not r["absent"] for r in back)
    assert all(set(r["absent"].values()) <= {"offline", "deadline"} for r in result.cell_records)
