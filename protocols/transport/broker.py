"""Local MQTT brokers for emulation and tests: amqtt in-process, or a Mosquitto subprocess.

Both listen on 127.0.0.1 (a free port unless one is given), return from ``start()`` once the port
accepts connections, can be stopped and started again on the same port, and are context managers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

from .. import procs

log = logging.getLogger(__name__)

MAX_QUEUED = 100000
"""Messages Mosquitto queues per session (in flight or waiting for a disconnected client)."""

AUTOSAVE_INTERVAL = 60
"""Seconds between Mosquitto's saves of its whole database (``autosave_interval``; it saves every that many
seconds plus one, whether anything changed or not, fsyncs each save and stalls every client meanwhile):
fedtier's brokers and the provisioned ones. Measured (Mosquitto 2.0.11, 20 sessions away with 48 MB of tasks
queued for them): every 1 s it wrote 86 GB an hour (10-18 MB and 1,800 log lines an hour with nothing
queued); every 60 s 2.8 GB (1.5 MB, 58 lines). ``autosave_on_changes`` is worse under load: it saves after
every queued or acknowledged message (5.8 GB written to queue those 48 MB). What a kill -9 loses: what the
broker acknowledged in its last minute and has not yet delivered (a message for a node that is away);
what it never acknowledged its publishers re-send."""

CLOSING_DRAIN_S = 10.0
"""Seconds the embedded broker gives a closing client's session to broadcast what the client sent before it closed
(:func:`_deliver_before_disconnect`), at most."""


def parse_broker_url(url: str) -> tuple[str, int]:
    """``mqtt://host:port`` (or ``tcp://``, default port 1883) -> ``(host, port)``."""
    parts = urlsplit(url if "://" in url else f"mqtt://{url}")
    if parts.scheme not in ("mqtt", "tcp", "mqtts", "ssl"):
        raise ValueError(f"broker url {url!r}: scheme must be mqtt:// (or tcp://, mqtts://)")
    if not parts.hostname:
        raise ValueError(f"broker url {url!r} has no host")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"broker url {url!r} has an invalid port") from None
    if port == 0:  # not "the default port": a client cannot connect to port 0
        raise ValueError(f"broker url {url!r}: port 0 (leave the port out for the default)")
    if parts.path not in ("", "/") or parts.query:
        raise ValueError(f"broker url {url!r}: unexpected path or query")
    return parts.hostname, port or (8883 if parts.scheme in ("mqtts", "ssl") else 1883)


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """The first of ``count`` consecutive TCP ports that were free a moment ago, below the system's ephemeral range: a
    port in it (port 0's) may be any outgoing connection's next, held by it, then 60 s in TIME_WAIT, which a listener
    cannot bind even with SO_REUSEADDR (a broker started on it seconds later, or restarted, failed). Where the range
    leaves too little room below it, a port the system gives."""
    low = _ephemeral_low()
    for _ in range(200 if low - count > _LOWEST + 1000 else 0):
        base = _draw.randrange(max(_LOWEST, low - 12768), low - count + 1)
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + count):
                    held.enter_context(socket.socket()).bind((host, port))
            except OSError:
                continue
            return base
    if count > 1:
        raise RuntimeError(f"no {count} consecutive free ports on {host}")
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_LOWEST, _draw = 10000, random.SystemRandom()  # not the global generator: two test processes seeded alike draw alike


def _ephemeral_low() -> int:
    """Where the ports the system hands outgoing connections begin (Linux: ``ip_local_port_range``; IANA's 49152)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def listens(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds the socket listening on TCP ``port`` (``None``: this system cannot tell, no
    ``/proc``). A port :func:`free_port` found free may be taken by another process before the broker binds it (another
    test's broker, picked the same free port a moment apart): the broker then exits, and whoever listens there
    answers in its place (a test's clients then talk to another test's broker)."""
    try:
        with open("/proc/net/tcp", encoding="ascii") as fh:
            inodes = {
                f[9]
                for f in (line.split() for line in fh.readlines()[1:])
                if f[3] == "0A" and int(f[1][-4:], 16) == port
            }
        return any(os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] in inodes for fd in os.listdir(f"/proc/{pid}/fd"))
    except (OSError, IndexError, ValueError) as exc:  # the process gone (it exited: its port taken), or its descriptor
        return False if isinstance(exc, OSError) and os.path.exists("/proc/net/tcp") else None


