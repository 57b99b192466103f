"""Model files, checkpoints and journals in the ``tensors/v1`` payload format (never pickle).

The bytes depend only on the tensors and metadata, so two runs that end in the same model write
byte-identical files. Writes go to a temporary file that is then renamed: a crash leaves the
previous file intact.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .jsonl import append_whole, write_all, writing
from .limits import read_file
from .wire.envelope import WireError
from .wire.payload import Payload, decode_payload, encode_payload

MAGIC = b"FTCK1\n"


def private_file(path: Path) -> Any:
    """``path`` opened for writing (created or truncated), readable by its owner only (mode 600, also when it
    existed): checkpoints, journals and config copies hold models, individual updates or a broker password."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "wb")


def sync_folder(path: Path) -> None:
    """Make the names in ``path``'s folder durable (fsync the folder): a rename, or a file created, survives a
    power loss only then; the data's own fsync does not cover its name."""
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(
    path: str | Path, data: bytes, *, private: bool = True, before_rename: Callable[[Path], None] | None = None
) -> None:
    """Replace ``path`` with ``data`` atomically and durably, the one way every state file is written (checkpoints,
    journals, ledgers, job queues, rosters, keys): a temporary file beside it, written and fsynced, renamed over it,
    then its folder fsynced (the rename survives a power loss only then). A crash leaves the old file or the new one,
    whole. ``private``: owner only (mode 600), else as created under the umask. ``before_rename`` is called with the
    temporary file (e.g. to give it the old file's owner). A failure before the rename (a full disk, a rename refused,
    Ctrl-C) leaves the old file whole and removes the temporary one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with private_file(tmp) if private else tmp.open("wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if before_rename is not None:
            before_rename(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_folder(path)


def save_payload(path: str | Path, payload: Payload) -> None:
    """Write ``payload`` atomically and durably (:func:`write_durably`), mode 600."""
    kept = " (the previous one is kept)" if Path(path).exists() else ""  # a full disk: the previous file stays whole
    with writing(path, kept):
        write_durably(path, MAGIC + encode_payload(payload))


def load_payload(path: str | Path, sha256: str | None = None) -> Payload:
    """Read a file written by :func:`save_payload`; with ``sha256``, only if the file's digest is that one."""
    data = read_file(path)  # /dev/zero or a file larger than memory: ValueError, before reading
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        got = hashlib.sha256(data).hexdigest()
        raise ValueError(f"its sha256 is {got[:16]}..., not {sha256[:16]}... (not the file named by its digest)")
    if not data.startswith(MAGIC):
        raise ValueError(f"{path} is not a fedtier model/checkpoint file")
    return decode_payload(data[len(MAGIC) :])


def save_params(path: str | Path, params: Mapping[str, np.ndarray], **meta: Any) -> None:
    """Write a model (``name -> array``) with optional JSON metadata."""
    save_payload(path, Payload(dict(meta), dict(params)))


def load_params(path: str | Path, sha256: str | None = None) -> dict[str, np.ndarray]:
    """Read a model written by :func:`save_params` (with ``sha256``: only a file of that digest)."""
    return load_payload(path, sha256).tensors


JOURNAL_MAGIC = b"FTJL1\n"
_ENTRY = struct.Struct("<II")  # length, crc32 of the encoded payload


