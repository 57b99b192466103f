"""Long-lived disk use: records files rotate and stay bounded (readers take every kept file); a full disk is
a clear error that fails the job, and never leaves a torn record or a corrupt checkpoint."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from monitor.sources import RunDirFollower
from protocols import jsonl, runfiles
from protocols.checkpoint import load_params, save_params
from protocols.jsonl import JsonlWriter, StorageError
from protocols.records import CellRecord, read_records
from sim.launcher import SimHierarchy
from tests.conftest import small_config


def full_disk(monkeypatch: pytest.MonkeyPatch, after: int = 10) -> None:
    """Every ``os.write`` of protocols.jsonl writes ``after`` bytes at most, then the disk is full."""
    real = os.write

    def write(fd: int, data) -> int:
        if len(data) > after:
            real(fd, bytes(data[:after]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(jsonl.os, "write", write)


def record(i: int) -> dict:
    return CellRecord(
        run="t", round=i, edge_round=0, cell="c0", algorithm="fedavg", closed_by="all answered", duration_s=0.1, time=i
    ).to_dict()


def test_a_record_that_does_not_fit_is_cut_off_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "aggregation.jsonl"
    writer = JsonlWriter(path)
    writer.write(record(0))
    before = path.read_bytes()
    with monkeypatch.context() as m:
        full_disk(m)
        with pytest.raises(StorageError, match="No space left on device.*not written"):
            writer.write(record(1))
    assert path.read_bytes() == before  # no torn line
    writer.write(record(2))  # space freed: the file goes on whole
    assert [r.round for r in read_records(path)[0]] == [0, 2] and not read_records(path)[1]


def test_a_checkpoint_that_does_not_fit_keeps_the_previous_one(tmp_path: Path, monkeypatch) -> None:
    import numpy as np

    from protocols import checkpoint

    path = tmp_path / "checkpoint.ftw"
    save_params(path, {"w": np.ones(4, np.float32)})

    class Full:
        def __init__(self, fh) -> None:
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.fh.close()

        def write(self, data) -> int:
            self.fh.write(bytes(data[:7]))
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.fh, name)

    real = checkpoint.private_file
    monkeypatch.setattr(checkpoint, "private_file", lambda p: Full(real(p)))
    with pytest.raises(StorageError, match="previous one is kept"):
        save_params(path, {"w": np.zeros(4, np.float32)})
    with pytest.raises(StorageError) as first:  # the first checkpoint: there is no previous one to keep (walked)
        save_params(tmp_path / "first.ftw", {"w": np.zeros(4, np.float32)})
    assert str(first.value).endswith("No space left on device") and not (tmp_path / "first.ftw").exists()
    monkeypatch.undo()
    assert load_params(path)["w"].tolist() == [1, 1, 1, 1] and not list(tmp_path.glob("*.tmp"))


def test_a_journal_entry_that_does_not_fit_is_cut_off_and_closing_raises_nothing(tmp_path: Path, monkeypatch) -> None:
    """A cell's round journal on a full disk (measured on a 2 MB tmpfs: the entry's buffered write failed, the job
    failed naming no file, then closing the journal flushed the buffer again and `fedtier cell --serve` died with a
    traceback): the entry is cut off again, the error names the file, closing raises nothing, and once there is
    space the journal takes the next entry after the earlier ones, whole; a header that does not fit leaves no file
    (else no read could open it)."""
    import numpy as np

    from protocols import checkpoint
    from protocols.checkpoint import Journal
    from protocols.wire.payload import Payload

    def entry(i: int) -> Payload:
        return Payload({"i": i}, {"w": np.full(64, i, np.float32)})

    journal = Journal(tmp_path / "cell-c0.journal")
    journal.append(entry(0))
    before = journal.path.read_bytes()
    with monkeypatch.context() as m:
        full_disk(m, after=100)
        with pytest.raises(StorageError, match=r"cannot write .*cell-c0.journal: No space left on device"):
            journal.append(entry(1))
        journal.close()
    assert journal.path.read_bytes() == before
    journal.append(entry(2))
    assert [e.meta["i"] for e in journal.read()] == [0, 2]
    fresh = Journal(tmp_path / "new.journal")
    with monkeypatch.context() as m:
        full_disk(m, after=2)
        with pytest.raises(StorageError):
            fresh.append(entry(0))
    assert not fresh.path.exists()
    fresh.append(entry(3))
    assert [e.meta["i"] for e in fresh.read()] == [3]
    # the cloud's round log (the same Journal, beside its checkpoint) names its file once: it said "cannot write
    # P: cannot write P: No space left on device (the entry is not written)"
    from cloud.round_log import RoundLog

    rounds = RoundLog(tmp_path / "model.ftw")
    rounds.add(lambda start: {"x": np.zeros((2, 3), np.float32)})
    rounds.saved()
    with monkeypatch.context() as m:
        full_disk(m, after=0)
        with pytest.raises(StorageError) as raised:
            rounds.add(lambda start: {"x": np.zeros((1, 3), np.float32)})
    assert str(raised.value.strerror).count("cannot write") == 1, raised.value
    # a new round's journal that does not fit (walked: "cannot journal round 1's task: [Errno 28] No space left on
    # device", naming no file) names it, the old one whole
    from tests.conftest import FullDisk

    real = checkpoint.private_file
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "private_file", lambda p: FullDisk(real(p)))
        with pytest.raises(StorageError, match=r"cannot write .*new.journal: No space left on device"):
            fresh.reset(entry(4))
    assert [e.meta["i"] for e in fresh.read()] == [3] and not list(tmp_path.glob("*.tmp"))


def test_a_full_disk_fails_the_job_with_a_clear_reason(tmp_path: Path, monkeypatch) -> None:
    """The cloud's records file hits a full disk in round 1: the job fails with that reason (no traceback
    lost in a loop's log, no half-written record), and the checkpoint of round 0 is whole."""
    cfg = small_config(tmp_path, run={"rounds": 5})
    sim = SimHierarchy(cfg)
    write = sim.cloud.metrics.write

    def metrics_write(rec: dict) -> None:
        if rec["round"] == 1:
            full_disk(monkeypatch)
        write(rec)

    sim.cloud.metrics.write = metrics_write  # type: ignore[method-assign]
    result = sim.run()
    assert result.status == "failed" and "No space left on device" in result.failed
    assert f"cannot write {cfg.output_dir() / runfiles.METRICS}" in result.failed
    monkeypatch.undo()
    lines = (cfg.output_dir() / runfiles.METRICS).read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [0]
    assert load_params(cfg.output_dir() / runfiles.CHECKPOINT)


def test_records_rotate_bounded_and_readers_take_every_kept_file(tmp_path: Path) -> None:
    path = tmp_path / "aggregation.jsonl"
    follower = RunDirFollower(tmp_path)
    writer = JsonlWriter(path, max_bytes=600, keep=2)
    seen = []
    for i in range(30):
        writer.write(record(i))
        if i % 3 == 0:  # a monitor polls more often than the file rotates (0.5 s against 256 MiB)
            seen += [r.round for r in follower.poll()[0]]
    writer.close()
    seen += [r.round for r in follower.poll()[0]]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["aggregation.jsonl", "aggregation.jsonl.1", "aggregation.jsonl.2"]
    assert all(p.stat().st_size < 600 + 400 for p in tmp_path.iterdir())  # bounded: 3 files of ~600 bytes
    kept = [r.round for r in read_records(path)[0]]
    assert kept == list(range(30 - len(kept), 30)) and len(kept) < 30  # the oldest dropped, the rest in order
    assert seen == list(range(30)) and follower.restarts == 0  # a live monitor follows the rotation
