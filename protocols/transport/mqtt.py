"""MQTT transport on paho-mqtt 2.x (MQTT 3.1.1, QoS 1).

The network side (paho's own thread, or a shared :class:`~.reactor.Reactor` that drives many
connections from one thread) only receives, reassembles chunks and counts bytes; every handler runs
on the node's :class:`EventLoop`. With ``persistent`` the MQTT session survives a disconnect (MQTT 3.1.1
``clean_session=False``, under a client id that is stable across restarts of the node): the broker
keeps the node's subscriptions and queues QoS-1 messages for it while it is away, and a broker with
persistence keeps them across its own restart. Either way the transport remembers its subscriptions
and re-issues them on every (re)connect, and paho re-sends every QoS-1 publish not yet acknowledged
(receivers de-duplicate by message id, chunks by content id). What the broker delivers from a resumed
session before the node has subscribed a handler for it (it comes right after the CONNACK) is held, bounded
(``protocols.transport.hold``), and handed to the first handler subscribed to a matching pattern.
A lost connection is re-established with exponential backoff
(with a reactor: jittered from ``backoff_seed``, and a broker that hangs up before its CONNACK, e.g.
at a connection rate limit, is retried the same way when ``retry_refused``). Messages larger than
``max_chunk`` travel as chunks (``protocols.wire.chunking``); handlers only see whole messages.
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt

from ..wire import chunking
from ..wire.envelope import Segments
from .base import EventLoop, Handler, TimerHandle, Transport, Will
from .connecting import Connecting
from .hold import Hold, HoldLimits
from .inbound import Inbound
from .paho_client import (
    Credentials,
    linger_on_disconnect,
    mark_connected,
    new_client,
    nodelay,
    round_trip,
    say_reconnected,
    stop_thread,
    wait_answer,
    wait_lingered,
)
from .reactor import Reactor
from .subscriptions import broker_filters
from .traffic import TransportStats, publish_packet_bytes

log = logging.getLogger(__name__)
TAKEN_OR_CUT = (
    "the broker or the network closed it: a network fault, a broker that stopped, or another client that connected "
    "under this client id"
)
"""Why a connection was lost, where the broker gave no reason (paho: "Unspecified error")."""


class MqttTransport(Connecting, Inbound, Transport):
    """One node's MQTT connection. Call :meth:`connect` before use, :meth:`close` at the end."""

    # scalar state, per instance once assigned: the connection ...
    _connected = False
    _closed = False
    _ever_connected = False
    _connack_reason: Any = None
    _deadline = 0.0  # of the first connect
    _connect_error: ConnectionError | None = None
    _attempts = 0  # failed (re)connect attempts in a row
    _refusals = 0  # reconnects in a row refused or hung up on before their CONNACK
    _refused_for = 0.0  # ... the delays after them, summed (REFUSED_PATIENCE)
    _connack_refused = False  # the last CONNACK refused the connection (said): its hang-up that follows is no news
    _final = False  # a lost connection is not re-established (stay_down)
    # ... its subscriptions ...
    _sub_sending = 0  # SUBSCRIBEs decided on but not yet registered as pending
    _gen = 0  # connection generation: SUBACK bookkeeping of an older connection is void
    # ... the wire and the session
    _chunk_auth: chunking.ChunkAuth | None = None
    _expiry: TimerHandle | None = None
    sessions_lost = 0  # reconnects of a persistent client that found no session at the broker
    on_session_lost: Callable[[], None] | None = None  # then called (network thread): re-announce
    on_reconnected: Callable[[], None] | None = None  # called (network thread) at each reconnect, the session lost
    # or not: a broker restored from its last autosave resumes sessions without what it took since
    own_drop_line = False  # its user says a lost connection itself (fedtier monitor's line): this one's then at info

    def __init__(
        self,
        client_id: str,
        loop: EventLoop,
        host: str = "127.0.0.1",
        port: int = 1883,
        *,
        username: str | None = None,
        password: str | None = None,
        ca_certs: str | None = None,
        certfile: str | None = None,
        keyfile: str | None = None,
        will: Will | None = None,
        keepalive: int = 30,
        max_chunk: int = chunking.DEFAULT_MAX_CHUNK,
        chunk_timeout: float = chunking.DEFAULT_TIMEOUT,
        max_reassembly_bytes: int = chunking.DEFAULT_MAX_BYTES,
        max_message_bytes: int | None = None,
        reconnect_min_delay: float = 1.0,
        reconnect_max_delay: float = 30.0,
        max_inflight: int = 64,
        reactor: Reactor | None = None,
        backoff_seed: int | None = None,
        retry_refused: bool = False,
        persistent: bool = False,
        hold: HoldLimits = HoldLimits(),
    ) -> None:
        """``persistent``: keep the broker-side session across disconnects (see the module doc);
        ``hold`` bounds what such a session delivers before its handler is subscribed.
        ``reactor``: drive the connection from that shared I/O thread instead of a paho thread
        of its own. ``backoff_seed`` seeds the reconnect jitter; ``retry_refused``: a broker that
        closes the connection before its CONNACK is retried until the connect timeout."""
        if max_chunk <= chunking.HEADER_BYTES:
            raise ValueError(f"max_chunk must exceed {chunking.HEADER_BYTES} bytes")
        self.client_id, self.loop, self.host, self.port = client_id, loop, host, port
        self.keepalive, self.max_chunk, self.will, self.persistent = keepalive, max_chunk, will, persistent
        self.stats = TransportStats()
        self.drop_expected: str | None = None
        """What this connection is doing while a lost connection is expected (``protocols.twin``'s check: a live
        process of the node takes its session back): a drop then is said at info, with it, not warned of."""
        self._cv = threading.Condition()
        self._subs: dict[str, tuple[int, list[Handler]]] = {}  # pattern -> (qos, handlers)
        self._at_broker: dict[str, int] = {}  # pattern -> qos subscribed at the broker
        self._suback_pending: set[int] = set()
        self._suback_early: set[int] = set()
        self._unacked: set[int] = set()  # mids of QoS-1 publishes awaiting PUBACK
        self._acked_early: set[int] = set()  # PUBACKs that beat publish() to the bookkeeping
        self._held = Hold(client_id, hold)  # messages of a resumed session that came before their handler
        self._taking: Callable[[], None] | None = None  # the acknowledgement of the message being handled
        self._keep: Callable[[], None] | None = None  # ... its handler's share of it (``keep_ack``)
        self._unsubscribed: set[str] = set()  # patterns given up: late deliveries on them are not held
        self._reassemble(chunk_timeout, max_reassembly_bytes, max_message_bytes)
        self._connack = threading.Event()
        self._gone = threading.Event()  # the socket is closed after close()
        self._reactor, self._retry_refused = reactor, retry_refused
        self._backoff = (reconnect_min_delay, reconnect_max_delay)
        self._rng = random.Random(backoff_seed)
        self._creds = Credentials(username, password, ca_certs, certfile, keyfile)
        self._client = new_client(client_id, persistent, self._creds, will, max_chunk, self._backoff, max_inflight)
        self._attach(self._client, reactor)

    def _attach(self, c: mqtt.Client, reactor: Reactor | None) -> None:
        """Route paho's callbacks here; hand ``c`` to ``reactor``, or let paho's thread drive it (TCP_NODELAY)."""
        c.on_connect, c.on_disconnect = self._on_connect, self._on_disconnect
        c.on_message, c.on_subscribe, c.on_publish = self._on_message, self._on_subscribe, self._on_publish
        if reactor is not None:
            reactor.add(c)  # sets the socket callbacks (the reactor sets TCP_NODELAY itself)
        else:
            c.on_socket_open = nodelay

    @classmethod
    def from_url(cls, url: str, client_id: str, loop: EventLoop, **kwargs: Any) -> MqttTransport:
        from .broker import parse_broker_url

        host, port = parse_broker_url(url)
        return cls(client_id, loop, host, port, **kwargs)

    # -- lifecycle -------------------------------------------------------------------------
    def _drop_socket(self) -> None:
        """Reactor thread: close the socket without DISCONNECT and forget the client."""
        try:
            self._client._sock_close()  # paho 2.x: closes the socket and calls on_socket_close
        finally:
            assert self._reactor is not None
            self._reactor.discard(self._client)
            self._gone.set()

    def close(self, flush_timeout: float = 5.0) -> None:
        """Disconnect cleanly (the broker discards the will) after waiting up to ``flush_timeout``
        for outstanding publishes to be acknowledged. The socket is closed once the broker closed its side
        (``paho_client.linger_close``: closed before, the broker could drop the connection as lost and say the will);
        off the network thread, this waits for that too (up to ``paho_client.LINGER_WAIT`` seconds), so a connection
        opened next under the same client id does not take this one over (the broker would say the will then too).
        A broker that let such a wait time out is not waited for until it answers again (``paho_client.wait_answer``:
        closing many connections to a hung broker costs one wait, not one each)."""
        if self._closed:
            return
        if self._connected:
            flushed = wait_answer(self._client, self.flush, flush_timeout)  # (not waited for a silent broker)
            if self._taking is not None:  # closed by the handler of a message (or while it runs): it was taken
                self._taking()
            if self.persistent and (self._acked_since_publish or not flushed):
                self._settle(flush_timeout)
        self._closed = True
        with self._cv:
            self._held.clear()
            self._cv.notify_all()  # wait_subscribed returns
        self.loop.cancel(self._expiry)
        lingers = self._connected and linger_on_disconnect(self._client)
        if self._reactor is None:
            self._client.disconnect()
            stop_thread(self._client)
            if lingers and threading.current_thread() is not self._client._thread:
                wait_lingered(self._client)
            return
        if self._connected:  # the reactor writes DISCONNECT, then closes the socket (lingering)
            self._client.disconnect()
            self._reactor.wake(self._client)
        else:
            self._reactor.run_soon(self._drop_socket)
        if self._reactor.running and not self._reactor.in_thread():
            self._gone.wait(2.0)
            if lingers:
                wait_lingered(self._client)

    def _settle(self, timeout: float) -> None:
        """Wait (up to ``timeout``) until the broker has read the acknowledgements this persistent client wrote, by a
        PINGREQ's round trip: Mosquitto reads one packet a connection per turn of its loop, so a node that closed and
        at once opened its next session (a cloud per job) could have its CONNECT read first, the old connection taken
        over with its PUBACKs unread, and messages it had handled handed again to the next session (a chunked one's
        set in part, which then held the unacknowledged-chunk budget until it expired)."""
        network = (
            self._reactor.in_thread()
            if self._reactor is not None
            else self._client._thread is threading.current_thread()
        )
        if network or timeout <= 0:  # the network thread cannot wait for its own read
            return
        wake = (lambda: self._reactor.wake(self._client)) if self._reactor is not None else (lambda: None)
        if not wait_answer(self._client, lambda t: round_trip(self._client, t, wake), timeout):
            log.debug("%s: no PINGRESP within %.1f s before closing", self.client_id, timeout)

    def crash(self) -> None:
        """For tests: drop the TCP connection without DISCONNECT, so the broker fires the will."""
        if self._closed:
            return
        self._closed = True
        self.loop.cancel(self._expiry)
        if self._reactor is not None:
            self._reactor.run_soon(self._drop_socket)
            self._gone.wait(2.0)
            return
        self._no_reconnect()
        sock = self._client.socket()
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # type: ignore[attr-defined]  # paho's SocketLike: a real socket here
            except OSError:
                pass
        stop_thread(self._client)

    def _abort(self) -> None:
        self._closed = True
        if self._reactor is not None:
            self._reactor.run_soon(self._drop_socket)
            return
        self._no_reconnect()
        self._client.disconnect()
        stop_thread(self._client)

    def stay_down(self) -> None:
        """Do not re-establish this connection once lost (a refused second process of a node leaving: its session's
        live process takes the session back meanwhile, and a reconnect would take it over once more); :meth:`flush`
        then returns at once."""
        self._final = True
        if self._reactor is None:
            self._no_reconnect()

    def _no_reconnect(self) -> None:
        # paho 2.2 only takes reconnect_on_failure in the constructor; without this, its network
        # thread would sit in the reconnect backoff (or even reconnect) before loop_stop() returns.
        self._client._reconnect_on_failure = False

    @property
    def connected(self) -> bool:
        return self._connected and not self._closed

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def reconnects(self) -> int:
        """Connections made after the first: each follows a lost one (a network fault, or the broker replacing
        this connection by another with the same client id)."""
        with self._cv:
            return max(0, self._gen - 1)

    def persist(self, keep: bool = True) -> None:
        """Keep the session from the next (re)connect on (a clean connection that became worth keeping); ``keep``
        False: a clean session from the next reconnect on, and what this one delivered before its handler came is
        dropped (a connection that resumed a session only not to end it: ``protocols.twin.NodeTwin.borrow``)."""
        self.persistent = keep
        self._client._clean_session = not keep  # paho reads it for every CONNECT
        if not keep:
            with self._cv:
                self._held.clear()

    # -- Transport -------------------------------------------------------------------------
    def publish(
        self, topic: str, payload: bytes | memoryview | Segments, *, qos: int = 1, retain: bool = False
    ) -> None:
        if self._closed:
            log.debug("%s: publish on %s after close dropped", self.client_id, topic)
            return
        payload = bytes(payload)  # (paho takes one buffer: a message's segments joined here)
        parts = chunking.split(payload, self.max_chunk, topic=topic, auth=self._chunk_auth)
        if retain and len(parts) > 1:
            raise ValueError(f"retained message on {topic} is {len(payload)} bytes; it must fit in one chunk")
        tlen = len(topic.encode())
        with self.stats._lock:
            self.stats.messages_out += 1
        if qos:  # cleared before it is queued: its PUBACK confirms the acknowledgements written before it
            self._acked_since_publish = False
        infos = []
        for part in parts:
            infos.append(self._client.publish(topic, part, qos=qos, retain=retain))
            self.stats._count(topic, publish_packet_bytes(tlen, len(part), qos), len(part), out=True)
        if self._reactor is not None:
            self._reactor.wake(self._client)
        if qos:
            with self._cv:
                for info in infos:
                    if info.mid in self._acked_early:
                        self._acked_early.discard(info.mid)
                    else:
                        self._unacked.add(info.mid)

    def subscribe(self, pattern: str, handler: Handler, *, qos: int = 1, segments: bool = False) -> None:
        with self._cv:
            old_qos, handlers = self._subs.get(pattern, (qos, []))
            self._subs[pattern] = (max(qos, old_qos), [*handlers, handler])
            self._unsubscribed.discard(pattern)
            for topic, payload in self._held.take(pattern) if len(self._held) else ():
                self.loop.post(self._bind(pattern, handler, topic, payload))
        self._sync_broker_subs()

    def unsubscribe(self, pattern: str) -> None:
        with self._cv:
            self._subs.pop(pattern, None)
            self._unsubscribed.add(pattern)
            self._held.take(pattern)  # held for a handler that will not come: dropped
        self._sync_broker_subs()

    def _wanted(self) -> dict[str, int]:
        """Broker-level subscriptions (caller holds ``_cv``): :func:`~.subscriptions.broker_filters`."""
        return broker_filters(self._subs)

    def _sync_broker_subs(self) -> None:
        with self._cv:
            wanted = self._wanted()
            add = [(p, q) for p, q in wanted.items() if self._at_broker.get(p) != q]
            drop = [p for p in self._at_broker if p not in wanted]
            live = self._connected and not self._closed
            if live:
                self._at_broker = wanted
                self._sub_sending += bool(add)
            gen = self._gen
        if live:
            if add:
                self._send_subscribe(add, gen)
            if drop:  # after subscribing the wider filters, so nothing falls through the gap
                self._client.unsubscribe(drop)
            if self._reactor is not None:
                self._reactor.wake(self._client)

    # -- waiting helpers -------------------------------------------------------------------
    def wait_subscribed(self, timeout: float = 10.0) -> bool:
        """Block until connected and every subscription so far is acknowledged by the broker (True), or ``timeout``
        passed or the transport was closed (False: a closed connection is acknowledged nothing more, so a waiter
        whose node closed it meanwhile, e.g. a device that sits the round out, returns at once)."""
        with self._cv:
            subscribed = lambda: self._connected and not self._suback_pending and not self._sub_sending  # noqa: E731
            return self._cv.wait_for(lambda: self._closed or subscribed(), timeout) and not self._closed

    def flush(self, timeout: float = 10.0) -> bool:
        """Block until every QoS-1 publish so far is acknowledged by the broker (True), or ``timeout`` passed or the
        connection was lost for good (:meth:`stay_down`)."""
        with self._cv:
            gone = lambda: self._final and not self._connected  # noqa: E731
            return self._cv.wait_for(lambda: not self._unacked or gone(), timeout) and not self._unacked

    # -- paho callbacks (network thread) ---------------------------------------------------
    def _on_connect(self, client: mqtt.Client, _u: Any, flags: Any, reason: Any, _props: Any) -> None:
        self._connack_reason = reason
        self._connack_refused = reason.is_failure
        if reason.is_failure:  # a first connect's refusal is raised by finish_connect; a reconnect's said here
            if self._ever_connected:
                self._say_refused_again(reason)
            self._connack.set()
            return
        with self._cv:
            self._connected = True
            self._at_broker = self._wanted()  # re-issued even on a resumed session (the broker may have lost it)
            subs = list(self._at_broker.items())
            self._sub_sending += bool(subs)
            self._gen += 1
            gen = self._gen
            self._suback_pending.clear()
            self._suback_early.clear()
            self._cv.notify_all()
        self._attempts = self._refusals = 0
        self._refused_for = 0.0
        mark_connected(client)  # (its reconnect delay: paho_client.LONG_LIVED)
        lost = self.persistent and self._ever_connected and not getattr(flags, "session_present", False)
        if lost:  # the broker expired it (persistent_client_expiration) or lost its state: say so
            self.sessions_lost += 1
        if reconnect := self._ever_connected:
            say_reconnected(self.client_id, f"{self.host}:{self.port}", lost, flags, len(subs))
        self._ever_connected = True
        if subs:
            self._send_subscribe(subs, gen)
        self._connack.set()
        if lost and self.on_session_lost is not None:
            self.on_session_lost()
        if reconnect and self.on_reconnected is not None:
            self.on_reconnected()

    def _on_disconnect(self, client: mqtt.Client, _u: Any, _flags: Any, reason: Any, _props: Any) -> None:
        if not self._connack.is_set():  # hung up before the first CONNACK: connect() fails at once
            if (
                self._reactor is not None
                and self._retry_refused
                and not self._closed
                and time.monotonic() + 0.2 < self._deadline
            ):
                self._hung_up()
                self._retry_later()
                return
            self._connack.set()
            return
        with self._cv:
            was_connected, self._connected = self._connected, False
            self._suback_pending.clear()
            self._cv.notify_all()
        if self._closed:
            if self._reactor is not None:
                self._reactor.discard(self._client)
            self._gone.set()
            return
        if was_connected:  # (paho names a hang-up of MQTT 3.1.1, which gives no reason, "Unspecified error")
            why = TAKEN_OR_CUT if str(reason) == "Unspecified error" else reason
            expected = self.drop_expected
            level = logging.INFO if expected or self.own_drop_line else logging.WARNING
            during = f" while {expected}" if expected else ""
            log.log(
                level,
                "%s: lost connection to %s:%s (%s)%s; reconnecting",
                self.client_id,
                self.host,
                self.port,
                why,
                during,
            )
        elif self._connack_refused:  # the broker's hang-up after its CONNACK refused the connection, said then
            self._connack_refused = False
        else:  # a reconnect hung up on before its CONNACK (e.g. a revoked certificate): why, then rarely
            self._say_refused_again(None)
        if self._reactor is not None and not self._final:
            self._retry_later(refused=not was_connected)  # refused: backs off further

    def _send_subscribe(self, subs: list[tuple[str, int]], gen: int) -> None:
        """Send a SUBSCRIBE; the caller has counted it in ``_sub_sending`` (so that
        :meth:`wait_subscribed` cannot slip in between the decision and the bookkeeping)."""
        try:
            rc, mid = self._client.subscribe(subs)
        except Exception:
            rc, mid = None, None
            log.exception("%s: subscribe %s failed", self.client_id, subs)
        with self._cv:
            self._sub_sending -= 1
            self._cv.notify_all()
            if rc != mqtt.MQTT_ERR_SUCCESS or mid is None or gen != self._gen:
                return  # not connected, or reconnected meanwhile: on_connect subscribes again
            if mid in self._suback_early:
                self._suback_early.discard(mid)
            else:
                self._suback_pending.add(mid)

    def _on_subscribe(self, client: mqtt.Client, _u: Any, mid: int, reasons: list[Any], _props: Any) -> None:
        for r in reasons:
            if r.is_failure:
                log.warning("%s: broker rejected a subscription: %s", self.client_id, r)
        with self._cv:
            if mid in self._suback_pending:
                self._suback_pending.discard(mid)
            else:
                self._suback_early.add(mid)
            self._cv.notify_all()

    def _on_publish(self, client: mqtt.Client, _u: Any, mid: int, _reason: Any, _props: Any) -> None:
        with self.stats._lock:
            self.stats.acked += 1
        with self._cv:
            if mid in self._unacked:
                self._unacked.discard(mid)
                if not self._unacked:
                    self._cv.notify_all()
            else:
                if len(self._acked_early) > 1024:  # acks of publishes made behind our back
                    self._acked_early.clear()
                self._acked_early.add(mid)
