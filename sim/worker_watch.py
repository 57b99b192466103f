"""How ``fedtier sim`` notices a worker that hangs (``sim/executors.py``): a worker process or Ray actor that is stopped
(SIGSTOP), deadlocked or stuck in a kernel sends nothing and never dies, so without a bound its run would wait forever.

A worker is heard from when it answers a task or beats: a worker process sends a beat every few seconds while its
training steps move (``protocols.trainer.PROGRESS``, ``sim/device_worker.py``), a Ray actor is asked for its count
(``sim/ray_actors.py``). A worker that owes results (tasks sent to it, not answered) and has not been heard from for
``runtime.worker_stall_s`` is *stalled*: :class:`Watch` calls ``stalled(worker, silent_s)`` once, from its own
thread, and the executor ends the run naming it. The silence counts from the later of the last word heard and the
moment the worker began to owe (a worker that was idle owes nothing); before a worker is ready (its devices built)
the bound is at least :data:`START_S`. A watcher that itself did not run for a while (the main process was stopped,
the machine suspended) does not count that time against the workers."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("fedtier.sim")

START_S = 300.0
"""A worker still building its devices (loading the data set) is given at least this long."""


NAMED = 8
"""Devices a worker's error message names (a worker of thousands is not a wall of ids)."""


def named_devices(group: list[str]) -> str:
    """A worker's devices for an error message: all of them, or the first :data:`NAMED` and how many in all."""
    if len(group) <= NAMED:
        return ", ".join(group)
    return f"{', '.join(group[:NAMED])}, ... ({len(group)} devices)"


def check_period(stall_s: float) -> float:
    """How often silences are checked, and workers beat: a quarter of the bound, within [0.05, 5] s."""
    return min(5.0, max(0.05, stall_s / 4))


class Watch:
    """Each worker's silence while it owes results; calls ``stalled(worker, silent_s)`` past ``stall_s`` and
    ``poll(worker)`` every period for a worker that owes (to ask for a beat: Ray actors)."""

    def __init__(
        self,
        workers: int,
        stall_s: float,
        stalled: Callable[[int, float], None],
        poll: Callable[[int], None] | None = None,
    ) -> None:
        self.stall_s, self._stalled, self._poll = stall_s, stalled, poll
        now = time.monotonic()
        self._lock = threading.Lock()
        self.owed = [0] * workers  # tasks sent to each worker and not answered
        self.heard = [now] * workers  # when each was last heard from (or began to owe)
        self.ready = [False] * workers
        self._given_up = [False] * workers  # stalled or dead: no longer watched
        self._stop = threading.Event()
        self._failed: set[str] = set()  # the callbacks that raised (logged in full once)
        self._thread = threading.Thread(target=self._run, name="sim-worker-watch", daemon=True)
        self._thread.start()

    def sent(self, worker: int, tasks: int) -> None:
        """``tasks`` more tasks went to ``worker``."""
        with self._lock:
            if self.owed[worker] == 0:
                self.heard[worker] = time.monotonic()  # its silence counts from now
            self.owed[worker] += tasks

    def answered(self, worker: int) -> None:
        """``worker`` answered one task it owed."""
        with self._lock:
            self.owed[worker] = max(0, self.owed[worker] - 1)
            self.heard[worker] = time.monotonic()

    def beat(self, worker: int) -> None:
        """``worker`` showed that it is alive and training."""
        with self._lock:
            self.heard[worker] = time.monotonic()

    def started(self, worker: int) -> None:
        """``worker`` has built its devices: from now on its silence is bounded by ``stall_s`` alone."""
        with self._lock:
            self.ready[worker] = True
            self.heard[worker] = time.monotonic()

    def give_up(self, worker: int) -> None:
        """``worker`` is gone (dead, or declared stalled): watch it no more."""
        with self._lock:
            self._given_up[worker] = True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _run(self) -> None:
        period = check_period(self.stall_s)
        last = time.monotonic()
        while not self._stop.wait(period):
            now = time.monotonic()
            if now - last > 2 * period + 1.0:  # we did not run (main process stopped): nor could we hear them
                with self._lock:
                    self.heard = [max(h, now) for h in self.heard]
            last = now
            for worker, silent in self._check(now):
                self._call(self._stalled, worker, silent)

    def _call(self, fn: Callable[..., None], *args: object) -> None:
        """``fn(*args)``; if it raises, logged (its first failure with the traceback) and the watch goes on: a
        failed poll must not end the watching of every worker."""
        try:
            fn(*args)
        except Exception:
            name = getattr(fn, "__name__", repr(fn))
            log.log(
                logging.DEBUG if name in self._failed else logging.ERROR,
                "sim worker watch: %s%r failed",
                name,
                args,
                exc_info=True,
            )
            self._failed.add(name)

    def _check(self, now: float) -> list[tuple[int, float]]:
        """The workers stalled at ``now`` and how long each was silent (given up from then on); polls the others
        that owe."""
        stalled: list[tuple[int, float]] = []
        polls: list[int] = []
        with self._lock:
            for w, owed in enumerate(self.owed):
                if owed == 0 or self._given_up[w]:
                    continue
                bound = self.stall_s if self.ready[w] else max(self.stall_s, START_S)
                if now - self.heard[w] > bound:
                    self._given_up[w] = True
                    stalled.append((w, now - self.heard[w]))
                elif self.ready[w]:
                    polls.append(w)
        if self._poll is not None:
            for w in polls:
                self._call(self._poll, w)
        return stalled
