"""deploy/: the Grafana dashboard and the Prometheus alert rules parse (promtool), the alerts fire when
they should (promtool's rule unit tests), and every metric they name is one the exporter serves."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client import generate_latest

from fedtier.docs_reference import metrics_reference
from monitor.exporter import AgentCollector, MetricsExporter

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
DASHBOARD = DEPLOY / "grafana" / "fedtier-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: prometheus)")
# Grafana's template variables, as a dashboard user may set them
VARIABLES = {"$__rate_interval": "1m", "$run": ".*", "$cell": ".*", "$topn": "10"}


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20 and all(exprs)
    out = []
    for expr in exprs:
        for var, value in VARIABLES.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"unknown template variable in {expr}"
        out.append(expr)
    return out


def alert_exprs() -> list[str]:
    return [rule["expr"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def docs_exprs() -> list[str]:
    """The queries docs/how-to/monitor.md gives (its text block after "A few queries"): one a line, a line that
    starts with blanks continuing the one before, a ``#`` comment after each."""
    page = (DEPLOY.parent / "docs" / "how-to" / "monitor.md").read_text()
    block = page.split("A few queries", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    out: list[str] = []
    for line in block.splitlines():
        expr = line.split("  #", 1)[0].strip()
        if line.startswith(" ") and out:
            out[-1] += " " + expr
        elif expr:
            out.append(expr)
    assert len(out) >= 5, block
    return out


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


def served_exporter() -> MetricsExporter:
    """An exporter serving every metric of every tier, each given a value: a cloud and two cells in one process
    (as ``fedtier run``), their devices having announced their capabilities, a certificate, an agent process."""
    exporter = MetricsExporter("r", devices=True)  # ([monitoring] device_metrics: on)
    exporter.observe(
        {
            "schema": 1,
            "event": "aggregation",
            "run": "r",
            "round": 0,
            "edge_round": 0,
            "cell": "c0",
            "algorithm": "fedavg",
            "closed_by": "deadline",
            "duration_s": 0.1,
            "planned": ["c0-d0"],
            "answered": ["c0-d0"],
            "absent": {"c0-d1": "offline"},
            "bytes_in": 5,
            "bytes_out": 7,
            "loss_mean": 1.0,
            "loss_std": 0.1,
            "deadline_s": 5.0,
            "time": 1.0,
            "rejected": [{"device": "c0-d2", "reason": "stale"}],
            "diverged": {"c0-d3": "loss inf"},
            "failed": {"c0-d4": "ValueError: shapes"},
            "failed_counts": {"ValueError: shapes": 1},
        }
    )
    exporter.observe(
        {
            "schema": 1,
            "event": "round",
            "run": "r",
            "round": 0,
            "rounds": 2,
            "closed_by": "deadline",
            "duration_s": 1.0,
            "cells_planned": ["c0", "c1"],
            "cells_reported": ["c0"],
            "cells_absent": ["c1"],
            "bytes": {"cloud_to_cell": 1},
            "accuracy": 0.5,
            "loss": 1.0,
            "rejected": [{"from": "c1", "reason": "stale"}],
            "time": 1.0,
        }
    )
    for cell in ("c0", "c1"):
        device, caps = f"{cell}-d0", {"fedtier": "0.1", "wire": 1, "backends": "torch", "cores": 2, "memory_mb": 512}
        exporter.watch_cell(
            SimpleNamespace(
                observers=[],
                cell=cell,
                online={device: True},
                devices=[device],
                device_deadline=5.0,
                caps={device: caps},
            )
        )
    exporter.watch_cloud(SimpleNamespace(observers=[], failure_observers=[], cell_deadline=10.0, rounds=2))
    exporter.job_failed("no cell answered in rounds 0-2")
    exporter.watch_certificate("c0-d0", "client.crt")  # unreadable here: NaN, but served
    agent = SimpleNamespace(
        agents={"c0-d0": SimpleNamespace(tasks_done=3)}, train_seconds=1.5, connections={"c0-d0": 2}
    )
    exporter.registry.register(AgentCollector("r", agent))
    return exporter


def served_names() -> set[str]:
    """Every sample name the exporter and an agent process serve."""
    return {s.name for family in served_exporter().registry.collect() for s in family.samples}


@needs_promtool
def test_what_the_tiers_serve_passes_promtool_check_metrics(tmp_path: Path) -> None:
    """Prometheus's own linter on a scrape of every family: each family once (a process of two cells served the
    fleet's four families twice, a text promtool refused: "second HELP line"), units in base units (bytes, not
    ``_mb``; a certificate's expiry in seconds, not ``_days``), counters in ``_total``."""
    text = generate_latest(served_exporter().registry).decode()
    assert text.count("# HELP fedtier_device_online ") == 1
    assert 'fedtier_device_memory_bytes{cell="c1",device="c1-d0",run="r"} 5.36870912e+08' in text  # 512 MiB
    checked = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and not checked.stdout + checked.stderr, checked.stdout + checked.stderr


def test_the_metrics_reference_lists_every_family_a_tier_serves() -> None:
    """docs/reference/metrics.md (generated) names every family: the fleet's and the certificate's were missing."""
    listed = set(re.findall(r"^\| `(fedtier_\w+)`", metrics_reference(), re.M))
    served = {f.name + ("_total" if f.type == "counter" else "") for f in served_exporter().registry.collect()}
    assert served and served <= listed, f"not in the reference: {sorted(served - listed)}"


def test_the_dashboard_and_the_alerts_name_only_metrics_the_exporter_serves() -> None:
    served = served_names()
    exprs = dashboard_exprs() + alert_exprs() + docs_exprs()
    used = {name for expr in exprs for name in re.findall(r"\bfedtier_[a-z_]+", expr)}
    assert len(used) >= 20
    assert used <= served, f"not served: {sorted(used - served)}"
    assert {"fedtier_agent_tasks_total", "fedtier_agent_reconnects_total"} <= served


@needs_promtool
def test_every_expression_of_the_dashboard_and_the_alert_rules_parses(tmp_path: Path) -> None:
    checked = promtool("check", "rules", str(ALERTS))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    n = sum(len(g["rules"]) for g in yaml.safe_load(ALERTS.read_text())["groups"])
    assert n >= 10 and f"SUCCESS: {n} rules found" in checked.stdout
    # the dashboard's queries, as recording rules, so that promtool parses each one
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": expr}
                    for i, expr in enumerate(dashboard_exprs() + docs_exprs())  # and the queries of the docs
                ],
            }
        ]
    }
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump(rules))
    checked = promtool("check", "rules", str(tmp_path / "dashboard.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # and promtool does refuse a query that does not parse
    rules["groups"][0]["rules"].append({"record": "dashboard:broken", "expr": "sum by (run (fedtier_cloud_round)"})
    (tmp_path / "broken.yml").write_text(yaml.safe_dump(rules))
    assert promtool("check", "rules", str(tmp_path / "broken.yml")).returncode != 0


@needs_promtool
def test_the_alerts_fire_on_a_silent_cell_a_participation_drop_rejections_and_an_overdue_round() -> None:
    tested = promtool("test", "rules", str(DEPLOY / "prometheus" / "alerts_test.yml"))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


@needs_promtool
def test_the_example_prometheus_config_is_valid() -> None:
    checked = promtool("check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
