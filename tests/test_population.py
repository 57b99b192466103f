"""A simulated population costs what is active: agents built on a device's first task, dropped when idle."""

from __future__ import annotations

import json

import pytest

from protocols import runfiles
from protocols.checkpoint import load_params
from sim import population
from sim.launcher import SimHierarchy


def partial(make_config, tmp_path, name: str, **sections):
    return make_config(
        run={"rounds": 4, "output": str(tmp_path / name)},
        topology={"cells": 2, "devices_per_cell": 6},
        participation={"model": "uniform", "per_round": 3},
        **sections,
    )


def run_counting_agents(sim: SimHierarchy) -> tuple[list[int], object]:
    """Run; return how many agents existed when each cloud round closed, and the result."""
    alive: list[int] = []
    sim.cloud.on_round = lambda record: alive.append(len(sim.agents.built()))
    return alive, sim.run()


@pytest.mark.parametrize("kept", [0, 2])  # idle agents kept for their next tasks: none, or the 2 most recent
def test_lazy_population_gives_the_eager_model_and_records_byte_for_byte(make_config, tmp_path, monkeypatch, kept):
    lazy = SimHierarchy(partial(make_config, tmp_path, "lazy"))
    assert lazy.agents.built() == [] and len(lazy.agents) == 12  # nothing built before a task
    bound = "KEPT_IDLE_AGENTS" if kept == 0 else "KEPT_IDLE_BYTES"  # (either bound)
    monkeypatch.setattr(population, bound, kept * population._data_bytes(lazy.agents.data["c0-d0"]) if kept else 0)
    dropping = lazy.agents.drop_idle
    recency: list[tuple[list, list]] = []  # each pass: (the kept idle agents' last tasks, the dropped ones')

    def drop_idle() -> None:
        before = {d: a.last_task for d, a in lazy.agents.active().items() if not a.pending}
        dropping()
        recency.append(
            (
                [t for d, t in before.items() if d in lazy.agents.active()],
                [t for d, t in before.items() if d not in lazy.agents.active()],
            )
        )

    monkeypatch.setattr(lazy.agents, "drop_idle", drop_idle)
    alive, lazy_result = run_counting_agents(lazy)
    assert recency and all(not dropped or min(kept_ + [(99, 0)]) >= max(dropped) for kept_, dropped in recency)
    eager = SimHierarchy(partial(make_config, tmp_path, "eager"))
    for device in eager.agents:  # every device built up front, announced, kept (what the sim did before)
        eager.agents[device]
    eager_alive, eager_result = run_counting_agents(eager)

    a, b = (load_params(tmp_path / n / runfiles.FINAL_MODEL) for n in ("lazy", "eager"))
    assert all(a[k].tobytes() == b[k].tobytes() for k in b)
    strip = lambda records: [{k: v for k, v in r.items() if k not in ("time", "duration_s")} for r in records]  # noqa: E731
    assert strip(lazy_result.cell_records) == strip(eager_result.cell_records)
    assert [h["cumulative_bytes"] for h in lazy_result.history] == [h["cumulative_bytes"] for h in eager_result.history]
    active = {d: t for d, t in eager_result.device_traffic.items() if t["tasks"]}
    assert lazy_result.device_traffic == active and len(active) < 12
    # idle agents are dropped when the next round begins, but for the most recent ones that fit the bound: the
    # round's 3 devices exist when it closes, and at most `kept` others; the eager run held all 12 throughout
    assert eager_alive == [12] * 4 and all(3 <= n <= 3 + kept for n in alive)
    assert alive == [3] * 4 if kept == 0 else max(alive) > 3


def test_devices_that_keep_state_keep_their_agents(make_config, tmp_path):
    cfg = partial(
        make_config,
        tmp_path,
        "decomfl",
        algorithm={
            "name": "decomfl",
            "edge_rounds": 1,
            "local_steps": 2,
            "perturbations": 2,
            "lr": 0.02,
            "mu": 1e-3,
            "batch_size": 16,
        },
    )
    sim = SimHierarchy(cfg, write_output=False)
    alive, result = run_counting_agents(sim)
    took_part = {d for r in result.cell_records for d in r["planned"]}
    assert alive == sorted(alive) and alive[-1] == len(took_part)  # never dropped: replicas live on
    assert {a.device for a in sim.agents.built()} == took_part


