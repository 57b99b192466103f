"""The virtual loop of the in-memory transport (``protocols/transport/memory.py``): one thread, a virtual clock.

Every call posted runs in order, then timers in (time, creation) order; the clock jumps to the next timer when
there is nothing to do, so a simulated deadline costs no real time. Work done outside the loop (device training in
worker processes, ``sim/executors.py``) is registered with :meth:`VirtualLoop.hold`: while any is unfinished the
clock does not advance (timers due now still fire), and the loop blocks until the oldest one completes, completions
running in the order the work was registered.

Its work has two sides, the cloud's and the cells' (:data:`MAIN`, :data:`CELLS`), that a one-process simulation
declares (``MemoryHub.side_of``) so that it runs as a simulation split across processes does
(``sim/cell_processes.py``): at each virtual instant the sides take turns, what crosses from one to the other is
delivered at the other's turn sorted by sender, and at a new instant the cloud's timers fire first.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .base import EventLoop, TimerHandle

MAIN, CELLS = 0, 1
"""The two sides of a simulation run in one process as it runs split across processes (``sim/cell_processes.py``):
the cloud's and the cells' with their devices (:attr:`MemoryHub.side_of`)."""


class _Side:
    """One side's work: calls queued, timers, outside work, and messages of the other side waiting for its turn."""

    __slots__ = ("ready", "timers", "held", "inbox")

    def __init__(self) -> None:
        self.ready: deque[Callable[[], None]] = deque()
        self.timers: list[TimerHandle] = []
        self.held: deque[_Held] = deque()  # outstanding outside work, oldest first
        self.inbox: list[tuple[str, Callable[[], None]]] = []  # (sender, delivery) from the other side

    def due(self, now: float) -> bool:
        """Whether this side has anything to do at ``now``."""
        return bool(self.inbox or self.ready or self.held or _first_timer(self.timers, now))


def _first_timer(timers: list[TimerHandle], now: float | None = None) -> TimerHandle | None:
    """The next timer not cancelled (those before it are dropped); with ``now``, only one due by then."""
    while timers and timers[0].cancelled:
        heapq.heappop(timers)
    if timers and (now is None or timers[0].when <= now):
        return timers[0]
    return None


