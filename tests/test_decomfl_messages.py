"""DeComFL's largest message, a cell's task that carries the whole round log, against ``runtime.max_message_bytes``:
computed to the byte when the algorithm is built, and a bound that cannot hold it refused before the run starts.
Before, the cell refused the task when it came ("payload of N bytes exceeds the limit", in its own log only) and the
round went on without it: the job stalled, or a device never caught up."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from fedtier.cli import main
from protocols.config import ConfigError
from protocols.config.run import MODEL_ENVELOPE_BYTES
from protocols.wire.payload import Payload, payload_size
from sim.launcher import run_simulation

K, P = 1, 2


def decomfl(make_config, tmp_path: Path, rounds: int, bound: int | None = None, out: str = "run"):
    return make_config(
        run={"rounds": rounds, "output": str(tmp_path / out)},
        algorithm={"name": "decomfl", "edge_rounds": 1, "local_steps": K, "perturbations": P, "lr": 0.02},
        runtime={"device_deadline": 5.0, "max_message_bytes": bound},
    )


def largest(cfg) -> tuple[int, int, str]:
    algorithm = cfg.build_algorithm(cfg.model_spec((64,), 10))
    found = algorithm.largest_message()
    assert found is not None
    return found


def test_the_largest_task_is_counted_to_the_byte(make_config, tmp_path) -> None:
    """c0-d0 answers in round 0 only: every later task of c0 carries the log from round 0, and in the last round the
    whole log and the three devices' synced rounds. Its bytes are what largest_message counted (its "id":h entries
    count h's digits: c0-d0's 0 has one fewer)."""
    cfg = decomfl(make_config, tmp_path, 40, bound=None)
    size, meta, what = largest(cfg)
    algorithm = cfg.build_algorithm(cfg.model_spec((64,), 10))
    cloud, cells = algorithm.cloud(), {c: algorithm.cell(c) for c in cfg.topology.cell_ids()}
    for r in range(40):
        tasks, reports = cloud.plan(r, list(cells)), {}
        for c, cell in cells.items():
            cell.begin(r, tasks[c])
            devices = [d for d in cfg.topology.devices(c) if r == 0 or d != "c0-d0"]
            cell.plan(0, devices)
            cell.aggregate(0, {d: Payload({"weight": 1}, {"g": np.zeros((K, P), np.float32)}) for d in devices})
            reports[c] = cell.report()
        if r < 39:
            cloud.aggregate(r, reports)
    task = tasks["c0"]
    assert task.meta["from"] == 0 and task.tensors["g"].shape == (39, K, P) and len(task.meta["synced"]) == 3
    assert size - payload_size(task) == 1 and meta > 0, (size, payload_size(task))
    assert "cell c0's in round 40 (the last), with the whole log (39 rounds x 16 bytes" in what


def test_a_bound_that_cannot_hold_the_whole_log_is_refused_and_one_that_can_runs_a_resume_that_sends_it(
    make_config, tmp_path
) -> None:
    """The worst case happens: `fedtier sim --resume` recreates the devices, and the resumed round's tasks carry the
    log from round 0. A bound one byte short is refused when the algorithm is built (every node, fedtier sim before it
    starts), naming both figures and the fix; at the figure the resume of the last round runs, every device answers."""
    size, _, _ = largest(decomfl(make_config, tmp_path, 8))
    need = size + MODEL_ENVELOPE_BYTES
    with pytest.raises(ConfigError) as refused:
        run_simulation(decomfl(make_config, tmp_path, 8, bound=need - 1))
    assert (
        f"runtime.max_message_bytes = {need - 1:,} cannot hold decomfl's largest task: cell c0's in round 8 "
        f"(the last), with the whole log (7 rounds x 16 bytes"
        in str(refused.value)
        and f"(~{need:,} bytes): raise it to at least {need:,}, or set fewer run.rounds" in str(refused.value)
    ), refused.value
    run_simulation(decomfl(make_config, tmp_path, 7, bound=need))
    resumed = run_simulation(decomfl(make_config, tmp_path, 8, bound=need), resume=True)
    assert [(r["round"], r["metrics"]["devices"]) for r in resumed.history] == [(7, 6)]


def test_fedtier_sim_exits_2_naming_the_bound_and_a_cell_whose_table_is_too_large(make_config, tmp_path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(decomfl(make_config, tmp_path, 100_000).to_toml())
    res = CliRunner().invoke(main, ["sim", str(cfg), "--no-progress", "--set", "runtime.max_message_bytes=100000"])
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and "runtime.max_message_bytes = 100,000 cannot hold decomfl's largest task" in said, said
    assert "Traceback" not in res.output
    many = decomfl(make_config, tmp_path, 10).model_copy(deep=True)
    many.topology.devices_per_cell = 100_000  # ~1.3 MB of "c0-d12345":9 entries, the metadata's bound is 1 MiB
    with pytest.raises(ConfigError, match=r"metadata would be 1,3\d\d,\d\d\d bytes, more than the 1,048,576 .*cells"):
        many.build_algorithm(many.model_spec((64,), 10))
