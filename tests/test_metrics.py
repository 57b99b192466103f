"""Prometheus metrics (monitor/exporter.py): they equal the records a run writes, in-process and as scraped
by a real Prometheus server from a ``fedtier run``."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedtier.cli import main
from monitor.exporter import MetricsExporter
from protocols import runfiles
from protocols.procs import popen
from protocols.records import CellRecord, RoundRecord, read_run
from protocols.transport.broker import free_port
from sim.launcher import SimHierarchy
from tests.conftest import free_port_run, small_config


def sample(exporter: MetricsExporter, name: str, **labels: str) -> float | None:
    return exporter.registry.get_sample_value(name, {"run": exporter.run, **labels})


def expected_from(run_dir: Path) -> tuple[dict, dict]:
    """Per cell: answered, planned, bytes per tier; per tier: the cloud's bytes (from the run's records)."""
    records, bad = read_run(run_dir)
    assert not bad
    cells: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    cloud: dict[str, int] = defaultdict(int)
    for r in records:
        if isinstance(r, CellRecord):
            cells[r.cell]["answered"] += len(r.answered)
            cells[r.cell]["planned"] += len(r.planned)
            cells[r.cell]["device_to_cell"] += r.bytes_in
            cells[r.cell]["cell_to_device"] += r.bytes_out
            cells[r.cell]["aggregations"] += 1
            for why in r.absent.values():
                cells[r.cell]["absent " + why.replace(" ", "_")] += 1
            cells[r.cell]["participation"] = r.coverage  # the latest
        elif isinstance(r, RoundRecord):
            for tier, n in r.bytes.items():
                cloud[tier] += n
    return cells, cloud


def test_exporter_counters_equal_the_records_of_a_simulated_run(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, participation={"model": "uniform", "per_round": 4}, run={"rounds": 3})
    sim = SimHierarchy(cfg)
    exporter = MetricsExporter(cfg.run.name)
    for cell in sim.cells.values():
        exporter.watch_cell(cell)
    exporter.watch_cloud(sim.cloud)
    result = sim.run()
    cells, cloud = expected_from(result.output_dir)
    assert set(cells) == {"c0", "c1"}
    for cell, want in cells.items():
        assert sample(exporter, "fedtier_cell_devices_answered_total", cell=cell) == want["answered"]
        assert sample(exporter, "fedtier_cell_devices_planned_total", cell=cell) == want["planned"]
        for tier in ("device_to_cell", "cell_to_device"):
            assert sample(exporter, "fedtier_cell_bytes_total", cell=cell, tier=tier) == want[tier]
        assert sample(exporter, "fedtier_cell_aggregation_duration_seconds_count", cell=cell) == want["aggregations"]
        # uniform participation, 4 of 6 devices: the others are absent, "not participating"
        assert (
            sample(exporter, "fedtier_cell_devices_absent_total", cell=cell, reason="not_participating")
            == want["absent not_participating"]
        )
        assert sample(exporter, "fedtier_cell_participation_ratio", cell=cell) == want["participation"]
    assert sum(w["absent not_participating"] for w in cells.values()) == 3 * 2 * 2  # rounds x edge rounds x 2
    assert sum(w["device_to_cell"] for w in cells.values()) > 0
    for tier, n in cloud.items():
        assert sample(exporter, "fedtier_cloud_bytes_total", tier=tier) == n > 0
    assert sample(exporter, "fedtier_cloud_round") == 2
    assert sample(exporter, "fedtier_cloud_finished") == 1
    assert sample(exporter, "fedtier_cloud_accuracy") == result.final_accuracy
    assert sample(exporter, "fedtier_cloud_cells_reported") == 2
    assert sample(exporter, "fedtier_cloud_round_duration_seconds_count") == 3


def test_rejections_are_counted_by_a_bounded_reason_and_bad_records_never_raise() -> None:
    exporter = MetricsExporter("r")
    base = {
        "schema": 1,
        "event": "aggregation",
        "run": "r",
        "round": 0,
        "edge_round": 0,
        "cell": "c0",
        "algorithm": "fedavg",
        "closed_by": "deadline",
        "duration_s": 0.1,
        "planned": ["c0-d0", "c0-d1"],
        "answered": ["c0-d0"],
        "absent": {"c0-d1": "deadline"},
    }
    exporter.observe(
        {
            **base,
            "rejected": [
                {"device": "c0-d1", "kind": "stale", "reason": "stale answer for round 0.0 (now 0.1)"},
                {"device": "c0-d7", "kind": "non_finite", "reason": "update: non-finite values"},
                {"device": "c0-d1", "kind": "signature", "reason": "bad signature of device.c0-d1"},
            ],
        }
    )
    exporter.observe({"event": "aggregation", "schema": 99})  # logged and skipped
    exporter.observe({**base, "answered": "not a list"})
    assert sample(exporter, "fedtier_cell_results_rejected_total", cell="c0", reason="stale") == 1
    assert sample(exporter, "fedtier_cell_results_rejected_total", cell="c0", reason="non_finite") == 1
    assert sample(exporter, "fedtier_cell_results_rejected_total", cell="c0", reason="signature") == 1
    assert sample(exporter, "fedtier_cell_devices_answered_total", cell="c0") == 1
    assert sample(exporter, "fedtier_cell_devices_absent_total", cell="c0", reason="deadline") == 1
    exporter.observe({**base, "edge_round": 1, "diverged": {"c0-d1": "loss is not finite", "c0-d2": "x"}})
    assert sample(exporter, "fedtier_cell_devices_diverged_total", cell="c0") == 2


def test_a_revoked_cell_is_counted_revoked_not_absent() -> None:
    """A round that lost c1 to a revocation and went without c2 (its deadline): the 'cells missing from a round'
    alert (fedtier_cloud_cells_absent_total) counts c2 only; fedtier_cloud_cells_revoked says c1 is out."""
    exporter = MetricsExporter("r")
    base = {"schema": 1, "event": "round", "run": "r", "rounds": 5, "closed_by": "deadline", "duration_s": 1.0}
    exporter.observe({**base, "round": 0, "cells_planned": ["c0", "c1", "c2"], "cells_reported": ["c0", "c1", "c2"]})
    assert sample(exporter, "fedtier_cloud_cells_absent_total") == 0
    assert sample(exporter, "fedtier_cloud_cells_revoked") == 0
    revoked = {"cells_revoked": {"c1": "revoked (roster version 2)"}}
    exporter.observe(
        {
            **base,
            "round": 1,
            "cells_planned": ["c0", "c1", "c2"],
            "cells_reported": ["c0"],
            "cells_absent": ["c1", "c2"],
        }
        | revoked
    )
    assert sample(exporter, "fedtier_cloud_cells_absent_total") == 1
    assert sample(exporter, "fedtier_cloud_cells_revoked") == 1
    exporter.observe({**base, "round": 2, "cells_planned": ["c0", "c2"], "cells_reported": ["c0", "c2"]} | revoked)
    assert (
        sample(exporter, "fedtier_cloud_cells_absent_total") == 1
        and sample(exporter, "fedtier_cloud_cells_revoked") == 1
    )


def test_a_lying_cells_free_text_becomes_a_short_plain_label() -> None:
    """A cell chooses its record's ``closed_by`` and its devices' absence reasons: whatever it writes, the label
    is at most 64 characters of letters, digits and ``._-+:,`` (the one sanitizer, also for device announcements)."""
    from monitor.record_metrics import label_value, task_failure_kind

    exporter = MetricsExporter("r")
    lie = 'all answered"}\n' + "x" * 10_000
    record = {
        "schema": 1,
        "event": "aggregation",
        "run": "r",
        "round": 0,
        "edge_round": 0,
        "cell": "c0",
        "algorithm": "fedavg",
        "closed_by": lie,
        "duration_s": 0.1,
        "planned": ["c0-d0"],
        "answered": [],
        "absent": {"c0-d0": lie},
    }
    exporter.observe(record)
    plain = "all_answered___" + "x" * 49
    assert sample(exporter, "fedtier_cell_aggregations_total", cell="c0", closed_by=plain) == 1
    assert sample(exporter, "fedtier_cell_devices_absent_total", cell="c0", reason=plain) == 1
    assert label_value(["onnx", "torch"]) == "onnx,torch" and label_value(None) == ""
    assert task_failure_kind("numpy.linalg.LinAlgError: singular") == "numpy.linalg.linalgerror"
    assert task_failure_kind("<script>: x") == "other"


# ------------------------------------------------------------------------------ a real Prometheus
PROMETHEUS = shutil.which("prometheus")


class Prometheus:
    """A Prometheus server on a free loopback port scraping ``target`` every second."""

    def __init__(self, tmp: Path, target: str) -> None:
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: fedtier\n    static_configs:\n"
            f"      - targets: ['{target}']\n"
        )
        self.log = (tmp / "prometheus.log").open("w")
        self.proc = popen(  # dies with the test process, even a SIGKILLed one
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        end = time.monotonic() + 30
        while not self._ready():
            assert self.proc.poll() is None, (tmp / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < end, "prometheus did not become ready in 30 s"
            time.sleep(0.1)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def query(self, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
        """An instant query: {labels (without __name__, job, instance): value}."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        skip = {"__name__", "job", "instance"}
        return {
            tuple(sorted((k, v) for k, v in r["metric"].items() if k not in skip)): float(r["value"][1])
            for r in body["data"]["result"]
        }

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (Debian: apt-get install prometheus)")
def test_a_real_prometheus_scrapes_a_fedtier_run_and_its_counters_equal_the_records(tmp_path: Path) -> None:
    # a generous device deadline: on a loaded machine every device still answers (rounds close on "all answered")
    cfg = small_config(tmp_path, run={"rounds": 2}, runtime={"device_deadline": 60.0})
    config = tmp_path / "run.toml"
    config.write_text(cfg.to_toml())
    metrics_port = free_port_run(1)  # bound by the run seconds from now: below the ephemeral range (conftest)
    prom = Prometheus(tmp_path, f"127.0.0.1:{metrics_port}")
    try:
        # --metrics-linger: the run exits only once Prometheus stored the final values. In this process (its agents
        # in their own): no Python process to start and torch to import for the command itself
        run = ["run", str(config), "--no-progress", "--workers", "1", "--metrics-port", str(metrics_port)]
        res = CliRunner().invoke(main, [*run, "--metrics-linger", "60"])
        out = res.output
        assert res.exit_code == 0 and res.exception is None, out
        assert f"metrics on http://127.0.0.1:{metrics_port}/metrics" in out
        assert "no scrape of the final values" not in out
        cells, cloud = expected_from(tmp_path / "run")
        # the run is over (its series are stale now): the last value each series had
        answered = prom.query("last_over_time(fedtier_cell_devices_answered_total[1h])")
        assert answered == {(("cell", c), ("run", "t")): float(w["answered"]) for c, w in cells.items()}
        assert sum(answered.values()) == 2 * 2 * 2 * 3  # rounds x edge rounds x cells x devices, all answered
        bytes_ = prom.query("last_over_time(fedtier_cell_bytes_total[1h])")
        assert bytes_ == {
            (("cell", c), ("run", "t"), ("tier", t)): float(w[t])
            for c, w in cells.items()
            for t in ("device_to_cell", "cell_to_device")
        }
        assert prom.query("last_over_time(fedtier_cloud_bytes_total[1h])") == {
            (("run", "t"), ("tier", t)): float(n) for t, n in cloud.items()
        }
        assert prom.query("last_over_time(fedtier_cloud_round[1h])") == {(("run", "t"),): 1.0}
        assert prom.query("last_over_time(fedtier_cloud_finished[1h])") == {(("run", "t"),): 1.0}
        # the run's own wire counters agree with the cells' (the summary is written from the same run)
        summary = json.loads((tmp_path / "run" / runfiles.SUMMARY).read_text())
        assert summary["cumulative_bytes"]["device_to_cell"] == sum(w["device_to_cell"] for w in cells.values())
    finally:
        prom.close()


