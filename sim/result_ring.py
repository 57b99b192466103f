"""A ``fedtier sim`` worker's results to the main process through shared memory (``sim/executors.py``).

A result is a model-sized encoded payload (800 KB for the large workload); through a pipe it cost the main
process ~340 us of CPU (64 KiB reads, each copied again into a growing buffer), through shared memory one copy
(~80 us). Each worker has a ring: one shared-memory segment the main process creates (and alone unlinks: at
:meth:`RingReader.close`, after the run or a worker's death; multiprocessing's resource tracker unlinks it if
the main process is killed). The worker writes a result's bytes at the ring's head and sends only where they
are (``{"ring": [at, n]}``) through its pipe; the main process copies them out into a ``bytes`` of their own
(decoded as read-only views of it, never pickled) and releases a semaphore: the worker's room back. Records are
freed in the order written (one pipe, one reader), so a counting semaphore is the whole protocol.

Bounded: a worker's ring is :data:`RING_BYTES` at most, less where ``/dev/shm`` has less room free (half of it
over the workers; below :data:`MIN_RING_BYTES`, no ring). A result larger than the ring, or one that finds no
room within :data:`WAIT_S` (the main process stopped reading), goes through the pipe as before; a record that
does not lie within the ring is refused as the device's failure, not read.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from protocols.wire.payload import Parts, parts_size

log = logging.getLogger("fedtier.sim")

RING_BYTES = 64 << 20
"""A worker's ring at most: ~80 results of the large workload's 800 KB in flight."""
MIN_RING_BYTES = 1 << 20
WAIT_S = 5.0
"""How long a worker waits for room in its ring before it sends a result through its pipe instead."""


def ring_bytes(workers: int, shm_dir: str = "/dev/shm") -> int:
    """Each of ``workers`` rings' size: :data:`RING_BYTES`, or half of ``shm_dir``'s free room over the workers
    where that is less (a full tmpfs would kill a writer with SIGBUS); 0 (no rings) below :data:`MIN_RING_BYTES`."""
    try:
        st = os.statvfs(shm_dir)
        free = st.f_bavail * st.f_frsize
    except OSError:  # no /dev/shm (not Linux): POSIX shared memory without a tmpfs to fill
        free = 2 * workers * RING_BYTES
    size = min(RING_BYTES, free // (2 * max(workers, 1)))
    return size if size >= MIN_RING_BYTES else 0


def _buf(shm: SharedMemory) -> memoryview:
    buf = shm.buf
    if buf is None:
        raise ValueError(f"result ring {shm.name} is closed")
    return buf


def _map_in(shm: SharedMemory, reserve: bool = False) -> None:
    """Map every page of ``shm`` into this process now (not one fault a page at its first copies); with
    ``reserve``, first allocate its memory where it is a ``/dev/shm`` file: a full tmpfs is then an ``OSError``
    here, not a SIGBUS at a later write."""
    path = os.path.join("/dev/shm", shm.name.lstrip("/"))
    if reserve and os.path.exists(path):
        fd = os.open(path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, shm.size)
        finally:
            os.close(fd)
    pages = np.frombuffer(_buf(shm), np.uint8)[:: mmap.PAGESIZE]
    int(pages.sum())  # one byte read a page (its values do not matter)
    del pages


class RingReader:
    """The main process's side of a worker's ring: creates it; :meth:`take` copies a record out and frees it."""

    def __init__(self, size: int, freed: Any) -> None:
        """``freed``: a semaphore (value 0) shared with the worker, released once per record taken."""
        self.shm = SharedMemory(create=True, size=size)
        self.size, self.freed = size, freed
        self.name = self.shm.name
        try:
            _map_in(self.shm, reserve=True)
        except BaseException:
            self.close()
            raise

    def take(self, at: Any, n: Any) -> bytes:
        """The ``n`` bytes written at ``at``, copied out (their room goes back to the worker); ``ValueError`` for
        a record outside the ring (its room is given back all the same: the worker waits for it)."""
        try:
            if not (type(at) is int and type(n) is int and 0 <= at and 0 <= n <= self.size - at):
                raise ValueError(f"ring record [{at!r}, {n!r}] is not within the {self.size}-byte ring")
            return bytes(_buf(self.shm)[at : at + n])
        finally:
            self.freed.release()

    def close(self) -> None:
        """Unlink the segment (idempotent); its mapping goes when no copy is being taken from it."""
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass
        try:
            self.shm.close()
        except BufferError:  # a reader still copying (it ended late): the mapping goes with the process
            log.warning("result ring %s still in use at close", self.name)


class RingWriter:
    """A worker's side of its ring: :meth:`put` writes an encoded result at the head, waiting for room."""

    def __init__(self, name: str, size: int, freed: Any) -> None:
        self.shm = SharedMemory(name=name)
        if self.shm.size < size:
            raise ValueError(f"result ring {name} is {self.shm.size} bytes, not {size}")
        self.size, self.freed = size, freed
        _map_in(self.shm)
        self.head = 0  # bytes written so far (padding included); the ring's offset is head % size
        self.tail = 0  # bytes freed so far
        self.records: collections.deque[int] = collections.deque()  # each record's end (a head), oldest first

    def put(self, parts: Parts) -> tuple[int, int] | None:
        """Write ``parts`` (an encoded payload's buffers, :func:`~protocols.wire.payload.payload_parts`) as one
        record: ``(offset, length)``, or ``None`` when they do not fit in the ring, or no room was freed within
        :data:`WAIT_S` (send them through the pipe)."""
        n = parts_size(parts)
        if n > self.size:
            return None
        while True:
            if not self.records:  # all taken: start at the ring's beginning
                self.head = self.tail = 0
            at = self.head % self.size
            pad = self.size - at if at + n > self.size else 0  # a record never wraps: it starts again at 0
            if self.head + pad + n - self.tail <= self.size:
                break
            if not self.freed.acquire(timeout=WAIT_S):  # the oldest record's room, once the main process took it
                return None
            self.tail = self.records.popleft()
        at = (at + pad) % self.size
        view = np.frombuffer(_buf(self.shm), np.uint8, n, at)
        pos = 0
        for part in parts:
            size = len(part) if isinstance(part, bytes) else part.nbytes
            view[pos : pos + size] = np.frombuffer(part, np.uint8)
            pos += size
        del view  # (no export of the segment outlives the call)
        self.head += pad + n
        self.records.append(self.head)
        return at, n

    def close(self) -> None:
        self.shm.close()
