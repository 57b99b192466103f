"""Prometheus metrics of a run, derived from the records the runtimes already write.

A :class:`MetricsExporter` is fed the cell aggregation records and the cloud round records
(``protocols.records``) through the runtimes' ``observers`` seam (:meth:`MetricsExporter.watch_cell`,
:meth:`MetricsExporter.watch_cloud`), plus a few live gauges it reads from the runtime on each scrape
(devices online, the cloud's deadline). :class:`AgentCollector` reads an agent process's counters on
each scrape. :meth:`MetricsExporter.serve` serves ``/metrics``.

Names follow Prometheus conventions: ``fedtier_<tier>_<what>_<unit>``, counters end in ``_total``,
times in seconds, sizes in bytes. Labels are bounded: ``run``, ``cell``, ``tier`` (the four links),
``reason`` (a rejection's kind, ``protocols.rejections.RejectKind``: a small fixed vocabulary that rewording a
message never changes), ``closed_by``. No device ids, except the fleet families ``fedtier_device_*`` of a cell
(:class:`DeviceFleetCollector`, at most :data:`FLEET_DEVICES` devices a cell), served only when asked for
(``devices``: ``[monitoring] device_metrics``): a series per device is millions of series on a large fleet.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from protocols.numbers import finite_number
from protocols.records import CellRecord, RoundRecord, parse_record

from .record_metrics import CellHealth, CellOutcomes, CloudCells, CloudRounds, label_value

log = logging.getLogger("fedtier.metrics")


FLEET_DEVICES = 10_000
"""Devices of a cell its exporter lists in the fleet families at most (a simulated population is not a fleet)."""


def certificate_expiry(certfile: str | Path) -> float:
    """Unix time the PEM certificate in ``certfile`` expires (NaN when unreadable)."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(Path(certfile).read_bytes())
    except (OSError, ValueError):
        return math.nan
    return cert.not_valid_after_utc.timestamp()


