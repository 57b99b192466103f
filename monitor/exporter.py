"""Prometheus metrics of a run, derived from the records the runtimes already write.

A :class:`MetricsExporter` is fed the cell aggregation records and the cloud round records
(``protocols.records``) through the runtimes' ``observers`` seam (:meth:`MetricsExporter.watch_cell`,
:meth:`MetricsExporter.watch_cloud`), plus a few live gauges it reads from the runtime on each scrape
(devices online, the cloud's deadline). :class:`AgentCollector` reads an agent process's counters on
each scrape. :meth:`MetricsExporter.serve` serves ``/metrics``.

Names follow Prometheus conventions: ``fedtier_<tier>_<what>_<unit>``, counters end in ``_total``,
times in seconds, sizes in bytes. Labels are bounded: ``run``, ``cell``, ``tier`` (the four links),
``reason`` (a rejection's kind, ``protocols.rejections.RejectKind``: a small fixed vocabulary that rewording a
message never changes), ``closed_by``. No device ids.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import re
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from protocols.records import TIERS, CellRecord, RoundRecord, parse_record
from protocols.rejections import RejectKind

log = logging.getLogger("fedtier.metrics")

# wall seconds an aggregation or a round takes: from a few ms (a small sim) to the deadlines (minutes)
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


def _kind_label(kind: str | None) -> str:
    """A cloud record's rejection kind as a label value (``invalid`` for one it does not know, or none)."""
    known = {k.value for k in RejectKind}
    return kind if kind in known else RejectKind.INVALID.value


_FAILURES = (  # first match wins: why a job failed -> a bounded label value
    ("storage", ("no space left", "cannot write", "cannot open")),
    ("diverged", ("global model diverged",)),
    ("stalled", ("no cell answered", "cells answered in round", "failed or diverged")),
    ("cell_failed", ("failed in round",)),
    ("handler_error", (" raised ",)),
)
MAX_TASK_FAILURE_KINDS = 8  # distinct exception names a run's metrics label (devices choose them); then "other"


def failure_kind(reason: str) -> str:
    """Why a job failed, reduced to one of a few label values (``other`` when none fits)."""
    text = reason.lower()
    for kind, words in _FAILURES:
        if any(w in text for w in words):
            return kind
    return "other"


def task_failure_kind(reason: str) -> str:
    """A device's task failure ("ValueError: shapes...") reduced to its exception name (``other`` if none)."""
    name = reason.split(":", 1)[0].strip()
    return _label(name) if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]{0,40}", name) else "other"


