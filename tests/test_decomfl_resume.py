"""DeComFL deployed (``fedtier cloud``, one ``fedtier cell`` per cell, one ``fedtier agent`` per device, over a broker),
its cell c0 SIGKILLed mid-round and its cloud SIGKILLed once the cells aggregated round 1, each restarted with
``--resume`` (:func:`tests.test_resume.kill_cell_then_cloud`). Unlike FedAvg's, DeComFL's devices and cloud keep state
across rounds (each device's model replica, replayed from the cloud's seeds and scalars; the cloud's history, its
``synced`` and ``need`` tables, its round log beside the checkpoint): none may be lost or applied twice. Devices take
part in 3 of 4 a round (``uniform``, seeded: c1-d1 sits rounds 0 and 1 out, c0-d0 round 2), so devices catch up
across the resume with history the resumed cloud read back from its checkpoint, and agents that sit a round out
really leave the broker (churn). A second deployment SIGKILLs a device's agent holding its task (:func:`agent_killed`):
an agent has no ``--resume``, so it resyncs, and the job ends as ``fedtier sim`` with that replica lost."""

from __future__ import annotations

import json
import signal
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import pytest

from protocols import runfiles
from protocols.checkpoint import Journal, load_params
from protocols.config import load_config
from sim.hierarchy import participation
from sim.launcher import SimHierarchy
from tests.test_resume import Deployment, Killed, kill_cell_then_cloud, new_broker, records, wait_for

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
    assert "resumed edge round 1.1 with 1 of 2 results" in dep.log("c0")
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


@dataclass
class AgentKilled:
    """The deployment run to its end through the kill of agent c0-d1 (:func:`agent_killed`)."""

    dep: Deployment
    expected: bytes  # the final model of ``fedtier sim`` with c0-d1's replica lost after round 1


@pytest.fixture(scope="module")
def agent_killed(tmp_path_factory: pytest.TempPathFactory) -> AgentKilled:
    """The DeComFL deployment (5 rounds) with agent c0-d1 SIGKILLed holding its task of round 2 (its replica x_1:
    it answered round 1) and started again afresh (agents have no ``--resume``: its replica is x_0 again). Each pause
    (SIGSTOP) holds a round open so the next step cannot race it: c1-d0 through round 0 until c0 aggregated it,
    c0-d0 through c0's round 1 until c0 journaled c0-d1's answer, then c0-d1 until c0 journaled round 2's plan with
    it (its task sent to the paused agent)."""
    with new_broker() as broker:
        dep = Deployment(
            tmp_path_factory.mktemp("decomfl-agent-killed"),
            broker.url,
            "decomfl",
            rounds=5,
            runtime="rejoin_poll = 0.2\nheartbeat_timeout = 0\n",  # (paused agents are not offline: killed ones are)
            tables=PARTICIPATION,
        )
        journal = Journal(dep.cell_dir("c0") / runfiles.CELL_JOURNAL.format(cell="c0"))
        try:
            with ExitStack() as stack:
                stack.callback(dep.close)
                dep.start_all_but("cloud")
                expected = replica_lost_after_round_1(dep, "c0-d1")  # while the cells and agents start up
                dep.wait_online("c1-d0")
                dep.signal("c1-d0", signal.SIGSTOP)  # before the cloud opens round 0
                dep.start("cloud")
                aggregated = lambda: records(dep.cell_dir("c0") / runfiles.AGGREGATION)  # noqa: E731
                wait_for("c0's record of round 0", lambda: any(r["round"] == 0 for r in aggregated()))
                dep.signal("c0-d0", signal.SIGSTOP)  # waiting for round 1, which c1-d0 holds back
                dep.signal("c1-d0", signal.SIGCONT)
                wait_for("c0-d1's answer of round 1 in c0's journal", lambda: _journaled(journal, 1, "result", "c0-d1"))
                dep.signal("c0-d1", signal.SIGSTOP)  # waiting for round 2, which c0-d0 holds back
                dep.signal("c0-d0", signal.SIGCONT)
                wait_for("c0's plan of round 2 with c0-d1", lambda: _journaled(journal, 2, "plan", "c0-d1"))
                dep.kill("c0-d1")
                dep.start("c0-d1")
                dep.wait_all()
        except AssertionError as exc:  # a wait timed out, or a node exited non-zero: what each node said
            raise AssertionError(f"{exc}\n{log_tails(dep)}") from exc
        return AgentKilled(dep, expected)


