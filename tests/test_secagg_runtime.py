"""Secure aggregation in the running hierarchy (``fedtier sim`` and ``fedtier run``): the cell aggregates
exactly the survivors' quantised updates, survives devices dropping after the share phase, fails a
round cleanly below the threshold, keeps secrets out of its log, and refuses bad secagg messages."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from protocols import runfiles
from protocols.privacy.secagg import dequantize, flatten, quantize, unflatten
from protocols.wire import topics
from protocols.wire.payload import Payload
from sim.launcher import SimHierarchy, run_simulation
from tests.conftest import small_config


def secure(tmp_path: Path, devices: int = 3, **sections):
    sections.setdefault("privacy", {}).setdefault("secure_aggregation", True)
    sections.setdefault("topology", {"cells": 2, "devices_per_cell": devices})
    return small_config(tmp_path, **sections)


def silent_after_sharing(sim: SimHierarchy, devices, rounds=None) -> None:
    """These devices key, share and train, then never send their (masked) result: dropped after sharing."""
    for d in devices:
        agent = sim.agents[d]
        keep = agent.secagg.result_ready

        def drop(result, rnd, edge, keep=keep):
            if rounds is not None and rnd not in rounds:
                keep(result, rnd, edge)

        agent.secagg.result_ready = drop


def capture_plain(sim: SimHierarchy, devices) -> dict:
    """Each device's plain (unmasked) result by (round, edge round), as it trained it."""
    seen: dict = {}
    for d in devices:
        agent = sim.agents[d]
        keep = agent.secagg.result_ready

        def spy(result, rnd, edge, keep=keep, d=d):
            seen[(rnd, edge, d)] = result
            keep(result, rnd, edge)

        agent.secagg.result_ready = spy
    return seen


@pytest.mark.parametrize("algorithm", ["fedavg", "hist"])
def test_secure_sim_learns_like_the_plain_one_and_records_the_protocol(tmp_path, algorithm):
    name = {"name": algorithm}
    plain = run_simulation(
        small_config(tmp_path / "p", run={"rounds": 4, "output": str(tmp_path / "p")}, algorithm=name)
    )
    safe = run_simulation(secure(tmp_path, run={"rounds": 4, "output": str(tmp_path / "s")}, algorithm=name))
    assert safe.final_accuracy >= plain.final_accuracy - 0.03 and safe.final_accuracy > 0.8
    for rec in safe.cell_records:
        assert rec["closed_by"] == "all answered" and len(rec["answered"]) == 3 and not rec["rejected"]
        assert rec["metrics"]["secagg"] == {
            "planned": 3,
            "keys": 3,
            "shared": 3,
            "survivors": 3,
            "dropped": 0,
            "recovered": 0,
            "consents": 3,
            "degree": 2,
            "threshold": 2,
        }
    # the masked vector is as large as the plain update; keys and shares add a little
    ratio = safe.cell_records[0]["bytes_in"] / plain.cell_records[0]["bytes_in"]
    assert 1.0 < ratio < 1.3


