"""A sim worker's results through its ring (``sim/result_ring.py``): the main process's CPU a result, framed in
place (the worker leaves room before each result, its message's envelope is written there: no copy of it, session
13) against lent and framed by a copy (session 12) and copied out first (``LEND_SHARE = 0``: every record copied,
as before session 12), alternating.

    .venv/bin/python benchmarks/result_ring.py [--results 1100] [--repeat 3]

A worker process writes ``--results`` results of the large workload's shape (MLP 784-200-200-10: 797 KB each) into
its 64 MiB ring; the main process's reader thread takes each and decodes it (as ``sim/executors.py`` does), the
main thread frames its message as a device's agent does (``Messenger.frame_once``; ``Messenger.frame`` for the
other two) and drops it (the record is freed). The first 100 results are not timed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import threading
import time
from typing import Any

import numpy as np

from protocols.heap import keep_freed_memory
from protocols.transport.memory import MemoryHub
from protocols.wire.envelope import ENVELOPE_ROOM
from protocols.wire.messenger import Messenger
from protocols.wire.payload import Payload, decode_payload
from sim import result_ring

SHAPES = {"0.w": (200, 784), "0.b": (200,), "1.w": (200, 200), "1.b": (200,), "2.w": (10, 200), "2.b": (10,)}
WARM = 100


def _payload() -> Payload:
    rng = np.random.default_rng(0)
    return Payload({"steps": 30}, {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()})


def _worker(name: str, size: int, freed: Any, conn: Any, n: int, room: int) -> None:
    from protocols.wire.payload import payload_parts

    keep_freed_memory()
    p = _payload()
    writer = result_ring.RingWriter(name, size, freed)
    for i in range(n):
        p.tensors["2.b"][0] = i  # each result its own bytes
        conn.send(writer.put(payload_parts(p), room))
    conn.send(None)
    writer.close()


MODES = ("copied out", "lent", "in place")


def run(n: int, mode: str) -> float:
    """The main process's CPU seconds a result (all its threads)."""
    result_ring.LEND_SHARE = 0.0 if mode == "copied out" else 0.5
    room = ENVELOPE_ROOM if mode == "in place" else 0
    ctx = mp.get_context("spawn")
    freed = ctx.Semaphore(0)
    reader = result_ring.RingReader(result_ring.RING_BYTES, freed)
    r, w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_worker, args=(reader.name, reader.size, freed, w, n, room))
    proc.start()
    w.close()
    decoded: queue.Queue[Payload | None] = queue.Queue()

    def read() -> None:
        while (where := r.recv()) is not None:
            decoded.put(decode_payload(reader.take(*where, room), require_finite=False, views=True, checked=True))
        decoded.put(None)

    threading.Thread(target=read, daemon=True).start()
    messenger = Messenger(MemoryHub().connect("c0-d1"), "r", "c0-d1")
    frame = messenger.frame_once if mode == "in place" else messenger.frame
    got, cpu = 0, 0.0
    while (p := decoded.get()) is not None:
        got += 1
        if got == WARM:
            cpu = time.process_time()
        message = frame("device_result", p, round=1, cell="c0")
        assert message[-4:] == p.tensors["2.b"][-1:].tobytes() and isinstance(message, bytes) == (not room)
        del p, message
    cpu = time.process_time() - cpu
    proc.join()
    reader.close()
    return cpu / (got - WARM)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=int, default=1100)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    keep_freed_memory()  # as run_simulation does
    for _ in range(args.repeat):
        for mode in MODES:
            us = 1e6 * run(args.results, mode)
            print(f"{mode:>10}: main process CPU {us:6.1f} us a result", flush=True)


if __name__ == "__main__":
    main()
