"""A diverged device is a clean, logged "diverged" result the cell records and never aggregates; a stale
or replayed task is never trained (issue #14)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest

from cloud.parts import RoundCounts
from cloud.round_record import blame
from edge_agent.agent import DeviceAgent
from protocols.algorithms.base import DeviceContext, DeviceRole
from protocols.divergence import diverged_reason, diverged_result, nonfinite
from protocols.session import CloudSession
from protocols.trainer import LocalData
from protocols.transport.memory import MemoryHub
from protocols.wire import topics
from protocols.wire.messenger import Messenger
from protocols.wire.payload import Payload
from sim.launcher import SimHierarchy
from tests.conftest import overflow_devices, small_config


def test_nonfinite_finds_loss_overflow_and_bad_tensors() -> None:
    ok = Payload({"weight": 3, "loss": 0.5, "nested": {"a": [1.0, 2.0]}}, {"d": np.ones(3, np.float32)})
    assert nonfinite(ok) is None
    assert "loss" in nonfinite(Payload({"loss": float("inf")}, {}))
    assert "nested.a[1]" in nonfinite(Payload({"nested": {"a": [1.0, float("nan")]}}, {}))
    assert "2 non-finite" in nonfinite(Payload({}, {"d": np.array([1, np.inf, np.nan], np.float32)}))
    assert nonfinite(Payload({}, {"bits": np.array([255], np.uint8)})) is None
    assert diverged_reason(diverged_result("loss inf")) == "loss inf"
    assert diverged_reason(ok) is None
    assert diverged_reason(Payload({"diverged": "x"}, {"d": np.ones(1, np.float32)})) is None  # carries numbers


def test_a_device_whose_loss_overflows_sends_diverged_and_the_cell_records_it(tmp_path: Path, caplog) -> None:
    """c0-d1's inputs are scaled to overflow float32: its loss is inf/NaN. It sends a logged "diverged"
    result (no traceback); c0 records it in every aggregation, closes on "all answered" without it, and
    the model stays finite."""
    cfg = small_config(tmp_path, run={"rounds": 2})
    h = overflow_devices(SimHierarchy(cfg), lambda device: device == "c0-d1")
    with caplog.at_level(logging.WARNING):
        result = h.run()
    c0 = [r for r in result.cell_records if r["cell"] == "c0"]
    assert len(c0) == 4
    for record in c0:
        assert set(record["diverged"]) == {"c0-d1"} and "not finite" in record["diverged"]["c0-d1"]
        assert record["answered"] == ["c0-d0", "c0-d2"] and record["closed_by"] == "all answered"
        assert not record["absent"] and not record["rejected"]
    assert all("diverged" not in r for r in result.cell_records if r["cell"] == "c1")
    assert all(np.isfinite(v).all() for v in result.params.values())
    assert "device c0-d1 diverged in round 1.1" in caplog.text
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


class _Counting(DeviceRole):
    def __init__(self) -> None:
        self.trained: list[tuple[int, int]] = []

    def train(self, task: Payload, data: LocalData, trainer, ctx: DeviceContext) -> Payload:
        self.trained.append((ctx.round, ctx.edge_round))
        return Payload({"weight": 1, "loss": 0.1}, {})


class _Unsigned:
    """Device c0-d0 (a counting role) on a memory hub; :meth:`task` sends it a task as its cell would."""

    def __init__(self, **agent_kw) -> None:
        self.hub, self.role = MemoryHub(), _Counting()
        self.agent = DeviceAgent(
            self.hub.connect("d"),
            run="r",
            cell="c0",
            device="c0-d0",
            role=self.role,
            data=LocalData(np.zeros((1, 2), np.float32), np.zeros(1, np.int64)),
            trainer=None,
            seed=0,
            **agent_kw,
        )
        self.agent.start()
        self.cell = Messenger(self.hub.connect("cell"), "r", "c0")
        self.rejected: list[str] = []
        self.agent.messenger.on_reject = lambda topic, kind, reason, sender: self.rejected.append(reason)

    def task(self, rnd: int, edge: int) -> None:
        self.cell.send(
            topics.device_task("r", "c0", "c0-d0"),
            "device_task",
            Payload({}, {}),
            round=rnd,
            edge_round=edge,
            cell="c0",
        )
        self.hub.loop.run()


def test_replayed_and_stale_tasks_are_never_trained() -> None:
    """Unsigned run (anyone can forge; the window still holds): a task re-sent for a (round, edge round)
    already taken, or an older one, is rejected as a replay; a task for a round before the cloud's
    manifest is rejected as stale; a new cloud session opens a new window."""
    cloud = CloudSession()
    cloud.on_status({"state": "online", "session": "s1", "started": 1.0})
    d = _Unsigned(cloud=cloud)
    role, agent, rejected, task = d.role, d.agent, d.rejected, d.task
    task(1, 0)
    task(1, 1)
    task(1, 1)  # the same task again, a new message id: a replay
    task(0, 3)  # an older one
    assert role.trained == [(1, 0), (1, 1)]
    assert sum("(replayed)" in r for r in rejected) == 2
    cloud.on_manifest({"session": "s1", "round": 3})
    task(2, 0)  # the cloud is at round 3 already
    assert role.trained == [(1, 0), (1, 1)] and "stale task for round 3" in rejected[-1]
    task(3, 0)
    cloud.on_status({"state": "online", "session": "s2", "started": 2.0})  # a restarted cloud
    cloud.on_manifest({"session": "s2", "round": 0})
    task(0, 0)
    assert role.trained == [(1, 0), (1, 1), (3, 0), (0, 0)]
    assert agent.tasks_done == 4


def test_an_async_task_is_numbered_by_its_cells_model_version_which_the_cloud_manifest_does_not_bound() -> None:
    """``algorithm.mode = "async"``: a task's round is the cell's model version, which runs ahead of or behind the
    cloud's version (the manifest's round) as the cells' pace differs. Deployed, agents refused such tasks as stale
    ("stale task for round 2, the cloud's manifest says round 4"; signed: "task for round 1, ... says round 0"),
    so a cell whose version fell behind, a restarted one at once, never got a result again. A versioned agent
    takes them; the replay window still refuses an older task."""
    cloud = CloudSession()
    cloud.on_status({"state": "online", "session": "s1", "started": 1.0})
    cloud.on_manifest({"session": "s1", "round": 4})
    d = _Unsigned(cloud=cloud, versioned=True)
    d.task(2, 0)  # behind the cloud's version
    d.task(9, 1)  # ahead of it
    d.task(3, 2)  # before the last task taken: a replay
    assert d.role.trained == [(2, 0), (9, 1)] and len(d.rejected) == 1 and "(replayed)" in d.rejected[0]
    rounds = _Unsigned(cloud=cloud)  # a round-based agent: the manifest bounds it
    rounds.task(2, 0)
    assert rounds.role.trained == [] and "stale task for round 3" in rounds.rejected[0]


def test_a_restarted_cells_task_gets_the_kept_result_again_never_a_second_training() -> None:
    """Unsigned, ``keep_answer`` (MQTT agents): the task of the last (round, edge round) again, under a new
    message id (a restarted cell re-sends the tasks whose results it had not journaled), gets the kept
    result message again, byte for byte, without training; at most ``REANSWERS`` times, then it is
    refused as a replay. An older task is still refused, and a new task replaces the kept result."""
    from edge_agent.agent import REANSWERS

    d = _Unsigned(keep_answer=True)
    role, rejected, task = d.role, d.rejected, d.task
    results: list[bytes] = []
    d.hub.connect("watch").subscribe(topics.device_result("r", "c0", "c0-d0"), lambda t, data: results.append(data))
    task(1, 0)
    for _ in range(REANSWERS + 1):
        task(1, 0)
    assert role.trained == [(1, 0)]
    assert len(results) == 1 + REANSWERS and len(set(results)) == 1
    assert len(rejected) == 1 and "(replayed)" in rejected[0]
    task(0, 5)
    assert "(replayed)" in rejected[-1] and len(results) == 1 + REANSWERS
    task(1, 1)
    task(1, 1)
    assert role.trained == [(1, 0), (1, 1)] and results[-1] == results[-2] != results[0]


def test_a_diverged_global_model_stops_the_run_with_a_record_not_a_crash(tmp_path: Path, caplog) -> None:
    """DeComFL at a far too large learning rate: the devices' scalars are finite, but the step they make
    overflows float32, so the global model's evaluation loss is NaN (as DeComFL at lr 0.01 on MNIST reached
    within its first minute). The cloud records the round without the non-finite numbers (``diverged`` says
    which), logs it, and ends the run there with that reason: it never raises (a record that refused the NaN
    loss once crashed the run) and never burns the remaining rounds."""
    cfg = small_config(
        tmp_path,
        run={"rounds": 30},
        algorithm={
            "name": "decomfl",
            "edge_rounds": 1,
            "local_steps": 1,
            "perturbations": 2,
            "lr": 1e30,
            "mu": 1e-3,
            "batch_size": 16,
        },
        model={"name": "mlp", "hidden": [8]},
        runtime={"eval_every": 1},
    )
    with caplog.at_level(logging.ERROR, logger="cloud.server"):
        result = SimHierarchy(cfg, write_output=False).run()
    last = result.history[-1]
    assert len(result.history) < 30 and result.status == "failed" and "global model diverged" in result.failed
    assert last["diverged"] and "loss" in last["diverged"] and "loss" not in last
    assert any("global model diverged" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_global_model_overflowed_by_a_lying_cell_fails_the_job_naming_that_cell(
    tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Cell c1 (a node with its credentials) reports an update of finite values near the float32 maximum: the global
    model overflows and the job fails. It said only "the global model diverged ... (a learning rate too large?)";
    now the failure names the cells of the aggregate that diverged, the largest update norms first (c1's), and
    points at robust aggregation (rounds) and revocation, as well as at the learning rate. The cloud's log says the
    job failed in the round whose close found it ("round 1/4 closed", then "fails in round 2": the count had moved
    on)."""
    algorithm = {"mode": "async", "async_buffer": 2, "edge_rounds": 1} if mode == "async" else {"edge_rounds": 1}
    cfg = small_config(
        tmp_path,
        run={"rounds": 4},
        algorithm=algorithm,
        runtime={"eval_every": 1},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
    )
    sim = SimHierarchy(cfg, write_output=False)
    cell = sim.cells["c1"]
    role = cell.fb if mode == "async" else cell.role
    honest = role.report

    def lying() -> Payload:
        out = honest()
        return Payload(out.meta, {k: np.full_like(v, 3e38) for k, v in out.tensors.items()})

    role.report = lying  # type: ignore[method-assign]
    result = sim.run()
    unit, at = (
        ("version", result.history[-1]["round"]) if mode == "async" else ("round", result.history[-1]["round"] + 1)
    )
    assert result.status == "failed" and result.failed.startswith(f"the global model diverged at {unit} {at} "), (
        result.failed  # (a round counted from 1 as people read it, a version by its number)
    )
    named = re.search(r"largest update norms of its \d+ cells?: (c\d) ([0-9.e+]+)", result.failed)
    assert named is not None and named[1] == "c1" and float(named[2]) > 3e38, result.failed
    assert ("robust aggregation leaves one out" if mode == "sync" else "revoke it") in result.failed, result.failed
    assert result.history[-1]["diverged"], result.history[-1]
    said = [r.getMessage() for r in caplog.records if "the job fails in round" in r.getMessage()]
    assert said and said[0].startswith(f"cloud: the job fails in round {result.history[-1]['round'] + 1}: "), said


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_global_model_overflowed_by_a_lying_device_fails_the_job_naming_that_device(
    tmp_path: Path, mode: str
) -> None:
    """Device c1-d2 (a node with its key) sends results of finite values near the float32 maximum: the global model
    overflows and the job fails (async: c1's model first, then the cloud's with its push). Its failure named the cells
    of the aggregate (c1, the largest), not the device: the operator would revoke an honest cell. Now each cell's
    report names its devices of the largest update norms (``largest_updates``, one BLAS pass a result), and the
    failure names c1-d2 beside c1."""
    algorithm = {"mode": "async", "async_buffer": 2, "edge_rounds": 1} if mode == "async" else {"edge_rounds": 1}
    cfg = small_config(
        tmp_path,
        run={"rounds": 10},
        algorithm=algorithm,
        runtime={"eval_every": 1},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
    )
    sim = SimHierarchy(cfg, write_output=False)
    configure = sim.agents.configure

    def compromised(agent) -> None:
        configure(agent)
        if agent.device == "c1-d2":
            genuine = agent.publish_result
            huge = lambda r: Payload(r.meta, {k: np.full_like(v, 3e38) for k, v in r.tensors.items()})  # noqa: E731
            agent.publish_result = lambda r, *a: genuine(huge(r), *a)

    sim.agents.configure = compromised
    result = sim.run()
    assert result.status == "failed" and "the global model diverged" in result.failed, result.failed
    named = re.search(
        r"largest update norms of its \d+ cells?: c1 [0-9.e+]+ \(its devices: (c1-d\d) ~1e\+(\d+)", result.failed
    )
    assert named is not None and named[1] == "c1-d2" and int(named[2]) >= 38, result.failed


