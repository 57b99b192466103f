"""The Ray actors of ``fedtier sim``'s Ray workers (``RayExecutor`` in ``sim/executors.py``, which owns the tasks
and their order): one CPU each (the cohort engine: as many as its torch threads), on the cluster
``sim/ray_cluster.py`` joins.

The main process loads the dataset once and ships its training arrays through Ray's object store (numpy buffers),
and the file ``run.init_model`` names as its bytes, so the other nodes need fedtier (the same code, Python, numpy and
torch: an actor checks), not the data; each actor rebuilds its share of the devices from the config text, as a
worker process does (``sim/ray_worker.py``), partitioning with the run seed. Tasks and results cross as bytes
frames (``sim/worker_frames.py``), with ``engine = "cohort"`` one batch per actor and edge round; results come
back through Ray, never through a shared-memory ring (an actor may be on another host). An actor that is not running
within ``ACTOR_START_S``, dies or cannot start ends the run naming it, its devices, its node and the reason; so does
one that hangs: the main process asks each actor that owes results for its training's progress (:meth:`RayActors.poll`,
answered on a concurrency group of its own while a task runs) and one whose progress is not heard of for
``runtime.worker_stall_s`` is killed (``sim/worker_watch.py``). The cloud's checkpoint of the last finished round stays
for ``--resume``."""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protocols.config import ConfigError, RunConfig
from protocols.execution import execution_plan
from protocols.wire.messenger import Received

from .hierarchy import run_dataset
from .ray_cluster import connect, import_ray, plain
from .ray_worker import RayWorker, geometry, software
from .worker_frames import Batch, frame, unframe
from .worker_watch import Watch, named_devices

log = logging.getLogger("fedtier.sim")

ACTOR_START_S = 300.0  # an actor must be running (placed, its devices built) within this

Reply = Callable[[int, "bytes | memoryview", str, bool], None]  # (task id, result, error, checked)
Died = Callable[[int, str], None]  # (worker, why)


