"""Append-only JSON-lines files: one record per line, flushed at once so a crash loses nothing."""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn


def loads(data: str | bytes, *, finite: bool = False) -> Any:
    """``json.loads`` for untrusted input: every defect is a ``ValueError`` (deep nesting too, which
    ``json`` reports as ``RecursionError``); with ``finite``, ``NaN``, ``Infinity`` and numbers that
    overflow a float (``1e999``) are refused."""
    try:
        if not finite:
            return json.loads(data)
        if isinstance(data, str) and not data.startswith("\ufeff"):  # (json.loads refuses a BOM in a str)
            return _FINITE.decode(data)
        if isinstance(data, (bytes, bytearray)):
            return _FINITE.decode(data.decode(json.detect_encoding(data), "surrogatepass"))  # as json.loads
        return json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def nested_deeper(value: object, limit: int) -> bool:
    """Whether ``value`` (parsed JSON or TOML) nests lists and objects deeper than ``limit`` (walked without
    recursion: what a peer or a file nests is no bound on this process's stack)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        stack.extend((c, depth + 1) for c in items if isinstance(c, (dict, list)))
    return False


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not allowed")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is out of the float range")
    return value


_FINITE = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)
"""``loads(..., finite=True)``'s decoder, made once (``json.loads`` with hooks builds one a call: ~3 us of a
message's metadata; the module's own decoder is shared by every thread the same way)."""


class StorageError(OSError):
    """A run file could not be written (a full disk, a read-only folder): the tier's guard fails the job with
    this message; nothing half-written is left behind."""


@contextlib.contextmanager
def writing(path: str | Path | None, kept: str = "") -> Iterator[None]:
    """Raise an ``OSError`` of the block (a full disk) as the :class:`StorageError` "cannot write PATH: why" (then
    ``kept``: what is left as it was); a :class:`StorageError` raised inside, which names its file already, as is."""
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        raise StorageError(exc.errno, f"cannot write {path}: {exc.strerror or exc}{kept}") from exc


def append_whole(fd: int, data: bytes, sync: bool = False) -> int:
    """Append ``data`` to the file ``fd`` (fsynced with ``sync``), whole or not at all: a write that fails (a full
    disk) is cut off again before its ``OSError`` goes on (no torn tail for the next append to follow). Returns
    where it began."""
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        write_all(fd, data)
        if sync:
            os.fsync(fd)
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise
    return start


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written (a write may take part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def rotated(path: Path) -> list[Path]:
    """``path`` and its rotated predecessors (``path.1`` the newest of them), oldest first, those that exist."""
    older = sorted(
        (p for p in path.parent.glob(path.name + ".*") if p.suffix[1:].isdigit()),
        key=lambda p: -int(p.suffix[1:]),
    )
    return [*older, *([path] if path.exists() else [])]


class JsonlWriter:
    """Appends records to ``path`` (created with its folder); each record is one ``write`` to the file (no
    buffer: a crash loses nothing). A record that cannot be written (``ENOSPC``...) is cut off the file again
    and raises :class:`StorageError`. With ``max_bytes`` the file rotates when it grows past that size:
    ``path`` -> ``path.1`` -> ... -> ``path.{keep}`` (the oldest is dropped), so a long-lived node's records
    stay bounded; readers take the kept files in order (:func:`rotated`)."""

    def __init__(self, path: str | Path | None, max_bytes: int | None = None, keep: int = 4) -> None:
        self.path = Path(path) if path is not None else None
        self.max_bytes, self.keep = max_bytes, max(1, keep)
        self._fd: int | None = None
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as exc:
                raise StorageError(exc.errno, f"cannot open {self.path}: {exc.strerror or exc}") from exc

    def write(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            return
        data = (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode()
        with writing(self.path, " (the record is not written)"):  # no torn line for the next to be glued to
            start = append_whole(self._fd, data)
        if self.max_bytes is not None and start + len(data) >= self.max_bytes:
            self._rotate()

    def _rotate(self) -> None:
        assert self.path is not None and self._fd is not None
        os.close(self._fd)
        oldest = self.path.with_name(f"{self.path.name}.{self.keep}")
        oldest.unlink(missing_ok=True)
        for n in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{n}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{n + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a JSON-lines file; a torn last line (crash mid-write) is skipped."""
    with Path(path).open(encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                yield loads(line)
            except ValueError:
                continue
