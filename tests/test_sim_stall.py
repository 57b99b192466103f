"""A ``fedtier sim`` worker that hangs (``sim/worker_watch.py``): a worker process stopped with SIGSTOP mid-run ends
the run within ``runtime.worker_stall_s``, naming it, its silence and what it owed, and ``--resume`` finishes the run
to the uninterrupted model; a worker slower than the bound but training (it beats) is left alone."""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

import pytest
from click.testing import CliRunner

from protocols import runfiles
from protocols.checkpoint import load_params
from sim import launcher
from sim.executors import WorkerError
from sim.launcher import SimHierarchy, run_simulation
from tests.conftest import wait_until

pytestmark = pytest.mark.usefixtures("own_plugins")  # its plugin algorithms are not left registered

STALL_S = 2.0


def test_a_stopped_worker_ends_the_run_naming_it_and_resume_finishes_it(make_config, tmp_path, monkeypatch):
    """SIGSTOP the worker of c1-d0 when c1-d0's task of round 1 comes: the run stops within the bound (and a check
    period) with exit 1, the stopped worker is killed, and ``fedtier sim --resume`` ends with the unbroken run's
    model, byte for byte."""
    from fedtier.cli import main

    sections: dict[str, Any] = dict(run={"rounds": 3}, algorithm={"edge_rounds": 1})
    uninterrupted = run_simulation(make_config(**sections), write_output=False)
    cfg = make_config(**sections, runtime={"sim_workers": 2, "worker_stall_s": STALL_S, "device_deadline": 5.0})
    path = tmp_path / "stall.toml"
    path.write_text(cfg.to_toml())
    stopped: dict[str, Any] = {}

    class Stopping(SimHierarchy):
        """The run, with c1-d0's worker stopped as its round-1 task comes (the moment is picked, the fault real)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            proc = self.executor.procs[self.executor.owner["c1-d0"]]

            def stop(rnd: int, edge: int) -> None:
                if (rnd, edge) == (1, 0) and not stopped:
                    os.kill(proc.pid, signal.SIGSTOP)
                    stopped.update(proc=proc, at=time.monotonic())

            self.agents["c1-d0"].on_task = stop

    monkeypatch.setattr(launcher, "SimHierarchy", Stopping)
    res = CliRunner().invoke(main, ["sim", str(path), "--no-progress"])
    took = time.monotonic() - stopped["at"]
    out = " ".join(res.output.split())
    assert res.exit_code == 1, out
    proc = stopped["proc"]
    found = re.search(
        rf"sim worker \d \(pid {proc.pid}; devices [^)]*c1-d0[^)]*\) sent nothing, no result and no progress beat, "
        rf"for (\d+\.\d) s \(runtime\.worker_stall_s = 2\) while it owed \d result\(s\): [^;]*c1-d0 \(2\.1\)[^;]*; "
        r"it is stopped, deadlocked or stuck, and was killed",
        out,
    )
    assert found, out
    assert "a device role that trains in a loop of its own must tick protocols.trainer.PROGRESS each step" in out
    assert STALL_S <= float(found.group(1)) < STALL_S + 2.0
    assert took < STALL_S + 6.0  # the bound, a check period, the shutdown: not the 10 s of a worker's polite stop
    assert "the same command with --resume continues from the last finished round" in out
    assert proc.exitcode == -signal.SIGKILL  # killed (a stopped process ignores anything less), reaped
    monkeypatch.undo()

    res = CliRunner().invoke(main, ["sim", str(path), "--no-progress", "--resume"])
    assert res.exit_code == 0, res.output
    final = load_params(cfg.output_dir() / runfiles.FINAL_MODEL)
    assert final.keys() == uninterrupted.params.keys()
    assert all(final[k].tobytes() == uninterrupted.params[k].tobytes() for k in final)


def test_a_worker_whose_training_deadlocks_ends_the_run_though_its_process_lives(make_config):
    """c1-d0's training deadlocks in its worker (``tests/plugin_deadlock.py``): the process is alive and not stopped,
    but its training steps stand still, so it beats no more and the run stops within the bound, naming it."""
    cfg = make_config(
        run={"rounds": 2, "plugins": ["tests.plugin_deadlock"]},
        algorithm={"name": "fedavg_deadlock", "edge_rounds": 1},
        runtime={"sim_workers": 2, "worker_stall_s": 2.0, "device_deadline": 5.0},
    )
    sim = SimHierarchy(cfg, write_output=False)
    proc = sim.executor.procs[sim.executor.owner["c1-d0"]]
    with pytest.raises(WorkerError, match=rf"\(pid {proc.pid}; devices [^)]*c1-d0[^)]*\) sent nothing.*c1-d0 \(2\.1\)"):
        sim.run()
    assert proc.exitcode == -signal.SIGKILL


def test_a_worker_slower_than_the_bound_that_trains_is_not_stopped(make_config):
    """A cohort that trains for longer than ``worker_stall_s`` without a result (its worker owes it all along) still
    beats with its steps, so the run finishes; the test checks that such a silence of results did happen. The bound
    is 1 s: at 0.5 s a beat was once late past it at load 10 on 2 cores (the worker killed as stalled), while the
    cohort's 7,500 steps stay silent of results for several seconds."""
    bound = 1.0
    cfg = make_config(
        run={"rounds": 1},
        topology={"cells": 1, "devices_per_cell": 2},
        algorithm={"edge_rounds": 1, "local_steps": 7500},
        runtime={"sim_workers": 1, "engine": "cohort", "worker_stall_s": bound, "device_deadline": 1e4},
    )
    sim = SimHierarchy(cfg, write_output=False)
    waits = result_waits(sim.executor.watch)
    result = sim.run()
    assert [r["round"] for r in result.history] == [0]
    assert max(waits) > bound, waits  # it was silent of results longer than the bound, and it was not stopped


