"""Child processes that die with their parent, even when the parent is killed with SIGKILL.

A process killed with SIGKILL runs no ``finally`` and no ``atexit``: its children (agent workers,
the Mosquitto it started) would run on as orphans. Two mechanisms, both used:

* Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``): the kernel kills the child as
  soon as its parent exits. The "parent" is the *thread* that started the child, so children are
  started through :func:`spawn`, on one long-lived thread of the process (a child started by a
  short-lived thread would die with that thread).
* a watchdog thread in Python children (:func:`die_with_parent`) that polls the parent pid and kills
  its own process once it changes (the child was re-parented: its parent is gone), for platforms
  without ``prctl``.

External programs (Mosquitto) get the signal through :func:`popen` (``setpriv --pdeathsig`` when
util-linux has it, else a ``preexec_fn``); Python children (``multiprocessing``) call
:func:`die_with_parent` first thing and are started with ``spawn(process.start)``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
WATCHDOG_PERIOD = 0.5
T = TypeVar("T")
_SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="fedtier-spawner")  # its thread lives as long as we do


def spawn(start: Callable[[], T]) -> T:
    """Run ``start`` (which starts a child process) on the process's long-lived spawner thread, so a
    parent-death signal fires when this process dies, not when the calling thread ends."""
    if threading.current_thread().name.startswith("fedtier-spawner"):
        return start()
    return _SPAWNER.submit(start).result()


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()  # looked up once, before any fork: a preexec_fn must not load libraries


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) exits; False where
    that is not available (not Linux)."""
    return _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's (the pid was reused)
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):  # no /proc (not Linux), or it ended meanwhile
        return os.path.exists(f"/proc/{pid}") or not os.path.isdir("/proc/self")


def die_with_parent(parent: int | None = None, period: float = WATCHDOG_PERIOD) -> None:
    """Call first in a child process: it is killed when ``parent`` (default: its parent now) dies —
    by the parent-death signal, and by a daemon watchdog thread checking every ``period`` seconds. A child forked
    by a fork server (``multiprocessing``'s ``forkserver``, which lives as long as its children do) is given its
    launcher's pid as ``parent``: the watchdog checks that process is alive."""
    direct = os.getppid()
    parent = direct if parent is None else parent
    set_parent_death_signal()
    if os.getppid() != direct or not _alive(parent):  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)
    gone = (lambda: os.getppid() != parent) if parent == direct else (lambda: not _alive(parent))

    def watch() -> None:
        while True:
            time.sleep(period)
            if gone():
                log.warning("parent process %d is gone: exiting", parent)
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _child_setup() -> None:  # runs between fork and exec: no imports, no allocations of note
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def popen(cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kwargs)`` whose process the kernel kills when the calling thread's
    process dies (Linux; elsewhere a plain ``Popen``)."""
    if _PRCTL is None:
        return subprocess.Popen(list(cmd), **kwargs)
    setpriv = shutil.which("setpriv")
    if setpriv is not None:
        return spawn(lambda: subprocess.Popen([setpriv, "--pdeathsig", "KILL", "--", *cmd], **kwargs))
    return spawn(lambda: subprocess.Popen(list(cmd), preexec_fn=_child_setup, **kwargs))  # noqa: PLW1509


class _Child(Protocol):
    name: str

    def join(self, timeout: float | None = None) -> None: ...
    def is_alive(self) -> bool: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


def end(children: Sequence[_Child], grace: float = 5.0, what: str = "") -> None:
    """End ``children`` (``multiprocessing`` processes): wait up to ``grace`` seconds for them to exit, terminate
    (SIGTERM) those still alive, logging a warning naming each (``what``: how to call them; "" logs nothing: an
    expected end), and kill any that are still alive 5 seconds later."""
    deadline = time.monotonic() + grace
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.is_alive():
            if what:
                log.warning("terminating %s %s", what, child.name)
            child.terminate()
    for child in children:
        child.join(5.0)
        if child.is_alive():
            child.kill()
            child.join()