def test_every_tier_over_mqtt_serves_its_metrics_over_http(tmp_path: Path) -> None:
    """A cloud, a cell and an agent process over a broker, one exporter serving them all on a loopback port:
    the scraped text has the cell's and the cloud's counters (equal to the records) and the agent
    process's tasks, training seconds and reconnects."""
    from prometheus_client.parser import text_string_to_metric_families

    from cell_server.node import build_cell
    from cloud.node import build_cloud
    from edge_agent.runner import AgentProcess, BrokerOptions, make_trainer, offline_will
    from monitor.exporter import AgentCollector
    from protocols.transport.broker import EmbeddedBroker
    from protocols.transport.threadloop import ThreadLoop
    from protocols.wire import topics
    from sim.hierarchy import prepare

    cfg = small_config(
        tmp_path,
        run={"rounds": 2},
        topology={"cells": 1, "devices_per_cell": 2},
        runtime={"startup_wait": 20.0, "device_deadline": 60.0},
    )
    run, out = cfg.run.name, tmp_path / "run"
    prep = prepare(cfg)
    algorithm = cfg.build_algorithm(prep.spec)
    exporter = MetricsExporter(run)
    port = exporter.serve(0)
    with EmbeddedBroker() as broker:
        opts = BrokerOptions(broker.url)
        loop = ThreadLoop("tiers").start()
        cell_t = opts.transport(topics.cell_node("c0"), run, loop, will=offline_will(run, "cell.c0")).connect()
        cell = build_cell(cfg, "c0", cell_t, algorithm, heartbeats=True, output_dir=out)
        cloud_t = opts.transport("cloud", run, loop, will=offline_will(run, "cloud")).connect()
        cloud = build_cloud(cfg, cloud_t, algorithm, startup_wait=cfg.runtime.startup_wait, output_dir=out)
        exporter.watch_cell(cell)
        exporter.watch_cloud(cloud)
        for node in (cell, cloud):
            node.transport.wait_subscribed()
            loop.post(node.start)
        agents = AgentProcess(cfg, algorithm, prep.device_data, make_trainer("torch", prep.spec, cfg), opts).start()
        exporter.registry.register(AgentCollector(run, agents))
        try:
            assert agents.wait(60.0) and cloud.finished
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        finally:
            agents.stop()
            for node in (cell, cloud):
                loop.post(node.stop)
            loop.stop()
            exporter.close()
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    cells, cloud_bytes = expected_from(out)
    assert got[("fedtier_cell_devices_answered_total", (("cell", "c0"), ("run", run)))] == cells["c0"]["answered"] == 8
    for tier in ("device_to_cell", "cell_to_device"):
        assert got[("fedtier_cell_bytes_total", (("cell", "c0"), ("run", run), ("tier", tier)))] == cells["c0"][tier]
    for tier, n in cloud_bytes.items():
        assert got[("fedtier_cloud_bytes_total", (("run", run), ("tier", tier)))] == n
    assert got[("fedtier_agent_devices", (("run", run),))] == 2
    assert got[("fedtier_agent_tasks_total", (("run", run),))] == 8  # 2 rounds x 2 edge rounds x 2 devices
    assert 0 < got[("fedtier_agent_training_seconds_total", (("run", run),))] < 60
    assert got[("fedtier_agent_reconnects_total", (("run", run),))] == 0
    assert not any(name.endswith("_created") for name, _ in got)