class MetricsExporter:
    """The Prometheus metrics of one process (cloud, cells, or both) of run ``run``.

    Thread-safe: records may come from the runtimes' loop thread while the server thread scrapes.
    """

    def __init__(self, run: str, registry: CollectorRegistry | None = None, devices: bool = False) -> None:
        self.run, self.devices = run, devices  # devices: serve the per-device fleet families (DeviceFleetCollector)
        self.registry = registry or CollectorRegistry()
        self._lock = threading.Condition()
        self._scrapes_after = 0  # scrapes that began after the latest record
        self.registry.register(_ScrapeCounter(self))  # first: a record that comes mid-scrape resets the count
        self.cell_outcomes = CellOutcomes(self.registry)
        self.cell_health = CellHealth(self.registry)
        self.cloud_rounds = CloudRounds(self.registry)
        self.cloud_cells = CloudCells(self.registry)
        self.fleet: DeviceFleetCollector | None = None  # the devices of this process's cells (from the first cell)
        self.agents: AgentCollector | None = None  # an agent process's counters (``fedtier.metrics``)

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
        self.cell_outcomes.observe(self.run, rec)
        self.cell_health.observe(self.run, rec)

    def _cloud(self, rec: RoundRecord) -> None:
        self.cloud_rounds.observe(self.run, rec)
        self.cloud_cells.observe(self.run, rec)
        if rec.failed:
            self.job_failed(rec.failed)

    # ------------------------------------------------------------------ runtimes
    def watch_cell(self, server: Any) -> None:
        """Observe a :class:`cell_server.server.CellServer`: its records, and its online devices on each scrape."""
        server.observers.append(self.observe)
        health = self.cell_health
        health.online.labels(self.run, server.cell).set_function(lambda: sum(server.online.values()))
        health.devices.labels(self.run, server.cell).set(len(server.devices))
        health.deadline.labels(self.run, server.cell).set(server.device_deadline)
        if not self.devices:  # the per-cell aggregates above only
            return
        if self.fleet is None:  # one collector for all the cells of the process: each family once in a scrape
            self.fleet = DeviceFleetCollector(self.run)
            self.registry.register(self.fleet)
        self.fleet.servers[server.cell] = server  # a long-lived cell's next job: its server replaces the last

    def job_failed(self, reason: str) -> None:
        """The cloud ended the job as failed with ``reason``."""
        with self._lock:
            self.cloud_rounds.fail(self.run, reason)

    def watch_cloud(self, server: Any) -> None:
        """Observe a :class:`cloud.server.CloudServer`: its round records, its deadline, a failed job."""
        server.observers.append(self.observe)
        server.failure_observers.append(self.job_failed)
        self.cloud_rounds.job_failed.clear()  # a long-lived cloud's next job has not failed (yet)
        self.cloud_cells.deadline.labels(self.run).set(server.cell_deadline)
        self.cloud_rounds.planned.labels(self.run).set(server.rounds)
        self.cloud_rounds.finished.labels(self.run).set(0)
        self.cloud_cells.last.labels(self.run).set(time.time())  # "overdue" counts from the start

    # ------------------------------------------------------------------ serving
    def watch_certificate(self, node: str, certfile: str | Path) -> None:
        """``fedtier_certificate_expiry_timestamp_seconds{run,node}``: when the node's broker certificate expires, read
        at each scrape (so a renewed file shows at once; ``fedtier provision renew``)."""
        gauge = Gauge(
            "fedtier_certificate_expiry_timestamp_seconds",
            "Unix time this node's client certificate expires (days left: (this - time()) / 86400)",
            ["run", "node"],
            registry=self.registry,
        )
        gauge.labels(self.run, node).set_function(lambda: certificate_expiry(certfile))

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` in a daemon thread (port 0: a free one); the bound port. The server is
        prometheus_client's ``start_http_server``'s, whose thread polls for :meth:`close` every 0.5 s: here every
        50 ms (a node with ``--metrics-port`` exited up to half a second late)."""
        from wsgiref.simple_server import make_server

        from prometheus_client import disable_created_metrics, make_wsgi_app
        from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family, _SilentHandler

        disable_created_metrics()  # no *_created series: they double the output and dashboards never use them

        class Server(ThreadingWSGIServer):
            """(A class of its own: the address family is set on it, as start_http_server does.)"""

        Server.address_family, addr = _get_best_family(host, port)
        server = make_server(addr, port, make_wsgi_app(self.registry), Server, handler_class=_SilentHandler)
        serving = threading.Thread(target=server.serve_forever, args=(0.05,), name="metrics-http", daemon=True)
        serving.start()
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


class DeviceFleetCollector(Collector):
    """The devices of a process's cells as the fleet view shows them (``fedtier fleet``), read on each scrape:
    online or not, and what each announced in its signed status (versions, accelerator, backends, cores, memory).
    One per exporter (:attr:`servers`: each cell's latest server), so that a process of several cells
    (``fedtier run``) serves each family once: a family repeated is a scrape ``promtool check metrics`` refuses."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.servers: dict[str, Any] = {}

    def collect(self) -> Iterable[Any]:
        labels = ["run", "cell", "device"]
        online = GaugeMetricFamily("fedtier_device_online", "1 if the cell deems the device online", labels=labels)
        info = GaugeMetricFamily(
            "fedtier_device_info",
            "A device's announced versions and capabilities (value 1)",
            labels=[*labels, "fedtier", "wire", "accelerator", "backends"],
        )
        cores = GaugeMetricFamily("fedtier_device_cores", "CPU cores a device announced", labels=labels)
        memory = GaugeMetricFamily("fedtier_device_memory_bytes", "Memory a device announced", labels=labels)
        for cell, s in sorted(self.servers.items()):
            caps = dict(s.caps)
            for device in list(s.devices)[:FLEET_DEVICES]:
                key = [self.run, cell, device]
                online.add_metric(key, 1.0 if s.online[device] else 0.0)
                c = caps.get(device)
                if c is None:
                    continue
                fields = (c.get("fedtier"), c.get("wire"), c.get("gpu") or c.get("accelerator"), c.get("backends"))
                info.add_metric([*key, *(label_value(v) for v in fields)], 1.0)
                for family, name, unit in ((cores, "cores", 1), (memory, "memory_mb", 2**20)):  # MiB announced
                    said = c.get(name)
                    whole = isinstance(said, int) and not isinstance(said, bool)  # (a whole number: true is none)
                    number = finite_number(said * unit) if whole else None
                    if number is not None:  # (a device's word: 10**400 is none, and must not fail the scrape)
                        family.add_metric(key, number)
        return [online, info, cores, memory]

    def describe(self) -> Iterable[Any]:
        return []


class AgentCollector(Collector):
    """The counters of one agent process (``edge_agent.runner.AgentProcess``), read on each scrape; ``None``
    until :meth:`follow` gives it one (a long-lived agent starts its process with its first job)."""

    def __init__(self, run: str, agents: Any) -> None:
        self.run, self.agents = run, agents

    def follow(self, agents: Any) -> None:
        """Read ``agents`` from now on."""
        self.agents = agents

    def collect(self) -> Iterable[Any]:
        agents = self.agents
        if agents is None:
            return []
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
