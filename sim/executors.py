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
error naming the device and the worker's last words; one that hangs (owes results and sends nothing, not even a
progress beat, for ``runtime.worker_stall_s``: ``sim/worker_watch.py``) is killed and ends the run the same way,
naming it and its silence; workers are always shut down (:meth:`close`).
The worker side is ``sim/device_worker.py``, the frames both sides exchange ``sim/worker_frames.py``; Ray's
actors are ``sim/ray_actors.py``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from protocols import procs
from protocols.algorithms.base import DeviceContext, ModelSpec
from protocols.config import ConfigError, RunConfig
from protocols.execution import ExecutionPlan, execution_plan, shared_threads
from protocols.limits import processes_refusal
from protocols.round_text import nth_edge
from protocols.trainer import Trainer
from protocols.transport.memory import VirtualLoop
from protocols.wire.envelope import ENVELOPE_ROOM
from protocols.wire.messenger import Received
from protocols.wire.payload import Payload, decode_payload, encode_payload

from .datasets import builtin_geometry
from .device_worker import process_main
from .device_worker import set_torch_threads as set_torch_threads  # the launchers import it from here
from .result_ring import RingReader, ring_bytes
from .worker_context import launch, worker_context
from .worker_frames import Batch, frame, unframe
from .worker_watch import Watch, named_devices

if TYPE_CHECKING:
    from edge_agent.agent import Trainee
    from edge_agent.cohort import CohortExecutor

log = logging.getLogger("fedtier.sim")

Done = Callable[[Payload | None, str | None], None]


def worker_threads(cfg: RunConfig) -> int:
    """Torch threads of a worker's cohorts: ``cohort_threads`` shared by the ``sim_workers`` (the cloud's
    evaluation, which runs while they wait, takes all of them)."""
    return shared_threads(cfg.runtime.cohort_threads, cfg.runtime.sim_workers)


class WorkerError(RuntimeError):
    """A worker died, hung or could not start; the run cannot go on."""


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

    def __init__(
        self, groups: list[list[str]], loop: VirtualLoop, batched: bool = False, stall_s: float = 300.0
    ) -> None:
        """``batched`` (engine = cohort): tasks wait until the loop is idle, then go to each worker as one
        batch, which it trains as cohorts; otherwise each task goes at once. ``stall_s``: the longest silence of a
        worker that owes results (``runtime.worker_stall_s``)."""
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
        self.watch = Watch(len(groups), stall_s, self._stalled, self._poll)

    def submit(self, device: str, task: Payload, ctx: DeviceContext, done: Done, wire: Received | None = None) -> None:
        """Queue ``task`` for its device's worker: its bytes as they arrived (``wire``), else encoded now."""
        worker = self.owner[device]
        with self._lock:
            if worker in self._dead:
                raise WorkerError(
                    f"device {device} (round {nth_edge(ctx.round, ctx.edge_round)}): {self._dead[worker]}"
                )
            task_id = next(self._ids)
            self._pending[task_id] = (worker, device, nth_edge(ctx.round, ctx.edge_round), self.loop.hold(), done)
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
            self.watch.sent(worker, 1)
            self._send(worker, task_id, header, body)

    def flush(self) -> None:
        """Send each worker its queued tasks as one batch (the loop is idle: the round's tasks are all in)."""
        batches, self._batches = self._batches or {}, {}
        for worker, batch in batches.items():
            self.largest_batch = max(self.largest_batch, len(batch))
            self.watch.sent(worker, len(batch))
            self._send_batch(worker, batch)

    def _send(self, worker: int, task_id: int, ctx: dict[str, Any], task: Received) -> None:
        raise NotImplementedError

    def _send_batch(self, worker: int, batch: Batch) -> None:
        raise NotImplementedError(f"{type(self).__name__} trains per device")

    def describe(self, worker: int) -> str:
        """The worker and its devices, for error messages."""
        return f"sim worker {worker} (devices {named_devices(self.groups[worker])})"

    def _poll(self, worker: int) -> None:
        """Ask ``worker``, which owes results, for a progress beat (Ray actors; worker processes send theirs)."""

    def _kill(self, worker: int) -> None:
        """End a stalled worker (it may be stopped: nothing short of a kill ends it)."""
        raise NotImplementedError

    def _reply(self, task_id: int, result: bytes | memoryview, error: str, checked: bool = False) -> None:
        """A worker's answer (any thread): decode it here, deliver it on the loop. ``checked``: the worker checked
        its floats finite (``device_worker.answer``): its device's agent does not read them again."""
        with self._lock:
            owed = self._pending.pop(task_id, None)
        if owed is None:
            return  # its worker was declared dead meanwhile
        self.watch.answered(owed[0])
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
        """Worker ``worker`` is gone: every task it owed ends the run, naming its device (the first reason stays)."""
        self.watch.give_up(worker)
        with self._lock:
            self._dead.setdefault(worker, why)
            owed = [(k, v) for k, v in self._pending.items() if v[0] == worker]
            for k, _ in owed:
                del self._pending[k]
        for _, (_, device, rnd, complete, _) in owed:
            complete(functools.partial(_raise, WorkerError(f"device {device} (round {rnd}): {why}")))

    def _stalled(self, worker: int, silent: float) -> None:
        """``worker`` owes results and was silent for ``silent`` s (:class:`Watch`'s thread): kill it, end the run."""
        with self._lock:
            owed = [f"{device} ({rnd})" for w, device, rnd, *_ in self._pending.values() if w == worker]
        why = (
            f"{self.describe(worker)} sent nothing, no result and no progress beat, for {silent:.1f} s "
            f"(runtime.worker_stall_s = {self.watch.stall_s:g}) while it owed {len(owed)} result(s): "
            f"{', '.join(owed[:8])}{', ...' if len(owed) > 8 else ''}; it is stopped, deadlocked or stuck, and was "
            "killed (a device role that trains in a loop of its own must tick protocols.trainer.PROGRESS each step; "
            "a longer silence: raise runtime.worker_stall_s)"
        )
        log.error("%s", why)
        self._died(worker, why)
        self._kill(worker)


