"""``fedtier sim`` on Ray (``runtime.sim_backend = "ray"``: ``sim/ray_actors.py``, ``sim/ray_cluster.py``,
``sim/ray_worker.py``) as a researcher meets it: without Ray, with an address nothing answers at, on a local Ray (the
cohort engine, an actor killed mid-round, ``--resume``), and on a two-node cluster begun with ``ray start`` whose nodes
lack the data file. Ray is an optional extra, absent from CI: these tests skip without it (one local Ray for the
module, 2 CPUs, no dashboard)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from protocols.config import ConfigError
from sim.executors import WorkerError
from sim.launcher import SimHierarchy, run_simulation
from tests.conftest import free_port_run, same_run
from tests.test_sim_stall import result_waits

ROOT = Path(__file__).resolve().parent.parent
RAY_BIN = Path(sys.executable).with_name("ray")


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance (``address="local"``: never a cluster this machine happens to run) for the module."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


def on_ray(make_config, **sections: dict[str, Any]):
    runtime = sections.pop("runtime", {})
    return make_config(runtime={**runtime, "sim_workers": 2, "sim_backend": "ray"}, **sections)


def test_without_ray_a_ray_run_stops_at_its_start_saying_how_to_install(make_config, tmp_path, monkeypatch):
    from fedtier.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray: ImportError
    path = tmp_path / "ray.toml"
    path.write_text(on_ray(make_config).to_toml())
    res = CliRunner().invoke(main, ["sim", str(path), "--no-progress"])
    assert res.exit_code == 2, res.output
    assert "needs Ray: pip install 'fedtier[ray]'" in " ".join(res.output.split())
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # stopped before its first round


@pytest.mark.parametrize("where", ["runtime.ray_address", "RAY_ADDRESS"])
def test_an_address_nothing_answers_at_fails_in_seconds_naming_it(make_config, monkeypatch, where):
    """Ray retries an unreachable cluster for ~13 minutes; fedtier checks the address first (``CONNECT_S``)."""
    pytest.importorskip("ray")
    address = f"127.0.0.1:{free_port_run(1)}"  # nothing listens there
    if where == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", address)
        cfg = on_ray(make_config)
    else:
        cfg = on_ray(make_config, runtime={"ray_address": address})
    t0 = time.monotonic()
    with pytest.raises(
        ConfigError, match=rf"{where} = '{address}': no Ray cluster answers at .*:{address[10:]} within"
    ):
        run_simulation(cfg, write_output=False)
    assert time.monotonic() - t0 < 30


def test_a_ray_start_record_that_outlived_its_cluster_says_how_to_run_on_a_local_ray(monkeypatch):
    """No address set and no RAY_ADDRESS: Ray joins the cluster `ray start` recorded on this machine, a record that
    outlives a cluster that died without `ray stop` (walked: /tmp/ray/ray_current_cluster named a long-gone head, and
    fedtier sim said only to start one). The refusal says how to forget it, and "local" is a local Ray."""
    services = pytest.importorskip("ray._private.services")
    from sim.ray_cluster import cluster_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    dead = f"127.0.0.1:{free_port_run(1)}"  # nothing listens there
    real = services.canonicalize_bootstrap_address
    monkeypatch.setattr(services, "canonicalize_bootstrap_address", lambda a, *_: dead if a is None else real(a))
    with pytest.raises(ConfigError, match=rf"started on this machine \(ray start\): no Ray cluster answers at {dead}"):
        cluster_address(None)
    with pytest.raises(ConfigError, match='`ray stop` forgets it, or runtime.ray_address = "local" starts a local Ray'):
        cluster_address(None)
    assert cluster_address("local") is None  # a new local instance, whatever the record says


def test_ray_actors_are_byte_identical(make_config, local_ray):
    """Two Ray actors train the devices: the run is the one-process run, byte for byte, records included."""
    inline = run_simulation(make_config(run={"rounds": 2}), write_output=False)
    same_run(inline, run_simulation(on_ray(make_config, run={"rounds": 2}), write_output=False))


def test_cohort_engine_on_ray_is_the_inline_cohort_run(make_config, local_ray):
    """engine = cohort with Ray actors: each actor gets its share of an edge round as one batch (bytes frames) and
    trains it as cohorts; the run is the one-process cohort run, bit for bit, seeds and records included."""
    from sim.executors import RayExecutor

    sections = dict(run={"rounds": 2}, algorithm={"local_steps": 0, "local_epochs": 1.0, "batch_size": 32})
    inline = run_simulation(make_config(runtime={"engine": "cohort"}, **sections), write_output=False)
    sim = SimHierarchy(on_ray(make_config, runtime={"engine": "cohort"}, **sections), write_output=False)
    assert isinstance(sim.executor, RayExecutor)
    same_run(inline, sim.run())
    assert sim.executor.largest_batch == 3  # 6 devices over 2 actors, a batch per edge round
    assert not hasattr(sim.executor, "rings")  # results come back through Ray: an actor may be on another host


def test_an_actor_the_cluster_has_no_room_for_ends_the_run_instead_of_waiting_forever(
    make_config, local_ray, monkeypatch
):
    """A busy cluster (here another job holds one of the 2 CPUs) leaves an actor pending; Ray would wait for room
    forever, the run gives up after ``ACTOR_START_S`` naming the actor and what it needs."""
    monkeypatch.setattr("sim.ray_actors.ACTOR_START_S", 3.0)

    @local_ray.remote(num_cpus=1)
    class Other:
        def ping(self) -> int:
            return 1

    other = Other.remote()
    assert local_ray.get(other.ping.remote(), timeout=60) == 1  # it holds its CPU
    try:
        sim = SimHierarchy(on_ray(make_config), write_output=False)
        with pytest.raises(
            WorkerError, match=r"Ray actor \d \(devices .*\) is not running 3 s after .*needs 1 CPU\(s\)"
        ):
            sim.run()
    finally:
        local_ray.kill(other)


def test_a_node_with_other_software_refuses_to_start_saying_what_differs(make_config, local_ray, monkeypatch, tmp_path):
    """An actor checks its node's fedtier code, Python, numpy and torch against the main process's: another torch
    (here the main process claims one) would break bit-identity silently, so the run stops naming it."""
    from fedtier.cli import main
    from sim import ray_actors
    from sim.ray_worker import software

    monkeypatch.setattr(ray_actors, "software", lambda: {**software(), "torch": "0.0"})
    path = tmp_path / "ray.toml"
    path.write_text(on_ray(make_config).to_toml())
    res = CliRunner().invoke(main, ["sim", str(path), "--no-progress"])
    out = " ".join(res.output.split())
    assert res.exit_code == 1, out
    assert re.search(
        r"error: device c\d-d\d \(round 1\.1\): Ray actor \d \(devices .*\) could not start: .*"
        r"torch: 0\.0 in the main process, \S+ here",
        out,
    ), out
    assert "stopped: the same command with --resume continues from the last finished round" in out


def test_cuda_on_a_cluster_without_a_gpu_is_refused_at_the_start(make_config, local_ray):
    with pytest.raises(ConfigError, match="runtime.device = 'cuda' but the Ray cluster has no GPU"):
        run_simulation(on_ray(make_config, runtime={"device": "cuda"}), write_output=False)


def test_a_cohort_actor_asks_for_a_cpu_per_torch_thread(make_config, local_ray):
    """engine = cohort: an actor computes with cohort_threads / sim_workers torch threads, so it asks Ray for as many
    CPUs (else Ray packs actors onto one node's cores, each running several threads); too many for the cluster is
    refused at the start, with both numbers."""
    cohort = {"engine": "cohort"}
    with pytest.raises(ConfigError, match=r"2 Ray actors of 2 CPU\(s\) each but the Ray cluster has 2 CPUs"):
        run_simulation(on_ray(make_config, runtime={**cohort, "cohort_threads": 4}), write_output=False)
    sim = SimHierarchy(on_ray(make_config, runtime={**cohort, "cohort_threads": 2}), write_output=False)
    assert sim.executor.actors.cpus == 1
    sim.executor.close()


def test_a_killed_actor_ends_the_run_naming_it_and_resume_finishes_the_run(make_config, local_ray):
    sections = dict(run={"rounds": 3}, algorithm={"edge_rounds": 1})
    uninterrupted = run_simulation(make_config(**sections), write_output=False)
    sim = SimHierarchy(on_ray(make_config, **sections))
    executor = sim.executor
    worker = executor.owner["c1-d0"]

    def kill(rnd: int, edge: int) -> None:
        if (rnd, edge) == (1, 0):
            os.kill(executor.actors.placement[worker]["pid"], signal.SIGKILL)

    sim.agents["c1-d0"].on_task = kill
    died = (
        rf"device c\d-d\d \(round 2\.1\): Ray actor {worker} \(devices .*c1-d0.*\) on node .* \(\w+, pid \d+\) failed: "
    )
    with pytest.raises(WorkerError, match=died + r"ActorDiedError: The actor died unexpectedly"):
        sim.run()
    resumed = run_simulation(on_ray(make_config, **sections), resume=True)
    assert resumed.history[0]["round"] == 1  # round 0 was not trained again
    assert all(uninterrupted.params[k].tobytes() == resumed.params[k].tobytes() for k in uninterrupted.params)


def test_a_stopped_actor_ends_the_run_within_the_bound_and_resume_finishes_the_run(make_config, local_ray):
    """SIGSTOP an actor mid-run: its progress calls go unanswered too, so after ``worker_stall_s`` the run stops
    naming it and its silence (a blocking wait would hang forever), and ``--resume`` ends with the unbroken model."""
    sections = dict(run={"rounds": 3}, algorithm={"edge_rounds": 1})
    uninterrupted = run_simulation(make_config(**sections), write_output=False)
    sim = SimHierarchy(on_ray(make_config, **sections, runtime={"worker_stall_s": 3.0}))
    executor = sim.executor
    worker = executor.owner["c1-d0"]
    stopped: list[float] = []

    def stop(rnd: int, edge: int) -> None:
        if (rnd, edge) == (1, 0) and not stopped:
            os.kill(executor.actors.placement[worker]["pid"], signal.SIGSTOP)
            stopped.append(time.monotonic())

    sim.agents["c1-d0"].on_task = stop
    with pytest.raises(
        WorkerError,
        match=rf"Ray actor {worker} \(devices .*c1-d0.*\) on node .* sent nothing, no result and no progress beat, "
        r"for \d+\.\d s \(runtime\.worker_stall_s = 3\) while it owed \d result\(s\): .*c1-d0 \(2\.1\)",
    ):
        sim.run()
    assert time.monotonic() - stopped[0] < 3.0 + 6.0
    resumed = run_simulation(on_ray(make_config, **sections), resume=True)
    assert all(uninterrupted.params[k].tobytes() == resumed.params[k].tobytes() for k in uninterrupted.params)


def test_an_actor_slower_than_the_bound_that_trains_is_not_stopped(make_config, local_ray):
    """A cohort batch answers only once it is all trained, here after several times ``worker_stall_s``: the actor's
    progress, polled beside its task, keeps it from being taken as hung."""
    bound = 1.0
    cfg = make_config(
        run={"rounds": 1},
        topology={"cells": 1, "devices_per_cell": 2},
        algorithm={"edge_rounds": 1, "local_steps": 15000},
        runtime={"sim_workers": 1, "sim_backend": "ray", "engine": "cohort", "worker_stall_s": bound},
    )
    sim = SimHierarchy(cfg, write_output=False)
    waits = result_waits(sim.executor.watch)
    assert [r["round"] for r in sim.run().history] == [0]
    assert max(waits) > bound, waits  # it was silent of results longer than the bound, and it was not stopped


def _ray_start(args: list[str], cwd: Path, env: dict[str, str]) -> int:
    """``ray start ARGS`` in a session of its own (its daemons keep that process group: the teardown ends them and
    nothing else of this machine's); returns the group id."""
    proc = subprocess.Popen(
        [str(RAY_BIN), "start", *args, "--disable-usage-stats"],
        cwd=cwd,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    if proc.returncode != 0:
        _stop_groups([proc.pid])
        pytest.fail(f"ray start {' '.join(args)} failed:\n{out[-3000:]}")
    return proc.pid


def _stop_groups(groups: list[int]) -> None:
    """SIGKILL the process groups ``groups`` (``ray stop --force`` kills as hard) and wait, bounded, for them to go."""
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(g) for g in groups):
        time.sleep(0.1)


def _alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A Ray cluster of two nodes on this machine, one CPU each, begun with ``ray start`` in a folder of their own
    (so a path relative to the driver's folder is not there for them), its state in a private temp dir (this
    machine's /tmp/ray is untouched); ``(address, env)`` for its drivers."""
    pytest.importorskip("ray")
    base = tmp_path_factory.mktemp("nodes")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    port = free_port_run(1)
    address = f"127.0.0.1:{port}"
    temp = Path(f"/tmp/ft-ray-{os.getpid()}")
    groups: list[int] = []
    try:
        groups.append(
            _ray_start(
                ["--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false", f"--temp-dir={temp}"],
                base,
                env,
            )
        )
        groups.append(_ray_start([f"--address={address}", "--num-cpus=1"], base, env))
        yield address, env
    finally:
        _stop_groups(groups)
        subprocess.run(["rm", "-rf", str(temp)], check=False)


def test_a_two_node_cluster_trains_the_run_without_the_data_files_on_its_nodes(
    make_config, tmp_path, two_nodes, monkeypatch
):
    """Following the docs: `ray start --head` on one node, `ray start --address=HEAD:PORT` on another, then `fedtier sim
    CONFIG` with runtime.ray_address = HEAD:PORT on the head. The data set is a user's npz file named relative to the
    driver's folder, which the nodes do not have, and so is the model the run starts from (run.init_model): the main
    process ships the arrays and the file. Each node gets one actor (one
    CPU each), `-v` says where they run, and the final model is the one-process run's, byte for byte."""
    from sim.datasets import load_dataset

    address, env = two_nodes
    ds = load_dataset("digits")
    np.savez(tmp_path / "d.npz", x_train=ds.x_train, y_train=ds.y_train, x_test=ds.x_test, y_test=ds.y_test)
    monkeypatch.chdir(tmp_path)
    run_simulation(make_config(run={"rounds": 1, "output": "start"}))  # a model to start from, relative too
    run, data = {"rounds": 2, "init_model": "start/final_model.ftw"}, {"dataset": "npz:d.npz"}
    inline = run_simulation(make_config(run={**run, "output": "inline"}, data=data))
    (tmp_path / "ray.toml").write_text(on_ray(make_config, run={**run, "output": "out"}, data=data).to_toml())
    cmd = [
        str(RAY_BIN.with_name("fedtier")),
        "sim",
        "ray.toml",
        f"--set=runtime.ray_address={address}",
        "-v",
        "--no-progress",
    ]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = " ".join((res.stdout + res.stderr).split())
    assert res.returncode == 0, out[-4000:]
    assert "joining the Ray cluster at" in out and "2 Ray actors running on 2 node(s)" in out
    assert (tmp_path / "out" / "final_model.ftw").read_bytes() == (tmp_path / "inline" / "final_model.ftw").read_bytes()
    assert inline.history[-1]["round"] == 1
