"""Differential privacy (``[privacy] dp``): the accountant, clipping, seeded noise, the budget, sim == run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from protocols import params as P
from protocols import runfiles
from protocols.algorithms.fedavg import FedAvgCell, FedAvgParams
from protocols.config import ConfigError, parse_config
from protocols.privacy.accountant import Accountant, calibrate
from protocols.privacy.dp import DpSettings, PrivateCell, clip, l2_norm
from protocols.records import read_run
from protocols.wire.payload import Payload
from sim.launcher import run_simulation
from tests.conftest import beside, small_config


# ------------------------------------------------------------------------------------------- accountant
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the order inf
def test_accountant_matches_the_librarys_reference_rdp() -> None:
    """dp-accounting's own test vector (rdp_privacy_accountant_test: q = 0.01, z = 2.5, 50 steps): the RDP
    curve of 50 cloud rounds of cell-level DP at those orders, and the epsilon it converts to."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    orders = [1.5, 2.5, 5, 50, 100, np.inf]
    reference = [6.70579741e-04, 1.08548710e-03, 2.18075656e-03, 2.38460375e-02, 1.67416308e02, np.inf]
    acc = Accountant("cell", 2.5, 0.01, 1, 1e-5, orders=orders)
    np.testing.assert_allclose(acc.rdp(50), reference, rtol=1e-8)
    assert acc.epsilon(50) == pytest.approx(compute_epsilon(orders, reference, 1e-5)[0], rel=1e-9)


def test_accountant_against_abadi_et_al() -> None:
    """Abadi et al. 2016, Sec. 3.1: q = 0.01, sigma = 4, delta = 1e-5, T = 10000 gives epsilon ~ 1.26 with
    the moments accountant. The RDP accountant is the same analysis with a tighter conversion: at most
    1.26, and close to it."""
    eps = Accountant("cell", 4.0, 0.01, 1, 1e-5).epsilon(10_000)
    assert 0.9 < eps <= 1.26


def test_accountant_semantics_of_modes_and_edge_rounds() -> None:
    """E edge rounds per cloud round are one Gaussian of multiplier z / sqrt(E); local DP is replace-one
    (z / 2) and never amplified by sampling."""
    cell_e4 = Accountant("cell", 2.0, 0.1, 4, 1e-5)
    assert cell_e4.epsilon(30) == pytest.approx(Accountant("cell", 1.0, 0.1, 1, 1e-5).epsilon(30))
    local = Accountant("local", 4.0, 0.1, 1, 1e-5)
    assert local.epsilon(30) == pytest.approx(Accountant("cell", 2.0, 1.0, 1, 1e-5).epsilon(30))
    eps = [cell_e4.epsilon(r) for r in range(0, 6)]
    assert eps[0] == 0 and all(a < b for a, b in zip(eps, eps[1:]))
    assert Accountant("cell", 0.0, 1.0, 1, 1e-5).epsilon(1) == math.inf
    fit = cell_e4.max_rounds(eps[3] + 1e-9, 100)
    assert fit == 3


def test_calibrated_noise_reaches_the_target_epsilon() -> None:
    z = calibrate(3.0, 40, mode="cell", sampling_rate=0.2, edge_rounds=2, delta=1e-5)
    acc = Accountant("cell", z, 0.2, 2, 1e-5)
    assert acc.epsilon(40) <= 3.0 < Accountant("cell", z * 0.99, 0.2, 2, 1e-5).epsilon(40)


# ------------------------------------------------------------------------------------------- clipping
def test_clip_bounds_the_norm_and_keeps_small_updates() -> None:
    g = np.random.default_rng(0)
    big = {"a": g.normal(0, 100, (50, 20)).astype(np.float32), "b": g.normal(0, 100, 20).astype(np.float32)}
    out, norm = clip(big, 1.5)
    assert norm > 1000 and l2_norm(out) <= 1.5 and l2_norm(out) > 1.5 * 0.999
    assert all(out[k].dtype == np.float32 for k in out)
    np.testing.assert_allclose(out["a"] / big["a"], 1.5 / norm, rtol=1e-5)  # a scaling, same direction
    small = {k: v / 1e4 for k, v in big.items()}
    assert all(np.array_equal(clip(small, 1.5)[0][k], small[k]) for k in small)


