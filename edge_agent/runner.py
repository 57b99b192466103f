"""Device agents on MQTT, as a process runs them: ``fedtier agent`` on a device, and each worker of
``fedtier run`` for its share of the emulated devices.

Every device keeps its own connection and client id (its will marks it offline), announces itself
online (retained), sends a heartbeat every ``heartbeat`` seconds, answers its tasks, and leaves when
the cloud publishes the retained ``finished`` control record of its current session. With churn, a
device that does not take part in a round really disconnects and comes back for the rounds it takes
part in. The devices of one process share one event loop (their training runs there, one at a
time), one trainer and one I/O thread (a :class:`~protocols.transport.reactor.Reactor` on epoll):
a device costs a socket, not a thread. Heartbeats, keepalives and reconnects are timers of the I/O
thread, so a long training step never silences them. With ``runtime.engine = "cohort"`` the devices'
tasks are queued and trained together as cohorts whenever the loop is idle (``edge_agent/cohort.py``).
torch is imported only by the torch backend.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocols.algorithms.base import Algorithm, ModelSpec
from protocols.config import ConfigError, RunConfig
from protocols.execution import execution_plan
from protocols.rejections import RejectKind
from protocols.roster import Roster, RosterError, roster_topic, verify_roster
from protocols.seeding import derive_seed
from protocols.session import CloudSession, decode_manifest
from protocols.status import decode_status, encode_status
from protocols.trainer import LocalData, Trainer
from protocols.transport.base import TimerHandle, Will
from protocols.transport.reactor import Reactor
from protocols.transport.threadloop import ThreadLoop
from protocols.wire import chunking, topics
from protocols.wire.keys import node_trust
from protocols.wire.messenger import Messenger
from protocols.wire.signed import signer_of

from .agent import DeviceAgent
from .datasources import DataSource
from .node import build_agent, cell_of
from .secagg import cell_lies, learn_roster
from .twin import TwinAgentError, TwinWatch, new_instance

if TYPE_CHECKING:
    from .cohort import CohortExecutor

log = logging.getLogger("fedtier.agent")


# --------------------------------------------------------------------------------------- broker
@dataclass(frozen=True)
class BrokerOptions:
    """How a node reaches the broker (paho gets the credentials and TLS files as they are)."""

    url: str
    username: str | None = None
    password: str | None = None
    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    max_chunk: int = chunking.DEFAULT_MAX_CHUNK

    @classmethod
    def from_config(cls, cfg: RunConfig, url: str | None = None, **overrides: Any) -> BrokerOptions:
        """The config's ``[broker]`` section; ``url`` and non-None ``overrides`` (CLI flags) win."""
        b = cfg.broker
        fields: dict[str, Any] = {
            "username": b.username,
            "password": b.password,
            "ca_certs": b.ca_certs,
            "certfile": b.certfile,
            "keyfile": b.keyfile,
        }
        fields.update({k: v for k, v in overrides.items() if v is not None})
        url = url or b.url
        if not url:
            raise ConfigError("broker.url: required (mqtt://host:port), or pass --broker")
        return cls(url, **fields)

    def transport(self, node: str, run: str, loop: Any, will: Will | None = None, **kwargs: Any) -> Any:
        """A (not yet connected) :class:`MqttTransport` for ``node`` with client id ``fedtier-{run}-{node}``
        and a persistent session (a node restarted under the same id gets what the broker queued for
        it meanwhile); ``kwargs`` go to the transport (``reactor``, ``backoff_seed``, ``retry_refused``,
        ``persistent``)."""
        from protocols.transport.mqtt import MqttTransport

        kwargs.setdefault("persistent", True)

        return MqttTransport.from_url(
            self.url,
            client_id(run, node),
            loop,
            username=self.username,
            password=self.password,
            ca_certs=self.ca_certs,
            certfile=self.certfile,
            keyfile=self.keyfile,
            will=will,
            max_chunk=self.max_chunk,
            **kwargs,
        )


