"""A ``fedtier sim`` worker's results to the main process through shared memory (``sim/executors.py``).

A result is a model-sized encoded payload (800 KB for the large workload); through a pipe it cost the main
process ~340 us of CPU (64 KiB reads, each copied again into a growing buffer). Each worker has a ring: one
shared-memory segment the main process creates (and alone unlinks: at :meth:`RingReader.close`, after the run or
a worker's death; multiprocessing's resource tracker unlinks it if the main process is killed). The worker writes
a result's bytes into its ring (one copy) and sends only where they are (``{"ring": [at, n]}``) through its pipe.

The main process does not copy them out: it *lends* the record (:class:`~protocols.wire.payload.Lent`, read-only;
the result is decoded as views of it) and frees it when the last view of it is gone (a ``weakref.finalize``): a
record is never freed while anything can read it, so no view of freed memory exists to read another device's
bytes. The worker leaves room before the result (:data:`~protocols.wire.envelope.ENVELOPE_ROOM`), where its
device's agent writes its message's envelope (:class:`~protocols.wire.payload.Headroom`): the message is the
record itself, not a copy of it, and keeps it lent until the cell is done with it. Results are delivered in
submission order across workers, so records are freed out of the order written (one waits for a slower worker's
result; a result the clock model delays is kept until its time): the worker places a record in any free gap of its
ring (first fit from where it last wrote), and learns which records were freed from a list at the segment's start
(each free published there, then the semaphore released; the worker reads no more entries than it has acquired
releases).

Bounded: a worker's ring is :data:`RING_BYTES` at most, less where ``/dev/shm`` has less room free (half of it
over the workers; below :data:`MIN_RING_BYTES`, no ring). The main process lends at most half of a ring at once
(:data:`LEND_SHARE`); a record beyond that is copied out and freed at once (a slow worker or kept results can pin
half a ring, never all of it, so a worker always finds room again as the reader takes its records); a record
copied out is copied after room of its own, its message framed there: a result costs one copy at most. A worker
writes a cohort's results in a burst, faster than the main process frames them, and a cell keeps its results until
its edge round closes: the first half-ring of them is lent, the rest copied. A result larger than the ring, or
one that finds no room within :data:`WAIT_S` (the main process stopped reading; a ring fragmented by pinned
records), goes through the pipe, and the next ones too until the ring has room at once; at most
:data:`MAX_RECORDS` records live in a ring. A record that does not lie within the ring is refused as the device's
failure, not read (its room is freed all the same).
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import threading
import time
import weakref
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from protocols.trainer import PROGRESS
from protocols.wire.envelope import ENVELOPE_ROOM
from protocols.wire.payload import Headroom, Lent, Parts, parts_size

log = logging.getLogger("fedtier.sim")

RING_BYTES = 64 << 20
"""A worker's ring at least (where its shared memory has room): ~80 results of the large workload's 800 KB."""
MAX_RING_BYTES = 1 << 30
"""A worker's ring at most, whatever its results need (and at most 1/8 of the machine's memory over the workers)."""
MIN_RING_BYTES = 1 << 20
WAIT_S = 5.0
"""How long a worker waits for room in its ring before it sends a result through its pipe instead."""
LEND_SHARE = 0.5
"""The share of a ring lent at once at most; a record beyond it is copied out (freed at once)."""
MAX_RECORDS = 1024
"""Records alive in a ring at most (the freed list's slots)."""
_CONTROL = 8 * (1 + MAX_RECORDS)  # the segment's start: frees published so far, then the freed records' numbers


def ring_bytes(workers: int, shm_dir: str = "/dev/shm", results: int = 0) -> int:
    """Each of ``workers`` rings' size: room for ``results`` bytes (a worker's results of an edge round) lent
    at once (twice that: :data:`LEND_SHARE`), between :data:`RING_BYTES` and :data:`MAX_RING_BYTES`, at most 1/8 of
    the machine's memory over the workers, and at most half of ``shm_dir``'s free room over them (a full tmpfs
    would kill a writer with SIGBUS); 0 (no rings) below :data:`MIN_RING_BYTES`."""
    workers = max(workers, 1)
    try:
        st = os.statvfs(shm_dir)
        free = st.f_bavail * st.f_frsize
    except OSError:  # no /dev/shm (not Linux): POSIX shared memory without a tmpfs to fill
        free = 2 * workers * MAX_RING_BYTES
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        memory = 8 * workers * MAX_RING_BYTES
    wanted = min(MAX_RING_BYTES, max(RING_BYTES, int(results / LEND_SHARE)))
    size = min(wanted, memory // (8 * workers), free // (2 * workers))
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
    """The main process's side of a worker's ring: creates it; :meth:`take` lends a record (or copies it out)."""

    def __init__(self, size: int, freed: Any, room: int = ENVELOPE_ROOM) -> None:
        """``freed``: a semaphore (value 0) shared with the worker, released once per record freed; ``room``: the
        room its worker leaves before a result (a record says 0 or this: a worker that said more could have the
        main process write an envelope over the record before it)."""
        self.shm = SharedMemory(create=True, size=_CONTROL + size)
        self.size, self.freed, self.room = size, freed, room
        self.name = self.shm.name
        self.taken = 0  # records taken so far: the next one is the writer's record number ``taken``
        self.lent = 0  # bytes of the records lent and not yet freed
        self._published = 0  # frees published to the writer
        self._lock = threading.RLock()  # (a finalizer may run in any thread, within another free)
        self._control: np.ndarray | None = None
        self._records: memoryview | None = None
        try:
            _map_in(self.shm, reserve=True)
        except BaseException:
            self.close()
            raise
        self._control = np.frombuffer(_buf(self.shm), np.int64, 1 + MAX_RECORDS)
        self._records = _buf(self.shm)[_CONTROL : _CONTROL + size]

    def take(self, at: Any, n: Any, room: Any = 0) -> memoryview | bytes:
        """The ``n`` bytes written at ``at``: lent (a read-only view, freed once nothing made from it is left)
        while at most half of the ring is lent, else copied out (freed at once); ``ValueError`` for a record
        outside the ring (freed all the same: the worker waits for its room). ``room``: the bytes the worker left
        free before them (the record starts there), lent with them as their :class:`Headroom` for their
        message's envelope (a message framed there keeps the record lent); a record copied out is copied after
        room of its own (a private buffer, read-only but for its room): its message is framed there too, so that
        a result costs one copy at most."""
        with self._lock:
            number, self.taken = self.taken, self.taken + 1
            records = self._records
            inside = (
                type(at) is int
                and type(n) is int
                and room in (0, self.room)
                and room <= at
                and 0 <= n <= self.size - at
            )
            lend = inside and records is not None and self.lent + room + n <= LEND_SHARE * self.size
            if lend:
                self.lent += room + n
        if not inside or records is None:
            self._free(number, 0)
            raise ValueError(f"ring record [{at!r}, {n!r}] (room {room!r}) is not within the {self.size}-byte ring")
        if not lend:
            try:
                if not room:
                    return bytes(records[at : at + n])
                private = np.empty(room + n, np.uint8)  # a private copy, room first: framed in place all the same
                private[room:] = np.frombuffer(records[at : at + n], np.uint8)
            finally:
                self._free(number, 0)
            writable: Any = private  # (numpy's stubs do not say that an array is a buffer)
            copy = np.frombuffer(memoryview(writable).toreadonly(), np.uint8)  # (read-only: as a lent record)
            return _lend(copy, room, memoryview(writable)[:room])
        # the record's anchor: every array made from it keeps it (numpy's bases stop at the last array before
        # a non-array, here the memoryview, which holds the segment mapped); freed when it goes
        # (of a read-only view: numpy refuses to make anything made from it writable, as for a message's bytes)
        anchor = np.frombuffer(records.toreadonly()[at - room : at + n], np.uint8)
        weakref.finalize(anchor, self._free, number, room + n).atexit = False
        return _lend(anchor, room, records[at - room : at])

    def _free(self, number: int, lent: int) -> None:
        """Record ``number`` is done with (``lent`` bytes of it were lent): tell the writer."""
        with self._lock:
            self.lent -= lent
            control = self._control
            if control is None:  # closed: its worker is gone
                return
            control[1 + self._published % MAX_RECORDS] = number
            self._published += 1
            control[0] = self._published
        self.freed.release()

    def close(self) -> None:
        """Unlink the segment (idempotent); its mapping goes once no record is lent (else with the last array
        made from one: a result kept past the run reads as it was)."""
        with self._lock:
            self._control = self._records = None
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass
        try:
            self.shm.close()
        except BufferError:  # a result still holds a lent record: the mapping goes with the last of them
            log.info("result ring %s: a record is still lent at close, unmapped when released", self.name)
            self.shm._mmap = None  # type: ignore[attr-defined]  # (else __del__ tries again) it closes itself
            self.shm.close()  # its descriptor


def _lend(record: np.ndarray, room: int, writable: memoryview) -> memoryview:
    """``record``'s bytes after its first ``room``, lent: a read-only :class:`Lent` view, with the room as its
    :class:`Headroom` (``writable``: a writable view of the room) where there is room."""
    record.flags.writeable = False
    lent: Any = record[room:].view(Lent)  # (numpy's stubs do not say that an array is a buffer)
    if room:
        lent.headroom = Headroom(record, writable)
    return memoryview(lent)


class RingWriter:
    """A worker's side of its ring: :meth:`put` writes an encoded result into a free gap, waiting for room."""

    def __init__(self, name: str, size: int, freed: Any) -> None:
        self.shm = SharedMemory(name=name)
        if self.shm.size < _CONTROL + size:
            raise ValueError(f"result ring {name} is {self.shm.size} bytes, not {_CONTROL + size}")
        self.size, self.freed = size, freed
        _map_in(self.shm)
        self.control: np.ndarray | None = np.frombuffer(_buf(self.shm), np.int64, 1 + MAX_RECORDS)
        self.records: np.ndarray | None = np.frombuffer(_buf(self.shm), np.uint8, size, _CONTROL)
        self.head = 0  # where the last record ended: the next is placed from here (first fit, wrapping)
        self.written = 0  # records written so far (the next one's number)
        self.read = 0  # freed-list entries read so far
        self.credits = 0  # semaphore releases acquired and not yet matched by an entry read
        self.jammed = False  # the last wait for room timed out: the next results do not wait
        self.starts: list[int] = []  # the live records' offsets, sorted
        self.ends: list[int] = []  # their ends, in the same order
        self.live: dict[int, int] = {}  # record number -> its offset

    def put(self, parts: Parts, room: int = 0) -> tuple[int, int] | None:
        """Write ``parts`` (an encoded payload's buffers, :func:`~protocols.wire.payload.payload_parts`) as one
        record, ``room`` bytes left free before them (for their message's envelope: the record starts there):
        ``(offset, length)`` of the parts' bytes, or ``None`` when they do not fit in the ring, or no room was
        freed within :data:`WAIT_S` (send them through the pipe)."""
        n = parts_size(parts)
        if not 0 < n <= self.size - room or room < 0 or self.records is None:
            return None
        nbytes, n = n, room + n  # the parts' bytes; the record's (its room, then the parts)
        deadline = time.monotonic() + (0.0 if self.jammed else WAIT_S)
        while (at := self._place(n)) is None:
            wait = deadline - time.monotonic()
            if wait <= 0:
                self.jammed = True
                return None
            PROGRESS.tick()  # waiting for the main process to free room is not a hang (sim/worker_watch.py)
            if self.freed.acquire(timeout=min(wait, 0.25)):
                self.credits += 1
        self.jammed = False
        pos = at + room
        for part in parts:
            size = len(part) if isinstance(part, bytes) else part.nbytes
            self.records[pos : pos + size] = np.frombuffer(part, np.uint8)
            pos += size
        i = bisect.bisect_left(self.starts, at)
        self.starts.insert(i, at)
        self.ends.insert(i, at + n)
        self.live[self.written] = at
        self.written += 1
        self.head = at + n
        return at + room, nbytes

    def _reclaim(self) -> None:
        """Forget the records the main process freed (those its releases, acquired so far, vouch for)."""
        while self.freed.acquire(False):
            self.credits += 1
        assert self.control is not None
        count = min(int(self.control[0]) - self.read, self.credits)
        for i in range(self.read, self.read + count):
            at = self.live.pop(int(self.control[1 + i % MAX_RECORDS]), None)
            if at is not None:  # (a refused record's number the writer never wrote is ignored)
                j = bisect.bisect_left(self.starts, at)
                del self.starts[j], self.ends[j]
        self.read += count
        self.credits -= count

    def _place(self, n: int) -> int | None:
        """Where ``n`` bytes fit now: from the head, else the first gap after it, else the first from the ring's
        start; ``None`` when no gap is that large (or :data:`MAX_RECORDS` records are alive)."""
        self._reclaim()
        if len(self.live) >= MAX_RECORDS:
            return None
        if not self.live:
            self.head = 0
        if self.head + n <= self.size and self._free_at(self.head, n):
            return self.head
        gaps = zip([0, *self.ends], [*self.starts, self.size])
        fits = [start for start, end in gaps if end - start >= n]
        later = [start for start in fits if start >= self.head]
        return (later or fits)[0] if fits else None

    def _free_at(self, at: int, n: int) -> bool:
        i = bisect.bisect_left(self.starts, at)
        return (i == 0 or self.ends[i - 1] <= at) and (i == len(self.starts) or self.starts[i] >= at + n)

    def close(self) -> None:
        self.control = self.records = None
        self.shm.close()