def test_an_async_model_overflowed_between_evaluations_fails_the_job_at_that_version(tmp_path: Path) -> None:
    """Async, evaluated every 10 versions of 6 (the last only): cell c1 (a node with its credentials) pushes finite
    values near the float32 maximum, and the model's parameters overflow to inf at version 4. Divergence was caught on
    evaluated versions only: here at version 5, the last; in a job of 8 versions, never (the cells refused every later
    version as non-finite, pushed from ever staler ones, were resent the current one and refused it again: still
    running after 300 s). Now every version's parameters are checked (one pass of the model): the job fails at the
    version that overflowed, naming c1, and its record says which tensor."""
    cfg = small_config(
        tmp_path,
        run={"rounds": 6},
        algorithm={"mode": "async", "async_buffer": 2, "edge_rounds": 1},
        runtime={"eval_every": 10},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
    )
    sim = SimHierarchy(cfg, write_output=False)
    role = sim.cells["c1"].fb
    honest = role.report

    def lying() -> Payload:
        out = honest()
        return Payload(out.meta, {k: np.full_like(v, 3e38) for k, v in out.tensors.items()})

    role.report = lying  # type: ignore[method-assign]
    result = sim.run()
    last = result.history[-1]
    assert result.status == "failed" and len(result.history) < 6, (result.failed, len(result.history))
    assert result.failed.startswith(f"the global model diverged at version {last['round']} "), result.failed
    assert re.search(r"largest update norms of its \d+ cells?: c1 ", result.failed), result.failed
    assert "non-finite values" in last["diverged"] and "loss" not in last, last


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "fedavg"},
        {"name": "decomfl", "edge_rounds": 1, "local_steps": 2, "perturbations": 2, "lr": 0.01, "mu": 1e-3},
    ],
)
def test_a_run_in_which_every_device_diverges_fails_after_stalled_rounds(tmp_path: Path, algorithm, caplog) -> None:
    """Every device's inputs overflow float32: each answers "diverged" at once (DeComFL's non-finite ZO
    scalars too, which once made the device refuse its task, so the cell waited for the deadline and the
    run idled through every round). Cells close on "all answered" without rejections, the cloud's records
    count the diverged devices per cell, and after ``STALLED_ROUNDS`` such rounds in a row the cloud fails
    the run with that reason; the global model stays finite."""
    from protocols.divergence import STALLED_ROUNDS

    cfg = small_config(tmp_path, run={"rounds": 20}, algorithm=algorithm, model={"name": "mlp", "hidden": [8]})
    h = overflow_devices(SimHierarchy(cfg, write_output=False))
    with caplog.at_level(logging.WARNING):
        result = h.run()
    assert len(result.history) == STALLED_ROUNDS and result.status == "failed"
    assert result.failed == f"every device that answered failed or diverged (6 diverged) in rounds 1-{STALLED_ROUNDS}"
    for record in result.history:
        assert record["devices_diverged"] == {"c0": 3, "c1": 3} and not any(record["devices"].values())
    for record in result.cell_records:
        assert len(record["diverged"]) == 3 and record["closed_by"] == "all answered" and not record["rejected"]
    if algorithm["name"] == "decomfl":
        assert all("non-finite ZO scalars" in why for r in result.cell_records for why in r["diverged"].values())
    assert all(np.isfinite(v).all() for v in result.params.values())
    assert not [r for r in caplog.records if r.exc_info]


