"""Capabilities: agents announce what their machine has in their signed status; a job's requirements
leave out the devices that miss them, with the reason; `fedtier sim` refuses a job its machine cannot serve."""

from __future__ import annotations

import json

import pytest

from protocols.capabilities import WIRE_VERSION, probe, unmet
from protocols.config import ConfigError, RequirementsSection, load_config
from sim.launcher import run_simulation

CONFIG = """
[run]
name = "caps"
rounds = 4
output = "{out}"
[topology]
cells = 1
devices_per_cell = 2
[algorithm]
name = "fedavg"
local_steps = 1
[model]
name = "mlp"
hidden = [8]
[data]
dataset = "digits"
max_train = 100
[runtime]
device_deadline = 30.0
heartbeat = 1.0
"""


def test_probe_reports_this_machine():
    import os

    import torch

    caps = probe()
    assert caps["cores"] == os.cpu_count() and caps["memory_mb"] > 0 and caps["wire"] == WIRE_VERSION
    assert caps["accelerator"] == ("cuda" if torch.cuda.is_available() else "none")
    assert "torch" in caps["backends"] and json.loads(json.dumps(caps)) == caps  # travels as JSON


NO_TORCH_AT_IMPORT = (
    "fedtier.cli",  # every command (each registers itself on import): `fedtier jobs`, `submit`, `logs`, `--help`...
    "fedtier.serve",
    "cell_server.node",
    "edge_agent.node",
    "cloud.node",
    "monitor.live",
    "monitor.report",
)
"""What a ``fedtier`` process imports before it knows its command: the command line with every command, the
long-lived nodes' service and each tier's node. None may import torch at import (1.3-1.7 s of CPU and ~200 MB a
process): the operator's commands and a cell never need it, an agent and the cloud only once a job comes."""