def test_the_late_answers_of_stragglers_count_as_late_not_as_the_rejections_that_alert(tmp_path: Path) -> None:
    """Edge rounds closed at the quorum refuse the answers of the devices they did not wait for when these come:
    they were counted 'stale', as a replayed or old-round message is, and FedtierResultsRejected fired every
    round of a healthy run with stragglers. They are 'late' now, a reason the alert leaves out."""
    cfg = small_config(tmp_path, run={"rounds": 2}, runtime={"quorum": 0.5, "device_deadline": 5.0})
    sim = SimHierarchy(cfg)
    exporter = MetricsExporter(cfg.run.name)
    for cell in sim.cells.values():
        exporter.watch_cell(cell)
    result = sim.run()
    records, _ = read_run(result.output_dir)
    cut_off = [
        (r.cell, d) for r in records if isinstance(r, CellRecord) for d, why in r.absent.items() if why == "quorum"
    ]
    refused = [(r.cell, x.kind.value) for r in records if isinstance(r, CellRecord) for x in r.rejected]
    assert cut_off and refused and {kind for _, kind in refused} == {"late"}
    for cell in ("c0", "c1"):
        late = sum(1 for c, _ in refused if c == cell)
        assert sample(exporter, "fedtier_cell_results_rejected_total", cell=cell, reason="late") == late
        assert sample(exporter, "fedtier_cell_results_rejected_total", cell=cell, reason="stale") is None
    rules = (Path(__file__).parents[1] / "deploy" / "prometheus" / "alerts.yml").read_text()
    assert 'fedtier_cell_results_rejected_total{reason!="late"}' in rules


