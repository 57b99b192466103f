"""How :class:`~.mqtt.MqttTransport` connects: the first connect (a refused TCP connect retried until the
connect timeout; a failed TLS handshake, a refused CONNACK or a broker that hangs up before its CONNACK fails it,
the last retried with ``retry_refused``) and, with a reactor, every (re)connect attempt with jittered backoff.
While it retries it says so once (one line per broker address and process: an agent's devices share it), and a
connect that runs out of time fails with the reason it last saw (connection refused, name not resolved, closed
before its CONNACK), or "no CONNACK" when the broker took the connection but never answered."""

from __future__ import annotations

import logging
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, Self

import paho.mqtt.client as mqtt

from .paho_client import REVOKED_CHECK, Credentials, Refused, hung_up_before_connack

log = logging.getLogger("protocols.transport.mqtt")
_failing: set[str] = set()  # broker addresses a first connect said it retries, until one connects there
_failing_lock = threading.Lock()


def failure_kind(exc: OSError) -> str:
    """What a failed TCP connect to a broker means, in words: ``connection refused``, ``name not resolved``,
    ``timed out``, else ``unreachable``."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, socket.gaierror):
        return "name not resolved"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return "unreachable"


CONNECT_TIMEOUT = 10.0
"""Seconds a first connect retries by default (a node's; an operator command with a wait gives up within it)."""
REFUSED_BACKOFF = 10.0
"""A refused (re)connect backs off up to this many times its usual longest delay (a node's: 30 s -> 5 min): a broker
that refuses a node (a revoked one's login, for ever) is asked rarely, and says so rarely in its own log too."""
REFUSED_PATIENCE = 600.0
"""Seconds a node is refused in a row (the waits between its attempts) before it backs off beyond its usual longest
delay: a broker full after a restart (its max_connections), a proxy in front of one restarting, a renewed certificate
not reloaded yet or a handshake cut by the network refuse a node for minutes, and it must come back soon after; a
revoked node is refused for ever."""


def longest_delay(longest: float, refused: bool, refused_for: float) -> float:
    """A node's longest delay between (re)connect attempts: ``longest``, or :data:`REFUSED_BACKOFF` times it after a
    ``refused`` attempt once the waits after refusals in a row (``refused_for``) reached :data:`REFUSED_PATIENCE`."""
    return longest * (REFUSED_BACKOFF if refused and refused_for >= REFUSED_PATIENCE else 1.0)


REFUSED_LOGIN = ("Not authorized", "Bad user name or password")
"""The CONNACK reasons of a login the broker refused (MQTT 3.1.1 and 5)."""


def refused_hint(reason: Any) -> str:
    """What a refused login may mean in a provisioned federation: a revoked node's login is dropped from the broker."""
    if str(reason) in REFUSED_LOGIN:
        return (
            " (a wrong username or password, or this node was revoked: `fedtier provision revoke` drops its login; "
            f"{REVOKED_CHECK})"
        )
    return ""


def said_rarely(n: int) -> bool:
    """Whether the ``n``-th same failure in a row (from 1) is said: the 1st, then the 10th, 100th, 1000th ...: a node
    that retries a broker that refuses it for ever (a revoked node's) says so a few times, not at every attempt (a
    log that grows without bound)."""
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1


def say_retrying(client_id: str, where: str, why: str, deadline: float, timeout: float) -> None:
    """Log that the first connect of ``client_id`` to ``where`` failed (``why``) and is retried until ``deadline``
    (monotonic), unless a connect to the same broker in this process said so since one last connected there (an
    agent's devices, and a long-lived node's attempts, whose retries ``fedtier.serve.Retrying`` says: before, each
    attempt of a node whose broker was down said it again, every 40 s at most)."""
    with _failing_lock:
        if where in _failing:
            return
        _failing.add(where)
    until = time.strftime("%H:%M:%S", time.gmtime(time.time() + deadline - time.monotonic()))
    log.warning(
        "%s: broker at %s %s; retrying until %s UTC (the connect timeout, %g s)", client_id, where, why, until, timeout
    )


class Connecting:
    """The connecting part of :class:`~.mqtt.MqttTransport`; a base of it, sharing its state (declared here, set
    by its ``__init__``)."""

    client_id: str
    host: str
    port: int
    keepalive: int
    _client: mqtt.Client
    _reactor: Any
    _creds: Credentials
    _connack: threading.Event
    _connack_reason: Any
    _connect_error: ConnectionError | None
    _closed: bool
    _final: bool  # a lost connection is not re-established (MqttTransport.stay_down)
    _ever_connected: bool
    _deadline: float  # of the first connect
    _timeout = 0.0  # ... and its length
    _last_failure: ConnectionError | None = None  # why its last attempt failed, raised when its time is up
    _attempts: int  # failed (re)connect attempts in a row
    _refusals: int  # reconnects in a row refused or hung up on before their CONNACK
    _refused_for: float  # ... the delays after them, summed
    _backoff: tuple[float, float]  # (min, max) reconnect delay
    _rng: random.Random  # the reconnect jitter, from ``backoff_seed``

    _abort: Callable[[], None]  # the transport's: close what a failed connect left
    _schedule_expiry: Callable[[], None]  # Inbound's: expire incomplete chunk sets on the loop

    def connect(self, timeout: float = CONNECT_TIMEOUT) -> Self:
        """Connect and block until the broker's CONNACK; retries a refused TCP connect until
        ``timeout``. Raises ``ConnectionError`` naming ``host:port`` on failure, at once when the TLS
        handshake fails or the broker closes the connection before its CONNACK (a TLS listener or a
        refused client certificate: retrying cannot help; unless ``retry_refused``)."""
        self.start_connect(timeout)
        return self.finish_connect()

    def start_connect(self, timeout: float = CONNECT_TIMEOUT) -> None:
        """Begin :meth:`connect`; :meth:`finish_connect` waits for the outcome. With a reactor this
        returns at once, so one thread can have many connections under way."""
        if self._ever_connected or self._closed or self._deadline:
            raise RuntimeError(f"{self.client_id}: connect() may be called once per transport")
        self._deadline, self._timeout = time.monotonic() + timeout, timeout
        self._client.connect_timeout = max(0.5, min(timeout, 5.0))
        if self._reactor is not None:
            self._reactor.run_soon(self._attempt)
            return
        while True:
            try:
                self._client.connect(self.host, self.port, self.keepalive)
                break
            except ssl.SSLError as exc:  # e.g. the server's certificate is not signed by ca_certs
                raise self._tls_error(exc) from exc
            except OSError as exc:
                self._refused(exc)
                if time.monotonic() + 0.2 > self._deadline:
                    raise self._gave_up() from exc
                time.sleep(0.2)
        self._client.loop_start()

    def finish_connect(self) -> Self:
        """Wait for the CONNACK of :meth:`start_connect` (until its timeout); raise as :meth:`connect`."""
        where = self._where
        if not self._connack.wait(max(0.0, self._deadline - time.monotonic())):
            self._abort()
            raise self._gave_up()
        if self._connect_error is not None:
            self._abort()
            raise self._connect_error
        reason = self._connack_reason
        if reason is None:  # _on_disconnect: the broker hung up before its CONNACK
            self._abort()
            raise hung_up_before_connack(where, self.client_id, self._creds)
        if reason is not None and reason.is_failure:  # (said by whoever catches it: not logged as it came)
            self._abort()
            raise Refused(f"MQTT broker at {where} refused {self.client_id!r}: {reason}{refused_hint(reason)}")
        self._schedule_expiry()
        with _failing_lock:
            _failing.discard(where)  # a first connect failing here again says so again
        return self

    @property
    def _where(self) -> str:
        return f"{self.host}:{self.port}"

    def _tls_error(self, exc: BaseException) -> Refused:
        return Refused(f"TLS handshake with MQTT broker at {self._where} failed: {exc}")

    def _refused(self, exc: OSError) -> None:
        """A first-connect attempt's TCP connect failed: keep why, say once that it is retried."""
        kind = failure_kind(exc)
        self._last_failure = ConnectionError(
            f"cannot connect to MQTT broker at {self._where} within the connect timeout ({self._timeout:g} s): "
            f"{kind} ({exc})"
        )
        why = "refused the connection" if kind == "connection refused" else f"cannot be reached: {kind}"
        say_retrying(self.client_id, self._where, f"{why} ({exc})", self._deadline, self._timeout)

    def _hung_up(self) -> None:
        """A first-connect attempt was closed by the broker before its CONNACK (retried with ``retry_refused``)."""
        self._last_failure = hung_up_before_connack(self._where, self.client_id, self._creds)
        why = "closed the connection before its CONNACK (a TLS listener? a refused certificate? its connection limit?)"
        say_retrying(self.client_id, self._where, why, self._deadline, self._timeout)

    def _say_refused_again(self, reason: Any, error: Refused | None = None) -> None:
        """A reconnect was refused (its CONNACK's ``reason``; else ``error``, a failed TLS handshake; else hung up on
        before its CONNACK, e.g. a revoked certificate): said the first time with what it may mean, then
        :func:`said_rarely`. A first connect's refusal is raised by :meth:`finish_connect` instead."""
        self._refusals += 1
        n = self._refusals
        if n == 1 and reason is None:
            why: object = error or hung_up_before_connack(self._where, self.client_id, self._creds)
        elif n == 1:
            why = f"broker {self._where} refused the connection: {reason}{refused_hint(reason)}"
        else:
            why = f"refused again ({n} times in a row{f': {reason}' if reason is not None else ''})"
        log.log(logging.WARNING if said_rarely(n) else logging.DEBUG, "%s: %s; retrying", self.client_id, why)

    def _gave_up(self) -> ConnectionError:
        """The error of a first connect whose time is up: the reason its last attempt failed, else no CONNACK."""
        if self._last_failure is not None:
            return self._last_failure
        return ConnectionError(
            f"no CONNACK from MQTT broker at {self._where} within the connect timeout ({self._timeout:g} s)"
        )

    # -- reactor mode: (re)connects with jittered backoff, on the reactor thread --------------------
    def _attempt(self) -> None:
        if self._closed or (self._final and self._ever_connected):  # (a retry due before stay_down: not made)
            return
        try:
            self._client.connect(self.host, self.port, self.keepalive)
        except ssl.SSLError as exc:
            if not self._ever_connected:
                self._fail(self._tls_error(exc))
            else:
                self._say_refused_again(None, self._tls_error(exc))
                self._retry_later(refused=True)
        except OSError as exc:
            if self._ever_connected:
                self._retry_later()
                return
            self._refused(exc)
            if time.monotonic() + 0.2 > self._deadline:
                self._fail(self._gave_up())
            else:
                self._retry_later()

    def _fail(self, error: ConnectionError) -> None:
        self._connect_error = error
        self._connack.set()

    def next_backoff(self, refused: bool = False) -> float:
        """Seconds before the next (re)connect attempt: doubling from the minimum delay (0.2 s before
        the first CONNACK) up to the maximum (:data:`REFUSED_BACKOFF` times it after a ``refused`` reconnect once the
        refusals in a row lasted :data:`REFUSED_PATIENCE`), times a jitter in [0.5, 1.5) drawn from ``backoff_seed``,
        so that agents refused together do not come back together."""
        lo, hi = self._backoff
        hi = longest_delay(hi, refused, self._refused_for)
        base = min(hi, (lo if self._ever_connected else 0.2) * 2 ** min(self._attempts, 16))
        self._attempts += 1
        delay = base * (0.5 + self._rng.random())
        self._refused_for += delay if refused else 0.0
        return delay

    def _retry_later(self, refused: bool = False) -> None:
        assert self._reactor is not None
        self._reactor.call_later(self.next_backoff(refused), self._attempt)
