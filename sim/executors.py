"""Where ``fedtier sim`` trains its devices: in the main process, in local worker processes, or on Ray.

The device agents, cells and cloud always run in the main process on the virtual loop; they count
every byte as before. Only the device role's ``train`` call moves: a worker (a process or a Ray
actor) rebuilds, from the run's config text, the data partition (``prepare`` is deterministic) and
trains a fixed round-robin share of the devices; it builds a device's role on its first task and keeps
it for the whole run (roles may hold state, so a device always trains in the same worker). Main and worker
exchange only the encoded task and result payloads (``protocols/wire/payload.py``) and small
ints/strings; nothing of ours is pickled.

Each submitted task is registered with :meth:`VirtualLoop.hold`: virtual time stands still until it
completes, and completions run in submission order, so the run is the sequential one event for event
where it matters (answers reach a cell in the same order, at the same virtual times) and the final
model is byte-identical whatever the number of workers. A worker that dies ends the run with an
error naming the device and the worker's last words; workers are always shut down (:meth:`close`).
The worker side is ``sim/device_worker.py``, the frames both sides exchange ``sim/worker_frames.py``; Ray's are
``sim/ray_worker.py`` and ``sim/ray_cluster.py``.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import multiprocessing as mp
import queue
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from protocols import procs
from protocols.algorithms.base import DeviceContext, ModelSpec
from protocols.config import ConfigError, RunConfig
from protocols.execution import ExecutionPlan, execution_plan, shared_threads
from protocols.trainer import Trainer
from protocols.transport.memory import VirtualLoop
from protocols.wire.messenger import Received
from protocols.wire.payload import Payload, decode_payload, encode_payload

from .device_worker import process_main
from .device_worker import set_torch_threads as set_torch_threads  # the launchers import it from here
from .hierarchy import run_dataset
from .ray_cluster import connect, import_ray, plain
from .ray_worker import RayWorker, geometry
from .result_ring import RingReader, ring_bytes
from .worker_frames import Batch, frame, unframe

if TYPE_CHECKING:
    from edge_agent.agent import Trainee
    from edge_agent.cohort import CohortExecutor

log = logging.getLogger("fedtier.sim")

ACTOR_START_S = 300.0  # a Ray actor must be running (placed, its devices built) within this

Done = Callable[[Payload | None, str | None], None]


def worker_threads(cfg: RunConfig) -> int:
    """Torch threads of a worker's cohorts: ``cohort_threads`` shared by the ``sim_workers`` (the cloud's
    evaluation, which runs while they wait, takes all of them)."""
    return shared_threads(cfg.runtime.cohort_threads, cfg.runtime.sim_workers)


class WorkerError(RuntimeError):
    """A worker died or could not start; the run cannot go on."""


class InlineExecutor:
    """Trains in the main process, at once, on the agent's own role and trainer (the default)."""

    def __init__(self, agents: Mapping[str, Trainee]) -> None:
        self.agents = agents

    def submit(self, device: str, task: Payload, ctx: DeviceContext, done: Done, wire: Received | None = None) -> None:
        done(*self.agents[device].train_here(task, ctx))

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------ the main side
class _Remote:
    """What the process and Ray executors share: device -> worker, outstanding tasks, completions."""

    def __init__(self, groups: list[list[str]], loop: VirtualLoop, batched: bool = False) -> None:
        """``batched`` (engine = cohort): tasks wait until the loop is idle, then go to each worker as one
        batch, which it trains as cohorts; otherwise each task goes at once."""
        self.loop, self.groups = loop, groups
        self._batches: dict[int, Batch] | None = {} if batched else None
        self.largest_batch = 0  # most tasks a worker got at once (tests, progress)
        if batched:
            loop.on_idle = self.flush
        self.owner = {d: i for i, group in enumerate(groups) for d in group}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[int, str, str, Callable[[Callable[[], None]], None], Done]] = {}
        self._dead: dict[int, str] = {}  # worker -> why

    def submit(self, device: str, task: Payload, ctx: DeviceContext, done: Done, wire: Received | None = None) -> None:
        """Queue ``task`` for its device's worker: its bytes as they arrived (``wire``), else encoded now."""
        worker = self.owner[device]
        with self._lock:
            if worker in self._dead:
                raise WorkerError(f"device {device} (round {ctx.round}.{ctx.edge_round}): {self._dead[worker]}")
            task_id = next(self._ids)
            self._pending[task_id] = (worker, device, f"{ctx.round}.{ctx.edge_round}", self.loop.hold(), done)
        header = {
            "seed": ctx.seed,
            "round": ctx.round,
            "edge_round": ctx.edge_round,
            "cell": ctx.cell,
            "device": ctx.device,
        }
        body = wire if wire is not None else Received(encode_payload(task), 0)
        if self._batches is not None:
            batch = self._batches.get(worker)
            if batch is None:
                batch = self._batches[worker] = Batch()
            batch.add(task_id, header, body)
        else:
            self._send(worker, task_id, header, body)

    def flush(self) -> None:
        """Send each worker its queued tasks as one batch (the loop is idle: the round's tasks are all in)."""
        batches, self._batches = self._batches or {}, {}
        for worker, batch in batches.items():
            self.largest_batch = max(self.largest_batch, len(batch))
            self._send_batch(worker, batch)

    def _send(self, worker: int, task_id: int, ctx: dict[str, Any], task: Received) -> None:
        raise NotImplementedError

    def _send_batch(self, worker: int, batch: Batch) -> None:
        raise NotImplementedError(f"{type(self).__name__} trains per device")

    def _reply(self, task_id: int, result: bytes | memoryview, error: str, checked: bool = False) -> None:
        """A worker's answer (any thread): decode it here, deliver it on the loop. ``checked``: the worker checked
        its floats finite (``device_worker.answer``): its device's agent does not read them again."""
        with self._lock:
            owed = self._pending.pop(task_id, None)
        if owed is None:
            return  # its worker was declared dead meanwhile
        complete, done = owed[3], owed[4]
        if error:
            complete(lambda: done(None, error))
            return
        try:  # no finiteness check: the device's agent's (unless checked) and the cell's judge the result
            payload = decode_payload(result, require_finite=False, views=True, checked=checked)
        except Exception as exc:
            err = str(exc)
            complete(lambda: done(None, f"bad result from the worker: {err}"))
            return
        complete(lambda: done(payload, None))

    def _died(self, worker: int, why: str) -> None:
        """Worker ``worker`` is gone: every task it owed ends the run, naming its device."""
        with self._lock:
            self._dead[worker] = why
            owed = [(k, v) for k, v in self._pending.items() if v[0] == worker]
            for k, _ in owed:
                del self._pending[k]
        for _, (_, device, rnd, complete, _) in owed:
            complete(functools.partial(_raise, WorkerError(f"device {device} (round {rnd}): {why}")))