def test_a_run_stalls_only_when_every_answering_device_diverged(tmp_path: Path) -> None:
    """One diverging device in each round is not a stalled run: the others' results move the model."""
    cfg = small_config(tmp_path, run={"rounds": 5}, model={"name": "mlp", "hidden": [8]})
    h = overflow_devices(SimHierarchy(cfg, write_output=False), lambda device: device != "c0-d0")
    result = h.run()
    assert len(result.history) == 5 and result.status == "finished"
    assert [r["devices_diverged"] for r in result.history] == [{"c0": 2, "c1": 3}] * 5
    assert [r["devices"] for r in result.history] == [{"c0": 1, "c1": 0}] * 5


def test_a_resumed_cloud_keeps_counting_stalled_rounds(tmp_path: Path) -> None:
    """The stall count is in the cloud's checkpoint: a run ended after 2 all-diverged rounds (failed: none of its
    rounds made progress) and resumed for more rounds stops after the third, as the uninterrupted run does."""
    from protocols.divergence import STALLED_ROUNDS

    def run(rounds: int, resume: bool):
        cfg = small_config(tmp_path, run={"rounds": rounds}, model={"name": "mlp", "hidden": [8]})
        return overflow_devices(SimHierarchy(cfg, resume=resume)).run()

    first = run(STALLED_ROUNDS - 1, resume=False)
    assert len(first.history) == STALLED_ROUNDS - 1 and first.status == "failed"
    assert str(first.failed).endswith(f"(6 diverged) in rounds 1-{STALLED_ROUNDS - 1}")
    resumed = run(20, resume=True)
    assert [r["round"] for r in resumed.history] == [STALLED_ROUNDS - 1]
    assert resumed.failed and f"(6 diverged) in rounds 1-{STALLED_ROUNDS}" in resumed.failed


