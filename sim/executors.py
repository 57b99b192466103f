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
"""

from __future__ import annotations

import itertools
import json
import logging
import multiprocessing as mp
import queue
import signal
import struct
import sys
import threading
import tomllib
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from protocols import procs
from protocols.algorithms.base import DeviceContext, DeviceRole, ModelSpec
from protocols.config import ConfigError, RunConfig, parse_config
from protocols.execution import ExecutionPlan, execution_plan, shared_threads
from protocols.trainer import LocalData, Trainer
from protocols.transport.memory import VirtualLoop
from protocols.wire.payload import Payload, decode_payload, encode_payload

from .attack import attacked, byzantine_devices

if TYPE_CHECKING:
    from edge_agent.agent import Trainee
    from edge_agent.cohort import CohortExecutor

log = logging.getLogger("fedtier.sim")

Done = Callable[[Payload | None, str | None], None]
LOCAL_DATA_BYTES = 512 << 20  # a worker keeps its recently trained devices' samples up to this size


def set_torch_threads(n: int = 1) -> None:
    """One torch thread per worker: on small models, more threads are much slower here."""
    import torch

    torch.set_num_threads(n)


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

    def submit(self, device: str, task: Payload, ctx: DeviceContext, done: Done) -> None:
        done(*self.agents[device].train_here(task, ctx))

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------ the worker side
class DeviceWorker:
    """The devices one worker trains, built from the run's config text; used in a process or as a Ray actor."""

    def __init__(self, config_text: str, devices: Sequence[str]) -> None:
        from protocols.torch_trainer import TorchTrainer

        from .hierarchy import prepare
        from .onnx_devices import onnx_trainers

        set_torch_threads(1)
        cfg = parse_config(tomllib.loads(config_text))
        prep = prepare(cfg)
        spec = prep.spec
        algorithm = cfg.build_algorithm(spec)
        torch_trainer = TorchTrainer.from_spec(
            spec.name, spec.input_shape, spec.num_classes, cfg.runtime.device, **spec.build_kwargs()
        )
        onnx = onnx_trainers(cfg, spec, algorithm) if set(devices) & set(cfg.runtime.onnx_devices) else {}
        self.mine = frozenset(devices)
        self.data = prep.device_data  # index views: a device's samples are copied out when it trains
        self.algorithm = algorithm
        self.roles: dict[str, DeviceRole] = {}  # built on a device's first task, kept (roles may hold state)
        self.trainer_for = lambda d: onnx.get(d, torch_trainer)
        self.byzantine, self.attack = set(byzantine_devices(cfg)), cfg.attack  # [attack], as in the main process
        self.spec = spec
        plan = execution_plan(cfg)
        self.runner = None  # the cohort engine: this worker's share of a round trains as cohorts
        if plan.cohort:
            from edge_agent.cohort import CohortRunner

            self.runner = CohortRunner(spec, plan.cohort_size, plan.device, plan.worker_threads)
        self._local: dict[str, LocalData] = {}  # recently trained devices' samples (copied out once)
        self._local_bytes = 0

    def _device(self, ctx: dict[str, Any]) -> tuple[DeviceContext, DeviceRole, LocalData]:
        c = DeviceContext(
            int(ctx["seed"]), int(ctx["round"]), int(ctx["edge_round"]), str(ctx["cell"]), str(ctx["device"])
        )
        if c.device not in self.mine:
            raise KeyError(f"device {c.device!r} is not one of this worker's")
        role = self.roles.get(c.device)
        if role is None:
            role = attacked(self.algorithm.device(c.device), c.device, self.byzantine, self.attack)
            self.roles[c.device] = role
        return c, role, self._data(c.device)

    def _data(self, device: str) -> LocalData:
        """The device's samples, kept for its next tasks while the kept ones fit in ``LOCAL_DATA_BYTES``
        (copying a large share out of the data set every round costs more than training it)."""
        data = self._local.pop(device, None)
        if data is None:
            data = self.data[device]
            self._local_bytes += data.x.nbytes + data.y.nbytes
        self._local[device] = data  # most recently used last
        while self._local_bytes > LOCAL_DATA_BYTES and len(self._local) > 1:
            old = self._local.pop(next(iter(self._local)))
            self._local_bytes -= old.x.nbytes + old.y.nbytes
        return data

    def train(self, ctx: dict[str, Any], task: bytes | memoryview) -> tuple[bytes, str]:
        """``(encoded result, "")``, or ``(b"", error)`` when the role raised (the device rejects the task)."""
        try:
            c, role, data = self._device(ctx)
            result = role.train(decode_payload(task), data, self.trainer_for(c.device), c)
            return encode_payload(result), ""
        except Exception as exc:  # a bad task must not kill the device (as in the main process)
            log.exception("device %s failed round %s.%s", ctx.get("device"), ctx.get("round"), ctx.get("edge_round"))
            return b"", str(exc)

    def train_many(self, items: Sequence[tuple[dict[str, Any], bytes | memoryview]]) -> list[tuple[bytes, str]]:
        """:meth:`train` for each item, in order; with ``engine = "cohort"`` the torch devices' tasks
        train as cohorts of at most ``cohort_size`` (``edge_agent.cohort.CohortRunner``), the others one by one."""
        out: list[tuple[bytes, str]] = [(b"", "not run")] * len(items)
        jobs: list[tuple[int, DeviceContext, DeviceRole, LocalData, Payload]] = []
        for i, (ctx, task) in enumerate(items):
            if self.runner is None or not self.trainer_for(str(ctx["device"])).trains_in_cohorts:
                out[i] = self.train(ctx, task)
                continue
            try:
                c, role, data = self._device(ctx)
                jobs.append((i, c, role, data, decode_payload(task)))
            except Exception as exc:
                log.exception("device %s: bad task", ctx.get("device"))
                out[i] = (b"", str(exc))
        if self.runner is None:
            return out
        for chunk in self.runner.split(jobs, lambda job: job[1].device):
            run = [
                lambda trainer, c=c, role=role, data=data, task=task: role.train(task, data, trainer, c)
                for _, c, role, data, task in chunk
            ]
            outcomes = self.runner.train([job[1].device for job in chunk], run)
            for (i, *_), (result, error) in zip(chunk, outcomes):
                out[i] = (encode_payload(result), "") if result is not None else (b"", error or "failed")
        return out


