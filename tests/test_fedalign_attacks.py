"""FedALIGN's priority value F against a lying priority device and a lying cell (each with valid credentials).

F decides which free devices every cell admits (``|F - l_k| <= eps``). Its inputs are peers' words: a priority
device's probe loss (finite, unbounded) and accuracy, a cell's sums or lists of them. With the paper's mean one
liar puts F where it likes (these tests show the attack works); with ``priority_statistic = "median"`` F stays
within the honest devices' range while the liars hold under half the priority weight, and a liar that only
exaggerates its own side of the median changes nothing at all. The sims run the real hierarchy over the
in-memory hub (``SimHierarchy``): 3 cells x 3 devices, priority devices c0-d1 (115 samples), c1-d0 (72) and
c2-d2 (87), so any one of them, or any one cell's, is a minority."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from protocols.algorithms.base import Rejected
from protocols.algorithms.fedalign import FedAlignCloud
from protocols.algorithms.fedalign_priority import weighted_median
from protocols.config import parse_config
from protocols.wire.payload import Payload
from sim.launcher import RunResult, SimHierarchy
from tests.test_credentialed_attacks import lying_device

PRIORITY = ["c0-d1", "c1-d0", "c2-d2"]
HUGE = 1e30


def config(statistic: str, criterion: str = "loss") -> Any:
    eps = 0.3 if criterion == "loss" else 0.15
    return parse_config(
        {
            "run": {"name": "fa", "rounds": 5, "seed": 3},
            "topology": {"cells": 3, "devices_per_cell": 3},
            "algorithm": {
                "name": "fedalign",
                "priority": PRIORITY,
                "local_steps": 3,
                "lr": 0.1,
                "epsilon": eps,
                "warmup_rounds": 1,
                "criterion": criterion,
                "priority_statistic": statistic,
            },
            "model": {"name": "logreg"},
            "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5, "max_train": 900},
        }
    )


def lying_cell(sim: Any, cell: str, key: str, value: float) -> None:
    """``cell`` of ``sim`` (a ``SimHierarchy``, or that cell's server itself), with its own key, reports its
    priority devices' ``key`` (``loss`` or ``accuracy``) as ``value``, in the sums the mean reads and in the lists
    the median reads, weights untouched."""
    role = sim.cells[cell].role if isinstance(sim, SimHierarchy) else sim.role
    honest = role.report

    def lying_report() -> Payload:
        r = honest()
        meta = dict(r.meta)
        meta[f"prio_{key}"] = meta["prio_weight"] * value
        if "prio_devices" in meta:
            meta[f"prio_{'losses' if key == 'loss' else 'accuracies'}"] = [value] * len(meta["prio_devices"])
        return Payload(meta, r.tensors)

    role.report = lying_report


def attacked(statistic: str, criterion: str, liar: str, value: float) -> RunResult:
    """The run with ``liar`` (a priority device, or a cell) claiming ``value`` as its criterion's probe."""
    sim = SimHierarchy(config(statistic, criterion), write_output=False)
    key = "loss" if criterion == "loss" else "accuracy"
    if "-d" in liar:
        lying_device(sim, liar, {f"probe_{key}": value})
    else:
        lying_cell(sim, liar, key, value)
    result = sim.run()
    assert result.failed is None and len(result.history) == 5
    return result


HONEST: dict[tuple[str, str], RunResult] = {}


def honest(statistic: str, criterion: str = "loss") -> RunResult:
    if (statistic, criterion) not in HONEST:
        HONEST[statistic, criterion] = SimHierarchy(config(statistic, criterion), write_output=False).run()
    return HONEST[statistic, criterion]


def free_rounds(result: RunResult) -> list[dict[str, Any]]:
    return [r["metrics"] for r in result.history if r["metrics"]["phase"] == "free"]


def admitted(result: RunResult) -> list[tuple[int, str]]:
    return sorted((r["round"], d) for r in result.cell_records for d in r["metrics"].get("admitted", ()))


def honest_range(result: RunResult, round: int, liar: str, criterion: str) -> tuple[float, float]:
    """The range of the honest priority devices' probes in ``round``'s record: every cell's but the liar's (each
    cell holds one priority device, so a cell's mean is its device's probe)."""
    key = "loss" if criterion == "loss" else "accuracy"
    cells = result.history[round]["metrics"]["priority_by_cell"]
    values = [
        figures[key] if "weight" in figures else next(iter(figures.values()))[1 if key == "loss" else 2]
        for cell, figures in cells.items()
        if cell != liar[:2]
    ]
    return min(values), max(values)


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------ the statistic itself
def test_weighted_median_holds_within_the_honest_values_while_liars_weigh_under_half() -> None:
    assert weighted_median([(1.0, 100), (3.0, 100)]) == 2.0  # two equal weights: their mean, as the paper's F
    assert weighted_median([(1.0, 1), (2.0, 5), (9.0, 1)]) == 2.0
    assert weighted_median([(1.0, 0.0)]) is None and weighted_median([]) is None
    assert weighted_median([(5.0, 1e308), (7.0, 1e308), (6.0, 1e308)]) == 6.0  # no weight sum overflows
    # the limit: a liar holding half the weight (the paper's two equal priority devices: either one) still moves F
    assert weighted_median([(1.0, 100), (HUGE, 100)]) == HUGE / 2 and weighted_median([(1.0, 100), (HUGE, 101)]) == HUGE
    g = np.random.default_rng(0)
    for _ in range(300):
        n = int(g.integers(1, 8))
        good = [(float(g.normal(2, 1)), float(g.integers(1, 500))) for _ in range(n)]
        total = sum(w for _, w in good)
        budget = total * float(g.uniform(0, 0.999))  # liars weigh less than the honest devices
        lies = [(float(g.choice([0.0, HUGE, -HUGE])), budget / 2)] * 2
        lo, hi = min(v for v, _ in good), max(v for v, _ in good)
        assert lo <= weighted_median(good + lies) <= hi  # type: ignore[operator]


@pytest.mark.parametrize(
    "change, match",
    [
        ({"prio_losses": [1.0, 2.0]}, "lists of one length"),
        (
            {
                "prio_devices": ["c0-d1"] * 2,
                "prio_weights": [5.0] * 2,
                "prio_losses": [2.0] * 2,
                "prio_accuracies": [0.5] * 2,
            },
            "distinct device ids",
        ),
        ({"prio_devices": ["c0-d0"]}, "'c0-d0', no priority device"),
        ({"prio_losses": [math.inf]}, "prio_losses must hold finite numbers"),
        ({"prio_losses": [-1.0]}, "prio_losses must hold finite numbers"),
        ({"prio_accuracies": [1.5]}, "prio_accuracies must hold finite numbers in \\[0, 1.0\\]"),
        ({"prio_weights": [10**400]}, "prio_weights must hold finite numbers"),
        ({"prio_weights": [3.0]}, "prio_weights add up to 3, prio_weight says 10"),
        ({"prio_devices": None}, "lists of one length"),
    ],
)
def test_a_cells_malformed_priority_probes_are_refused(change: dict, match: str) -> None:
    train = config("median").train
    cloud = FedAlignCloud(train, {"w": np.zeros(3, np.float32)}, frozenset(PRIORITY))  # type: ignore[arg-type]
    cloud.plan(0, ["c0"])
    meta = {"phase": "solo", "prio_weight": 10.0, "prio_loss": 20.0, "prio_accuracy": 5.0, "weight": 0}
    lists = {"prio_devices": ["c0-d1"], "prio_weights": [10.0], "prio_losses": [2.0], "prio_accuracies": [0.5]}
    cloud.check("c0", Payload({**meta, **lists}, {}))  # the honest report: taken
    with pytest.raises(Rejected, match=match):
        cloud.check("c0", Payload({**meta, **lists, **change}, {}))


# ------------------------------------------------------------------------------ the paper's mean: the attack works
@pytest.mark.parametrize("liar", ["c2-d2", "c2"], ids=["device", "cell"])
def test_one_liar_raising_the_mean_F_to_1e30_makes_every_free_device_train_and_admits_none(liar: str) -> None:
    clean = honest("mean")
    assert admitted(clean)  # the honest run admits free devices
    result = attacked("mean", "loss", liar, HUGE)
    assert all(m["F"] > 1e28 for m in free_rounds(result))
    assert admitted(result) == []  # |F - l_k| > eps for every free device: the filter admits nobody ...
    free = [a for r in result.cell_records for a in r["metrics"].get("admission", {}).values()]
    assert free and all(a["by"] == "cell" for a in free)  # ... after every one opted in (l_k <= F + eps) and trained


@pytest.mark.parametrize("liar", ["c0-d1", "c0"], ids=["device", "cell"])
def test_one_liar_lowering_the_mean_F_takes_it_out_of_the_honest_range(liar: str) -> None:
    clean = honest("mean")
    result = attacked("mean", "loss", liar, 0.0)
    for rnd, m in ((r["round"], r["metrics"]) for r in result.history if r["metrics"]["phase"] == "free"):
        lo, _ = honest_range(result, rnd - 1, liar, "loss")
        assert m["F"] < lo - 0.3  # below every honest priority device by more than eps
    assert admitted(result) != admitted(clean)


def test_with_the_accuracy_criterion_one_liar_moves_the_mean_F_and_the_admissions() -> None:
    clean = honest("mean", "accuracy")
    assert not admitted(clean)  # the honest priority devices' accuracy is far above every free device's
    result = attacked("mean", "accuracy", "c0-d1", 0.0)  # 42 % of the priority weight claims accuracy 0
    moved = [b["F"] - a["F"] for a, b in zip(free_rounds(result), free_rounds(clean))]
    assert all(d > 0.15 for d in moved)  # down by more than eps
    assert admitted(result)  # misaligned free devices let in


# ------------------------------------------------------------------------------ the median: F within the honest range
@pytest.mark.parametrize(
    "criterion, liar, value",
    [
        ("loss", "c2-d2", HUGE),  # c2-d2's honest loss is above the median: the lie changes nothing
        ("loss", "c2", HUGE),
        ("loss", "c0-d1", 0.0),  # c0-d1's is below it
        ("loss", "c0", 0.0),
        ("accuracy", "c0-d1", 1.0),  # c0-d1's accuracy is the highest
        ("accuracy", "c0", 1.0),
    ],
)
def test_a_minority_liar_exaggerating_its_side_of_the_median_changes_nothing(
    criterion: str, liar: str, value: float
) -> None:
    clean = honest("median", criterion)
    result = attacked("median", criterion, liar, value)
    assert [m["F"] for m in free_rounds(result)] == [m["F"] for m in free_rounds(clean)]
    assert admitted(result) == admitted(clean) and admitted(clean)
    assert same(result.params, clean.params)
    record = result.history[1]["metrics"]
    assert record["priority_statistic"] == "median"
    assert record["priority_by_cell"][liar[:2]][PRIORITY[int(liar[1])]][1 if criterion == "loss" else 2] == value


@pytest.mark.parametrize(
    "criterion, liar, value",
    [("loss", "c0-d1", HUGE), ("loss", "c2", 0.0), ("accuracy", "c1-d0", 1.0), ("accuracy", "c0", 0.0)],
)
def test_a_minority_liar_crossing_the_median_keeps_F_within_the_honest_range(
    criterion: str, liar: str, value: float
) -> None:
    result = attacked("median", criterion, liar, value)
    for r in result.history:
        if r["metrics"]["phase"] == "free":
            lo, hi = honest_range(result, r["round"] - 1, liar, criterion)
            assert lo <= r["metrics"]["F"] <= hi


def test_a_cell_cannot_weigh_its_priority_device_with_its_other_devices_samples() -> None:
    """The cloud bounds a cell's report by the sum of its devices' bounds, so its ``prio_weight`` could give its one
    priority device the samples of all three (c2: 274 against the others' 187, a majority of the median) and own F.
    Each listed device's weight is now bounded by that device's own (``CloudRole.member_weight_keys``): refused."""
    sim = SimHierarchy(config("median"), write_output=False)
    samples = {d: len(sim.prep.device_data.indices(d)) for d in ("c2-d0", "c2-d1", "c2-d2")}
    role = sim.cells["c2"].role
    honest_report = role.report

    def lying_report() -> Payload:
        r = honest_report()
        if not r.meta["prio_devices"]:
            return r
        whole = float(sum(samples.values()))
        lie = {"prio_weight": whole, "prio_loss": whole * HUGE, "prio_weights": [whole], "prio_losses": [HUGE]}
        return Payload({**r.meta, **lie}, r.tensors)

    role.report = lying_report
    result = sim.run()
    refused = [x for r in result.history for x in r["rejected"]]
    assert refused and all(
        x["from"] == "c2"
        and f"prio_weights: weight {sum(samples.values())} exceeds the bound of device c2-d2" in x["reason"]
        for x in refused
    )
    for r in result.history:
        if r["metrics"]["phase"] == "free":
            lo, hi = honest_range(result, r["round"] - 1, "c2", "loss")
            assert lo <= r["metrics"]["F"] <= hi


def test_over_mqtt_a_lying_cells_median_probes_change_nothing(tmp_path: Path) -> None:
    """``fedtier run``'s hierarchy (a broker, the cloud and cell servers, device agents in worker processes): c2
    (its own key) says its priority device's loss is 10^30 in the lists it reports. They travel the wire, pass the
    cloud's checks, and the median F, the admissions and the model are the honest in-memory sim's, bit for bit."""
    from protocols.transport.broker import EmbeddedBroker
    from sim.emulation import Emulation

    cfg = config("median")
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"output": str(tmp_path / "emu")})})

    class LyingC2(Emulation):
        def _cell_builder(self, prep, out):  # type: ignore[no-untyped-def]
            build = super()._cell_builder(prep, out)

            def lying_build(job_cfg, cell, transport):  # type: ignore[no-untyped-def]
                node = build(job_cfg, cell, transport)
                if cell == "c2":
                    lying_cell(node, "c2", "loss", HUGE)  # type: ignore[arg-type]
                return node

            return lying_build

    with EmbeddedBroker() as broker:
        emu = LyingC2(cfg, broker_url=broker.url).run()
    clean = honest("median")
    rounds = lambda r: [(c["round"], c["cell"], c["answered"], c["absent"]) for c in r.cell_records]  # noqa: E731
    assert rounds(emu) == rounds(clean)  # who answered each round (a difference here explains one in the model)
    assert same(emu.params, clean.params) and admitted(emu) == admitted(clean)
    assert [m["F"] for m in free_rounds(emu)] == [m["F"] for m in free_rounds(clean)]
    assert emu.history[1]["metrics"]["priority_by_cell"]["c2"]["c2-d2"][1] == HUGE  # the lie arrived


