"""One process per node id: a second agent, cloud or cell process started under a live node's id is refused
loudly (agents: ``edge_agent.runner``; the long-lived cloud and cells: ``cloud.service``, ``cell_server.service``).

Two processes with one node id share one broker session (the client id is the node's; provisioned brokers
force it from the login), so each connection takes the session from the other, silently, without end. So
every such process draws a random *instance* nonce and puts it in its (signed) status records, and a cloud or
cell in its will too. Before it announces anything, a starting process listens on its nodes' own status topics
for ``window`` seconds (:func:`twin_window`): a record of another instance seen *twice* is live (the broker
hands the retained copy once per subscription; a second copy is a heartbeat, a re-announce, the retained copy
again after the live process took the session back and this one reconnected, or the live one's will, which
Mosquitto publishes at a takeover only where one of the two connections is clean: 2.0.11 checked, none between two
persistent ones), and the process refuses to start (:class:`TwinError`). A single copy is
what a crashed predecessor left retained (its last record, or its will): it does not block a restart. Where
the broker retains no status record for the ids at all (no process announced under them yet), the check ends
after a second. Once it runs, a record of an instance started before this one (its nonce says when) is its
predecessor's, handed again by a broker restored from an older save: it announces itself again, no twin. The
refused process leaves a retained ``duplicate`` status record naming itself (readers
ignore that state), so the running process, which gets its own status topic's retained record again when it
reconnects after the takeover, says loudly that another process took its session, and re-announces itself.
What the broker hands a checking process from the session it took over (meant for the live process) is not
acknowledged until the check passed (:meth:`NodeTwin.borrow`): a refused one leaves it to the live process, which the
broker hands it to again as it takes its session back (after ``paho_client.TAKEN_BACK_DELAY``, not the reconnect delay).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from protocols.status import encode_status
from protocols.transport.mqtt import MqttTransport
from protocols.wire import topics
from protocols.wire.envelope import WireError
from protocols.wire.signed import open_record, signer_of

if TYPE_CHECKING:
    from protocols.transport.base import Transport
    from protocols.transport.threadloop import ThreadLoop
    from protocols.wire.keys import Trust

log = logging.getLogger("fedtier.twin")
T = TypeVar("T")

GRACE = 1.0
"""Seconds a check waits for the retained record of its nodes' status topics (sent right after the
SUBACK) before it concludes there is none."""
DUPLICATE = "duplicate"
"""The status state a refused second process leaves (not online/offline/idle: ``decode_status`` ignores it)."""
LIVE_STATES = ("online", "idle")
"""A process's own records it re-announces after a takeover (not its will's ``offline``)."""
TAKEOVER_STATES = ("offline", DUPLICATE)
"""Another instance's records that say it took this process's session: its will (the broker publishes it when this
process takes the session back) or its refusal."""


class TwinError(ConnectionError):
    """Another process is live under this node's id."""

    @classmethod
    def of(cls, noun: str, node: str, kind: str, other: str) -> TwinError:
        """The refusal of a second ``kind`` process for ``node`` (``other``: the live one's instance)."""
        return cls(
            f"{noun} {node}: another {kind} process (instance {other}) is live under this {noun} id on the broker: "
            f"refusing to start a second one (two {kind}s with one id take the broker session from each other); "
            f"stop the other {kind} first"
        )


def twin_window(heartbeat: float) -> float:
    """How long a starting process listens (seconds): one heartbeat and a second, and at least the two
    reconnects a takeover takes to show (the live process's, then this one's, each within 1.5 x the
    transport's 1 s minimum reconnect delay: the two share one broker session, so the live one's records
    reach this one only as the retained copy re-sent when this one connects again, or its will)."""
    return max(heartbeat, 3.0) + 1.0


def new_instance() -> str:
    """A per-process nonce, then when the process started (Unix seconds, hex: :func:`started_of`). Deliberately not
    drawn from the run seed: two processes of one config must differ, which is the whole point."""
    return f"{secrets.token_hex(8)}-{int(time.time()):x}"


def started_of(instance: str) -> int | None:
    """When the process of ``instance`` started (:func:`new_instance`), or ``None`` (a nonce of an older version)."""
    nonce, _, started = instance.rpartition("-")
    if not nonce or not 0 < len(started) <= 12 or started.strip("0123456789abcdef"):
        return None
    return int(started, 16)