def _frame(header: dict[str, Any], body: bytes = b"") -> bytes:
    h = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<I", len(h)) + h + body


def _unframe(data: bytes) -> tuple[dict[str, Any], memoryview]:
    (n,) = struct.unpack_from("<I", data)
    view = memoryview(data)
    return json.loads(bytes(view[4 : 4 + n])), view[4 + n :]


def _batch_frame(items: Sequence[tuple[int, dict[str, Any], bytes]]) -> bytes:
    """One frame for a worker's batch of tasks. A task byte-identical to an earlier one of the batch (a cell
    sends every device of an edge round the same model) is sent once: its item says ``"same": j``."""
    head: list[dict[str, Any]] = []
    bodies: list[bytes] = []
    for task_id, ctx, task in items:
        same = next(
            (
                j
                for j, (_, _, earlier) in enumerate(items[: len(head)])
                if "n" in head[j] and len(earlier) == len(task) and earlier == task
            ),
            None,
        )
        if same is None:
            head.append({"id": task_id, "ctx": ctx, "n": len(task)})
            bodies.append(task)
        else:
            head.append({"id": task_id, "ctx": ctx, "same": same})
    return _frame({"batch": head}, b"".join(bodies))


def _batch_items(header: dict[str, Any], body: memoryview) -> list[tuple[dict[str, Any], memoryview]]:
    """``(ctx, task bytes)`` of each item of a :func:`_batch_frame`; a bad reference raises ``ValueError``."""
    items: list[tuple[dict[str, Any], memoryview]] = []
    at = 0
    for item in header["batch"]:
        if "same" in item:
            j = item["same"]
            if not (isinstance(j, int) and 0 <= j < len(items)):
                raise ValueError(f"batch item refers to task {j!r}")
            items.append((item["ctx"], items[j][1]))
        else:
            items.append((item["ctx"], body[at : at + item["n"]]))
            at += item["n"]
    return items


