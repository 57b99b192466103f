"""The federation's privacy ledger: the epsilon each device's data has spent across jobs.

A job's accountant bounds one job; the same devices' data serve job after job, and the guarantees compose.
The cloud of a federation keeps one JSON file (beside its job queue) with, per job, the epsilon it may
spend (reserved when the job is accepted: its ``run.rounds`` at its accountant) or did spend (settled when
it ends: its last round's epsilon), its delta and the devices it may use. A device's total is the sum over
the jobs that use it (basic composition: epsilons and deltas add, a valid bound whatever the mechanisms).
With ``privacy.federation_epsilon_budget`` in the cloud's bundle, a job whose reservation would take any
of its devices past the budget is refused at submission, with the device and the figures; so is a job
without DP (it would spend an unbounded epsilon). Written atomically (temporary file, fsync, rename, fsync of
the folder).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..checkpoint import write_durably

FORMAT = 1
LEDGER_FILE = "privacy_ledger.json"


class LedgerError(RuntimeError):
    """The ledger cannot be read or written (the cloud must not run jobs it cannot account)."""


class PrivacyLedger:
    """Per-job epsilon reservations and spendings of a federation, persisted in ``path``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.jobs: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
                if data.get("format") != FORMAT or not isinstance(data.get("jobs"), dict):
                    raise ValueError(f"not a fedtier privacy ledger (format {FORMAT})")
                self.jobs = data["jobs"]
            except (OSError, ValueError) as exc:
                raise LedgerError(f"{self.path}: {exc}") from None

    def spent(self, device: str) -> float:
        """The epsilon ``device``'s data has spent or is reserved for, over every job."""
        return sum(j["epsilon"] for j in self.jobs.values() if device in j["devices"])

    def refusal(self, job: str, devices: Iterable[str], epsilon: float, budget: float | None) -> str | None:
        """Why ``job`` (``epsilon`` on ``devices``) would take a device past ``budget`` (None: it fits)."""
        if budget is None:
            return None
        if not math.isfinite(epsilon):
            return f"job {job} has no differential privacy (unbounded epsilon); the federation's budget is {budget:g}"
        worst, device = max(((self.spent(d), d) for d in devices), default=(0.0, ""))
        if worst + epsilon > budget:
            return (
                f"job {job} would spend epsilon {epsilon:.4g} on devices whose data already spent up to "
                f"{worst:.4g} ({device}): {worst + epsilon:.4g} > privacy.federation_epsilon_budget {budget:g}"
            )
        return None

    def reserve(self, job: str, devices: Iterable[str], epsilon: float, delta: float) -> None:
        """Hold ``epsilon`` for ``job`` on ``devices`` (when it is accepted). An entry the ledger holds of that id
        already is an earlier job's (a cloud that lost its queue, not this ledger, took the id again): its data spent
        it, so it stays, under a name no job id takes (``{job} (earlier 1)``, ...)."""
        if job in self.jobs:
            earlier = next(
                f"{job} (earlier {n})" for n in itertools.count(1) if f"{job} (earlier {n})" not in self.jobs
            )
            self.jobs[earlier] = self.jobs.pop(job)
        self.jobs[job] = {"epsilon": float(epsilon), "delta": float(delta), "devices": sorted(devices), "ended": False}
        self._save()

    def settle(self, job: str, epsilon: float) -> None:
        """``job`` ended having spent ``epsilon`` (at most what it reserved): the rest is released."""
        entry = self.jobs.get(job)
        if entry is None:
            return
        entry["epsilon"], entry["ended"] = min(float(epsilon), entry["epsilon"]), True
        self._save()

    def _save(self) -> None:
        data = json.dumps({"format": FORMAT, "jobs": self.jobs}, sort_keys=True).encode()
        try:  # the rename durable: a reservation lost in a power loss would be overspent
            write_durably(self.path, data, private=False)
        except OSError as exc:
            raise LedgerError(f"cannot write {self.path}: {exc}") from None
