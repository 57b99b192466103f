"""The ``multiprocessing`` context the sim's worker processes start from: a fork server that imported torch and the
workers' modules once, where the platform has one (Linux, macOS), else ``spawn``.

Each worker used to be a fresh interpreter (``spawn``) importing torch and the sim again: about 2.2 s of CPU a
worker, paid before it could take its first task. A fork server is a single-threaded process started once per
parent, that preloads :data:`PRELOAD` and forks each worker from itself: a worker starts with those modules already
imported. This process is never forked (it has threads); the workers are still children that die with it
(``protocols.procs``: the server exits when this process does, and its workers then find their parent gone).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from protocols import procs
from protocols.fast_exit import skip_exit_collection
from protocols.heap import keep_freed_memory
from protocols.safe_text import log_to_stderr

PRELOAD = ("sim.forkserver_exit", "torch", "sim.device_worker", "sim.cell_share", "sim.agent_workers")
"""What the fork server imports before forking: torch and the modules of the workers' entry points; first, what makes
the server exit fast once its workers have (``sim.forkserver_exit``)."""


def worker_context() -> Any:
    """The context to start sim, cell and agent worker processes from (see the module)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # (no effect once this process's server runs: the same list)
    return ctx


class Inherited:
    """What a worker inherits from its launcher as the launcher is when the worker starts: stdout and stderr (sent as
    file descriptors) and the environment. A fork server's worker would otherwise have the server's, those of when
    the first worker started (a test's captured output, long gone; ``CUDA_VISIBLE_DEVICES``, ``FEDTIER_CACHE_DIR``
    set since by a program that runs several simulations), and a worker's log must go where its launcher's goes now."""

    def __init__(self) -> None:
        self._conns = [Connection(os.dup(fd), readable=False) for fd in (1, 2)]
        self._environ = dict(os.environ)

    def adopt(self) -> None:
        """In the worker, first thing: write to the launcher's stdout and stderr, take its environment."""
        for fd, conn in zip((1, 2), self._conns):
            os.dup2(conn.fileno(), fd)
            conn.close()
        os.environ.clear()
        os.environ.update(self._environ)

    def close(self) -> None:
        """In the launcher, once the worker started (it holds its own copies)."""
        for conn in self._conns:
            conn.close()


def start_worker(proc: Any, inherited: Inherited) -> None:
    """Start ``proc`` (given ``inherited`` in its arguments) on the spawner thread (``protocols.procs.spawn``: it dies
    with this process), then close this process's copies of ``inherited``."""
    try:
        procs.spawn(proc.start)
    finally:
        inherited.close()


def launch(ctx: Any, target: Callable[..., None], args: tuple[Any, ...], name: str) -> Any:
    """Start a worker process ``name`` running ``target(*args, parent, inherited)``: this process's pid (it dies with
    this process) and what it inherits from this process now (:class:`Inherited`); its entry point begins with
    :func:`become_worker`. Returns the started process."""
    inherited = Inherited()
    proc = ctx.Process(target=target, args=(*args, os.getpid(), inherited), name=name, daemon=True)
    start_worker(proc, inherited)
    return proc


def become_worker(parent: int | None, inherited: Inherited | None, log_level: int = logging.WARNING) -> None:
    """First thing in a worker's entry point (:func:`launch`): take the launcher's output and environment, leave
    Ctrl-C to the launcher (which stops the worker), die with the launcher (even SIGKILLed), log to stderr under
    the process's name, keep freed memory for reuse (each round frames and decodes model-sized messages) and exit
    without a final collection (~0.15 s, not ~1 s: the launcher waits for it)."""
    if inherited is not None:
        inherited.adopt()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    procs.die_with_parent(parent)
    log_to_stderr(log_level, "%(processName)s %(message)s")
    keep_freed_memory()
    skip_exit_collection()
