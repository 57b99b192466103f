"""Deployment as a user runs it: ``fedtier cloud``, ``fedtier cell`` and two ``fedtier agent``s, each its
own OS process started from the command line, over one broker; one agent is forward-only
(``--backend onnx`` with the model from ``fedtier export``). The result is ``fedtier sim``'s, byte for byte."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

from edge_agent.runner import save_device_data
from protocols import runfiles
from protocols.config import load_config
from protocols.procs import popen
from protocols.records import CellRecord, read_records, read_run
from protocols.trainer import LocalData
from protocols.transport.broker import EmbeddedBroker
from sim.hierarchy import prepare
from sim.launcher import run_simulation

FEDTIER = str(Path(sys.executable).parent / "fedtier")

CONFIG = """
[run]
name = "deploy"
rounds = 3
output = "{out}"
[topology]
cells = 1
devices_per_cell = 2
[algorithm]
name = "decomfl"
edge_rounds = 1
local_steps = 1
perturbations = 4
lr = 0.02
batch_size = 16
[model]
name = "mlp"
hidden = [8]
[data]
dataset = "digits"
[runtime]
device_deadline = 60.0
onnx_devices = ["c0-d1"]
heartbeat = 1.0
"""


def test_each_tier_in_its_own_process_with_a_forward_only_agent(tmp_path: Path) -> None:
    config = tmp_path / "deploy.toml"
    config.write_text(CONFIG.format(out=tmp_path / "deployed"))
    cfg = load_config(config)
    # what an operator ships to each device: its data file (and the ONNX model for the onnx device); the export runs
    # in this process (a process of its own would import torch again, ~2 s of CPU, for nothing it proves)
    from click.testing import CliRunner

    from fedtier.cli import main

    exported = CliRunner().invoke(main, ["export", str(config), "--out", str(tmp_path / "model.onnx")])
    assert exported.exit_code == 0 and exported.exception is None, exported.output
    sim = run_simulation(load_config(config, [f'run.output="{tmp_path / "sim"}"']))
    prep = prepare(cfg)
    for device, data in prep.device_data.items():
        save_device_data(tmp_path / f"{device}.npz", data, prep.spec)
    save_device_data(tmp_path / "test.npz", LocalData(prep.dataset.x_test, prep.dataset.y_test), prep.spec)

    with EmbeddedBroker() as broker:
        common = ["--broker", broker.url, "--insecure"]
        commands = {
            "cloud": [
                FEDTIER,
                "cloud",
                str(config),
                *common,
                "--test-data",
                str(tmp_path / "test.npz"),
                "--no-progress",
                "-v",
            ],
            "cell": [  # on its own machine: its own run folder
                FEDTIER,
                "cell",
                str(config),
                *common,
                "--cell",
                "c0",
                "--set",
                f'run.output="{tmp_path / "cell"}"',
            ],
            "torch agent": [
                FEDTIER,
                "agent",
                str(config),
                *common,
                "--device",
                "c0-d0",
                "--data",
                str(tmp_path / "c0-d0.npz"),
            ],
            "onnx agent": [
                FEDTIER,
                "agent",
                str(config),
                *common,
                "--device",
                "c0-d1",
                "--data",
                str(tmp_path / "c0-d1.npz"),
                "--backend",
                "onnx",
                "--onnx-model",
                str(tmp_path / "model.onnx"),
            ],
        }
        procs = {
            name: popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for name, cmd in commands.items()
        }
        try:
            outputs = {name: p.communicate(timeout=180)[0] for name, p in procs.items()}
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
    for name, p in procs.items():
        assert p.returncode == 0, f"{name} exited with {p.returncode}:\n{outputs[name]}"
    assert "c0-d1: 3 tasks" in outputs["onnx agent"] and "c0-d0: 3 tasks" in outputs["torch agent"]
    deployed = (tmp_path / "deployed" / runfiles.FINAL_MODEL).read_bytes()
    assert deployed == (sim.output_dir / runfiles.FINAL_MODEL).read_bytes()
    # the cloud's folder holds the whole run: the cell's records came with its telemetry, as the cell wrote them
    cloud_dir, cell_dir = tmp_path / "deployed", tmp_path / "cell"
    own, _ = read_records(cell_dir / runfiles.AGGREGATION)
    records, bad = read_run(cloud_dir)
    assert not bad and not (cloud_dir / runfiles.AGGREGATION).exists() and len(own) == 3
    assert [r for r in records if isinstance(r, CellRecord)] == own
    readers = {  # two independent readers of the finished run's folder, at once
        "logs": [FEDTIER, "logs", str(cloud_dir), "--json"],
        "monitor": [FEDTIER, "monitor", str(cloud_dir), "--once", "--width", "200"],
    }
    started = {
        name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, cmd in readers.items()
    }
    read = {name: p.communicate(timeout=120) for name, p in started.items()}
    for name, p in started.items():
        assert p.returncode == 0, f"fedtier {name} exited with {p.returncode}: {read[name][1]}"
    shown = [json.loads(line) for line in read["logs"][0].splitlines()]
    assert [r for r in shown if r["event"] == "aggregation"] == [r.to_dict() for r in own]
    assert (
        "cells 1: 1 ok" in read["monitor"][0] and "finished" in read["monitor"][0]
    )  # it was "seen never, rounds behind"
    assert "cloud: round 3/3 closed (all reported): cells 1/1 answered" in outputs["cloud"]  # -v: a line a round


def test_unsigned_deployment_commands_refuse_to_start_without_insecure(tmp_path: Path) -> None:
    """``fedtier cloud|cell|agent`` of a config without [security] keys exit 2 before connecting, saying why
    and what to do; with ``--insecure`` a cell goes on (here: to a broker that hangs up, exit 1), warned."""
    from click.testing import CliRunner

    from fedtier.cli import main

    config = tmp_path / "deploy.toml"
    config.write_text(CONFIG.format(out=tmp_path / "run"))
    prep = prepare(load_config(config))
    data = tmp_path / "d.npz"
    save_device_data(data, prep.device_data["c0-d0"], prep.spec)
    nowhere = ["--broker", "mqtt://127.0.0.1:1"]
    for node in (["cloud"], ["cell", "--cell", "c0"], ["agent", "--device", "c0-d0", "--data", str(data)]):
        refused = CliRunner().invoke(main, [node[0], str(config), *node[1:], *nowhere])
        said = " ".join(refused.output.split())  # the console wraps lines
        assert refused.exit_code == 2, said
        assert "unsigned deployment refused" in said and "or --insecure to run unsigned" in said, said
    # with --insecure the cell goes on, to the broker: here a listener that hangs up on it (exit 1 at once; an
    # unreachable port is retried for the 10 s connect timeout)
    with socket.create_server(("127.0.0.1", 0)) as server:
        hang_up = threading.Thread(target=lambda: server.accept()[0].close(), daemon=True)
        hang_up.start()
        broker = ["--broker", f"mqtt://127.0.0.1:{server.getsockname()[1]}"]
        allowed = CliRunner().invoke(main, ["cell", str(config), "--cell", "c0", *broker, "--insecure"])
        hang_up.join(10)
    assert allowed.exit_code == 1 and not hang_up.is_alive(), allowed.output  # it went on, to the broker
    said = " ".join(allowed.output.split())
    assert "unsigned deployment refused" not in said and "--insecure: running unsigned" in said, said


def test_a_cloud_that_cannot_reach_its_broker_leaves_the_last_runs_files(tmp_path: Path) -> None:
    """``fedtier cloud`` replaces the run folder's records and model only once its broker answered: a wrong
    broker address (exit 1) used to delete the last run's metrics, checkpoint, final model and summary first."""
    from click.testing import CliRunner

    from fedtier.cli import main

    config = tmp_path / "deploy.toml"
    config.write_text(CONFIG.format(out=tmp_path / "run"))
    (tmp_path / "run").mkdir()
    kept = {name: f"{name} of the last run".encode() for name in ("metrics.jsonl", "final_model.ftw", "summary.json")}
    for name, data in kept.items():
        (tmp_path / "run" / name).write_bytes(data)
    with socket.create_server(("127.0.0.1", 0)) as server:  # a listener that hangs up: exit 1 at once
        hang_up = threading.Thread(target=lambda: server.accept()[0].close(), daemon=True)
        hang_up.start()
        broker = ["--broker", f"mqtt://127.0.0.1:{server.getsockname()[1]}", "--insecure"]
        done = CliRunner().invoke(main, ["cloud", str(config), *broker])
        hang_up.join(10)
    assert done.exit_code == 1 and "MQTT broker at" in done.output, done.output
    assert {name: (tmp_path / "run" / name).read_bytes() for name in kept} == kept


