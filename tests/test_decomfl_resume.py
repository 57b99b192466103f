"""DeComFL deployed (``fedtier cloud``, one ``fedtier cell`` per cell, one ``fedtier agent`` per device, over a broker),
its cell c0 SIGKILLed mid-round and its cloud SIGKILLed once the cells aggregated round 1, each restarted with
``--resume`` (:func:`tests.test_resume.kill_cell_then_cloud`). Unlike FedAvg's, DeComFL's devices and cloud keep state
across rounds (each device's model replica, replayed from the cloud's seeds and scalars; the cloud's history, its
``synced`` and ``need`` tables, its round log beside the checkpoint): none may be lost or applied twice. Devices take
part in 3 of 4 a round (``uniform``, seeded: c1-d1 sits rounds 0 and 1 out, c0-d0 round 2), so devices catch up
across the resume with history the resumed cloud read back from its checkpoint, and agents that sit a round out
really leave the broker (churn)."""

from __future__ import annotations

import pytest

from protocols import runfiles
from sim.hierarchy import participation
from tests.test_resume import Deployment, Killed, kill_cell_then_cloud, new_broker, records

PARTICIPATION = """[participation]
model = "uniform"
per_round = 3
"""


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Killed:
    """The signed DeComFL deployment (4 rounds) with its cell c0 killed in round 0 and its cloud in round 1 (one
    deployment for the assertions below)."""
    with new_broker() as broker:
        tmp = tmp_path_factory.mktemp("decomfl-killed")
        dep = Deployment(tmp, broker.url, "decomfl", rounds=4, runtime="rejoin_poll = 0.2\n", tables=PARTICIPATION)
        return kill_cell_then_cloud(dep, kill_cloud=True)


def test_decomfl_cloud_and_cell_killed_mid_round_resume_to_the_uninterrupted_model(killed: Killed) -> None:
    """The run ends with the uninterrupted run's model byte for byte (``fedtier sim`` of the same config): every
    device's replica stayed the cloud's (a replica off by one replayed round, or a resync, gives other scalars), and
    the history the devices that missed rounds replayed is the one the killed cloud had."""
    dep = killed.dep
    assert killed.done is not None
    assert (dep.tmp / "cloud" / runfiles.FINAL_MODEL).read_bytes() == killed.expected
    assert "resumed round 0, edge round 0 with 1 of 2 results" in dep.log("c0")
    takes_part = participation(dep.cfg).participants
    assert "c1-d1" not in takes_part(0) | takes_part(1) and "c1-d1" in takes_part(2)  # catches up rounds 0-1 in 2


def test_decomfl_resumed_tiers_record_every_round_once_with_every_participating_device(killed: Killed) -> None:
    dep, cells = killed.dep, killed.dep.cfg.topology.cell_ids()
    takes_part = participation(dep.cfg).participants
    metrics = records(dep.tmp / "cloud" / runfiles.METRICS)
    assert [m["round"] for m in metrics] == [0, 1, 2, 3], killed.done  # the re-run round once
    assert all(m["cells_reported"] == cells and m["closed_by"] == "all reported" for m in metrics), metrics
    for cell in cells:
        aggregation = records(dep.cell_dir(cell) / runfiles.AGGREGATION)
        assert [r["round"] for r in aggregation] == [0, 1, 2, 3], aggregation
        for r in aggregation:
            assert r["answered"] == sorted(takes_part(r["round"]) & set(dep.cfg.topology.device_ids(cell))), r
            assert not r["rejected"] and r["closed_by"] == "all answered", r
    assert not any("resync" in dep.log(d) for d in dep.cfg.topology.all_devices())  # no replica was lost


def test_a_resumed_cloud_does_not_wait_for_devices_that_sit_the_round_out(killed: Killed) -> None:
    """Each cell's status counts the offline devices that take no part in its round (``devices_away``), so the resumed
    cloud re-opens its round at once. Before, it waited for every device of every cell to be online, which the ones
    sitting the round out (gone from the broker by design) never were: it re-sent the round after its whole startup
    wait (60 s), and the job stalled that long at every cloud restart of a run with device participation."""
    assert killed.resumed_s is not None
    assert killed.resumed_s < killed.dep.cfg.runtime.startup_wait / 2, (killed.resumed_s, killed.dep.log("cloud"))
