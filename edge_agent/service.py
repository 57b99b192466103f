"""The long-lived agents of a federation's devices (one, ``fedtier agent --serve``, or many in one
process): they answer one job after another, each with the config the cloud published for it
(``protocols.jobs``), until SIGTERM. Between jobs one clean connection (the first device's) learns the
next job; during a job, an :class:`AgentProcess` of all the devices, pinned to the job's session, does
the work."""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from protocols.config import RunConfig, public_reason
from protocols.failures import MAX_REASON
from protocols.job_watch import JobWatch
from protocols.joblog import say_ended, say_taken
from protocols.jobs import CurrentJob, JobError, say_cannot_serve
from protocols.roster import Roster
from protocols.session import EndedJobs
from protocols.status import idle_each_while
from protocols.transport.base import Transport
from protocols.transport.threadloop import ThreadLoop
from protocols.twin import NodeTwin
from protocols.wire import topics
from protocols.wire.keys import Trust

from .runner import AgentProcess

log = logging.getLogger("fedtier.agent.service")
T = TypeVar("T")


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
        idle: dict[str, Trust | None] | None = None,
        twin_window: float | None = None,
    ) -> None:
        """``idle``: the devices whose idle status the watch connection says before their first job, each signed by
        its own identity (default: the first device's, ``trust``; ``fedtier run``'s agents: every device on that
        connection's broker). ``twin_window``: the first watch connection refuses to start if another agent process
        is live under the first device's id (``protocols.twin.NodeTwin``; ``fedtier agent --serve``)."""
        self.bundle, self.devices, self.loop, self.watch, self.build, self.trust = (
            bundle,
            devices,
            loop,
            watch,
            build,
            trust,
        )
        self.idle = idle if idle is not None else {devices[0]: trust}
        fed, cell = bundle.run.name, bundle.topology.cell_of(devices[0])
        status = topics.device_status(fed, cell, devices[0]) if cell is not None else None
        window = twin_window if status is not None else None
        self.twin = NodeTwin(fed, devices[0], "agent", window, trust, topic=status, noun="device")  # its instance
        self.stopping = threading.Event()
        self.served: list[str] = []
        self.tasks = 0
        self.stopped_during: str | None = None  # the job it was stopped during (SIGTERM mid-job), if it was
        self.agents: AgentProcess | None = None
        self.unfit: dict[str, str] | None = None  # the latest job they could not serve, and why (idle statuses)
        self.roster: Roster | None = None  # the newest signed roster known: tells one enrolled since from a wrong id
        self.revoked: str | None = None  # why it stopped: a roster revoked its devices (the node exits 2: no restart)
        self.revoked_during: str | None = None  # the job it was serving then, if it was
        self.on_job_end: Callable[[str], None] | None = None  # called after each job served (benchmarks)
        self.on_start: Callable[[AgentProcess], None] | None = None  # called once its agents started
        self.only_job: str | None = None  # the one job it serves (a `fedtier run` worker's): it stops once that ended

    def stop(self) -> None:
        """Stop serving (SIGTERM): the job's poll ends at once. Its agents' ``done`` says only that their job ended (it
        was set here too, so a job stopped mid-way counted as served)."""
        self.stopping.set()
        self.loop.post(lambda: None)

    def serve(self) -> None:
        """Serve jobs until :meth:`stop`. The first job is learnt on a clean watch connection; then the
        devices stay connected (a long-lived :class:`AgentProcess`) and learn each next job from the cloud's
        job record on the first device's connection."""
        done: set[str] = set()
        records = JobWatch(None, self.bundle.run.name, self.trust)  # fed by the agents' first connection
        agents: AgentProcess | None = None
        try:
            while not self.stopping.is_set() and self.revoked is None:
                if agents is None:
                    transport = self.watch()
                    if transport is None:  # stopped while the broker was unreachable
                        break
                    current = self._first_job(transport, done)
                else:
                    current = self._poll(lambda: records.pending(done))
                    self.roster = agents.job.roster or self.roster
                if current is None:
                    break
                try:
                    job_cfg = current.run_config(self.bundle, self.devices, self.roster)
                    fresh = self.build(job_cfg, current.session)
                except (JobError, ValueError) as exc:  # cannot serve it: absent from this job, with the reason
                    self._cannot_serve(current, exc, agents)
                    done.add(current.session)
                    continue
                self._taken(current.job, job_cfg)
                if agents is None:
                    agents = self._first_process(fresh, done)
                    agents.on_job_record = records.on_job
                    agents.start()
                    if self.on_start is not None:
                        self.on_start(agents)
                else:  # the same connections, the next job's roles
                    agents.next_job(
                        fresh.cfg,
                        fresh.algorithm,
                        fresh.trainer,
                        current.session,
                        fresh.records.availability,
                        data=fresh.data,  # as this job's model takes it
                    )
                    fresh.discard()  # its parts serve on the same connections: its own sockets close now
                del fresh  # the last job's parts (replaced) and this spare are garbage in reference cycles: freed now,
                gc.collect()  # not after ~10 more jobs (their arrays are native memory: few objects, rare collections)
                moved_on = partial(records.left, current)  # (its end missed: the next job's record, or it cleared)
                self._poll(lambda: agents.done.is_set() or moved_on() or None)  # noqa: B023
                if self.revoked is not None:  # revoked mid-job: it takes no more part in it
                    self._left_during(current, agents)
                    break
                if self.stopping.is_set() and not (agents.done.is_set() or moved_on()):  # stopped mid-job (a job that
                    self._left_during(current, agents)  # ended before the stop, seen or not by the poll's last
                    break  # look, was served: counted below)
                done.add(current.session)
                self._served(current.job, agents)
        finally:
            self.agents = None
            if agents is not None:
                agents.stop()

    def _first_process(self, fresh: AgentProcess, done: set[str]) -> AgentProcess:
        """``fresh``, the process that serves this service's jobs from now on: this process's instance, and the jobs
        ``done`` with (a task of one a broker hands back again is an old copy, ``protocols.session.EndedJobs``)."""
        fresh.twins.instance = fresh.links.instance = self.twin.instance  # one instance, the process's
        fresh.job.past_jobs = EndedJobs(done)
        self.agents = fresh
        return fresh

    @property
    def who(self) -> str:
        """How its lines name these devices: ``device c0-d0``, ``devices c0-d0, c0-d1, c0-d2, ...``."""
        more = ", ..." if len(self.devices) > 3 else ""
        return f"device{'s' if len(self.devices) > 1 else ''} {', '.join(self.devices[:3])}{more}"

    def _taken(self, job: str, cfg: RunConfig) -> None:
        """These devices serve ``job`` (of config ``cfg``): no more unfit for one (their idle statuses), and said."""
        self.unfit = None
        say_taken(self.who, job, cfg.run.rounds)

    def _served(self, job: str, agents: AgentProcess) -> None:
        """Count the tasks ``agents`` answered in ``job`` and say it ended for these devices (they know it ended,
        seen by its end or the cloud's next job, not how: the cloud's line says)."""
        self.served.append(job)
        answered = sum(s["tasks"] for s in agents.stats().values())
        self.tasks += answered
        say_ended(self.who, job, f"ended ({answered} tasks answered)")
        if self.on_job_end is not None:
            self.on_job_end(job)

    def _left_during(self, current: CurrentJob, agents: AgentProcess) -> None:
        """Revoked, or stopped (SIGTERM), while serving ``current``: the tasks answered in it count (it said "served 0
        jobs, 0 tasks" of a device that had answered 50 of that job's), and the job is named as it stops."""
        self.tasks += agents.tasks_answered(current.session)
        if self.revoked is not None:
            self.revoked_during = current.job
        else:
            self.stopped_during = current.job

    def _cannot_serve(self, current: CurrentJob, exc: Exception, agents: AgentProcess | None) -> None:
        """Say why these devices cannot serve ``current`` (in full in their log), and put it in their idle statuses
        (``agents``, once they run), so the job's cells do not wait for them. What the statuses say of a file the
        job names is only its setting (``public_reason``): the job's signer learns no more of this device's files."""
        say_cannot_serve(self.who, current.job, exc)  # walked: 'devices c0-d2 cannot serve' of one device
        self.unfit = {"session": current.session, "reason": public_reason(exc)[:MAX_REASON]}
        if agents is not None:
            agents.cannot_serve(**self.unfit)

    def revoked_by(self, roster: Roster | None) -> bool:
        """Whether ``roster`` (the newest these devices' connections verified) revoked every one of them; then
        :attr:`revoked` says so: the broker dropped their logins and the cells refuse their messages, so the service
        stops rather than serve, or wait for, jobs it can no longer take part in (and ``fedtier agent --serve``
        exits 2 saying why: ``protocols.roster.NodeRevoked``)."""
        if self.revoked is None and roster is not None and all(d in roster.revoked for d in self.devices):
            self.revoked = (
                f"{self.who} revoked from federation {self.bundle.run.name!r} (signed roster version "
                f"{roster.version}): it takes part in no job from now on; stopping (a revoked id is never reused: "
                "enroll the device again under a new id, `fedtier provision add-device`)"
            )
        return self.revoked is not None

    def _newest_roster(self) -> Roster | None:
        """The newest roster its running devices' connections verified (their job's view of it)."""
        agents = self.agents
        return agents.job.roster if agents is not None else None

    def _poll(self, ready: Callable[[], T | None]) -> T | None:
        """``ready()``'s first value that is not None, checked every 0.2 s (``None``: stopped, or revoked)."""
        while not self.stopping.is_set() and not self.revoked_by(self._newest_roster()):
            value = ready()
            if value is not None:
                return value
            self.stopping.wait(0.2)
        return None

    def _next_job(self, watch: JobWatch, done: set[str]) -> CurrentJob | None:
        """Wait for a job this device has yet to serve (``None``: stopped)."""
        stop = lambda: self.stopping.is_set() or self.revoked_by(watch.roster) or self._only_job_ended(watch)  # noqa: E731
        self.loop.run(until=lambda: stop() or watch.pending(done) is not None)
        return None if stop() else watch.pending(done)

    def _only_job_ended(self, watch: JobWatch) -> bool:
        """Whether the one job this service serves (:attr:`only_job`) ended before it took it: a `fedtier run` whose
        job ended at once (resumed with no round left) started its workers after the end; they waited for ever."""
        job = self.only_job
        return job is not None and any(session.startswith(f"{job}.") for session in watch.finished)

    def _first_job(self, transport: Transport, done: set[str]) -> CurrentJob | None:
        """On the watch connection (the first device's): say the devices idle (:attr:`idle`), wait for a job
        (``None``: stopped, the devices said offline), close."""
        fed, topo = self.bundle.run.name, self.bundle.topology
        self.twin.guard(transport, self.loop)  # TwinError: another agent process is live under the first device's id
        watch = JobWatch(transport, fed, self.trust, *done)
        wait = partial(self._next_job, watch, done)
        period = self.bundle.monitoring.idle_heartbeat
        unfit = {"unfit": self.unfit} if self.unfit is not None else {}  # the job it could not serve, and why
        statuses = [
            (topics.device_status(fed, cell, device), trust, {"cell": cell, **unfit, **self.twin.extra})
            for device, trust in self.idle.items()
            if (cell := topo.cell_of(device)) is not None
        ]
        current = idle_each_while(self.loop, transport, statuses, period, wait)
        transport.close()
        self.roster = watch.roster or self.roster
        return current