def test_cell_clips_a_crafted_huge_update() -> None:
    """A device that skipped clipping sends a 1e6-norm update: the cell's progress stays within the clip."""
    p = FedAvgParams(name="fedavg", local_steps=1)
    model = {"w": np.zeros((10, 5), np.float32), "b": np.zeros(5, np.float32)}
    cell = PrivateCell(FedAvgCell(p, "c0"), DpSettings("cell", 0.5, 0.0, 0), "c0")
    cell.begin(0, Payload({}, model))
    honest = {"w": np.full((10, 5), 0.01, np.float32), "b": np.full(5, 0.01, np.float32)}
    huge = {k: np.full_like(v, 1e5) for k, v in honest.items()}
    results = {"c0-d0": Payload({"weight": 1}, honest), "c0-d1": Payload({"weight": 1}, huge)}
    for d, r in results.items():
        cell.check(d, r)
    metrics = cell.aggregate(0, results)
    assert metrics["dp_clipped"] == 1
    report = cell.report()
    assert report.meta["weight"] == 2 and l2_norm(report.tensors) <= 0.5  # (0.07 + 0.5) / 2 at most


def _byzantine(tmp_path: Path, dp: dict) -> float:
    """The global model's move in one round with a 1e6-scaling Byzantine device per cell."""
    cfg = small_config(
        tmp_path,
        run={"rounds": 1},
        algorithm={"edge_rounds": 1},
        topology={"cells": 2, "devices_per_cell": 5},
        attack={"kind": "scale", "fraction": 0.2, "factor": 1e6},
        privacy=dp,
    )
    start = cfg.build_algorithm(cfg.model_spec((64,), 10)).initial_params()
    result = run_simulation(cfg, write_output=False)
    return l2_norm(P.sub(result.params, start))


def test_clipping_bounds_a_byzantine_device(tmp_path: Path) -> None:
    """With cell-level DP (no noise, to see the clip alone) the round moves the model by at most the clip
    norm, though a Byzantine device scaled its update 1e6 times; without DP the same attack moves it
    by orders of magnitude more."""
    bounded = _byzantine(tmp_path / "dp", {"dp": "cell", "clip": 0.5, "noise_multiplier": 0.0})
    assert bounded <= 0.5
    assert _byzantine(tmp_path / "plain", {}) > 1000


# ------------------------------------------------------------------------------------------- runs
def _dp_config(tmp_path: Path, **privacy):
    return small_config(
        tmp_path, run={"rounds": 4}, privacy={"dp": "cell", "clip": 1.0, "noise_multiplier": 1.0, **privacy}
    )


def test_noise_is_seeded_and_epsilon_is_recorded(tmp_path: Path) -> None:
    """Same seeds, same model; another noise seed, another model. Every round record carries the
    accountant's epsilon so far, the report and the summary the last one."""
    a = run_simulation(_dp_config(tmp_path / "a"))
    b = run_simulation(_dp_config(tmp_path / "b"), write_output=False)
    c = run_simulation(_dp_config(tmp_path / "c", noise_seed=7), write_output=False)
    assert all(a.params[k].tobytes() == b.params[k].tobytes() for k in a.params)
    assert any(a.params[k].tobytes() != c.params[k].tobytes() for k in a.params)
    acc = _dp_config(tmp_path / "a").dp_accountant()
    assert [r["epsilon"] for r in a.history] == pytest.approx([acc.epsilon(r) for r in range(1, 5)])
    records, bad = read_run(a.output_dir)
    assert not bad and [r.epsilon for r in records if r.event == "round"] == [r["epsilon"] for r in a.history]
    summary = json.loads((a.output_dir / runfiles.SUMMARY).read_text())
    assert summary["epsilon"] == a.history[-1]["epsilon"]
    assert summary["epsilon_by_party"] == {"cloud": summary["epsilon"], "cell": None, "devices": summary["epsilon"]}
    assert summary["epsilon_basis"].startswith("q = 1") and "replace-one" in summary["epsilon_basis"]
    # devices claim weight 1 and leave their training loss out
    assert all("loss_mean" not in r for r in a.cell_records)
    # fedtier monitor shows it on the cloud line, fedtier report plots accuracy against it
    from monitor.report import write_report
    from monitor.view import MonitorState, render_text

    state = MonitorState()
    state.add_all(records)
    assert f"ε {a.history[-1]['epsilon']:.3g}" in render_text(state, now=0.0)
    page, plots = write_report([a.output_dir], tmp_path / "report.html")
    eps_plot = next(p for p in plots if p.name == "metrics_vs_epsilon")
    ((x, _),) = (v for k, v in eps_plot.series.items() if k.endswith("/accuracy"))
    assert x == [r["epsilon"] for r in a.history]
    assert f"<td>{a.history[-1]['epsilon']:.3g}</td>" in page.read_text()


