"""``fedtier sim``'s worker processes on the run's torch device (issue 33, the host side over several cores):
workers start with ``spawn`` (never forked after the main process touched CUDA), ``auto`` is decided once in
the main process and every worker follows it, and a run with workers is the run without them."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context
import time

import numpy as np
import pytest
import torch

from protocols.algorithms.base import ModelSpec
from protocols.torch_trainer import _told
from sim import executors
from sim.launcher import SimHierarchy
from tests.conftest import while_workers_start
from tests.spinner import spin_then_wait
from tests.test_cohort import _equivalent, _run

SECTIONS = dict(
    run={"rounds": 2},
    topology={"cells": 1, "devices_per_cell": 5},
    algorithm={"local_steps": 0, "local_epochs": 1.0, "batch_size": 32, "edge_rounds": 1},
)
MLP = ModelSpec(name="mlp", input_shape=(784,), num_classes=10, hidden=(200, 200))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_workers_on_auto_without_a_gpu_train_on_the_cpu_and_match_the_run_without_workers(make_config, caplog):
    caplog.set_level(logging.INFO, logger="fedtier.device")
    _told.clear()
    runtime = {"engine": "cohort", "cohort_size": 2, "device": "auto"}
    sim = SimHierarchy(make_config(runtime={**runtime, "sim_workers": 2}, **SECTIONS), write_output=False)
    alone = while_workers_start(
        sim, lambda: SimHierarchy(make_config(runtime=runtime, **SECTIONS), write_output=False).run()
    )
    workers = sim.run()
    executor = sim.executor
    assert isinstance(executor, executors.ProcessExecutor) and executor.largest_batch == 3
    fresh = (multiprocessing.context.ForkServerProcess, multiprocessing.context.SpawnProcess)  # never forked from here
    assert all(isinstance(p, fresh) for p in executor.procs)
    assert "the 2 sim workers train on cpu (torch sees no CUDA device)" in caplog.text
    for k in alone.params:  # the final model, byte for byte
        assert alone.params[k].tobytes() == workers.params[k].tobytes(), k


def test_auto_is_decided_once_in_the_main_process_and_the_workers_follow(make_config, monkeypatch, caplog):
    """With a GPU present (pretended), the main process applies the cohort engine's rule to a worker's
    largest cohort and hands every worker the chosen device in its config; the per-device engine's workers
    take the GPU; an explicit device is left as it is."""
    caplog.set_level(logging.INFO, logger="fedtier.device")
    _told.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Pretend GPU")
    started: list[str] = []

    class Recorder:
        def __init__(self, config_text: str, groups, loop, batched: bool = False, **kwargs: object) -> None:
            started.append(config_text)

    monkeypatch.setattr(executors, "ProcessExecutor", Recorder)
    cohort = make_config(runtime={"engine": "cohort", "device": "auto", "sim_workers": 2}, **SECTIONS)
    assert executors.worker_device(cohort) is None  # the rule needs the model
    with pytest.raises(ValueError, match="depends on the model spec"):
        executors.start_workers(cohort, None)  # type: ignore[arg-type]
    small = ModelSpec(name="mlp", input_shape=(64,), num_classes=10, hidden=(32,))
    assert executors.worker_device(cohort, small) == "cpu"  # 3 models x 32 x 2,410 parameters: little work
    assert "(3 models x batch 32 x 2410 parameters" in caplog.text
    assert executors.worker_device(cohort, MLP) == "cuda"  # 3 x 32 x 199,210 = 19M multiply-adds a step
    executors.start_workers(cohort, None, MLP)  # type: ignore[arg-type]
    assert 'device = "cuda"' in started[-1] and 'device = "auto"' not in started[-1]
    per_device = make_config(runtime={"device": "auto", "sim_workers": 2}, **SECTIONS)
    assert executors.worker_device(per_device) == "cuda" and "Pretend GPU" in caplog.text
    assert executors.worker_device(make_config(runtime={"device": "cpu", "sim_workers": 2}, **SECTIONS)) == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cohort_workers_on_cuda_match_the_one_process_cuda_run(make_config):
    """Two worker processes, each with its own cohort engine on the GPU, give the one-process CUDA run's
    messages and device results within the cohort GPU tests' tolerance."""
    runtime = {"engine": "cohort", "cohort_size": 2, "device": "cuda"}
    one = _run(make_config(runtime=runtime, **SECTIONS))
    two = _run(make_config(runtime={**runtime, "sim_workers": 2}, **SECTIONS))
    assert isinstance(two[2].executor, executors.ProcessExecutor) and two[2].executor.largest_batch == 3
    _equivalent(one, two, rounds=(0, 1))
    for k in one[0].params:
        np.testing.assert_allclose(two[0].params[k], one[0].params[k], rtol=1e-4, atol=1e-6)


def test_the_gpu_benchmark_reads_its_worker_sides_and_counts_the_workers_cpu():
    """benchmarks/gpu.py: ``cohort-cuda-w8`` is the cohort engine on cuda, cohort_size 64, in 8 sim workers, the
    cells summing where ``auto`` says (``-host``: on the host); its ``tree cpu`` adds a live worker's CPU time to
    the main process's."""
    from benchmarks.gpu import SIDES, cohort_side, tree_cpu

    assert cohort_side("cohort-cuda-w8") == ("cuda", 64, 8, "auto")
    assert cohort_side("cohort-cuda-1000") == ("cuda", 1000, 0, "auto")
    assert cohort_side("cohort-cpu") == ("cpu", 64, 0, "auto")
    assert cohort_side("cohort-cuda-w4-host") == ("cuda", 64, 4, "host")
    assert cohort_side("cohort-cpu-engine") == ("cpu", 64, 0, "engine")
    assert {"cohort-cuda-w4-host", "cohort-cuda-host", "cohort-cpu-engine"} <= set(SIDES)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=spin_then_wait, args=(0.4, ready), daemon=True)  # alive until terminated
    proc.start()
    try:
        assert ready.wait(30)
        before_main, total = time.process_time(), tree_cpu()
        assert total - before_main >= 0.3  # the worker's 0.4 s of CPU (and its start-up) are counted
    finally:
        proc.terminate()
        proc.join(10)


def test_workers_sharing_a_gpu_plan_their_cohorts_within_a_share_of_its_memory(monkeypatch):
    """Each of 4 workers on one GPU plans its cohort parts within a quarter of 80% of the memory free at its
    start (each seeing all of it free would let them together plan 4x what fits); on the CPU or alone: no bound."""
    from sim.device_worker import share_gpu_memory

    class Engine:
        memory_limit = None

        def __init__(self, device: str) -> None:
            self.device = torch.device(device)

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (10 << 30, 80 << 30))
    gpu, alone, cpu = Engine("cuda"), Engine("cuda"), Engine("cpu")
    share_gpu_memory(gpu, 4)
    share_gpu_memory(alone, 1)
    share_gpu_memory(cpu, 4)
    assert gpu.memory_limit == int(0.8 * (10 << 30) / 4)
    assert alone.memory_limit is None and cpu.memory_limit is None
