"""A sim worker's results through its ring (``sim/result_ring.py``): the main process's CPU a result, lent (decoded
and framed straight from the ring) against copied out first (``LEND_SHARE = 0``: every record copied, as before
session 12), alternating.

    .venv/bin/python benchmarks/result_ring.py [--results 1100] [--repeat 3]

A worker process writes ``--results`` results of the large workload's shape (MLP 784-200-200-10: 797 KB each) into
its 64 MiB ring; the main process's reader thread takes each and decodes it (as ``sim/executors.py`` does), the
main thread frames its message and drops it (the record is freed). The first 100 results are not timed.
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
from protocols.wire.envelope import Header, encode_message
from protocols.wire.payload import Payload, decode_payload, payload_parts
from sim import result_ring

SHAPES = {"0.w": (200, 784), "0.b": (200,), "1.w": (200, 200), "1.b": (200,), "2.w": (10, 200), "2.b": (10,)}
WARM = 100


def _payload() -> Payload:
    rng = np.random.default_rng(0)
    return Payload({"steps": 30}, {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()})


def _worker(name: str, size: int, freed: Any, conn: Any, n: int) -> None:
    keep_freed_memory()
    p = _payload()
    writer = result_ring.RingWriter(name, size, freed)
    for i in range(n):
        p.tensors["2.b"][0] = i  # each result its own bytes
        conn.send(writer.put(payload_parts(p)))
    conn.send(None)
    writer.close()


def run(n: int, lend: bool) -> float:
    """The main process's CPU seconds a result (all its threads)."""
    result_ring.LEND_SHARE = 0.5 if lend else 0.0
    ctx = mp.get_context("spawn")
    freed = ctx.Semaphore(0)
    reader = result_ring.RingReader(result_ring.RING_BYTES, freed)
    r, w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_worker, args=(reader.name, reader.size, freed, w, n))
    proc.start()
    w.close()
    decoded: queue.Queue[Payload | None] = queue.Queue()

    def read() -> None:
        while (where := r.recv()) is not None:
            decoded.put(decode_payload(reader.take(*where), require_finite=False, views=True, checked=True))
        decoded.put(None)

    threading.Thread(target=read, daemon=True).start()
    header = Header(run="r", kind="device_result", round=1, cell="c0", sender="c0-d1", msg_id="x" * 16, payload_len=0)
    got, cpu = 0, 0.0
    while (p := decoded.get()) is not None:
        got += 1
        if got == WARM:
            cpu = time.process_time()
        message = encode_message(header, payload_parts(p))
        assert message[-4:] == p.tensors["2.b"][-1:].tobytes()
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
        for lend in (False, True):
            us = 1e6 * run(args.results, lend)
            print(f"{'lent' if lend else 'copied out':>10}: main process CPU {us:6.1f} us a result", flush=True)


if __name__ == "__main__":
    main()
