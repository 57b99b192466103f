"""Upper bounds of config values that no sane run reaches, and the memory check that refuses a model or a data
set before it is allocated.

A mistyped or generated config must be refused at its start, naming the key, not crash later (``time.sleep`` and
``threading`` waits overflow past about 9.2e9 seconds), start a million threads or processes, or ask numpy or
torch for terabytes."""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_SECONDS = 1e7
"""The longest wait, deadline or period a config may set (about 116 days): far beyond any run's, far below what
the platform's timers take (``threading.TIMEOUT_MAX``, about 9.2e9 seconds)."""

MAX_THREADS = 1024
"""The most threads a config may ask one process for (``runtime.cohort_threads``, ``cell_process_threads``)."""

MAX_PROCESSES = 4096
"""The most worker processes or Ray actors a config may ask for (``runtime.sim_workers``, ``cell_processes``)."""


MAX_ROUNDS = 10**9
"""The most cloud rounds (``run.rounds``; async mode: model versions) and edge rounds a cloud round
(``algorithm.edge_rounds``) a config may ask for: a round a millisecond for 11 days. Nothing is sized by them up
front (the records, DeComFL's log and FedALIGN's schedule grow with the rounds run; the async buffers fill whatever
they are); the bound keeps every round number far below 2**53, exact wherever it is read as a float64 (Prometheus's
``fedtier_cloud_rounds_planned``, JSON readers)."""

MAX_STEPS = 10**9
"""The most local steps (``algorithm.local_steps``) or epochs (``local_epochs``) a device may be asked for in an
edge round. The cohort engine draws a device's minibatches' indices at once, for every device of a cohort: that is
checked against memory when the algorithm is built (``RunConfig.build_algorithm``), and for ``local_epochs`` once the
data is partitioned (``sim.hierarchy.prepare``: the steps depend on a device's samples)."""

MAX_MESSAGE_BYTES = 512 << 20
"""The largest message a node may be told to accept (``runtime.max_message_bytes``): all a transport's incomplete
chunked messages together hold at most this much (``protocols.wire.chunking.DEFAULT_MAX_BYTES``, which a larger
bound was silently cut to), an unchunked one is an MQTT packet (at most 268,435,455 bytes), and the simulator's
messages are the model's size, which the default bound already exceeds 8 times."""

MAX_TEXT_BYTES = 64 << 20
"""The largest config or job file read (a ``topology.members`` of a million devices is ~20 MB)."""

MAX_DEVICES = 10**8
"""The most devices a topology may hold (``topology.cells`` x ``devices_per_cell``, or ``members``)."""

MAX_KEYED_NODES = 10**6
"""The most nodes ``fedtier keys`` and ``fedtier provision`` generate an identity for (a keys file of a million
nodes is ~150 MB, and each takes ~50 us to make)."""


PROCESSES_PER_CORE = 100
"""The most local processes a run may start per core of its machine (``runtime.sim_workers``, ``cell_processes``):
each loads the whole data set."""


def processes_refusal(n: int, what: str) -> str | None:
    """Why starting ``n`` local processes is refused (``what`` says for which key), or ``None`` within
    :data:`PROCESSES_PER_CORE` per core of this machine."""
    cores = os.cpu_count() or 1
    if n <= PROCESSES_PER_CORE * cores:
        return None
    return f"{what}: {n} processes, more than {PROCESSES_PER_CORE} per core of this machine ({cores} cores)"


def machine_memory() -> int | None:
    """This machine's physical memory in bytes, or ``None`` when the platform does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return None


def memory_refusal(nbytes: float, what: str, memory: int | None = None) -> str | None:
    """Why allocating ``nbytes`` is refused (the message starts with ``what``: the key and what it asks for) when
    they exceed ``memory`` (default: this machine's physical memory); ``None`` when they fit or it is unknown."""
    memory = machine_memory() if memory is None else memory
    if memory is None or nbytes <= memory:
        return None
    return f"{what} needs {nbytes / 2**30:,.1f} GiB, more than this machine's {memory / 2**30:,.1f} GiB of memory"


def read_file(path: str | Path, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path``; ``ValueError`` for anything else (a device such as /dev/zero, read
    for ever into memory; a FIFO, which blocks; a folder) or a file over ``limit`` bytes (default: this machine's
    memory), before a byte is read. ``OSError`` as ``open`` raises it (missing, no permission)."""
    mode = os.stat(path).st_mode  # not open(): opening a FIFO blocks until a writer comes
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(21, "Is a directory", str(path))
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path} is not a regular file")
    with open(path, "rb") as f:
        size, cap = os.fstat(f.fileno()).st_size, machine_memory() if limit is None else limit
        if cap is not None and size > cap:
            raise ValueError(f"{path} is {size:,} bytes, more than the {cap:,} it may have")
        return f.read()
