"""``fedtier run`` (the emulated hierarchy over MQTT): bit-identical to ``fedtier sim``, and robust."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest

from cell_server.server import CellServer
from cloud.jobs import JobQueue
from edge_agent.runner import load_device_data
from protocols import runfiles
from protocols.algorithms import get_algorithm
from protocols.algorithms.base import ModelSpec
from protocols.config import ConfigError, load_config, parse_config
from protocols.jobs import config_hash
from protocols.status import decode_status, encode_status
from protocols.transport.broker import EmbeddedBroker, MosquittoBroker, find_mosquitto
from protocols.transport.memory import MemoryHub
from protocols.transport.mqtt import MqttTransport
from protocols.transport.threadloop import ThreadLoop
from protocols.wire import topics
from sim.emulation import Emulation, Faults, say_failed_workers, worker_groups
from sim.launcher import run_simulation
from sim.local_federation import federation_bundle
from tests.conftest import small_config

QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart.toml"
needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")


# The quickstart's hierarchy, model and algorithm on 200 MNIST samples a device (its own: 6,000) and 10 SGD steps
# an edge round (its own: 50): bit-identity and resuming do not need its full training, which took most of these
# tests' time.
SMALLER = ["data.max_train=2000", "data.max_test=500", "algorithm.local_steps=10"]


def quickstart(out: Path, rounds: int = 2):
    return load_config(QUICKSTART, [f"run.output={json.dumps(str(out))}", f"run.rounds={rounds}", *SMALLER])


@pytest.fixture(scope="module")
def sim_model(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    result = run_simulation(quickstart(tmp_path_factory.mktemp("sim")))
    return (result.output_dir / runfiles.FINAL_MODEL).read_bytes()


@pytest.mark.parametrize("kind", ["amqtt", pytest.param("mosquitto", marks=needs_mosquitto)])
def test_run_is_bit_identical_to_sim(kind: str, sim_model: bytes, tmp_path: Path) -> None:
    """Quickstart, 2 rounds. Over Mosquitto the payloads also travel in 16 KiB chunks (a model is
    ~50 chunks) and every device result is published twice: neither changes a bit."""
    cfg = quickstart(tmp_path)
    opts = {} if kind == "amqtt" else {"max_chunk": 16 * 1024, "faults": Faults(duplicate=True)}
    with EmbeddedBroker() if kind == "amqtt" else MosquittoBroker() as broker:
        result = Emulation(cfg, broker_url=broker.url, **opts).run()
    out = result.output_dir
    assert (out / runfiles.FINAL_MODEL).read_bytes() == sim_model
    assert len(result.history) == 2 and all(r["closed_by"] == "all reported" for r in result.history)
    assert all(not r["absent"] and not r["rejected"] for r in result.cell_records)
    # devices loaded their partitions from their files, as deployed agents do
    data, shape, classes = load_device_data(out / "devices" / "c1-d4.npz")
    assert shape == (1, 28, 28) and classes == 10 and len(data) == 200
    summary = json.loads((out / runfiles.SUMMARY).read_text())
    wire, payload = summary["wire_bytes"], summary["cumulative_bytes"]
    for tier in ("cloud_to_cell", "cell_to_cloud", "cell_to_device"):
        assert payload[tier] < wire[tier] < payload[tier] * 1.01  # the framing costs under 1 %
    factor = 2 if kind == "mosquitto" else 1  # duplicated results are on the wire twice, counted once
    assert factor * payload["device_to_cell"] < wire["device_to_cell"] < factor * payload["device_to_cell"] * 1.01
    assert sum(t["tasks"] for t in summary["device_traffic"].values()) == 2 * 2 * 10


def test_killed_agent_and_foreign_garbage(tmp_path: Path) -> None:
    """c0-d1's worker is SIGKILLed on its task of round 1, edge round 0: the cell closes that edge round
    on its deadline with the survivor, the next one without the (now offline, by its will) device, and
    the run completes. Garbage published by a foreign client on a device topic is rejected and logged."""
    cfg = small_config(  # a deadline waited once: 1.5 s, ~25 times a live device's edge round here under load
        tmp_path, run={"rounds": 2}, topology={"cells": 2, "devices_per_cell": 2}, runtime={"device_deadline": 1.5}
    )
    with EmbeddedBroker() as broker:

        def inject(record: dict) -> None:
            if record["round"] == 0:
                foreign = MqttTransport.from_url(broker.url, "intruder", ThreadLoop()).connect()
                foreign.publish(topics.device_result(cfg.run.name, "c1", "c1-d0"), b"\x00not a message")
                assert foreign.flush(5.0)
                foreign.close()

        result = Emulation(cfg, broker_url=broker.url, on_round=inject, faults=Faults(crash={"c0-d1": (1, 0)})).run()
    assert [r["round"] for r in result.history] == [0, 1]
    rec = {(r["round"], r["edge_round"], r["cell"]): r for r in result.cell_records}
    assert rec[1, 0, "c0"]["closed_by"] == "deadline"
    assert rec[1, 0, "c0"]["answered"] == ["c0-d0"] and rec[1, 0, "c0"]["absent"] == {"c0-d1": "deadline"}
    assert rec[1, 1, "c0"]["planned"] == ["c0-d0"] and rec[1, 1, "c0"]["absent"] == {"c0-d1": "offline"}
    assert rec[1, 0, "c1"]["answered"] == ["c1-d0", "c1-d1"]
    rejected = [x for r in result.cell_records if r["cell"] == "c1" for x in r["rejected"]]
    assert len(rejected) == 1 and rejected[0]["device"] == "c1-d0"
    assert result.history[1]["cells_reported"] == ["c0", "c1"]
    assert np.isfinite(result.history[1]["accuracy"])
    logged = [json.loads(line) for line in (result.output_dir / runfiles.AGGREGATION).read_text().splitlines()]
    assert {(r["round"], r["edge_round"], r["cell"]) for r in logged} == set(rec)


def test_stale_heartbeat_marks_device_offline() -> None:
    """A device whose status is not refreshed within heartbeat_timeout is deemed offline (no will needed)."""
    hub = MemoryHub()
    spec = ModelSpec(name="logreg", input_shape=(4,), num_classes=2)
    algorithm = get_algorithm("fedavg")(get_algorithm("fedavg").Params(name="fedavg"), spec, 0)
    cell = CellServer(
        hub.connect("cell"),
        run="r",
        cell="c0",
        devices=["c0-d0", "c0-d1"],
        role=algorithm.cell("c0"),
        algorithm="fedavg",
        device_deadline=5.0,
        heartbeat=2.0,
        heartbeat_timeout=6.0,
    )
    statuses: list[dict] = []
    watcher = hub.connect("watcher")
    watcher.subscribe(topics.status("r", "cell.c0"), lambda t, b: statuses.append(decode_status(b)))
    cell.start()
    devices = {d: hub.connect(d) for d in cell.devices}

    def beat(device: str) -> None:
        devices[device].publish(topics.device_status("r", "c0", device), encode_status("online"), retain=True)

    beat("c0-d0"), beat("c0-d1")
    loop = hub.loop
    loop.run(until=lambda: all(cell.online.values()))
    assert loop.now() == 0 and cell.online == {"c0-d0": True, "c0-d1": True}
    for t in range(1, 10):  # c0-d0 beats every 2 s, c0-d1 fell silent
        loop.call_later(2.0 * t - loop.now(), lambda: beat("c0-d0"))
    loop.run(until=lambda: loop.now() >= 12.5)
    assert cell.online == {"c0-d0": True, "c0-d1": False}
    assert statuses[-1]["devices_online"] == 1
    beat("c0-d1")
    loop.run(until=lambda: cell.online["c0-d1"])
    assert cell.online["c0-d1"]


def test_helpers() -> None:
    assert worker_groups([f"d{i}" for i in range(5)], 2) == [["d0", "d2", "d4"], ["d1", "d3"]]
    assert worker_groups(["a", "b", "c"], 2, isolate=("b",)) == [["b"], ["a"], ["c"]]
    assert worker_groups(["a", "b"], 8) == [["a"], ["b"]]
    assert topics.tier_of(topics.cell_task("r", "c0")) == "cloud_to_cell"
    assert topics.tier_of(topics.device_task("r", "c0", "c0-d0")) == "cell_to_device"
    assert topics.tier_of(topics.device_result("r", "c0", "c0-d0")) == "device_to_cell"
    assert topics.tier_of(topics.cell_report("r", "c0")) == "cell_to_cloud"
    assert {
        topics.tier_of(t)
        for t in (
            topics.status("r", "device.c0-d0"),
            topics.control("r"),
            topics.round_manifest("r"),
            topics.telemetry_cell("r", "c0"),
            topics.telemetry_cloud("r"),
        )
    } == {None}


def test_run_resumes_after_a_stop(sim_model: bytes, tmp_path: Path) -> None:
    """A `fedtier run` stopped after round 0 and resumed ends with the uninterrupted run's model. A cell record
    of round 1 that the stopped run had written (a Ctrl-C mid-round) is gone: its cells ran round 1 again, and
    `fedtier logs`/`report` would count the round's first edge round twice. The stopped run's broker sessions are
    not the resumed one's (walked: Ctrl-C mid-round 3, then --resume: its cells took the stopped job again from the
    broker's retained record and sessions, its devices trained the stopped job's task 3.1, their results were refused
    as stale, the edge round waited its device deadline without them and the model was not the uninterrupted one)."""
    first = quickstart(tmp_path, rounds=1)
    Emulation(first).run()
    cell_records = tmp_path / runfiles.AGGREGATION
    interrupted = {**json.loads(cell_records.read_text().splitlines()[0]), "round": 1, "time": 1.0}
    with cell_records.open("a") as f:
        f.write(json.dumps(interrupted) + "\n")
    stale = tmp_path / runfiles.BROKER / "shared" / "stopped-run"  # beside the stopped run's mosquitto.db
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("its broker sessions: the stopped job's retained record, the tasks they queued")
    resumed = Emulation(quickstart(tmp_path), resume=True).run()
    assert not stale.exists()  # the resumed run's broker started afresh
    assert [r["round"] for r in resumed.history] == [1]
    assert (tmp_path / runfiles.FINAL_MODEL).read_bytes() == sim_model
    kept = [json.loads(line) for line in cell_records.read_text().splitlines()]
    keys = [(r["round"], r["edge_round"], r["cell"]) for r in kept]
    assert len(keys) == len(set(keys)) and interrupted["time"] not in [r["time"] for r in kept]
    # resumed again with no round left: the job ends at once, before its workers take it; they stop on its retained
    # end and report (walked: they waited for a job that never came, the launcher its 60 s join timeout, then killed)
    again = Emulation(quickstart(tmp_path), resume=True, join_timeout=30.0)
    assert again.run().history == [] and again.served == [[]] * len(again.procs)


def test_run_is_a_local_federation_plus_one_job(tmp_path: Path) -> None:
    """`fedtier run` goes through the service code: its run folder holds the cloud's durable job queue, with
    the run's config as one finished job and its config hash; every agent worker served exactly that job's
    session, with the config of the cloud's job record (the workers' own bundle holds no training config:
    its defaults would train another model, which no cell would accept), and the model is the sim's. Both
    start from a given model (``run.init_model``): the job carries its sha256, not its path."""
    import hashlib

    from protocols.checkpoint import save_params

    plain = small_config(tmp_path)
    start = tmp_path / "start.ftw"
    save_params(
        start, {k: v * 0.5 for k, v in plain.build_algorithm(plain.model_spec((64,), 10)).initial_params().items()}
    )
    sections = {"run": {"rounds": 2, "init_model": str(start)}, "algorithm": {"lr": 0.05}}
    sim = run_simulation(small_config(tmp_path / "sim", **sections))
    cfg = small_config(tmp_path / "emu", **sections)
    emulation = Emulation(cfg, workers=2)
    result = emulation.run()
    assert (result.output_dir / runfiles.FINAL_MODEL).read_bytes() == (
        sim.output_dir / runfiles.FINAL_MODEL
    ).read_bytes()
    [job] = JobQueue(result.output_dir / runfiles.JOBS).jobs.values()
    assert job.state == "finished" and job.digest == config_hash(job.config)
    assert parse_config(tomllib.loads(job.config)).train == cfg.train
    run = tomllib.loads(job.config)["run"]
    assert "init_model" not in run and run["init_model_sha256"] == hashlib.sha256(start.read_bytes()).hexdigest()
    assert emulation.served == [[job.session]] * 2 and job.nonce
    bundle = federation_bundle(cfg)
    assert bundle.model != cfg.model and bundle.train != cfg.train  # what a local copy would have trained


def test_a_job_the_cloud_cannot_start_fails_the_run_with_its_reason(tmp_path: Path) -> None:
    """`fedtier run --resume` from a checkpoint that is no checkpoint (an empty file): the cloud service fails the
    job before it starts, with the reason, the run raises it (exit 2) and the queue keeps it as failed. (The example
    was an asynchronous run, refused --resume until the async cloud resumed.)"""
    cfg = small_config(tmp_path)
    cfg.output_dir().mkdir(parents=True)
    (cfg.output_dir() / runfiles.CHECKPOINT).write_bytes(b"")  # a checkpoint to resume from, unreadable
    with pytest.raises(ConfigError, match="is not a fedtier model/checkpoint file"):
        Emulation(cfg, resume=True, workers=1).run()
    [job] = JobQueue(cfg.output_dir() / runfiles.JOBS).jobs.values()
    assert job.state == "failed" and "is not a fedtier model/checkpoint file" in job.reason


def test_run_says_it_ignores_the_virtual_clock_and_reports_no_virtual_time(tmp_path: Path, caplog) -> None:
    """[clock] models time in fedtier sim only. fedtier run printed its loop clock, the machine's monotonic time
    (hours since boot), as the summary's virtual_time_s; it now says it ignores [clock] and reports none."""
    cfg = small_config(tmp_path, run={"rounds": 1}, algorithm={"edge_rounds": 1}, clock={"device_steps_per_s": 5.0})
    with EmbeddedBroker() as broker, caplog.at_level("WARNING", logger="fedtier.run"):
        result = Emulation(cfg, broker_url=broker.url, workers=1).run()
    assert "[clock] is fedtier sim's virtual clock: fedtier run runs in real time" in caplog.text
    summary = json.loads((result.output_dir / runfiles.SUMMARY).read_text())
    assert summary["status"] == "finished" and "virtual_time_s" not in summary
    assert (
        run_simulation(small_config(tmp_path / "sim", **{"clock": {"device_steps_per_s": 5.0}})).summary()[
            "virtual_time_s"
        ]
        > 0
    )


