"""The worker side of ``fedtier sim``'s parallel training (``sim/executors.py``): a worker process or Ray actor
rebuilds the run's data partition from the config text and trains its fixed share of the devices, keeping
each device's role for the whole run."""

from __future__ import annotations

import functools
import logging
import sys
import threading
import tomllib
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from protocols.algorithms.base import DeviceContext, DeviceRole, train_role
from protocols.config import parse_config
from protocols.divergence import diverged_result, nonfinite
from protocols.execution import execution_plan
from protocols.heap import setup_frozen
from protocols.round_text import nth_edge
from protocols.trainer import PROGRESS, LocalData
from protocols.wire.envelope import ENVELOPE_ROOM
from protocols.wire.payload import Parts, Payload, decode_payload, payload_parts

from .attack import attacked, byzantine_devices
from .result_ring import RingWriter
from .worker_context import become_worker
from .worker_frames import batch_items, frame, unframe
from .worker_watch import check_period

if TYPE_CHECKING:
    from .datasets import Dataset

log = logging.getLogger("fedtier.sim")

Emit = Callable[[int, Parts, str], None]
"""A worker's answer to item ``i`` of a batch, as soon as it is known (:meth:`DeviceWorker.train_many`)."""

LOCAL_DATA_BYTES = 512 << 20  # a worker keeps its recently trained devices' samples up to this size


def set_torch_threads(n: int = 1) -> None:
    """One torch thread per worker: on small models, more threads are much slower here."""
    import torch

    torch.set_num_threads(n)


def share_gpu_memory(engine: Any, workers: int) -> None:
    """A worker's cohort engine on a GPU that ``workers`` workers share plans its cohort parts within its share of
    the GPU memory free now (``MEMORY_SHARE`` of it, over ``workers``), not within what it sees free at each call
    (every worker would plan on the same free memory); a no-op on the CPU or for one worker."""
    if workers < 2 or engine.device.type != "cuda":
        return
    import torch

    from protocols.cohort_trainer import MEMORY_SHARE

    free, _ = torch.cuda.mem_get_info(engine.device)
    engine.memory_limit = int(MEMORY_SHARE * free / workers)
    log.info("sim worker: cohort parts planned within %.0f MiB of GPU memory", engine.memory_limit / 2**20)