def _label(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "unknown"


def certificate_days_left(certfile: str | Path, now: dt.datetime | None = None) -> float:
    """Days until the PEM certificate in ``certfile`` expires (negative once it has; NaN when unreadable)."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(Path(certfile).read_bytes())
    except (OSError, ValueError):
        return math.nan
    return (cert.not_valid_after_utc - (now or dt.datetime.now(dt.UTC))).total_seconds() / 86400


class MetricsExporter:
    """The Prometheus metrics of one process (cloud, cells, or both) of run ``run``.

    Thread-safe: records may come from the runtimes' loop thread while the server thread scrapes.
    """

    def __init__(self, run: str, registry: CollectorRegistry | None = None) -> None:
        self.run = run
        self.registry = registry or CollectorRegistry()
        self._lock = threading.Condition()
        self._scrapes_after = 0  # scrapes that began after the latest record
        self.registry.register(_ScrapeCounter(self))  # first: a record that comes mid-scrape resets the count
        r, cell, cloud = self.registry, ("run", "cell"), ("run",)
        # ---------------------------------------------------------------- cells
        self.cell_aggregations = Counter(
            "fedtier_cell_aggregations", "Edge-round aggregations a cell closed", [*cell, "closed_by"], registry=r
        )
        self.cell_round = Gauge("fedtier_cell_round", "Cloud round of the cell's latest aggregation", cell, registry=r)
        self.cell_edge_round = Gauge(
            "fedtier_cell_edge_round", "Edge round of the cell's latest aggregation", cell, registry=r
        )
        self.cell_planned = Counter("fedtier_cell_devices_planned", "Devices sent a task", cell, registry=r)
        self.cell_answered = Counter("fedtier_cell_devices_answered", "Device results aggregated", cell, registry=r)
        self.cell_absent = Counter(
            "fedtier_cell_devices_absent",
            "Devices absent from an aggregation, by reason (offline, not_participating, not_selected, deadline)",
            [*cell, "reason"],
            registry=r,
        )
        self.cell_rejected = Counter(
            "fedtier_cell_results_rejected",
            "Messages the cell refused, by kind of reason",
            [*cell, "reason"],
            registry=r,
        )
        self.cell_diverged = Counter(
            "fedtier_cell_devices_diverged",
            "Devices whose training diverged (answered, not aggregated)",
            cell,
            registry=r,
        )
        self.cell_failed = Counter(
            "fedtier_cell_devices_failed",
            "Devices whose task raised (answered with the reason, not aggregated), by exception name",
            [*cell, "reason"],
            registry=r,
        )
        self._task_failure_kinds: set[str] = set()
        self.cell_bytes = Counter(
            "fedtier_cell_bytes",
            "Payload bytes of the cell's device links (tier: cell_to_device, device_to_cell)",
            [*cell, "tier"],
            registry=r,
        )
        self.cell_duration = Histogram(
            "fedtier_cell_aggregation_duration_seconds",
            "Wall seconds an edge round took, from the tasks to the aggregate",
            cell,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.cell_loss = Gauge(
            "fedtier_cell_device_loss",
            "Mean training loss the answering devices reported in the latest aggregation",
            cell,
            registry=r,
        )
        self.cell_loss_std = Gauge(
            "fedtier_cell_device_loss_stddev", "Its standard deviation over devices", cell, registry=r
        )
        self.cell_participation = Gauge(
            "fedtier_cell_participation_ratio",
            "Answered / devices of the cell in the latest aggregation",
            cell,
            registry=r,
        )
        self.cell_devices = Gauge("fedtier_cell_devices", "Devices of the cell", cell, registry=r)
        self.cell_last = Gauge(
            "fedtier_cell_last_aggregation_timestamp_seconds",
            "Unix time of the cell's latest aggregation",
            cell,
            registry=r,
        )
        self.cell_deadline = Gauge(
            "fedtier_cell_device_deadline_seconds", "Seconds the cell waits for its devices", cell, registry=r
        )
        self.cell_online = Gauge("fedtier_cell_devices_online", "Devices the cell deems online", cell, registry=r)
        # ---------------------------------------------------------------- cloud
        self.cloud_rounds = Counter("fedtier_cloud_rounds", "Cloud rounds closed", [*cloud, "closed_by"], registry=r)
        self.cloud_round = Gauge("fedtier_cloud_round", "The latest closed cloud round (0-based)", cloud, registry=r)
        self.cloud_rounds_planned = Gauge(
            "fedtier_cloud_rounds_planned", "Cloud rounds the run is configured for", cloud, registry=r
        )
        self.cloud_finished = Gauge(
            "fedtier_cloud_finished", "1 once the last round closed (or the job failed)", cloud, registry=r
        )
        self.cloud_job_failed = Gauge(
            "fedtier_cloud_job_failed",
            "1 once the cloud ended the job as failed, by kind (stalled, cell_failed, handler_error, diverged, "
            "storage, other); the reason is in summary.json and the cloud's log",
            [*cloud, "kind"],
            registry=r,
        )
        self.cloud_accuracy = Gauge(
            "fedtier_cloud_accuracy", "Test accuracy of the global model (latest evaluated round)", cloud, registry=r
        )
        self.cloud_loss = Gauge(
            "fedtier_cloud_loss", "Test loss of the global model (latest evaluated round)", cloud, registry=r
        )
        self.cloud_cells_planned = Gauge(
            "fedtier_cloud_cells_planned", "Cells planned in the latest round", cloud, registry=r
        )
        self.cloud_cells_reported = Gauge(
            "fedtier_cloud_cells_reported", "Cells whose report the latest round aggregated", cloud, registry=r
        )
        self.cloud_cells_absent = Counter(
            "fedtier_cloud_cells_absent", "Planned cells that did not report in time", cloud, registry=r
        )
        self.cloud_rejected = Counter(
            "fedtier_cloud_reports_rejected",
            "Messages the cloud refused, by kind of reason",
            [*cloud, "reason"],
            registry=r,
        )
        self.cloud_bytes = Counter(
            "fedtier_cloud_bytes",
            "Payload bytes per tier (cloud_to_cell, cell_to_cloud, "
            "cell_to_device, device_to_cell), as the cells report them",
            [*cloud, "tier"],
            registry=r,
        )
        self.cloud_duration = Histogram(
            "fedtier_cloud_round_duration_seconds",
            "Wall seconds a cloud round took",
            cloud,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.cloud_last = Gauge(
            "fedtier_cloud_last_round_timestamp_seconds",
            "Unix time the latest round closed (or the cloud started)",
            cloud,
            registry=r,
        )
        self.cloud_deadline = Gauge(
            "fedtier_cloud_cell_deadline_seconds", "Seconds the cloud waits for its cells", cloud, registry=r
        )

    # ------------------------------------------------------------------ feeding
    def observe(self, record: dict[str, Any] | CellRecord | RoundRecord) -> None:
        """Fold one cell aggregation record or cloud round record in; an invalid one is logged and skipped
        (metrics never break a run)."""
        try:
            rec = record if isinstance(record, (CellRecord, RoundRecord)) else parse_record(record)
            if isinstance(rec, CellRecord):
                self._cell(rec)
            else:
                self._cloud(rec)
        except (ValueError, TypeError) as exc:
            log.warning("metrics: skipped a record: %s", exc)
            return
        with self._lock:
            self._scrapes_after = 0
            self._lock.notify_all()

    def _cell(self, rec: CellRecord) -> None:
        run, cell = self.run, rec.cell
        self.cell_aggregations.labels(run, cell, _label(rec.closed_by)).inc()
        self.cell_round.labels(run, cell).set(rec.round)
        self.cell_edge_round.labels(run, cell).set(rec.edge_round)
        self.cell_planned.labels(run, cell).inc(len(rec.planned))
        self.cell_answered.labels(run, cell).inc(len(rec.answered))
        for why, count in rec.absent_by_reason().items():  # records of large cells count, not list
            self.cell_absent.labels(run, cell, _label(why)).inc(count)
        for rejection in rec.rejected:
            self.cell_rejected.labels(run, cell, rejection.kind.value).inc()
        if rec.diverged:
            self.cell_diverged.labels(run, cell).inc(len(rec.diverged))
        for why, count in (rec.failed_counts or {}).items():
            kind = task_failure_kind(why)
            if kind not in self._task_failure_kinds and len(self._task_failure_kinds) >= MAX_TASK_FAILURE_KINDS:
                kind = "other"
            self._task_failure_kinds.add(kind)
            self.cell_failed.labels(run, cell, kind).inc(count)
        self.cell_bytes.labels(run, cell, "device_to_cell").inc(rec.bytes_in)
        self.cell_bytes.labels(run, cell, "cell_to_device").inc(rec.bytes_out)
        self.cell_duration.labels(run, cell).observe(rec.duration_s)
        if rec.loss_mean is not None:
            self.cell_loss.labels(run, cell).set(rec.loss_mean)
        if rec.loss_std is not None:
            self.cell_loss_std.labels(run, cell).set(rec.loss_std)
        if rec.coverage is not None:
            self.cell_participation.labels(run, cell).set(rec.coverage)
        self.cell_devices.labels(run, cell).set(rec.cell_size)
        self.cell_last.labels(run, cell).set(rec.time if rec.time is not None else time.time())
        if rec.deadline_s is not None:
            self.cell_deadline.labels(run, cell).set(rec.deadline_s)

    def _cloud(self, rec: RoundRecord) -> None:
        run = self.run
        self.cloud_rounds.labels(run, _label(rec.closed_by)).inc()
        self.cloud_round.labels(run).set(rec.round)
        if rec.rounds is not None:
            self.cloud_rounds_planned.labels(run).set(rec.rounds)
            self.cloud_finished.labels(run).set(1 if rec.round + 1 >= rec.rounds else 0)
        if rec.accuracy is not None:
            self.cloud_accuracy.labels(run).set(rec.accuracy)
        if rec.loss is not None:
            self.cloud_loss.labels(run).set(rec.loss)
        self.cloud_cells_planned.labels(run).set(len(rec.cells_planned))
        self.cloud_cells_reported.labels(run).set(len(rec.cells_reported))
        self.cloud_cells_absent.labels(run).inc(len(rec.cells_absent))
        for rejection in rec.rejected:
            self.cloud_rejected.labels(run, _kind_label(rejection.get("kind"))).inc()
        for tier, n in rec.bytes.items():
            if tier in TIERS:  # a label value from a fixed set, whatever a record holds
                self.cloud_bytes.labels(run, tier).inc(n)
        self.cloud_duration.labels(run).observe(rec.duration_s)
        if rec.failed:
            self.job_failed(rec.failed)
        self.cloud_last.labels(run).set(rec.time if rec.time is not None else time.time())

    # ------------------------------------------------------------------ runtimes
    def watch_cell(self, server: Any) -> None:
        """Observe a :class:`cell_server.server.CellServer`: its records, and its online devices on each scrape."""
        server.observers.append(self.observe)
        self.cell_online.labels(self.run, server.cell).set_function(lambda: sum(server.online.values()))
        self.cell_devices.labels(self.run, server.cell).set(len(server.devices))
        self.cell_deadline.labels(self.run, server.cell).set(server.device_deadline)
        self.registry.register(DeviceFleetCollector(self.run, server))

    def job_failed(self, reason: str) -> None:
        """The cloud ended the job as failed with ``reason``."""
        with self._lock:
            self.cloud_job_failed.labels(self.run, failure_kind(reason)).set(1)
            self.cloud_finished.labels(self.run).set(1)

    def watch_cloud(self, server: Any) -> None:
        """Observe a :class:`cloud.server.CloudServer`: its round records, its deadline, a failed job."""
        server.observers.append(self.observe)
        server.failure_observers.append(self.job_failed)
        self.cloud_deadline.labels(self.run).set(server.cell_deadline)
        self.cloud_rounds_planned.labels(self.run).set(server.rounds)
        self.cloud_finished.labels(self.run).set(0)
        self.cloud_last.labels(self.run).set(time.time())  # "overdue" counts from the start

    # ------------------------------------------------------------------ serving
    def watch_certificate(self, node: str, certfile: str | Path) -> None:
        """``fedtier_certificate_expiry_days{run,node}``: days until the node's broker certificate expires, read
        at each scrape (so a renewed file shows at once; ``fedtier provision renew``)."""
        gauge = Gauge(
            "fedtier_certificate_expiry_days",
            "Days until this node's client certificate expires (negative: expired)",
            ["run", "node"],
            registry=self.registry,
        )
        gauge.labels(self.run, node).set_function(lambda: certificate_days_left(certfile))

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` in a daemon thread (port 0: a free one); the bound port."""
        from prometheus_client import disable_created_metrics, start_http_server

        disable_created_metrics()  # no *_created series: they double the output and dashboards never use them
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        bound = server.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return int(bound)

    def close(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.shutdown()
            server.server_close()

    def _scraped(self) -> None:
        with self._lock:
            self._scrapes_after += 1
            self._lock.notify_all()

    def linger(self, timeout: float) -> bool:
        """Call when the values are final: block until a scraper stored them, or ``timeout`` passed (False).

        Stored means: a scrape began after this call (and after the latest record) and another one after
        it (a scraper starts the next scrape of a target only after it stored the previous one), so
        nothing is lost when the process exits right after."""
        end = time.monotonic() + timeout
        with self._lock:
            self._scrapes_after = 0
            while self._scrapes_after < 2:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True


class _ScrapeCounter(Collector):
    """Exposes nothing; notes that a scrape began (for :meth:`MetricsExporter.linger`)."""

    def __init__(self, exporter: MetricsExporter) -> None:
        self.exporter = exporter

    def collect(self) -> Iterable[Any]:
        self.exporter._scraped()
        return []

    def describe(self) -> Iterable[Any]:
        return []  # registering must not count as a scrape


def _announced(value: Any) -> str:
    """A label value from a device's own announcement (signed, still the device's word): short, plain text."""
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value if value is not None else "")
    return "".join(c if c.isalnum() or c in "._-+:, " else "_" for c in text[:64])


class DeviceFleetCollector(Collector):
    """A cell's devices as the fleet view shows them (``fedtier fleet``), read on each scrape: online or not,
    and what each announced in its signed status (versions, accelerator, backends, cores, memory)."""

    def __init__(self, run: str, server: Any) -> None:
        self.run, self.server = run, server

    def collect(self) -> Iterable[Any]:
        s, labels = self.server, ["run", "cell", "device"]
        online = GaugeMetricFamily("fedtier_device_online", "1 if the cell deems the device online", labels=labels)
        info = GaugeMetricFamily(
            "fedtier_device_info",
            "A device's announced versions and capabilities (value 1)",
            labels=[*labels, "fedtier", "wire", "accelerator", "backends"],
        )
        cores = GaugeMetricFamily("fedtier_device_cores", "CPU cores a device announced", labels=labels)
        memory = GaugeMetricFamily("fedtier_device_memory_mb", "Memory (MB) a device announced", labels=labels)
        caps = dict(s.caps)
        for device in list(s.devices)[:10_000]:  # a simulated population is not a fleet: bounded
            key = [self.run, s.cell, device]
            online.add_metric(key, 1.0 if s.online[device] else 0.0)
            c = caps.get(device)
            if c is None:
                continue
            fields = (c.get("fedtier"), c.get("wire"), c.get("gpu") or c.get("accelerator"), c.get("backends"))
            info.add_metric([*key, *(_announced(v) for v in fields)], 1.0)
            for family, name in ((cores, "cores"), (memory, "memory_mb")):
                if isinstance(c.get(name), int) and not isinstance(c.get(name), bool):
                    family.add_metric(key, float(c[name]))
        return [online, info, cores, memory]

    def describe(self) -> Iterable[Any]:
        return []


class AgentCollector(Collector):
    """The counters of one agent process (``edge_agent.runner.AgentProcess``), read on each scrape."""

    def __init__(self, run: str, agents: Any) -> None:
        self.run, self.agents = run, agents

    def collect(self) -> Iterable[Any]:
        agents = self.agents
        devices = GaugeMetricFamily("fedtier_agent_devices", "Devices this agent process runs", labels=["run"])
        devices.add_metric([self.run], len(agents.agents))
        tasks = CounterMetricFamily("fedtier_agent_tasks", "Tasks the devices of this process answered", labels=["run"])
        tasks.add_metric([self.run], sum(a.tasks_done for a in list(agents.agents.values())))
        train = CounterMetricFamily("fedtier_agent_training_seconds", "Wall seconds spent training", labels=["run"])
        train.add_metric([self.run], agents.train_seconds)
        reconnects = CounterMetricFamily(
            "fedtier_agent_reconnects", "Broker connections beyond each device's first", labels=["run"]
        )
        reconnects.add_metric([self.run], sum(max(0, n - 1) for n in list(agents.connections.values())))
        lies = CounterMetricFamily(
            "fedtier_agent_secagg_cell_lies",
            "Secure aggregations in which a device caught its cell lying (a substituted key, views that disagree)",
            labels=["run"],
        )
        caught = (getattr(getattr(a, "secagg", None), "cell_lies", 0) for a in list(agents.agents.values()))
        lies.add_metric([self.run], sum(int(n) for n in caught))
        return [devices, tasks, train, reconnects, lies]

    def describe(self) -> Iterable[Any]:
        return []