def test_the_emulation_keeps_no_copy_of_the_samples_it_wrote_for_the_agents(tmp_path: Path) -> None:
    """The run writes each device's samples to its agent's file and trains none itself: it holds no copy of them
    for the run (the data set's LRU of copies, 99618e1, kept up to 256 MiB of them in this process)."""
    import gc

    from protocols.trainer import LocalData
    from sim.hierarchy import prepare

    cfg = small_config(tmp_path)
    prep = prepare(cfg)
    before = [o for o in gc.get_objects() if isinstance(o, LocalData)]  # (held: their ids are not reused)
    emulation = Emulation(cfg)
    emulation._prepare_folder(prep)
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, LocalData) and not any(o is b for b in before)]
    assert all(
        len(load_device_data(f)[0]) == len(prep.device_data.indices(d)) for d, f in emulation.device_files.items()
    )


def test_a_cause_that_stops_every_node_of_fedtier_run_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """``fedtier run --broker`` of a broker that refuses them: the cloud and each cell logged 'CloudService stopped:
    ...', 'CellService stopped: ...' (one line per cell: 101 with 100 cells), and the command then said the same as
    its error. The first is raised (the command says it), the same cause again is not said, another one is, naming
    its node; one never raised (it stopped a node after the job) is said as the federation stops."""
    import logging

    from sim.local_federation import LocalFederation

    class Refused:
        def __init__(self, why: str) -> None:
            self.why = why

        def serve(self) -> None:
            raise ConnectionError(self.why)

        def stop(self) -> None:
            pass

    fed = LocalFederation.__new__(LocalFederation)  # its nodes' serving and stopping only: no broker, no job
    fed.errors, fed.raised, fed.threads = [], False, []
    fed.cloud, fed.cells = Refused(""), {}
    with caplog.at_level(logging.DEBUG, logger="fedtier.run"):
        for node, why in (("cloud", "broker refused"), ("cell c0", "broker refused"), ("cell c1", "disk full")):
            fed._serve(node, Refused(why))
        with pytest.raises(ConnectionError, match="broker refused"):
            fed.check()
        fed.stop()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == ["cell c1 stopped: disk full"]
    fed.errors, fed.raised = [ConnectionError("after the job")], False
    with caplog.at_level(logging.DEBUG, logger="fedtier.run"):
        fed.stop()
    assert caplog.records[-1].levelno == logging.ERROR and caplog.records[-1].getMessage() == "after the job"