class DeviceWorker:
    """The devices one worker trains, built from the run's config text; used in a process or as a Ray actor."""

    def __init__(self, config_text: str, devices: Sequence[str], dataset: Dataset | None = None) -> None:
        """``dataset``: the run's, as the main process loaded it (Ray ships it); none: loaded here."""
        from protocols.torch_trainer import TorchTrainer

        from .hierarchy import prepare
        from .onnx_devices import onnx_trainers

        set_torch_threads(1)
        cfg = parse_config(tomllib.loads(config_text))
        prep = prepare(cfg, dataset)
        spec = prep.spec
        algorithm = cfg.build_algorithm(spec)
        torch_trainer = TorchTrainer.from_spec(
            spec.name, spec.input_shape, spec.num_classes, cfg.runtime.device, **spec.build_kwargs()
        )
        onnx = onnx_trainers(cfg, spec, algorithm) if set(devices) & set(cfg.runtime.onnx_devices) else {}
        self.mine = frozenset(devices)
        self.data = prep.device_data  # a device's samples, copied out of the data set when it first trains
        self.data.keep_bytes = LOCAL_DATA_BYTES  # and kept for its next tasks: the worker's one bound
        self.algorithm = algorithm
        self.roles: dict[str, DeviceRole] = {}  # built on a device's first task, kept (roles may hold state)
        self.trainer_for = lambda d: onnx.get(d, torch_trainer)
        self.byzantine, self.attack = set(byzantine_devices(cfg)), cfg.attack  # [attack], as in the main process
        self.spec = spec
        self.stall_s = cfg.runtime.worker_stall_s
        plan = execution_plan(cfg)
        self.runner = None  # the cohort engine: this worker's share of a round trains as cohorts
        if plan.cohort:
            from edge_agent.cohort import CohortRunner

            self.runner = CohortRunner(spec, plan.cohort_size, plan.device, plan.worker_threads)
            share_gpu_memory(self.runner.engine, plan.workers)

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
        return c, role, self.data[c.device]

    def train(self, ctx: dict[str, Any], task: bytes | memoryview) -> tuple[bytes, str]:
        """``(encoded result, "")``, or ``(b"", error)`` when the role raised (the device rejects the task)."""
        parts, error = self.train_parts(ctx, task)
        return b"".join(parts), error  # type: ignore[arg-type]  # arrays are buffers

    def train_parts(self, ctx: dict[str, Any], task: bytes | memoryview) -> tuple[Parts, str]:
        """:meth:`train`'s result as its encoding's buffers (``payload_parts``), not joined."""
        try:
            c, role, data = self._device(ctx)
            result = train_role(role, decode_payload(task, views=True), data, self.trainer_for(c.device), c)
            return answer(result, c), ""
        except Exception as exc:  # a bad task must not kill the device (as in the main process)
            log.exception(
                "device %s failed round %s", ctx.get("device"), nth_edge(ctx.get("round"), ctx.get("edge_round"))
            )
            return [], str(exc)

    def train_many(
        self, items: Sequence[tuple[dict[str, Any], bytes | memoryview]], emit: Emit | None = None
    ) -> list[tuple[Parts, str]]:
        """:meth:`train_parts` for each item, in order; with ``engine = "cohort"`` the torch devices' tasks
        train as cohorts of at most ``cohort_size`` (``edge_agent.cohort.CohortRunner``), the others one by one.
        ``emit(i, parts, error)``: each item's result as soon as it is known (a cohort's once it is trained: the
        main process takes the first cohorts' results in while the later ones train), not kept in the list."""
        out: list[tuple[Parts, str]] = [([], "not run")] * len(items)

        def done(i: int, parts: Parts, error: str) -> None:
            if emit is None:
                out[i] = (parts, error)
            else:
                emit(i, parts, error)

        jobs: list[tuple[int, DeviceContext, DeviceRole, LocalData, Payload]] = []
        for i, (ctx, task) in enumerate(items):
            PROGRESS.tick()  # preparing a large batch's devices (their roles, their data) is progress too
            if self.runner is None or not self.trainer_for(str(ctx["device"])).trains_in_cohorts:
                done(i, *self.train_parts(ctx, task))
                continue
            try:
                c, role, data = self._device(ctx)
                jobs.append((i, c, role, data, decode_payload(task, views=True)))
            except Exception as exc:
                log.exception("device %s: bad task", ctx.get("device"))
                done(i, [], str(exc))
        if self.runner is None:
            return out
        for chunk in self.runner.split(jobs, lambda job: job[1].device):
            run = [
                lambda trainer, c=c, role=role, data=data, task=task: train_role(role, task, data, trainer, c)
                for _, c, role, data, task in chunk
            ]
            outcomes = self.runner.train([job[1].device for job in chunk], run)
            for (i, c, *_), (result, error) in zip(chunk, outcomes):
                done(i, *((answer(result, c), "") if result is not None else ([], error or "failed")))
        return out


def answer(result: Payload, c: DeviceContext) -> Parts:
    """A trained result's encoding as its device's agent sends it: one with a non-finite number as its diverged
    result (``edge_agent.agent``'s rule, the same reason), so that every float of what a worker sends is checked
    finite and the main process need not read it again for that."""
    why = nonfinite(result)
    if why is not None:
        log.warning("device %s diverged in round %s: %s", c.device, nth_edge(c.round, c.edge_round), why)
        result = diverged_result(why)
    return payload_parts(result)