def test_the_statistic_is_validated_and_fedalign_never_runs_under_secure_aggregation() -> None:
    """Only ``mean`` or ``median``; and a FedALIGN cell must see each device's probe, so secure aggregation (where a
    lying device could move its cell's mean anywhere in the clip box unseen) is refused for FedALIGN."""
    from protocols.config import ConfigError

    algorithm = {"name": "fedalign", "priority": ["c0-d0"], "edge_rounds": 1}
    with pytest.raises(ConfigError, match='algorithm.priority_statistic = "trimmed": must be .mean. or .median.'):
        parse_config({"algorithm": {**algorithm, "priority_statistic": "trimmed"}})
    with pytest.raises(ConfigError, match="secure_aggregation: .* FedALIGN's cell admits each non-priority device"):
        parse_config({"algorithm": algorithm, "privacy": {"secure_aggregation": True}})


def test_a_plausible_lie_steers_the_mean_F_onto_the_devices_the_honest_F_refused() -> None:
    """No absurd number needed: c2-d2 claiming a loss of 3.4 (1.5 times its honest one, a badly fitted device's)
    pulls the mean F up by more than eps and lets in free devices the honest F refused; under the median the same
    lie changes nothing."""
    clean = honest("mean")
    result = attacked("mean", "loss", "c2-d2", 3.4)
    refused = {(r["round"], d) for r in clean.cell_records for d in r["metrics"].get("refused", ())}
    let_in = set(admitted(result)) - set(admitted(clean))
    assert let_in and let_in <= refused
    assert all(a["F"] - b["F"] > 0.3 for a, b in zip(free_rounds(result), free_rounds(clean)))  # by more than eps
    median = attacked("median", "loss", "c2-d2", 3.4)
    assert same(median.params, honest("median").params) and admitted(median) == admitted(honest("median"))