def client_id(run: str, node: str) -> str:
    """MQTT client id of a node (``cloud``, ``cell.c0``, ``device.c0-d1``) in a run."""
    return f"fedtier-{run}-{node}"


def offline_will(run: str, node: str, cfg: RunConfig | None = None) -> Will:
    """The last will of a node: its retained status says offline (signed by the node when ``cfg`` has
    ``[security] keys``)."""
    return _will(topics.status(run, node), cfg)


def device_will(run: str, cell: str, device: str, cfg: RunConfig | None = None) -> Will:
    """The last will of a device: its retained status (under its cell) says offline (signed as above)."""
    return _will(topics.device_status(run, cell, device), cfg)


def _will(topic: str, cfg: RunConfig | None) -> Will:
    signer = signer_of(topic)
    trust = node_trust(cfg, signer) if cfg is not None and signer is not None else None
    return Will(topic, encode_status("offline", topic=topic, trust=trust), retain=True)


# ------------------------------------------------------------------------------------ device data
def save_device_data(path: str | Path, data: LocalData, spec: ModelSpec) -> None:
    """A device's samples as ``.npz``: ``x``, ``y``, plus the model's ``input_shape`` and ``num_classes``."""
    from .datasources import write_source

    write_source(path, data, spec.input_shape, spec.num_classes, "npz")


def load_device_data(
    source: str | Path | DataSource, input_shape: tuple[int, ...] | None = None
) -> tuple[LocalData, tuple[int, ...] | None, int | None]:
    """``(data, input_shape, num_classes)`` of a device's data source (``.npz``, CSV, a folder of images
    by class, or a loader: :mod:`edge_agent.datasources`); the last two are ``None`` when the source
    does not record them. Raises ``DataSourceError`` (a ``ConfigError``) naming the defect."""
    from .datasources import load_source

    d = load_source(source, input_shape=input_shape)
    return d.data, d.input_shape, d.num_classes


# ---------------------------------------------------------------------------------------- backends
TrainerFactory = Callable[[ModelSpec, RunConfig], Trainer]


def _torch_trainer(spec: ModelSpec, cfg: RunConfig) -> Trainer:
    import torch

    from protocols.torch_trainer import TorchTrainer

    torch.set_num_threads(1)  # small models: one thread per process is fastest, and processes share cores
    return TorchTrainer.from_spec(
        spec.name, spec.input_shape, spec.num_classes, cfg.runtime.device, **spec.build_kwargs()
    )


def _onnx_trainer(spec: ModelSpec, cfg: RunConfig) -> Trainer:
    """Forward-only (onnxruntime, no torch): the file of ``runtime.onnx_model`` (``fedtier export``)."""
    from .onnx_trainer import build_onnx_trainer

    if not cfg.runtime.onnx_model:
        raise ConfigError("runtime.onnx_model: the onnx backend needs a model from `fedtier export` (--onnx-model)")
    return build_onnx_trainer(cfg.runtime.onnx_model)


BACKENDS: dict[str, TrainerFactory] = {"torch": _torch_trainer, "onnx": _onnx_trainer}
"""Trainer backends by name; a backend module is imported only when its factory is called."""


def make_trainer(backend: str, spec: ModelSpec, cfg: RunConfig) -> Trainer:
    try:
        factory = BACKENDS[backend]
    except KeyError:
        raise ConfigError(f"backend {backend!r}: expected one of {sorted(BACKENDS)}") from None
    return factory(spec, cfg)