def test_thirty_percent_dropping_after_sharing_the_cell_aggregates_exactly_the_survivors(tmp_path):
    cfg = secure(
        tmp_path, devices=10, run={"rounds": 1}, algorithm={"edge_rounds": 1}, runtime={"device_deadline": 20.0}
    )
    sim = SimHierarchy(cfg)
    cell = sim.cells["c0"]
    devices = cfg.topology.device_ids("c0")
    dropped = devices[2:5]
    plain = capture_plain(sim, devices)
    silent_after_sharing(sim, dropped)
    seen_by_role = {}
    keep = cell.role.aggregate

    def spy(edge, results):
        seen_by_role.update(results)
        return keep(edge, results)

    cell.role.aggregate = spy
    sim.run()
    rec = next(r for r in cell.records)
    survivors = [d for d in devices if d not in dropped]
    assert rec["answered"] == survivors and rec["closed_by"] == "deadline"
    assert rec["metrics"]["secagg"]["dropped"] == 3 and rec["metrics"]["secagg"]["recovered"] == 3
    # what the role got is exactly the survivors' quantised sum, unmasked, over their weight
    settings = cfg.secagg_settings()
    total_weight = float(sum(len(sim.prep.device_data[d]) for d in devices))  # every device sent keys
    total = sum(
        quantize(flatten(plain[(0, 0, d)].tensors)[0], plain[(0, 0, d)].meta["weight"], settings, total_weight)
        for d in survivors
    )
    layout = flatten(plain[(0, 0, survivors[0])].tensors)[1]
    weight = sum(plain[(0, 0, d)].meta["weight"] for d in survivors)
    expected = {
        k: (v / weight).astype(np.float32)
        for k, v in unflatten(dequantize(total, settings, total_weight), layout).items()
    }
    assert sorted(seen_by_role) == survivors
    for d in survivors:
        assert seen_by_role[d].meta["weight"] == plain[(0, 0, d)].meta["weight"]
        assert all(np.array_equal(seen_by_role[d].tensors[k], expected[k]) for k in expected)


def test_a_device_silent_from_the_start_is_left_out_after_the_key_deadline(tmp_path):
    cfg = secure(
        tmp_path, devices=4, run={"rounds": 1}, algorithm={"edge_rounds": 1}, runtime={"device_deadline": 20.0}
    )
    sim = SimHierarchy(cfg)
    sim.agents["c0-d2"].secagg.begin = lambda h, train: None  # takes its task, never sends keys nor trains
    result = sim.run()
    rec = next(r for r in result.cell_records if r["cell"] == "c0")
    assert rec["answered"] == ["c0-d0", "c0-d1", "c0-d3"] and rec["absent"] == {"c0-d2": "no secagg keys"}
    assert rec["metrics"]["secagg"]["keys"] == 3 and rec["metrics"]["secagg"]["dropped"] == 0
    assert rec["closed_by"] == "all answered" and rec["clock_s"] == pytest.approx(5.0)  # device_deadline / 4


def test_fewer_survivors_than_the_threshold_fail_the_round_cleanly_and_the_next_one_proceeds(tmp_path):
    cfg = secure(tmp_path, run={"rounds": 2}, algorithm={"edge_rounds": 1})
    sim = SimHierarchy(cfg)
    silent_after_sharing(sim, ["c0-d0", "c0-d1"], rounds={0})  # 1 survivor, threshold 2
    result = sim.run()
    c0 = [r for r in result.cell_records if r["cell"] == "c0"]
    assert c0[0]["closed_by"] == "secure aggregation failed" and c0[0]["answered"] == []
    assert "threshold" in c0[0]["metrics"]["secagg"]["failed"]
    assert c0[1]["closed_by"] == "all answered" and len(c0[1]["answered"]) == 3
    assert result.history[0]["metrics"]["cells"] == 1  # c0 reported nothing in round 0: the cloud used c1
    assert result.history[0]["devices"] == {"c0": 0, "c1": 3}
    assert result.history[1]["metrics"]["cells"] == 2


def test_masks_and_shares_never_appear_in_the_cell_log(tmp_path):
    cfg = secure(tmp_path, run={"rounds": 1})
    sim = SimHierarchy(cfg)
    secrets: list[bytes] = []
    for agent in sim.agents.values():
        send = agent.messenger.send

        def keep(topic, kind, payload, send=send, **kw):
            if kind in ("secagg_shares", "secagg_reveal", "device_result"):
                secrets.extend(a.tobytes()[:16] for a in payload.tensors.values() if a.size)
            return send(topic, kind, payload, **kw)

        agent.messenger.send = keep
    sim.run()
    log = (cfg.output_dir() / runfiles.AGGREGATION).read_text()
    assert len(secrets) > 20 and "secagg" in log
    for s in secrets:
        for text in (s.hex(), str(list(s[:6]))[1:-1], __import__("base64").b64encode(s).decode()[:12]):
            assert text not in log


