"""Deployment hardening (issue 31): run and job names that are one safe path component, and files that hold
secrets or individual updates readable by their owner only."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocols import runfiles
from protocols.checkpoint import Journal
from protocols.config import ConfigError, parse_config
from protocols.jobs import JobError, check_job_id
from protocols.wire.payload import Payload
from sim.launcher import run_simulation
from tests.conftest import small_config


@pytest.mark.parametrize("name", ["..", ".", ".hidden", "a/b", "../up", "run 1", "", "x" * 65])
def test_a_run_or_job_name_that_is_no_single_safe_path_component_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="run"):
        parse_config({"run": {"name": name}})
    with pytest.raises(JobError):
        check_job_id(name)


def test_plain_names_are_kept() -> None:
    assert parse_config({"run": {"name": "fleet-2.v1_a"}}).run.name == "fleet-2.v1_a"
    assert check_job_id("job-a.2") == "job-a.2"


@pytest.fixture
def open_umask() -> Iterator[None]:
    """Files created meanwhile would be world-readable unless their writer restricts them."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_checkpoints_journals_and_the_run_config_are_mode_600(tmp_path: Path, open_umask: None) -> None:
    cfg = small_config(tmp_path, run={"rounds": 1}, broker={"password": "secret"})
    out = run_simulation(cfg).output_dir
    assert out is not None
    for name in (runfiles.CHECKPOINT, runfiles.CONFIG, runfiles.FINAL_MODEL):
        assert mode(out / name) == 0o600, name
    assert 'password = "secret"' in (out / runfiles.CONFIG).read_text()
    (out / runfiles.CONFIG).chmod(0o644)  # a copy an older version left readable is restricted when rewritten
    run_simulation(cfg)
    assert mode(out / runfiles.CONFIG) == 0o600
    journal = Journal(tmp_path / "cell-c0.journal")
    journal.reset(Payload({"task": 1}, {}))
    journal.append(Payload({"result": "c0-d0"}, {}))
    assert mode(journal.path) == 0o600 and len(journal.read()) == 2


def test_a_journal_created_by_its_first_append_is_private_and_readable_and_a_failed_write_leaves_no_temp_file(
    tmp_path: Path, open_umask: None
) -> None:
    """A journal holds devices' results (and a cell's noise seed): one created by its first append (the async cloud's
    after its file was lost) was made under the umask, world-readable here, while a reset's is the owner's only, and
    without the journal's header: read (a resume) refused it as 'not a fedtier journal'. A write_durably whose rename
    failed (or that Ctrl-C stopped) left its temporary file beside the target."""
    from protocols.checkpoint import write_durably

    journal = Journal(tmp_path / "cloud.journal")
    journal.append(Payload({"k": "push"}, {}))
    assert mode(journal.path) == 0o600 and len(journal.read()) == 1
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "x").write_text("a folder in the file's place: the rename fails")
    with pytest.raises(OSError):
        write_durably(tmp_path / "held", b"state")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cloud.journal", "held"]


def test_fedtier_logs_shows_record_text_as_it_is_never_as_markup() -> None:
    """A record's text (a cloud of a federation writes its cells' records: text a cell chose) is rendered
    literally by `fedtier logs`; an unbalanced closing tag cannot break the table."""
    import io
    import time

    from rich.console import Console

    from fedtier.cmd_logs import records_table
    from protocols.records import CellRecord

    evil = "[/bold] all [red]answered[link=http://x]"
    record = CellRecord(
        run="r",
        round=0,
        edge_round=0,
        cell="c0",
        algorithm="fedavg",
        planned=["c0-d0"],
        answered=["c0-d0"],
        closed_by=evil,
        duration_s=0.1,
        time=time.time(),
    )
    out = Console(width=400, file=io.StringIO(), color_system=None)
    out.print(records_table([record]))
    assert evil in out.file.getvalue()  # type: ignore[attr-defined]