def wait_for_port(
    host: str, port: int, timeout: float, alive: Callable[[], bool] | None = None, pid: int | None = None
) -> None:
    """Block until ``host:port`` accepts a TCP connection (with ``pid``: on a socket of that process, where the system
    says, :func:`listens`); raise ``TimeoutError`` otherwise, ``RuntimeError`` once ``alive()`` is false."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                pass
            if pid is None or listens(pid, port) is not False:
                return
            raise ConnectionRefusedError(f"another process listens on {host}:{port}")
        except OSError:
            if alive is not None and not alive():
                raise RuntimeError(f"broker process exited before listening on {host}:{port}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing accepts connections on {host}:{port} after {timeout} s") from None
            time.sleep(0.02)


class _Broker:
    host = "127.0.0.1"

    def __init__(self, port: int | None = None) -> None:
        self.port = port

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("broker not started")
        return f"mqtt://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> _Broker:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> _Broker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Snapshots(dict):
    """amqtt's table of subscriptions (topic filter -> subscribers), iterated over a copy: amqtt awaits inside
    its loops over it, and a subscription added meanwhile raised "dictionary changed size during iteration"."""

    def __iter__(self) -> Iterator[Any]:
        return iter(list(super().__iter__()))

    def items(self) -> Any:
        return list(super().items())


def _deliver_before_disconnect(broker: Any) -> None:
    """Make amqtt's ``broker`` broadcast what a client sent before it disconnected (or its connection dropped) before it
    takes the disconnect: each session's loop broadcasts one message a turn, and amqtt 0.12.1 ended it at the
    disconnect, dropping the messages still queued (acknowledged already) whenever the loop had been busy."""
    message_loop = broker._client_message_loop

    async def client_message_loop(session: Any, handler: Any) -> None:
        handler.wait_disconnect = _after_queued(handler.wait_disconnect, session.delivered_message_queue)
        await message_loop(session, handler)

    broker._client_message_loop = client_message_loop


def _subscriptions_of_current_sessions(broker: Any) -> None:
    """Make amqtt's ``broker`` keep a subscription for the current session of its client id only. amqtt 0.12.1 keeps a
    connection that a clean CONNECT of its client id replaced running, and holds a subscription per client id: the
    replaced connection's late SUBSCRIBE (its session loop behind) held the filter in its successor's place, whose own
    SUBSCRIBE was then "already subscribed", and once the replaced session was disconnected what was published there
    went to no one. A replaced session's SUBSCRIBE is now refused (0x80), and another session's entry under the same
    client id gives way to the current one's."""
    add = broker.add_subscription

    async def add_subscription(subscription: tuple[str, int], session: Any) -> int:
        current = broker._sessions.get(session.client_id, (None, None))[0]
        if current is not None and current is not session:
            return 0x80
        held = broker._subscriptions.get(subscription[0], [])
        held[:] = [(s, qos) for s, qos in held if s is session or s.client_id != session.client_id]
        result: int = await add(subscription, session)
        return result

    broker.add_subscription = add_subscription


def _after_queued(wait: Callable[[], Any], queue: asyncio.Queue[Any]) -> Callable[[], Any]:
    """``wait`` (a session's wait for its disconnect), returning once ``queue`` (what its client sent, not yet taken by
    the session's loop) is also empty, or ``CLOSING_DRAIN_S`` later."""

    async def wait_disconnect() -> Any:
        result = await wait()
        deadline = time.monotonic() + CLOSING_DRAIN_S
        while not queue.empty() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        return result

    return wait_disconnect


