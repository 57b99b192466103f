"""One I/O thread for many MQTT connections: paho's external-loop API driven by one selector.

Each paho client started with ``loop_start()`` costs a network thread (plus a socket pair), and
that thread waits in ``select()``, which silently fails for file descriptors >= 1024. A
:class:`Reactor` instead drives every client of a process from one thread on ``epoll`` (the
platform's best selector): it reads when a socket is readable, writes while a client has bytes
queued, calls ``loop_misc`` (keepalive pings) once a second, and runs timers (reconnects with
backoff, heartbeats). A connection then costs one socket, not a thread.

Thread rules: paho sockets are opened, read, written and closed only on the reactor thread.
Other threads may queue packets (``publish``, ``subscribe``, ``disconnect``) and must then call
:meth:`Reactor.wake` with the client (after paho's call has returned), which the reactor flushes
on its next turn. paho's ``register_write`` callback only marks the client dirty: it runs inside
paho's ``publish`` under the client's message lock, and a wake-up there (a syscall, which lets
the I/O thread take the GIL) would make the I/O thread's PUBACK handling wait on that lock.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .base import TimerHandle

log = logging.getLogger(__name__)

MISC_PERIOD = 1.0  # seconds between loop_misc() sweeps (keepalive)


class Reactor:
    """A thread that runs the network I/O of many paho clients, plus timers.

    ``start()`` / ``stop()``; ``add(client)`` before a client's first connect; ``run_soon(fn)`` and
    ``call_later(delay, fn)`` run ``fn`` on the reactor thread (any thread may call them).
    """

    def __init__(self, name: str = "fedtier-io") -> None:
        self.name = name
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r.fileno(), selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._dirty: set[Any] = set()  # clients with packets queued by another thread
        self._calls: list[Callable[[], None]] = []
        self._timers: list[TimerHandle] = []
        self._seq = itertools.count()
        self._clients: set[Any] = set()
        self._fds: dict[Any, tuple[int, int]] = {}  # client -> (fd, registered events)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._signalled = False

    # -- any thread --------------------------------------------------------------------------
    def start(self) -> Reactor:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (sockets still open are left to their owners' ``close``)."""
        thread = self._thread
        if thread is None:
            return
        self._stopping = True
        self._signal()
        if thread is not threading.current_thread():
            thread.join(timeout)
        self._thread = None

    def close(self) -> None:
        self.stop()
        for s in (self._wake_r, self._wake_w):
            s.close()
        self._sel.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def in_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def add(self, client: Any) -> None:
        """Wire ``client``'s socket callbacks to this reactor (call before its first connect)."""
        client.on_socket_open = self._on_open
        client.on_socket_close = self._on_close
        client.on_socket_register_write = lambda c, _u, _s: self._mark(c)
        client.on_socket_unregister_write = None  # the reactor decides from want_write()
        with self._lock:
            self._clients.add(client)

    def discard(self, client: Any) -> None:
        """Forget ``client`` (after its socket is closed)."""
        with self._lock:
            self._clients.discard(client)
            self._dirty.discard(client)

    def wake(self, client: Any) -> None:
        """``client`` has packets queued: write them on the reactor's next turn."""
        with self._lock:
            self._dirty.add(client)
        if not self.in_thread():
            self._signal()

    def _mark(self, client: Any) -> None:
        """paho's ``register_write``: remember that ``client`` has bytes to write, without waking the
        I/O thread (the thread that queued them calls :meth:`wake` once paho's call returned)."""
        with self._lock:
            self._dirty.add(client)

    def run_soon(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._calls.append(fn)
        if not self.in_thread():
            self._signal()

    def call_later(self, delay: float, fn: Callable[[], None]) -> TimerHandle:
        handle = TimerHandle(time.monotonic() + max(0.0, delay), next(self._seq), fn)
        with self._lock:
            heapq.heappush(self._timers, handle)
        if not self.in_thread():
            self._signal()
        return handle

    @staticmethod
    def cancel(handle: TimerHandle | None) -> None:
        if handle is not None:
            handle.cancel()

    def _signal(self) -> None:
        with self._lock:
            if self._signalled:
                return
            self._signalled = True
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass

    # -- paho socket callbacks (reactor thread) ---------------------------------------------
    def _on_open(self, client: Any, _u: Any, sock: Any) -> None:
        try:  # else Nagle + delayed ACK hold a small publish ~40 ms
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, AttributeError):
            pass
        fd = sock.fileno()
        old = self._fds.pop(client, None)
        if old is not None:
            self._unregister(old[0])
        self._unregister(fd)  # a recycled fd number of a socket closed behind our back
        self._sel.register(fd, selectors.EVENT_READ, client)
        self._fds[client] = (fd, selectors.EVENT_READ)
        with self._lock:
            self._dirty.add(client)  # the CONNECT packet is queued

    def _on_close(self, client: Any, _u: Any, sock: Any) -> None:
        entry = self._fds.pop(client, None)
        if entry is not None:
            self._unregister(entry[0])

    def _unregister(self, fd: int) -> None:
        try:
            self._sel.unregister(fd)
        except (KeyError, ValueError):
            pass

    # -- the reactor thread -------------------------------------------------------------------
    def _run(self) -> None:
        next_misc = time.monotonic() + MISC_PERIOD
        while not self._stopping:
            try:
                timeout = self._turn_timeout(next_misc)
                for key, mask in self._sel.select(timeout):
                    client = key.data
                    if client is None:
                        self._drain_wake()
                        continue
                    if mask & selectors.EVENT_READ:
                        self._read(client)
                    if mask & selectors.EVENT_WRITE and client in self._fds:
                        client.loop_write()
                    self._flush(client)
                self._run_calls()
                self._run_timers()
                now = time.monotonic()
                if now >= next_misc:
                    next_misc = now + MISC_PERIOD
                    with self._lock:
                        clients = list(self._clients)
                    for client in clients:
                        if client in self._fds:
                            client.loop_misc()
                with self._lock:
                    dirty, self._dirty = self._dirty, set()
                for client in dirty:
                    self._flush(client)
            except Exception:  # a bad callback must never stop everybody's I/O
                log.exception("reactor %s: error in the I/O loop", self.name)

    def _turn_timeout(self, next_misc: float) -> float:
        with self._lock:
            if self._calls or self._dirty:
                return 0.0
            while self._timers and self._timers[0].cancelled:
                heapq.heappop(self._timers)
            due = min(next_misc, self._timers[0].when) if self._timers else next_misc
        return max(0.0, due - time.monotonic())

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        with self._lock:  # after draining: a signal sent from now on makes the socket readable again
            self._signalled = False  # (what was queued before is handled later in this turn)

    def _read(self, client: Any) -> None:
        client.loop_read()
        sock = client.socket()
        # TLS: bytes already decrypted into the SSL object never make the fd readable again
        while sock is not None and hasattr(sock, "pending") and sock.pending() and client in self._fds:
            client.loop_read()
            sock = client.socket()

    def _flush(self, client: Any) -> None:
        """Write what ``client`` has queued; keep write interest only while bytes remain."""
        entry = self._fds.get(client)
        if entry is None:
            return
        if client.want_write():
            client.loop_write()
            entry = self._fds.get(client)
            if entry is None:
                return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if client.want_write() else 0)
        if want != entry[1]:
            self._sel.modify(entry[0], want, client)
            self._fds[client] = (entry[0], want)

    def _run_calls(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for fn in calls:
            self._call(fn)

    def _run_timers(self) -> None:
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._timers or self._timers[0].when > now:
                    return
                handle = heapq.heappop(self._timers)
            if not handle.cancelled:
                self._call(handle.fn)

    def _call(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            log.exception("reactor %s: callback %r raised", self.name, fn)
