"""Rejections carry a kind from a fixed vocabulary, from where they are raised to the metric label."""

from __future__ import annotations

import ast
import functools
import pickle
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from monitor.exporter import MetricsExporter
from protocols.answers import Answers
from protocols.records import CellRecord
from protocols.rejections import Rejected, RejectKind, kind_of
from protocols.transport.memory import MemoryHub
from protocols.wire.envelope import WireError
from protocols.wire.messenger import Messenger
from protocols.wire.payload import Payload
from tests.conftest import product_trees

ROOT = Path(__file__).resolve().parents[1]


def _calls(name: str) -> list[tuple[str, ast.Call]]:
    """Every call of a function or method named ``name`` in the product packages, with where it is."""
    return _all_calls().get(name, [])


@functools.cache
def _all_calls() -> dict[str, list[tuple[str, ast.Call]]]:
    """The product packages' calls by the called name: parsed once for the tests below (each reads it only)."""
    found: dict[str, list[tuple[str, ast.Call]]] = {}
    for where, tree in product_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if called is not None:
                    found.setdefault(called, []).append((f"{where}:{node.lineno}", node))
    return found


def _names_a_kind(arg: ast.expr) -> bool:
    """``RejectKind.X``, or a kind taken from a refusal (``exc.kind``, ``kind_of(...)``, a ``kind`` variable)."""
    if isinstance(arg, ast.Attribute):
        return (isinstance(arg.value, ast.Name) and arg.value.id == "RejectKind") or arg.attr == "kind"
    if isinstance(arg, ast.Call):
        return getattr(arg.func, "id", None) == "kind_of"
    return isinstance(arg, ast.Name) and arg.id == "kind"


@pytest.mark.parametrize("name", ["Rejected", "WireError", "OffPlan"])
def test_every_refusal_names_its_kind(name: str) -> None:
    calls = _calls(name)
    assert len(calls) >= {"Rejected": 80, "WireError": 25, "OffPlan": 2}[name]
    missing = [where for where, call in calls if not call.args or not _names_a_kind(call.args[0])]
    assert not missing, f"{name}(...) without a RejectKind first: {missing}"


def test_every_reported_rejection_names_its_kind() -> None:
    calls = _calls("reject")
    assert len(calls) >= 25
    bad = [where for where, call in calls if len(call.args) != 4 or not _names_a_kind(call.args[1])]
    assert not bad, f"Messenger.reject(topic, kind, reason, sender) without a kind: {bad}"


def test_a_refusal_without_a_kind_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="RejectKind"):
        Rejected("stale", "no kind")  # type: ignore[arg-type]  # the mistake this test is about
    with pytest.raises(TypeError):
        WireError("bad magic")  # type: ignore[call-arg]  # the mistake this test is about


def test_the_kind_survives_pickling_and_kind_of_defaults() -> None:
    exc = pickle.loads(pickle.dumps(Rejected(RejectKind.BOUND, "weight 1e+09 exceeds")))
    assert isinstance(exc, Rejected) and exc.kind is RejectKind.BOUND and str(exc) == "weight 1e+09 exceeds"
    assert kind_of(WireError(RejectKind.OVERSIZED, "too big")) is RejectKind.OVERSIZED
    assert kind_of(ValueError("plain")) is RejectKind.INVALID
    assert kind_of(ValueError("plain"), RejectKind.SHAPE) is RejectKind.SHAPE


def _record(*rejected: tuple[str, str]) -> CellRecord:
    return CellRecord.model_validate(
        {
            "round": 0,
            "edge_round": 0,
            "cell": "c0",
            "algorithm": "fedavg",
            "closed_by": "deadline",
            "duration_s": 0.1,
            "rejected": [{"device": "c0-d1", "kind": k, "reason": why} for k, why in rejected],
        }
    )


def _rejected_by_label(exporter: MetricsExporter) -> dict[str, float]:
    return {
        s.labels["reason"]: s.value
        for family in exporter.registry.collect()
        for s in family.samples
        if s.name == "fedtier_cell_results_rejected_total"
    }


