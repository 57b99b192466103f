"""Knowing when another process has read a file: Linux's inotify (a read-only open, then its close).

A broker told to reload (SIGHUP) rereads its revocation list and ACL some moments later, in its own loop:
``fedtier provision revoke`` returned before that, and a revoked certificate logged in right after it
(measured: 4 of 15 logins tried at once, Mosquitto 2.0.11 on 2 loaded cores). :func:`watch_reads` lets the
caller wait until the files were read again. Elsewhere than Linux it cannot tell (its wait says ``None``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

_IN_CLOSE_NOWRITE, _IN_ONLYDIR = 0x10, 0x01000000
_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of the file's name, NUL-padded)


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.inotify_init1  # noqa: B018 (absent outside Linux)
    except (OSError, AttributeError):
        return None
    return libc


@contextlib.contextmanager
def watch_reads(paths: list[Path]) -> Iterator[Callable[[float], bool | None]]:
    """Watch ``paths`` from now on; yields ``wait(timeout)``: ``True`` once each was opened read-only and closed
    again (by any process), ``False`` if not within ``timeout`` seconds, ``None`` where this cannot be watched
    (no inotify, no paths, a path that does not exist). Each file and its folder (by the file's name) are watched: a
    file replaced meanwhile (a rename over it) is the one read, not the one it replaced (a watch of that inode alone
    waited out ``timeout``), and a file bind-mounted alone into a broker's container is read under no folder of ours."""
    libc = _libc()
    fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC) if libc is not None and paths else -1
    if fd < 0:
        yield lambda timeout: None
        return
    try:
        watched: dict[tuple[int, bytes], Path] = {}  # (a watch, the name its event gives) -> the file
        for path in paths:
            for target, name, only in ((path, b"", 0), (path.parent, os.fsencode(path.name), _IN_ONLYDIR)):
                wd = libc.inotify_add_watch(fd, os.fsencode(target), _IN_CLOSE_NOWRITE | only)  # type: ignore[union-attr]
                if wd < 0:
                    yield lambda timeout: None
                    return
                watched[(wd, name)] = path  # (one folder twice: the same watch)
        pending = set(paths)

        def wait(timeout: float) -> bool:
            end = time.monotonic() + timeout
            while pending:
                left = end - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    return False
                data = os.read(fd, 4096)
                at = 0
                while at + _EVENT.size <= len(data):
                    wd, mask, _, size = _EVENT.unpack_from(data, at)
                    name = data[at + _EVENT.size : at + _EVENT.size + size].rstrip(b"\0")
                    at += _EVENT.size + size
                    if mask & _IN_CLOSE_NOWRITE and (path := watched.get((wd, name))) is not None:
                        pending.discard(path)
            return True

        yield wait
    finally:
        os.close(fd)
