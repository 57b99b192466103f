"""The paho-mqtt client a :class:`~.mqtt.MqttTransport` drives: MQTT 3.1.1, credentials, TLS, the will,
reconnect delays and the in-flight window set from the transport's options."""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from . import tls_reload
from .base import Will

log = logging.getLogger("protocols.transport.mqtt")


@dataclass(frozen=True)
class Credentials:
    """How a client authenticates: a broker login, and TLS (on when any of the three files is set)."""

    username: str | None = None
    password: str | None = None
    ca_certs: str | None = None  # the CA bundle that signed the broker's certificate
    certfile: str | None = None  # this node's client certificate
    keyfile: str | None = None  # and its private key

    @property
    def tls(self) -> bool:
        return bool(self.ca_certs or self.certfile or self.keyfile)


LONG_LIVED = 0.8
"""Seconds a connection lasted after which, lost, it is tried again after :data:`TAKEN_BACK_DELAY` rather than the
reconnect delay (1 s): a node whose session another client took over for a moment (a second process of the node, as
it checks whether the node is live: ``protocols.twin``), or whose network blipped, is back at once, and its job with
it; a broker that is down refuses that try, and the usual backoff follows. The other side of a takeover is back after
the reconnect delay, so two processes that keep taking one session from each other still back off: the one that came
back at once holds the session for less than this, and waits the delay next time."""
TAKEN_BACK_DELAY = 0.2
"""Seconds before the first try after a connection of :data:`LONG_LIVED` was lost."""


class _Client(mqtt.Client):
    """paho's client, whose reconnect backoff notices a stop (``disconnect``, ``loop_stop``) within 50 ms: paho
    sleeps it out in steps of up to 1 s, so closing a client its broker had just hung up on (a refused login, a
    listener without MQTT) took a second, and every command that then failed exited a second late. It counts its
    PINGREQs and their PINGRESPs, for :meth:`round_trip`."""

    connected_at = math.inf  # when its connection was last accepted (monotonic; set by the transport on CONNACK)

    def next_wait(self) -> float:
        """Seconds before the next reconnect attempt: paho's exponential backoff, as its own ``_reconnect_wait``
        computes it (from the minimum delay, reset by each accepted connection), but :data:`TAKEN_BACK_DELAY` first
        after a connection of :data:`LONG_LIVED`."""
        with self._reconnect_delay_mutex:
            last = self._reconnect_delay
            delay = self._reconnect_min_delay if last is None else min(last * 2, self._reconnect_max_delay)
            self._reconnect_delay = delay
            wait: float = delay
            if last is None and time.monotonic() - self.connected_at >= LONG_LIVED:
                wait = min(delay, TAKEN_BACK_DELAY)  # a connection of long standing lost: its first try at once
                self._reconnect_delay = None  # (a failed try after it waits the reconnect delay)
            self.connected_at = math.inf
            return wait

    def _reconnect_wait(self) -> None:
        until = time.monotonic() + self.next_wait()
        while not self._stopping() and (left := until - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))

    def _stopping(self) -> bool:
        gone = (mqtt._ConnectionState.MQTT_CS_DISCONNECTING, mqtt._ConnectionState.MQTT_CS_DISCONNECTED)
        return self._state in gone or self._thread_terminate

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._pong_cv = threading.Condition()  # PINGREQs sent and PINGRESPs received on this connection:
        self._pings = self._pongs = 0  # the broker answers them in order (round_trip)
        self.linger = False  # close the socket as a clean disconnect does: see _sock_close
        self.lingered = threading.Event()  # set once a lingering socket is closed
        self.lingered.set()
        super().__init__(*args, **kwargs)

    def _sock_close(self) -> None:
        """With :attr:`linger` (a clean disconnect: paho calls this right after writing the DISCONNECT), the socket is
        closed only once the broker closed its side (:func:`linger_close`, :attr:`lingered`); else at once."""
        sock = self._sock if self.linger else None
        if sock is None:
            super()._sock_close()
        else:
            self._sock, self.linger = None, False
            self.lingered.clear()
            try:
                self._call_socket_unregister_write(sock)
                self._call_socket_close(sock)
            finally:
                linger_close(sock, self.lingered, lambda: _answered(self))
        with self._pong_cv:
            self._pongs = self._pings  # a PINGREQ of this connection gets no answer now: round_trip stops waiting
            self._pong_cv.notify_all()

    def _send_pingreq(self) -> mqtt.MQTTErrorCode:
        with self._pong_cv:
            rc = super()._send_pingreq()
            self._pings += rc == mqtt.MQTT_ERR_SUCCESS
        return rc

    def _handle_pingresp(self) -> mqtt.MQTTErrorCode:
        rc = super()._handle_pingresp()
        with self._pong_cv:
            self._pongs += 1
            self._pong_cv.notify_all()
        return rc

    def _packet_handle(self) -> mqtt.MQTTErrorCode:
        if _silent:  # any packet from the broker (a CONNACK, PINGRESP, PUBACK, PUBLISH, SUBACK ...) is an answer
            _answered(self)
        return super()._packet_handle()

    def round_trip(self, timeout: float, wake: Callable[[], None] = lambda: None) -> bool:
        """Send a PINGREQ and wait up to ``timeout`` for its PINGRESP (``wake``: after queueing it, for a reactor):
        the broker reads a connection's packets in order, so it has then handled every one this client wrote before
        (its PUBACKs). False: no answer in time, or the connection was lost (then at once)."""
        with self._pong_cv:
            if self._send_pingreq() != mqtt.MQTT_ERR_SUCCESS:
                return False
            wanted = self._pings
        wake()
        with self._pong_cv:
            return self._pong_cv.wait_for(lambda: self._pongs >= wanted, timeout) and self.is_connected()


