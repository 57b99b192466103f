"""Sim, cell and agent workers start from a fork server that imported torch and their modules once
(``sim.worker_context``), not as fresh interpreters importing them again (~2.2 s of CPU a worker)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from sim.worker_context import PRELOAD, become_worker, launch, worker_context


def _what_it_started_with(out: Any) -> None:
    from protocols import fast_exit  # (the server's, as it forked this worker)
    from sim.forkserver_exit import is_fork_server

    out.put(
        (sorted(m for m in PRELOAD if m in sys.modules), os.getppid(), bool(fast_exit._registered), is_fork_server())
    )


def test_a_worker_starts_with_torch_and_the_workers_modules_already_imported_and_is_not_forked_from_here():
    """... and from a server that exits without the final collections over its torch-sized heap (sim.forkserver_exit:
    it took 1.3-2.3 s to exit once its workers had, a SIGKILLed run's fork server the last of its processes to go)."""
    ctx = worker_context()
    out = ctx.SimpleQueue()
    proc = ctx.Process(target=_what_it_started_with, args=(out,))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    imported, parent, skips_exit_collection, server = out.get()
    assert imported == sorted(PRELOAD)  # before its target ran: the server's, not imported again
    assert skips_exit_collection  # registered in the server before it forked this worker
    assert not server  # (a worker is no fork server: its exit is its own)
    assert parent != os.getpid()  # forked by the server, never by this process (it has threads)


ROOT = Path(__file__).resolve().parent.parent
SERVER = """
import multiprocessing.forkserver as forkserver, os, sys
import sim.forkserver_exit
said = lambda event, args, write=os.write: event == "cpython.PyInterpreterState_Clear" and write(1, b"torn down")
sys.addaudithook(said)  # the interpreter's teardown, which ends by clearing its state
state = forkserver._forkserver  # a fork server's main sets its address; a launcher's start, it and the server's pid
if sys.argv[1] in ("server", "failing server", "launcher"):
    state._forkserver_address = "fake"
if sys.argv[1] == "launcher":
    state._forkserver_pid = 1
print("exiting", flush=True)
if sys.argv[1] == "failing server":
    raise RuntimeError("failed")
"""


def test_the_fork_server_ends_after_its_exit_handlers_without_the_interpreters_teardown():
    """A SIGKILLed run's fork server, the last of its processes to go (its workers gone): its interpreter's teardown
    of the heap torch left it cost 0.25-0.3 s of CPU (with protocols.fast_exit), 1.1-1.5 s of wall at load 7-10, and
    at load ~9 a server was once alive 10 s after its run's kill (tests/test_orphans.py). sim.forkserver_exit ends it
    once its exit handlers ran (0.02-0.04 s of CPU): the teardown (here its last audit event) is not done, its exit
    status kept; in a process that is no fork server, it changes nothing."""
    ran = {
        role: subprocess.run([sys.executable, "-c", SERVER, role], capture_output=True, text=True, timeout=60, cwd=ROOT)
        for role in ("server", "failing server", "launcher", "neither")
    }
    said = {role: (r.returncode, r.stdout.split()) for role, r in ran.items()}
    assert said["server"] == (0, ["exiting"]), ran["server"].stderr
    assert said["failing server"] == (1, ["exiting"]) and "RuntimeError: failed" in ran["failing server"].stderr
    assert said["launcher"] == said["neither"] == (0, ["exiting", "torn", "down"]), ran


def _say(parent: int, inherited: Any) -> None:
    become_worker(parent, inherited)
    print("said by the worker", os.environ.get("FEDTIER_TEST_SET_SINCE"), file=sys.stderr, flush=True)


def test_a_worker_writes_where_its_launcher_writes_now_with_its_environment_not_the_servers(tmp_path, monkeypatch):
    """The fork server keeps the stderr and environment it started with (here: before the redirect and the variable
    below, as a test's captured output is): a worker given Inherited logs to the launcher's stderr of the moment it
    starts, with the launcher's environment of that moment (``launch``, ``become_worker``: every sim, cell and agent
    worker's start)."""
    ctx = worker_context()
    warm = ctx.Process(target=os.getpid)  # the server runs before the redirect
    warm.start()
    warm.join(120)
    saved = os.dup(2)
    try:
        with open(tmp_path / "stderr", "wb") as f:
            os.dup2(f.fileno(), 2)
        monkeypatch.setenv("FEDTIER_TEST_SET_SINCE", "and set since")
        proc = launch(ctx, _say, (), "fedtier-test-worker")
        proc.join(120)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    assert proc.exitcode == 0 and (tmp_path / "stderr").read_text() == "said by the worker and set since\n"