def _raise(exc: Exception) -> NoReturn:
    raise exc


class ProcessExecutor(_Remote):
    """Local worker processes (``spawn``: never fork a process that has threads), one pipe each way."""

    def __init__(self, config_text: str, groups: list[list[str]], loop: VirtualLoop, batched: bool = False) -> None:
        super().__init__(groups, loop, batched)
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self._outboxes: list[queue.Queue[bytes | None]] = []
        self._threads: list[threading.Thread] = []
        self._closing = False
        self.rings: list[RingReader | None] = []  # each worker's results (sim/result_ring.py); None: its pipe
        ring_size = ring_bytes(len(groups))
        try:
            for i, group in enumerate(groups):
                task_r, task_w = ctx.Pipe(duplex=False)
                result_r, result_w = ctx.Pipe(duplex=False)
                ring = self._ring(ring_size, ctx)
                self.rings.append(ring)
                proc = ctx.Process(
                    target=process_main,
                    args=(task_r, result_w, config_text, group, ring and (ring.name, ring.size, ring.freed)),
                    name=f"fedtier-sim-worker-{i}",
                    daemon=True,
                )
                procs.spawn(proc.start)
                task_r.close()  # our copies of the child's ends: EOF reaches us when it dies
                result_w.close()
                self.procs.append(proc)
                outbox: queue.Queue[bytes | None] = queue.Queue()
                self._outboxes.append(outbox)
                for target, args in ((self._writer, (i, task_w, outbox)), (self._reader, (i, result_r))):
                    thread = threading.Thread(
                        target=target, args=args, name=f"sim-worker-{i}-{target.__name__}", daemon=True
                    )
                    thread.start()
                    self._threads.append(thread)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _ring(size: int, ctx: Any) -> RingReader | None:
        """A worker's result ring of ``size`` bytes; ``None`` (its results by pipe) for 0 or where it cannot be made."""
        if size == 0:
            return None
        try:
            return RingReader(size, ctx.Semaphore(0))
        except OSError as exc:
            log.warning("sim worker results through pipes: no shared memory for them (%s)", exc)
            return None

    def _send(self, worker: int, task_id: int, ctx: dict[str, Any], task: Received) -> None:
        self._outboxes[worker].put(frame({"id": task_id, "ctx": ctx}, task.view()))

    def _send_batch(self, worker: int, batch: Batch) -> None:
        self._outboxes[worker].put(batch.frame())

    def _writer(self, worker: int, conn: Any, outbox: queue.Queue[bytes | None]) -> None:
        """Sends tasks in order without blocking the loop (a pipe holds only 64 KiB)."""
        try:
            while (data := outbox.get()) is not None:
                conn.send_bytes(data)
            conn.send_bytes(frame({"stop": True}))
        except OSError:
            pass  # the worker is gone: its reader reports it
        finally:
            conn.close()

    def _reader(self, worker: int, conn: Any) -> None:
        fatal = ""
        try:
            while True:
                header, view = unframe(conn.recv_bytes())
                body: bytes | memoryview = view
                if "fatal" in header:
                    fatal = header["fatal"]
                    continue
                if "ring" in header:  # the result's bytes are in the worker's ring: lent until they are done with
                    try:
                        at, n = header["ring"]
                        body = self._ring_of(worker).take(at, n)
                    except (TypeError, ValueError) as exc:
                        self._reply(header["id"], b"", f"bad result from the worker: {exc}")
                        continue
                self._reply(header["id"], body, header["error"], header.get("checked") is True)
                del body  # (not kept while the next result is awaited: a lent record is freed when done with)
        except (EOFError, OSError):
            pass
        finally:
            conn.close()
        if self._closing:
            return
        proc = self.procs[worker]
        proc.join(5.0)
        group = ", ".join(self.groups[worker])
        why = f"sim worker {worker} (devices {group}) died with exit code {proc.exitcode}"
        log.error("%s%s", why, f":\n{fatal}" if fatal else "")
        self._died(worker, why + (f":\n{fatal.rstrip()}" if fatal else " (see its log above)"))

    def _ring_of(self, worker: int) -> RingReader:
        ring = self.rings[worker] if worker < len(self.rings) else None
        if ring is None:
            raise ValueError("a ring record from a worker without a ring")
        return ring

    def close(self) -> None:
        """Stop the workers (terminate those that do not exit within a few seconds), unlink their rings;
        idempotent."""
        self._closing = True
        if self._batches is not None and self.loop.on_idle == self.flush:
            self.loop.on_idle = None
        for outbox in self._outboxes:
            outbox.put(None)
        for proc in self.procs:
            proc.join(5.0)
        for proc in self.procs:
            if proc.is_alive():
                log.warning("terminating %s", proc.name)
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for thread in self._threads:
            thread.join(5.0)
        for ring in self.rings:
            if ring is not None:
                ring.close()
        self.rings = []  # (their semaphores are unlinked as they go)