# ------------------------------------------------------------------------------------------ agents
class AgentProcess:
    """The device agents of one process: connect, announce, heartbeat, answer tasks, leave on ``finished``.

    ``on_task(device, round, edge_round)`` is called before a device trains (fault injection in tests);
    with ``timing``, every training is timed (``stats()[device]["compute"]``: ``[round, edge_round,
    start, end]`` on the system-wide monotonic clock, comparable across processes of one machine).

    ``availability(round) -> devices that take part in that cloud round`` turns on churn: on the cloud's
    round manifest, a device that does not take part says offline and disconnects (after the results
    it owes: the manifest is handled after them), then reconnects every ``rejoin_poll`` seconds just
    long enough to read the retained manifest, and stays, announced online, from the first round it
    takes part in. A device's connections share its client id; its sessions are persistent, except
    that its polls start clean (ending what the broker queued while it sat out); ``stats()`` counts
    them (``connections``) and sums their wire counters. Cloud records (manifest, ``finished``) count
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
        to start (:class:`~edge_agent.twin.TwinAgentError`) if another agent process is live under one of
        their ids (``edge_agent/twin.py``; deployed agents: one heartbeat and a second; ``None``: no check).
        ``session``: serving one job, only its cloud session counts (``protocols.jobs``). ``long_lived``:
        at the job's end the devices stay connected, announced offline (``done`` is set), and :meth:`next_job`
        serves the next job on the same connections; ``on_job_record`` (set before :meth:`start`) gets the
        cloud's ``cloud/job`` records, on the first device's connection."""
        self.session = session
        self.long_lived = long_lived
        self.on_job_record: Callable[[str, bytes], None] | None = None
        self.roster: Roster | None = None  # long-lived: the newest verified roster (its members' keys)
        self._last_status: dict[str, dict[str, Any] | None] = {}  # each device's latest cloud status record
        self._last_manifest: dict[str, dict[str, Any]] = {}
        self.cfg, self.algorithm, self.data, self.trainer, self.broker = cfg, algorithm, data, trainer, broker
        self.cell_brokers = cell_brokers or {}  # cell -> its own broker (bridged cell brokers)
        self.run = cfg.run.name
        self.heartbeat = cfg.runtime.heartbeat if heartbeat is None else heartbeat
        self.on_task, self.timing = on_task, timing
        self.availability = availability
        self.rejoin_poll = cfg.runtime.rejoin_poll if rejoin_poll is None else rejoin_poll
        self.connect_timeout = 30.0
        self.compute: dict[str, list[list[float]]] = {}
        self._train_seconds = 0.0  # wall seconds the devices trained one by one (see train_seconds)
        self._train_lock = threading.Lock()
        self.loop = ThreadLoop(f"agents-{self.run}")
        self.reactor = Reactor(f"agents-io-{self.run}")  # every device's socket, keepalives, heartbeats
        self._beat_timer: TimerHandle | None = None
        self.connect_window = 64  # CONNECTs under way at once (bounded rate)
        self.agents: dict[str, DeviceAgent] = {}
        self.transports: dict[str, Any] = {}  # each device's current connection
        self.clouds: dict[str, CloudSession] = {}
        self.connections: dict[str, int] = {}
        self._past: dict[str, list[dict[str, Any]]] = {}  # wire counters of earlier connections
        self._live: set[str] = set()  # not yet left for good
        self._present: set[str] = set()  # connected and announced online (the heartbeat keeps them so)
        self._fresh: set[str] = set()  # read a manifest on their current connection
        self._polls: dict[str, TimerHandle] = {}
        self.twin_window = twin_window
        self.twins = TwinWatch(new_instance())  # this process's nonce, in every status record
        self._refused = False  # refused to start (a twin): already stopped, nothing announced
        self._lock = threading.Lock()
        self.done = threading.Event()
        self.executor: CohortExecutor | None = None  # cohorts (runtime.engine = "cohort"), torch agents only
        plan = execution_plan(cfg)
        if plan.batches(trainer):  # onnx-only agents never load the cohort engine (torch)
            from .cohort import make_cohort_executor

            self.executor = make_cohort_executor(plan, self.agents, algorithm.model, self.loop, trainer)

    def start(self, connect_timeout: float = 30.0) -> AgentProcess:
        """Connect every device (at most ``connect_window`` CONNECTs under way at once, each retried
        with jittered backoff while the broker refuses it), wait until the broker acknowledged their
        subscriptions, then announce them online. Raises ``ConnectionError`` if one cannot connect
        within ``connect_timeout``."""
        self.connect_timeout = connect_timeout
        self.reactor.start()
        self.loop.start()
        fresh: list[tuple[str, Any]] = []
        for device in self.data:
            transport = self._transport(device)
            self.agents[device] = self._make_agent(device, transport)
            with self._lock:
                self._live.add(device)
            fresh.append((device, transport))
        self.twins.checking = self.twin_window is not None  # no task is taken before the check is over
        self._on_loop(lambda: self._each(fresh, self._prepare))
        under_way: deque[tuple[str, Any]] = deque()
        for device, transport in fresh:
            if len(under_way) >= self.connect_window:
                self._connected(*under_way.popleft())
            transport.start_connect(connect_timeout)
            under_way.append((device, transport))
        while under_way:
            self._connected(*under_way.popleft())
        for device, transport in fresh:
            if not transport.wait_subscribed(connect_timeout):
                raise ConnectionError(
                    f"device {device}: the broker did not acknowledge its subscriptions within {connect_timeout:g} s"
                )
        if self.twin_window is not None:
            self._check_twins(self.twin_window)
            self._on_loop(lambda: self._each(fresh, lambda d, t: self.agents[d].attach(t)))  # held tasks follow
        self._on_loop(lambda: self._each([(d,) for d, _ in fresh], self._announce))
        if self.heartbeat > 0:
            self._beat_timer = self.reactor.call_later(self.heartbeat, self._beat)
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
        reason = (
            f"device {device}: another agent process (instance {other}) is live under this device id on the "
            f"broker: refusing to start a second one (two agents with one id take the broker session from each "
            f"other); stop the other agent first"
        )
        log.error("%s", reason)
        transport, agent = self.transports[device], self.agents[device]
        status = topics.device_status(self.run, agent.cell, device)
        self._on_loop(lambda: transport.publish(status, self.twins.refusal(status, agent.trust), qos=1, retain=True))
        transport.flush(self.connect_timeout)
        for t in list(self.transports.values()):
            self._on_loop(t.close)  # a clean DISCONNECT: no will, the live agent's status stays
        self.loop.stop()
        if self.executor is not None:
            self.executor.close()
        self.reactor.close()
        self._refused = True
        raise TwinAgentError(reason)

    def _on_own_status(self, device: str, topic: str, data: bytes) -> None:
        """A record on the device's own status topic: another instance's means a second agent (see twin.py)."""
        trust = self.agents[device].trust
        self.twins.on_status(
            device, topic, data, trust.verify if trust is not None else None, lambda: self._session_lost(device)
        )

    def _make_agent(self, device: str, transport: Any) -> DeviceAgent:
        """The device's agent for the current job (its cloud view pinned to the job's session)."""
        self.clouds[device] = CloudSession(pinned=self.session)
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
        agent.role.train = self._timed(device, agent.role.train)  # type: ignore[method-assign]
        agent.executor = self.executor
        if self.roster is not None:
            learn_roster(agent, self.roster)
        return agent

    def _on_roster(self, trust: Any, data: bytes) -> None:
        """A roster on the federation's topic (first device's connection): verified with the cloud's key, a
        newer one teaches every device its cell's members' keys (``edge_agent.secagg.learn_roster``)."""
        if not data:
            return
        try:
            roster = verify_roster(
                data, trust.verify, federation=self.run, min_version=self.roster.version + 1 if self.roster else 0
            )
        except RosterError as exc:
            if self.roster is None or "older" not in str(exc):
                log.warning("ignored a roster: %s", exc)
            return
        self.roster = roster
        for agent in list(self.agents.values()):
            learn_roster(agent, roster)

    def next_job(
        self,
        cfg: RunConfig,
        algorithm: Algorithm,
        trainer: Trainer,
        session: str,
        availability: Callable[[int], Iterable[str]] | None = None,
    ) -> None:
        """Long-lived agents: serve the job of ``session`` with new roles on the same connections (a device
        that sat out the last round connects again); ``done`` is cleared until it is finished."""
        old = self.executor
        self.cfg, self.algorithm, self.trainer, self.session = cfg, algorithm, trainer, session
        self.availability = availability
        self.done.clear()
        offline: list[str] = []

        def swap() -> None:
            if old is not None:
                old.close()
            plan = execution_plan(cfg)
            self.executor = None
            if plan.batches(trainer):
                from .cohort import make_cohort_executor

                self.executor = make_cohort_executor(plan, self.agents, algorithm.model, self.loop, trainer)
            for device in self.data:
                transport = self.transports[device]
                transport.unsubscribe(topics.device_task(self.run, cell_of(cfg, device), device))
                agent = self.agents[device] = self._make_agent(device, transport)
                agent.attach(transport)
                cloud = self.clouds[device]
                cloud.on_status(self._last_status.get(device))  # the new job's cloud may have announced itself
                if device in self._last_manifest:
                    cloud.on_manifest(self._last_manifest[device])
                with self._lock:
                    self._live.add(device)
                if transport.connected:
                    with self._lock:
                        self._present.add(device)
                        agent.announce("online")
                else:
                    offline.append(device)
            if not self.data:
                self.done.set()

        self._on_loop(swap)
        for device in offline:
            self._on_loop(lambda d=device: self._connect(d, self._transport(d), present=True))  # type: ignore[misc]
        for device in self.data:
            self._on_loop(lambda d=device: self._update(d))  # type: ignore[misc]

    def _transport(self, device: str, persistent: bool = True) -> Any:
        node = topics.device_node(device)
        attempt = self.connections.get(device, 0)
        cell = cell_of(self.cfg, device)
        broker = self.cell_brokers.get(cell, self.broker)
        return broker.transport(
            node,
            self.run,
            self.loop,
            will=device_will(self.run, cell, device, self.cfg),
            reactor=self.reactor,
            retry_refused=True,
            persistent=persistent,
            backoff_seed=derive_seed(self.cfg.run.seed, device, attempt, "mqtt-backoff"),
        )

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
        transport.subscribe(topics.control(run), lambda t, b: self._on_control(device, control, t, b))
        transport.subscribe(topics.status(run, "cloud"), lambda t, b: self._on_cloud_status(device, t, b))
        transport.subscribe(topics.round_manifest(run), lambda t, b: self._on_manifest(device, t, b))
        if self.on_job_record is not None and device == next(iter(self.data)):
            transport.subscribe(topics.current_job(run), self.on_job_record)
        if self.long_lived and agent.trust is not None and device == next(iter(self.data)):
            transport.subscribe(roster_topic(run), lambda t, b: self._on_roster(agent.trust, b))
        old = self.transports.get(device)
        if old is not None:
            self._past.setdefault(device, []).append(old.stats.snapshot())
        self.transports[device] = transport
        self._fresh.discard(device)
        transport.on_session_lost = lambda: self._session_lost(device)

    def _session_lost(self, device: str) -> None:
        """On the I/O thread: the broker had no session for a present device (expired while it was away):
        announce it online again at once (QoS 1), so its cell re-sends a task whose copy the session lost."""
        with self._lock:
            if device in self._present and self.transports.get(device) is not None:
                self.agents[device].announce("online")

    def _connected(self, device: str, transport: Any) -> None:
        transport.finish_connect()
        self.connections[device] = self.connections.get(device, 0) + 1

    def _announce(self, device: str) -> None:
        with self._lock:
            self._present.add(device)
            self.agents[device].announce("online")

    def _connect(self, device: str, transport: Any, present: bool) -> None:
        """On the loop: subscribe, connect, wait for the subscriptions; announce online if ``present``."""
        self._prepare(device, transport)
        transport.start_connect(self.connect_timeout)
        self._connected(device, transport)
        transport.wait_subscribed(self.connect_timeout)
        if present:
            self._announce(device)

    def _timed(self, device: str, train: Callable[..., Any]) -> Callable[..., Any]:
        """``train`` adding its time to ``train_seconds`` (and, with ``timing``, its span to ``compute``)."""
        spans = self.compute.setdefault(device, []) if self.timing else None

        def timed_train(task: Any, data: Any, trainer: Any, ctx: Any) -> Any:
            start = time.monotonic()
            try:
                return train(task, data, trainer, ctx)
            finally:
                end = time.monotonic()
                if self.executor is None:  # in a cohort, devices train side by side: the executor times it
                    with self._train_lock:
                        self._train_seconds += end - start
                if spans is not None:
                    spans.append([ctx.round, ctx.edge_round, start, end])

        return timed_train

    @property
    def train_seconds(self) -> float:
        """Wall seconds this process spent training (metrics): each device's training, or each cohort once."""
        return self._train_seconds + (self.executor.seconds if self.executor is not None else 0.0)

    @staticmethod
    def _each(items: Sequence[tuple[Any, ...]], fn: Callable[..., None]) -> None:
        """``fn(*item)`` for each item, in order."""
        for item in items:
            fn(*item)

    def _on_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the agents' loop and wait for it (handlers never run concurrently with it);
        re-raises its exception here."""
        ran = threading.Event()
        error: list[BaseException] = []

        def call() -> None:
            try:
                fn()
            except BaseException as exc:
                error.append(exc)
            finally:
                ran.set()

        self.loop.post(call)
        ran.wait()
        if error:
            raise error[0]

    def _beat(self) -> None:
        """On the I/O thread: re-announce every present device (training on the loop cannot delay it)."""
        with self._lock:
            for device in self._present:
                if self.transports[device].connected:
                    self.agents[device].announce("online", qos=0)
        self._beat_timer = self.reactor.call_later(self.heartbeat, self._beat)

    # ------------------------------------------------------------------ cloud records (on the loop)
    def _on_control(self, device: str, messenger: Messenger, topic: str, data: bytes) -> None:
        if not data:
            return  # a cleared retained record
        msg = messenger.receive(topic, data, kinds=("control",))
        if msg is not None and messenger.signed and msg.header.sender != "cloud":
            messenger.reject(
                topic, RejectKind.WRONG_SENDER, f"control record signed by {msg.header.sender!r}, not the cloud", None
            )
            return
        if msg is not None and msg.payload.meta.get("event") == "finished":
            self.clouds[device].on_finished(msg.payload.meta.get("session"))
            self._update(device)

    def _on_cloud_status(self, device: str, topic: str, data: bytes) -> None:
        record = decode_status(data, topic, self.agents[device].trust) if data else None
        if self.long_lived:
            self._last_status[device] = record
        self.clouds[device].on_status(record)
        self._update(device)

    def _on_manifest(self, device: str, topic: str, data: bytes) -> None:
        record = decode_manifest(data, topic, self.agents[device].trust) if data else None
        if record is not None:
            if self.long_lived:
                self._last_manifest[device] = record
            self.clouds[device].on_manifest(record)
            self._fresh.add(device)
            self._update(device)

    def _update(self, device: str) -> None:
        """Leave on the current session's ``finished``; with churn, go or stay for the current round."""
        cloud = self.clouds[device]
        if device not in self._live:
            return
        if cloud.finished:
            log.info("device %s: the run is finished", device)
            if self.long_lived:
                self._job_done(device)
            else:
                self._leave(device)
            return
        rnd = cloud.round
        if self.availability is None or rnd is None:
            return
        takes_part = device in set(self.availability(rnd))
        if device in self._present:
            if not takes_part:
                log.info("device %s: not in round %d, leaving for now", device, rnd)
                with self._lock:
                    self._present.discard(device)
                    self.agents[device].announce("offline")
                self._disconnect(device)
        elif device in self._fresh:  # a poll that read the manifest
            if takes_part:
                log.info("device %s: back for round %d", device, rnd)
                self.transports[device].persist()
                with self._lock:
                    self._present.add(device)
                    self.agents[device].announce("online")
            else:
                self._disconnect(device)

    def _disconnect(self, device: str) -> None:
        """Close the connection cleanly (after its pending publishes) and poll again later."""
        self.transports[device].close()
        self._polls[device] = self.loop.call_later(self.rejoin_poll, lambda: self._poll(device))

    def _poll(self, device: str) -> None:
        if device not in self._live:
            return
        try:
            # a clean session: it ends the one the device left, and what the broker queued for it
            # while it sat out (records it reads retained anyway); persistent again once it stays
            self._connect(device, self._transport(device, persistent=False), present=False)
        except (ConnectionError, RuntimeError) as exc:
            log.warning("device %s: reconnect failed (%s); retrying", device, exc)
            self.transports[device].close(flush_timeout=0)
            self._polls[device] = self.loop.call_later(self.rejoin_poll, lambda: self._poll(device))

    def _job_done(self, device: str) -> None:
        """Long-lived: the device's job is finished; it stays connected for the next one, announced offline
        until it has that job's role (a cell of the next job plans it only then)."""
        with self._lock:
            if device not in self._live:
                return
            self._live.discard(device)
            if device in self._present and self.agents[device].transport.connected:
                self.agents[device].announce("offline")  # under the lock: no heartbeat can follow it
            self._present.discard(device)
            done = not self._live
        self.loop.cancel(self._polls.pop(device, None))
        if done:
            self.done.set()

    def _leave(self, device: str) -> None:
        with self._lock:
            if device not in self._live:
                return
            self._live.discard(device)
            self._present.discard(device)
            agent = self.agents[device]
            if agent.transport.connected:
                agent.announce("offline")  # under the lock: no heartbeat can follow it
            done = not self._live
        agent.transport.close()  # not under the lock: the I/O thread's heartbeat takes it
        self.loop.cancel(self._polls.pop(device, None))
        if done:
            self.done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every device saw ``finished`` (True) or ``timeout`` passed (False)."""
        return self.done.wait(timeout)

    def stop(self) -> None:
        """Leave: every device still connected says offline and disconnects."""
        if self._refused:
            return
        self.reactor.cancel(self._beat_timer)
        if self.loop.running:
            for device in list(self.agents):
                self._on_loop(functools.partial(self._leave, device))
            for device, transport in list(self.transports.items()):  # long-lived: between jobs, still connected
                if device not in self._live and transport.connected:
                    self._on_loop(transport.close)
        self.loop.stop()
        if self.executor is not None:
            self.executor.close()
        self.reactor.close()

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per device: its wire counters (all its connections), connections, the agent's payload bytes and tasks
        (and, with the cohort engine, ``cohort_sizes``: the size of each cohort it trained in)."""
        return {
            d: {
                "wire": merge_wire([*self._past.get(d, []), self.transports[d].stats.snapshot()]),
                "connections": self.connections.get(d, 0),
                "bytes_in": a.bytes_in,
                "bytes_out": a.bytes_out,
                "tasks": a.tasks_done,
                "cell_lies": cell_lies(a),
                **({"compute": self.compute.get(d, [])} if self.timing else {}),
                **({"cohort_sizes": self.executor.sizes.get(d, [])} if self.executor is not None else {}),
            }
            for d, a in self.agents.items()
        }


def merge_wire(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """The sum of transport counter snapshots (``TransportStats.snapshot``), topic by topic."""
    total: dict[str, Any] = {"by_topic": {}}
    for snap in snapshots:
        for key, value in snap.items():
            if key == "by_topic":
                for topic, counts in value.items():
                    acc = total["by_topic"].setdefault(topic, [0] * len(counts))
                    total["by_topic"][topic] = [a + b for a, b in zip(acc, counts)]
            else:
                total[key] = total.get(key, 0) + value
    return total