def test_rewording_a_reason_does_not_change_the_metric_label() -> None:
    exporter = MetricsExporter("r", CollectorRegistry())
    # the same kind in other words counts under one label; words that name another kind do not move it
    exporter.observe(_record(("stale", "stale answer for round 0.0 (now 0.1)")).to_dict())
    exporter.observe(_record(("stale", "this answer came in late, a non-finite signature")).to_dict())
    exporter.observe(_record(("bound", "weight 1e+09 exceeds the 600 samples known for c0-d1")).to_dict())
    assert _rejected_by_label(exporter) == {"stale": 2.0, "bound": 1.0}
    # a record written before kinds existed still parses, and counts as invalid
    old = _record(("stale", "bad signature")).to_dict()
    del old["rejected"][0]["kind"]
    exporter.observe(old)
    assert _rejected_by_label(exporter) == {"stale": 2.0, "bound": 1.0, "invalid": 1.0}


def test_the_runtimes_report_the_kind_of_what_they_refuse() -> None:
    seen: list[tuple[RejectKind, str]] = []
    hub = MemoryHub()
    receiver = Messenger(hub.connect("cell"), "r", "c0", on_reject=lambda t, kind, why, s: seen.append((kind, why)))
    receiver.receive("t", b"not a fedtier message at all")
    receiver.receive(
        "t", Messenger(hub.connect("x"), "other-run", "c0-d0").frame("device_result", Payload({}), round=0)
    )
    assert [k for k, _ in seen] == [RejectKind.MALFORMED, RejectKind.WRONG_SENDER]

    answers = Answers("device")
    answers.open((1, 0), ["c0-d0"])
    result = Payload({"weight": 1.0}, {"w": np.zeros(2, np.float32)})
    ok = answers.offer("c0-d0", "c0-d0", (0, 0), result, lambda who, p: None)
    assert ok is not None and ok.kind is RejectKind.STALE
    assert answers.offer("c0-d9", "c0-d9", (1, 0), result, lambda who, p: None).kind is RejectKind.NOT_PLANNED  # type: ignore[union-attr]  # a refusal is expected here

    def check(who: str, payload: Payload) -> None:
        raise Rejected(RejectKind.NON_FINITE, "update: non-finite values")

    refused = answers.offer("c0-d0", "c0-d0", (1, 0), result, check)
    assert refused is not None and refused.kind is RejectKind.NON_FINITE and "c0-d0" in answers.pending


def test_the_metrics_reference_names_every_kind() -> None:
    text = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    assert [k.value for k in RejectKind if f"`{k.value}`" not in text] == []


def test_a_late_answer_is_late_once_and_a_broken_one_is_refused_for_what_it_holds() -> None:
    """A device the round closed without answers it later: 'late' (expected, no alert). A second copy is stale;
    a late answer with non-finite values is refused as such (an alert), whenever it comes."""
    answers = Answers("device")
    answers.open((1, 0), ["c0-d0", "c0-d1", "c0-d2"])
    result = Payload({"weight": 1.0}, {"w": np.zeros(2, np.float32)})
    assert answers.offer("c0-d0", "c0-d0", (1, 0), result, lambda who, p: None) is None
    answers.close()
    answers.open((1, 1), ["c0-d0", "c0-d1", "c0-d2"])
    nothing = answers.offer("c0-d0", "c0-d0", (1, 0), result, lambda who, p: None)  # answered in time, again
    late = answers.offer("c0-d1", "c0-d1", (1, 0), result, lambda who, p: None)
    again = answers.offer("c0-d1", "c0-d1", (1, 0), result, lambda who, p: None)
    assert nothing is not None and nothing.kind is RejectKind.STALE
    assert late is not None and late.kind is RejectKind.LATE and again is not None and again.kind is RejectKind.STALE

    def nan(who: str, payload: Payload) -> None:
        raise Rejected(RejectKind.NON_FINITE, "update: non-finite values")

    broken = answers.offer("c0-d2", "c0-d2", (1, 0), result, nan)
    assert broken is not None and broken.kind is RejectKind.NON_FINITE
    assert answers.pending == {"c0-d0", "c0-d1", "c0-d2"}  # nothing late counts in the open round