class TwinWatch:
    """Reads one process's nodes' own status topics: during :meth:`check` it counts other instances'
    records; afterwards such a record means another process took a node's session (``on_taken``).
    ``kind`` (agent, cloud, cell) and ``noun`` (device, node) name them in what it logs."""

    def __init__(self, instance: str, kind: str = "agent", noun: str = "device") -> None:
        self.instance, self.kind, self.noun = instance, kind, noun
        self.checking = False
        self.seen: dict[str, list[str]] = {}  # node -> other instances' records seen during the check
        self.twin: tuple[str, str] | None = None  # (node, instance) found live
        self.taken = 0  # records of another instance seen while running (takeovers noticed)
        self.own: dict[str, bytes] = {}  # topic -> this process's latest online/idle record there (re-announced)
        self._found = threading.Event()
        self._any = threading.Event()  # a record of another instance seen during the check
        self._live_others: set[str] = set()  # other instances whose own live records were seen (said once)
        self._counted_at: dict[tuple[str, int], float] = {}  # (node, connection) -> when a record last counted
        self._late: dict[str, float] = {}  # a predecessor seen in the check -> when its first late record came
        self._said_taken: set[tuple[str, bool]] = set()  # (other instance, its refusal?) takeovers said
        self._said_old: set[str] = set()  # predecessors whose records a broker handed again, said

    def on_status(
        self, node: str, topic: str, data: bytes, verify: Any, on_taken: Callable[[], None], epoch: int | None = None
    ) -> None:
        """A record on ``node``'s own status topic (signed by the node when ``verify`` is given). ``epoch``: the
        connection it came on (a transport's reconnect count): another instance's records on one connection within
        :data:`GRACE` of each other count once (what the node's persistent session held for it, e.g. a crashed
        predecessor's last record still in flight and its will, then the retained record: one burst as it
        connects); a live process shows again on the next connection (its retained record handed again), or by a later
        beat."""
        if not data:
            return
        if self.instance.encode() in data:  # this process's own records (its heartbeats come back)
            self._keep_own(topic, data)
            return
        try:
            record = open_record(data, topic, signer_of(topic), verify)
        except WireError:
            return  # a forged or malformed record says nothing about who holds the session
        other = record.get("instance")
        if not isinstance(other, str) or other == self.instance:
            return
        if self.checking:
            if epoch is not None:  # what the broker hands at once as this one connects counts once
                now, last = time.monotonic(), self._counted_at.get((node, epoch))
                if last is not None and now - last < GRACE:
                    return
                self._counted_at[(node, epoch)] = now
            seen = self.seen.setdefault(node, [])
            seen.append(other)
            self._any.set()
            if len(seen) >= 2 and self.twin is None:
                self.twin = (node, other)
                self._found.set()
            return
        if self._predecessors_late_record(node, other):
            return
        if self._predecessor(other):  # its record again: a broker restored from a save taken before this one started
            self._said_predecessor(node, other)
            on_taken()  # (this one's own replaces it)
            return
        if record.get("state") not in TAKEOVER_STATES:  # another live process's own record, not a takeover's trace
            self._other_live(node, other)
            return
        self._say_taken(node, other, refused=record.get("state") == DUPLICATE)
        self.taken += 1  # after the log line: a reader of the count finds the line written
        on_taken()

    def _say_taken(self, node: str, other: str, refused: bool) -> None:
        """Say a takeover once per other instance and kind of record: its will (a live process: stop one) at error,
        its refusal (it exited: nothing to stop) at warning. The broker hands a refusal twice as this process takes
        its session back (queued in the session, then retained), which said it twice, each time 'stop the other one'
        of a process that had exited."""
        if (other, refused) in self._said_taken:
            return
        self._said_taken.add((other, refused))
        took = (
            f"{self.noun} {node}: another {self.kind} process (instance {other}) connected under this {self.noun} id "
            f"and took this {self.kind}'s broker session"
        )
        if refused:
            log.warning(
                "%s for a moment; it was refused and exited, nothing to stop (this one, instance %s, re-announces "
                "itself)",
                took,
                self.instance,
            )
            return
        log.error(  # a takeover is rare and must be seen
            "%s: two %ss with one id take the session from each other; stop the other one (this one, instance %s, "
            "re-announces itself)",
            took,
            self.kind,
            self.instance,
        )

    def _predecessors_late_record(self, node: str, other: str) -> bool:
        """A record of the instance the check saw once (a crashed predecessor) coming after the check, in one burst:
        what its persistent session queued for this one (its will, its last status), held until a job's handler of
        that topic came (a resumed job's). Not a takeover: said at info; a later record of it is one."""
        if other not in self.seen.get(node, ()):
            return False
        now = time.monotonic()
        first = self._late.setdefault(other, now)
        if now - first >= GRACE:
            return False
        log.info("%s %s: a record its predecessor (instance %s) left on the broker came late", self.noun, node, other)
        return True

    def _predecessor(self, other: str) -> bool:
        """Whether ``other`` is an instance started before this one (its nonce says when: :func:`started_of`). A live
        one would have refused this one's start (its check); its record after the check is its last one, handed again
        by a broker restored from an older save (an autosave taken before this process started), not a twin's."""
        mine, theirs = started_of(self.instance), started_of(other)
        return mine is not None and theirs is not None and theirs < mine

    def _said_predecessor(self, node: str, other: str) -> None:
        if other not in self._said_old:
            self._said_old.add(other)
            log.info(
                "%s %s: the broker handed again a record of its predecessor (instance %s, started before this %s): "
                "announcing itself again",
                self.noun,
                node,
                other,
                self.kind,
            )

    def _other_live(self, node: str, other: str) -> None:
        """Another process's own online/idle record while this one runs (both started unchecked): said once per
        instance (re-announcing would answer its re-announce, without end)."""
        if other not in self._live_others:
            self._live_others.add(other)
            log.error(
                "%s %s: another %s process (instance %s) announces itself under this %s id; stop one of them",
                self.noun,
                node,
                self.kind,
                other,
                self.noun,
            )

    def _keep_own(self, topic: str, data: bytes) -> None:
        try:  # its own record: no signature to check
            record = open_record(data, topic, signer_of(topic), None)
        except WireError:
            return
        if record.get("instance") == self.instance and record.get("state") in LIVE_STATES:
            self.own[topic] = data

    def check(
        self, window: float, grace: float = GRACE, wait: Callable[[threading.Event, float], bool] | None = None
    ) -> tuple[str, str] | None:
        """Wait up to ``window`` seconds for a live record of another instance: ``(node, instance)``,
        or ``None`` (none live: start). Call with :attr:`checking` set before subscribing. If no record of
        another instance came within ``grace`` seconds (the broker retains none: no process ever announced
        under these ids, or only this one), there is no other process: start at once. ``wait(event,
        seconds)``: how this thread waits for an event (default ``event.wait``; a service whose loop this
        thread drains runs it meanwhile)."""
        wait = wait or (lambda event, seconds: event.wait(seconds))
        start = time.monotonic()
        if wait(self._any, min(window, grace)):
            wait(self._found, max(0.0, window - (time.monotonic() - start)))
        self.checking = False
        return self.twin

    def refusal(self, topic: str, trust: Any) -> bytes:
        """The retained record a refused process leaves on its node's status topic."""
        return encode_status(
            DUPLICATE, topic=topic, trust=trust, instance=self.instance, reason="that process was refused and exited"
        )