class RayActors:
    """One actor per group of devices; each answer goes to ``reply`` per task, each actor's end to ``died``."""

    def __init__(self, cfg: RunConfig, groups: list[list[str]], reply: Reply, died: Died, watch: Watch) -> None:
        """``watch``: told when an actor runs and when its progress moves (:meth:`poll`)."""
        ray = import_ray()
        self.ray, self.groups, self.reply, self.died, self.watch = ray, groups, reply, died, watch
        self.actors: list[Any] = []
        self._progress: list[int | None] = [None] * len(groups)  # each actor's last progress count heard
        self._polling = [False] * len(groups)  # a progress call in flight
        self.placement: list[dict[str, Any] | None] = [None] * len(groups)  # each actor's node and pid, once running
        self._timer: threading.Timer | None = None
        self.cpus = 1
        self._owns = not ray.is_initialized()
        if self._owns:
            connect(ray, cfg.runtime.ray_address)
        try:
            self.cpus = execution_plan(cfg).worker_threads  # torch threads an actor computes with (cohorts), else 1
            cpus = ray.cluster_resources().get("CPU", 0)
            if len(groups) * self.cpus > cpus:
                raise ConfigError(
                    f"runtime.sim_workers = {len(groups)} Ray actors of {self.cpus} CPU(s) each but the Ray cluster "
                    f"has {cpus:g} CPUs"
                    + (" (runtime.cohort_threads is shared by the workers)" if self.cpus > 1 else "")
                )
            ds = run_dataset(cfg)  # (cached: the main process's own prepare takes it again)
            x, y = ray.put(ds.x_train), ray.put(ds.y_train)
            actor = ray.remote(
                num_cpus=self.cpus,
                num_gpus=gpu_share(cfg, ray, len(groups)),
                max_restarts=0,
                concurrency_groups={"progress": 1},  # progress calls run beside its tasks (one at a time)
            )(RayWorker)
            text, shape, expected = cfg.to_toml(), geometry(ds), json.dumps(software())
            init = ray.put(_read_init_model(cfg)) if cfg.run.init_model else None
            self.actors = [actor.remote(text, group, shape, x, y, expected, init) for group in groups]
            for i, a in enumerate(self.actors):
                a.where.remote().future().add_done_callback(functools.partial(self._placed, i))
            self._timer = threading.Timer(ACTOR_START_S, self._not_started)
            self._timer.daemon = True
            self._timer.start()
        except BaseException:
            self.close()
            raise

    def name(self, worker: int) -> str:
        """The actor, its devices and, once it runs, its node and pid (for error messages)."""
        where = self.placement[worker]
        on = f" on node {where['node']} ({str(where['node_id'])[:8]}, pid {where['pid']})" if where else ""
        return f"Ray actor {worker} (devices {named_devices(self.groups[worker])}){on}"

    def _placed(self, worker: int, future: Any) -> None:
        try:
            self.placement[worker] = json.loads(future.result())
        except Exception:  # its first task says why
            return
        self.watch.started(worker)
        if all(self.placement):
            nodes = sorted({f"{p['node']} ({str(p['node_id'])[:8]})" for p in self.placement if p})
            log.info("sim: %d Ray actors running on %d node(s): %s", len(self.actors), len(nodes), ", ".join(nodes))

    def _not_started(self) -> None:
        """``ACTOR_START_S`` after the start: an actor still not running ends the run (the cluster has no room)."""
        for worker, where in enumerate(self.placement):
            if where is None:
                self.died(
                    worker,
                    f"{self.name(worker)} is not running {ACTOR_START_S:g} s after it was asked for (it needs "
                    f"{self.cpus} CPU(s); `ray status` shows what the cluster has free)",
                )

    def send(self, worker: int, task_id: int, ctx: dict[str, Any], task: Received) -> None:
        future = self.actors[worker].train.remote(frame({"ctx": ctx}, task.view())).future()
        future.add_done_callback(functools.partial(self._settled, worker, [task_id], False))

    def send_batch(self, worker: int, batch: Batch) -> None:
        future = self.actors[worker].train_batch.remote(batch.frame()).future()
        future.add_done_callback(functools.partial(self._settled, worker, [i["id"] for i in batch.head], True))

    def poll(self, worker: int) -> None:
        """Ask the actor for its progress count (unless a call is in flight: a stopped actor never answers); the
        watch hears of it when it moved."""
        if self._polling[worker] or worker >= len(self.actors):
            return
        self._polling[worker] = True
        call = self.actors[worker].progress.options(concurrency_group="progress").remote()
        call.future().add_done_callback(functools.partial(self._progressed, worker))

    def _progressed(self, worker: int, future: Any) -> None:
        self._polling[worker] = False
        try:
            steps = int(future.result())
        except Exception:  # the actor is gone: its task says so
            return
        if steps != self._progress[worker]:
            self._progress[worker] = steps
            self.watch.beat(worker)

    def kill(self, worker: int) -> None:
        """End a stalled actor (its tasks then fail; the run already stopped, naming why)."""
        try:
            self.ray.kill(self.actors[worker])
        except Exception:  # already gone
            pass

    def _settled(self, worker: int, ids: list[int], batched: bool, future: Any) -> None:
        """An actor's answer to the tasks ``ids`` (any thread): each result to its task, or the actor's end."""
        try:
            header, body = unframe(future.result())
        except Exception as exc:  # the actor died (killed, its node lost...)
            self.died(worker, f"{self.name(worker)} failed: {plain(exc)}")
            return
        if "fatal" in header:
            self.died(worker, f"{self.name(worker)} could not start:\n{str(header['fatal']).rstrip()}")
            return
        results = header.get("results") if batched else [{**header, "n": len(body)}]
        if not isinstance(results, list) or len(results) != len(ids):
            self.died(worker, f"{self.name(worker)} answered {len(ids)} tasks with a malformed frame")
            return
        at = 0
        for task_id, item in zip(ids, results):
            n = item.get("n") if isinstance(item, dict) else None
            if not isinstance(n, int) or not 0 <= n <= len(body) - at:
                self.reply(task_id, b"", "bad result from the worker: a malformed result frame", False)
                continue
            self.reply(task_id, body[at : at + n], str(item.get("error", "")), item.get("checked") is True)
            at += n

    def close(self) -> None:
        """Kill the actors; shut Ray down if we started it (idempotent)."""
        if self._timer is not None:
            self._timer.cancel()
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:  # already gone
                pass
        self.actors = []
        if self._owns:
            self._owns = False
            self.ray.shutdown()


def _read_init_model(cfg: RunConfig) -> bytes:
    """The bytes of ``run.init_model`` (shipped: the nodes need not have the file); ConfigError when unreadable."""
    try:
        return Path(str(cfg.run.init_model)).expanduser().read_bytes()
    except OSError as exc:
        raise ConfigError(f"run.init_model: cannot use {cfg.run.init_model}: {exc}") from None


def gpu_share(cfg: RunConfig, ray: Any, actors: int) -> float:
    """The GPU each actor asks for: none on the CPU; on ``cuda``, the cluster's GPUs shared evenly (Ray shows an
    actor only the GPU it was given); ConfigError for a cluster without one."""
    if not cfg.runtime.device.startswith("cuda"):
        return 0.0
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus == 0:
        raise ConfigError(f"runtime.device = {cfg.runtime.device!r} but the Ray cluster has no GPU")
    return 1.0 / -(-actors // gpus)  # ceil(actors / gpus) actors on each GPU
