"""A real-time :class:`EventLoop`: posted calls and timers run one at a time on one thread.

Use it either with a worker thread (``start()`` / ``stop()``), or blocking in the calling thread
(``run(until, timeout)``). Any thread may ``post`` or ``call_later``. Many transports may share one
loop; their handlers are then serialised. An exception in a callback is logged, never fatal.

Like :class:`~protocols.transport.memory.VirtualLoop`, it offers :meth:`~ThreadLoop.hold` and an
``on_idle`` hook, so that one executor (the cohort engine, ``edge_agent/cohort.py``) serves both.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from .base import EventLoop, TimerHandle

log = logging.getLogger(__name__)


class ThreadLoop(EventLoop):
    """Queue + timer heap on the monotonic clock, drained by a single thread."""

    def __init__(self, name: str = "fedtier-loop") -> None:
        self.name = name
        self._cv = threading.Condition()
        self._ready: deque[Callable[[], None]] = deque()
        self._timers: list[TimerHandle] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._runner: int | None = None  # ident of the thread draining the loop
        self._stopping = False
        self._idle_called = False  # on_idle ran since the last callback
        self.on_idle: Callable[[], None] | None = None
        """Called on the loop's thread when nothing is ready and no timer is due, once each time the
        loop runs out of work (the cohort engine trains its queued devices then); set it before the
        loop starts."""

    # -- EventLoop -------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic()

    def post(self, fn: Callable[[], None]) -> None:
        with self._cv:
            self._ready.append(fn)
            self._cv.notify()

    def call_later(self, delay: float, fn: Callable[[], None]) -> TimerHandle:
        with self._cv:
            handle = TimerHandle(self.now() + max(0.0, delay), next(self._seq), fn)
            heapq.heappush(self._timers, handle)
            self._cv.notify()
        return handle

    def hold(self) -> Callable[[Callable[[], None]], None]:
        """Register work done outside the loop's callbacks; returns ``complete(fn)``, callable from any
        thread once, which makes ``fn`` run on the loop. In real time nothing waits for it: this is
        :meth:`post` (the counterpart of :meth:`VirtualLoop.hold`, whose clock stands still meanwhile)."""
        return self.post

    # -- running ---------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._runner is not None

    def in_loop_thread(self) -> bool:
        """True when called from the thread currently draining this loop."""
        return self._runner == threading.get_ident()

    def start(self) -> ThreadLoop:
        """Drain the loop on a daemon worker thread (no-op if it already runs)."""
        with self._cv:
            if self._thread is not None and self._thread.is_alive():
                return self
            if self._runner is not None:
                raise RuntimeError("loop is already being run by another thread")
            self._stopping = False
            self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the worker thread (or a blocking ``run``) after the current callback; idempotent."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("loop %s did not stop within %s s", self.name, timeout)
        self._thread = None

    def run(self, until: Callable[[], bool] | None = None, timeout: float | None = None) -> bool:
        """Drain the loop in the calling thread until ``until()`` is true (checked after every
        callback), ``stop()`` is called or ``timeout`` seconds pass. Returns ``until()``'s last value
        (True if ``until`` is None and the loop was stopped)."""
        with self._cv:
            if self._runner is not None:
                raise RuntimeError("loop is already being run by another thread")
            self._runner = threading.get_ident()
            self._stopping = False
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                if until is not None and until():
                    return True
                fn = self._next(deadline)
                if fn is None:
                    return until() if until is not None else self._stopping
                self._call(fn)
        finally:
            with self._cv:
                self._runner = None

    def _work(self) -> None:
        with self._cv:
            self._runner = threading.get_ident()
        try:
            while True:
                fn = self._next(None)
                if fn is None:
                    return
                self._call(fn)
        finally:
            with self._cv:
                self._runner = None

    def _next(self, deadline: float | None) -> Callable[[], None] | None:
        """Wait for the next ready call or due timer; None on stop or deadline."""
        with self._cv:
            while not self._stopping:
                if self._ready:
                    self._idle_called = False
                    return self._ready.popleft()
                while self._timers and self._timers[0].cancelled:
                    heapq.heappop(self._timers)
                now = time.monotonic()
                if self._timers and self._timers[0].when <= now:
                    self._idle_called = False
                    return _unless_cancelled(heapq.heappop(self._timers))
                if self.on_idle is not None and not self._idle_called:
                    self._idle_called = True
                    return self.on_idle
                wait = self._timers[0].when - now if self._timers else None
                if deadline is not None:
                    if now >= deadline:
                        return None
                    wait = deadline - now if wait is None else min(wait, deadline - now)
                self._cv.wait(wait)
            return None

    @staticmethod
    def _call(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # a bad callback must never kill the loop
            log.exception("callback %r raised", fn)


def _unless_cancelled(handle: TimerHandle) -> Callable[[], None]:
    def fire() -> None:
        if not handle.cancelled:  # cancelled from another thread after it was popped
            handle.fn()

    return fire