class Journal:
    """An append-only file of payloads, each fsynced before :meth:`append` returns, for state that grows
    by events (a cell's round: its task, then each result). :meth:`reset` atomically replaces the whole
    file with one first entry (a new round), so the file never holds more than one round. A torn or
    corrupt tail (a crash mid-append) is ignored by :meth:`read` and cut off by the next :meth:`append`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._end: int | None = None  # where the entries :meth:`read` found end

    def read(self) -> list[Payload]:
        """The entries up to the first torn or corrupt one (the file is not changed)."""
        return list(self.scan())

    def scan(self, until: int | None = None) -> Iterator[Payload]:
        """:meth:`read`'s entries one at a time, read from the file as they are asked for (a journal of large entries,
        the async cloud's pushes, is never all in memory), up to offset ``until`` if given (:attr:`end`, as a whole
        scan found it: entries appended since are not read). A whole scan records where its entries end
        (:meth:`append` cuts a torn tail there)."""
        if not self.path.exists():
            return
        with self.path.open("rb") as fh:
            if fh.read(len(JOURNAL_MAGIC)) != JOURNAL_MAGIC:
                raise ValueError(f"{self.path} is not a fedtier journal")
            pos, length = len(JOURNAL_MAGIC), os.fstat(fh.fileno()).st_size
            whole, limit = until is None, length if until is None else min(until, length)
            while pos < limit and pos + _ENTRY.size <= length:
                if whole:
                    self._end = pos
                size, crc = _ENTRY.unpack(fh.read(_ENTRY.size))
                body = fh.read(size) if pos + _ENTRY.size + size <= length else b""  # (a torn length: no allocation)
                if len(body) < size or zlib.crc32(body) != crc:
                    return
                try:
                    entry = decode_payload(body)
                except WireError:
                    return
                pos += _ENTRY.size + size
                yield entry
            if whole:
                self._end = pos

    @property
    def end(self) -> int | None:
        """Where the entries of the last whole :meth:`scan` (or :meth:`read`) end; ``None`` after a reset or append."""
        return self._end

    def reset(self, first: Payload, *more: Payload) -> None:
        """Replace the journal with ``first`` (and ``more``) as its only entries (atomic and durable: temporary
        file, fsync, rename, fsync of the folder). One that cannot be written (a full disk) raises
        :class:`~protocols.jsonl.StorageError` naming the file, the old journal kept whole."""
        self.close()
        with writing(self.path, " (the old one is kept)"):  # owner only: the devices' results, the cell's noise seed
            write_durably(self.path, JOURNAL_MAGIC + b"".join(_frame(entry) for entry in (first, *more)))
        self._end = None

    def append(self, entry: Payload) -> bytes:
        """Add ``entry`` durably (fsync) after the existing ones; returns the bytes added (its frame). An entry that
        cannot be written (a full disk) is cut off the file again and raises :class:`~protocols.jsonl.StorageError`
        naming the file: the journal holds the entries before it, whole, and takes the next one once there is space."""
        frame = _frame(entry)
        with writing(self.path, " (the entry is not written)"):
            append_whole(self._open(), frame, sync=True)
        return frame

    def _open(self) -> int:
        """The journal's file, open to append: created with its header (durably) if there is none, a torn tail
        that :meth:`read` skipped cut off. A header that does not fit leaves no file (else no read could open it)."""
        if self._fd is not None:
            return self._fd
        created = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # owner only, as a reset's
        try:
            if created:  # a journal as a reset makes it: its header, then its name made durable
                write_all(fd, JOURNAL_MAGIC)
                os.fsync(fd)
                sync_folder(self.path)
            if self._end is not None:  # a torn tail that read() skipped goes before anything is added
                os.ftruncate(fd, self._end)
                self._end = None
        except OSError:
            os.close(fd)
            if created:
                self.path.unlink(missing_ok=True)
            raise
        self._fd = fd
        return fd

    def cut(self, end: int) -> None:
        """Keep the file's first ``end`` bytes (entries after them, written by an attempt that a checkpoint did not
        record, go), durably; the next :meth:`append` starts there."""
        self.close()
        with self.path.open("r+b") as fh:
            fh.truncate(end)
            fh.flush()
            os.fsync(fh.fileno())
        self._end = None

    @staticmethod
    def frame(entry: Payload) -> bytes:
        """``entry`` as :meth:`append` writes it: its length, its crc32, its encoding."""
        return _frame(entry)

    def clear(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Close the file (every entry was fsynced as it was added: nothing is left to write, nothing raises)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)


def _frame(entry: Payload) -> bytes:
    body = encode_payload(entry)
    return _ENTRY.pack(len(body), zlib.crc32(body)) + body
