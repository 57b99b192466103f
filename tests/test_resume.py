"""Crash-consistent state at every tier, in deployment: each tier its own ``fedtier`` process over a
Mosquitto (amqtt where Mosquitto is not installed), signed, killed with SIGKILL at a point the test
waits for (a record in a file, bounded), restarted with ``--resume``; the final model is the
uninterrupted run's (``fedtier sim`` of the same config), byte for byte, and no round lost a cell."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cell_server.node import build_cell
from cloud.node import build_cloud
from edge_agent.runner import save_device_data
from protocols import runfiles
from protocols.checkpoint import Journal, save_payload
from protocols.config import load_config
from protocols.jsonl import read_jsonl
from protocols.status import decode_status
from protocols.transport.broker import EmbeddedBroker, MosquittoBroker, find_mosquitto
from protocols.transport.mqtt import MqttTransport
from protocols.transport.threadloop import ThreadLoop
from protocols.wire import topics
from protocols.wire.keys import generate_keys, write_keys
from protocols.wire.payload import Payload
from sim.hierarchy import prepare
from sim.launcher import SimHierarchy, device_samples, run_simulation
from tests.conftest import overflow_devices, small_config

FEDTIER = str(Path(sys.executable).parent / "fedtier")

CONFIG = """
[run]
name = "resume"
rounds = {rounds}
output = "{out}"
[topology]
cells = 2
devices_per_cell = 2
[algorithm]
name = "{algorithm}"
edge_rounds = {edge_rounds}
local_steps = 4
lr = 0.05
batch_size = 16
[model]
name = "mlp"
hidden = [8]
[data]
dataset = "digits"
[runtime]
device_deadline = 60.0
heartbeat = 1.0
{runtime}"""
SIGNED = """[security]
keys = "{keys}"
"""


def test_journal_keeps_what_was_fsynced_and_cuts_a_torn_tail(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    journal.reset(Payload({"k": "task", "round": 1}, {"x": np.arange(3, dtype=np.float32)}))
    journal.append(Payload({"k": "result", "n": 1}))
    journal.close()
    data = (tmp_path / "j").read_bytes()
    (tmp_path / "j").write_bytes(data + data[-7:])  # a crash in the middle of the next append
    again = Journal(tmp_path / "j")
    entries = again.read()
    assert [e.meta["k"] for e in entries] == ["task", "result"]
    assert entries[0].tensors["x"].tolist() == [0, 1, 2]
    again.append(Payload({"k": "result", "n": 2}))  # goes where the torn entry began
    assert [e.meta.get("n") for e in Journal(tmp_path / "j").read()] == [None, 1, 2]
    again.reset(Payload({"k": "task", "round": 2}))  # a new round: one entry, whatever was there
    assert [e.meta["round"] for e in Journal(tmp_path / "j").read()] == [2]


def test_a_journal_or_checkpoint_rename_is_made_durable_by_an_fsync_of_its_folder(tmp_path: Path, monkeypatch) -> None:
    """A rename survives a power loss only once its folder is fsynced: before, a machine that crashed after the
    async cloud's checkpoint and journal reset could come back with the new journal (empty, next version) beside
    the old checkpoint (or the reverse), losing or double-counting the pushes of a version."""
    events: list[tuple[str, str]] = []
    replace, fsync = os.replace, os.fsync

    def recording_replace(src: Any, dst: Any) -> None:
        replace(src, dst)
        events.append(("replace", str(Path(dst).parent)))

    def recording_fsync(fd: int) -> None:
        fsync(fd)
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            events.append(("fsync folder", os.readlink(f"/proc/self/fd/{fd}")))

    monkeypatch.setattr(os, "replace", recording_replace)
    monkeypatch.setattr(os, "fsync", recording_fsync)
    folder = str(tmp_path / "d")
    save_payload(tmp_path / "d" / "ckpt", Payload({"round": 1}))
    assert events == [("replace", folder), ("fsync folder", folder)], events
    events.clear()
    journal = Journal(tmp_path / "d" / "j")
    journal.append(Payload({"k": "push"}))  # a journal created by its first append
    assert events == [("fsync folder", folder)], events
    events.clear()
    journal.append(Payload({"k": "push"}))  # its name durable already: the append's own fsync only
    assert events == [], events
    journal.reset(Payload({"version": 2}))
    assert events == [("replace", folder), ("fsync folder", folder)], events


def journaled_c0(sim: SimHierarchy, resume: bool):
    """Cell c0 of ``sim`` with its journal, on a fresh hub connection (``resume``: from the journal)."""
    cfg = sim.cfg
    return build_cell(
        cfg,
        "c0",
        sim.hub.connect("cell.c0"),
        sim.algorithm,
        output_dir=sim.output_dir,
        assume_online=True,
        journal=True,
        resume=resume,
        samples=device_samples(sim.prep.device_data, cfg.topology.device_ids("c0")),
    )


def crash_after_its_first_result_of_round_1_1(sim: SimHierarchy, first: Any, restart: Callable[[], None]) -> None:
    """Make ``first`` (a journaled c0) crash once it has journaled its first result of round 1's second edge round
    (no clean-up: results already on their way reach nobody), then ``restart`` (posted to the loop)."""
    journal_result = first.journal.result

    def result(edge_round, device, msg):
        journal_result(edge_round, device, msg)
        if (first.round, edge_round) == (1, 1) and len(first.answers.received) == 1:
            first.transport.crash()
            first.stop()
            sim.hub.loop.post(restart)

    first.journal.result = result


def test_cell_restarted_from_its_journal_mid_edge_round_gives_the_uninterrupted_model(tmp_path: Path) -> None:
    """In memory: cell c0 crashes (no clean-up, nothing delivered to it until it is back) once it has
    closed round 1's first edge round and taken one result of its second; a new cell server resumes
    from the journal (replays the closed edge round, keeps the result, re-sends the pending tasks):
    the model and c0's records are those of the uninterrupted run."""

    def config(name: str):
        return small_config(
            tmp_path / name,
            algorithm={"edge_rounds": 2},
            runtime={"device_deadline": 50.0},
            security={"keys": "keys.toml"},
        )  # signed: devices take the re-sent task again

    straight = run_simulation(config("straight"))
    sim = SimHierarchy(config("crashed"))
    cfg, out = sim.cfg, sim.output_dir

    def cell(resume: bool):
        return journaled_c0(sim, resume)

    def restart() -> None:
        sim.cells["c0"] = new = cell(resume=True)
        new.start()

    first = sim.cells["c0"] = cell(resume=False)
    crash_after_its_first_result_of_round_1_1(sim, first, restart)
    crashed = sim.run()
    assert sim.cells["c0"] is not first
    assert sim.cells["c0"].resumes and not first.resumes  # what its job line says (cell_server.service)
    assert all(np.array_equal(straight.params[k], crashed.params[k]) for k in straight.params)
    c0 = [r for r in read_jsonl(out / runfiles.AGGREGATION) if r["cell"] == "c0"]
    assert [(r["round"], r["edge_round"]) for r in c0] == [(r, e) for r in range(3) for e in range(2)]
    assert all(r["answered"] == cfg.topology.device_ids("c0") for r in c0), c0
    assert [m["cells_reported"] for m in crashed.history] == [["c0", "c1"]] * 3