class RayExecutor(_Remote):
    """Ray actors, one CPU each, on ``cfg``'s cluster (``sim/ray_cluster.py``); ``batched``: engine = cohort.

    The main process loads the dataset once and ships its training arrays through Ray's object store, so the
    other nodes need fedtier, not the data; each actor rebuilds its share of the devices from the config text, as a
    worker process does (``sim/ray_worker.py``). Tasks and results cross as bytes frames (``sim/worker_frames.py``),
    with the cohort engine one batch per actor and edge round; results come back through Ray, never through a
    shared-memory ring (an actor may be on another host). An actor that is not running within ``ACTOR_START_S``,
    dies or cannot start ends the run naming it, its devices, its node and the reason; the cloud's checkpoint of the
    last finished round stays for ``--resume``."""

    def __init__(self, cfg: RunConfig, groups: list[list[str]], loop: VirtualLoop, batched: bool = False) -> None:
        ray = import_ray()
        super().__init__(groups, loop, batched)
        self.ray = ray
        self.actors: list[Any] = []
        self.placement: list[dict[str, Any] | None] = [None] * len(groups)  # each actor's node and pid, once running
        self._timer: threading.Timer | None = None
        self._owns = not ray.is_initialized()
        if self._owns:
            connect(ray, cfg.runtime.ray_address)
        try:
            cpus = ray.cluster_resources().get("CPU", 0)
            if len(groups) > cpus:
                raise ConfigError(f"runtime.sim_workers = {len(groups)} but the Ray cluster has {cpus:g} CPUs")
            ds = run_dataset(cfg)  # (cached: the main process's own prepare takes it again)
            x, y = ray.put(ds.x_train), ray.put(ds.y_train)
            actor = ray.remote(num_cpus=1, num_gpus=_gpu_share(cfg, ray, len(groups)), max_restarts=0)(RayWorker)
            text, shape = cfg.to_toml(), geometry(ds)
            self.actors = [actor.remote(text, group, shape, x, y) for group in groups]
            for i, a in enumerate(self.actors):
                a.where.remote().future().add_done_callback(functools.partial(self._placed, i))
            self._timer = threading.Timer(ACTOR_START_S, self._not_started)
            self._timer.daemon = True
            self._timer.start()
        except BaseException:
            self.close()
            raise

    def _name(self, worker: int) -> str:
        where = self.placement[worker]
        on = f" on node {where['node']} ({str(where['node_id'])[:8]}, pid {where['pid']})" if where else ""
        return f"Ray actor {worker} (devices {', '.join(self.groups[worker])}){on}"

    def _placed(self, worker: int, future: Any) -> None:
        try:
            self.placement[worker] = json.loads(future.result())
        except Exception:  # its first task says why
            return
        if all(self.placement):
            nodes = sorted({f"{p['node']} ({str(p['node_id'])[:8]})" for p in self.placement if p})
            log.info("sim: %d Ray actors running on %d node(s): %s", len(self.actors), len(nodes), ", ".join(nodes))

    def _not_started(self) -> None:
        """``ACTOR_START_S`` after the start: an actor still not running ends the run (the cluster has no room)."""
        for worker, where in enumerate(self.placement):
            if where is None:
                self._died(
                    worker,
                    f"{self._name(worker)} is not running {ACTOR_START_S:g} s after it was asked for (it needs 1 CPU; "
                    "`ray status` shows what the cluster has free)",
                )

    def _send(self, worker: int, task_id: int, ctx: dict[str, Any], task: Received) -> None:
        future = self.actors[worker].train.remote(frame({"ctx": ctx}, task.view())).future()
        future.add_done_callback(functools.partial(self._settled, worker, [task_id], False))

    def _send_batch(self, worker: int, batch: Batch) -> None:
        future = self.actors[worker].train_batch.remote(batch.frame()).future()
        future.add_done_callback(functools.partial(self._settled, worker, [i["id"] for i in batch.head], True))

    def _settled(self, worker: int, ids: list[int], batched: bool, future: Any) -> None:
        """An actor's answer to the tasks ``ids`` (any thread): each result to its task, or the actor's end."""
        try:
            header, body = unframe(future.result())
        except Exception as exc:  # the actor died (killed, its node lost...)
            self._died(worker, f"{self._name(worker)} failed: {plain(exc)}")
            return
        if "fatal" in header:
            self._died(worker, f"{self._name(worker)} could not start:\n{str(header['fatal']).rstrip()}")
            return
        results = header.get("results") if batched else [{**header, "n": len(body)}]
        if not isinstance(results, list) or len(results) != len(ids):
            self._died(worker, f"{self._name(worker)} answered {len(ids)} tasks with a malformed frame")
            return
        at = 0
        for task_id, item in zip(ids, results):
            n = item.get("n") if isinstance(item, dict) else None
            if not isinstance(n, int) or not 0 <= n <= len(body) - at:
                self._reply(task_id, b"", "bad result from the worker: a malformed result frame")
                continue
            self._reply(task_id, body[at : at + n], str(item.get("error", "")), item.get("checked") is True)
            at += n

    def close(self) -> None:
        """Kill the actors; shut Ray down if we started it (idempotent)."""
        if self._timer is not None:
            self._timer.cancel()
        if self._batches is not None and self.loop.on_idle == self.flush:
            self.loop.on_idle = None
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:  # already gone
                pass
        self.actors = []
        if self._owns:
            self._owns = False
            self.ray.shutdown()


