"""The device agents of ``fedtier sim``, built when a device is first needed: a population costs what is active.

A device that takes no part in a round holds nothing: no agent, messenger, role, data copy or hub
connection. The first task published to a device's topic builds its agent (one wildcard subscription
of the population sees it), which takes that task at once and subscribes its own topic for the next
ones, so delivery order and every message are those of a population built up front. When a new cloud
round starts (the retained round manifest), idle agents are dropped, but for a bounded number of the most recently
active ones (:data:`KEPT_IDLE_AGENTS`, kept for their devices' next tasks); an algorithm whose devices keep
state across rounds (``Trait.DEVICE_STATE``: DeComFL's replicas) keeps them all, and an agent
that code outside asked for by id (``population[device]``, as tests do to tamper with a device)
stays until the end.

The sim's devices do not announce themselves (the cells count them online: nobody disconnects in a
simulation unless made to); an agent connects with the offline status as its last will, so a
device that is made to crash is seen offline, as under MQTT.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping

from edge_agent.agent import DeviceAgent
from edge_agent.node import build_agent
from edge_agent.runner import device_will
from protocols.algorithms.base import Algorithm
from protocols.algorithms.traits import Trait
from protocols.config import RunConfig
from protocols.trainer import LocalData, Trainer
from protocols.transport.memory import MemoryHub
from protocols.wire import topics
from protocols.wire.envelope import Segments

TRAFFIC = ("bytes_in", "bytes_out", "tasks")

KEPT_IDLE_AGENTS = 256
"""Idle agents kept for their devices' next tasks, the most recently active first, at most this many and while their
data (counted as copied, as ``sim.hierarchy.DeviceData`` keeps it for agents built again) totals at most
:data:`KEPT_IDLE_BYTES`; the others are dropped. Building an agent a task and dropping it the next round cost ~65 us a
device (the standard workload's 10 devices of 100 a round: ~0.6 ms of its 12 ms host side); a population of a million
devices holds its round's agents and at most these."""
KEPT_IDLE_BYTES = 256 << 20

LISTENER = "population"
"""The client id of a population's listener on the hub (its first tasks, the manifests)."""


class Population(Mapping[str, DeviceAgent]):
    """Every device of the topology by id; an agent exists only while its device is needed.

    Iterating yields device ids without building anything; ``population[device]`` builds (and keeps)
    that device's agent; :meth:`built` is the agents that exist now."""

    def __init__(
        self,
        cfg: RunConfig,
        hub: MemoryHub,
        algorithm: Algorithm,
        data: Mapping[str, LocalData],
        trainer_for: Callable[[str], Trainer],
        configure: Callable[[DeviceAgent], None],
    ) -> None:
        """``trainer_for(device)``: its trainer (shared ones are fine: roles hold no trainer state);
        ``configure(agent)``: runs on each new agent before it takes a task (executor, clock)."""
        self.cfg, self.hub, self.algorithm, self.data = cfg, hub, algorithm, data
        self.trainer_for, self.configure = trainer_for, configure
        self.run = cfg.run.name
        self._agents: dict[str, DeviceAgent] = {}
        self._kept: set[str] = set()  # asked for from outside: never dropped
        self._traffic: dict[str, dict[str, int]] = {}  # of dropped agents
        self._sizes: dict[str, int] = {}  # device -> its agent's data in bytes, counted as copied
        self._size = 0  # theirs in all
        self._started = False
        self._announced: set[str] = set()
        self._listener = hub.connect(LISTENER)
        self._listener.subscribe(topics.device_task(self.run, "+", "+"), self._on_task, segments=True)
        self._listener.subscribe(topics.round_manifest(self.run), lambda _t, _d: self.drop_idle())

    # ------------------------------------------------------------------ Mapping over the topology
    def __getitem__(self, device: str) -> DeviceAgent:
        if self.cfg.topology.cell_of(device) is None:
            raise KeyError(device)
        self._kept.add(device)
        return self._need(device)

    def __iter__(self) -> Iterator[str]:
        return iter(self.cfg.topology.devices())

    def __len__(self) -> int:
        return len(self.cfg.topology.devices())

    def __contains__(self, device: object) -> bool:
        return device in self.cfg.topology.devices()

    # ------------------------------------------------------------------ lifecycle
    def built(self) -> list[DeviceAgent]:
        """The agents that exist now."""
        return list(self._agents.values())

    def active(self) -> Mapping[str, DeviceAgent]:
        """The agents that exist, by device (a live view; reading it builds nothing)."""
        return self._agents

    def start(self) -> None:
        """Start the agents asked for before the run (they announce themselves, as deployed agents do)."""
        self._started = True
        self._announced = set(self._agents)
        for agent in self.built():
            agent.start()

    def stop(self) -> None:
        """Agents that announced themselves say offline; the others just disconnect (cleanly)."""
        for d, agent in self._agents.items():
            if d in self._announced:
                agent.stop()
            else:
                agent.transport.close()
        self._listener.close()

    def traffic(self) -> dict[str, dict[str, int]]:
        """Bytes in and out and tasks of every device that existed during the run, in topology order."""
        out = {d: dict(t) for d, t in self._traffic.items()}
        for d, a in self._agents.items():
            _count(out, d, a)
        ids = self.cfg.topology.devices()  # DeviceIds or MemberIds: both have position (annotated Sequence[str])
        return dict(sorted(out.items(), key=lambda item: ids.position(item[0]) or 0))  # type: ignore[attr-defined]

    def drop_idle(self) -> None:
        """Drop the agents with nothing in flight but the most recently active ones that
        :data:`KEPT_IDLE_AGENTS` keeps, unless their devices keep state or they were asked for. With
        ``participation.model = "always"`` every device trains again next round: nothing is dropped (rebuilding an
        agent copies its data out of the data set again)."""
        if Trait.DEVICE_STATE in self.algorithm.stack_traits() or self.cfg.participation.model == "always":
            return
        if len(self._sizes) <= KEPT_IDLE_AGENTS and self._size <= KEPT_IDLE_BYTES:
            return  # every agent fits, idle or not: all kept (a small population's, none built again)
        idle = [d for d, a in self._agents.items() if d not in self._kept and not a.pending and a.transport.connected]
        if len(idle) <= KEPT_IDLE_AGENTS and sum(self._sizes[d] for d in idle) <= KEPT_IDLE_BYTES:
            return
        idle.sort(key=lambda d: self._agents[d].last_task, reverse=True)  # the most recently active first (stable)
        room, places = KEPT_IDLE_BYTES, KEPT_IDLE_AGENTS
        for d in idle:
            if places > 0 and self._sizes[d] <= room:
                room, places = room - self._sizes[d], places - 1
                continue
            agent = self._agents.pop(d)
            _count(self._traffic, d, agent)
            agent.transport.close()
            self._size -= self._sizes.pop(d)

    # ------------------------------------------------------------------ building
    def _need(self, device: str) -> DeviceAgent:
        agent = self._agents.get(device)
        if agent is None:
            will = functools.partial(device_will, self.run, self.cfg.topology.cell_of(device) or "", device, self.cfg)
            agent = build_agent(
                self.cfg,
                device,
                self.hub.connect(topics.device_node(device), will=will),  # (made if it crashes)
                self.algorithm,
                self.data[device],
                self.trainer_for(device),
            )
            self.configure(agent)
            self._agents[device] = agent
            self._sizes[device] = _data_bytes(agent.data)
            self._size += self._sizes[device]
            if self._started:
                agent.attach(agent.transport)
        return agent

    def _on_task(self, topic: str, data: bytes | Segments) -> None:
        """A task for a device: the first one builds its agent, which takes it at once."""
        parts = topic.split("/")
        device, cell = parts[-2], parts[-4]
        if device in self._agents or self.cfg.topology.cell_of(device) != cell:
            return  # its agent has its own subscription; or no such device in that cell (nobody gets it)
        self._need(device).receive_task(topic, data)


def _data_bytes(data: LocalData) -> int:
    """A device's samples in bytes, counted as copied (``DatasetRows.nbytes``: whether or not they are yet)."""
    size = getattr(data, "nbytes", None)
    return int(size) if size is not None else int(data.x.nbytes + data.y.nbytes)


def _count(traffic: dict[str, dict[str, int]], device: str, agent: DeviceAgent) -> None:
    """Add ``agent``'s bytes in and out and tasks to ``traffic[device]``."""
    mine = traffic.setdefault(device, dict.fromkeys(TRAFFIC, 0))
    for key, value in zip(TRAFFIC, (agent.bytes_in, agent.bytes_out, agent.tasks_done)):
        mine[key] += value