def test_a_journaled_results_digest_is_its_signature_checks_not_a_second_sha256_of_its_bytes(monkeypatch) -> None:
    """A journaling cell keeps each result's sha256 (f762da2: a result delivered again after a restart is said taken),
    and hashed every result a second time (~0.5-1 ms per 800 KB result) although its signature check had just hashed
    the same bytes, the payload as it arrived, with the same hash. The journal now takes that digest; an unsigned
    result (no check) is hashed as before. Both are the sha256 of the bytes that arrived."""
    import hashlib

    from cell_server import recovery
    from protocols.config import TopologySection
    from protocols.transport.memory import MemoryHub
    from protocols.wire.keys import Trust
    from protocols.wire.messenger import Messenger

    ring, hub, topic = generate_keys(TopologySection(cells=1, devices_per_cell=1)), MemoryHub(), "t/result"
    result = Payload({"weight": 1.0}, {"w": np.arange(200_000, dtype=np.float32)})  # 800 KB
    hashed: list[int] = []
    monkeypatch.setattr(recovery, "payload_digest", lambda raw: hashed.append(len(raw)) or hashlib.sha256(raw).digest())
    for signed in (True, False):
        trust = (lambda node: Trust(node, ring.private[node], ring.public)) if signed else (lambda node: None)
        device = Messenger(hub.connect("device"), "t", "c0-d0", trust=trust("c0-d0"))
        cell = Messenger(hub.connect("cell"), "t", "c0", trust=trust("c0"))
        msg = cell.receive(topic, device.frame("device_result", result, round=1, cell="c0", topic=topic))
        assert msg is not None and msg.received is not None
        assert recovery.result_digest(msg) == hashlib.sha256(msg.received.view()).hexdigest()
        assert hashed == ([] if signed else [msg.received.nbytes]), signed  # signed: no second pass over its bytes