def replica_lost_after_round_1(dep: Deployment, device: str) -> bytes:
    """The final model of ``fedtier sim`` of ``dep``'s config with ``device``'s role made afresh (x_0, as a
    restarted agent) once the cloud closed round 1."""
    sim = SimHierarchy(load_config(dep.config, [f"run.output={json.dumps(str(dep.tmp / 'sim'))}"]))

    def restart_after_round_1(record: dict) -> None:
        if record["round"] == 1:
            sim.agents[device].role = sim.algorithm.device(device)

    sim.cloud.on_round = restart_after_round_1
    sim.run()
    return (sim.output_dir / runfiles.FINAL_MODEL).read_bytes()


def log_tails(dep: Deployment, chars: int = 1500) -> str:
    """The end of every node's log (what a failed wait prints)."""
    return "\n".join(f"---- {p.stem}\n{p.read_text(errors='replace')[-chars:]}" for p in sorted(dep.tmp.glob("*.log")))


def _journaled(journal: Journal, round: int, kind: str, device: str) -> bool:
    """Whether ``journal`` (a cell's, of its current round) is ``round``'s and has a ``kind`` entry naming
    ``device`` (a result of it, or a plan with it)."""
    entries = [e.meta for e in journal.read()]
    return any(e.get("k") == "task" and e.get("round") == round for e in entries) and any(
        e.get("k") == kind and device in (e.get("device"), *e.get("available", [])) for e in entries
    )


def test_a_decomfl_agent_killed_mid_job_resyncs_and_the_job_ends_with_every_round(agent_killed: AgentKilled) -> None:
    """The restarted agent is back at x_0 and its task of round 2 starts at round 1: it answers ``resync`` (its log
    says so), sits round 3 out as planned, and answers round 4 from the whole history the cloud's window grew back
    to. The job ends as ``fedtier sim`` with that device's replica lost after round 1, byte for byte: nothing it sent
    from the killed process or the restarted one (which got round 2's task twice: its session's queue and its cell's
    re-send) was taken twice, and nothing from a stale replica was taken at all."""
    dep, cells = agent_killed.dep, agent_killed.dep.cfg.topology.cell_ids()
    assert (dep.tmp / "cloud" / runfiles.FINAL_MODEL).read_bytes() == agent_killed.expected, log_tails(dep)
    assert all(np.isfinite(v).all() for v in load_params(dep.tmp / "cloud" / runfiles.FINAL_MODEL).values())
    metrics = records(dep.tmp / "cloud" / runfiles.METRICS)
    assert [m["round"] for m in metrics] == [0, 1, 2, 3, 4], dep.log("cloud")
    assert all(m["cells_reported"] == cells and m["closed_by"] == "all reported" for m in metrics), metrics
    assert [m["metrics"]["devices"] for m in metrics] == [3, 3, 2, 3, 3]  # round 2: c0-d1 resynced, no scalars
    assert [m["metrics"]["history_rounds"] for m in metrics][2:4] == [3, 4]  # the window back to round 0
    c0 = {r["round"]: r for r in records(dep.cell_dir("c0") / runfiles.AGGREGATION)}
    assert sorted(c0) == [0, 1, 2, 3, 4], c0
    assert c0[2]["metrics"] == {"answered": 1, "resync": 1} and c0[4]["answered"] == ["c0-d0", "c0-d1"], c0
    assert "c0-d1" not in c0[3]["planned"]  # sits round 3 out: round 4 is its first answer since the resync
    for cell in cells:
        assert all(not r["rejected"] for r in records(dep.cell_dir(cell) / runfiles.AGGREGATION)), cell
    assert "resync" in dep.log("c0-d1"), dep.log("c0-d1")
