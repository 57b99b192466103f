"""Bounded influence: a node that lies about its weight, with valid credentials, is refused at every tier.

A cell claiming 1e15 samples is refused by the cloud (its bound: the sum of its devices' bounds), a device
claiming 1e12 by its cell (its bound: its known sample count, or the ``security.max_device_weight`` that
``fedtier provision`` writes into every bundle); each refusal is logged with its reason and counted in the
round records, and the final model is the clean run's, bit for bit (the genuine message still counts).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from fedtier.cli import main
from protocols.bounds import CellBounds, cell_weight_bound, weight_over
from protocols.config import parse_config
from protocols.wire import topics
from protocols.wire.messenger import Messenger
from protocols.wire.payload import Payload
from sim.launcher import SimHierarchy
from tests.conftest import small_config

RUN = "t"


def forge_once(sim: SimHierarchy, watch: str, sender: str, topic: str, kind: str, weight: float) -> list[int]:
    """On the first message on ``watch`` (a task), publish one forged ``kind`` on ``topic`` as ``sender``:
    the model plus 10 everywhere, claiming ``weight`` samples, for the task's round. Returns the rounds
    it fired in (once)."""
    liar = sim.hub.connect(f"liar-{sender}")
    messenger = Messenger(liar, RUN, sender)
    fired: list[int] = []

    def on_task(_topic: str, data: bytes) -> None:
        if fired:
            return
        model = sim.cloud.role.global_params()
        forged = Payload({"weight": weight, "loss": 0.0}, {k: np.full_like(v, 10.0) for k, v in model.items()})
        fired.append(sim.cloud.round)
        messenger.send(topic, kind, forged, round=sim.cloud.round, cell="c0")  # type: ignore[arg-type]

    liar.subscribe(watch, on_task)
    return fired


def run(cfg: Any, attack: Any = None, exporter: Any = None) -> tuple[Any, list[int]]:
    sim = SimHierarchy(cfg)
    fired = attack(sim) if attack else []
    if exporter is not None:
        exporter.watch_cloud(sim.cloud)
    return sim.run(), fired


def same_model(a: Any, b: Any) -> bool:
    return a.params.keys() == b.params.keys() and all(np.array_equal(a.params[k], b.params[k]) for k in a.params)


def test_the_cloud_refuses_a_cell_claiming_1e15_samples(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from monitor.exporter import MetricsExporter

    clean, _ = run(small_config(tmp_path / "clean", run={"rounds": 2}))
    exporter = MetricsExporter(RUN)
    attacked, fired = run(
        small_config(tmp_path / "attacked", run={"rounds": 2}),
        lambda sim: forge_once(
            sim, topics.cell_task(RUN, "c0"), "c0", topics.cell_report(RUN, "c0"), "cell_report", 1e15
        ),
        exporter,
    )
    counted = exporter.registry.get_sample_value(
        "fedtier_cloud_reports_rejected_total", {"run": RUN, "reason": "bound"}
    )
    assert counted == 1  # counted in the metrics, with its kind
    assert fired == [0]
    assert same_model(clean, attacked)  # the genuine report of c0 came after and counted
    rejected = attacked.history[0]["rejected"]
    assert len(rejected) == 1 and rejected[0]["from"] == "c0", rejected
    assert "weight 1e+15 exceeds the bound of cell c0" in rejected[0]["reason"]
    assert "weight 1e+15 exceeds the bound of cell c0" in caplog.text  # logged, with the reason
    assert attacked.history[0]["cells_reported"] == ["c0", "c1"]
    assert "rejected" not in attacked.history[1] or not attacked.history[1]["rejected"]  # logged once


def test_a_cell_cannot_claim_its_devices_samples_once_per_edge_round(tmp_path: Path) -> None:
    """A FedAvg report counts each device once per cloud round, whatever the edge rounds: c0 (its own key) claiming
    E = 2 times its devices' samples took twice its share of the mean under a bound of E x the sum; the bound is now
    the sum (x E only for a role that declares its reports add every edge round, DeComFL), and the lie is refused."""
    cfg = small_config(tmp_path, run={"rounds": 2})
    assert cfg.train.edge_rounds == 2
    sim = SimHierarchy(cfg)
    role = sim.cells["c0"].role
    genuine = role.report
    bound = sim.cloud.cell_bounds["c0"]

    def doubled() -> Payload:
        r = genuine()
        assert r.meta["weight"] <= bound  # the honest claim is within the bound
        return Payload({**r.meta, "weight": 2 * r.meta["weight"]}, r.tensors)

    role.report = doubled
    attacked = sim.run()
    refused = [x for r in attacked.history for x in r["rejected"]]
    assert len(refused) == 2 and all(
        x["from"] == "c0" and "exceeds the bound of cell c0" in x["reason"] for x in refused
    )
    assert [r["cells_reported"] for r in attacked.history] == [["c1"], ["c1"]]  # c0's progress is out


def test_a_provisioned_cell_refuses_a_device_claiming_1e12_samples(tmp_path: Path) -> None:
    """``fedtier provision`` writes the largest device of the partition as every bundle's bound; a cell built
    from its bundle alone (no sample counts, as a deployed ``fedtier cell``) refuses a larger claim, and the
    cloud bounds each cell by its devices' bounds."""
    cfg = small_config(tmp_path, run={"rounds": 2})
    (tmp_path / "run.toml").write_text(cfg.to_toml())
    res = CliRunner().invoke(main, ["provision", str(tmp_path / "run.toml"), "--out", str(tmp_path / "prov")])
    assert res.exit_code == 0, res.output
    bundle = tomllib.loads((tmp_path / "prov" / "nodes" / "c0" / "config.toml").read_text())
    bound = bundle["security"]["max_device_weight"]
    from sim.hierarchy import prepare

    sizes = [len(prepare(cfg).device_data.indices(d)) for d in cfg.topology.devices()]
    assert bound == max(sizes)
    cloud_bundle = tomllib.loads((tmp_path / "prov" / "nodes" / "cloud" / "config.toml").read_text())
    assert cloud_bundle["security"]["max_device_weight"] == bound

    deployed = parse_config({**bundle, "broker": {}, "security": {"max_device_weight": bound}})
    deployed = deployed.model_copy(update={"run": deployed.run.model_copy(update={"output": str(tmp_path / "d")})})

    def as_deployed(sim: SimHierarchy) -> list[int]:
        for cell in sim.cells.values():
            cell.max_weights = {}  # what a deployed cell knows: its bundle's bound only
        assert sim.cloud.cell_bounds is not None and sim.cells["c0"].max_weight == bound
        return forge_once(
            sim,
            topics.device_task(RUN, "c0", "c0-d0"),
            "c0-d0",
            topics.device_result(RUN, "c0", "c0-d0"),
            "device_result",
            1e12,
        )

    clean, _ = run(small_config(tmp_path / "clean", run={"rounds": 2}))
    attacked, fired = run(deployed, as_deployed)
    assert fired == [0]
    assert same_model(clean, attacked)
    refused = [r for r in attacked.cell_records if r.get("rejected")]
    assert len(refused) == 1 and refused[0]["cell"] == "c0", refused
    assert refused[0]["rejected"][0]["reason"] == f"weight 1e+12 exceeds the {bound:g} samples known for c0-d0"