def _gpu_share(cfg: RunConfig, ray: Any, actors: int) -> float:
    """The GPU each Ray actor asks for: none on the CPU; on ``cuda``, the cluster's GPUs shared evenly (Ray shows an
    actor only the GPU it was given); ConfigError for a cluster without one."""
    if not cfg.runtime.device.startswith("cuda"):
        return 0.0
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus == 0:
        raise ConfigError(f"runtime.device = {cfg.runtime.device!r} but the Ray cluster has no GPU")
    return 1.0 / -(-actors // gpus)  # ceil(actors / gpus) actors on each GPU


def _groups(cfg: RunConfig) -> list[list[str]]:
    """Each worker's devices: a static round-robin share (a device stays in its worker)."""
    devices = cfg.topology.all_devices()
    n = min(cfg.runtime.sim_workers, len(devices))
    return [devices[i::n] for i in range(n)]


def worker_device(cfg: RunConfig, spec: ModelSpec | None = None) -> str | None:
    """The torch device every worker trains on: ``runtime.device``, with ``auto`` decided once, here in the
    main process (logged), so that all workers follow one choice: the CPU when torch sees no GPU; with a GPU,
    the GPU for the per-device engine and, for the cohort engine, the engine's own rule
    (``protocols.cohort_trainer.auto_on_gpu``) applied to a worker's largest cohort (its share of the devices,
    at most ``cohort_size``, x ``batch_size`` x the model's parameters). ``None``: that rule needs ``spec``."""
    device = cfg.runtime.device
    if device != "auto" or cfg.runtime.sim_workers == 0:
        return device
    import torch

    from protocols.cohort_trainer import auto_on_gpu
    from protocols.torch_trainer import say

    plan = execution_plan(cfg)
    if not torch.cuda.is_available():
        choice, why = "cpu", "torch sees no CUDA device"
    elif not plan.cohort:
        choice, why = "cuda", torch.cuda.get_device_name(0)
    elif spec is None:
        return None
    else:
        models = min(plan.cohort_size, max(len(g) for g in _groups(cfg)))
        gpu, why = auto_on_gpu(models, cfg.train.batch_size, spec.num_params())
        choice = "cuda" if gpu else "cpu"
    say(f"runtime.device = auto: the {len(_groups(cfg))} sim workers train on {choice} ({why})")
    return choice


def start_workers(
    cfg: RunConfig, loop: VirtualLoop, spec: ModelSpec | None = None
) -> ProcessExecutor | RayExecutor | None:
    """The workers the run's execution plan asks for (``runtime.sim_workers``, ``runtime.sim_backend``),
    started now (they build their devices meanwhile) on :func:`worker_device`'s device (started with
    ``spawn``: the main process may have touched CUDA); ``None`` for 0 workers (devices train in this
    process: :func:`make_executor`). ``ValueError`` when ``auto`` needs ``spec`` to decide and has none."""
    plan = execution_plan(cfg)
    if plan.workers == 0:
        return None
    device = worker_device(cfg, spec)
    if device is None:
        raise ValueError("runtime.device = auto with a GPU: the workers' device depends on the model spec")
    if device != cfg.runtime.device:
        cfg = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"device": device})})
    if plan.backend == "ray":
        return RayExecutor(cfg, _groups(cfg), loop, batched=plan.cohort)
    return ProcessExecutor(cfg.to_toml(), _groups(cfg), loop, batched=plan.cohort)


def make_executor(
    plan: ExecutionPlan,
    agents: Mapping[str, Trainee],
    spec: ModelSpec,
    loop: VirtualLoop,
    trainer: Trainer,
    workers: ProcessExecutor | RayExecutor | None,
) -> ProcessExecutor | RayExecutor | CohortExecutor | InlineExecutor:
    """The executor of ``fedtier sim``'s devices under ``plan``: its ``workers`` (:func:`start_workers`),
    else cohorts in this process (``trainer`` can train in them), else each device at once."""
    from edge_agent.cohort import cohort_engine, make_cohort_executor

    if workers is not None:
        if plan.cohort:
            cohort_engine(spec, plan.device)  # refuse a model the workers could not vectorize, now
        return workers
    return make_cohort_executor(plan, agents, spec, loop, trainer) or InlineExecutor(agents)