def test_a_lying_cell_cannot_have_another_cells_device_blamed_and_its_word_is_said_to_be_its() -> None:
    """Cell c0 (a node with its credentials) names devices of its largest updates (``largest_updates``): another
    cell's honest device c1-d0, which the operator would revoke on the failure's word, an id of no cell, junk, and
    one of its own. The cloud takes only c0's own device (the topology's ``cell_of``; none where no membership is
    known), at most 3 a cell, and the failure says the names are c0's report. Before, c1-d0 was named beside c0."""
    cell_of = {"c0-d0": "c0", "c0-d1": "c0", "c1-d0": "c1"}.get
    counts = RoundCounts()
    lying = {"c1-d0": 45, "c9-d9": 44, "c0-d1": 40, "x" * 10_000: 1, "c0-d0": True}
    counts.count("c0", 10, {"largest_updates": lying}, cell_of)
    counts.count("c0", 10, {"largest_updates": [1, 2, 3]}, cell_of)  # not a map: nothing, no crash
    counts.count("c1", 10, {"largest_updates": {f"c1-d{i}": 3 for i in range(100_000)}}, cell_of)
    assert counts.largest == {"c0": {"c0-d1": 40}, "c1": {"c1-d0": 3}}
    unknown = RoundCounts()
    unknown.count("c0", 10, {"largest_updates": {"c0-d1": 40}}, None)
    assert unknown.largest == {}
    said = blame([("c0", {"w": np.full(4, 1e38, np.float32)})], "round", counts.largest)
    assert "c0 2e+38 (its devices: c0-d1 ~1e+40, as c0 reports)" in said and "c1-d0" not in said, said


