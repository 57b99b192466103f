"""``fedtier run`` with ``runtime.engine = "cohort"``: each agent worker trains its agents' queued tasks
as cohorts (``edge_agent/cohort.py``); the result is the per-device engine's within float tolerance,
with the same messages and records."""

from __future__ import annotations

import re
import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from edge_agent.cohort import CohortExecutor
from fedtier.cli import main
from protocols.algorithms.base import DeviceContext, ModelSpec
from protocols.config import ConfigError
from protocols.torch_trainer import TorchTrainer
from protocols.trainer import LocalData
from protocols.transport.broker import EmbeddedBroker, MosquittoBroker, find_mosquitto
from protocols.transport.threadloop import ThreadLoop
from protocols.wire.payload import Payload
from sim.emulation import Emulation
from sim.launcher import run_simulation
from tests.conftest import beside, small_config, wait_until
from tests.test_cohort import ATOL, RTOL, WALL, _approx


def test_emulated_cohorts_match_the_per_device_sim(tmp_path: Path) -> None:
    """16 agents in one worker, cohorts of at most 4: the final model is the per-device sim's within
    float tolerance, every device answered every edge round, and tasks really trained together."""
    sections = dict(
        run={"rounds": 2},
        topology={"cells": 2, "devices_per_cell": 8},
        algorithm={"edge_rounds": 2, "local_steps": 3, "batch_size": 16},
    )
    sim_cfg = small_config(tmp_path / "sim", runtime={"device_deadline": 60.0}, **sections)
    cfg = small_config(
        tmp_path / "run", runtime={"engine": "cohort", "cohort_size": 4, "device_deadline": 60.0}, **sections
    )
    watched = "log_type notice\nconnection_messages true"  # who connected: said when the model differs
    with MosquittoBroker(extra_config=watched) if find_mosquitto() else EmbeddedBroker() as broker:
        em = Emulation(cfg, broker_url=broker.url, workers=1)
        run, sim = beside(em.run, lambda: run_simulation(sim_cfg, write_output=False))
        who = _who_connected(broker)
    # who answered first: a model that differs says little without it (one failure on a loaded CI-like machine)
    assert all(r["closed_by"] == "all reported" for r in run.history), ([r["closed_by"] for r in run.history], who)
    assert all(len(r["answered"]) == 8 and not r["absent"] and not r["rejected"] for r in run.cell_records), (
        [(r["cell"], r["round"], r["edge_round"], r["answered"], r["absent"], r["rejected"]) for r in run.cell_records],
        who,
    )
    assert run.params.keys() == sim.params.keys()
    for k, v in sim.params.items():
        assert torch.allclose(torch.from_numpy(run.params[k]), torch.from_numpy(v), rtol=RTOL, atol=ATOL), (k, who)
    for d, t in sim.device_traffic.items():  # the same messages (float metadata: a few digits apart)
        u = run.device_traffic[d]
        assert t["tasks"] == u["tasks"] and abs(t["bytes_out"] - u["bytes_out"]) <= 8 * t["tasks"], d
    real_time = (*WALL, "clock_s", "clock_end_s", "bytes_in", "bytes_out")
    strip = lambda recs: [{k: v for k, v in r.items() if k not in real_time} for r in recs]  # noqa: E731
    _approx(strip(sim.cell_records), strip(run.cell_records), "cell records")
    sizes = [s for stats in em.agent_stats.values() for s in stats["cohort_sizes"]]
    tasks = 2 * 2 * 16
    assert len(sizes) == tasks and max(sizes) <= 4
    cohorts = round(sum(1 / s for s in sizes))
    assert cohorts < tasks, f"{cohorts} cohorts for {tasks} tasks: nothing was batched"


def _who_connected(broker: EmbeddedBroker | MosquittoBroker) -> str:
    """What the test's Mosquitto logged of its clients (``connection_messages``): the connections per client id and
    the sessions taken over (a second connection under a live id): whether a process the test did not start (another
    test's, still reconnecting to a port this broker now has) took part in its devices' names."""
    if not isinstance(broker, MosquittoBroker):
        return "(amqtt: no connection log)"
    text = broker.log_text(tail=1 << 20)
    ids = Counter(re.findall(r"New client connected from \S+ as (\S+) ", text))
    taken = [line for line in text.splitlines() if "already connected" in line]
    return f"connections per client id: {dict(sorted(ids.items()))}; sessions taken over: {taken}"


