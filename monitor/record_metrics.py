"""The Prometheus metric families fed by the runtimes' records (``protocols.records``), and their label values.

Four groups, each declaring its families in one registry and folding a record in: what a cell's aggregations
did with its devices (:class:`CellOutcomes`), how they went (:class:`CellHealth`), the cloud's rounds
(:class:`CloudRounds`) and what those rounds got from the cells (:class:`CloudCells`).
Label values are bounded: a fixed vocabulary, or free text made plain and short by :func:`label_value`.
"""

from __future__ import annotations

import re
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from protocols.records import TIERS, CellRecord, RoundRecord
from protocols.rejections import RejectKind

# wall seconds an aggregation or a round takes: from a few ms (a small sim) to the deadlines (minutes)
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
CELL = ("run", "cell")
CLOUD = ("run",)
MAX_LABEL = 64
MAX_TASK_FAILURE_KINDS = 8  # distinct exception names a run's metrics label (devices choose them); then "other"
_FAILURES = (  # first match wins: why a job failed -> a bounded label value
    ("storage", ("no space left", "cannot write", "cannot open")),
    ("diverged", ("global model diverged",)),
    ("stalled", ("no cell answered", "cells answered in round", "failed or diverged")),
    ("cell_failed", ("failed in round",)),
    ("handler_error", (" raised ",)),
)


def label_value(value: Any) -> str:
    """Free text (a reason, a ``closed_by``, a device's announced version or backends) as a label value: at
    most :data:`MAX_LABEL` characters, each one but a letter, a digit or ``._-+:,`` replaced by ``_``; a list
    is joined by commas, ``None`` is empty."""
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value if value is not None else "")
    return "".join(c if c.isalnum() or c in "._-+:," else "_" for c in text[:MAX_LABEL])


def kind_label(kind: str | None) -> str:
    """A cloud record's rejection kind as a label value (``invalid`` for one it does not know, or none)."""
    known = {k.value for k in RejectKind}
    return kind if kind in known else RejectKind.INVALID.value


def failure_kind(reason: str) -> str:
    """Why a job failed, reduced to one of a few label values (``other`` when none fits)."""
    text = reason.lower()
    for kind, words in _FAILURES:
        if any(w in text for w in words):
            return kind
    return "other"


def task_failure_kind(reason: str) -> str:
    """A device's task failure ("ValueError: shapes...") reduced to its exception name in lower case (``other``
    if none)."""
    name = reason.split(":", 1)[0].strip()
    return label_value(name.lower()) if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]{0,40}", name) else "other"