def process_main(tasks: Any, results: Any, config_text: str, devices: list[str]) -> None:
    """A worker process: build the devices, then answer tasks until told to stop (or the main process is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the main process, which stops us
    procs.die_with_parent()  # even a SIGKILLed main process leaves no worker behind
    logging.basicConfig(level=logging.WARNING, format="%(processName)s %(message)s")
    try:
        worker = DeviceWorker(config_text, devices)
    except BaseException:  # the main process shows it when a task needs this worker (it may fail the same way)
        results.send_bytes(_frame({"fatal": traceback.format_exc()}))
        sys.exit(1)
    while True:
        try:
            header, body = _unframe(tasks.recv_bytes())
        except EOFError:
            return
        if header.get("stop"):
            return
        if "batch" in header:  # engine = cohort: a round's tasks for this worker, answered one by one
            for item, (result, error) in zip(header["batch"], worker.train_many(_batch_items(header, body))):
                results.send_bytes(_frame({"id": item["id"], "error": error}, result))
            continue
        result, error = worker.train(header["ctx"], body)
        results.send_bytes(_frame({"id": header["id"], "error": error}, result))


# ------------------------------------------------------------------------------ the main side
class _Remote:
    """What the process and Ray executors share: device -> worker, outstanding tasks, completions."""

    def __init__(self, groups: list[list[str]], loop: VirtualLoop, batched: bool = False) -> None:
        """``batched`` (engine = cohort): tasks wait until the loop is idle, then go to each worker as one
        batch, which it trains as cohorts; otherwise each task goes at once."""
        self.loop, self.groups = loop, groups
        self._batches: dict[int, list[tuple[int, dict[str, Any], bytes]]] | None = {} if batched else None
        self.largest_batch = 0  # most tasks a worker got at once (tests, progress)
        if batched:
            loop.on_idle = self.flush
        self.owner = {d: i for i, group in enumerate(groups) for d in group}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[int, str, str, Callable[[Callable[[], None]], None], Done]] = {}
        self._dead: dict[int, str] = {}  # worker -> why

    def submit(self, device: str, task: Payload, ctx: DeviceContext, done: Done) -> None:
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
        if self._batches is not None:
            self._batches.setdefault(worker, []).append((task_id, header, encode_payload(task)))
        else:
            self._send(worker, task_id, header, encode_payload(task))

    def flush(self) -> None:
        """Send each worker its queued tasks as one batch (the loop is idle: the round's tasks are all in)."""
        batches, self._batches = self._batches or {}, {}
        for worker, items in batches.items():
            self.largest_batch = max(self.largest_batch, len(items))
            self._send_batch(worker, items)

    def _send(self, worker: int, task_id: int, ctx: dict[str, Any], task: bytes) -> None:
        raise NotImplementedError

    def _send_batch(self, worker: int, items: list[tuple[int, dict[str, Any], bytes]]) -> None:
        raise NotImplementedError(f"{type(self).__name__} trains per device")

    def _reply(self, task_id: int, result: bytes | memoryview, error: str) -> None:
        """A worker's answer (any thread): decode it here, deliver it on the loop."""
        with self._lock:
            owed = self._pending.pop(task_id, None)
        if owed is None:
            return  # its worker was declared dead meanwhile
        complete, done = owed[3], owed[4]
        if error:
            complete(lambda: done(None, error))
            return
        try:  # no finiteness check: the cell's own decoding judges the result, as in the main process
            payload = decode_payload(result, require_finite=False)
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
            message = f"device {device} (round {rnd}): {why}"
            complete(lambda m=message: _raise(WorkerError(m)))


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
        try:
            for i, group in enumerate(groups):
                task_r, task_w = ctx.Pipe(duplex=False)
                result_r, result_w = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=process_main,
                    args=(task_r, result_w, config_text, group),
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

    def _send(self, worker: int, task_id: int, ctx: dict[str, Any], task: bytes) -> None:
        self._outboxes[worker].put(_frame({"id": task_id, "ctx": ctx}, task))

    def _send_batch(self, worker: int, items: list[tuple[int, dict[str, Any], bytes]]) -> None:
        self._outboxes[worker].put(_batch_frame(items))

    def _writer(self, worker: int, conn: Any, outbox: queue.Queue[bytes | None]) -> None:
        """Sends tasks in order without blocking the loop (a pipe holds only 64 KiB)."""
        try:
            while (data := outbox.get()) is not None:
                conn.send_bytes(data)
            conn.send_bytes(_frame({"stop": True}))
        except OSError:
            pass  # the worker is gone: its reader reports it
        finally:
            conn.close()

    def _reader(self, worker: int, conn: Any) -> None:
        fatal = ""
        try:
            while True:
                header, body = _unframe(conn.recv_bytes())
                if "fatal" in header:
                    fatal = header["fatal"]
                    continue
                self._reply(header["id"], body, header["error"])
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

    def close(self) -> None:
        """Stop the workers (terminate those that do not exit within a few seconds); idempotent."""
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


class RayExecutor(_Remote):
    """Ray actors (``runtime.ray_address``: a cluster; none: a local Ray), one CPU each."""

    def __init__(
        self, config_text: str, groups: list[list[str]], loop: VirtualLoop, address: str | None = None
    ) -> None:
        try:
            import ray
        except ImportError:
            raise ConfigError("runtime.sim_backend = \"ray\" needs Ray: pip install 'fedtier[ray]'") from None
        super().__init__(groups, loop)
        self.ray = ray
        self._owns = not ray.is_initialized()
        if self._owns:
            ray.init(
                address=address or None, include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING
            )
        self.actors: list[Any] = []
        try:
            cpus = ray.cluster_resources().get("CPU", 0)
            if len(groups) > cpus:
                raise ConfigError(f"runtime.sim_workers = {len(groups)} but the Ray cluster has {cpus:g} CPUs")
            actor = ray.remote(num_cpus=1)(DeviceWorker)
            self.actors = [actor.remote(config_text, group) for group in groups]
        except BaseException:
            self.close()
            raise

    def _send(self, worker: int, task_id: int, ctx: dict[str, Any], task: bytes) -> None:
        future = self.actors[worker].train.remote(ctx, task).future()
        future.add_done_callback(lambda f: self._settled(worker, task_id, f))

    def _settled(self, worker: int, task_id: int, future: Any) -> None:
        try:
            result, error = future.result()
        except Exception as exc:  # the actor died or could not be built
            group = ", ".join(self.groups[worker])
            self._died(worker, f"Ray actor {worker} (devices {group}) failed: {exc}")
            return
        self._reply(task_id, result, error)

    def close(self) -> None:
        """Kill the actors; shut Ray down if we started it (idempotent)."""
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:  # already gone
                pass
        self.actors = []
        if self._owns:
            self._owns = False
            self.ray.shutdown()


def start_workers(cfg: RunConfig, loop: VirtualLoop) -> ProcessExecutor | RayExecutor | None:
    """The workers the run's execution plan asks for (``runtime.sim_workers``, ``runtime.sim_backend``),
    started now (they build their devices meanwhile); ``None`` for 0 workers (devices train in this process:
    :func:`make_executor`)."""
    plan = execution_plan(cfg)
    if plan.workers == 0:
        return None
    devices = cfg.topology.all_devices()
    n = min(plan.workers, len(devices))
    groups = [devices[i::n] for i in range(n)]  # a static round-robin share: a device stays in its worker
    if plan.backend == "ray":
        return RayExecutor(cfg.to_toml(), groups, loop, plan.ray_address)
    return ProcessExecutor(cfg.to_toml(), groups, loop, batched=plan.cohort)


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