class EmbeddedBroker(_Broker):
    """amqtt's broker on its own asyncio loop in a background thread (listening once ``start()``
    returns: amqtt's ``Broker.start`` awaits ``asyncio.start_server``).

    The zero-install fallback only: ``fedtier run`` starts Mosquitto wherever it is installed,
    because amqtt (0.12.1) does not hold a fleet. Report, upstream style:

      *QoS-1 deliveries time out and sessions drop with a few hundred clients.* Reproduction
      (Python 3.11, amqtt 0.12.1, paho-mqtt 2.2.0, one process, loopback): start this broker; connect
      200 paho clients (``loop_start``), each subscribing ``s/+`` at QoS 1 and publishing a retained
      QoS-1 ``s/<id>``; then every 0.1 s, 29 of them re-publish their retained ``s/<id>``. Within
      10 s the broker logs ~3,500 ``TimeoutError: Timeout waiting for PUBACK`` from
      ``handler._handle_qos1_message_flow`` (via ``broker._broadcast_loop``), and subscribers miss
      messages. Expected: every subscriber gets every message, as with Mosquitto on the same script.
      Also observed (fedtier's scale profile, 50-500 agents): ``RuntimeError: dictionary changed size
      during iteration`` in the session handler, 15-67 dropped connections per run, and startup time
      growing ~N^3 because each new subscription is matched against every retained message. The
      dictionary error was not reproduced by the script above in 10 s runs.

    Also (0.12.1): a new connection gets, at QoS 0 and before its SUBACK, every retained message that matches any
    client's filter (``Broker._handle_client_session``'s "retained messages to a pre-existing session's
    subscriptions"): a node must not count on its SUBACK coming before the retained records it subscribes to (an
    agent's device that read a round manifest it sits out closed its connection while its start waited for that SUBACK).

    Also (0.12.1): a session's loop broadcasts one message a turn and ended at the client's DISCONNECT, dropping what
    the client sent just before it (acknowledged already) whenever the loop was busy, e.g. awaiting the PUBACKs of the
    retained records it sends after a SUBACK: a device that said online, then offline, then disconnected stayed online
    for its cell and in the retained record. Worked around here (:func:`_deliver_before_disconnect`). And a clean
    CONNECT under a live client id left the older connection running, whose late SUBSCRIBE then held the subscription
    in the new one's place (:func:`_subscriptions_of_current_sessions`).

    The dictionary error is worked around here (:class:`_Snapshots`): amqtt iterates its table of
    subscriptions with awaits in the loop (a resumed session's retained messages, each broadcast), so a
    client subscribing meanwhile ended another's connection; it came back after its reconnect delay (~1 s),
    which a ``fedtier run`` of a few devices paid at its start, some runs in three.
    """

    def __init__(self, port: int | None = None) -> None:
        super().__init__(port)
        self._thread: threading.Thread | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._broker = None

    def _config(self) -> dict:
        return {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port or 0}"}},
            # no packet logging, no $SYS; amqtt has no message size limit to raise
            # every client in, not as "anonymous": amqtt keeps no session for an anonymous client
            "plugins": {"protocols.transport.amqtt_auth.OpenAuth": {}},
        }

    def start(self, timeout: float = 10.0) -> EmbeddedBroker:
        if self._thread is not None:
            return self
        from amqtt.broker import Broker

        ready = threading.Event()
        error: list[BaseException] = []
        booted: list[Any] = []  # the broker this thread serves
        aloop = asyncio.new_event_loop()

        async def boot() -> None:
            broker = Broker(self._config(), loop=aloop)
            broker._subscriptions = _Snapshots()  # (empty until a client subscribes)
            _deliver_before_disconnect(broker)
            _subscriptions_of_current_sessions(broker)
            await broker.start()
            self._broker = broker
            booted.append(broker)
            server = broker._servers["default"].instance  # amqtt 0.12: the asyncio.Server
            self.port = server.sockets[0].getsockname()[1]

        def main() -> None:
            asyncio.set_event_loop(aloop)
            try:
                aloop.run_until_complete(boot())
            except BaseException as exc:  # reported to start()
                error.append(exc)
                ready.set()
                aloop.close()
                return
            ready.set()
            aloop.run_forever()
            # a shutdown that timed out (a loaded machine) may leave the listening socket open, and a
            # restart on the same port would fail with "address already in use": close it here, always
            for listener in booted[0]._servers.values():
                server = getattr(listener, "instance", None)
                if server is not None:
                    server.close()
            # amqtt leaves per-client tasks behind after shutdown: cancel and drain them before
            # closing, or they die later with "Event loop is closed"
            pending = asyncio.all_tasks(aloop)
            for task in pending:
                task.cancel()
            aloop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            aloop.run_until_complete(aloop.shutdown_asyncgens())
            aloop.close()

        self._aloop = aloop
        self._thread = threading.Thread(target=main, name="amqtt-broker", daemon=True)
        self._thread.start()
        if not ready.wait(timeout) or error:
            self._thread = None
            raise RuntimeError(f"embedded amqtt broker did not start: {error[0] if error else 'timeout'}")
        log.info("embedded amqtt broker listening on %s", self.url)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        thread, aloop, broker = self._thread, self._aloop, self._broker
        if thread is None or aloop is None:
            return
        self._thread = self._aloop = self._broker = None
        if broker is not None:
            fut = asyncio.run_coroutine_threadsafe(broker.shutdown(), aloop)
            try:
                fut.result(timeout)
            except Exception as exc:  # shutdown problems must not mask the caller's
                log.warning("amqtt shutdown: %s", exc)
        aloop.call_soon_threadsafe(aloop.stop)
        thread.join(timeout)