def test_a_worker_that_exited_with_an_error_is_said_with_its_devices(caplog) -> None:
    """An agent worker that exited with an error during the job is logged as an error naming its devices (their work
    is missing from the result); one that ended well, or was SIGKILLed (a fault a test injected), is not. Before, the
    run said nothing and a test read KeyError 'c0-d1' (the onnx emulation's worker dead at its start)."""
    import multiprocessing
    import os
    import signal
    import sys

    ctx = multiprocessing.get_context("fork")
    failed = ctx.Process(target=sys.exit, args=(1,), name="fedtier-agents-0")
    ended = ctx.Process(target=sys.exit, args=(0,), name="fedtier-agents-1")
    killed = ctx.Process(target=lambda: os.kill(os.getpid(), signal.SIGKILL), name="fedtier-agents-2")
    for p in (failed, ended, killed):
        p.start()
        p.join(10.0)
    with caplog.at_level("ERROR", logger="fedtier.run"):
        names = say_failed_workers([failed, ended, killed], [["c0-d1"], ["c0-d0", "c1-d0"], ["c1-d1"]])
    assert names == ["fedtier-agents-0"]
    assert caplog.messages == [
        "agent worker fedtier-agents-0 (devices c0-d1) exited with code 1 during the job (its log is above): what its "
        "devices did is missing from the result"
    ]
