"""The epsilon a run states is true against each party: checked against dp-accounting for the mechanism
actually applied (q = 1, replace-one sensitivity 2C, the noise that survives secure aggregation's
quantisation); a quantisation range that would cut the noise is refused; a DP device tells nothing of its
data's size; ``dp_min_survivors`` defaults to what the participation model lets survive."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from protocols.config import ConfigError
from protocols.privacy.secagg import SecAggSettings, dequantize, quantize
from tests.conftest import small_config

Z, CLIP, M = 1.2, 1.0, 4


def secure_dp(tmp_path: Path, **privacy):
    return small_config(
        tmp_path,
        run={"rounds": 5},
        topology={"cells": 2, "devices_per_cell": 6},
        participation={"model": "bernoulli", "prob": 0.5},
        privacy={
            "dp": "cell",
            "clip": CLIP,
            "noise_multiplier": Z,
            "secure_aggregation": True,
            "dp_min_survivors": M,
            **privacy,
        },
    )


def surviving_noise_std(bound: float, n: int = 200_000) -> tuple[float, float]:
    """(std of the noise one device adds, std of what of it survives secure aggregation's clipping and
    quantisation at ``bound``), the update itself at the clip (one coordinate of value ``CLIP``)."""
    std = Z * CLIP / math.sqrt(M)
    g = np.random.default_rng(0)
    update = np.zeros(n)
    update[::100] = CLIP  # values as large as clipping lets them be
    noisy = update + g.normal(0.0, std, n)
    settings = SecAggSettings(seed=0, bound=bound)
    out = dequantize(quantize(noisy, 1.0, settings, float(M)), settings, float(M))
    return std, float(np.std(out - update))


def test_a_quantisation_range_that_would_cut_the_noise_is_refused(tmp_path: Path) -> None:
    need = CLIP + 6 * Z * CLIP / math.sqrt(M)  # 4.6
    with pytest.raises(ConfigError, match=r"privacy.secagg_bound: 1 would cut .* >= clip \+ 6 x std = 4.6"):
        secure_dp(tmp_path, secagg_bound=CLIP)  # accepted before: "bound >= clip"
    secure_dp(tmp_path, secagg_bound=need)
    std, kept = surviving_noise_std(need)
    assert kept == pytest.approx(std, rel=0.01)  # the noise epsilon counts on is all there
    std, cut = surviving_noise_std(CLIP)
    assert cut < 0.93 * std  # at bound = clip, secure aggregation would have cut some of it away
    with pytest.raises(ConfigError, match="secagg_bound"):  # local DP: each device's whole noise must fit
        small_config(tmp_path, privacy={"dp": "local", "noise_multiplier": 1.0, "secure_aggregation": True})


def test_the_accountant_is_dp_accounting_for_the_mechanism_applied(tmp_path: Path) -> None:
    """Cell DP under secure aggregation, E = 2 edge rounds, Bernoulli(0.5) participation drawn from run.seed:
    each edge round releases a cell's sum of >= M devices' clipped updates with the noise that survives
    quantisation (measured here); participation is known, so q = 1 and neighbours replace a device (2C)."""
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    cfg = secure_dp(tmp_path, secagg_bound=5.0)
    edge_rounds = cfg.train.edge_rounds
    assert edge_rounds == 2
    _, per_device = surviving_noise_std(5.0)
    sum_std = per_device * math.sqrt(M)  # M devices' independent shares
    by_hand = rdp.RdpAccountant()
    by_hand.compose(dp_accounting.GaussianDpEvent(sum_std / (2 * CLIP)), 5 * edge_rounds)  # q = 1: no sampling
    expected = by_hand.get_epsilon(cfg.privacy.delta)
    acc = cfg.dp_accountant()
    assert acc.epsilon(5) == pytest.approx(expected, rel=0.01)
    assert acc.basis.startswith("q = 1") and "2C" in acc.basis
    assert acc.by_party(5) == {"cloud": acc.epsilon(5), "cell": acc.epsilon(5), "devices": acc.epsilon(5)}
    amplified = rdp.RdpAccountant()  # what was stated before: q = 0.5, add/remove (sensitivity C)
    amplified.compose(dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(Z / math.sqrt(2))), 5)
    assert acc.epsilon(5) > 2 * amplified.get_epsilon(cfg.privacy.delta)  # understated by more than half
    plain = small_config(tmp_path, privacy={"dp": "cell", "noise_multiplier": Z})  # the cell sees the updates
    assert plain.dp_accountant().by_party(3)["cell"] == math.inf


def test_a_dp_device_sends_no_size_and_the_virtual_clock_still_counts_its_steps(tmp_path: Path) -> None:
    from sim.launcher import SimHierarchy, run_simulation

    clock = {"device_steps_per_s": 10.0}
    dp = {"dp": "local", "noise_multiplier": 0.5, "secure_aggregation": True, "secagg_bound": 5.0}
    common = {"run": {"rounds": 1}, "algorithm": {"local_steps": 0, "local_epochs": 1.0}, "clock": clock}
    sim = SimHierarchy(small_config(tmp_path / "dp", privacy=dp, **common))
    sent: list[tuple[str, dict]] = []
    published: list[bytes] = []
    for agent in sim.agents.values():  # every message a device sends is framed here (its result by frame_once)
        for method in ("frame", "frame_once"):
            frame = getattr(agent.messenger, method)

            def spy(kind, payload, frame=frame, **kw):
                sent.append((kind, dict(payload.meta)))
                return frame(kind, payload, **kw)

            setattr(agent.messenger, method, spy)
    result = sim.run()
    agent = sim.agents["c0-d0"]
    publish = agent.transport.publish
    agent.transport.publish = lambda topic, data, **kw: published.append(data)
    agent.announce("online")
    agent.transport.publish = publish
    assert {k for k, _ in sent} >= {"secagg_keys", "device_result"}
    for kind, meta in sent:
        if "weight" in meta:
            assert meta["weight"] == 1, (kind, meta)
        assert "steps" not in meta and "loss" not in meta and "samples" not in meta, (kind, meta)
    assert published and b"samples" not in published[0]
    # the simulator times the devices' training from its own count of their steps: as without DP
    plain = run_simulation(small_config(tmp_path / "plain", **common), write_output=False)
    assert [r["clock_s"] for r in result.cell_records] == pytest.approx([r["clock_s"] for r in plain.cell_records])
    assert result.cell_records[0]["clock_s"] > 1.0


@pytest.mark.parametrize(
    "participation",
    [
        {"model": "always"},
        {"model": "bernoulli", "prob": 0.5},
        {"model": "cyclic", "groups": 2},
        {"model": "uniform", "per_round": 8},
        {"model": "markov", "p_on": 0.3, "p_off": 0.3},
    ],
)
def test_dp_min_survivors_defaults_to_what_the_participation_model_lets_survive(tmp_path: Path, participation):
    """The default must be reached by the cell's participants (less secure aggregation's 30% dropout) in
    nearly every round, yet not be one when more survive: too high and every secure round fails (the old
    default under cyclic groups: 7 of the 5 that take part), too low and each device adds far more noise."""
    from sim.hierarchy import participation as model_of

    cfg = small_config(
        tmp_path,
        topology={"cells": 2, "devices_per_cell": 10},
        participation=participation,
        privacy={"dp": "cell", "noise_multiplier": 1.0, "secure_aggregation": True, "secagg_bound": 20.0},
    )
    m = cfg.dp_noise_shares()
    model = model_of(cfg)
    counts = [sum(d.startswith(f"{c}-") for d in model.participants(r)) for r in range(200) for c in ("c0", "c1")]
    reached = np.mean([math.floor(0.7 * k) >= m for k in counts])
    assert reached >= 0.9, (m, reached)
    assert m >= max(1, math.floor(0.35 * np.mean(counts)))  # no smaller than half the expected survivors