def test_per_device_series_are_served_only_when_the_config_asks(tmp_path: Path) -> None:
    """``fedtier_device_*`` carry a device id: a series per device and family (up to 10,000 a cell), millions on a
    fleet of 10^6 devices, and every cell served them. They are opt-in now (``[monitoring] device_metrics``, or
    ``--set monitoring.device_metrics=true``); the per-cell aggregates are served either way."""
    from types import SimpleNamespace

    from fedtier.metrics import serve_metrics

    cell = SimpleNamespace(
        observers=[], cell="c0", online={"c0-d0": True, "c0-d1": False}, devices=["c0-d0", "c0-d1"],
        device_deadline=5.0, caps={},
    )  # fmt: skip
    for on in (False, True):
        exporter = serve_metrics(small_config(tmp_path, monitoring={"metrics_port": 0, "device_metrics": on}))
        try:
            exporter.watch_cell(cell)
            port = exporter._server.server_address[1]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as scrape:
                text = scrape.read().decode()
        finally:
            exporter.close()
        assert 'fedtier_cell_devices_online{cell="c0",run="t"} 1.0' in text, text
        assert ('fedtier_device_online{cell="c0",device="c0-d1",run="t"} 0.0' in text) is on, text
        assert ("fedtier_device_" in text) is on, text
