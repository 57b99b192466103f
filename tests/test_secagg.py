"""Secure aggregation (SecAgg+) inside a cell: Shamir sharing, the neighbour graph, and the protocol's
maths end to end (the cell unmasks exactly the survivors' sum, survives dropouts, refuses bad input)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocols.algorithms.base import Rejected
from protocols.privacy import shamir
from protocols.privacy.secagg import (
    RoundId,
    SecAggCell,
    SecAggDevice,
    SecAggFailure,
    SecAggSettings,
    flatten,
    neighbour_graph,
    quantize,
)
from protocols.wire.payload import Payload, decode_payload, encode_payload

RID = RoundId("r", "c0", 3, 1)


# ----------------------------------------------------------------------------- Shamir
def test_shamir_any_t_shares_reconstruct_and_fewer_do_not():
    secret = bytes(range(32))
    shares = shamir.split(secret, [2, 5, 7, 9, 11], 3)
    for subset in ([0, 1, 2], [4, 2, 0], [1, 3, 4], [0, 1, 2, 3, 4]):
        assert shamir.combine([shares[i] for i in subset], 32) == secret
    with pytest.raises(shamir.ShareError):  # two shares of a degree-2 polynomial: some other value
        assert shamir.combine(shares[:2], 32) != secret
        raise shamir.ShareError("combined to a value of the right size, and it is wrong")


@pytest.mark.parametrize("bad", [(0, bytes(66)), (1, bytes(65)), (1, b"\xff" * 66)])
def test_shamir_refuses_malformed_shares(bad):
    with pytest.raises(shamir.ShareError):
        shamir.combine([bad, (2, bytes(66))], 32)


def test_shamir_refuses_duplicate_points():
    shares = shamir.split(b"x" * 32, [1, 2, 3], 2)
    with pytest.raises(shamir.ShareError):
        shamir.combine([shares[0], shares[0]], 32)


# ----------------------------------------------------------------------------- graph
@pytest.mark.parametrize("n", [2, 5, 10, 50, 200])
def test_graph_is_symmetric_sparse_and_seeded(n):
    settings = SecAggSettings(seed=7)
    devices = [f"c0-d{i}" for i in range(n)]
    g = neighbour_graph(devices, settings, RID)
    k = settings.degree(n)
    assert all(len(near) == k and d not in near for d, near in g.items())
    assert all(d in g[j] for d, near in g.items() for j in near)
    assert k <= max(n - 1, 0) and (n < 200 or k <= 13 * math.log2(n))  # sparse: O(log n)
    assert g == neighbour_graph(list(reversed(devices)), settings, RID)
    if k < n - 1:
        assert g != neighbour_graph(devices, settings, RoundId("r", "c0", 4, 1))


@pytest.mark.parametrize("threshold", [0.5, 0.34])
def test_the_default_degree_survives_thirty_percent_dropping_after_sharing(threshold):
    """With 30% of a cell of 200 dropping at random after sharing, a round fails only when some device keeps
    fewer than t live neighbours (a secret of its is lost): the default degree keeps that below ~1%,
    also at t > k/2 (which needs about 3x the neighbours of t = k/3)."""
    settings = SecAggSettings(seed=1, threshold=threshold)
    devices = [f"c0-d{i}" for i in range(200)]
    g, t = neighbour_graph(devices, settings, RID), settings.t(200)
    draws = np.random.default_rng(0)
    failed = 0
    for _ in range(300):
        dropped = set(draws.choice(devices, 60, replace=False))
        failed += any(sum(j not in dropped for j in g[d]) < t for d in devices)
    assert failed <= 6, (settings.degree(200), t, failed)  # <= 2% of 300 rounds (the design: 1%)


# ----------------------------------------------------------------------------- the protocol
def updates(n: int, seed: int = 0, size: int = 37) -> dict[str, Payload]:
    g = np.random.default_rng(seed)
    return {
        f"c0-d{i}": Payload(
            {"weight": float(g.integers(10, 100))},
            {"w": g.normal(0, 0.3, (size - 5,)).astype(np.float32), "b": g.normal(0, 0.3, (5,)).astype(np.float32)},
        )
        for i in range(n)
    }


def wire(p: Payload) -> Payload:
    """Through the real payload codec, as on the network."""
    return decode_payload(encode_payload(p))


class Round:
    """Drives one aggregation between a cell and its devices, phase by phase (what the runtimes do)."""

    def __init__(self, n: int, settings: SecAggSettings | None = None, rid: RoundId = RID, seed: int = 0) -> None:
        self.settings = settings or SecAggSettings(seed=11)
        self.rid = rid
        self.results = updates(n, seed)
        self.devices = {d: SecAggDevice(self.settings, rid, d, r.meta["weight"]) for d, r in self.results.items()}
        self.cell = SecAggCell(self.settings, rid, list(self.devices))
        self.masked: dict[str, Payload] = {}

    def setup(self, skip_share: tuple[str, ...] = ()) -> None:
        for d, dev in self.devices.items():
            self.cell.add_keys(d, wire(dev.advertise()))
        self.sealed = {d: wire(self.devices[d].share(wire(r))) for d, r in self.cell.rosters().items()}
        for d, s in self.sealed.items():
            if d not in skip_share:
                self.cell.add_shares(d, s)
        for d, routed in self.cell.routes().items():
            self.devices[d].receive(wire(routed))

    def send_results(self, drop: tuple[str, ...] = ()) -> None:
        for d in self.cell.shared:
            self.masked[d] = wire(self.devices[d].mask(self.results[d]))
            if d not in drop:
                self.cell.add_masked(d, self.masked[d])

    def unmask(self):
        for d, req in self.cell.unmask_requests().items():
            self.cell.add_consent(d, wire(self.devices[d].consent(wire(req))))
        for d, views in self.cell.views().items():
            self.cell.add_reveal(d, wire(self.devices[d].reveal(wire(views))))
        return self.cell.finish()

    def expected(self, survivors) -> np.ndarray:
        total = np.zeros_like(self.masked[survivors[0]].tensors["masked"])
        for d in survivors:
            total += quantize(
                flatten(self.results[d].tensors)[0],
                self.results[d].meta["weight"],
                self.settings,
                self.cell.total_weight,
            )
        return total


@pytest.mark.parametrize("n", [3, 10, 24])
def test_cell_unmasks_exactly_the_sum_and_no_single_update(n):
    r = Round(n)
    r.setup()
    r.send_results()
    out = r.unmask()
    survivors = sorted(r.results)
    assert np.array_equal(out.quantised_sum, r.expected(survivors))
    assert out.dropped == [] and out.stats["survivors"] == n
    bound = r.settings.bound
    plain = sum(
        r.results[d].meta["weight"] * np.clip(r.results[d].tensors["w"].astype(np.float64), -bound, bound)
        for d in survivors
    )
    assert np.allclose(out.weighted_sum["w"], plain, atol=1e-3)
    for d in survivors:  # a masked vector is not its quantised update (nor close to it)
        own = r.expected([d])
        masked = r.masked[d].tensors["masked"]
        assert not np.array_equal(masked, own)
        assert np.mean(masked == own) < 0.01


def test_thirty_percent_dropping_after_the_share_phase_still_aggregates_exactly_the_survivors():
    r = Round(20)
    r.setup()
    dropped = tuple(sorted(r.results)[::3][:6])  # 6 of 20
    r.send_results(drop=dropped)
    out = r.unmask()
    survivors = sorted(set(r.results) - set(dropped))
    assert out.dropped == list(dropped) and out.stats["recovered"] == 6
    assert np.array_equal(out.quantised_sum, r.expected(survivors))
    assert sorted(out.weights) == survivors


def test_a_device_that_never_shared_is_left_out_of_everyone_s_masks():
    r = Round(10)
    r.setup(skip_share=("c0-d4",))
    assert "c0-d4" not in r.cell.shared
    r.send_results()
    out = r.unmask()
    assert np.array_equal(out.quantised_sum, r.expected(sorted(set(r.results) - {"c0-d4"})))


def test_fewer_survivors_than_the_threshold_fail_cleanly():
    r = Round(10)
    r.setup()
    t = r.settings.t(10)
    r.send_results(drop=tuple(sorted(r.results)[t - 1 :]))  # t - 1 survivors
    with pytest.raises(SecAggFailure, match="threshold"):
        r.cell.unmask_requests()


def test_the_next_round_after_a_failure_is_independent():
    Round(6).setup()
    r = Round(6, rid=RoundId("r", "c0", 4, 0), seed=1)
    r.setup()
    r.send_results()
    assert np.array_equal(r.unmask().quantised_sum, r.expected(sorted(r.results)))


# ----------------------------------------------------------------------------- bad input
def test_keys_from_a_device_not_planned_are_refused():
    r = Round(4)
    with pytest.raises(Rejected, match="not planned"):
        r.cell.add_keys("c0-d99", SecAggDevice(r.settings, RID, "c0-d99", 1.0).advertise())


@pytest.mark.parametrize("tamper", ["short", "extra", "missing"])
def test_malformed_shares_are_refused_at_the_cell(tamper):
    r = Round(6)
    for d, dev in r.devices.items():
        r.cell.add_keys(d, dev.advertise())
    rosters = r.cell.rosters()
    sealed = r.devices["c0-d0"].share(rosters["c0-d0"])
    name = sorted(sealed.tensors)[0]
    if tamper == "short":
        sealed.tensors[name] = sealed.tensors[name][:-1]
    elif tamper == "extra":
        sealed.tensors["e/c0-d99"] = sealed.tensors[name]
    else:
        del sealed.tensors[name]
    with pytest.raises(Rejected):
        r.cell.add_shares("c0-d0", sealed)
    assert "c0-d0" not in r.cell.sealed


def test_a_share_replayed_from_a_previous_round_does_not_open_and_the_sum_stays_exact():
    old = Round(6, rid=RoundId("r", "c0", 2, 1))
    old.setup()
    r = Round(6)
    for d, dev in r.devices.items():
        r.cell.add_keys(d, dev.advertise())
    sealed = {d: r.devices[d].share(ros) for d, ros in r.cell.rosters().items()}
    victim = sorted(sealed["c0-d1"].tensors)[0]
    sealed["c0-d1"].tensors[victim] = old.sealed["c0-d1"].tensors[victim]  # an old ciphertext
    for d, s in sealed.items():
        r.cell.add_shares(d, s)
    held = {d: r.devices[d].receive(routed) for d, routed in r.cell.routes().items()}
    assert held[victim[2:]] == 4  # the replayed one did not open
    r.send_results(drop=("c0-d1",))  # and the device whose share was replaced drops: recovered regardless
    out = r.unmask()
    assert np.array_equal(out.quantised_sum, r.expected(sorted(set(r.results) - {"c0-d1"})))


def test_a_wrong_revealed_share_is_detected_never_a_wrong_sum():
    r = Round(8)
    r.setup()
    r.send_results(drop=("c0-d2",))
    for d, req in r.cell.unmask_requests().items():
        r.cell.add_consent(d, r.devices[d].consent(req))
    for i, (d, views) in enumerate(sorted(r.cell.views().items())):
        reveal = r.devices[d].reveal(views)
        if i == 0:  # a well-formed but wrong share of every secret it holds
            for name in reveal.tensors:
                reveal.tensors[name] = np.frombuffer((12345).to_bytes(66, "big"), np.uint8).copy()
        r.cell.add_reveal(d, reveal)
    out = r.cell.finish()  # one bad share among >= t + 1: left out by the checks
    assert np.array_equal(out.quantised_sum, r.expected(sorted(set(r.results) - {"c0-d2"})))


def test_a_device_reveals_once_and_never_both_secrets_of_one_device():
    r = Round(6)
    r.setup()
    r.send_results()
    requests = r.cell.unmask_requests()
    for d, req in requests.items():
        r.cell.add_consent(d, r.devices[d].consent(req))
    with pytest.raises(Rejected, match="second"):
        r.devices["c0-d0"].consent(requests["c0-d0"])
    views = r.cell.views()["c0-d0"]
    r.devices["c0-d0"].reveal(views)
    with pytest.raises(Rejected, match="second"):
        r.devices["c0-d0"].reveal(views)
    overlap = Payload({"survivors": ["c0-d0", "c0-d1", "c0-d2", "c0-d3", "c0-d4"], "dropped": ["c0-d1"]}, {})
    fresh = Round(6)
    fresh.setup()
    with pytest.raises(Rejected, match="overlap"):
        fresh.devices["c0-d3"].consent(overlap)


def test_masked_result_with_a_wrong_layout_or_weight_is_refused():
    r = Round(5)
    r.setup()
    good = r.devices["c0-d0"].mask(r.results["c0-d0"])
    short = Payload(dict(good.meta), {"masked": good.tensors["masked"][:-1]})
    with pytest.raises(Rejected, match="layout"):
        r.cell.add_masked("c0-d0", short)
    heavy = Payload({**good.meta, "weight": 1e9}, good.tensors)
    with pytest.raises(Rejected, match="weight"):
        r.cell.add_masked("c0-d0", heavy)


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "algorithm, match",
    [
        ({"name": "fedalign", "priority_fraction": 0.5}, "FedALIGN"),
        ({"name": "decomfl"}, "DeComFL"),
        ({"name": "fedmrn"}, "FedMRN"),
        ({"name": "fedavg", "uplink": "qsgd"}, "uplink"),
        ({"name": "fedavg", "cell_aggregator": "krum"}, "cell_aggregator"),
        ({"name": "fedavg", "mode": "async"}, "async"),
    ],
)
def test_secure_aggregation_is_refused_where_cells_need_individual_updates(algorithm, match):
    from protocols.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=f"privacy.secure_aggregation: .*{match}"):
        parse_config({"algorithm": algorithm, "privacy": {"secure_aggregation": True}})
    parse_config({"algorithm": algorithm})  # fine without it


@pytest.mark.parametrize("name", ["fedavg", "hist"])
def test_secure_aggregation_is_accepted_for_dense_summing_algorithms(name):
    from protocols.config import parse_config

    assert parse_config(
        {"algorithm": {"name": name}, "privacy": {"secure_aggregation": True}}
    ).privacy.secure_aggregation


def test_a_device_masking_an_out_of_range_vector_fails_the_round_instead_of_corrupting_it():
    r = Round(6)
    r.setup()
    r.send_results(drop=("c0-d3",))
    evil = r.masked["c0-d4"]  # a survivor adds 2^31 (the total weight's worth) to its vector: masks still cancel
    r.cell.masked["c0-d4"] = Payload(evil.meta, {"masked": evil.tensors["masked"] + np.uint32(2**31)})
    with pytest.raises(SecAggFailure, match="exceeds"):
        r.unmask()


def test_a_non_finite_update_is_not_sent():
    r = Round(4)
    r.setup()
    bad = r.results["c0-d0"]
    bad.tensors["w"][0] = np.nan
    with pytest.raises(Rejected, match="non-finite"):
        r.devices["c0-d0"].mask(bad)
