"""Imported by the sim's fork server only, first of :data:`sim.worker_context.PRELOAD`: the server ends, once its exit
handlers ran, without tearing down the interpreter that imported torch and the workers' modules.

The server exits once its last worker has (its alive pipe closed), after its launcher: the last process of a run to
go. With torch imported its interpreter's teardown cost 0.55-0.6 s of CPU (1.5-2.9 s of wall after a SIGKILLed run,
load 9-10 on 2 cores), and a SIGKILLed run's server was once still alive 10 s after its workers had gone
(test_orphans, a fresh-clone suite at load ~9); without the final collections (``protocols.fast_exit``) 0.25-0.3 s;
ended here by ``os._exit`` after its exit handlers, 0.02-0.04 s. Its forked workers exit by ``os._exit`` and run no
exit handler: this changes nothing for them, nor for any process that is not a fork server."""

from __future__ import annotations

import atexit
import os
import sys

from protocols.fast_exit import skip_exit_collection

_PRELOADED_IN = os.getpid()  # the server's (it imports this before it forks any worker)


def is_fork_server() -> bool:
    """Whether this process is the ``multiprocessing`` fork server that imported this module: its ``main`` set the
    server's address, and no server was started from it (a launcher that started one has both set)."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    server = getattr(forkserver, "_forkserver", None)
    address, pid = getattr(server, "_forkserver_address", None), getattr(server, "_forkserver_pid", 1)
    return os.getpid() == _PRELOADED_IN and address is not None and pid is None


def end_fork_server() -> None:
    """Exit handler: in a fork server, run ``multiprocessing``'s exit handler, flush the standard streams and end the
    process now, 0 (1 after an uncaught exception, which the interpreter printed), without the interpreter's teardown.
    Elsewhere nothing."""
    if not is_fork_server():
        return
    from multiprocessing import util

    util._exit_function()  # type: ignore[attr-defined]  # multiprocessing's exit handler, registered before: now
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # None, closed, or a broken pipe: nothing left to say there
            pass
    os._exit(1 if hasattr(sys, "last_value") else 0)


skip_exit_collection()  # (a server that is not ended here, if any: without the final collections)
atexit.register(end_fork_server)  # registered after: runs before it (and after the handlers of the modules it preloads)