def _raise(exc: Exception) -> NoReturn:
    raise exc


class ProcessExecutor(_Remote):
    """Local worker processes (``spawn``: never fork a process that has threads), one pipe each way."""

    def __init__(
        self,
        config_text: str,
        groups: list[list[str]],
        loop: VirtualLoop,
        batched: bool = False,
        stall_s: float = 300.0,
        result_bytes: int = 0,
    ) -> None:
        """``result_bytes``: about one device's result (its ring holds a worker's results of an edge round)."""
        super().__init__(groups, loop, batched, stall_s)
        ctx = worker_context()  # never fork: this process has threads (a fork server, or spawn)
        self.procs: list[Any] = []
        self._outboxes: list[queue.Queue[bytes | None]] = []
        self._threads: list[threading.Thread] = []
        self._closing = False
        self.rings: list[RingReader | None] = []  # each worker's results (sim/result_ring.py); None: its pipe
        most = max((len(g) for g in groups), default=0)
        ring_size = ring_bytes(len(groups), results=most * (result_bytes + ENVELOPE_ROOM))
        try:
            for i, group in enumerate(groups):
                task_r, task_w = ctx.Pipe(duplex=False)
                result_r, result_w = ctx.Pipe(duplex=False)
                ring = self._ring(ring_size, ctx)
                self.rings.append(ring)
                ring_args = ring and (ring.name, ring.size, ring.freed)
                worker_args = (task_r, result_w, config_text, group, ring_args)
                proc = launch(ctx, process_main, worker_args, f"fedtier-sim-worker-{i}")
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
                if "beat" in header:
                    self.watch.beat(worker)
                    continue
                if "ready" in header:
                    self.watch.started(worker)
                    continue
                if "fatal" in header:
                    fatal = header["fatal"]
                    continue
                if "ring" in header:  # the result's bytes are in the worker's ring: lent until they are done with
                    try:
                        at, n = header["ring"]
                        body = self._ring_of(worker).take(at, n, header.get("room", 0))
                    except (TypeError, ValueError) as exc:
                        self._reply(header["id"], b"", f"bad result from the worker: {exc}")
                        continue
                self._reply(header["id"], body, header["error"], header.get("checked") is True)
                del body  # (not kept while the next result is awaited: a lent record is freed when done with)
        except (EOFError, OSError):
            pass
        finally:
            conn.close()
        if self._closing or worker in self._dead:  # (a stalled worker, killed: its reason is told)
            return
        proc = self.procs[worker]
        proc.join(5.0)
        group = named_devices(self.groups[worker])
        why = f"sim worker {worker} (devices {group}) died with exit code {proc.exitcode}"
        log.error("%s%s", why, f":\n{fatal}" if fatal else "")
        self._died(worker, why + (f":\n{fatal.rstrip()}" if fatal else " (see its log above)"))

    def describe(self, worker: int) -> str:
        return f"sim worker {worker} (pid {self.procs[worker].pid}; devices {named_devices(self.groups[worker])})"

    def _kill(self, worker: int) -> None:
        self.procs[worker].kill()

    def _ring_of(self, worker: int) -> RingReader:
        ring = self.rings[worker] if worker < len(self.rings) else None
        if ring is None:
            raise ValueError("a ring record from a worker without a ring")
        return ring

    def close(self) -> None:
        """Stop the workers (terminate those that do not exit within a few seconds), unlink their rings;
        idempotent."""
        self._closing = True
        self.watch.close()
        if self._batches is not None and self.loop.on_idle == self.flush:
            self.loop.on_idle = None
        for outbox in self._outboxes:
            outbox.put(None)
        procs.end(self.procs, grace=5.0, what="sim worker")
        for thread in self._threads:
            thread.join(5.0)
        for ring in self.rings:
            if ring is not None:
                ring.close()
        self.rings = []  # (their semaphores are unlinked as they go)


