"""Churn in ``fedtier run``: a device that does not take part in a round really disconnects from the
broker and rejoins for the rounds it takes part in, bit-identically to ``fedtier sim``; retained
records of an earlier run with the same name never stop a new run's nodes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from cell_server.node import build_cell
from cloud.node import build_cloud
from edge_agent.runner import AgentProcess, BrokerOptions, make_trainer, offline_will
from fedtier.node_loop import serve_node, watch_cloud
from protocols import runfiles
from protocols.config import load_config
from protocols.session import CloudSession, decode_manifest, encode_manifest
from protocols.status import decode_status, encode_status
from protocols.transport.broker import EmbeddedBroker
from protocols.transport.mqtt import MqttTransport
from protocols.transport.threadloop import ThreadLoop
from protocols.wire import topics
from protocols.wire.messenger import Messenger
from protocols.wire.payload import Payload
from sim.emulation import Emulation
from sim.hierarchy import participation, prepare
from sim.launcher import run_simulation
from tests.conftest import beside, small_config

CYCLIC = {"model": "cyclic", "groups": 2, "random_offset": False}
MARKOV = {"model": "markov", "p_off": 0.5, "p_on": 0.5, "start_on": 0.5}


def churn_config(tmp_path: Path, name: str, model: dict):
    return small_config(
        tmp_path / name,
        run={"rounds": 3},
        topology={"cells": 2, "devices_per_cell": 2},
        algorithm={"name": "fedavg", "edge_rounds": 2, "local_steps": 5, "batch_size": 16, "lr": 0.1},
        participation=model,
        runtime={"device_deadline": 10.0, "rejoin_poll": 0.2, "rejoin_wait": 20.0},
    )


def collapse(states: list[str]) -> list[str]:
    return [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]]


def until(cond, timeout: float = 20.0) -> bool:
    """Wait for ``cond`` (set by another thread's handler), at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("model", [CYCLIC, MARKOV], ids=["cyclic", "markov"])
def test_absent_agents_disconnect_and_rejoin_bit_identically(model: dict, tmp_path: Path) -> None:
    """Cyclic participation, 2 groups: every device sits out every other round; Markov on/off. Over
    MQTT, each absent device announces offline and disconnects, polls, and comes back online exactly
    for its rounds; the final model and every cell record's planned/answered/absent are the sim's."""
    cfg = churn_config(tmp_path, "run", model)
    takes = participation(cfg)
    seen: dict[str, list[str]] = {}
    with EmbeddedBroker() as broker:
        loop = ThreadLoop("watcher").start()
        watcher = MqttTransport.from_url(broker.url, "watcher", loop)
        watcher.subscribe(
            topics.device_statuses(cfg.run.name),
            lambda t, b: seen.setdefault(t.rsplit("/", 1)[-1], []).append(decode_status(b)),
        )
        watcher.connect().wait_subscribed()
        emulation = Emulation(cfg, broker_url=broker.url)
        result, sim = beside(emulation.run, lambda: run_simulation(churn_config(tmp_path, "sim", model)))
        watcher.close()
        loop.stop()
    assert (result.output_dir / runfiles.FINAL_MODEL).read_bytes() == (
        sim.output_dir / runfiles.FINAL_MODEL
    ).read_bytes()
    keys = ("round", "edge_round", "cell", "planned", "answered", "absent")
    assert [{k: r[k] for k in keys} for r in result.cell_records] == [{k: r[k] for k in keys} for r in sim.cell_records]
    assert any(
        r["absent"] == {d: "not participating" for d in r["absent"]} and r["absent"] for r in result.cell_records
    )
    for device in cfg.topology.all_devices():
        takes_part = ["online" if device in takes.participants(r) else "offline" for r in range(cfg.run.rounds)]
        # the job's records name its session; idle ones (before the job, after it: long-lived) and a will do not (the
        # broker publishes a will when a loaded machine's connect attempt timed out and its retry took the session over)
        in_job = [r["state"] for r in seen[f"device.{device}"] if r.get("session")]
        assert collapse(in_job) == collapse(["online", *takes_part, "offline"]), device
        rejoins = sum(a == "offline" and b == "online" for a, b in zip(["online", *takes_part], takes_part))
        assert emulation.agent_stats[device]["connections"] >= 1 + rejoins  # each return is a new connection
    states = [[r["state"] for r in v] for v in seen.values()]
    assert any(collapse(v).count("online") >= 2 for v in states)  # someone left and came back
    assert any("idle" in v for v in states)  # the agents' long-lived service: idle outside the job


def _retain_finished(transport: MqttTransport, run: str, round: int, session: str) -> None:
    """The ``finished`` record a cloud of ``session`` leaves retained when its job ends after ``round``."""
    Messenger(transport, run, "cloud").send(
        topics.control(run),
        "control",
        Payload({"event": "finished", "round": round, "session": session}),
        round=round,
        retain=True,
    )


def test_stale_finished_does_not_stop_a_new_run(tmp_path: Path) -> None:
    """A cell and an agent start before the cloud while the broker still holds an earlier run's retained
    records (cloud offline, ``finished``, a manifest of round 5): they wait, work through the new run,
    and leave on its own ``finished``."""
    cfg = small_config(
        tmp_path,
        run={"rounds": 1},
        topology={"cells": 1, "devices_per_cell": 1},
        algorithm={"name": "fedavg", "edge_rounds": 1, "local_steps": 2, "batch_size": 16, "lr": 0.1},
        runtime={"startup_wait": 20.0},
    )
    run, device = cfg.run.name, "c0-d0"
    prep = prepare(cfg)
    algorithm = cfg.build_algorithm(prep.spec)
    with EmbeddedBroker() as broker:
        opts = BrokerOptions(broker.url)
        old_loop = ThreadLoop("old").start()
        old = MqttTransport.from_url(broker.url, "old-cloud", old_loop).connect()
        _retain_finished(old, run, 5, "old")
        old.publish(topics.round_manifest(run), encode_manifest("old", 5), retain=True)
        old.publish(topics.status(run, "cloud"), encode_status("offline"), retain=True)
        assert old.flush(5.0)
        old.close()
        old_loop.stop()

        cell_loop = ThreadLoop("cell")
        cell_t = opts.transport(topics.cell_node("c0"), run, cell_loop, will=offline_will(run, "cell.c0")).connect()
        cell = build_cell(cfg, "c0", cell_t, algorithm, heartbeats=True)
        cell_watch = watch_cloud(cell)
        cell_thread = threading.Thread(  # it waits startup_wait for a new cloud, which comes
            target=serve_node, args=(cell, cell_loop, cell_watch, cfg.runtime.startup_wait), daemon=True
        )
        cell_thread.start()
        agents = AgentProcess(
            cfg, algorithm, {device: prep.device_data[device]}, make_trainer("torch", prep.spec, cfg), opts
        ).start()
        assert until(
            lambda: cell_watch.finished_sessions == {"old"} and agents.clouds[device].finished_sessions == {"old"}
        )
        assert cell_thread.is_alive() and not agents.done.is_set()  # the stale records were not obeyed

        cloud_loop = ThreadLoop("cloud").start()
        cloud_t = opts.transport("cloud", run, cloud_loop, will=offline_will(run, "cloud")).connect()
        cloud = build_cloud(cfg, cloud_t, algorithm, startup_wait=cfg.runtime.startup_wait)
        cloud_t.wait_subscribed()
        cloud_loop.post(cloud.start)
        try:
            assert until(lambda: cloud.finished, 30.0)
            assert agents.wait(20.0)
            cell_thread.join(20.0)
            assert not cell_thread.is_alive()
        finally:
            agents.stop()
            cloud_loop.post(cloud.stop)
            assert until(lambda: not cloud_t.connected, 5.0)
            cloud_loop.stop()
    assert agents.stats()[device]["tasks"] == 1 and cloud.history[0]["cells_reported"] == ["c0"]
    assert agents.clouds[device].session == cloud.session != "old"


LATE_CELL = """
[run]
name = "late"
rounds = 1
output = "{out}"
[topology]
cells = 1
devices_per_cell = 1
[algorithm]
name = "fedavg"
[model]
name = "mlp"
hidden = [8]
[data]
dataset = "digits"
[runtime]
startup_wait = {wait}
"""


@pytest.mark.parametrize("wait", [0.5, 0.0])
def test_a_cell_started_after_its_job_ended_leaves_saying_so(tmp_path: Path, wait: float) -> None:
    """``fedtier cell`` started after its run's cloud finished (its ``finished`` record retained, its status
    offline, as the cloud leaves them): it waits ``runtime.startup_wait`` for a new run's cloud, then exits 0 (as a
    device the job never planned), saying the job was over; a device agent started late leaves the same way. Before,
    it never learned the cloud's session (no cloud came online again), ignored ``finished`` and never exited; and
    with ``startup_wait = 0`` the cell looked once, at its start, before the retained records came, and never again.
    """
    from click.testing import CliRunner

    from fedtier.cli import main

    config = tmp_path / "late.toml"
    config.write_text(LATE_CELL.format(out=tmp_path / "run", wait=wait))
    run = "late"
    with EmbeddedBroker() as broker:
        loop = ThreadLoop("ended-cloud").start()
        ended = MqttTransport.from_url(broker.url, "cloud", loop).connect()
        _retain_finished(ended, run, 1, "ended-job")
        ended.publish(topics.status(run, "cloud"), encode_status("offline"), retain=True)
        assert ended.flush(5.0)
        ended.close()
        loop.stop()
        out: list = []
        cell = threading.Thread(
            target=lambda: out.append(
                CliRunner().invoke(main, ["cell", str(config), "--cell", "c0", "--broker", broker.url, "--insecure"])
            ),
            daemon=True,
        )
        cell.start()
        cfg = load_config(config)  # a device agent started late leaves the same way
        prep = prepare(cfg)
        agents = AgentProcess(
            cfg,
            cfg.build_algorithm(prep.spec),
            {"c0-d0": prep.device_data["c0-d0"]},
            make_trainer("torch", prep.spec, cfg),
            BrokerOptions(broker.url),
        ).start()
        try:
            assert agents.wait(30.0), "the late device did not leave"
        finally:
            agents.stop()
        cell.join(30.0)
        assert not cell.is_alive(), "the late cell did not exit"
    assert agents.records.ended == {"c0-d0": "ended-job"} and agents.stats()["c0-d0"]["tasks"] == 0
    said = " ".join(out[0].output.split())  # the console wraps lines
    assert out[0].exit_code == 0, said
    assert "the job was over before this cell started (the cloud finished session ended-job" in said, said


def test_cloud_session_records() -> None:
    s = CloudSession()
    s.on_manifest(decode_manifest(encode_manifest("a", 3)))
    s.on_finished("a")
    assert s.round is None and not s.finished  # no cloud seen online yet
    s.on_status({"state": "online", "session": "a"})
    assert s.round == 3 and s.finished
    s.on_status({"state": "online", "session": "b"})  # a new cloud: the old records no longer count
    assert s.round is None and not s.finished
    s.on_status({"state": "offline"})
    assert s.session == "b" and s.ended is None  # its cloud was seen online: only its own finished ends it
    late = CloudSession()  # a node started after the job ended: the cloud offline, its finished retained
    late.on_finished("a")
    assert late.ended is None  # the cloud's status not heard yet
    late.on_status({"state": "offline"})
    assert late.ended == "a" and not late.finished
    late.on_status({"state": "online", "session": "c"})  # a new run's cloud came
    assert late.ended is None
    for bad in (b"", b"{}", b'{"session": "a", "round": -1}', b'{"session": "a", "round": true}', b"\xff"):
        assert decode_manifest(bad) is None


def test_a_node_that_finds_its_job_finished_works_when_its_cloud_resumes_the_job_for_more_rounds() -> None:
    """A node started after its job's cloud finished (its finished retained, the cloud offline) whose cloud then
    comes back in the same session (``fedtier cloud --resume`` with more rounds) works: before, the session counted
    as finished the moment the cloud came online, and a one-shot cell or agent left at once, exit 0, its work undone."""
    late = CloudSession()
    late.on_finished("a")
    late.on_status({"state": "offline"})
    assert late.ended == "a"
    late.on_status({"state": "online", "session": "a", "started": 2.0})  # the job resumed, its session kept
    assert late.session == "a" and not late.finished and late.ended is None
    late.on_finished("a")  # and when it finishes again, the node leaves
    assert late.finished
    seen = CloudSession()  # the cloud's finished while its status is still online (it stops next): it is finished
    seen.on_status({"state": "online", "session": "a", "started": 1.0})
    seen.on_finished("a")
    seen.on_status({"state": "online", "session": "a", "started": 1.0})  # its retained status again
    assert seen.finished


def test_heartbeats_repeat_the_retained_status_at_qos_0(tmp_path: Path, monkeypatch) -> None:
    """A device announces itself online at QoS 1 (the record the broker retains and the cell acts on),
    then re-announces the same record every heartbeat at QoS 0 (still retained): a lost heartbeat is
    followed by the next, and nobody handles an acknowledgement per heartbeat (~3 % of a fleet's CPU)."""
    cfg = small_config(tmp_path, topology={"cells": 1, "devices_per_cell": 1})
    prep = prepare(cfg)
    algorithm = cfg.build_algorithm(prep.spec)
    device = "c0-d0"
    status = topics.device_status(cfg.run.name, "c0", device)
    sent: list[tuple[bytes, int, bool]] = []
    enough = threading.Event()
    connect = BrokerOptions.transport

    def recording(self, *args, **kwargs):  # the device's connection, its status publishes recorded
        transport = connect(self, *args, **kwargs)
        real = transport.publish

        def publish(topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
            if topic == status:
                sent.append((payload, qos, retain))
                if len(sent) >= 4:
                    enough.set()
            real(topic, payload, qos=qos, retain=retain)

        transport.publish = publish
        return transport

    monkeypatch.setattr(BrokerOptions, "transport", recording)
    with EmbeddedBroker() as broker:
        agents = AgentProcess(
            cfg,
            algorithm,
            {device: prep.device_data[device]},
            make_trainer("torch", prep.spec, cfg),
            BrokerOptions(broker.url),
            heartbeat=0.05,
        )
        try:
            agents.start()
            assert enough.wait(20.0), sent
        finally:
            agents.stop()
    online = [s for s in sent if decode_status(s[0])["state"] == "online"]
    assert online[0][1:] == (1, True) and len(online) >= 4
    assert all(s[1:] == (0, True) and s[0] == online[0][0] for s in online[1:4])


class _NoSubackYet:
    """An MQTT listener that accepts one client (CONNACK), answers its pings and records its publishes, and has not
    acknowledged its SUBSCRIBE yet: as amqtt, which sends a new connection the retained records matching any client's
    filters (a round manifest among them) before its SUBACK."""

    def __init__(self) -> None:
        import socket

        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"mqtt://127.0.0.1:{self.server.getsockname()[1]}"
        self.subscribed = threading.Event()  # its SUBSCRIBE came (and stays unanswered)
        self.published: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        with conn, self.server:
            while head := conn.recv(1):
                size, shift = 0, 0
                while (byte := conn.recv(1)[0]) & 0x80:
                    size, shift = size | (byte & 0x7F) << shift, shift + 7
                size |= byte << shift
                body = b""
                while len(body) < size:
                    body += conn.recv(size - len(body))
                kind = head[0] >> 4
                if kind == 1:  # CONNECT: accepted
                    conn.sendall(b"\x20\x02\x00\x00")
                elif kind == 3:  # PUBLISH: its topic
                    self.published.append(body[2 : 2 + int.from_bytes(body[:2], "big")].decode())
                elif kind == 8:  # SUBSCRIBE: no SUBACK yet
                    self.subscribed.set()
                elif kind == 12:  # PINGREQ
                    conn.sendall(b"\xd0\x00")
                elif kind == 14:  # DISCONNECT: the client lingers until we close
                    return


def test_a_device_that_sits_the_round_out_before_its_suback_does_not_fail_its_agents_start(tmp_path: Path) -> None:
    """A device whose loop reads a round manifest it sits out before the broker's SUBACK closes its connection (to
    rejoin later): its agent process starts all the same, at once, and does not announce it online. Before, ``start``
    waited the whole connect timeout for a SUBACK that a closed connection never gets, then raised, and the agent
    worker died with all its devices (tests/test_decomfl.py's onnx emulation under load: its late worker's c0-d1,
    not in round 0, 'did not acknowledge its subscriptions within 30 s')."""
    cfg = small_config(tmp_path, topology={"cells": 1, "devices_per_cell": 1})
    prep = prepare(cfg)
    device, broker = "c0-d0", _NoSubackYet()
    agents = AgentProcess(
        cfg,
        cfg.build_algorithm(prep.spec),
        {device: prep.device_data[device]},
        make_trainer("torch", prep.spec, cfg),
        BrokerOptions(broker.url),
    )

    def sits_the_round_out() -> None:  # what the manifest's handler does (CloudRecords._disconnect), on the loop
        if broker.subscribed.wait(10.0):
            agents.loop.post(agents.transports[device].close)

    threading.Thread(target=sits_the_round_out, daemon=True).start()
    started = time.monotonic()
    try:
        agents.start(connect_timeout=10.0)
        assert time.monotonic() - started < 5.0 and agents.transports[device].closed
        assert device not in agents.presence.present  # not announced online (its heartbeat would say so)
    finally:
        agents.stop()
    assert topics.device_status(cfg.run.name, "c0", device) not in broker.published
