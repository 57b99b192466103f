"""Keep freed memory for reuse in message-heavy processes (glibc's malloc settings).

A simulated round frames a task of the model's size for every device, all alive at once in the loop's
queue (a cell's 100 tasks of 800 KB: 80 MB), then frees them. glibc gives such a heap top back to the
kernel as soon as more than twice the largest freed chunk is free at its top, so every round faults the same
memory in again, page by page: measured, a task's framing cost 309 us instead of 114 us at 500 devices
(``benchmarks/gpu.py --breakdown``, issue #33). :func:`keep_freed_memory` turns that off for the process:
freed memory stays in the heap for the next round (up to 2 GiB free; resident memory stays at its peak, which
a round reaches again anyway), and blocks under 32 MiB come from the heap instead of their own mappings.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("fedtier.heap")

# mallopt's parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 * 2**20  # glibc's own ceiling for its adaptive threshold
TOP_PAD = 64 * 2**20  # the heap grows in steps of at least this much
TRIM_THRESHOLD = 2**31 - 1  # the most mallopt takes: 2 GiB free at the heap's top before any is given back

_done: list[bool] = []


def keep_freed_memory() -> bool:
    """Set this process's malloc to keep freed memory (see the module); once, idempotent. ``False`` (and
    nothing changed) where the C library has no ``mallopt`` (not glibc)."""
    if _done:
        return _done[0]
    ok = False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is not None:
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        # each returns 1 on success; the mmap threshold first: setting any of them freezes glibc's adaptive one
        ok = all(
            mallopt(param, value) == 1
            for param, value in (
                (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                (M_TOP_PAD, TOP_PAD),
                (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            )
        )
    log.debug("malloc keeps freed memory: %s", ok)
    _done.append(ok)
    return ok


@contextmanager
def setup_frozen() -> Iterator[None]:
    """While inside, the cyclic garbage collector leaves the objects alive on entry alone (``gc.freeze``): a
    run's setup (modules, torch, the data set, the nodes: ~200,000 objects) is not scanned again by every full
    collection, which came every ~2 rounds and took ~0.1 s at 500 simulated devices (~0.1 ms a device a round).
    On exit they are collected as usual again (``gc.unfreeze``), so a process that runs many jobs leaks nothing.
    Reference counting frees everything as before; only the cycle collector's scans change, never a result."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