def test_a_cells_bound_is_what_its_devices_can_add_up() -> None:
    sync = parse_config({"algorithm": {"name": "fedavg", "edge_rounds": 3}}).train
    assert cell_weight_bound(sync, [10, 20, 30]) == 60  # each device at most once per cloud round
    fedbuff = parse_config(
        {"algorithm": {"name": "fedavg", "mode": "async", "async_buffer": 4, "async_push_every": 2}}
    ).train
    assert cell_weight_bound(fedbuff, [10, 20, 30]) == 240  # K x M results, each at most the largest bound
    assert weight_over(10**400, 5.0, "b") == "weight 100000000000... exceeds b"  # no OverflowError
    assert weight_over(float("nan"), 5.0, "b") == "weight nan exceeds b"
    assert weight_over(5, 5.0, "b") is None and weight_over(True, 0.5, "b") is None
    from cloud.node import config_cell_bounds  # a deployed cloud: security.max_device_weight for every device

    cells = config_cell_bounds(parse_config({"topology": {"cells": 2}, "security": {"max_device_weight": 7}}))
    assert isinstance(cells, CellBounds) and cells.device_bound("c1", "c1-d0") == 7
    assert cells.device_bound("c0", "c1-d0") is None


def test_a_federation_cloud_bounds_each_cell_by_its_devices_in_the_signed_roster() -> None:
    """The long-lived cloud takes each cell's bound from the roster it signed: the sum of the bounds of the
    devices the roster lists (per device)."""
    from protocols.bounds import roster_cell_bounds
    from protocols.roster import Roster
    from protocols.wire.keys import generate_keys

    cfg = parse_config(
        {"topology": {"cells": 2, "devices_per_cell": 2}, "algorithm": {"name": "fedavg", "edge_rounds": 2}}
    )
    ring = generate_keys(cfg.topology)
    bounds = {"c0-d0": 10.0, "c0-d1": 30.0, "c1-d0": 5.0, "c1-d1": 5.0}
    topo = cfg.topology
    roster = Roster.from_topology("fed", {c: topo.devices(c) for c in topo.cell_ids()}, ring.public, bounds)
    cells = roster_cell_bounds(roster, cfg.train)
    assert dict(cells) == {"c0": 40.0, "c1": 10.0}
    assert weight_over(41.0, cells["c0"], "b") is not None and weight_over(40.0, cells["c0"], "b") is None
    # each device's own bound, for reports that weigh the devices they list (CloudRole.member_weight_keys)
    assert cells.device_bound("c0", "c0-d1") == 30.0 and cells.device_bound("c1", "c0-d1") is None
