"""The federation's privacy ledger: epsilon per device accumulates across jobs, and the federation's budget
refuses a job that would exceed it (``protocols/privacy/ledger.py``, ``cloud/service.py``)."""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

import pytest

from cloud import job_requests
from cloud.jobs import JobQueue
from cloud.service import CloudService
from protocols.jobs import JobError
from protocols.privacy.ledger import LEDGER_FILE, LedgerError, PrivacyLedger
from tests.conftest import small_config

JOB = """
[run]
seed = 3
rounds = {rounds}
[algorithm]
name = "fedavg"
[privacy]
dp = "cell"
noise_multiplier = 4.0
"""


def test_the_ledger_adds_up_each_devices_jobs_and_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / LEDGER_FILE
    ledger = PrivacyLedger(path)
    ledger.reserve("a", ["c0-d0", "c0-d1"], 1.5, 1e-5)
    ledger.reserve("b", ["c0-d1"], 2.0, 1e-5)
    assert ledger.spent("c0-d0") == 1.5 and ledger.spent("c0-d1") == 3.5 and ledger.spent("c1-d0") == 0
    assert ledger.refusal("c", ["c0-d0"], 2.0, budget=4.0) is None
    reason = ledger.refusal("c", ["c0-d0", "c0-d1"], 1.0, budget=4.0)
    assert reason is not None and "c0-d1" in reason and "4.5 > privacy.federation_epsilon_budget 4" in reason
    assert "no differential privacy" in (ledger.refusal("d", ["c0-d0"], math.inf, budget=100.0) or "")
    ledger.settle("b", 0.5)  # stopped early: the rest of its reservation is released
    again = PrivacyLedger(path)
    assert again.spent("c0-d1") == 2.0 and again.jobs["b"]["ended"]
    path.write_text("{}")
    with pytest.raises(LedgerError, match="not a fedtier privacy ledger"):
        PrivacyLedger(path)


def test_the_federations_budget_refuses_a_job_that_would_exceed_it(tmp_path: Path) -> None:
    bundle = small_config(tmp_path, run={"name": "fed"}, privacy={"federation_epsilon_budget": 10.0})
    queue = JobQueue(tmp_path / "q" / "jobs.json")
    service = CloudService(bundle, None, lambda: None, queue, None, trust=None, operator=None)  # type: ignore[arg-type]
    for job in ("j1", "j2"):
        job_requests.submit(service, job, {"config": JOB.format(rounds=3)})
    per_job = service.ledger.jobs["j1"]["epsilon"]  # the job's accountant: 3 rounds at z = 4, E = 1
    assert 3.4 < per_job < 5  # two such jobs fit in 10, a third does not
    assert [j.job for j in queue.jobs.values()] == ["j1", "j2"]
    assert service.ledger.spent("c1-d2") == pytest.approx(2 * per_job)
    with pytest.raises(JobError, match=r"would spend epsilon .* > privacy.federation_epsilon_budget 10"):
        job_requests.submit(service, "j3", {"config": JOB.format(rounds=3)})
    with pytest.raises(JobError, match="no differential privacy"):
        job_requests.submit(service, "plain", {"config": '[algorithm]\nname = "fedavg"\n'})
    assert "j3" not in queue.jobs and "plain" not in queue.jobs  # refused jobs are not queued
    job_requests.cancel(service, "j2")  # never ran: its reservation goes back
    job_requests.submit(service, "j3", {"config": JOB.format(rounds=3)})
    restarted = CloudService(bundle, None, lambda: None, queue, None, trust=None, operator=None)  # type: ignore[arg-type]
    assert restarted.ledger.spent("c0-d0") == pytest.approx(2 * per_job)  # j1 and j3, from the file


def test_a_job_id_a_cloud_that_lost_its_queue_takes_again_keeps_the_earlier_jobs_spending(tmp_path: Path) -> None:
    """A cloud whose ``jobs.json`` was lost (moved aside, unreadable) but not the ledger beside it accepts a job id
    again (its queue no longer holds it; ec80d18 runs it as a new session). The new job's reservation replaced the
    ledger entry of that id, the earlier job's spending: its devices' data counted once, and the budget admitted a
    job past it. The earlier job's entry is kept."""
    bundle = small_config(tmp_path, run={"name": "fed"}, privacy={"federation_epsilon_budget": 10.0})
    path = tmp_path / "q" / "jobs.json"
    service = CloudService(bundle, None, lambda: None, JobQueue(path), None, trust=None, operator=None)  # type: ignore[arg-type]
    job_requests.submit(service, "j1", {"config": JOB.format(rounds=3)})
    per_job = service.ledger.jobs["j1"]["epsilon"]  # (3.4-5: two such jobs fit in 10, a third does not)
    service.ledger.settle("j1", per_job)  # it ran to its end
    path.unlink()  # the queue lost, the ledger kept
    service = CloudService(bundle, None, lambda: None, JobQueue(path), None, trust=None, operator=None)  # type: ignore[arg-type]
    job_requests.submit(service, "j1", {"config": JOB.format(rounds=3)})  # the same id again, a new job
    assert service.ledger.spent("c0-d0") == pytest.approx(2 * per_job)
    with pytest.raises(JobError, match=r"would spend epsilon .* > privacy.federation_epsilon_budget 10"):
        job_requests.submit(service, "j2", {"config": JOB.format(rounds=3)})
    job_requests.cancel(service, "j1")  # the new j1 never ran: its reservation (only) goes back
    assert PrivacyLedger(service.ledger.path).spent("c0-d0") == pytest.approx(per_job)


def test_a_reservation_is_made_durable_by_an_fsync_of_the_ledgers_folder(tmp_path: Path, monkeypatch) -> None:
    """The ledger's rename is followed by an fsync of its folder: without it, a power loss could bring back the
    ledger before a job's reservation, and the next job be admitted past the federation's budget."""
    events: list[str] = []
    replace, fsync = os.replace, os.fsync

    def recording_fsync(fd: int) -> None:
        fsync(fd)
        events.append("fsync folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")

    monkeypatch.setattr(os, "replace", lambda src, dst: (replace(src, dst), events.append("replace")))
    monkeypatch.setattr(os, "fsync", recording_fsync)
    PrivacyLedger(tmp_path / "ledger.json").reserve("j1", ["c0-d0"], 1.0, 1e-5)
    assert events == ["fsync file", "replace", "fsync folder"], events