def test_a_result_a_resumed_cell_took_before_it_died_delivered_again_is_said_taken_not_rejected(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Walk-through (a cell killed -9 mid-job and restarted): the broker delivered again the results the dead cell
    had taken and journaled (its session's, unacknowledged), and the resumed cell logged each as "rejected ...
    stale answer for round N", which reads as an attack. Now the same bytes of a result its journal holds (c0-d0's
    of round 1.0) are said at info level, taken already; a result of round 0 (no longer held) and another result
    of c0-d0 for round 1.0 (other bytes, signed with its key) are still rejected as stale."""
    import logging

    from protocols.wire.envelope import decode_message
    from protocols.wire.keys import node_trust
    from protocols.wire.messenger import Messenger

    cfg = small_config(
        tmp_path,
        run={"rounds": 2},
        algorithm={"edge_rounds": 2},
        runtime={"device_deadline": 50.0},
        security={"keys": "keys.toml"},
    )
    sim = SimHierarchy(cfg)
    run, results = sim.cfg.run.name, {}  # (round, edge round) -> c0-d0's result as delivered
    watch = sim.hub.connect("watch")

    def seen(topic: str, data: Any) -> None:
        h, _ = decode_message(data)
        if h.sender == "c0-d0":
            results[(h.round, h.edge_round)] = (topic, data)

    watch.subscribe(topics.device_result(run, "c0", "c0-d0"), seen)

    def deliver_again(cell) -> None:
        forger = Messenger(sim.hub.connect("forger"), run, "c0-d0", trust=node_trust(sim.cfg, "c0-d0"))
        forger.session = cell.messenger.session
        topic, _ = results[(1, 0)]
        other = Payload(
            {"weight": 1.0, "loss": 0.0}, {k: np.zeros_like(v) for k, v in sim.cloud.role.global_params().items()}
        )
        forged = forger.frame("device_result", other, round=1, edge_round=0, cell="c0", topic=topic)
        for t, data in (results[(1, 0)], results[(0, 1)], (topic, forged)):
            cell._on_result(t, data)

    def restart() -> None:
        sim.cells["c0"] = new = journaled_c0(sim, resume=True)
        new.start()
        deliver_again(new)

    first = sim.cells["c0"] = journaled_c0(sim, resume=False)
    crash_after_its_first_result_of_round_1_1(sim, first, restart)
    with caplog.at_level(logging.INFO, logger="fedtier"):
        sim.run()
    assert sim.cells["c0"] is not first
    said = [r.getMessage() for r in caplog.records if "c0-d0" in r.getMessage() or "stale" in r.getMessage()]
    assert "cell c0: result of c0-d0 for round 2.1 delivered again, already taken" in said, said
    stale = [m for m in said if "rejected" in m]
    assert [m.split(": ", 2)[-1] for m in stale] == [
        "stale answer for round 1.2 (now 2.2)",
        "stale answer for round 2.1 (now 2.2)",
    ], said


def test_a_cell_resumed_under_cell_dp_with_secret_noise_re_sends_what_it_released(tmp_path: Path) -> None:
    """Cell DP with noise drawn from the OS (as deployed): c0 crashes in round 1's second edge round, after
    sending its tasks, which carry edge round 0's noisy sum. The resumed cell replays edge round 0 with the
    noise seed it journaled, so the tasks it sends again are the bytes it released; with fresh noise the
    same sum would go out twice with independent noises (whose mean carries less)."""
    cfg = small_config(
        tmp_path,
        run={"rounds": 2},
        algorithm={"edge_rounds": 2},
        runtime={"device_deadline": 50.0},
        security={"keys": "keys.toml"},
        privacy={"dp": "cell", "noise_multiplier": 1.0, "noise_seed": "system"},
    )
    sim = SimHierarchy(cfg)
    sent: dict[str, list[bytes]] = {}  # a device's task topic -> the tasks c0 sent it for round 1, edge round 1

    def watched(cell):
        send = cell.messenger.send

        def spy(topic, kind, payload, **kw):
            if kind == "device_task" and (kw.get("round"), kw.get("edge_round")) == (1, 1):
                sent.setdefault(topic, []).append(b"".join(v.tobytes() for _, v in sorted(payload.tensors.items())))
            return send(topic, kind, payload, **kw)

        cell.messenger.send = spy
        return cell

    def restart() -> None:
        sim.cells["c0"] = new = watched(journaled_c0(sim, resume=True))
        new.start()

    first = sim.cells["c0"] = watched(journaled_c0(sim, resume=False))
    crash_after_its_first_result_of_round_1_1(sim, first, restart)
    sim.run()
    assert sim.cells["c0"] is not first
    again = {d: tasks for d, tasks in sent.items() if len(tasks) > 1}
    assert again, sent  # the pending devices got their task again
    assert all(len(set(tasks)) == 1 for tasks in again.values())  # the very bytes released before the crash


def test_cell_killed_between_journaling_its_report_and_sending_it_sends_it_on_resume(tmp_path: Path) -> None:
    """In memory: c0 dies right after it journaled its report of round 1 (the publish never leaves); the
    resumed cell sends that report at once, so the cloud's round 1 has both cells and the model is the
    uninterrupted run's."""

    def config(name: str):
        return small_config(tmp_path / name, runtime={"device_deadline": 50.0})

    straight = run_simulation(config("straight"))
    sim = SimHierarchy(config("crashed"))

    def cell(resume: bool):
        return journaled_c0(sim, resume)

    def restart() -> None:
        sim.cells["c0"] = new = cell(resume=True)
        new.start()

    first = sim.cells["c0"] = cell(resume=False)
    journal_report = first.journal.report

    def report(message: bytes) -> None:
        journal_report(message)
        if first.round == 1:
            first.transport.crash()  # the publish that follows is dropped
            first.stop()
            sim.hub.loop.post(restart)

    first.journal.report = report
    crashed = sim.run()
    assert sim.cells["c0"] is not first
    assert [m["cells_reported"] for m in crashed.history] == [["c0", "c1"]] * 3
    assert all(np.array_equal(straight.params[k], crashed.params[k]) for k in straight.params)


def test_a_cell_killed_after_taking_the_next_task_before_journaling_it_is_sent_it_again(tmp_path: Path) -> None:
    """In memory: c0 reported round 1, took round 2's task (acknowledged to the broker) and died before it
    journaled it, so the task is lost with it. The resumed cell, whose journal ends with its report of round 1,
    sends that report again; the cloud, in round 2 and waiting for c0, sends c0 round 2's task again at once:
    round 2 has both cells, closes long before the cell deadline, and the model is the uninterrupted run's."""

    def config(name: str):
        return small_config(tmp_path / name, runtime={"device_deadline": 50.0})

    straight = run_simulation(config("straight"))
    sim = SimHierarchy(config("crashed"))

    def restart() -> None:
        sim.cells["c0"] = new = journaled_c0(sim, resume=True)
        new.start()

    first = sim.cells["c0"] = journaled_c0(sim, resume=False)
    journal_task = first.journal.task

    def task(rnd: int, *args: Any) -> None:
        if rnd != 2:
            return journal_task(rnd, *args)
        first.transport.crash()  # dead before the fsync: nothing of round 2 is journaled, nothing more is sent
        first.stop()
        first.enter_round = first.start_edge = lambda *_: None  # type: ignore[method-assign]
        sim.hub.loop.post(restart)

    first.journal.task = task  # type: ignore[method-assign]
    crashed = sim.run()
    assert sim.cells["c0"] is not first
    assert [m["cells_reported"] for m in crashed.history] == [["c0", "c1"]] * 3
    round2 = crashed.history[2]
    took = round2["clock_s"] - round2["clock_start_s"]
    deadline = sim.cfg.cell_deadline()
    assert round2["closed_by"] == "all reported" and took < deadline / 2, (took, deadline)
    assert all(np.array_equal(straight.params[k], crashed.params[k]) for k in straight.params)


def test_a_restarted_cell_takes_the_results_its_devices_sent_before_it_reopened_the_round(tmp_path: Path) -> None:
    """In memory: c0 sent round 1's first tasks and died before it journaled anything of round 1 (its journal ends
    with its report of round 0), so the resumed cell is between rounds when its devices' results of round 1, queued
    for it, arrive (as after a ``fedtier run`` stopped mid-round and resumed: its agents' persistent sessions hold
    the dead cell's tasks). It keeps them and takes them once round 1 opens: that edge round closes with every
    device and nothing rejected, and the model is the uninterrupted run's. (Refused as stale, they were lost: a
    device answers the task sent again with the same message, dropped as a repeat, and the edge round waited for
    its device deadline without them: another model.)"""

    def config(name: str):
        return small_config(tmp_path / name, runtime={"device_deadline": 50.0})

    straight = run_simulation(config("straight"))
    sim = SimHierarchy(config("crashed"))

    def restart() -> None:
        sim.cells["c0"] = new = journaled_c0(sim, resume=True)
        new.start()

    first = sim.cells["c0"] = journaled_c0(sim, resume=False)
    journal_task, journal_plan, open_edge = first.journal.task, first.journal.plan, first.open_edge

    def task(rnd: int, *args: Any) -> None:
        if rnd != 1:  # round 1: the crash comes before its fsync
            journal_task(rnd, *args)

    def plan(*args: Any) -> None:
        if first.round != 1:
            journal_plan(*args)

    def opened(*args: Any, **kwargs: Any) -> None:
        open_edge(*args, **kwargs)  # the tasks are out
        if first.round == 1:
            first.transport.crash()
            first.stop()
            first.enter_round = first.start_edge = lambda *_: None  # type: ignore[method-assign]

    queued: list[tuple[str, Any]] = []  # what the broker holds for c0's session while it is down

    def tap(topic: str, payload: Any, retain: bool, _sender: str) -> None:
        if first.transport.closed and topic.startswith("fedtier/t/cell/c0/up/") and len(queued) < 3:
            queued.append((topic, payload))
            if len(queued) == 3:  # every device answered the dead cell: it comes back, and gets them
                sim.hub.loop.post(restart)
                sim.hub.loop.post(lambda: [sim.hub.inject(t, p, False) for t, p in queued])

    first.journal.task, first.journal.plan = task, plan  # type: ignore[method-assign]
    first.open_edge = opened  # type: ignore[method-assign]
    sim.hub.tap = tap
    crashed = sim.run()
    assert sim.cells["c0"] is not first
    opened_early = [r for r in crashed.cell_records if (r["cell"], r["round"], r["edge_round"]) == ("c0", 1, 0)]
    assert [(r["closed_by"], r["rejected"], len(r["answered"])) for r in opened_early] == [("all answered", [], 3)]
    assert all(np.array_equal(straight.params[k], crashed.params[k]) for k in straight.params)


def test_a_cell_follows_a_cloud_that_started_afresh_in_a_new_session(tmp_path: Path) -> None:
    """Signed, in memory: after a finished run the same cells (at round 1) serve a cloud started again
    without --resume (a new session, announced by its signed status): they take its round 0 instead of
    refusing it as older, and the new run ends with the same model (fedavg devices keep no state)."""
    sim = SimHierarchy(small_config(tmp_path, run={"rounds": 2}, security={"keys": "keys.toml"}))
    for cell in sim.cells.values():
        cell.start()
    sim.agents.start()
    sim.hub.loop.run()
    sim.cloud.start()
    sim.hub.loop.run(until=lambda: sim.cloud.finished)
    again = build_cloud(sim.cfg, sim.hub.connect("cloud"), sim.algorithm, output_dir=tmp_path / "again")
    assert again.session != sim.cloud.session
    again.start()
    sim.hub.loop.run(until=lambda: again.finished)
    assert [r["cells_reported"] for r in again.history] == [["c0", "c1"]] * 2
    first, second = sim.cloud.role.global_params(), again.role.global_params()
    assert all(np.array_equal(first[k], second[k]) for k in first)


class Deployment:
    """A cloud, one ``fedtier cell`` per cell and one ``fedtier agent`` per device, over ``broker``; the
    cells keep their own run folders (``cells/<cell>``), as on their own machines."""

    def __init__(
        self,
        tmp: Path,
        broker_url: str,
        algorithm: str = "fedavg",
        edge_rounds: int = 1,
        signed: bool = True,
        rounds: int = 3,
        runtime: str = "",
        tables: str = "",
    ) -> None:
        """``runtime``: lines added to the config's ``[runtime]``; ``tables``: more of its tables."""
        self.tmp, self.url = tmp, broker_url
        keys = tmp / "keys.toml"
        self.config = tmp / "run.toml"
        self.config.write_text(
            CONFIG.format(
                out=tmp / "cloud", algorithm=algorithm, edge_rounds=edge_rounds, rounds=rounds, runtime=runtime
            )
            + (SIGNED.format(keys=keys) if signed else "")
            + tables
        )
        self.cfg = load_config(self.config)
        if signed:
            write_keys(keys, generate_keys(self.cfg.topology))
        prep = prepare(self.cfg)
        for device, data in prep.device_data.items():
            save_device_data(tmp / f"{device}.npz", data, prep.spec)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *extra: str) -> None:
        """Start node ``name`` (``cloud``, a cell id or a device id) as its own process."""
        common = [str(self.config), "--broker", self.url, "--insecure"]
        if name == "cloud":
            cmd = [FEDTIER, "cloud", *common, "--no-progress"]
        elif name in self.cfg.topology.cell_ids():
            cmd = [
                FEDTIER,
                "cell",
                *common,
                "--cell",
                name,
                "--set",
                f"run.output={json.dumps(str(self.cell_dir(name)))}",
            ]
        else:
            cmd = [FEDTIER, "agent", *common, "--device", name, "--data", str(self.tmp / f"{name}.npz")]
        log = (self.tmp / f"{name}.log").open("a")
        self.procs[name] = subprocess.Popen(
            [*cmd, *extra], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def start_all_but(self, *started: str) -> None:
        for name in ("cloud", *self.cfg.topology.cell_ids(), *self.cfg.topology.all_devices()):
            if name not in started:
                self.start(name)

    def cell_dir(self, cell: str) -> Path:
        return self.tmp / "cells" / cell

    def kill(self, name: str) -> None:
        """SIGKILL: no clean-up, no offline status but the broker's last will."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def wait_online(self, device: str, timeout: float = 90.0) -> None:
        """Wait until the device's retained status on the broker says online (one subscription, watched as the
        records come: not a fresh connection a poll, each waiting 2 s for a record that is not there yet)."""
        cell = self.cfg.topology.cell_of(device)
        topic = topics.device_status(self.cfg.run.name, cell, device)
        seen: list[bytes] = []
        loop = ThreadLoop("watcher").start()
        watcher = MqttTransport.from_url(self.url, f"watcher-{time.monotonic_ns()}", loop)
        try:
            watcher.subscribe(topic, lambda t, data: seen.append(data))
            watcher.connect().wait_subscribed()
            online = lambda: any((decode_status(d, topic) or {}).get("state") == "online" for d in list(seen))  # noqa: E731
            wait_for(f"agent {device} online", online, timeout)
        finally:
            watcher.close()
            loop.stop()

    def signal(self, name: str, sig: int) -> None:
        self.procs[name].send_signal(sig)

    def wait_all(self, timeout: float = 150.0) -> None:
        deadline = time.monotonic() + timeout
        for name, p in self.procs.items():
            try:
                code = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} still running after {timeout} s:\n{self.log(name)}") from None
            assert code == 0, f"{name} exited with {code}:\n{self.log(name)}"

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


def wait_for(what: str, condition: Callable[[], bool], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def records(path: Path) -> list[dict]:
    return list(read_jsonl(path)) if path.exists() else []


def new_broker() -> MosquittoBroker | EmbeddedBroker:
    """A broker of its own for one deployment (deployments share node ids: their sessions and retained statuses
    must not meet)."""
    return MosquittoBroker() if find_mosquitto() else EmbeddedBroker()


@pytest.fixture
def broker():
    with new_broker() as b:
        yield b


def uninterrupted(dep: Deployment) -> bytes:
    sim = run_simulation(load_config(dep.config, [f"run.output={json.dumps(str(dep.tmp / 'sim'))}"]))
    return (sim.output_dir / runfiles.FINAL_MODEL).read_bytes()


@dataclass
class Killed:
    """A deployment run to its end through the kills of :func:`kill_cell_then_cloud`."""

    dep: Deployment
    expected: bytes  # the uninterrupted run's final model
    done: list[int] | None  # the rounds in the cloud's metrics when it was killed (None: not killed)
    resumed_s: float | None = None  # seconds from the cloud's restart to the end of the run (None: not killed)


def kill_cell_then_cloud(dep: Deployment, kill_cloud: bool) -> Killed:
    """Agent c0-d1 is paused (SIGSTOP) once online, so round 0's first edge round of cell c0 cannot close; once
    c0 has journaled c0-d0's result, c0 is SIGKILLed, c0-d1 continues and ``fedtier cell --resume`` restarts c0.
    With ``kill_cloud``, the cloud is then SIGKILLed once every cell has aggregated round 1's last edge round (so
    they report into the void), and restarted with ``fedtier cloud --resume``. The run goes on to its end."""
    journal = Journal(dep.cell_dir("c0") / runfiles.CELL_JOURNAL.format(cell="c0"))
    cells, last_edge = dep.cfg.topology.cell_ids(), dep.cfg.train.edge_rounds - 1
    done = resumed_at = None
    with ExitStack() as stack:
        stack.callback(dep.close)
        dep.start("c0-d1")
        expected = uninterrupted(dep)  # while c0-d1 starts up (a process of its own, on the other core)
        dep.wait_online("c0-d1")
        dep.signal("c0-d1", signal.SIGSTOP)
        dep.start_all_but("c0-d1")
        wait_for(
            "c0-d0's result of round 0 in c0's journal",
            lambda: any(e.meta.get("k") == "result" and e.meta.get("device") == "c0-d0" for e in journal.read()),
        )
        dep.kill("c0")
        dep.signal("c0-d1", signal.SIGCONT)
        dep.start("c0", "--resume")
        if kill_cloud:
            wait_for(
                "every cell's record of round 1's last edge round",
                lambda: all(
                    any(
                        (r["round"], r["edge_round"]) == (1, last_edge)
                        for r in records(dep.cell_dir(c) / runfiles.AGGREGATION)
                    )
                    for c in cells
                ),
            )
            dep.kill("cloud")
            done = [r["round"] for r in records(dep.tmp / "cloud" / runfiles.METRICS)]
            dep.start("cloud", "--resume")
            resumed_at = time.monotonic()
        dep.wait_all()
    return Killed(dep, expected, done, None if resumed_at is None else time.monotonic() - resumed_at)


@pytest.fixture(scope="module")
def killed_twice(tmp_path_factory: pytest.TempPathFactory) -> Killed:
    """The signed deployment (2 edge rounds a round) with its cell c0 killed in round 0 and its cloud in round 1:
    each test below asserts what its kill must leave (one deployment instead of one for each kill)."""
    with new_broker() as broker:
        return kill_cell_then_cloud(Deployment(tmp_path_factory.mktemp("killed"), broker.url, edge_rounds=2), True)


def test_cloud_killed_mid_round_resumes_to_the_uninterrupted_model(killed_twice: Killed) -> None:
    """SIGKILL the cloud once every cell has aggregated round 1 (so they report into the void), then
    ``fedtier cloud --resume``: it re-sends round 1 in the same session, the cells answer it again
    with their report, and the run ends with the uninterrupted model; every round has every cell."""
    dep, done = killed_twice.dep, killed_twice.done
    cells = dep.cfg.topology.cell_ids()
    assert done is not None
    assert (dep.tmp / "cloud" / runfiles.FINAL_MODEL).read_bytes() == killed_twice.expected
    metrics = records(dep.tmp / "cloud" / runfiles.METRICS)
    assert [m["round"] for m in metrics] == [0, 1, 2], done  # each round once, the re-run one included
    assert all(m["cells_reported"] == cells and m["closed_by"] == "all reported" for m in metrics), metrics
    if 1 not in done:  # the usual case: the cloud died before it took round 1's reports
        assert all("re-sending its report" in dep.log(c) for c in cells)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_cell_killed_mid_round_resumes_and_loses_no_device_result(
    tmp_path: Path, broker, signed: bool, request: pytest.FixtureRequest
) -> None:
    """Agent c0-d1 is paused (SIGSTOP) once online, so round 0's first edge round of cell c0 cannot
    close; once c0 has journaled c0-d0's result, c0 is SIGKILLed, c0-d1 continues (its result goes to
    a cell that is down: the broker queues it in c0's session) and ``fedtier cell --resume`` restarts c0:
    it keeps c0-d0's result, gets c0-d1's from its session (held by the transport until c0 subscribes)
    or, re-sending the task, from c0-d1 again (the same message), waits for its devices' statuses before
    it plans the next edge round, and the run goes on. No device result of the round is lost: every
    edge round has both devices, every round both cells, the model is the uninterrupted run's. (Signed: the
    deployment of ``killed_twice``, whose cloud is killed later too.)"""
    if signed:
        killed: Killed = request.getfixturevalue("killed_twice")
    else:
        killed = kill_cell_then_cloud(Deployment(tmp_path, broker.url, edge_rounds=2, signed=False), False)
    dep = killed.dep
    assert "resumed edge round 1.1 with 1 of 2 results" in dep.log("c0")
    assert (dep.tmp / "cloud" / runfiles.FINAL_MODEL).read_bytes() == killed.expected
    metrics = records(dep.tmp / "cloud" / runfiles.METRICS)
    assert [m["round"] for m in metrics] == [0, 1, 2]
    assert all(m["cells_reported"] == ["c0", "c1"] for m in metrics), metrics
    for cell in ("c0", "c1"):
        aggregation = records(dep.cell_dir(cell) / runfiles.AGGREGATION)
        assert [(r["round"], r["edge_round"]) for r in aggregation] == [(r, e) for r in range(3) for e in range(2)]
        assert all(r["answered"] == dep.cfg.topology.device_ids(cell) for r in aggregation), aggregation


def test_a_cell_resumed_from_a_journal_with_a_diverged_result_never_aggregates_it(tmp_path: Path) -> None:
    """c0-d1's training diverges (inputs that overflow float32): its "diverged" answers are journaled like
    any result. c0 crashes right after journaling it in round 1's second edge round; the resumed cell
    replays the closed edge round and keeps the open one's answer without handing either to the role
    (it once aggregated the diverged payload: a KeyError), and ends with the uninterrupted run's model
    and records."""

    def config(name: str):
        return small_config(
            tmp_path / name,
            algorithm={"edge_rounds": 2},
            runtime={"device_deadline": 50.0},
            security={"keys": "keys.toml"},
        )

    def d1(device: str) -> bool:
        return device == "c0-d1"

    straight = overflow_devices(SimHierarchy(config("straight")), d1).run()
    sim = overflow_devices(SimHierarchy(config("crashed")), d1)
    out = sim.output_dir
    resumed = []

    def restart() -> None:
        sim.cells["c0"] = new = journaled_c0(sim, resume=True)
        resumed.append(new)
        new.start()

    first = sim.cells["c0"] = journaled_c0(sim, resume=False)
    journal_result = first.journal.result

    def result(edge_round, device, msg):
        journal_result(edge_round, device, msg)
        if (first.round, edge_round, device) == (1, 1, "c0-d1") and not resumed:
            first.transport.crash()
            first.stop()
            sim.hub.loop.post(restart)

    first.journal.result = result
    crashed = sim.run()
    assert resumed and sim.cells["c0"] is resumed[0]
    assert all(np.array_equal(straight.params[k], crashed.params[k]) for k in straight.params)
    c0 = [r for r in read_jsonl(out / runfiles.AGGREGATION) if r["cell"] == "c0"]
    assert [(r["round"], r["edge_round"]) for r in c0] == [(r, e) for r in range(3) for e in range(2)]
    assert all(set(r["diverged"]) == {"c0-d1"} and "c0-d1" not in r["answered"] for r in c0), c0
    assert [m["devices_diverged"] for m in crashed.history] == [{"c0": 1}] * 3


def test_a_cell_that_cannot_journal_a_task_fails_the_job_in_that_round_saying_why(tmp_path: Path) -> None:
    """Walk-through (a fleet's cell whose job folder became unwritable mid-job): the cell's journal write of round 5's
    task raised; the cell failed but answered only the next round's task with its failure, so the cloud waited a cell
    deadline (40 s) for round 5 first, and a traceback filled the cell's log. In memory: the write of round 1's task
    fails (no space left); the cell answers round 1 with its failure at once, the job fails in round 1 with why."""
    import errno

    from protocols.jsonl import StorageError

    sim = SimHierarchy(small_config(tmp_path, runtime={"device_deadline": 50.0}))
    cell = sim.cells["c0"] = journaled_c0(sim, resume=False)
    journal_task = cell.journal.task

    def task(rnd: int, *rest: Any) -> None:
        if rnd == 1:
            raise StorageError(errno.ENOSPC, "cannot write cell-c0.journal: No space left on device")
        journal_task(rnd, *rest)

    cell.journal.task = task
    result = sim.run()
    assert "cannot journal round 2's task: [Errno 28] cannot write cell-c0.journal: No space left" in result.failed
    assert result.failed.startswith("cell c0 failed in round 2: ") and len(result.history) == 1, result.failed
    assert sim.hub.loop.now() < 50.0  # (virtual seconds) no deadline waited out


def test_a_report_handed_again_to_a_resumed_cloud_is_said_as_that_not_as_its_cell_coming_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A cloud resumed at round 61 gets c1's report of round 60 again (the broker hands it what the killed cloud took
    and never acknowledged): the cell did not come back, the cloud did; it says so at info and still sends the round's
    task again (the cell may have restarted too). The same repeat in a later round is a cell that came back (warned)."""
    import logging

    from cloud.parts import RoundCounts
    from protocols.wire.envelope import Header

    report = Header(run="r", kind="cell_report", round=60, sender="c1", msg_id="m1", payload_len=0)
    caplog.set_level(logging.INFO, logger="fedtier.cloud")
    assert RoundCounts().lost_task("c1", report, 61, {"c1"}, resumed=True)
    said = [r for r in caplog.records if "c1" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO], caplog.text
    assert "this cloud resumed at round 62" in said[0].getMessage() and "came back" not in said[0].getMessage()
    caplog.clear()
    assert RoundCounts().lost_task("c1", report, 62, {"c1"})
    assert [(r.levelno, "c1 came back after round 61" in r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, True)
    ]


def test_a_cloud_whose_connection_came_back_sends_the_open_rounds_task_again_to_the_cells_it_waits_for(
    tmp_path: Path,
) -> None:
    """A broker killed -9 and started again from its last autosave resumes every session without what it acknowledged
    since: a cell's task or its report in flight then is lost, and the round waited up to its cell deadline. The
    cloud's service calls ``tasks_again`` as its connection comes back (``MqttTransport.on_reconnected``): each cell the
    open round still waits for gets its task again, counted apart as retransmission; a cell that reported does not."""
    from protocols.transport.memory import MemoryHub

    cfg = small_config(tmp_path, topology={"cells": 2, "devices_per_cell": 1}, runtime={"cell_deadline": 1000.0})
    hub = MemoryHub()
    cloud = build_cloud(cfg, hub.connect("cloud"), cfg.build_algorithm(prepare(cfg).spec))
    tasks: dict[str, int] = {}
    peer = hub.connect("cells")
    for cell in ("c0", "c1"):
        peer.subscribe(topics.cell_task(cfg.run.name, cell), lambda t, d: tasks.update({t: tasks.get(t, 0) + 1}))
    cloud.start()
    hub.loop.run(until=lambda: len(tasks) == 2)
    cloud.answers.pending.discard("c1")  # as if c1 had reported: the round waits for c0 alone
    cloud.tasks_again()
    hub.loop.run(until=lambda: sum(tasks.values()) > 2)
    assert tasks == {topics.cell_task(cfg.run.name, "c0"): 2, topics.cell_task(cfg.run.name, "c1"): 1}, tasks
    assert cloud.counts.resent.get("cloud_to_cell", 0) > 0


def test_a_cloud_whose_connection_came_back_says_its_jobs_online_status_again(tmp_path: Path) -> None:
    """Walk (session 25): a broker killed -9 in job i and restarted from its last save, made in job h, held the cloud's
    retained status of h: `fedtier fleet` said 'job job-h...' (the cloud online, without its capabilities) until i
    ended, the cloud saying its status only as a job starts. Its service says the job's status again as its connection
    comes back (``CloudService._tasks_again``, on ``MqttTransport.on_reconnected``), the same bytes."""
    from types import SimpleNamespace

    from cloud.service import CloudService
    from protocols.transport.memory import MemoryHub

    cfg = small_config(tmp_path, topology={"cells": 1, "devices_per_cell": 1}, runtime={"cell_deadline": 1000.0})
    hub, topic = MemoryHub(), topics.status(cfg.run.name, "cloud")
    cloud = build_cloud(cfg, hub.connect("cloud"), cfg.build_algorithm(prepare(cfg).spec))
    cloud.start()  # (the loop not run: in its startup wait, virtual time)
    said = hub._retained[topic]
    hub.inject(topic, b"another job's status, restored", retain=True)
    CloudService._tasks_again(SimpleNamespace(node=cloud, fed=cfg.run.name))  # type: ignore[arg-type]
    assert (
        not cloud.finished and hub._retained[topic] == said and decode_status(said, topic)["session"] == cloud.session
    )