class NodeTwin:
    """The check of a long-lived cloud or cell (``fedtier cloud|cell --serve``), one node per process: its
    first connection refuses to start if another process of ``node`` is live (:meth:`guard`); each later one
    watches for another taking its session, and re-announces the node's last status if one did. ``window``:
    :data:`NODE_WINDOW`, ``None``: no check (nodes of one process, tests)."""

    def __init__(
        self,
        fed: str,
        node: str,
        kind: str,
        window: float | None,
        trust: Trust | None,
        topic: str | None = None,
        noun: str = "node",
    ) -> None:
        """``topic``: the node's status topic, if not ``status/{node}`` (a device's, under its cell: a long-lived
        agent's watch connection before its first job, ``noun`` ``device``)."""
        self.node, self.kind, self.window, self.trust = node, kind, window, trust
        self.topic = topic or topics.status(fed, node)
        self.watch = TwinWatch(new_instance(), kind, noun)
        self._checked = False
        self._clean: MqttTransport | None = None  # a clean connection borrowed as persistent for the check

    @property
    def instance(self) -> str:
        return self.watch.instance

    def borrow(self, transport: T) -> T:
        """``transport``, not yet connected, of the node's session: if its connection is the one to check, it holds
        back its acknowledgements until the check passed (``MqttTransport.defer_acks``). The check takes the session
        over from a live process of the node for a moment: what the broker had in flight to that process, or sent
        meanwhile, comes to this one first, and acknowledged here it was lost to the live process (its round waited
        out its deadline for results the check took: 20 s measured, a cell's device deadline); held back, the broker
        hands it to the live process again as it takes its session back. A clean connection (a long-lived agent's
        watch) keeps the session for the check (connecting clean would end the live process's session, and what it
        queued), and is clean again once it passed."""
        if self.window is not None and not self._checked and isinstance(transport, MqttTransport):
            transport.defer_acks()
            if not transport.persistent:
                transport.persist()
                self._clean = transport
        return transport

    @property
    def extra(self) -> dict[str, str]:
        """What this process's status records (and will) carry: its instance."""
        return {"instance": self.watch.instance}

    def guard(self, transport: Transport, loop: ThreadLoop) -> None:
        """On a new connection of the service, before it subscribes to anything else (no job or request is taken
        meanwhile): its own status topic; the first time, the check: another live process of the node leaves this
        one a ``duplicate`` record, a clean disconnect (no will) and :class:`TwinError`."""
        if self.window is None:
            return
        watch = self.watch
        watch.checking = not self._checked
        verify = self.trust.verify if self.trust is not None else None

        will = getattr(transport, "will", None)

        def on_status(topic: str, data: bytes) -> None:
            reannounce = lambda: self._reannounce(transport)  # noqa: E731
            watch.on_status(self.node, topic, data, verify, reannounce, getattr(transport, "reconnects", None))
            if (
                will is not None
                and data == will.payload
                and topic == will.topic
                and getattr(transport, "reconnects", 0)
            ):
                # this process's own will, said by the broker while it lives (its connection was lost and is back: a
                # network blip): it read offline until its next beat, a cloud serving a job until the job ended. Its
                # own offline as it stops is another record (order-stamped). Only after this connection came back: an
                # earlier connection's will (the same bytes) said as this one took its session over may come after
                # this one's newer record, which a re-announce of the older would replace
                log.info(
                    "%s %s: the broker said its will (a lost connection): announcing itself again", self.kind, self.node
                )
                reannounce()

        transport.subscribe(self.topic, on_status, qos=0)  # (QoS 0: not queued behind the held-back acknowledgements)
        if self._checked:
            return
        self._checked = True
        mqtt = transport if isinstance(transport, MqttTransport) else None
        twin = self._check(transport, loop, self.window)
        if twin is None:
            if mqtt is not None:
                mqtt.release_acks()  # the session is this process's: what it received is taken
                if mqtt is self._clean:
                    mqtt.persist(keep=False)  # (what the session held for an earlier connection: dropped, as before)
            return
        refusal = TwinError.of(watch.noun, self.node, self.kind, twin[1])  # (said by whoever catches it: once)
        if mqtt is not None:
            mqtt.stay_down()  # taken back by the live process meanwhile: not taken over once more
        transport.publish(self.topic, watch.refusal(self.topic, self.trust), qos=1, retain=True)
        if mqtt is not None:
            mqtt.flush(5.0)
        transport.close()  # a clean DISCONNECT: no will, the live process's status stays; nothing acknowledged
        raise refusal

    def _check(self, transport: Transport, loop: ThreadLoop, window: float) -> tuple[str, str] | None:
        """The first connection's check; a live process taking the session back meanwhile is expected (said at
        info: the refusal that follows says why, not a "lost connection" warning before it)."""
        watch, wait = self.watch, lambda event, seconds: _drain(loop, event, seconds)
        mqtt = transport if isinstance(transport, MqttTransport) else None
        if mqtt is not None:
            mqtt.drop_expected = f"checking that no other {self.kind} process is live under this id"
        try:
            settle = min(window, SETTLE)
            twin = watch.check(settle, wait=wait)
            if twin is None and getattr(transport, "reconnects", 0) > 0:  # taken over meanwhile: a session holder
                watch.checking = True
                twin = watch.check(window - settle, grace=0.0, wait=wait)
            return twin
        finally:
            if mqtt is not None:
                mqtt.drop_expected = None

    def _reannounce(self, transport: Transport) -> None:
        """The node's last online or idle record again (retained): the other process's will or refusal replaced it."""
        own = self.watch.own.get(self.topic)
        if own is not None:
            transport.publish(self.topic, own, retain=True)


SETTLE = 2.5
"""Seconds after which a cloud's or cell's check that saw another instance's records only as it connected (a
predecessor's, retained or held in its session) ends if its connection was never taken over: a live process would
have taken the session back within 1.5 s (its reconnect delay) and shown again."""
NODE_WINDOW = twin_window(0.0)
"""How long a long-lived cloud or cell listens as it starts, at most (4 s; :data:`SETTLE` when its session was not
taken over, 1 s when the broker holds no record of the node): the live one's retained record (its instance) is
handed to each of this one's connections, so a live one shows twice within two reconnects (the live one's, then
this one's), whatever its heartbeat."""


def _drain(loop: ThreadLoop, event: threading.Event, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``event``, running ``loop`` meanwhile unless another thread drains it."""
    if loop.running:
        return event.wait(seconds)
    return loop.run(until=event.is_set, timeout=seconds)