class CellOutcomes:
    """What each edge-round aggregation of a cell did with its devices: planned, answered, absent (by reason),
    rejected (by kind), diverged, failed (by exception name), and how it closed."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.aggregations = Counter(
            "fedtier_cell_aggregations", "Edge-round aggregations a cell closed", [*CELL, "closed_by"], registry=r
        )
        self.round = Gauge(
            "fedtier_cell_round", "Cloud round of the cell's latest aggregation (0-based)", CELL, registry=r
        )
        self.edge_round = Gauge(
            "fedtier_cell_edge_round", "Edge round of the cell's latest aggregation (0-based)", CELL, registry=r
        )
        self.planned = Counter("fedtier_cell_devices_planned", "Devices sent a task", CELL, registry=r)
        self.answered = Counter("fedtier_cell_devices_answered", "Device results aggregated", CELL, registry=r)
        self.absent = Counter(
            "fedtier_cell_devices_absent",
            "Devices absent from an aggregation, by reason (offline, not_participating, not_selected, deadline, "
            "quorum, revoked, requirements, cannot serve)",
            [*CELL, "reason"],
            registry=r,
        )
        self.rejected = Counter(
            "fedtier_cell_results_rejected",
            "Messages the cell refused, by kind of reason",
            [*CELL, "reason"],
            registry=r,
        )
        self.diverged = Counter(
            "fedtier_cell_devices_diverged",
            "Devices whose training diverged (answered, not aggregated)",
            CELL,
            registry=r,
        )
        self.failed = Counter(
            "fedtier_cell_devices_failed",
            "Devices whose task raised (answered with the reason, not aggregated), by exception name",
            [*CELL, "reason"],
            registry=r,
        )
        self._failure_kinds: set[str] = set()

    def observe(self, run: str, rec: CellRecord) -> None:
        """Fold in one aggregation record of cell ``rec.cell``."""
        cell = rec.cell
        self.aggregations.labels(run, cell, label_value(rec.closed_by)).inc()
        self.round.labels(run, cell).set(rec.round)
        self.edge_round.labels(run, cell).set(rec.edge_round)
        self.planned.labels(run, cell).inc(len(rec.planned))
        self.answered.labels(run, cell).inc(len(rec.answered))
        for why, count in rec.absent_by_reason().items():  # records of large cells count, not list
            kind = why.split(":", 1)[0]  # "requirements: ...", "cannot serve: ...": the kind, a bounded label
            self.absent.labels(run, cell, label_value(kind)).inc(count)
        for rejection in rec.rejected:
            self.rejected.labels(run, cell, rejection.kind.value).inc()
        if rec.diverged:
            self.diverged.labels(run, cell).inc(len(rec.diverged))
        for why, count in (rec.failed_counts or {}).items():
            kind = task_failure_kind(why)
            if kind not in self._failure_kinds and len(self._failure_kinds) >= MAX_TASK_FAILURE_KINDS:
                kind = "other"
            self._failure_kinds.add(kind)
            self.failed.labels(run, cell, kind).inc(count)


class CellHealth:
    """How a cell's aggregations go: bytes on its device links, durations, the devices' loss, participation,
    its size, when it last aggregated, its deadline and (read on each scrape) its devices online."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.bytes = Counter(
            "fedtier_cell_bytes",
            "Payload bytes of the cell's device links (tier: cell_to_device, device_to_cell)",
            [*CELL, "tier"],
            registry=r,
        )
        self.resent = Counter(
            "fedtier_cell_bytes_resent",
            "Payload bytes of tasks the cell sent its devices again (a device back while its result was pending, "
            "e.g. a reconnect): retransmission overhead, not in fedtier_cell_bytes",
            CELL,
            registry=r,
        )
        self.duration = Histogram(
            "fedtier_cell_aggregation_duration_seconds",
            "Wall seconds an edge round took, from the tasks to the aggregate",
            CELL,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.loss = Gauge(
            "fedtier_cell_device_loss",
            "Mean training loss the answering devices reported in the latest aggregation",
            CELL,
            registry=r,
        )
        self.loss_std = Gauge(
            "fedtier_cell_device_loss_stddev", "Its standard deviation over devices", CELL, registry=r
        )
        self.participation = Gauge(
            "fedtier_cell_participation_ratio",
            "Answered / devices of the cell in the latest aggregation",
            CELL,
            registry=r,
        )
        self.devices = Gauge("fedtier_cell_devices", "Devices of the cell", CELL, registry=r)
        self.last = Gauge(
            "fedtier_cell_last_aggregation_timestamp_seconds",
            "Unix time of the cell's latest aggregation",
            CELL,
            registry=r,
        )
        self.deadline = Gauge(
            "fedtier_cell_device_deadline_seconds", "Seconds the cell waits for its devices", CELL, registry=r
        )
        self.online = Gauge("fedtier_cell_devices_online", "Devices the cell deems online", CELL, registry=r)

    def observe(self, run: str, rec: CellRecord) -> None:
        """Fold in one aggregation record of cell ``rec.cell``."""
        cell = rec.cell
        self.bytes.labels(run, cell, "device_to_cell").inc(rec.bytes_in)
        self.bytes.labels(run, cell, "cell_to_device").inc(rec.bytes_out)
        self.resent.labels(run, cell).inc(rec.bytes_resent or 0)
        self.duration.labels(run, cell).observe(rec.duration_s)
        if rec.loss_mean is not None:
            self.loss.labels(run, cell).set(rec.loss_mean)
        if rec.loss_std is not None:
            self.loss_std.labels(run, cell).set(rec.loss_std)
        if rec.coverage is not None:
            self.participation.labels(run, cell).set(rec.coverage)
        self.devices.labels(run, cell).set(rec.cell_size)
        self.last.labels(run, cell).set(rec.time if rec.time is not None else time.time())
        if rec.deadline_s is not None:
            self.deadline.labels(run, cell).set(rec.deadline_s)


class CloudRounds:
    """The cloud's rounds: closed (by how), the latest, planned, finished or failed (by kind), and the global
    model's test accuracy and loss."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.rounds = Counter("fedtier_cloud_rounds", "Cloud rounds closed", [*CLOUD, "closed_by"], registry=r)
        self.round = Gauge("fedtier_cloud_round", "The latest closed cloud round (0-based)", CLOUD, registry=r)
        self.planned = Gauge(
            "fedtier_cloud_rounds_planned", "Cloud rounds the run is configured for", CLOUD, registry=r
        )
        self.finished = Gauge(
            "fedtier_cloud_finished", "1 once the last round closed (or the job failed)", CLOUD, registry=r
        )
        self.job_failed = Gauge(
            "fedtier_cloud_job_failed",
            "1 once the cloud ended the job as failed, by kind (stalled, cell_failed, handler_error, diverged, "
            "storage, other); the reason is in summary.json and the cloud's log",
            [*CLOUD, "kind"],
            registry=r,
        )
        self.accuracy = Gauge(
            "fedtier_cloud_accuracy", "Test accuracy of the global model (latest evaluated round)", CLOUD, registry=r
        )
        self.loss = Gauge(
            "fedtier_cloud_loss", "Test loss of the global model (latest evaluated round)", CLOUD, registry=r
        )

    def observe(self, run: str, rec: RoundRecord) -> None:
        """Fold in one cloud round record (a failed job: :meth:`fail`)."""
        self.rounds.labels(run, label_value(rec.closed_by)).inc()
        self.round.labels(run).set(rec.round)
        if rec.rounds is not None:
            self.planned.labels(run).set(rec.rounds)
            self.finished.labels(run).set(1 if rec.round + 1 >= rec.rounds else 0)
        if rec.accuracy is not None:
            self.accuracy.labels(run).set(rec.accuracy)
        if rec.loss is not None:
            self.loss.labels(run).set(rec.loss)

    def fail(self, run: str, reason: str) -> None:
        """The cloud ended the job as failed with ``reason``."""
        self.job_failed.labels(run, failure_kind(reason)).set(1)
        self.finished.labels(run).set(1)


class CloudCells:
    """What the cloud's rounds got from the cells: planned, reported, absent, rejected (by kind), bytes per
    tier, durations, when the latest round closed and the cloud's deadline for its cells."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.planned = Gauge("fedtier_cloud_cells_planned", "Cells planned in the latest round", CLOUD, registry=r)
        self.reported = Gauge(
            "fedtier_cloud_cells_reported", "Cells whose report the latest round aggregated", CLOUD, registry=r
        )
        self.absent = Counter(
            "fedtier_cloud_cells_absent",
            "Planned cells that did not report in time (a cell the federation revoked is not: it is revoked)",
            CLOUD,
            registry=r,
        )
        self.revoked = Gauge(
            "fedtier_cloud_cells_revoked",
            "Cells of the job the federation revoked so far (out of the job, never planned again)",
            CLOUD,
            registry=r,
        )
        self.rejected = Counter(
            "fedtier_cloud_reports_rejected",
            "Messages the cloud refused, by kind of reason",
            [*CLOUD, "reason"],
            registry=r,
        )
        self.bytes = Counter(
            "fedtier_cloud_bytes",
            "Payload bytes per tier (cloud_to_cell, cell_to_cloud, "
            "cell_to_device, device_to_cell), as the cells report them",
            [*CLOUD, "tier"],
            registry=r,
        )
        self.resent = Counter(
            "fedtier_cloud_bytes_resent",
            "Payload bytes of tasks the cloud sent again (a cell that lost its task): not in fedtier_cloud_bytes",
            [*CLOUD, "tier"],
            registry=r,
        )
        self.duration = Histogram(
            "fedtier_cloud_round_duration_seconds",
            "Wall seconds a cloud round took",
            CLOUD,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.last = Gauge(
            "fedtier_cloud_last_round_timestamp_seconds",
            "Unix time the latest round closed (or the cloud started)",
            CLOUD,
            registry=r,
        )
        self.deadline = Gauge(
            "fedtier_cloud_cell_deadline_seconds", "Seconds the cloud waits for its cells", CLOUD, registry=r
        )

    def observe(self, run: str, rec: RoundRecord) -> None:
        """Fold in one cloud round record."""
        self.planned.labels(run).set(len(rec.cells_planned))
        self.reported.labels(run).set(len(rec.cells_reported))
        revoked = rec.cells_revoked or {}
        self.absent.labels(run).inc(sum(cell not in revoked for cell in rec.cells_absent))
        self.revoked.labels(run).set(len(revoked))
        for rejection in rec.rejected:
            self.rejected.labels(run, kind_label(rejection.get("kind"))).inc()
        for tier, n in rec.bytes.items():
            if tier in TIERS:  # a label value from a fixed set, whatever a record holds
                self.bytes.labels(run, tier).inc(n)
        for tier, n in (rec.bytes_resent or {}).items():
            if tier in TIERS:
                self.resent.labels(run, tier).inc(n)
        self.duration.labels(run).observe(rec.duration_s)
        self.last.labels(run).set(rec.time if rec.time is not None else time.time())
