"""Device agents on MQTT, as a process runs them: ``fedtier agent`` on a device, and each worker of
``fedtier run`` for its share of the emulated devices.

Every device keeps its own connection and client id (its will marks it offline), announces itself
online (retained), sends a heartbeat every ``heartbeat`` seconds, answers its tasks, and leaves when
the cloud publishes the retained ``finished`` control record of its current session. With churn, a
device that does not take part in a round really disconnects and comes back for the rounds it takes
part in. The devices of one process share one event loop (their training runs there, one at a
time), one trainer and one I/O thread (:mod:`edge_agent.connections`): a device costs a socket, not a
thread. Heartbeats, keepalives and reconnects are timers of the I/O thread, so a long training step
never silences them. With ``runtime.engine = "cohort"`` the devices' tasks are queued and trained
together as cohorts whenever the loop is idle (``edge_agent/cohort.py``). torch is imported only by
the torch backend (:mod:`edge_agent.backends`).

How a node reaches the broker lives in :mod:`edge_agent.broker`, a device's data files in
:mod:`edge_agent.datasources`; their names are re-exported here for the commands that start agents.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from protocols.algorithms.base import Algorithm
from protocols.config import RunConfig
from protocols.execution import execution_plan
from protocols.roster import roster_topic
from protocols.session import CloudSession
from protocols.status import IDLE
from protocols.trainer import LocalData, Trainer
from protocols.transport.base import TimerHandle
from protocols.transport.mqtt import MqttTransport
from protocols.twin import TwinError, TwinWatch, new_instance
from protocols.wire import topics
from protocols.wire.messenger import Messenger

from .agent import DeviceAgent
from .backends import BACKENDS, make_trainer
from .broker import BrokerOptions, client_id, device_will, offline_will
from .cloud_records import CloudRecords
from .connections import DeviceConnections, merge_wire
from .datasources import load_device_data, save_device_data
from .node import build_agent, cell_of
from .process_state import JobView, Presence, TrainClock
from .secagg import cell_lies, learn_roster

if TYPE_CHECKING:
    from .cohort import CohortExecutor

__all__ = [
    "BACKENDS",
    "AgentProcess",
    "BrokerOptions",
    "client_id",
    "device_will",
    "load_device_data",
    "make_trainer",
    "merge_wire",
    "offline_will",
    "save_device_data",
]

log = logging.getLogger("fedtier.agent")


class AgentProcess:
    """The device agents of one process: connect, announce, heartbeat, answer tasks, leave on ``finished``.

    ``on_task(device, round, edge_round)`` is called before a device trains (fault injection in tests);
    with ``timing``, every training is timed (``stats()[device]["compute"]``: ``[round, edge_round,
    start, end]`` on the system-wide monotonic clock, comparable across processes of one machine).

    ``availability(round) -> devices that take part in that cloud round`` turns on churn: a device sits out
    the rounds it does not take part in, disconnected, and polls back (:mod:`edge_agent.cloud_records`).
    A device's connections share its client id; ``stats()`` counts them (``connections``) and sums their
    wire counters. Cloud records (manifest, ``finished``) count
    only when they belong to the cloud's current session (``protocols.session``). ``cell_brokers``
    maps a cell to the broker of its devices (a broker per cell); other devices use ``broker``.
    """

    def __init__(
        self,
        cfg: RunConfig,
        algorithm: Algorithm,
        data: dict[str, LocalData],
        trainer: Trainer,
        broker: BrokerOptions,
        *,
        heartbeat: float | None = None,
        on_task: Callable[[str, int, int], None] | None = None,
        timing: bool = False,
        availability: Callable[[int], Iterable[str]] | None = None,
        rejoin_poll: float | None = None,
        cell_brokers: dict[str, BrokerOptions] | None = None,
        session: str | None = None,
        long_lived: bool = False,
        twin_window: float | None = None,
    ) -> None:
        """``twin_window``: before announcing, listen that long on the devices' own status topics and refuse
        to start (:class:`~protocols.twin.TwinError`) if another agent process is live under one of
        their ids (``protocols/twin.py``; deployed agents: one heartbeat and a second; ``None``: no check).
        ``session``: serving one job, only its cloud session counts (``protocols.jobs``). ``long_lived``:
        at the job's end the devices stay connected, announced idle (``done`` is set), and :meth:`next_job`
        serves the next job on the same connections; ``on_job_record`` (set before :meth:`start`) gets the
        cloud's ``cloud/job`` records, on the first device's connection."""
        self.on_job_record: Callable[[str, bytes], None] | None = None
        self.job = JobView(session, long_lived)
        self.cfg, self.algorithm, self.data, self.trainer = cfg, algorithm, data, trainer
        self.run = cfg.run.name
        self.heartbeat = cfg.runtime.heartbeat if heartbeat is None else heartbeat
        self.on_task = on_task
        self.links = DeviceConnections(cfg, broker, cell_brokers)
        self.loop = self.links.loop  # the devices' handlers and training
        self.clock = TrainClock(timing)
        self.presence = Presence()
        self._beat_timer: TimerHandle | None = None
        self._beat_lock = threading.Lock()  # the beat timer and ``_stopped``: no beat is scheduled after stop
        self._stopped = False
        self.agents: dict[str, DeviceAgent] = {}
        self.clouds: dict[str, CloudSession] = {}
        self.records = CloudRecords(
            self.clouds,
            self.agents,
            self.presence,
            self.job,
            self.links,
            cfg.runtime.rejoin_poll if rejoin_poll is None else rejoin_poll,
            leave=self._leave,
            job_done=self._job_done,
            connect=self._connect,
        )
        self.records.availability = availability
        self.records.ended_wait = cfg.runtime.startup_wait  # a one-shot device started after its job ended leaves
        self.twin_window = twin_window
        self.twins = TwinWatch(new_instance())  # this process's nonce, in every status record
        self.links.instance = self.twins.instance  # and in its devices' wills
        self._refused = False  # refused to start (a twin): already stopped, nothing announced
        self.done = threading.Event()
        self.executor: CohortExecutor | None = self._cohorts()  # cohorts (runtime.engine = "cohort"), torch only
        self.unfit: dict[str, str] | None = None  # long-lived: the job its devices cannot serve, and why

    @property
    def transports(self) -> dict[str, Any]:
        """Each device's current connection."""
        return self.links.transports

    @property
    def connections(self) -> dict[str, int]:
        """How many connections each device made."""
        return self.links.connections

    def _cohorts(self) -> CohortExecutor | None:
        """The cohort executor of the current job, if its plan batches this trainer (onnx-only agents never
        load the cohort engine, which needs torch)."""
        plan = execution_plan(self.cfg)
        if not plan.batches(self.trainer):
            return None
        from .cohort import make_cohort_executor

        return make_cohort_executor(plan, self.agents, self.algorithm.model, self.loop, self.trainer)

    def start(self, connect_timeout: float = 30.0) -> AgentProcess:
        """Connect every device (at most ``connect_window`` CONNECTs under way at once, each retried
        with jittered backoff while the broker refuses it), wait until the broker acknowledged their
        subscriptions, then announce them online. Raises ``ConnectionError`` if one cannot connect
        within ``connect_timeout``."""
        self.links.connect_timeout = connect_timeout
        self.links.reactor.start()
        self.loop.start()
        fresh: list[tuple[str, Any]] = []
        for device in self.data:
            transport = self.links.open(device)
            self.agents[device] = self._make_agent(device, transport)
            with self.presence.lock:
                self.presence.live.add(device)
            fresh.append((device, transport))
        self.twins.checking = self.twin_window is not None  # no task is taken before the check is over
        self.links.each_on_loop(fresh, self._prepare)
        if self.twins.checking:  # from the first connect: a live twin takes the sessions back as they open
            _expect_drops(fresh, "checking that no other agent process is live under this id")
            for transport in _mqtt(fresh):  # what a live twin's sessions held is left to it (twin.borrow)
                transport.defer_acks()
        self.links.connect_all(fresh, connect_timeout)
        if self.twin_window is not None:
            try:
                self._check_twins(self.twin_window)
            finally:
                _expect_drops(fresh, "")
            for transport in _mqtt(fresh):  # the sessions are this process's: what it received is taken
                transport.release_acks()
            self.links.each_on_loop(fresh, lambda d, t: self.agents[d].attach(t))  # held tasks follow
        self.links.each_on_loop(fresh, self._announce_connected)
        if self.heartbeat > 0:
            self._beat_timer = self.links.reactor.call_later(self.heartbeat, self._beat)
        if not self.agents:
            self.done.set()
        return self

    def _check_twins(self, window: float) -> None:
        """Refuse to start if another agent process is live under one of these device ids: leave a
        retained record saying so (the live one reads it when it takes its session back), disconnect
        without announcing anything, raise :class:`TwinAgentError`."""
        twin = self.twins.check(window)
        if twin is None:
            return
        device, other = twin
        refusal = TwinError.of("device", device, "agent", other)  # (said by whoever catches it: once)
        transport, agent = self.transports[device], self.agents[device]
        status = topics.device_status(self.run, agent.cell, device)
        for t in _mqtt(self.transports.items()):
            t.stay_down()  # taken back by the live agent meanwhile: not taken over once more
        self.links.on_loop(
            lambda: transport.publish(status, self.twins.refusal(status, agent.trust), qos=1, retain=True)
        )
        transport.flush(self.links.connect_timeout)
        for t in list(self.transports.values()):
            self.links.on_loop(t.close)  # a clean DISCONNECT: no will, the live agent's status stays
        self.loop.stop()
        if self.executor is not None:
            self.executor.close()
        self.links.reactor.close()
        self._refused = True
        raise refusal

    def _on_own_status(self, device: str, topic: str, data: bytes) -> None:
        """A record on the device's own status topic: another instance's means a second agent (``protocols.twin``)."""
        trust, epoch = self.agents[device].trust, getattr(self.transports.get(device), "reconnects", None)
        verify = trust.verify if trust is not None else None
        self.twins.on_status(device, topic, data, verify, lambda: self._reconnected(device), epoch)

    def _make_agent(self, device: str, transport: Any) -> DeviceAgent:
        """The device's agent for the current job (its cloud view pinned to the job's session)."""
        self.clouds[device] = CloudSession(pinned=self.job.session, past_jobs=self.job.past_jobs)
        agent = build_agent(
            self.cfg,
            device,
            transport,
            self.algorithm,
            self.data[device],
            self.trainer,
            cloud=self.clouds[device],
            keep_answer=True,
            instance=self.twins.instance,
        )
        on_task = self.on_task
        if on_task is not None:
            agent.on_task = lambda r, e: on_task(device, r, e)
        agent.role.train = self.clock.timed(  # type: ignore[method-assign]
            device, agent.role.train, batched=lambda: self.executor is not None
        )
        agent.executor = self.executor
        if self.job.roster is not None:
            learn_roster(agent, self.job.roster)
        return agent

    def _on_roster(self, trust: Any, data: bytes) -> None:
        """A roster on the federation's topic (first device's connection): a newer verified one teaches every
        device its cell's members' keys (``edge_agent.secagg.learn_roster``)."""
        roster = self.job.newer_roster(data, trust.verify, self.run)
        if roster is not None:
            for agent in list(self.agents.values()):
                learn_roster(agent, roster)

    def next_job(
        self,
        cfg: RunConfig,
        algorithm: Algorithm,
        trainer: Trainer,
        session: str,
        availability: Callable[[int], Iterable[str]] | None = None,
        data: dict[str, LocalData] | None = None,
    ) -> None:
        """Long-lived agents: serve the job of ``session`` with new roles on the same connections (a device
        that sat out the last round connects again), on ``data`` if given (the same devices' data as this
        job's model takes it); ``done`` is cleared until it is finished."""
        old = self.executor
        self.cfg, self.algorithm, self.trainer, self.job.session = cfg, algorithm, trainer, session
        if data is not None:
            self.data = {d: data[d] for d in self.data}
        self.links.cfg = cfg
        self.records.availability = availability
        self.unfit = None
        self.done.clear()
        offline: list[str] = []

        def swap() -> None:
            if old is not None:
                old.close()
            self.executor = self._cohorts()
            for device in self.data:
                transport = self.transports[device]
                transport.unsubscribe(topics.device_task(self.run, cell_of(cfg, device), device))
                agent = self.agents[device] = self._make_agent(device, transport)
                agent.attach(transport)
                cloud = self.clouds[device]
                cloud.on_status(self.job.last_status.get(device))  # the new job's cloud may have announced itself
                if device in self.job.last_manifest:
                    cloud.on_manifest(self.job.last_manifest[device])
                with self.presence.lock:
                    self.presence.live.add(device)
                if transport.connected:
                    with self.presence.lock:
                        self.presence.present.add(device)
                        agent.announce("online")
                else:
                    offline.append(device)
            if not self.data:
                self.done.set()

        self.links.on_loop(swap)
        for device in offline:
            self.links.on_loop(lambda d=device: self._connect(d, self.links.open(d), present=True))  # type: ignore[misc]
        for device in self.data:
            self.links.on_loop(lambda d=device: self.records.update(d))  # type: ignore[misc]

    def _prepare(self, device: str, transport: Any) -> None:
        """On the loop: make ``transport`` the device's connection and register its subscriptions
        (sent with the CONNECT's first CONNACK)."""
        agent, run = self.agents[device], self.run
        if not self.twins.checking:
            agent.attach(transport)
        if self.twin_window is not None:  # its own status: who else announces under this id
            transport.subscribe(
                topics.device_status(run, agent.cell, device), lambda t, b: self._on_own_status(device, t, b)
            )
        control = Messenger(transport, run, device, trust=agent.trust)
        transport.subscribe(topics.control(run), lambda t, b: self.records.on_control(device, control, t, b))
        transport.subscribe(topics.status(run, "cloud"), lambda t, b: self.records.on_cloud_status(device, t, b))
        transport.subscribe(topics.round_manifest(run), lambda t, b: self.records.on_manifest(device, t, b))
        if self.on_job_record is not None and device == next(iter(self.data)):
            transport.subscribe(topics.current_job(run), self.on_job_record)
        if self.job.long_lived and agent.trust is not None and device == next(iter(self.data)):
            transport.subscribe(roster_topic(run), lambda t, b: self._on_roster(agent.trust, b))
        self.links.adopt(device, transport)
        self.presence.fresh.discard(device)
        transport.on_reconnected = lambda: self._reconnected(device)

    def _reconnected(self, device: str) -> None:
        """On the I/O thread: a present device's connection came back. The broker may have lost what it held for it or
        took from it (no session: expired while it was away, or a broker restarted before its autosave; or a session
        restored from a broker's last autosave, without what came since): announce it online anew at once (QoS 1,
        after its subscriptions), so its cell, if it waits for its result, re-sends its task (at most 3 times an edge
        round), which the device trains or answers again. Its last record repeated was a heartbeat to the cell, no
        return: the edge round waited out its device deadline."""
        with self.presence.lock:
            if device in self.presence.present and self.transports.get(device) is not None:
                self.agents[device].announce("online", anew=True)

    def _announce_connected(self, device: str, transport: Any) -> None:
        """On the loop, as :meth:`start` ends: announce ``device`` online unless its connection ``transport`` was
        closed meanwhile (a round manifest it sits out came first: it left, and its poll brings it back)."""
        if not transport.closed:
            self._announce(device)

    def _announce(self, device: str) -> None:
        with self.presence.lock:
            self.presence.present.add(device)
            self.agents[device].announce("online")

    def _connect(self, device: str, transport: Any, present: bool) -> None:
        """On the loop: subscribe, connect, wait for the subscriptions; announce online if ``present``."""
        self._prepare(device, transport)
        transport.start_connect(self.links.connect_timeout)
        self.links.connected(device, transport)
        transport.wait_subscribed(self.links.connect_timeout)
        if present:
            self._announce(device)

    @property
    def train_seconds(self) -> float:
        """Wall seconds this process spent training (metrics): each device's training, or each cohort once."""
        return self.clock.seconds + (self.executor.seconds if self.executor is not None else 0.0)

    def _beat(self) -> None:
        """On the I/O thread: re-announce every present device (training on the loop cannot delay it), and
        each connected one between jobs as idle (long-lived: no job holds it)."""
        with self.presence.lock:
            if self._stopped:
                return  # its timer fired as the process stopped
            for device in self.presence.present:
                if self.transports[device].connected:
                    self.agents[device].announce("online", qos=0)
            for device, transport in self.transports.items():
                if self.job.long_lived and device not in self.presence.live and transport.connected:
                    self.agents[device].announce(IDLE, qos=0, heartbeat=self.heartbeat, unfit=self.unfit)
        with self._beat_lock:
            if not self._stopped:  # a beat in flight at stop schedules none after it
                self._beat_timer = self.links.reactor.call_later(self.heartbeat, self._beat)

    def cannot_serve(self, session: str, reason: str) -> None:
        """Long-lived, between jobs: its devices cannot serve the job of ``session`` (e.g. their data does not fit
        its model); their idle statuses say so from now on, so its cells plan them absent with ``reason``."""
        self.unfit = {"session": session, "reason": reason}
        with self.presence.lock:
            for device, transport in self.transports.items():
                if device not in self.presence.live and transport.connected:
                    self.agents[device].announce(IDLE, heartbeat=self.heartbeat, unfit=self.unfit)

    def _job_done(self, device: str) -> None:
        """Long-lived: the device's job is finished; it stays connected for the next one, announced idle
        (no job: a cell plans it only once it is online in its own job) until it has that job's role."""
        with self.presence.lock:
            if device not in self.presence.live:
                return
            self.presence.live.discard(device)
            if self.agents[device].transport.connected:  # also one back from sitting out a round: it is up
                self.agents[device].announce(IDLE, heartbeat=self.heartbeat, unfit=self.unfit)  # beats follow
            self.presence.present.discard(device)
            done = not self.presence.live
        self.loop.cancel(self.presence.polls.pop(device, None))
        if done:
            self.done.set()

    def _leave(self, device: str) -> None:
        with self.presence.lock:
            if device not in self.presence.live:
                return
            self.presence.live.discard(device)
            self.presence.present.discard(device)
            agent = self.agents[device]
            if agent.transport.connected:
                agent.announce("offline")  # under the lock: no heartbeat can follow it
            done = not self.presence.live
        agent.transport.close()  # not under the lock: the I/O thread's heartbeat takes it
        self.loop.cancel(self.presence.polls.pop(device, None))
        if done:
            self.done.set()

    def discard(self) -> None:
        """Close a process that was built but never started (a long-lived one took its job's parts with
        :meth:`next_job`): its cohort executor, its reactor's wake-up sockets and selector, now rather than when
        the garbage collector finds them."""
        if self.executor is not None:
            self.executor.close()
        self.links.reactor.close()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every device saw ``finished`` (True) or ``timeout`` passed (False)."""
        return self.done.wait(timeout)

    def stop(self) -> None:
        """Leave: every device still connected says offline and disconnects. Final: no heartbeat follows it (one
        in flight finishes and schedules none)."""
        if self._refused:
            return
        with self._beat_lock:
            self._stopped = True
            self.links.reactor.cancel(self._beat_timer)
        if self.loop.running:
            for device in list(self.agents):
                self.links.on_loop(functools.partial(self._leave, device))
            for device, transport in list(self.transports.items()):  # long-lived: between jobs, still connected
                if device not in self.presence.live and transport.connected:
                    self.links.on_loop(self.agents[device].stop)  # idle: it says offline, then disconnects
        self.loop.stop()
        if self.executor is not None:
            self.executor.close()
        self.links.reactor.close()

    def tasks_answered(self, session: str | None) -> int:
        """Tasks these devices answered in the job of ``session``: none by agents of the job before (``next_job`` swaps
        them on the loop, a moment after it takes the job's session: a stop then counted the last job's tasks again).
        By each agent's own view of the cloud: the swap puts a device's new view in :attr:`clouds` before its agent."""
        return sum(
            a.tasks_done for a in list(self.agents.values()) if a.cloud is not None and a.cloud.pinned == session
        )

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per device: its wire counters (all its connections), connections, the agent's payload bytes and tasks
        (and, with the cohort engine, ``cohort_sizes``: the size of each cohort it trained in)."""
        return {
            d: {
                "wire": self.links.wire(d),
                "connections": self.connections.get(d, 0),
                "bytes_in": a.bytes_in,
                "bytes_out": a.bytes_out,
                "tasks": a.tasks_done,
                "cell_lies": cell_lies(a),
                **({"compute": self.clock.compute.get(d, [])} if self.clock.timing else {}),
                **({"cohort_sizes": self.executor.sizes.get(d, [])} if self.executor is not None else {}),
            }
            for d, a in self.agents.items()
        }


def _mqtt(links: Iterable[tuple[str, Any]]) -> list[MqttTransport]:
    """The MQTT connections of these links."""
    return [t for _, t in links if isinstance(t, MqttTransport)]


def _expect_drops(links: list[tuple[str, Any]], why: str) -> None:
    """Say a lost connection of these links at info, with ``why`` (a twin check: a live agent of the same devices
    takes their sessions back), not as a warning; ``""``: warn again."""
    for _, transport in links:
        if isinstance(transport, MqttTransport):
            transport.drop_expected = why or None
