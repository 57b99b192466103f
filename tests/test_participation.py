"""Participation models: determinism, call-order independence, long-run rates, structure, traces, factory."""

from __future__ import annotations

import numpy as np
import pytest

from sim.participation import (
    Always,
    Bernoulli,
    CyclicGroups,
    Markov,
    RegularizedPermutation,
    Trace,
    UniformSample,
    make_participation,
)

DEVS = [f"d{i:02d}" for i in range(20)]


def _counts(model, rounds: int) -> np.ndarray:
    m = np.stack([model.mask(r) for r in range(rounds)])
    return m.sum(0)


SPECS = [
    {"model": "always"},
    {"model": "uniform", "per_round": 5},
    {"model": "bernoulli", "prob": 0.3},
    {"model": "cyclic", "groups": 4},
    {"model": "cyclic", "groups": 4, "per_round": 2, "random_offset": False},
    {"model": "permutation", "per_round": 4},
    {"model": "markov", "p_off": 0.2, "p_on": 0.1},
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s["model"] + str(len(s)))
def test_deterministic_and_call_order_independent(spec):
    a = make_participation(spec, DEVS, seed=7)
    b = make_participation(spec, DEVS, seed=7)
    rounds = list(range(40))
    fwd = [a.participants(r) for r in rounds]
    back = [b.participants(r) for r in reversed(rounds)][::-1]
    assert fwd == back
    assert all(isinstance(p, frozenset) and p <= set(DEVS) for p in fwd)
    fresh = make_participation(spec, DEVS, seed=7)
    assert fresh.participants(33) == fwd[33]  # jumping straight to a round gives the same answer
    if spec["model"] not in ("always",):
        c = make_participation(spec, DEVS, seed=8)
        assert [c.participants(r) for r in rounds] != fwd


def test_always():
    m = Always(DEVS)
    assert m.participants(0) == frozenset(DEVS) and m.expected_rate("d03") == 1.0


def test_uniform_exact_and_rate():
    m = UniformSample(DEVS, 5, seed=1)
    assert all(len(m.participants(r)) == 5 for r in range(100))
    freq = _counts(m, 2000) / 2000
    assert np.all(np.abs(freq - 0.25) < 0.04)  # sd ~ 0.0097 per device
    assert m.expected_rate("d00") == 0.25


def test_bernoulli_per_device_rates():
    probs = {d: p for d, p in zip(DEVS, np.linspace(0.05, 0.95, len(DEVS)))}
    m = Bernoulli(DEVS, probs, seed=2)
    freq = _counts(m, 2000) / 2000
    expected = np.array([probs[d] for d in DEVS])
    assert np.all(np.abs(freq - expected) < 4 * np.sqrt(expected * (1 - expected) / 2000) + 1e-3)
    assert m.expected_rate("d19") == pytest.approx(0.95)
    lst = Bernoulli(DEVS, list(expected), seed=2)
    assert lst.participants(11) == m.participants(11)
    assert Bernoulli(DEVS, 0.0).participants(5) == frozenset()
    assert Bernoulli(DEVS, 1.0).participants(5) == frozenset(DEVS)


@pytest.mark.parametrize("groups,active", [(4, 1), (3, 1), (5, 2)])
def test_cyclic_equal_counts_per_window(groups, active):
    m = CyclicGroups(DEVS, groups, seed=3, active=active)
    masks = np.stack([m.mask(r) for r in range(groups * 12)])
    for start in range(0, masks.shape[0] - groups + 1):  # every window of one cycle length
        assert np.all(masks[start : start + groups].sum(0) == active)
    sizes = np.bincount(m.group_of, minlength=groups)
    assert sizes.max() - sizes.min() <= 1
    assert all(m.expected_rate(d) == pytest.approx(active / groups) for d in DEVS)
    # the schedule is periodic with period = groups
    assert all(np.array_equal(masks[r], masks[r + groups]) for r in range(groups * 11))