LINGER = 5.0
"""Seconds a cleanly disconnected socket waits for the broker to close its side before it is closed anyway."""


def linger_close(sock: Any, done: threading.Event, answered: Callable[[], None] = lambda: None) -> None:
    """Close ``sock``, on which a DISCONNECT was just written, as TCP's graceful close: no more writes (FIN), and
    what the broker still sends is read and dropped until it closes its side (it read the DISCONNECT: ``answered`` is
    called) or :data:`LINGER` seconds pass; then ``done`` is set. Closed at once, with the broker's answers to packets
    written before the DISCONNECT on their way (Mosquitto reads one packet a connection per turn of its loop; amqtt
    answers a SUBSCRIBE or an UNSUBSCRIBE from a task of its own), the socket made the broker's next write fail (broken
    pipe, the client's reset): the broker dropped the connection as lost, its DISCONNECT still unread, said its will.
    A long-lived cloud's job server, which drops the job's subscriptions as it closes, so read offline between jobs
    (6 of 20 jobs in a row on Mosquitto, 14 of 20 on amqtt: Mosquitto's log "Client ... disconnected: Broken pipe."
    and the will, before the cloud's next connection), until its next connection said idle."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:  # not connected any more: nothing to wait for
        sock.close()
        done.set()
        return

    def drain() -> None:
        deadline = time.monotonic() + LINGER
        try:
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                if not sock.recv(65536):
                    answered()
                    break
        except OSError:  # (a timeout, a reset)
            pass
        finally:
            sock.close()
            done.set()

    threading.Thread(target=drain, name="mqtt-linger", daemon=True).start()


LINGER_WAIT = 2.0
"""Seconds :meth:`MqttTransport.close` waits for the broker to close its side of a cleanly disconnected socket."""

_silent: set[tuple[str, int]] = set()  # brokers (host, port) that let a close's wait for an answer time out
_silent_lock = threading.Lock()


def _answered(c: mqtt.Client) -> None:
    """``c``'s broker answered (any packet it sent, or the close of its side of a lingering socket): not silent."""
    with _silent_lock:
        _silent.discard((c._host, c._port))


def wait_answer(c: mqtt.Client, wait: Callable[[float], bool], timeout: float) -> bool:
    """``wait(timeout)`` for an answer of ``c``'s broker as ``c`` closes (its PUBACKs, a PINGRESP, the close of its
    side of the socket); once such a wait timed out, ``wait(0)`` for every close to that broker until it answers again
    (:func:`_answered`). So a process closing many connections to a broker that stopped answering (SIGSTOPped, or
    a network that drops its packets), one after another, pays one timeout, not one each: an agent worker's hundreds
    of devices took minutes to stop (2 s each, 7 after a QoS-1 publish). What is not waited for still happens:
    the packets were written, and a lingering socket still drains in the background (:func:`linger_close`)."""
    key = (c._host, c._port)
    with _silent_lock:
        silent = key in _silent
    if wait(0.0 if silent else timeout):
        return True
    if timeout > 0:
        with _silent_lock:
            _silent.add(key)
    return False


def linger_on_disconnect(c: mqtt.Client) -> bool:
    """Make ``c``'s next DISCONNECT close its socket as :func:`linger_close` does; False for another client."""
    if not isinstance(c, _Client):
        return False
    c.linger = True
    return True


def wait_lingered(c: mqtt.Client, timeout: float | None = None) -> bool:
    """Wait up to ``timeout`` (:data:`LINGER_WAIT`) for ``c``'s lingering socket to be closed (:func:`linger_close`),
    as :func:`wait_answer` does."""
    if not isinstance(c, _Client):
        return True
    return wait_answer(c, c.lingered.wait, LINGER_WAIT if timeout is None else timeout)