def test_bad_secagg_messages_are_rejected_and_logged_and_the_sum_stays_right(tmp_path):
    cfg = secure(tmp_path, devices=5, run={"rounds": 2}, algorithm={"edge_rounds": 1})
    sim = SimHierarchy(cfg)
    c0 = sim.cells["c0"]
    captured: dict = {}
    d1 = sim.agents["c0-d1"]
    send = d1.messenger.send

    def keep(topic, kind, payload, **kw):
        captured.setdefault((kw["round"], kind), (topic, payload))
        return send(topic, kind, payload, **kw)

    d1.messenger.send = keep
    intruder = sim.agents["c1-d0"]  # a device of another cell, never planned in c0
    rogue_topic = topics.device_result(cfg.run.name, "c0", "c1-d0")
    state = {"done": False}
    keep_advance = c0.secagg._advance

    def advance():
        st = c0.secagg.state
        if c0.round == 1 and st.phase == "keys" and not state["done"]:
            state["done"] = True
            # keys from a device not planned this round
            intruder.messenger.send(
                rogue_topic,
                "secagg_keys",
                Payload({"weight": 5.0}, {"c": np.zeros(32, np.uint8), "s": np.zeros(32, np.uint8)}),
                round=1,
                cell="c0",
            )
            # a share message replayed from round 0 (framed anew, its old round in the header)
            topic, old = captured[(0, "secagg_shares")]
            d1.messenger.send(topic, "secagg_shares", old, round=0, cell="c0")
            # a malformed shares message for this round from d2 (one ciphertext cut short)
            sim.agents["c0-d2"].messenger.send(
                topics.device_result(cfg.run.name, "c0", "c0-d2"),
                "secagg_shares",
                Payload({"commit": "0" * 64}, {"e/c0-d0": np.zeros(3, np.uint8)}),
                round=1,
                cell="c0",
            )
        keep_advance()

    c0.secagg._advance = advance
    result = sim.run()
    rec = [r for r in result.cell_records if r["cell"] == "c0"][1]
    reasons = " | ".join(r["reason"] for r in rec["rejected"])
    assert "not planned" in reasons and "stale or replayed" in reasons and "shares" in reasons
    # d2's real shares came after its malformed message was refused: everybody survives, the sum is whole
    assert rec["closed_by"] == "all answered" and len(rec["answered"]) == 5
    clean = run_simulation(
        secure(tmp_path, devices=5, run={"rounds": 2, "output": str(tmp_path / "clean")}, algorithm={"edge_rounds": 1})
    )
    assert all(np.array_equal(result.params[k], clean.params[k]) for k in clean.params)  # the very same model


def test_secure_aggregation_over_mqtt_gives_the_same_model_as_the_sim(tmp_path):
    """Signed: the secagg messages are signed and verified like every other kind."""
    from protocols.transport.broker import EmbeddedBroker, MosquittoBroker, find_mosquitto
    from sim.emulation import Emulation

    extra = {"security": {"keys": str(tmp_path / "keys.toml")}}
    sim = run_simulation(secure(tmp_path, run={"rounds": 2, "output": str(tmp_path / "sim")}, **extra))
    cfg = secure(tmp_path, run={"rounds": 2, "output": str(tmp_path / "run")}, **extra)
    with MosquittoBroker() if find_mosquitto() else EmbeddedBroker() as broker:
        run = Emulation(cfg, broker_url=broker.url).run()
    assert (run.output_dir / runfiles.FINAL_MODEL).read_bytes() == (sim.output_dir / runfiles.FINAL_MODEL).read_bytes()
    assert all(r["metrics"]["secagg"]["survivors"] == 3 and not r["rejected"] for r in run.cell_records)