class VirtualLoop(EventLoop):
    """A single-threaded loop whose clock jumps to the next timer when there is nothing to do.

    Its work has two sides (:data:`MAIN`, :data:`CELLS`), each of its own calls, timers and outside work: a
    simulation run in one process as it would run split across processes (``sim/cell_processes.py``). At each
    virtual instant the sides take turns, the cloud's first: each runs all it has at the present, then the other
    gets the messages the first sent it (:meth:`cross`), ordered by their senders (each sender's in the order it sent
    them), and runs in turn, until neither sent the other anything; then the clock moves to the earliest timer of
    both. Work of code outside the loop's callbacks is the cloud's, unless it says otherwise (:meth:`acting`).
    Without a second side (nothing declared a cell's), this is the one-side loop: calls in order, then timers."""

    def __init__(self) -> None:
        self._now = 0.0
        self._sides = (_Side(), _Side())
        self._ready = self._sides[MAIN].ready  # (the cloud's calls queued: tests count them)
        self._seq = itertools.count()
        self._turn = MAIN  # the side running its present
        self._acting = MAIN  # the side whose code runs now: what it posts, sets or holds is its own
        self._done = threading.Condition()
        self.on_idle: Callable[[], None] | None = None
        """Called when the loop would wait for outside work: nothing ready, no timer due now (the
        cohort engine trains its queued devices then, ``edge_agent/cohort.py``)."""

    def now(self) -> float:
        return self._now

    @property
    def acting_side(self) -> int:
        """The side whose code runs now (:meth:`acting`)."""
        return self._acting

    def start_at(self, t: float) -> None:
        """Move the clock, before anything ran, to ``t`` (a resumed run goes on from its virtual time); the timers
        already set move with it."""
        shift = t - self._now
        self._now = t
        for side in self._sides:
            for handle in side.timers:
                handle.when += shift

    def post(self, fn: Callable[[], None], side: int | None = None) -> None:
        """As :meth:`EventLoop.post`; ``side``: whose call it is (the side acting now by default)."""
        self._sides[self._acting if side is None else side].ready.append(fn)

    def call_later(self, delay: float, fn: Callable[[], None], side: int | None = None) -> TimerHandle:
        """As :meth:`EventLoop.call_later`; ``side``: whose timer it is (the side acting now by default)."""
        handle = TimerHandle(self._now + max(0.0, delay), next(self._seq), fn)
        heapq.heappush(self._sides[self._acting if side is None else side].timers, handle)
        return handle

    def cross(self, side: int, sender: str, deliver: Callable[[], None]) -> None:
        """A message of ``sender`` to ``side`` from the other side: ``deliver`` runs when ``side``'s turn comes, with
        the others then sorted by sender (stably: a sender's in the order it sent them)."""
        self._sides[side].inbox.append((sender, deliver))

    @contextmanager
    def acting(self, side: int) -> Iterator[None]:
        """Code run outside the loop's callbacks (a simulation starting its cells) as ``side``'s."""
        before, self._acting = self._acting, side
        try:
            yield
        finally:
            self._acting = before

    def hold(self) -> Callable[[Callable[[], None]], None]:
        """Register work done outside the loop (the acting side's); returns ``complete(fn)``, callable from any
        thread once, which makes ``fn`` run on the loop (after earlier registered work completed)."""
        held = _Held()
        self._sides[self._acting].held.append(held)

        def complete(fn: Callable[[], None]) -> None:
            with self._done:
                held.fn = fn
                self._done.notify_all()

        return complete

    @property
    def outstanding(self) -> int:
        """Registered outside work not yet completed on the loop."""
        return sum(len(side.held) for side in self._sides)

    def step(self) -> bool:
        """Run one queued call, delivery, outside work's completion or timer; False when nothing is left.

        The side whose turn it is runs what it has at the present (:meth:`_run_one`); when it has nothing, the turn
        passes (from the cloud's side always to the cells', from theirs back only if the cloud's has something at the
        present); when neither has, the clock moves to the next timer and the cloud's side begins."""
        while True:
            if self._run_one(self._turn):
                return True
            if self._turn == MAIN:
                self._turn = CELLS
                continue
            self._turn = MAIN
            if self._sides[MAIN].due(self._now):
                continue
            at = self.next_timer()
            if at is None:
                return False
            self._now = max(self._now, at)

    def _run_one(self, s: int) -> bool:
        """Run one thing side ``s`` has at the present: the messages crossed to it first (all of them, sorted by
        sender), then a queued call; with outside work outstanding, a timer due now, else (after ``on_idle``) the
        oldest work's completion, waited for; else a timer due now. False: it has nothing now."""
        side = self._sides[s]
        if side.inbox:
            crossed, side.inbox = side.inbox, []
            crossed.sort(key=lambda m: m[0])
            for _, deliver in crossed:
                self._run(s, deliver)
            return True
        if side.ready:
            self._run(s, side.ready.popleft())
            return True
        due = _first_timer(side.timers, self._now)
        if due is None and side.held:
            held = side.held[0]
            if held.fn is None and self.on_idle is not None:
                self.on_idle()
            with self._done:
                while held.fn is None:
                    self._done.wait(1.0)
            side.held.popleft()
            self._run(s, held.fn)
            return True
        if due is None:
            return False
        heapq.heappop(side.timers)
        self._run(s, due.fn)
        return True

    def _run(self, s: int, fn: Callable[[], None]) -> None:
        before, self._acting = self._acting, s
        try:
            fn()
        finally:
            self._acting = before

    def run_due(self, until: Callable[[], bool] | None = None) -> None:
        """Run everything due at the current time (queued calls, outside work, timers due now) without moving the
        clock, or until ``until()`` is true: one process of a simulation split across processes runs to the end
        of the present before it trades messages with the others (``sim/cell_processes.py``)."""
        while not (until and until()):
            if not any(side.due(self._now) for side in self._sides):
                return
            self.step()

    def next_timer(self) -> float | None:
        """When the next timer fires; ``None``: no timer is set."""
        times = [h.when for h in (_first_timer(side.timers) for side in self._sides) if h is not None]
        return min(times) if times else None

    def advance(self, t: float) -> None:
        """Move the clock to ``t`` (never back; no later than :meth:`next_timer`: the processes of a split
        simulation move to the earliest timer of them all)."""
        self._now = max(self._now, t)

    def run(self, until: Callable[[], bool] | None = None, max_steps: int | None = None) -> None:
        """Run until ``until()`` is true, nothing is left, or ``max_steps`` calls have run."""
        steps = 0
        while not (until and until()):
            if max_steps is not None and steps >= max_steps:
                return
            if not self.step():
                return
            steps += 1


class _Held:
    """One piece of outside work: its completion, once known."""

    __slots__ = ("fn",)

    def __init__(self) -> None:
        self.fn: Callable[[], None] | None = None