def process_main(
    tasks: Any,
    results: Any,
    config_text: str,
    devices: list[str],
    ring: tuple[str, int, Any] | None = None,
    parent: int | None = None,
    inherited: Any = None,
) -> None:
    """A worker process: build the devices, then answer tasks until told to stop (or the main process is gone).
    ``ring``: its result ring's ``(name, size, semaphore)`` (``sim/result_ring.py``); none: results by pipe.
    ``parent``, ``inherited``: the main process's pid, its output and environment (``sim.worker_context``: a fork
    server between)."""
    become_worker(parent, inherited)
    try:
        worker = DeviceWorker(config_text, devices)
    except BaseException:  # the main process shows it when a task needs this worker (it may fail the same way)
        results.send_bytes(frame({"fatal": traceback.format_exc()}))
        sys.exit(1)
    writer = _ring_writer(ring)
    answers = Answers(results, writer)
    answers.send_header({"ready": True})
    stop = threading.Event()
    threading.Thread(target=_beat, args=(answers, check_period(worker.stall_s), stop), daemon=True).start()
    try:
        with setup_frozen():  # this process lives for one run: its setup is not scanned by every full collection
            _serve(worker, tasks, answers)
    finally:
        stop.set()
        if writer is not None:
            writer.close()


def _beat(answers: Answers, period: float, stop: threading.Event) -> None:
    """Every ``period``, a beat to the main process if this process's training moved meanwhile (a stuck training
    sends none: the main process's ``sim/worker_watch.py`` then ends the run)."""
    last = PROGRESS.steps
    while not stop.wait(period):
        if PROGRESS.steps != last:
            last = PROGRESS.steps
            try:
                answers.send_header({"beat": True})
            except OSError:  # the main process is gone
                return


def _ring_writer(ring: tuple[str, int, Any] | None) -> RingWriter | None:
    """The worker's side of its result ring; ``None`` (results by pipe, logged) where it cannot be opened."""
    if ring is None:
        return None
    try:
        return RingWriter(*ring)
    except (OSError, ValueError) as exc:
        log.warning("sim worker: results through the pipe, the result ring cannot be opened: %s", exc)
        return None


class Answers:
    """Sends a worker's results: each through its ring where it fits (its place through the pipe), else the pipe;
    ``checked``: its floats are finite (:func:`answer`)."""

    def __init__(self, conn: Any, ring: RingWriter | None) -> None:
        self.conn, self.ring = conn, ring
        self._lock = threading.Lock()  # results and beats share the pipe

    def send(self, task_id: Any, parts: Parts, error: str) -> None:
        """A result: in the ring with :data:`~protocols.wire.envelope.ENVELOPE_ROOM` before it (the main process
        frames its message there, without copying it), else through the pipe."""
        where = self.ring.put(parts, ENVELOPE_ROOM) if self.ring is not None and parts else None
        header = {"id": task_id, "error": error, "checked": not error}
        if where is not None:
            data = frame({**header, "ring": list(where), "room": ENVELOPE_ROOM})
        else:
            data = frame(header, parts)
        with self._lock:
            self.conn.send_bytes(data)

    def send_header(self, header: dict[str, Any]) -> None:
        """A frame of ``header`` alone (``ready``, ``beat``)."""
        data = frame(header)
        with self._lock:
            self.conn.send_bytes(data)


def _send_item(answers: Answers, ids: list[Any], i: int, parts: Parts, error: str) -> None:
    answers.send(ids[i], parts, error)


def _serve(worker: DeviceWorker, tasks: Any, answers: Answers) -> None:
    """Answer tasks until told to stop (or the main process is gone)."""
    while True:
        try:
            header, body = unframe(tasks.recv_bytes())
        except EOFError:
            return
        if header.get("stop"):
            return
        if "batch" in header:  # engine = cohort: a round's tasks for this worker, each answered once trained
            ids = [item["id"] for item in header["batch"]]
            worker.train_many(batch_items(header, body), functools.partial(_send_item, answers, ids))
            continue
        parts, error = worker.train_parts(header["ctx"], body)
        answers.send(header["id"], parts, error)