def test_cyclic_offset_and_per_round():
    offsets = {CyclicGroups(DEVS, 5, seed=s).offset for s in range(20)}
    assert len(offsets) > 1
    assert CyclicGroups(DEVS, 5, seed=3, random_offset=False).offset == 0
    m = CyclicGroups(DEVS, 4, seed=3, per_round=2)
    for r in range(40):
        p = m.participants(r)
        assert len(p) == 2
        assert {int(m.group_of[m.index[d]]) for d in p} == {(r + m.offset) % 4}
    freq = _counts(m, 2000) / 2000
    assert np.all(np.abs(freq - 0.1) < 0.03)  # (1/4) * (2/5)
    assert m.expected_rate("d00") == pytest.approx(0.1)


@pytest.mark.parametrize("s", [4, 5, 3])
def test_permutation_once_per_block(s):
    m = RegularizedPermutation(DEVS, s, seed=4)
    B = m.block
    assert B == -(-len(DEVS) // s)
    masks = np.stack([m.mask(r) for r in range(B * 10)])
    for b in range(10):
        assert np.all(masks[b * B : (b + 1) * B].sum(0) == 1)
    assert masks.sum(1).max() <= s
    if len(DEVS) % s == 0:
        assert np.all(masks.sum(1) == s)
    assert not np.array_equal(masks[:B], masks[B : 2 * B])  # fresh permutation per block
    assert m.expected_rate("d05") == pytest.approx(1 / B)


def test_markov_stationary_rate_and_persistence():
    m = Markov(DEVS, p_on_to_off=0.2, p_off_to_on=0.1, seed=5)
    masks = np.stack([m.mask(r) for r in range(2000)])
    rate = masks.mean()
    assert rate == pytest.approx(0.1 / 0.3, abs=0.03)
    assert m.expected_rate("d00") == pytest.approx(1 / 3)
    # empirical transition probabilities
    on_prev = masks[:-1]
    p_stay_on = (masks[1:] & on_prev).sum() / on_prev.sum()
    p_turn_on = (masks[1:] & ~on_prev).sum() / (~on_prev).sum()
    assert p_stay_on == pytest.approx(0.8, abs=0.03) and p_turn_on == pytest.approx(0.1, abs=0.02)
    start = Markov(DEVS, 0.0, 0.0, start_on_prob=1.0)
    assert start.participants(50) == frozenset(DEVS)


def test_trace_replay(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("device,start,end\nd00,0,3\nd00,5,7\nd01,2,4\n\nd02,1,2\nd00,2,4\n")
    m = Trace(DEVS, path)
    expect = {
        0: {"d00"},
        1: {"d00", "d02"},
        2: {"d00", "d01"},
        3: {"d00", "d01"},
        4: set(),
        5: {"d00"},
        6: {"d00"},
        7: set(),
        100: set(),
    }
    for r, want in expect.items():
        assert m.participants(r) == frozenset(want), r
    assert m.expected_rate("d00") == pytest.approx(6 / 7)
    assert make_participation({"model": "trace", "path": str(path)}, DEVS, 0).participants(3) == {"d00", "d01"}


@pytest.mark.parametrize(
    "body,match",
    [
        ("dev,start,end\nd00,0,1\n", "header"),
        ("device,start,end\nd00,0\n", ":2: expected 3 fields"),
        ("device,start,end\nd00,0,1\nd00,a,2\n", ":3: start and end must be integers"),
        ("device,start,end\nd00,3,3\n", "start < end"),
        ("device,start,end\nd00,-1,3\n", "start < end"),
        ("device,start,end\nzz,0,3\n", ":2: a device not in the run's devices"),
        ("device,start,end\n,0,3\n", "empty device"),
        ("", "header"),
    ],
)
def test_trace_malformed(tmp_path, body, match):
    path = tmp_path / "t.csv"
    path.write_text(body)
    with pytest.raises(ValueError, match=match):
        Trace(DEVS, path)


def test_trace_non_strict_and_missing(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("device,start,end\nzz,0,3\nd01,0,1\n")
    assert Trace(DEVS, path, strict=False).participants(0) == {"d01"}
    with pytest.raises(ValueError, match="path"):
        Trace(DEVS, tmp_path / "nope.csv")


def test_factory_accepts_pydantic_model():
    from pydantic import BaseModel

    class Spec(BaseModel):
        model: str
        per_round: int | None = None
        groups: int | None = None

    m = make_participation(Spec(model="uniform", per_round=3), DEVS, seed=0)
    assert isinstance(m, UniformSample) and len(m.participants(0)) == 3
    assert isinstance(make_participation(Spec(model="cyclic", groups=2), DEVS, 0), CyclicGroups)


@pytest.mark.parametrize(
    "spec,match",
    [
        ({}, "model"),
        ({"model": "sometimes"}, "sometimes"),
        ({"model": "uniform"}, "per_round"),
        ({"model": "uniform", "per_round": 0}, "per_round"),
        ({"model": "uniform", "per_round": 21}, "per_round"),
        ({"model": "uniform", "per_round": 2, "prob": 0.5}, "prob"),
        ({"model": "bernoulli"}, "prob"),
        ({"model": "bernoulli", "prob": 1.5}, "prob"),
        ({"model": "bernoulli", "prob": 0.5, "probs": [0.5] * 20}, "probs"),
        ({"model": "bernoulli", "probs": [0.5] * 3}, "probs"),
        ({"model": "bernoulli", "probs": {"d00": 0.5}}, "probs"),
        ({"model": "cyclic"}, "groups"),
        ({"model": "cyclic", "groups": 0}, "groups"),
        ({"model": "cyclic", "groups": 21}, "groups"),
        ({"model": "cyclic", "groups": 4, "per_round": 6}, "per_round"),
        ({"model": "cyclic", "groups": 4, "random_offset": "yes"}, "random_offset"),
        ({"model": "permutation", "per_round": 0}, "per_round"),
        ({"model": "markov", "p_off": 0.2}, "p_on"),
        ({"model": "markov", "p_off": -0.1, "p_on": 0.1}, "p_off"),
        ({"model": "markov", "p_off": 0.1, "p_on": 2}, "p_on"),
        ({"model": "markov", "p_off": 0.1, "p_on": 0.1, "start_on": 3}, "start_on"),
        ({"model": "markov", "p_off": 0.0, "p_on": 0.0}, "start_on"),
        ({"model": "trace"}, "path"),
    ],
)
def test_factory_errors_name_parameter(spec, match):
    with pytest.raises(ValueError, match=match):
        make_participation(spec, DEVS, seed=0)


def test_bad_round_and_devices():
    with pytest.raises(ValueError, match="round"):
        Always(DEVS).participants(-1)
    with pytest.raises(ValueError, match="unique"):
        Always(["a", "a"])
    with pytest.raises(ValueError, match="devices"):
        Always([])


@pytest.mark.parametrize(
    "spec",
    [
        {"model": "uniform", "per_round": 7},
        {"model": "bernoulli", "prob": 0.3},
        {"model": "cyclic", "groups": 4, "period": 2, "per_round": 3},
        {"model": "permutation", "per_round": 5},
        {"model": "markov", "p_off": 0.3, "p_on": 0.4},
    ],
)
def test_a_topologys_computed_ids_draw_the_same_participants_as_a_list(spec):
    """``TopologySection.devices()`` (ids made when read, for large populations) is the id list."""
    from protocols.config import TopologySection
    from sim.participation import make_participation

    topo = TopologySection(cells=3, devices_per_cell=11)
    lazy, listed = make_participation(spec, topo.devices(), 5), make_participation(spec, topo.all_devices(), 5)
    assert all(lazy.participants(r) == listed.participants(r) for r in range(6))
    assert lazy.expected_rate("c2-d10") == listed.expected_rate("c2-d10")
    with pytest.raises(KeyError):
        lazy.expected_rate("c3-d0")


def test_every_cell_of_a_round_shares_one_draw():
    """``sim.hierarchy.per_round``: the cells ask in turn for the same round; the population's draw
    (which costs what the population does) is made once per round, and a new round draws anew."""
    from sim.hierarchy import per_round

    calls: list[int] = []
    drawn = per_round(lambda r: calls.append(r) or frozenset({f"d{r}"}))
    assert [drawn(r) for r in (0, 0, 0, 1, 1, 2)] == [frozenset({"d0"})] * 3 + [frozenset({"d1"})] * 2 + [
        frozenset({"d2"})
    ]
    assert calls == [0, 1, 2]