def test_a_model_the_cohort_engine_cannot_vectorize_is_refused_at_start(tmp_path: Path, monkeypatch) -> None:
    bn = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8), torch.nn.BatchNorm1d(8))
    monkeypatch.setattr("protocols.cohort_trainer.build_model", lambda *a, **k: bn)
    em = Emulation(small_config(tmp_path, runtime={"engine": "cohort"}), broker_url="mqtt://127.0.0.1:9")
    with pytest.raises(ConfigError, match=r"runtime.engine: .*BatchNorm1d.*per-device engine"):
        em.run()
    assert not em.procs  # refused before any worker started
    path = tmp_path / "c.toml"
    path.write_text(small_config(tmp_path).to_toml())
    res = CliRunner().invoke(
        main, ["run", str(path), "--engine", "cohort", "--broker", "mqtt://127.0.0.1:9", "--no-progress"]
    )
    assert res.exit_code == 2 and "BatchNorm1d" in res.output, res.output


def test_thread_loop_calls_on_idle_once_it_runs_out_of_work() -> None:
    """The hook the cohort executor trains in: called on the loop's thread after the queued calls,
    once per stretch of idleness (not in a busy loop), and what it posts runs after it."""
    loop = ThreadLoop("idle")
    seen: list[str] = []
    loop.on_idle = lambda: seen.append("idle")
    for i in range(3):
        loop.post(lambda i=i: seen.append(f"call{i}"))
    loop.start()
    try:
        assert wait_until(lambda: "idle" in seen, 5.0)
        complete = loop.hold()
        complete(lambda: seen.append("completed"))
        assert wait_until(lambda: seen.count("idle") == 2, 5.0)
        assert seen[:3] == ["call0", "call1", "call2"] and seen[3:] == ["idle", "completed", "idle"]
    finally:
        loop.stop()


def test_cohort_executor_on_a_thread_loop_trains_what_queued_meanwhile_together() -> None:
    """Group commit in real time: the tasks submitted before the loop runs out of work form one cohort
    (at most ``cohort_size``), each device's result equals its training alone, completions run on the
    loop's thread, and the training time counts each cohort once."""
    spec = ModelSpec(name="mlp", input_shape=(6,), num_classes=3, hidden=(8,))
    rng = np.random.default_rng(0)
    alone = TorchTrainer.from_spec(spec.name, spec.input_shape, spec.num_classes, hidden=spec.hidden)
    start = {k: v.copy() for k, v in alone.get_params().items()}

    def train(task: Payload, data: LocalData, trainer: Any, ctx: DeviceContext) -> Payload:
        trainer.set_params(task.tensors)
        trainer.sgd(data, steps=3, batch_size=4, lr=0.1, rng=np.random.default_rng(ctx.seed))
        return Payload({}, dict(trainer.get_params()))

    agents = {
        f"d{i}": SimpleNamespace(
            device=f"d{i}",
            trainer=alone,
            role=SimpleNamespace(train=train),
            data=LocalData(rng.normal(size=(10, 6)).astype(np.float32), rng.integers(0, 3, size=10)),
        )
        for i in range(5)
    }
    loop = ThreadLoop("cohorts")
    executor = CohortExecutor(agents, spec, loop, cohort_size=3)
    results: dict[str, Payload] = {}
    threads: set[str] = set()

    def done(device: str, result: Payload | None, error: str | None) -> None:
        assert error is None, error
        results[device] = result
        threads.add(threading.current_thread().name)

    for i, device in enumerate(agents):  # queued by callbacks, as tasks arrive
        ctx = DeviceContext(i, 0, 0, "c0", device)
        loop.post(lambda d=device, c=ctx: executor.submit(d, Payload({}, start), c, lambda r, e, d=d: done(d, r, e)))
    loop.start()
    try:
        assert wait_until(lambda: len(results) == 5, 30.0)
    finally:
        loop.stop()
        executor.close()
    assert executor.cohorts == 2 and sorted(map(len, executor.sizes.values())) == [1] * 5
    assert sorted(s[0] for s in executor.sizes.values()) == [2, 2, 3, 3, 3]
    assert threads == {"cohorts"} and executor.seconds > 0 and loop.on_idle is None
    for i, (device, agent) in enumerate(agents.items()):
        want = train(Payload({}, start), agent.data, alone, DeviceContext(i, 0, 0, "c0", device))
        for k, v in want.tensors.items():
            assert np.allclose(results[device].tensors[k], v, rtol=RTOL, atol=ATOL), (device, k)