def test_local_dp_noises_each_device(tmp_path: Path) -> None:
    """Local DP with the same z is far noisier than cell DP (each device's noise, not one per sum)."""
    local = run_simulation(_dp_config(tmp_path / "l", dp="local", noise_multiplier=0.0), write_output=False)
    clipped = run_simulation(_dp_config(tmp_path / "c", noise_multiplier=0.0), write_output=False)
    assert all(local.params[k].tobytes() == clipped.params[k].tobytes() for k in local.params)  # z = 0: same
    noisy = run_simulation(_dp_config(tmp_path / "n", dp="local", noise_multiplier=1.0), write_output=False)
    cell = run_simulation(_dp_config(tmp_path / "m", noise_multiplier=1.0), write_output=False)
    # participation is known: both are replace-one releases of z / 2 against the cloud; against the cell,
    # local DP still holds and cell DP (the cell sees the clipped updates) holds nothing
    assert noisy.history[-1]["epsilon"] == cell.history[-1]["epsilon"]
    assert noisy.history[-1]["epsilon_by_party"]["cell"] == noisy.history[-1]["epsilon"]
    eps = cell.history[-1]["epsilon"]
    assert cell.history[-1]["epsilon_by_party"] == {"cloud": eps, "cell": None, "devices": eps}
    assert cell.history[-1]["epsilon_basis"].startswith("q = 1 (participation drawn from run.seed")
    dist = lambda r: l2_norm(P.sub(r.params, clipped.params))  # noqa: E731
    assert dist(noisy) > 1.5 * dist(cell)


def test_budget_stops_the_run_at_it(tmp_path: Path) -> None:
    """on_budget = "stop": the run does the rounds that fit and stops cleanly before the next one;
    "refuse" (the default) does not start and says how many rounds fit."""
    acc = _dp_config(tmp_path / "x").dp_accountant()
    budget = (acc.epsilon(2) + acc.epsilon(3)) / 2
    result = run_simulation(_dp_config(tmp_path / "s", epsilon_budget=budget, on_budget="stop"))
    assert [r["round"] for r in result.history] == [0, 1]
    assert result.history[-1]["epsilon"] <= budget
    summary = json.loads((result.output_dir / runfiles.SUMMARY).read_text())
    assert summary["rounds"] == 2 and "privacy budget: round 3" in summary["stopped"]  # (its third)
    with pytest.raises(ConfigError, match=r"privacy.epsilon_budget: 4 rounds would spend .* 2 rounds fit"):
        _dp_config(tmp_path / "r", epsilon_budget=budget)
    with pytest.raises(ConfigError, match=r"; not one round fits \(more noise"):  # not 'set run.rounds = 0'
        _dp_config(tmp_path / "r", epsilon_budget=acc.epsilon(1) / 2)


def test_bad_privacy_configs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="exactly one of noise_multiplier or target_epsilon"):
        _dp_config(tmp_path, target_epsilon=2.0)
    with pytest.raises(ConfigError, match="algorithm.uplink"):
        small_config(tmp_path, algorithm={"uplink": "signsgd"}, privacy={"dp": "local", "noise_multiplier": 1.0})
    with pytest.raises(ConfigError, match="not 'fedalign'"):
        parse_config(
            {
                "algorithm": {"name": "fedalign", "local_steps": 1, "priority_fraction": 0.5},
                "privacy": {"dp": "cell", "noise_multiplier": 1.0},
            }
        )
    with pytest.raises(ConfigError, match="privacy.clip"):
        _dp_config(tmp_path, clip=0)


def test_dp_run_over_mqtt_gives_the_sim_model(tmp_path: Path) -> None:
    """Cell-level DP with noise over ``fedtier run`` (embedded broker): the final model of ``fedtier sim``."""
    from protocols.transport.broker import EmbeddedBroker
    from sim.emulation import Emulation

    cfg = small_config(tmp_path / "sim", run={"rounds": 2}, privacy={"dp": "cell", "noise_multiplier": 0.8})
    run_cfg = small_config(tmp_path / "run", run={"rounds": 2}, privacy={"dp": "cell", "noise_multiplier": 0.8})
    with EmbeddedBroker() as broker:
        emulated, sim = beside(lambda: Emulation(run_cfg, broker_url=broker.url).run(), lambda: run_simulation(cfg))
    assert (emulated.output_dir / runfiles.FINAL_MODEL).read_bytes() == (
        sim.output_dir / runfiles.FINAL_MODEL
    ).read_bytes()
    assert [r["epsilon"] for r in emulated.history] == [r["epsilon"] for r in sim.history]


def test_cohort_engine_runs_the_same_mechanism(tmp_path: Path) -> None:
    """The cohort engine trains the same devices with the same noise: the same model to float rounding."""
    device = run_simulation(_dp_config(tmp_path / "d", dp="local"), write_output=False)
    cohort = run_simulation(
        _dp_config(tmp_path / "c", dp="local").model_copy(
            update={"runtime": _dp_config(tmp_path / "c").runtime.model_copy(update={"engine": "cohort"})}
        ),
        write_output=False,
    )
    for k in device.params:
        np.testing.assert_allclose(cohort.params[k], device.params[k], atol=2e-4)


