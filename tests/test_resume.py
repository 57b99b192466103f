"""Crash-consistent state at every tier, in deployment: each tier its own ``fedtier`` process over a
Mosquitto (amqtt where Mosquitto is not installed), signed, killed with SIGKILL at a point the test
waits for (a record in a file, bounded), restarted with ``--resume``; the final model is the
uninterrupted run's (``fedtier sim`` of the same config), byte for byte, and no round lost a cell."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import pytest

from edge_agent.runner import save_device_data
from protocols import runfiles
from protocols.config import load_config
from protocols.jsonl import read_jsonl
from protocols.transport.broker import EmbeddedBroker, MosquittoBroker, find_mosquitto
from protocols.wire.keys import generate_keys, write_keys
from sim.hierarchy import prepare
from sim.launcher import run_simulation

FEDTIER = str(Path(sys.executable).parent / "fedtier")

CONFIG = """
[run]
name = "resume"
rounds = 3
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
[security]
keys = "{keys}"
"""


class Deployment:
    """A cloud, one ``fedtier cell`` per cell and one ``fedtier agent`` per device, over ``broker``; the
    cells keep their own run folders (``cells/<cell>``), as on their own machines."""

    def __init__(self, tmp: Path, broker_url: str, algorithm: str = "fedavg", edge_rounds: int = 1) -> None:
        self.tmp, self.url = tmp, broker_url
        keys = tmp / "keys.toml"
        self.config = tmp / "run.toml"
        self.config.write_text(CONFIG.format(out=tmp / "cloud", keys=keys, algorithm=algorithm,
                                             edge_rounds=edge_rounds))
        self.cfg = load_config(self.config)
        write_keys(keys, generate_keys(self.cfg.topology))
        prep = prepare(self.cfg)
        for device, data in prep.device_data.items():
            save_device_data(tmp / f"{device}.npz", data, prep.spec)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *extra: str) -> None:
        """Start node ``name`` (``cloud``, a cell id or a device id) as its own process."""
        common = [str(self.config), "--broker", self.url]
        if name == "cloud":
            cmd = [FEDTIER, "cloud", *common, "--no-progress"]
        elif name in self.cfg.topology.cell_ids():
            cmd = [FEDTIER, "cell", *common, "--cell", name, "--set", f"run.output={json.dumps(str(self.cell_dir(name)))}"]
        else:
            cmd = [FEDTIER, "agent", *common, "--device", name, "--data", str(self.tmp / f"{name}.npz")]
        log = (self.tmp / f"{name}.log").open("a")
        self.procs[name] = subprocess.Popen([*cmd, *extra], stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def start_all(self) -> None:
        self.start("cloud")
        for cell in self.cfg.topology.cell_ids():
            self.start(cell)
        for device in self.cfg.topology.all_devices():
            self.start(device)

    def cell_dir(self, cell: str) -> Path:
        return self.tmp / "cells" / cell

    def kill(self, name: str) -> None:
        """SIGKILL: no clean-up, no offline status but the broker's last will."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

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


@pytest.fixture
def broker():
    with (MosquittoBroker() if find_mosquitto() else EmbeddedBroker()) as b:
        yield b


def uninterrupted(dep: Deployment) -> bytes:
    sim = run_simulation(load_config(dep.config, [f"run.output={json.dumps(str(dep.tmp / 'sim'))}"]))
    return (sim.output_dir / runfiles.FINAL_MODEL).read_bytes()


def test_cloud_killed_mid_round_resumes_to_the_uninterrupted_model(tmp_path: Path, broker) -> None:
    """SIGKILL the cloud once every cell has aggregated round 1 (so they report into the void), then
    ``fedtier cloud --resume``: it re-sends round 1 in the same session, the cells answer it again
    with their report, and the run ends with the uninterrupted model; every round has every cell."""
    dep = Deployment(tmp_path, broker.url)
    expected = uninterrupted(dep)
    cells = dep.cfg.topology.cell_ids()
    with ExitStack() as stack:
        stack.callback(dep.close)
        dep.start_all()
        wait_for("every cell's round-1 record", lambda: all(
            any(r["round"] == 1 for r in records(dep.cell_dir(c) / runfiles.AGGREGATION)) for c in cells))
        dep.kill("cloud")
        done = [r["round"] for r in records(tmp_path / "cloud" / runfiles.METRICS)]
        dep.start("cloud", "--resume")
        dep.wait_all()
    assert (tmp_path / "cloud" / runfiles.FINAL_MODEL).read_bytes() == expected
    metrics = records(tmp_path / "cloud" / runfiles.METRICS)
    assert [m["round"] for m in metrics] == [0, 1, 2], done  # each round once, the re-run one included
    assert all(m["cells_reported"] == cells and m["closed_by"] == "all reported" for m in metrics), metrics
    if 1 not in done:  # the usual case: the cloud died before it took round 1's reports
        assert all("re-sending its report" in dep.log(c) for c in cells)
