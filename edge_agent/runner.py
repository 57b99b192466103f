"""Device agents on MQTT, as a process runs them: ``fedtier agent`` on a device, and each worker of
``fedtier run`` for its share of the emulated devices.

Every device keeps its own connection and client id (its will marks it offline), announces itself
online (retained), sends a heartbeat every ``heartbeat`` seconds from a thread of its own (so a long
training step never silences it), answers its tasks, and leaves when the cloud publishes the
retained ``finished`` control record. The devices of one process share one event loop (their
training runs one at a time) and one trainer. torch is imported only by the torch backend.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from protocols.algorithms.base import Algorithm, ModelSpec
from protocols.config import ConfigError, RunConfig
from protocols.status import encode_status
from protocols.trainer import LocalData, Trainer
from protocols.transport.base import Will
from protocols.transport.threadloop import ThreadLoop
from protocols.wire import chunking, topics
from protocols.wire.messenger import Messenger

from .agent import DeviceAgent
from .node import build_agent

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
    def from_config(cls, cfg: RunConfig, url: str | None = None, **overrides: Any) -> "BrokerOptions":
        """The config's ``[broker]`` section; ``url`` and non-None ``overrides`` (CLI flags) win."""
        b = cfg.broker
        fields = {"username": b.username, "password": b.password, "ca_certs": b.ca_certs,
                  "certfile": b.certfile, "keyfile": b.keyfile}
        fields.update({k: v for k, v in overrides.items() if v is not None})
        url = url or b.url
        if not url:
            raise ConfigError("broker.url: required (mqtt://host:port), or pass --broker")
        return cls(url, **fields)

    def transport(self, node: str, run: str, loop: Any, will: Will | None = None) -> "Any":
        """A (not yet connected) :class:`MqttTransport` for ``node`` with client id ``fedtier-{run}-{node}``."""
        from protocols.transport.mqtt import MqttTransport

        return MqttTransport.from_url(self.url, client_id(run, node), loop, username=self.username,
                                      password=self.password, ca_certs=self.ca_certs, certfile=self.certfile,
                                      keyfile=self.keyfile, will=will, max_chunk=self.max_chunk)


def client_id(run: str, node: str) -> str:
    """MQTT client id of a node (``cloud``, ``cell.c0``, ``device.c0-d1``) in a run."""
    return f"fedtier-{run}-{node}"


def offline_will(run: str, node: str) -> Will:
    """The last will of a node: its retained status says offline."""
    return Will(topics.status(run, node), encode_status("offline"), retain=True)