def test_an_async_model_huge_but_finite_fails_the_job_rather_than_its_devices_diverging_for_ever(
    tmp_path: Path,
) -> None:
    """Cell c1 (a node with its credentials) pushes once values of 1e30: finite (the cloud's check every version
    passes) but every device trained from the model diverges (a NaN loss), and none is evaluated (eval_every 100). An
    async cell sent each diverged device a task again at once: the job never ended (still running after 100 s, 43,000
    divergences logged). Now a cell whose devices answer STALLED_ROUNDS times each in a row with nothing usable on a
    cloud version fails, saying why, and the job fails with it (as the sync stall rule fails such a job)."""
    cfg = small_config(
        tmp_path,
        run={"rounds": 12},
        algorithm={"mode": "async", "async_buffer": 2, "edge_rounds": 1},
        runtime={"eval_every": 100},
        clock={"device_steps_per_s": 10.0, "latency_s": 0.01},
    )
    sim = SimHierarchy(cfg, write_output=False)
    role = sim.cells["c1"].fb
    honest, pushes = role.report, []

    def lying() -> Payload:
        out = honest()
        pushes.append(1)
        return (
            Payload(out.meta, {k: np.full_like(v, 1e30) for k, v in out.tensors.items()}) if len(pushes) == 2 else out
        )

    role.report = lying  # type: ignore[method-assign]
    result = sim.run()
    assert result.status == "failed" and "every device diverged or failed on cloud version" in result.failed, (
        result.failed
    )