# ------------------------------------------------------------------------------ with secure aggregation
def test_cell_dp_under_secure_aggregation_splits_the_noise(tmp_path: Path) -> None:
    """Cell DP with secure aggregation: each device adds 1/m of the noise's variance (m = dp_min_survivors),
    so with all n devices surviving a cell's sum carries n/m times the variance of plain cell DP: one
    round's noise (the model's move with noise minus without) is sqrt(n/m) times as large. The run
    records the same epsilon as plain cell DP."""

    def run(name: str, **privacy):
        cfg = small_config(
            tmp_path / name,
            run={"rounds": 1},
            algorithm={"edge_rounds": 1},
            topology={"cells": 2, "devices_per_cell": 5},
            privacy={"dp": "cell", "clip": 0.5, **privacy},
        )
        return run_simulation(cfg, write_output=False)

    sa = {"secure_aggregation": True, "dp_min_survivors": 2, "secagg_bound": 4.0}
    quiet, noisy = run("q", noise_multiplier=0.0, **sa), run("n", noise_multiplier=0.5, **sa)
    plain_quiet, plain_noisy = run("pq", noise_multiplier=0.0), run("pn", noise_multiplier=0.5)
    assert all(r["metrics"]["secagg"]["survivors"] == 5 for r in noisy.cell_records)
    ratio = l2_norm(P.sub(noisy.params, quiet.params)) / l2_norm(P.sub(plain_noisy.params, plain_quiet.params))
    assert ratio == pytest.approx(math.sqrt(5 / 2), rel=0.1)
    assert noisy.history[-1]["epsilon"] == plain_noisy.history[-1]["epsilon"]
    for k in quiet.params:  # without noise, secure aggregation changes the model by its quantisation only
        np.testing.assert_allclose(quiet.params[k], plain_quiet.params[k], atol=1e-5)


def test_secure_aggregation_unmasks_no_sum_with_less_noise_than_dp_needs() -> None:
    """With noise split among m = 8 devices, a cell of 10 where 3 dropped after sharing does not unmask
    (the sum would carry 7/8 of the noise), and a device refuses to reveal for 7 survivors."""
    from protocols.algorithms.base import Rejected
    from protocols.privacy.secagg import SecAggFailure, SecAggSettings
    from tests.test_secagg import Round

    r = Round(10, SecAggSettings(seed=11, min_survivors=8))
    r.setup()
    devices = sorted(r.results)
    r.send_results(drop=tuple(devices[:3]))
    with pytest.raises(SecAggFailure, match="7 survivors, fewer than the threshold 8"):
        r.cell.unmask_requests()
    request = Payload({"survivors": devices[3:], "dropped": devices[:3]}, {})
    with pytest.raises(Rejected, match="fewer survivors than the threshold"):
        r.devices[devices[3]].consent(request)
    ok = Round(10, SecAggSettings(seed=11, min_survivors=8))
    ok.setup()
    ok.send_results(drop=tuple(devices[:2]))
    assert sorted(ok.unmask().weights) == devices[2:]


def test_secure_aggregation_dp_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="privacy.secagg_bound"):
        _dp_config(tmp_path, clip=2.0, secure_aggregation=True)
    with pytest.raises(ConfigError, match="privacy.dp_min_survivors: 4 survivors can never be reached"):
        _dp_config(tmp_path, secure_aggregation=True, dp_min_survivors=4, secagg_bound=10.0)
    cfg = small_config(
        tmp_path,
        topology={"devices_per_cell": 10},
        participation={"model": "bernoulli", "prob": 0.8},
        privacy={"dp": "cell", "noise_multiplier": 1.0, "secure_aggregation": True, "secagg_bound": 10.0},
    )
    assert cfg.dp_noise_shares() == 3 and cfg.secagg_settings().min_survivors == 3  # 0.7 (8 - 2 x 1.26)


def test_a_diverged_update_is_left_to_the_runtime() -> None:
    """A device whose training overflowed returns its non-finite result unclipped (no exception): the
    runtime sends it as "diverged" and the cell never aggregates it."""
    from protocols.algorithms.base import DeviceContext, DeviceRole
    from protocols.privacy.dp import PrivateDevice

    class Overflowing(DeviceRole):
        def train(self, task, data, trainer, ctx):
            return Payload({"weight": 5, "loss": float("inf")}, {"w": np.array([np.inf, 1.0], np.float32)})

    out = PrivateDevice(Overflowing(), DpSettings("local", 1.0, 1.0, 0)).train(
        Payload({}, {}), None, None, DeviceContext(0, 0, 0, "c0", "c0-d0")
    )  # type: ignore[arg-type]
    from protocols.divergence import nonfinite

    assert nonfinite(out) is not None