def test_a_late_answer_that_contradicts_itself_is_filed_inconsistent_and_alerts(tmp_path: Path) -> None:
    """Two DeComFL devices of c0 answer every task after its edge round closed at the device deadline: c0-d2
    honestly (``late``, no alert), c0-d1 with a resync answer that carries a weight too (it contradicts itself).
    That one was filed ``late`` as well, out of sight of the alerts and the monitor; it is ``inconsistent`` now."""
    from edge_agent.agent import DeviceAgent
    from monitor.state import MonitorState
    from protocols.records import read_run
    from sim.launcher import SimHierarchy
    from tests.conftest import small_config

    algorithm = {"name": "decomfl", "local_steps": 1, "perturbations": 2, "lr": 0.02, "edge_rounds": 1}
    cfg = small_config(tmp_path, run={"rounds": 2}, algorithm=algorithm, runtime={"device_deadline": 5.0})
    sim = SimHierarchy(cfg)
    configure = sim.agents.configure

    def slow(agent: DeviceAgent) -> None:
        configure(agent)
        if agent.device in ("c0-d1", "c0-d2"):
            genuine = agent.publish_result
            lie = Payload({"resync": True, "weight": 1.0}) if agent.device == "c0-d1" else None
            agent.publish_result = lambda r, *a: sim.hub.loop.call_later(10.0, lambda: genuine(lie or r, *a))

    sim.agents.configure = slow
    result = sim.run()
    assert result.failed is None and len(result.history) == 2 and result.output_dir is not None
    records = [r for r in read_run(result.output_dir)[0] if isinstance(r, CellRecord) and r.cell == "c0"]
    assert all(r.absent == {"c0-d1": "deadline", "c0-d2": "deadline"} for r in records)
    refused = sorted({(x.device, x.kind.value) for r in records for x in r.rejected})
    assert refused == [("c0-d1", "inconsistent"), ("c0-d2", "late")]
    monitor = MonitorState()
    monitor.add_all(records)
    alerts = monitor.alerts(now=float(records[-1].time or 0.0))
    assert any(
        a.startswith("cell c0 rejected 1 result(s)") and "a resync answer carries nothing else" in a for a in alerts
    )
    assert not any("late answer" in a for a in alerts)


def test_a_late_hist_report_is_late_not_refused_for_the_next_rounds_partition() -> None:
    """HIST's check that a report's index sets are this round's partition judges the round, not the report: an
    honest report of the round before (closed without it) holds that round's partition, and is ``late``."""
    from protocols.algorithms.base import ModelSpec
    from protocols.algorithms.hist import Hist

    spec = ModelSpec(name="mlp", input_shape=(64,), num_classes=10, hidden=(30,))  # 15 units a cell, each round
    cloud = Hist(Hist.Params(name="hist", local_steps=1), spec, seed=7).cloud()
    answers = Answers("cell")
    tasks = cloud.plan(0, ["c0", "c1"])
    answers.open((0,), ["c0", "c1"])
    report = Payload({"weight": 10.0}, tasks["c1"].tensors)  # its submodel as its delta, with its index sets
    assert answers.offer("c0", "c0", (0,), Payload({"weight": 10.0}, tasks["c0"].tensors), cloud.check) is None
    answers.close()
    cloud.plan(1, ["c0", "c1"])
    answers.open((1,), ["c0", "c1"])
    with pytest.raises(Rejected) as now:
        cloud.check("c1", report)  # in round 1, the partition is another
    assert now.value.kind is RejectKind.INCONSISTENT
    late = answers.offer("c1", "c1", (0,), report, cloud.check)
    assert late is not None and late.kind is RejectKind.LATE, late