def test_a_node_probing_a_machine_without_a_gpu_driver_does_not_import_torch():
    """A cell or cloud announces its capabilities at start: on a Linux with no GPU driver in /dev it says
    accelerator none without importing torch (1.5-5 s and ~300 MB a process that never trains); where a driver
    shows, torch still decides (test_probe_reports_this_machine). Nor do the command line's and the nodes'
    modules import it (:data:`NO_TORCH_AT_IMPORT`, in the same fresh interpreter, imported first)."""
    import subprocess
    import sys

    from protocols import capabilities

    code = (
        f"import sys\nfirst = '-'\nfor m in {NO_TORCH_AT_IMPORT!r}:\n    __import__(m)\n"
        "    first = m if first == '-' and 'torch' in sys.modules else first\n"
        "from protocols.capabilities import probe\nprint(first, probe()['accelerator'], 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    first, accelerator, torch_imported = done.stdout.split()
    assert first == "-", f"importing {first} imported torch"
    if capabilities._no_gpu_driver():
        assert (accelerator, torch_imported) == ("none", "False"), done.stdout
    else:
        assert torch_imported == "True", done.stdout


@pytest.mark.parametrize(
    "dev, none",
    [(["null", "shm"], True), (["null", "nvidiactl", "nvidia0"], False), (["kfd"], False), (["dxg"], False)],
)
def test_a_gpu_driver_file_in_dev_lets_torch_decide(monkeypatch, dev, none):
    from protocols import capabilities

    monkeypatch.setattr(capabilities.sys, "platform", "linux")
    monkeypatch.setattr(capabilities.os, "listdir", lambda path: dev if path == "/dev" else [])
    assert capabilities._no_gpu_driver() is none
    monkeypatch.setattr(capabilities.sys, "platform", "darwin")  # elsewhere torch is asked
    assert capabilities._no_gpu_driver() is False


@pytest.mark.parametrize(
    "req, why",
    [
        ({}, None),
        ({"min_cores": 2}, None),
        ({"min_cores": 3}, "2 cores < min_cores 3"),
        ({"min_memory_mb": 5000}, "4096 MB memory < min_memory_mb 5000"),
        ({"accelerator": "cuda"}, "accelerator 'none', the job needs 'cuda'"),
        ({"backend": "onnx"}, "backends ['torch'] lack 'onnx'"),
        ({"wire": 2}, "speaks wire protocol 1, the job needs 2"),
    ],
)
def test_requirements_against_capabilities(req, why):
    caps = {"cores": 2, "memory_mb": 4096, "accelerator": "none", "backends": ["torch"], "wire": 1}
    assert unmet(caps, RequirementsSection(**req)) == why


def test_a_node_that_announced_nothing_serves_only_jobs_that_require_nothing():
    assert unmet(None, RequirementsSection()) is None
    assert unmet(None, RequirementsSection(min_cores=1)) == "announced no capabilities"
    assert unmet({"cores": "many", "wire": 1}, RequirementsSection(min_cores=1)) == "many cores < min_cores 1"


def load_config_text(tmp_path, extra: str = ""):
    path = tmp_path / "caps.toml"
    path.write_text(CONFIG.format(out=tmp_path / "out") + extra)
    return load_config(path)


def test_sim_refuses_a_job_its_machine_cannot_serve(tmp_path):
    cfg = load_config_text(tmp_path, "[requirements]\nmin_memory_mb = 1000000000\n")
    with pytest.raises(ConfigError, match="requirements: .* MB memory < min_memory_mb 1000000000"):
        run_simulation(cfg)


def test_a_job_no_device_can_serve_fails_with_that_reason(tmp_path):
    """`fedtier run` (real broker, agent processes): a job needing more memory than the agents announce plans
    nobody, each cell record says why each device sat out, and the job fails (exit 3) with that reason."""
    import json

    from click.testing import CliRunner

    from fedtier.cli import main
    from protocols.capabilities import machine_caps

    path = tmp_path / "caps.toml"
    path.write_text(CONFIG.format(out=tmp_path / "out") + "[requirements]\nmin_memory_mb = 1000000000\n")
    res = CliRunner().invoke(main, ["run", str(path), "--no-progress"])  # in this process; its agents in their own
    assert res.exit_code == 3, res.output
    want = f"requirements: {machine_caps()['memory_mb']} MB memory < min_memory_mb 1000000000"
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "failed" and "no device meets the job's requirements" in summary["failed"]
    assert want in summary["failed"]  # the reason quotes what each agent announced in its signed status
    records = [json.loads(x) for x in (tmp_path / "out" / "aggregation.jsonl").read_text().splitlines()]
    assert all(r["planned"] == [] and set(r["absent"].values()) == {want} for r in records)


def test_a_gpu_machines_probe_names_its_gpu_without_setting_cuda_up(monkeypatch, tmp_path):
    """On an H200 a `device = "cpu"` run had set CUDA up (a CUDA context on the GPU in every process that announced its
    capabilities): the probe named the GPU with torch.cuda.get_device_name, which initialises CUDA. It now reads the
    NVIDIA driver's files (no context), asks torch only where this process set CUDA up already, else names none."""
    import torch

    from protocols import capabilities

    gpus = tmp_path / "gpus"
    (gpus / "0000:1b:00.0").mkdir(parents=True)
    (gpus / "0000:1b:00.0" / "information").write_text("Model: \t\t NVIDIA H200\nIRQ:   \t\t 39\n")
    (gpus / "0000:00:00.0").mkdir()  # a folder without the file: skipped

    def no_init(*_: object) -> str:
        raise AssertionError("torch.cuda.get_device_name sets CUDA up")

    monkeypatch.setattr(capabilities, "_no_gpu_driver", lambda: False)
    monkeypatch.setattr(capabilities, "NVIDIA_GPUS", str(gpus))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", no_init)
    assert capabilities._cuda() == (True, "NVIDIA H200")
    assert capabilities.probe()["gpu"] == "NVIDIA H200" and capabilities.probe()["accelerator"] == "cuda"
    assert capabilities.gpu_name(str(tmp_path / "none")) == ""  # no driver files, CUDA not set up: no name
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # set up already (the engine's): torch says
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Pretend GPU")
    assert capabilities.gpu_name(str(tmp_path / "none")) == "Pretend GPU"