def test_a_worker_evaluating_longer_than_the_bound_is_not_stopped(make_config):
    """A device that evaluates the received model for longer than ``worker_stall_s`` before it trains
    (``tests/plugin_slow_eval.py``, as FedALIGN's devices evaluate ``F_k``) makes no training step meanwhile, but its
    evaluation batches count as progress: its worker beats and the run finishes (before, it was killed as hung)."""
    bound = 0.5
    cfg = make_config(
        run={"rounds": 1, "plugins": ["tests.plugin_slow_eval"]},
        topology={"cells": 1, "devices_per_cell": 1},
        algorithm={"name": "fedavg_slow_eval", "edge_rounds": 1, "local_steps": 2},
        runtime={"sim_workers": 1, "worker_stall_s": bound, "device_deadline": 1e4},
    )
    sim = SimHierarchy(cfg, write_output=False)
    waits = result_waits(sim.executor.watch)
    result = sim.run()
    assert [r["round"] for r in result.history] == [0]
    assert max(waits) > 3 * bound, waits  # silent of results for longer than the bound, and not stopped


def test_a_worker_preparing_a_large_first_batch_longer_than_the_bound_is_not_stopped(make_config):
    """A worker's first batch builds each of its devices' roles before any cohort trains; 40 devices whose roles take
    0.05 s each to build (``tests/plugin_slow_devices.py``) keep it from training for 2 s, 4x the bound: each device
    prepared counts as progress, so it beats and the run finishes (before, it was killed as hung)."""
    bound = 0.5
    cfg = make_config(
        run={"rounds": 1, "plugins": ["tests.plugin_slow_devices"]},
        topology={"cells": 1, "devices_per_cell": 40},
        algorithm={"name": "fedavg_slow_devices", "edge_rounds": 1, "local_steps": 1},
        runtime={"sim_workers": 1, "engine": "cohort", "worker_stall_s": bound, "device_deadline": 1e4},
    )
    sim = SimHierarchy(cfg, write_output=False)
    waits = result_waits(sim.executor.watch)
    result = sim.run()
    assert [r["round"] for r in result.history] == [0]
    assert max(waits) > 3 * bound, waits  # silent of results for longer than the bound, and not stopped


def test_a_watch_whose_poll_fails_still_ends_a_stalled_worker() -> None:
    """Asking a Ray actor for its progress can raise (its cluster unreachable): the watch logs it and goes on
    watching, so a worker that then stays silent is still declared stalled (before, the watch thread died with the
    first failed poll and a hung worker hung the run for good)."""
    from sim.worker_watch import Watch

    stalled: list[tuple[int, float]] = []
    polls = [0]

    def poll(worker: int) -> None:
        polls[0] += 1
        raise ConnectionError("the cluster is unreachable")

    watch = Watch(1, 0.2, lambda worker, silent: stalled.append((worker, silent)), poll)
    try:
        watch.started(0)
        watch.sent(0, 1)
        assert wait_until(lambda: bool(stalled), timeout=5.0), polls
        assert stalled[0][0] == 0 and stalled[0][1] > 0.2 and polls[0] >= 1
    finally:
        watch.close()


def test_a_stalled_worker_of_many_devices_is_named_in_a_line_not_a_wall_of_ids() -> None:
    """The main side of a worker of 40 devices that never answers (its executor's sending is a no-op: the worker
    hangs): the run ends with the stall, naming the worker, 8 of its devices and how many it has, and 8 of the 40
    tasks it owed (before, all 40 device ids, and a fleet-sized worker's thousands)."""
    from protocols.algorithms.base import DeviceContext
    from protocols.transport.memory import VirtualLoop
    from protocols.wire.payload import Payload
    from sim.executors import _Remote

    class Hung(_Remote):
        def _send(self, worker: int, task_id: int, ctx: dict[str, Any], task: Any) -> None:
            pass  # sent: never answered

        def _kill(self, worker: int) -> None:
            pass

    group = [f"c0-d{i}" for i in range(40)]
    loop = VirtualLoop()
    executor = Hung([group], loop, stall_s=0.2)
    executor.watch.started(0)  # its devices built
    try:
        for device in group:
            executor.submit(device, Payload({}, {}), DeviceContext(0, 0, 0, "c0", device), lambda *_: None)
        with pytest.raises(WorkerError) as err:
            while loop.step():
                pass
    finally:
        executor.watch.close()
    message = str(err.value)
    assert "sim worker 0 (devices c0-d0, c0-d1, c0-d2, c0-d3, c0-d4, c0-d5, c0-d6, c0-d7, ... (40 devices))" in message
    assert "while it owed 40 result(s)" in message and "c0-d39" not in message and len(message) < 600, message


def result_waits(watch: Any) -> list[float]:
    """The waits for results a worker was watched for (from the later of a task's sending, the worker's start and
    its last answer, to its next answer), filled in as the run goes."""
    waits: list[float] = []
    since = [0.0]

    def restart(call: Any) -> Any:
        def wrapped(*args: Any) -> None:
            since[0] = time.monotonic()
            call(*args)

        return wrapped

    answered = restart(watch.answered)

    def on_answered(worker: int) -> None:
        waits.append(time.monotonic() - since[0])
        answered(worker)

    watch.sent, watch.started, watch.answered = restart(watch.sent), restart(watch.started), on_answered
    return waits
