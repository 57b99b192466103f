"""The long-lived agents of a federation's devices (one, ``fedtier agent --serve``, or many in one
process): they answer one job after another, each with the config the cloud published for it
(``protocols.jobs``), until SIGTERM. Between jobs one clean connection (the first device's) learns the
next job; during a job, an :class:`AgentProcess` of all the devices, pinned to the job's session, does
the work."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from protocols.config import RunConfig
from protocols.jobs import CurrentJob, JobError, JobWatch
from protocols.transport.base import Transport
from protocols.transport.threadloop import ThreadLoop
from protocols.wire.keys import Trust

from .runner import AgentProcess

log = logging.getLogger("fedtier.agent.service")


class AgentService:
    """``watch()`` returns a connected transport on ``loop`` for reading the job (a clean session);
    ``build(cfg, session)`` an (unstarted) :class:`AgentProcess` of ``devices`` for a job's (localized)
    config."""

    def __init__(
        self,
        bundle: RunConfig,
        devices: list[str],
        loop: ThreadLoop,
        watch: Callable[[], Transport | None],
        build: Callable[[RunConfig, str], AgentProcess],
        trust: Trust | None,
    ) -> None:
        self.bundle, self.devices, self.loop, self.watch, self.build, self.trust = (
            bundle,
            devices,
            loop,
            watch,
            build,
            trust,
        )
        self.stopping = threading.Event()
        self.served: list[str] = []
        self.tasks = 0
        self.agents: AgentProcess | None = None
        self.on_job_end: Callable[[str], None] | None = None  # called after each job served (benchmarks)

    def stop(self) -> None:
        self.stopping.set()
        self.loop.post(lambda: None)
        agents = self.agents
        if agents is not None:
            agents.done.set()

    def serve(self) -> None:
        """Serve jobs until :meth:`stop`."""
        done: set[str] = set()
        fed = self.bundle.run.name
        while not self.stopping.is_set():
            transport = self.watch()
            if transport is None:  # stopped while the broker was unreachable
                break
            current = self._next_job(JobWatch(transport, fed, self.trust), done)
            transport.close()
            if current is None:
                break
            try:
                agents = self.build(current.run_config(self.bundle, self.devices), current.session)
            except (JobError, ValueError) as exc:  # cannot serve it: absent from this job, with the reason
                log.error("devices %s cannot serve job %s: %s", ", ".join(self.devices[:3]), current.job, exc)
                done.add(current.session)
                continue
            log.info("%d devices serve job %s", len(self.devices), current.job)
            self.agents = agents
            try:
                agents.start()
                while not agents.done.wait(0.5) and not self.stopping.is_set():
                    pass
            finally:
                self.agents = None
                agents.stop()
            if not self.stopping.is_set():
                done.add(current.session)
                self.served.append(current.job)
                self.tasks += sum(s["tasks"] for s in agents.stats().values())
                if self.on_job_end is not None:
                    self.on_job_end(current.job)

    def _next_job(self, watch: JobWatch, done: set[str]) -> CurrentJob | None:
        """Wait for a job this device has yet to serve (``None``: stopped)."""
        self.loop.run(until=lambda: self.stopping.is_set() or watch.pending(done) is not None)
        return None if self.stopping.is_set() else watch.pending(done)
