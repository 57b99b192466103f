"""A round replayed ahead, off the thread that waits for it (``fedtier sim``, where a process draws ahead).

Every round, the first device of a process that catches up to the new global state x_r replays the round before
(:func:`protocols.directions.replay`: its update ``u = sum_p c_p z_p`` and the step, a few passes over the model) on
the loop's thread, while the process's other threads idle. A cell of that process knows the round's scalars as its
task comes, before it has planned, framed and sent its devices' tasks and they have read them: :func:`replay_ahead`
replays the rounds after the newest state the process keeps in a thread of its own then, and keeps the state reached
as a device's replay would (the same function, the same bits, under the same chain key). A device catching up
meanwhile waits for it, then takes it as kept.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from . import directions as Z

_thread: ThreadPoolExecutor | None = None
_start = threading.Lock()


def replay_ahead(seeds: np.ndarray, hist: np.ndarray) -> bool:
    """Start replaying, in a thread of its own, the rounds of a history window (``seeds[i]``, ``hist[i]``: a task's)
    after the newest state this process keeps, where that state's last round is in the window and drawing ahead is
    on (:func:`protocols.directions.prefetching`). Whether it started."""
    newest = Z._newest
    if newest is None or not Z.prefetching():
        return False
    key, seed, scalars, lr, kind, momentum = newest
    at = _after(seeds, hist, seed, scalars)
    if at is None or at >= min(len(seeds), len(hist)):
        return False  # (its last round not in the window, or the window ends there: nothing to replay)
    seeds, hist = seeds[at:], hist[at:]
    target = Z._chain(key, seeds, hist)[-1]
    with Z._lock:
        kept = Z._states.get(key)
        if kept is None or target in Z._states or target in Z._replaying:
            return False
        Z._replaying[target] = done = Future[None]()
    try:
        _executor().submit(_replay, done, target, kept, key, seeds, hist, lr, kind, momentum)
    except RuntimeError:  # its executor shut down (the interpreter exiting): the devices replay it themselves
        _end(done, target)
        return False
    return True


def _after(seeds: np.ndarray, hist: np.ndarray, seed: int, scalars: bytes) -> int | None:
    """The index after the window's round of ``seed`` and ``scalars`` (the newest state's last round), looked for
    from the window's end; None where it is not in the window."""
    for i in range(min(len(seeds), len(hist)) - 1, -1, -1):
        if int(seeds[i]) == seed and hist[i].tobytes() == scalars:
            return i + 1
    return None


def _replay(
    done: Future,
    target: bytes,
    kept: tuple,
    key: bytes,
    seeds: np.ndarray,
    hist: np.ndarray,
    lr: float,
    kind: Any,
    momentum: float,
) -> None:
    try:  # (kept: read-only; replayed into a copy, kept in turn)
        Z.replay(kept[0], kept[1], key, seeds, hist, lr, kind, momentum, ahead=True)
    finally:
        _end(done, target)


def _end(done: Future, target: bytes) -> None:
    with Z._lock:
        Z._replaying.pop(target, None)
    done.set_result(None)


def _executor() -> ThreadPoolExecutor:
    global _thread
    with _start:
        if _thread is None:
            _thread = ThreadPoolExecutor(1, thread_name_prefix="zo-replay")
        return _thread