def mark_connected(c: mqtt.Client) -> None:
    """``c``'s connection was accepted now (:data:`LONG_LIVED`)."""
    if isinstance(c, _Client):
        c.connected_at = time.monotonic()


def round_trip(c: mqtt.Client, timeout: float, wake: Callable[[], None] = lambda: None) -> bool:
    """:meth:`_Client.round_trip` (False for another client)."""
    return isinstance(c, _Client) and c.round_trip(timeout, wake)


def new_client(
    client_id: str,
    persistent: bool,
    creds: Credentials,
    will: Will | None,
    max_chunk: int,
    reconnect_delays: tuple[float, float],
    max_inflight: int,
) -> mqtt.Client:
    """A paho client for ``client_id`` (``persistent``: ``clean_session=False``), logged in and with TLS as
    ``creds`` say; its will must fit in one chunk of ``max_chunk`` bytes. The caller sets the callbacks and
    acknowledges each QoS-1 message it takes (``manual_ack``: one it drops while closing stays the session's)."""
    c = _Client(
        CallbackAPIVersion.VERSION2,
        client_id=client_id,
        clean_session=not persistent,
        protocol=mqtt.MQTTv311,
        manual_ack=True,
    )
    if creds.username is not None:
        c.username_pw_set(creds.username, creds.password)
    if creds.tls:
        c.tls_set(ca_certs=creds.ca_certs, certfile=creds.certfile, keyfile=creds.keyfile)
        tls_reload.track(c, creds.certfile, creds.keyfile, creds.ca_certs)  # renewed files taken on SIGHUP
    if will is not None:
        if len(will.payload) > max_chunk:
            raise ValueError("the will payload must fit in one chunk")
        c.will_set(will.topic, will.payload, qos=1, retain=will.retain)
    c.reconnect_delay_set(*reconnect_delays)  # type: ignore[arg-type]
    c.max_inflight_messages_set(max_inflight)
    c.max_queued_messages_set(0)  # unbounded: publish never fails while reconnecting
    return c


def stop_thread(c: mqtt.Client) -> None:
    """Stop ``c``'s network thread (``loop_start``) and close its wake-up socket pair, which paho 2.x leaves to
    ``__del__``: to the garbage collector, since the client's callbacks and their transport make a cycle."""
    c.loop_stop()
    if threading.current_thread() is not c._thread:  # (from its own thread, loop_stop cannot wait: left as it is)
        c._reset_sockets(sockpair_only=True)


def nodelay(_client: mqtt.Client, _u: Any, sock: Any) -> None:
    """paho leaves Nagle on: a small publish right after another would wait ~40 ms for an ACK."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):
        pass


class Refused(ConnectionError):
    """The broker refused this client: its login (a refusing CONNACK), its TLS handshake, or a hang-up before accepting
    it. Unlike an unreachable broker, retrying helps only once the broker's side (its logins, CA, revocation list) or
    this node's credentials change, e.g. never for a revoked node: a long-lived node still retries (a broker's
    password file or revocation list can be mended), backing off further and saying so rarely."""


REVOKED_CHECK = "the provisioning folder's roster.json then lists it as revoked"
"""How an operator tells a revoked node from a misconfigured one (the node itself cannot read its roster any more)."""


def hung_up_before_connack(where: str, client_id: str, creds: Credentials) -> Refused:
    """The error of a broker at ``where`` that closed the connection before its CONNACK, with the likely causes."""
    how = (
        "with TLS" + (", client certificate" if creds.certfile else ", no client certificate")
        if creds.tls
        else "without TLS"
    )
    return Refused(
        f"MQTT broker at {where} closed the connection of {client_id!r} ({how}) "
        "before accepting it: does its listener require TLS (ca_certs) or a client "
        "certificate signed by the broker's CA (certfile, keyfile)? Is this certificate revoked (its node revoked: "
        f"{REVOKED_CHECK}; or replaced by a renewal: fedtier provision revoke|renew)? Or is it at its connection limit?"
    )


def say_reconnected(client_id: str, where: str, lost: bool, flags: Any, patterns: int) -> None:
    """Log a reconnect of ``client_id`` to ``where``: a warning when the broker kept no session for a persistent
    client (``lost``: what was queued for it is gone), else which session it found."""
    if lost:
        log.warning(
            "%s: the broker %s kept no session for this client (expired after its persistent_client_expiration, "
            "the broker lost its state, or another process connected under this client id and took it over): "
            "messages queued for it while it was away are lost; resubscribing %d "
            "patterns and re-announcing",
            client_id,
            where,
            patterns,
        )
    else:
        session = "resumed" if getattr(flags, "session_present", False) else "new"
        log.info("%s: reconnected to %s (%s session), resubscribing %d patterns", client_id, where, session, patterns)
