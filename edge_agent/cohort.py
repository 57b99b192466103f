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
:class:`~protocols.cohort_trainer.CohortDeviceTrainer`; whenever every device of the cohort is
waiting on a compute primitive (or done), the primitives are answered together, vectorized over the
devices (:class:`~protocols.cohort_trainer.CohortEngine`). The greenlets take turns in a fixed order
(no threads), so each device's random draws are its own, as on the per-device path. Completions
run in submission order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import greenlet

from protocols.algorithms.base import DeviceContext, ModelSpec
from protocols.cohort_trainer import CohortDeviceTrainer, CohortEngine, NotVectorizable, Request
from protocols.config import ConfigError
from protocols.torch_trainer import TorchTrainer
from protocols.wire.payload import Payload

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


def cohorts(items: Sequence[Any], device: Callable[[Any], str], size: int) -> list[list[Any]]:
    """``items`` (queued tasks) cut into cohorts of at most ``size``, in order, a device at most once
    per cohort (a device's later task waits for the next cohort)."""
    out: list[list[Any]] = []
    items = list(items)
    while items:
        chunk, seen, rest = [], set(), []
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
        agents: Mapping[str, Any],
        spec: ModelSpec,
        loop: Loop,
        cohort_size: int,
        device: str = "cpu",
        threads: int = 1,
    ) -> None:
        self.agents, self.spec, self.loop, self.cohort_size = agents, spec, loop, cohort_size
        self.engine = cohort_engine(spec, device, threads)
        self.queue: list[tuple[Any, Payload, DeviceContext, Callable[[Callable[[], None]], None], Done]] = []
        self.cohorts = 0  # cohorts trained (progress and tests)
        self.seconds = 0.0  # wall seconds spent training them (each cohort once, not per device)
        self.sizes: dict[str, list[int]] = {}  # device -> the size of each cohort it trained in
        loop.on_idle = self.flush

    def submit(self, device: str, task: Payload, ctx: DeviceContext, done: Done) -> None:
        self.queue.append((self.agents[device], task, ctx, self.loop.hold(), done))

    def flush(self) -> None:
        """Train the queued tasks of forward-only devices one by one, then the oldest cohort of at most
        ``cohort_size`` (a device at most once per cohort); the rest waits for the loop's next idle."""
        if not self.queue:
            return
        queue = self.queue
        for agent, task, ctx, complete, done in queue:
            if not isinstance(agent.trainer, TorchTrainer):  # forward-only (onnx) devices train as they are
                outcome = agent.train_here(task, ctx)
                complete(lambda done=done, outcome=outcome: done(*outcome))
        queue = [item for item in queue if isinstance(item[0].trainer, TorchTrainer)]
        if not queue:
            self.queue = []
            return
        chunk, *rest = cohorts(queue, lambda item: item[0].device, self.cohort_size)
        self.queue = [item for later in rest for item in later]
        jobs = [self._job(agent, task, ctx) for agent, task, ctx, _, _ in chunk]
        start = time.perf_counter()
        try:
            outcomes = run_cohort(self.engine, self.spec, jobs, [agent.device for agent, *_ in chunk])
        finally:
            self.engine.forget_data()
            self.seconds += time.perf_counter() - start
        self.cohorts += 1
        for agent, *_ in chunk:
            self.sizes.setdefault(agent.device, []).append(len(chunk))
        for (_, _, _, complete, done), (result, error) in zip(chunk, outcomes):
            complete(lambda done=done, result=result, error=error: done(result, error))

    @staticmethod
    def _job(agent: Any, task: Payload, ctx: DeviceContext) -> Job:
        return lambda trainer: agent.role.train(task, agent.data, trainer, ctx)

    def close(self) -> None:
        self.loop.on_idle = None