class MosquittoBroker(_Broker):
    """A Mosquitto subprocess with a generated config in a temporary directory.

    ``extra_config`` is appended after the listener line, so listener options apply to it: e.g. TLS
    (``cafile``, ``certfile``, ``keyfile``, ``require_certificate true``) or ``password_file``; with
    ``allow_anonymous=False`` clients must log in. Run as root, Mosquitto stays root (instead of
    switching to the ``mosquitto`` user) so it can read the caller's files.

    ``persistence``: keep sessions, subscriptions, queued and retained messages in ``mosquitto.db``
    (in that folder; ``True``: the broker's temporary folder), saved every ``autosave_interval``
    seconds (:data:`AUTOSAVE_INTERVAL`), at a clean stop and on :meth:`save`, and loaded again at start: a
    broker killed with SIGKILL and started again loses at most what it queued for disconnected clients since
    its last save (messages it has not acknowledged are re-sent by their publishers). Each session may queue
    ``MAX_QUEUED`` messages.
    The process asks the kernel to kill it when its parent dies (``protocols.procs``).
    """

    def __init__(
        self,
        port: int | None = None,
        binary: str | None = None,
        extra_config: str = "",
        allow_anonymous: bool = True,
        persistence: bool | str | os.PathLike[str] = False,
        autosave_interval: int = AUTOSAVE_INTERVAL,
    ) -> None:
        super().__init__(port)
        found = binary or find_mosquitto()
        if found is None:
            raise FileNotFoundError("mosquitto is not installed (looked for /usr/sbin/mosquitto and on PATH)")
        self.binary: str = found
        if not os.access(self.binary, os.X_OK):
            raise FileNotFoundError(f"mosquitto binary {self.binary!r} is not an executable file")
        self.extra_config, self.allow_anonymous = extra_config, allow_anonymous
        self.persistence, self.autosave_interval = persistence, autosave_interval
        self._proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    def start(self, timeout: float = 10.0) -> MosquittoBroker:
        """Start it (on a free port unless given one: a port taken before it bound it, by another process, is
        given up for another, up to 3 times)."""
        if self._proc is not None or self.port is not None:
            return self._start(timeout)
        for _ in range(2):
            self.port = free_port(self.host)
            with contextlib.suppress(RuntimeError):  # it exited (the port taken meanwhile), or another process answers
                return self._start(timeout)
        self.port = free_port(self.host)
        return self._start(timeout)

    def _start(self, timeout: float) -> MosquittoBroker:
        if self._proc is not None:
            return self
        assert self.port is not None
        self._dir = self._dir or tempfile.TemporaryDirectory(prefix="fedtier-mosquitto-")
        conf = os.path.join(self._dir.name, "mosquitto.conf")
        with open(conf, "w") as f:
            f.write(
                f"listener {self.port} {self.host}\n"
                f"allow_anonymous {'true' if self.allow_anonymous else 'false'}\n"
                + ("user root\n" if hasattr(os, "geteuid") and os.geteuid() == 0 else "")
                + self._persistence_config()
                + f"max_queued_messages {MAX_QUEUED}\n"  # a chunked model must not overflow a client's queue
                "max_queued_bytes 0\n"
                "max_inflight_messages 64\n"
                "set_tcp_nodelay true\n"  # else Nagle + delayed ACK add ~40 ms per small message
                "log_type error\nlog_type warning\n"
                f"{self.extra_config}\n"
            )
        self._log = open(os.path.join(self._dir.name, "mosquitto.log"), "wb")
        self._proc = proc = procs.popen([self.binary, "-c", conf], stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_for_port(self.host, self.port, timeout, alive=lambda: proc.poll() is None, pid=proc.pid)
        except (RuntimeError, TimeoutError) as exc:
            out = self.log_text()
            self.stop()
            raise RuntimeError(f"mosquitto did not start on port {self.port}: {exc}\n{out}") from None
        log.info("mosquitto (pid %d) listening on %s", self._proc.pid, self.url)
        return self

    @property
    def persistence_dir(self) -> str | None:
        """Where ``mosquitto.db`` lives (``None`` without persistence)."""
        if not self.persistence:
            return None
        if self.persistence is True:
            assert self._dir is not None, "start() first"
            return self._dir.name
        return os.fspath(self.persistence)

    def _persistence_config(self) -> str:
        where = self.persistence_dir
        if where is None:
            return "persistence false\n"
        os.makedirs(where, exist_ok=True)
        return (
            f"persistence true\npersistence_location {os.path.join(os.path.abspath(where), '')}\n"
            f"autosave_interval {self.autosave_interval}\n"
        )

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def log_text(self, tail: int = 2000) -> str:
        """The last ``tail`` characters of what Mosquitto logged."""
        if self._dir is None:
            return ""
        try:
            with open(os.path.join(self._dir.name, "mosquitto.log"), errors="replace") as f:
                return f.read()[-tail:]
        except OSError:
            return ""

    def stop(self, timeout: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            self._log.close()

    def kill(self) -> None:
        """SIGKILL the broker (a crash: nothing is saved) and reap it; :meth:`start` restarts it."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            self._log.close()

    def save(self, timeout: float = 5.0) -> bool:
        """Ask the broker to write its persistence database now (SIGUSR1) and wait until it has."""
        db = os.path.join(self.persistence_dir or "", "mosquitto.db")
        if self._proc is None or not self.persistence:
            return False
        before = os.stat(db).st_mtime_ns if os.path.exists(db) else None
        self._proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(db) and os.stat(db).st_mtime_ns != before:
                return True
            time.sleep(0.01)
        return False

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)  # None also when __init__ failed before setting it
        if proc is not None:
            proc.kill()


def find_mosquitto() -> str | None:
    if os.access("/usr/sbin/mosquitto", os.X_OK):
        return "/usr/sbin/mosquitto"
    return shutil.which("mosquitto")