class RayExecutor(_Remote):
    """Ray actors (``sim/ray_actors.py``: where they run, what crosses, how they fail), on ``cfg``'s cluster;
    ``batched``: engine = cohort, one batch per actor and edge round."""

    def __init__(self, cfg: RunConfig, groups: list[list[str]], loop: VirtualLoop, batched: bool = False) -> None:
        from .ray_actors import RayActors

        super().__init__(groups, loop, batched, cfg.runtime.worker_stall_s)
        try:
            self.actors = RayActors(cfg, groups, self._reply, self._died, self.watch)
        except BaseException:
            self.watch.close()
            raise

    def _send(self, worker: int, task_id: int, ctx: dict[str, Any], task: Received) -> None:
        self.actors.send(worker, task_id, ctx, task)

    def _send_batch(self, worker: int, batch: Batch) -> None:
        self.actors.send_batch(worker, batch)

    def describe(self, worker: int) -> str:
        return self.actors.name(worker)

    def _poll(self, worker: int) -> None:
        self.actors.poll(worker)

    def _kill(self, worker: int) -> None:
        self.actors.kill(worker)

    def close(self) -> None:
        """Kill the actors; shut Ray down if we started it (idempotent)."""
        self.watch.close()
        if self._batches is not None and self.loop.on_idle == self.flush:
            self.loop.on_idle = None
        self.actors.close()


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
    why = processes_refusal(min(plan.workers, len(cfg.topology.devices())), "runtime.sim_workers")
    if why is not None:
        raise ConfigError(why)
    return ProcessExecutor(
        cfg.to_toml(),
        _groups(cfg),
        loop,
        batched=plan.cohort,
        stall_s=cfg.runtime.worker_stall_s,
        result_bytes=_result_bytes(cfg, spec),
    )


def _result_bytes(cfg: RunConfig, spec: ModelSpec | None) -> int:
    """About one device's result: a dense float32 delta of the run's model (``spec``, else the model of a
    built-in dataset's geometry: workers start before the data is loaded); 0 when not known."""
    if spec is None:
        geometry = builtin_geometry(cfg.data.dataset, **cfg.data.loader_params())
        if geometry is None:
            return 0
        spec = cfg.model_spec(*geometry)
    return 4 * spec.num_params()


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