# ------------------------------------------------------------------------------------ device data
def save_device_data(path: str | Path, data: LocalData, spec: ModelSpec) -> None:
    """A device's samples as ``.npz``: ``x``, ``y``, plus the model's ``input_shape`` and ``num_classes``."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x=data.x, y=data.y, input_shape=np.asarray(spec.input_shape, dtype=np.int64),
             num_classes=np.asarray(spec.num_classes, dtype=np.int64))


def load_device_data(path: str | Path) -> tuple[LocalData, tuple[int, ...] | None, int | None]:
    """``(data, input_shape, num_classes)`` from a ``.npz`` with arrays ``x`` and ``y`` (never pickled);
    the last two are ``None`` when the file does not carry them."""
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = {"x", "y"} - set(f.files)
            if missing:
                raise ConfigError(f"{path}: missing array(s) {sorted(missing)} (expected x and y)")
            x, y = f["x"], f["y"]
            shape = tuple(int(v) for v in f["input_shape"]) if "input_shape" in f.files else None
            classes = int(f["num_classes"]) if "num_classes" in f.files else None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable .npz data file: {exc}") from None
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y) or not np.issubdtype(y.dtype, np.integer):
        raise ConfigError(f"{path}: expected x [n, ...] and integer y [n], got {x.shape} and {y.dtype}{y.shape}")
    return LocalData(np.ascontiguousarray(x.reshape(len(x), -1), dtype=np.float32),
                     np.ascontiguousarray(y, dtype=np.int64)), shape, classes


# ---------------------------------------------------------------------------------------- backends
TrainerFactory = Callable[[ModelSpec, RunConfig], Trainer]


def _torch_trainer(spec: ModelSpec, cfg: RunConfig) -> Trainer:
    import torch

    from protocols.torch_trainer import TorchTrainer

    torch.set_num_threads(1)  # small models: one thread per process is fastest, and processes share cores
    return TorchTrainer.from_spec(spec.name, spec.input_shape, spec.num_classes, cfg.runtime.device,
                                  **spec.build_kwargs())


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
    """

    def __init__(self, cfg: RunConfig, algorithm: Algorithm, data: dict[str, LocalData], trainer: Trainer,
                 broker: BrokerOptions, *, heartbeat: float | None = None,
                 on_task: Callable[[str, int, int], None] | None = None, timing: bool = False) -> None:
        self.cfg, self.algorithm, self.data, self.trainer, self.broker = cfg, algorithm, data, trainer, broker
        self.run = cfg.run.name
        self.heartbeat = cfg.runtime.heartbeat if heartbeat is None else heartbeat
        self.on_task, self.timing = on_task, timing
        self.compute: dict[str, list[list[float]]] = {}
        self.loop = ThreadLoop(f"agents-{self.run}")
        self._beats = ThreadLoop(f"heartbeat-{self.run}")
        self.agents: dict[str, DeviceAgent] = {}
        self.transports: dict[str, Any] = {}
        self._live: set[str] = set()
        self._lock = threading.Lock()
        self.done = threading.Event()

    def start(self, connect_timeout: float = 30.0) -> "AgentProcess":
        """Connect every device (blocking until the broker acknowledged its subscriptions) and announce it."""
        self.loop.start()
        for device, data in self.data.items():
            node = topics.device_node(device)
            transport = self.broker.transport(node, self.run, self.loop, will=offline_will(self.run, node))
            transport.connect(connect_timeout)
            self.transports[device] = transport
            agent = build_agent(self.cfg, device, transport, self.algorithm, data, self.trainer)
            if self.on_task is not None:
                agent.on_task = lambda r, e, d=device: self.on_task(d, r, e)
            self.agents[device] = agent
            if self.timing:
                agent.role.train = self._timed(device, agent.role.train)
            control = Messenger(transport, self.run, device)
            transport.subscribe(topics.control(self.run), lambda t, b, d=device, m=control: self._on_control(d, m, t, b))
            with self._lock:
                self._live.add(device)
            self._on_loop(agent.start)
            transport.wait_subscribed(connect_timeout)
        if self.heartbeat > 0:
            self._beats.start()
            self._beats.call_later(self.heartbeat, self._beat)
        if not self.agents:
            self.done.set()
        return self

    def _timed(self, device: str, train: Callable[..., Any]) -> Callable[..., Any]:
        spans = self.compute.setdefault(device, [])

        def timed_train(task: Any, data: Any, trainer: Any, ctx: Any) -> Any:
            start = time.monotonic()
            try:
                return train(task, data, trainer, ctx)
            finally:
                spans.append([ctx.round, ctx.edge_round, start, time.monotonic()])

        return timed_train

    def _on_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the agents' loop and wait for it (handlers never run concurrently with it)."""
        ran = threading.Event()

        def call() -> None:
            try:
                fn()
            finally:
                ran.set()

        self.loop.post(call)
        ran.wait()

    def _beat(self) -> None:
        with self._lock:
            for device in self._live:
                if self.transports[device].connected:
                    self.agents[device].announce("online")
        self._beats.call_later(self.heartbeat, self._beat)

    def _on_control(self, device: str, messenger: Messenger, topic: str, data: bytes) -> None:
        if not data:
            return  # a cleared retained record
        msg = messenger.receive(topic, data, kinds=("control",))
        if msg is not None and msg.payload.meta.get("event") == "finished":
            log.info("device %s: the run is finished", device)
            self._leave(device)

    def _leave(self, device: str) -> None:
        with self._lock:
            if device not in self._live:
                return
            self._live.discard(device)
        self.agents[device].stop()  # announces offline after the last heartbeat, then disconnects
        with self._lock:
            if not self._live:
                self.done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every device saw ``finished`` (True) or ``timeout`` passed (False)."""
        return self.done.wait(timeout)

    def stop(self) -> None:
        """Leave: every device still connected says offline and disconnects."""
        self._beats.stop()
        if self.loop.running:
            for device in list(self.agents):
                self._on_loop(lambda d=device: self._leave(d))
        self.loop.stop()

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per device: its transport's wire counters and the agent's payload bytes and tasks."""
        return {d: {"wire": self.transports[d].stats.snapshot(), "bytes_in": a.bytes_in, "bytes_out": a.bytes_out,
                    "tasks": a.tasks_done, **({"compute": self.compute.get(d, [])} if self.timing else {})}
                for d, a in self.agents.items()}
