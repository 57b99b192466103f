"""The MQTT connections of one agent process's devices: one I/O thread (a
:class:`~protocols.transport.reactor.Reactor` on epoll: every socket, keepalive and timer), one event loop
(their handlers and training), each device's current connection, how often it connected, and the wire
counters of its earlier connections. A device costs a socket, not a thread."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from protocols.config import RunConfig
from protocols.seeding import derive_seed
from protocols.transport.reactor import Reactor
from protocols.transport.threadloop import ThreadLoop
from protocols.wire import topics

from .broker import BrokerOptions, device_will
from .node import cell_of


class DeviceConnections:
    """Each device's connection to its broker: ``cell_brokers`` maps a cell to the broker of its devices
    (a broker per cell); other devices use ``broker``. ``cfg`` (the current job's) signs the wills and
    seeds the reconnect backoff."""

    def __init__(
        self, cfg: RunConfig, broker: BrokerOptions, cell_brokers: dict[str, BrokerOptions] | None = None
    ) -> None:
        self.cfg, self.run, self.broker = cfg, cfg.run.name, broker
        self.cell_brokers = cell_brokers or {}  # cell -> its own broker (bridged cell brokers)
        self.loop = ThreadLoop(f"agents-{self.run}")
        self.reactor = Reactor(f"agents-io-{self.run}")  # every device's socket, keepalives, heartbeats
        self.transports: dict[str, Any] = {}  # each device's current connection
        self.connections: dict[str, int] = {}  # connections made, per device
        self.past: dict[str, list[dict[str, Any]]] = {}  # wire counters of earlier connections
        self.connect_timeout = 30.0
        self.connect_window = 64  # CONNECTs under way at once (bounded rate)
        self.instance: str | None = None  # the agent process's (protocols.twin), named in the devices' wills

    def open(self, device: str, persistent: bool = True) -> Any:
        """A new (not yet connected) connection of ``device``: its will, a backoff seeded per attempt."""
        node = topics.device_node(device)
        attempt = self.connections.get(device, 0)
        cell = cell_of(self.cfg, device)
        broker = self.cell_brokers.get(cell, self.broker)
        return broker.transport(
            node,
            self.run,
            self.loop,
            will=device_will(self.run, cell, device, self.cfg, self.instance),
            reactor=self.reactor,
            retry_refused=True,
            persistent=persistent,
            backoff_seed=derive_seed(self.cfg.run.seed, device, attempt, "mqtt-backoff"),
        )

    def adopt(self, device: str, transport: Any) -> None:
        """Make ``transport`` the device's current connection (keeping the counters of the one it replaces)."""
        old = self.transports.get(device)
        if old is not None:
            self.past.setdefault(device, []).append(old.stats.snapshot())
        self.transports[device] = transport

    def connected(self, device: str, transport: Any) -> None:
        """Wait for ``transport``'s CONNACK (started by ``start_connect``) and count the connection."""
        transport.finish_connect()
        self.connections[device] = self.connections.get(device, 0) + 1

    def connect_all(self, fresh: Sequence[tuple[str, Any]], timeout: float) -> None:
        """Connect each ``(device, transport)`` (at most ``connect_window`` CONNECTs under way at once, each
        retried with jittered backoff while the broker refuses it) and wait until the broker acknowledged
        their subscriptions. Raises ``ConnectionError`` if one cannot within ``timeout``. A device whose
        connection was closed meanwhile left on purpose: its loop read a round manifest it sits out (a broker may
        send the retained one before the SUBACK: amqtt does) and polls to rejoin; it waits for no SUBACK."""
        under_way: deque[tuple[str, Any]] = deque()
        for device, transport in fresh:
            if len(under_way) >= self.connect_window:
                self.connected(*under_way.popleft())
            transport.start_connect(timeout)
            under_way.append((device, transport))
        while under_way:
            self.connected(*under_way.popleft())
        for device, transport in fresh:
            if not transport.wait_subscribed(timeout) and not transport.closed:
                raise ConnectionError(
                    f"device {device}: the broker did not acknowledge its subscriptions within {timeout:g} s"
                )

    def wire(self, device: str) -> dict[str, Any]:
        """The device's wire counters, summed over all its connections."""
        return merge_wire([*self.past.get(device, []), self.transports[device].stats.snapshot()])

    def on_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop and wait for it (handlers never run concurrently with it); re-raises its
        exception here."""
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

    def each_on_loop(self, items: Sequence[tuple[Any, ...]], fn: Callable[..., None]) -> None:
        """``fn(*item)`` for each item, in order, on the loop (as :meth:`on_loop`)."""

        def each() -> None:
            for item in items:
                fn(*item)

        self.on_loop(each)


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
