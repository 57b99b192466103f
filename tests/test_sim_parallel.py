"""Parallel device training in ``fedtier sim`` (``sim/executors.py``): the same run, byte for byte."""

from __future__ import annotations

from typing import Any

import pytest

from protocols.transport.memory import VirtualLoop
from sim.executors import ProcessExecutor, WorkerError
from sim.launcher import RunResult, SimHierarchy, run_simulation
from tests.conftest import kill_worker_at_task, same_run, while_workers_start


def _pair(make_config, **sections: dict[str, Any]) -> tuple[RunResult, RunResult]:
    runtime = sections.pop("runtime", {})
    sim = SimHierarchy(make_config(runtime={**runtime, "sim_workers": 2}, **sections), write_output=False)
    assert isinstance(sim.executor, ProcessExecutor) and len(sim.executor.procs) == 2
    inline = while_workers_start(
        sim, lambda: run_simulation(make_config(runtime=runtime, **sections), write_output=False)
    )
    parallel = sim.run()
    assert all(not p.is_alive() for p in sim.executor.procs)  # shut down after the run
    return inline, parallel


def test_loop_holds_virtual_time_for_outside_work():
    loop, seen = VirtualLoop(), []
    loop.call_later(5.0, lambda: seen.append(("deadline", loop.now())))
    loop.call_later(0.0, lambda: seen.append(("due now", loop.now())))
    first, second = loop.hold(), loop.hold()
    second(lambda: seen.append(("second", loop.now())))  # finishes first in real time...
    loop.post(lambda: first(lambda: seen.append(("first", loop.now()))))
    loop.run()
    assert seen == [("due now", 0.0), ("first", 0.0), ("second", 0.0), ("deadline", 5.0)]  # ...runs in order
    assert loop.outstanding == 0


def test_fedavg_two_workers_is_byte_identical(make_config):
    inline, parallel = _pair(make_config)
    same_run(inline, parallel)
    assert inline.final_accuracy > 0.5


def test_decomfl_stateful_devices_with_partial_participation(make_config):
    inline, parallel = _pair(
        make_config,
        run={"rounds": 6},
        algorithm={
            "name": "decomfl",
            "edge_rounds": 1,
            "local_steps": 2,
            "perturbations": 3,
            "lr": 0.02,
            "mu": 1e-3,
            "batch_size": 16,
        },
        model={"name": "mlp", "hidden": [16]},
        participation={"model": "uniform", "per_round": 2},  # devices miss rounds, then replay the history
        runtime={"device_deadline": 5.0, "eval_every": 6},
    )
    same_run(inline, parallel)
    missed = [r for r in inline.cell_records if any(why == "not participating" for why in r["absent"].values())]
    assert missed


def test_clock_stragglers_miss_the_same_deadlines(make_config):
    inline, parallel = _pair(
        make_config,
        run={"rounds": 2},
        algorithm={"edge_rounds": 2, "local_steps": 10},
        clock={
            "device_steps_per_s": 10.0,
            "device_speed_spread": 1.0,
            "downlink_bytes_per_s": 2e5,
            "uplink_bytes_per_s": 5e4,
            "latency_s": 0.01,
        },
        runtime={"device_deadline": 1.5},
    )
    same_run(inline, parallel)
    late = [d for r in inline.cell_records for d, why in r["absent"].items() if why == "deadline"]
    assert late and parallel.history[-1]["clock_s"] > 3.0


def test_a_worker_that_dies_ends_the_run_with_the_device_named(make_config):
    sim = SimHierarchy(make_config(runtime={"sim_workers": 2, "device_deadline": 5.0}), write_output=False)
    victim = "c1-d0"
    kill_worker_at_task(sim, victim)
    group = sim.executor.groups[sim.executor.owner[victim]]  # the error names the first task lost with it
    with pytest.raises(
        WorkerError,
        match=rf"device ({'|'.join(group)}) \(round 2\.[12]\).*"
        rf"\(devices {', '.join(group)}\) died with exit code -9",
    ):
        sim.run()
    assert all(not p.is_alive() for p in sim.executor.procs)


def test_a_worker_that_cannot_start_shows_its_error():
    from protocols.algorithms.base import DeviceContext
    from protocols.wire.payload import Payload

    loop = VirtualLoop()
    executor = ProcessExecutor("run = [not toml", [["c0-d0"]], loop)
    try:
        with pytest.raises(WorkerError, match=r"(?s)device c0-d0 \(round 1\.1\).*exit code 1.*TOMLDecodeError"):
            executor.submit("c0-d0", Payload(), DeviceContext(0, 0, 0, "c0", "c0-d0"), lambda r, e: None)
            loop.run()  # (or the worker was already dead when the task came)
    finally:
        executor.close()
