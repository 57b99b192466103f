"""The cohort engine (``runtime.engine = "cohort"``): the devices whose tasks are queued train as one
batched model. It serves ``fedtier sim`` (on its :class:`~protocols.transport.memory.VirtualLoop`)
and each agent worker process of ``fedtier run`` (on its agents'
:class:`~protocols.transport.threadloop.ThreadLoop`).

Agents, cells and the cloud run exactly as with the per-device engine: each device decodes (and
verifies) its own task and frames (and signs) its own result, so messages, byte counts, records,
deadlines and the virtual clock are unchanged. Only *where* a device role's ``train`` computes
differs: :class:`CohortExecutor` queues the submitted tasks (each registered with the loop's
``hold()``: in simulation, virtual time stands still), and whenever the loop has nothing else to do
(its ``on_idle`` hook) it trains the oldest queued tasks as one cohort of at most
``runtime.cohort_size``. Whatever arrives meanwhile forms the next cohort (group commit: no added
latency when the loop is idle, large cohorts when it is busy).

In a cohort every device role runs its unchanged ``train`` in a greenlet of its own with a
:class:`~protocols.cohort_device.CohortDeviceTrainer`; whenever every device of the cohort is
waiting on a compute primitive (or done), the primitives are answered together, vectorized over the
devices (:class:`~protocols.cohort_trainer.CohortEngine`). The greenlets take turns in a fixed order
(no threads), so each device's random draws are its own, as on the per-device path. Completions
run in submission order.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import greenlet

from protocols.algorithms.base import DeviceContext, ModelSpec, train_role
from protocols.cohort_device import CohortDeviceTrainer, Request
from protocols.cohort_kernels import NotVectorizable
from protocols.cohort_trainer import CohortEngine
from protocols.config import ConfigError
from protocols.execution import ExecutionPlan
from protocols.trainer import Trainer
from protocols.wire.messenger import Received
from protocols.wire.payload import Payload

from .agent import Trainee

log = logging.getLogger("fedtier.cohort")

Done = Callable[[Payload | None, str | None], None]
Job = Callable[[CohortDeviceTrainer], Payload]
Outcome = tuple[Payload | None, str | None]


def run_cohort(engine: CohortEngine, spec: ModelSpec, jobs: Sequence[Job], names: Sequence[str] = ()) -> list[Outcome]:
    """Run ``jobs`` (one device's ``train`` each, given its trainer) in lockstep; ``(result, None)`` or
    ``(None, error)`` per job, in order. A job that raises fails alone, as on the per-device path.

    Each job runs in a greenlet; a compute call switches back here with its request, and once every
    job is waiting (or done) the requests are answered together and the jobs resumed in order."""
    main = greenlet.getcurrent()
    outcomes: list[Outcome] = [(None, "not run")] * len(jobs)

    def call(req: Request | list[Request]) -> Any:
        reqs = req if isinstance(req, list) else [req]
        main.switch(reqs)  # resumed once the cohort's requests are answered
        for r in reqs:
            if isinstance(r.result, BaseException):
                raise r.result
        return [r.result for r in reqs] if isinstance(req, list) else req.result

    def body(i: int) -> None:
        try:
            outcomes[i] = (jobs[i](CohortDeviceTrainer(spec, call)), None)
        except Exception as exc:  # a bad task must not kill the device
            log.exception("device %s failed in its cohort", names[i] if i < len(names) else i)
            outcomes[i] = (None, str(exc))

    lets = [greenlet.greenlet(lambda i=i: body(i)) for i in range(len(jobs))]
    pending = {i: reqs for i, g in enumerate(lets) if (reqs := g.switch()) is not None}
    while pending:
        _answer(engine, [r for reqs in pending.values() for r in reqs])
        answered, pending = pending, {}
        for i in answered:
            following = lets[i].switch()
            if following is not None:
                pending[i] = following
    return outcomes


def cohort_engine(spec: ModelSpec, device: str = "cpu", threads: int = 1) -> CohortEngine:
    """A :class:`CohortEngine` for ``spec``; a model it cannot vectorize is refused here, before the run
    starts (:class:`ConfigError` naming the layer)."""
    engine = CohortEngine(device, threads=threads)
    try:
        engine.model(spec)
    except NotVectorizable as exc:
        raise ConfigError(f"runtime.engine: {exc}") from None
    return engine


class CohortRunner:
    """The one cohort loop of both executors: trains device jobs as cohorts of at most ``size`` (a device
    at most once per cohort) on one :class:`CohortEngine`, and counts what it trained.

    :class:`CohortExecutor` (``fedtier sim`` in one process, ``fedtier run``'s agent workers) trains one
    cohort per idle turn of its loop; ``sim.executors.DeviceWorker`` trains a worker's whole batch."""

    def __init__(self, spec: ModelSpec, size: int, device: str = "cpu", threads: int = 1) -> None:
        self.spec, self.size = spec, size
        self.engine = cohort_engine(spec, device, threads)
        self.cohorts = 0  # cohorts trained (progress and tests)
        self.seconds = 0.0  # wall seconds spent training them (each cohort once, not per device)
        self.sizes: dict[str, list[int]] = {}  # device -> the size of each cohort it trained in

    def split(self, items: Sequence[Any], device: Callable[[Any], str]) -> list[list[Any]]:
        """``items`` cut into this runner's cohorts (see :func:`cohorts`)."""
        return cohorts(items, device, self.size)

    def train(self, devices: Sequence[str], jobs: Sequence[Job]) -> list[Outcome]:
        """Train one cohort: ``jobs[i]`` is device ``devices[i]``'s ``train``; an outcome per job, in order."""
        start = time.perf_counter()
        try:
            outcomes = run_cohort(self.engine, self.spec, jobs, devices)
        finally:
            self.engine.forget_data()
            self.seconds += time.perf_counter() - start
        self.cohorts += 1
        for d in devices:
            self.sizes.setdefault(d, []).append(len(devices))
        return outcomes


def make_cohort_executor(
    plan: ExecutionPlan, agents: Mapping[str, Trainee], spec: ModelSpec, loop: Loop, trainer: Trainer
) -> CohortExecutor | None:
    """The executor of an agent process under ``plan``: a :class:`CohortExecutor` when the plan asks for
    cohorts and ``trainer`` can train in them, else ``None`` (each device trains as its task comes)."""
    if not plan.batches(trainer):
        return None
    return CohortExecutor(agents, spec, loop, plan.cohort_size, plan.device, plan.threads)


def cohorts(items: Sequence[Any], device: Callable[[Any], str], size: int) -> list[list[Any]]:
    """``items`` (queued tasks) cut into cohorts of at most ``size``, in order, a device at most once
    per cohort (a device's later task waits for the next cohort)."""
    out: list[list[Any]] = []
    items = list(items)
    while items:
        chunk: list[Any] = []
        seen: set[str] = set()
        rest: list[Any] = []
        for item in items:
            if len(chunk) < size and device(item) not in seen:
                chunk.append(item)
                seen.add(device(item))
            else:
                rest.append(item)
        out.append(chunk)
        items = rest
    return out


def _answer(engine: CohortEngine, reqs: list[Request]) -> None:
    """Answer the requests together; if that fails, one by one, so that only a bad one fails."""
    try:
        engine.run(reqs)
        return
    except Exception as exc:
        if len(reqs) == 1:
            reqs[0].result = exc
            return
    for r in reqs:
        try:
            engine.run([r])
        except Exception as exc:
            r.result = exc


def _complete_together(queue: Sequence[Any], chunk: Sequence[Any], outcomes: Sequence[Outcome]) -> None:
    """Complete a trained cohort's tasks: each run of them that were queued one after the other (all of them,
    unless a device's second task waits for the next cohort) completes in one turn of the loop, in order, in the
    first one's hold (the others' complete with nothing). Their results then leave together and reach their cell
    one after the other before anything else runs, as one batch (its waiting record: once for them all,
    ``CellServer._on_result``), rather than each after the cell took the one before."""
    trained = {id(item): (item[4], result, error) for item, (result, error) in zip(chunk, outcomes)}
    run: list[tuple[Done, Payload | None, str | None]] = []
    first: Callable[[Callable[[], None]], None] | None = None
    for item in [*queue, None]:
        got = trained.get(id(item)) if item is not None else None
        if got is not None:
            if first is None:
                first = item[3]
            else:
                item[3](_nothing)
            run.append(got)
        elif first is not None:
            first(functools.partial(_each, run))
            run, first = [], None


def _each(dones: list[tuple[Done, Payload | None, str | None]]) -> None:
    """Hand each device its outcome, in order; one whose handling raises keeps none after it from theirs (as each one's
    own turn did not), and its error, the first, is the loop's once all were handed (logged or fatal, as it says)."""
    failed: Exception | None = None
    for done, result, error in dones:
        try:
            done(result, error)
        except Exception as exc:
            failed = failed or exc
    if failed is not None:
        raise failed


def _nothing() -> None:
    pass


def _train_sealed(agent: Trainee, task: Payload, ctx: DeviceContext, trainer: CohortDeviceTrainer) -> Payload:
    """A device's ``train`` in its cohort, its result sealed as soon as its role returned it
    (``WireRecord.seal``: read-only, each float checked finite once, its sums of squares kept), while the delta it just
    wrote is still in the core's cache: sealed where its agent takes it (``DeviceAgent._trained``, which seals what is
    not sealed yet), the next devices' deltas had pushed it out and the check read 800 KB from memory. No role code
    runs between the two: the same bytes, the same check."""
    result = train_role(agent.role, task, agent.data, trainer, ctx)
    if result.headroom is not None:
        result.headroom.seal(result)
    return result


class Loop(Protocol):
    """What the executor needs of an event loop (``VirtualLoop`` and ``ThreadLoop`` both have it)."""

    on_idle: Callable[[], None] | None

    def hold(self) -> Callable[[Callable[[], None]], None]: ...


class CohortExecutor:
    """Queues device tasks and trains them as cohorts when the loop is idle (see the module).

    ``agents``: device id -> its agent (``role``, ``data``, ``trainer``, ``device``, ``train_here``);
    a forward-only (onnx) agent trains as it is. Refuses (``ConfigError``) a model the cohort engine
    cannot vectorize."""

    def __init__(
        self,
        agents: Mapping[str, Trainee],
        spec: ModelSpec,
        loop: Loop,
        cohort_size: int,
        device: str = "cpu",
        threads: int = 1,
    ) -> None:
        self.agents, self.spec, self.loop = agents, spec, loop
        self.runner = CohortRunner(spec, cohort_size, device, threads)
        self.queue: list[tuple[Any, Payload, DeviceContext, Callable[[Callable[[], None]], None], Done]] = []
        loop.on_idle = self.flush

    @property
    def engine(self) -> CohortEngine:
        """The engine the cohorts run on."""
        return self.runner.engine

    @property
    def cohorts(self) -> int:
        """Cohorts trained so far."""
        return self.runner.cohorts

    @property
    def seconds(self) -> float:
        """Wall seconds spent training cohorts (each cohort once, not per device)."""
        return self.runner.seconds

    @property
    def sizes(self) -> dict[str, list[int]]:
        """Device -> the size of each cohort it trained in."""
        return self.runner.sizes

    def submit(self, device: str, task: Payload, ctx: DeviceContext, done: Done, wire: Received | None = None) -> None:
        self.queue.append((self.agents[device], task, ctx, self.loop.hold(), done))

    def flush(self) -> None:
        """Train the queued tasks of forward-only devices one by one, then the oldest cohort of at most
        ``cohort_size`` (a device at most once per cohort); the rest waits for the loop's next idle."""
        if not self.queue:
            return
        queue = self.queue
        for agent, task, ctx, complete, done in queue:
            if not agent.trainer.trains_in_cohorts:  # forward-only (onnx) devices train as they are
                outcome = agent.train_here(task, ctx)
                complete(functools.partial(done, *outcome))
        queue = [item for item in queue if item[0].trainer.trains_in_cohorts]
        if not queue:
            self.queue = []
            return
        chunk, *rest = self.runner.split(queue, lambda item: item[0].device)
        self.queue = [item for later in rest for item in later]
        jobs = [self._job(agent, task, ctx) for agent, task, ctx, _, _ in chunk]
        outcomes = self.runner.train([agent.device for agent, *_ in chunk], jobs)
        _complete_together(queue, chunk, outcomes)

    @staticmethod
    def _job(agent: Trainee, task: Payload, ctx: DeviceContext) -> Job:
        return functools.partial(_train_sealed, agent, task, ctx)

    def close(self) -> None:
        self.loop.on_idle = None
