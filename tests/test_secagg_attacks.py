"""A cell that lies under secure aggregation (``sim/lying_cell.py``) against devices that sign: it substitutes
its own keys for a target's neighbours', or tells half the neighbours the target survived and half that it
dropped. The target's update is never recovered; the devices log and count the lie; the round fails cleanly.
The same attacks against what the protocol guarded before (unsigned keys, the threshold of one third)
recover the target's update exactly: the attacks are real."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from protocols.algorithms.base import Rejected
from protocols.privacy.secagg import (
    CellLied,
    RoundId,
    SecAggCell,
    SecAggDevice,
    SecAggFailure,
    SecAggSettings,
    flatten,
    quantize,
)
from protocols.wire.keys import Trust, new_seed, public_of
from protocols.wire.payload import Payload, decode_payload, encode_payload
from sim.lying_cell import LyingCell
from tests.conftest import small_config

RID = RoundId("r", "c0", 0, 0)
TARGET = "c0-d1"


def wire(p: Payload) -> Payload:
    return decode_payload(encode_payload(p))


def identities(devices: list[str]) -> dict[str, Trust]:
    seeds = {d: new_seed() for d in devices}
    public = {d: public_of(s) for d, s in seeds.items()}
    return {d: Trust(d, seeds[d], public) for d in devices}


def aggregation(liar: LyingCell | None, n: int = 6, signed: bool = True, threshold: float | None = None):
    """One aggregation of ``n`` devices against the (lying) cell: (each device's refusal, the outcome,
    the devices' plain updates, the settings)."""
    settings = SecAggSettings(seed=3) if threshold is None else SecAggSettings(seed=3, threshold=threshold)
    names = [f"c0-d{i}" for i in range(n)]
    ids = identities(names) if signed else {}
    g = np.random.default_rng(0)
    results = {d: Payload({"weight": 1.0}, {"w": g.normal(0, 0.3, 40).astype(np.float32)}) for d in names}
    devices = {d: SecAggDevice(settings, RID, d, 1.0, identity=ids.get(d)) for d in names}
    cell = liar.protocol(settings, RID, names) if liar else SecAggCell(settings, RID, names)
    refused: dict[str, Rejected] = {}

    def answer(d: str, method, message: Payload):
        if d in refused:
            return None
        try:
            return wire(method(wire(message)))
        except Rejected as exc:
            refused[d] = exc
            return None

    for d, dev in devices.items():
        cell.add_keys(d, wire(dev.advertise()))
    for d, roster in cell.rosters().items():
        if (shares := answer(d, devices[d].share, roster)) is not None:
            cell.add_shares(d, shares)
    for d, routed in cell.routes().items():
        devices[d].receive(wire(routed))
    for d in cell.shared:
        cell.add_masked(d, wire(devices[d].mask(results[d])))
    for d, req in cell.unmask_requests().items():
        if (consent := answer(d, devices[d].consent, req)) is not None:
            cell.add_consent(d, consent)
    for d, views in cell.views().items():
        if (reveal := answer(d, devices[d].reveal, views)) is not None:
            cell.add_reveal(d, reveal)
    try:
        outcome: object = cell.finish()
    except SecAggFailure as exc:
        outcome = exc
    return refused, outcome, results, settings, cell


def target_quantised(results, settings, cell) -> np.ndarray:
    return quantize(flatten(results[TARGET].tensors)[0], 1.0, settings, cell.total_weight)


# ----------------------------------------------------------------------------- key substitution
def test_key_substitution_reads_an_unsigned_target_exactly():
    liar = LyingCell("keys", TARGET)
    _, _, results, settings, cell = aggregation(liar, signed=False)
    assert np.array_equal(liar.recovered[(0, 0)], target_quantised(results, settings, cell))


def test_key_substitution_is_refused_by_a_signed_target_that_then_sends_nothing():
    liar = LyingCell("keys", TARGET)
    refused, outcome, _, _, cell = aggregation(liar)
    assert liar.attempts == 1 and liar.recovered == {}
    assert list(refused) == [TARGET] and isinstance(refused[TARGET], CellLied)
    assert "not signed by" in str(refused[TARGET]) and "substituted" in str(refused[TARGET])
    assert TARGET not in cell.sealed and TARGET not in cell.masked  # nothing of the target ever left it
    assert sorted(outcome.weights) == ["c0-d0", "c0-d2", "c0-d3", "c0-d4", "c0-d5"]  # the others' sum, intact


def test_neighbours_keys_are_checked_against_the_roster_the_cloud_signed():
    """Devices verify their neighbours' advertisements against the federation's roster (signed by the
    cloud, verified by each device): the key substitution is refused, an honest round completes, and a
    neighbour the roster revoked is refused like a stranger."""
    from protocols.privacy.secagg import RosterIdentity
    from protocols.roster import Roster, sign_roster, verify_roster
    from protocols.wire.keys import PublicKeys

    names = [f"c0-d{i}" for i in range(6)]
    seeds = {n: new_seed() for n in ["cloud", "c0", *names]}
    public = {n: public_of(s) for n, s in seeds.items()}
    cloud = Trust("cloud", seeds["cloud"], public)
    signed = sign_roster(Roster.from_topology("fed", {"c0": names}, public, 100.0), cloud.sign)
    roster = verify_roster(signed, PublicKeys({"cloud": public["cloud"]}).verify, federation="fed")

    def devices(r):
        return {
            d: SecAggDevice(SecAggSettings(seed=3), RID, d, 1.0, identity=RosterIdentity(Trust(d, seeds[d], {}), r))
            for d in names
        }

    def roster_round(liar, r):
        devs = devices(r)
        cell = (
            liar.protocol(devs[names[0]].settings, RID, names)
            if liar
            else SecAggCell(SecAggSettings(seed=3), RID, names)
        )
        for d, dev in devs.items():
            cell.add_keys(d, wire(dev.advertise()))
        refused = {}
        for d, ros in cell.rosters().items():
            try:
                devs[d].share(wire(ros))
            except CellLied as exc:
                refused[d] = str(exc)
        return refused

    assert roster_round(None, roster) == {}
    liar = LyingCell("keys", TARGET)
    assert list(roster_round(liar, roster)) == [TARGET] and liar.recovered == {}
    revoked = roster.without("c0-d3")  # a device the cloud revoked still advertises through a colluding cell
    refused = roster_round(None, revoked)
    assert set(refused) == set(names)  # c0-d3 itself is no member: it trusts no neighbour either
    assert all("neighbour c0-d3 " in why for d, why in refused.items() if d != "c0-d3")


def test_a_device_learns_a_neighbour_enrolled_later_from_the_roster_and_forgets_a_revoked_one():
    """Long-lived agents apply each roster the cloud signs (``edge_agent.secagg.learn_roster``): a device
    whose keys file predates a neighbour's enrolment refuses that neighbour's advertisement until the roster
    names it, then takes part; a neighbour the roster revokes is refused again."""
    from types import SimpleNamespace

    from edge_agent.secagg import learn_roster
    from protocols.roster import Roster

    names = [f"c0-d{i}" for i in range(6)]
    seeds = {n: new_seed() for n in ["cloud", "c0", *names]}
    public = {n: public_of(s) for n, s in seeds.items()}
    provisioned = {n: k for n, k in public.items() if n != "c0-d5"}  # c0-d5 enrolled after the others' files
    agents = {d: SimpleNamespace(device=d, cell="c0", trust=Trust(d, seeds[d], provisioned)) for d in names}
    agents["c0-d5"].trust.learn(public)
    settings = SecAggSettings(seed=3)

    def refusals() -> dict[str, str]:
        devs = {d: SecAggDevice(settings, RID, d, 1.0, identity=a.trust) for d, a in agents.items()}
        cell = SecAggCell(settings, RID, names)
        for d, dev in devs.items():
            cell.add_keys(d, wire(dev.advertise()))
        out = {}
        for d, ros in cell.rosters().items():
            try:
                devs[d].share(wire(ros))
            except CellLied as exc:
                out[d] = str(exc)
        return out

    assert set(refusals()) == set(names) - {"c0-d5"}  # they cannot tell c0-d5's keys from the cell's
    roster = Roster.from_topology("fed", {"c0": names}, public, 100.0)
    for agent in agents.values():
        learn_roster(agent, roster)  # type: ignore[arg-type]
    assert refusals() == {}
    for agent in agents.values():
        learn_roster(agent, roster.without("c0-d5"))  # type: ignore[arg-type]
    assert set(refusals()) == set(names) - {"c0-d5"}  # revoked: nobody takes its keys any more


# ----------------------------------------------------------------------------- the dropout lie
def test_the_dropout_lie_reads_the_target_at_the_old_threshold_of_a_third():
    liar = LyingCell("dropout", TARGET, hide=True)
    _, _, results, settings, cell = aggregation(liar, threshold=0.34)
    assert np.array_equal(liar.recovered[(0, 0)], target_quantised(results, settings, cell))


@pytest.mark.parametrize("hide", [False, True])
def test_the_dropout_lie_gets_nothing_and_fails_the_round_cleanly(hide):
    liar = LyingCell("dropout", TARGET, hide=hide)
    refused, outcome, _, settings, cell = aggregation(liar)
    assert settings.t(6) == 3 > cell.settings.degree(6) / 2  # more than half the neighbourhood
    assert liar.attempts == 1 and liar.recovered == {}
    assert isinstance(outcome, SecAggFailure) and "threshold" in str(outcome)
    told_dropped = {d for d, v in cell.views_sent.items() if v != cell.views_sent[TARGET]}
    assert told_dropped and set(refused) >= told_dropped
    if hide:  # what each device was shown agrees with it, but too few neighbours confirm it
        assert all("fewer than the threshold" in str(refused[d]) for d in told_dropped)
    else:  # the devices see the disagreement and say so
        assert all(isinstance(e, CellLied) and "inconsistently" in str(e) for e in refused.values())
        assert set(refused) == set(cell.consents)  # every device saw a neighbour told otherwise


def test_an_honest_signed_round_is_unchanged():
    refused, outcome, results, settings, cell = aggregation(None)
    assert refused == {} and outcome.stats["consents"] == 6
    total = sum(quantize(flatten(r.tensors)[0], 1.0, settings, cell.total_weight) for r in results.values())
    assert np.array_equal(outcome.quantised_sum, total)


# ----------------------------------------------------------------------------- the real runtime
def secure(tmp_path: Path, **sections):
    sections.setdefault("privacy", {}).setdefault("secure_aggregation", True)
    sections.setdefault("topology", {"cells": 2, "devices_per_cell": 6})
    sections.setdefault("security", {"keys": str(tmp_path / "keys.toml")})
    return small_config(tmp_path, run={"rounds": 1}, algorithm={"edge_rounds": 1}, **sections)


@pytest.mark.parametrize("attack", ["keys", "dropout"])
def test_a_lying_cell_in_the_sim_learns_nothing_and_its_devices_count_the_lie(tmp_path, attack):
    from sim.launcher import SimHierarchy

    liar = LyingCell(attack, TARGET)
    with liar.install():
        sim = SimHierarchy(secure(tmp_path))
        result = sim.run()
    assert liar.attempts == 1 and liar.recovered == {}
    rec = next(r for r in result.cell_records if r["cell"] == "c0")
    lies = {d: a.secagg.cell_lies for d, a in sim.agents.items() if d.startswith("c0-")}
    if attack == "keys":  # the target refused its roster: the others' sum, without it
        assert lies == {d: int(d == TARGET) for d in lies}
        assert rec["absent"] == {TARGET: "no secagg shares"} and TARGET not in rec["answered"]
    else:
        assert rec["closed_by"] == "secure aggregation failed" and rec["answered"] == []
        assert all(n == 1 for n in lies.values())
    assert "substituted" in (sim.agents[TARGET].secagg.last_lie or "") or attack == "dropout"
    c1 = next(r for r in result.cell_records if r["cell"] == "c1")
    assert len(c1["answered"]) == 6  # an honest cell beside it is untouched


@pytest.mark.parametrize("attack", ["keys", "dropout"])
def test_a_lying_cell_over_mqtt_never_recovers_the_target_and_the_devices_log_why(tmp_path, attack, capfd):
    from protocols.transport.broker import EmbeddedBroker, MosquittoBroker, find_mosquitto
    from sim.emulation import Emulation

    # the lie costs c0 one secagg phase deadline (the target's shares, the consensus): 1 s, not device_deadline / 4
    cfg = secure(tmp_path, runtime={"device_deadline": 8.0}, privacy={"secagg_deadline": 1.0})
    liar = LyingCell(attack, TARGET)
    with liar.install(), MosquittoBroker() if find_mosquitto() else EmbeddedBroker() as broker:
        emulation = Emulation(cfg, broker_url=broker.url)
        run = emulation.run()
    assert liar.attempts == 1 and liar.recovered == {}
    lies = {d: s["cell_lies"] for d, s in emulation.agent_stats.items() if d.startswith("c0-")}  # counted
    assert lies == ({d: int(d == TARGET) for d in lies} if attack == "keys" else dict.fromkeys(lies, 1)), lies
    rec = next(r for r in run.cell_records if r["cell"] == "c0")
    if attack == "keys":
        assert rec["absent"].get(TARGET) == "no secagg shares" and TARGET not in rec["answered"]
    else:
        assert rec["closed_by"] == "secure aggregation failed" and "threshold" in rec["metrics"]["secagg"]["failed"]
    logged = capfd.readouterr().err
    assert "cell c0 lied" in logged and ("substituted" if attack == "keys" else "inconsistently") in logged