def test_large_populations_count_absent_devices_instead_of_listing_them(make_config, tmp_path):
    cfg = partial(make_config, tmp_path, "counted", runtime={"absent_ids": 2})
    SimHierarchy(cfg).run()
    records = [json.loads(line) for line in (tmp_path / "counted" / runfiles.AGGREGATION).read_text().splitlines()]
    for r in records:
        sitting_out = 6 - len(r["planned"])
        if sitting_out > 2:  # too many to name: counted only
            assert r["absent_counts"] == {"not participating": sitting_out} and r["absent"] == {}
        else:
            assert "absent_counts" not in r and len(r["absent"]) == sitting_out
    assert any("absent_counts" in r for r in records)
    from protocols.records import CellRecord

    for r in map(CellRecord.model_validate, records):  # what monitor and the exporter read
        assert r.cell_size == 6 and sum(r.absent_by_reason().values()) == 6 - len(r.planned)
    from click.testing import CliRunner

    from fedtier.cli import main

    out = CliRunner().invoke(main, ["logs", str(tmp_path / "counted")])
    assert out.exit_code == 0 and "not participating" in out.output


def test_an_agent_built_again_gets_its_devices_samples_back_not_a_fresh_copy(make_config, tmp_path, monkeypatch):
    """A dropped agent's next build finds its device's samples where they were (the same arrays: no copy a round,
    and an engine that keeps data sets by array finds them); beyond the bound the oldest are copied again."""
    import numpy as np

    import sim.hierarchy as H

    sim = SimHierarchy(partial(make_config, tmp_path, "kept"))
    result = sim.run()
    data = sim.prep.device_data
    took_part = sorted({d for r in result.cell_records for d in r["planned"]})
    assert len(took_part) > 3  # agents were dropped and built again for other devices
    for d in took_part:  # each agent was built for its tasks and dropped when idle: its samples were kept
        again, idx = data[d], data.indices(d)
        assert data[d] is again and np.array_equal(again.x, data.ds.x_train[idx])
    a, b = took_part[:2]
    monkeypatch.setattr(H, "KEPT_DATA_BYTES", data[a].x.nbytes + data[a].y.nbytes)  # room for one device's
    small = H.DeviceData(data.ds, data.topology, data.parts)
    first = small[a]
    assert small[a] is first
    small[b]  # drops a's
    assert small[a] is not first and np.array_equal(small[a].x, first.x)


def test_a_run_of_more_devices_than_the_summary_lists_writes_their_traffic_a_line_each(
    make_config, tmp_path, monkeypatch
):
    """summary.json listed every device's traffic (at 10^6 devices ~465 MB of indented JSON, built whole in memory).
    Past LISTED_DEVICES (here lowered to 2) it holds their count and totals, and device_traffic.jsonl each device's,
    a line each; a later run of few devices in the folder leaves no stale file."""
    from sim import launcher

    monkeypatch.setattr(launcher, "LISTED_DEVICES", 2)
    result = SimHierarchy(partial(make_config, tmp_path, "many")).run()
    out = tmp_path / "many"
    summary = json.loads((out / runfiles.SUMMARY).read_text())
    lines = [json.loads(line) for line in (out / runfiles.DEVICE_TRAFFIC).read_text().splitlines()]
    assert "device_traffic" not in summary and summary["device_traffic_file"] == runfiles.DEVICE_TRAFFIC
    assert {d.pop("device"): d for d in lines} == result.device_traffic and len(lines) > 2
    totals = summary["device_traffic_totals"]
    assert totals["devices"] == len(lines) and totals["tasks"] == sum(
        t["tasks"] for t in result.device_traffic.values()
    )
    assert totals["bytes_out"] == sum(t["bytes_out"] for t in result.device_traffic.values()) > 0
    monkeypatch.setattr(launcher, "LISTED_DEVICES", 10_000)
    launcher.write_final(out, result)
    assert json.loads((out / runfiles.SUMMARY).read_text())["device_traffic"] == result.device_traffic
    assert not (out / runfiles.DEVICE_TRAFFIC).exists()
