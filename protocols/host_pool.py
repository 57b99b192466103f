"""A node's threads for elementwise passes over large arrays on the host.

A pass over a large array (a cell's weighted sum of its devices' results) is cut into slices computed side by
side: numpy releases the GIL inside its loops. Each element's arithmetic is the same whatever the cut, so the
results are bit-identical to one thread's (the wire's byte identity and sim/emulation equality hold).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

MAX_THREADS = 8  # more gain little: a pass is bound by memory bandwidth
MIN_SLICE = 1 << 14  # elements: a smaller slice costs more in hand-off than its share of the pass saves
# element-operations below which a pass stays in the calling thread: waking threads costs more than a few
# milliseconds of work saves (the small and standard workloads' weighted means, 5-10 results of 50k-200k
# values, ran slower in threads on a busy 2-core machine)
MIN_WORK = 1 << 22

_threads = max(1, min(MAX_THREADS, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def threads() -> int:
    """The threads a pass may use (this process's CPUs, at most :data:`MAX_THREADS`)."""
    return _threads


def set_threads(n: int) -> None:
    """Use at most ``n`` threads (>= 1) for a pass; 1 computes every pass in the calling thread."""
    global _threads, _pool
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    with _lock:
        _threads = n
        if _pool is not None:
            _pool.shutdown(wait=False)
            _pool = None


def bounds(n: int, work: int = 0) -> list[tuple[int, int]]:
    """``[0, n)`` cut into at most :func:`threads` slices of at least :data:`MIN_SLICE` elements; one slice
    when the pass's ``work`` (its element-operations, default ``n``) is under :data:`MIN_WORK`."""
    parts = max(1, min(_threads, n // MIN_SLICE)) if max(work, n) >= MIN_WORK else 1
    cuts = [n * i // parts for i in range(parts + 1)]
    return list(zip(cuts, cuts[1:]))


def run_sliced(n: int, fn: Callable[[int, int], None], work: int = 0) -> None:
    """Call ``fn(lo, hi)`` on each slice of ``[0, n)`` (:func:`bounds` of ``n`` and ``work``), side by side;
    returns when all are done, raising the first slice's error if any failed."""
    global _pool
    slices = bounds(n, work)
    if len(slices) == 1:
        fn(0, n)
        return
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_threads - 1, thread_name_prefix="host-pass")
        pool = _pool
    futures = [pool.submit(fn, lo, hi) for lo, hi in slices[1:]]
    try:
        fn(*slices[0])
    finally:
        for f in futures:
            f.result()


def _after_fork() -> None:  # a forked child has none of the parent's threads: a pool of its own when needed
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork)