def test_a_clouds_fresh_start_keeps_the_log_a_cell_sharing_its_folder_has_open(tmp_path: Path) -> None:
    """Cloud and cell started in one folder on one machine: the cloud's fresh start unlinked ``aggregation.jsonl``,
    which a cell started first had open, so the cell's records went to a deleted file (walked, session 23). It
    empties the earlier run's records in place now: the cell's log in the folder holds what the cell writes. The
    cloud's own copy of its cells' records (``cells.jsonl``) was never removed: a new run's were appended to the
    last run's."""
    from protocols.jsonl import JsonlWriter, read_jsonl
    from sim.hierarchy import fresh_output

    config = tmp_path / "deploy.toml"
    config.write_text(CONFIG.format(out=tmp_path / "run"))
    cfg = load_config(config)
    folder = cfg.output_dir()
    folder.mkdir()
    (folder / runfiles.AGGREGATION).write_text('{"round": 7, "cell": "c0", "of": "the last run"}\n')
    (folder / runfiles.METRICS).write_text('{"round": 7}\n')
    stale = [runfiles.CELL_RECORDS, f"{runfiles.CELL_RECORDS}.1", f"{runfiles.AGGREGATION}.1"]
    for name in stale:  # the last run's cell records a deployed cloud kept, and the logs' rotated files
        (folder / name).write_text('{"round": 7, "cell": "c0"}\n')
    cell_log = JsonlWriter(folder / runfiles.AGGREGATION)  # `fedtier cell`, started before its cloud
    try:
        fresh_output(cfg)  # `fedtier cloud`'s fresh start
        cell_log.write({"round": 0, "cell": "c0"})
    finally:
        cell_log.close()
    assert list(read_jsonl(folder / runfiles.AGGREGATION)) == [{"round": 0, "cell": "c0"}]
    assert not (folder / runfiles.METRICS).exists()  # the cloud's own records of the last run: replaced
    assert not any((folder / name).exists() for name in stale)  # cells.jsonl was kept, and appended to
