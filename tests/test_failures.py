"""Jobs that cannot make progress end as ``failed``, loudly: a summary with the reason, a non-zero exit.

Covered: a cloud whose cells never come, agents that fail every task (a model mismatch), an exception in
the cloud's and in a cell's handler (a bug) over MQTT, and the rule that a rejected message never fails a job.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_agent.runner import save_device_data
from protocols import runfiles
from protocols.config import load_config
from protocols.failures import StallWatch, count_reasons, guarded, merge_counts
from protocols.procs import popen
from protocols.trainer import LocalData
from protocols.transport.broker import EmbeddedBroker
from sim.hierarchy import prepare
from sim.launcher import SimHierarchy
from tests.conftest import small_config

FEDTIER = str(Path(sys.executable).parent / "fedtier")
JOB_FAILED = 3


def mismatched_devices(sim: Any) -> Any:
    """Give every device of ``sim`` data of the wrong shape (as an agent configured for another model):
    each task raises in the device's training."""
    configure = sim.agents.configure

    def wrong(agent: Any) -> None:
        configure(agent)
        agent.data = LocalData(np.zeros((len(agent.data), 5), np.float32), agent.data.y)

    sim.agents.configure = wrong
    return sim


# ------------------------------------------------------------------------------- the rule, alone
def test_stall_watch_counts_rounds_without_progress() -> None:
    watch = StallWatch(max_rounds=2)
    assert watch.observe(0, 0, 2, 0, {}, 0) is None  # no cell: 1 of 2
    assert watch.observe(1, 2, 2, 5, {}, 0) is None  # progress resets the count
    assert watch.observe(2, 2, 2, 0, {}, 0) is None  # cells answered, devices merely absent: not a stall
    assert watch.observe(3, 2, 2, 0, {"ValueError: x": 3}, 1) is None
    why = watch.observe(4, 0, 2, 0, {}, 0)
    assert why == "no cell answered in rounds 4-5"  # (rounds 3 and 4 as records count them)
    quorum = StallWatch(max_rounds=1, min_cells=2)
    assert quorum.observe(7, 1, 3, 4, {}, 0) == "fewer than 2 cells answered in round 8"
    assert StallWatch(max_rounds=1, min_cells=5).observe(0, 2, 2, 1, {}, 0) is None  # at most every cell
    assert StallWatch(max_rounds=1).observe(0, 0, 0, 0, {}, 0) is None  # participation let no cell take part
    assert StallWatch(max_rounds=1).observe(5, 2, 2, 0, {}, 0, offline=4) == (
        "no device online (4 taking part, every one offline) in round 6"
    )


def test_reason_counts_stay_bounded_whatever_devices_claim() -> None:
    counts = count_reasons({f"d{i}": f"made-up reason {i}" for i in range(100)}, limit=4)
    assert len(counts) == 5 and counts["other"] == 96 and sum(counts.values()) == 100
    into: dict[str, int] = {}
    merge_counts(into, {"a": 2, "b": -1, "c": True, "d" * 500: 1, 5: 3})
    merge_counts(into, "not a map")
    assert into == {"a": 2, "d" * 200: 1}
    merge_counts(into, {"e": 1, "f": 2, "a": 1}, limit=3)
    assert into == {"a": 3, "d" * 200: 1, "e": 1, "other": 2}


def test_guarded_logs_the_traceback_and_fails_with_the_reason(caplog: pytest.LogCaptureFixture) -> None:
    reasons: list[str] = []

    def handler(topic: str, data: bytes) -> None:
        raise TypeError("unsupported operand")

    guarded(handler, reasons.append, "cloud: report handler")("t", b"")
    assert reasons == ["cloud: report handler raised TypeError: unsupported operand"]
    assert any(r.exc_info and "report handler raised" in r.getMessage() for r in caplog.records)


def test_a_job_none_of_whose_rounds_made_progress_fails_at_its_end_however_few_its_rounds() -> None:
    """The last round of a job whose every round stalled fails it, before ``max_rounds``; a job that made
    progress once ends as before, its last rounds' stall under the count."""
    watch = StallWatch(max_rounds=3)
    assert watch.observe(0, 2, 2, 0, {"KeyError: 'lr'": 6}, 0) is None
    assert watch.observe(1, 2, 2, 0, {"KeyError: 'lr'": 6}, 0, last=True) == (
        "every device that answered failed or diverged (6 failed: KeyError: 'lr') in rounds 1-2"
    )
    progressed = StallWatch(max_rounds=3)
    assert progressed.observe(0, 2, 2, 6, {}, 0) is None
    assert progressed.observe(1, 2, 2, 0, {"KeyError: 'lr'": 6}, 0, last=True) is None


# ------------------------------------------------------------------------------- in memory
def test_a_short_job_whose_devices_all_fail_fails_rather_than_finishing(tmp_path: Path) -> None:
    """A 2-round job (fewer rounds than max_stalled_rounds, 3) whose every device fails every task: it
    "finished", exit 0, at its initial model (a researcher trying a broken plugin with --set run.rounds=2)."""
    cfg = small_config(tmp_path, run={"rounds": 2}, algorithm={"edge_rounds": 1, "local_steps": 2})
    result = mismatched_devices(SimHierarchy(cfg)).run()
    assert result.status == "failed" and len(result.history) == 2
    assert "every device that answered failed or diverged (6 failed: " in str(result.failed)
    assert str(result.failed).endswith("in rounds 1-2")


def test_a_job_whose_every_cell_report_is_refused_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cell sends a report the cloud refuses (a non-finite tensor: a broken cell role, or a lying cell): the
    job failed with 'no cell answered', though every cell did, and only the records' ``rejected`` said why."""
    from protocols.algorithms.fedavg import FedAvgCell

    report = FedAvgCell.report

    def poisoned(self: Any) -> Any:
        out = report(self)
        name = next(iter(out.tensors))
        return type(out)(out.meta, {**out.tensors, name: np.full_like(out.tensors[name], np.nan)})

    monkeypatch.setattr(FedAvgCell, "report", poisoned)
    cfg = small_config(tmp_path, run={"rounds": 2}, algorithm={"edge_rounds": 1, "local_steps": 2})
    result = SimHierarchy(cfg).run()
    assert result.status == "failed"
    assert result.failed == "no cell answered (messages refused: 2 non_finite) in rounds 1-2"


def test_a_role_whose_aggregate_returns_no_outcome_fails_the_job_naming_it(tmp_path: Path, monkeypatch) -> None:
    """A plugin's role returning its metrics as a dict, not an Outcome: the job failed with "'dict' object has no
    attribute 'epsilon'" (the cloud's) or "... 'with_metrics'" (a cell's), naming neither the role nor the fix."""
    from protocols.algorithms.fedavg import FedAvgCell

    monkeypatch.setattr(FedAvgCell, "aggregate", lambda self, edge_round, results: {"devices": len(results)})
    result = SimHierarchy(small_config(tmp_path, run={"rounds": 1}, algorithm={"local_steps": 1})).run()
    assert result.status == "failed"
    assert "TypeError: FedAvgCell.aggregate returned dict, not an Outcome (return protocols.algorithms" in result.failed


def test_agents_failing_every_task_fail_the_job_with_the_reasons_counted(tmp_path: Path) -> None:
    """Every device's task raises (data of another model's shape): each answers "failed" with the reason at
    once (cells close on "all answered", never on their deadline), records count the reasons, and after
    ``max_stalled_rounds`` rounds the job fails with them; the summary says so."""
    cfg = small_config(tmp_path, run={"rounds": 10}, runtime={"max_stalled_rounds": 2, "device_deadline": 600.0})
    result = mismatched_devices(SimHierarchy(cfg)).run()
    assert len(result.history) == 2 and result.status == "failed"
    assert "every device that answered failed or diverged (6 failed: " in result.failed
    assert result.failed.endswith("in rounds 1-2")
    last = result.history[-1]
    assert last["devices_failed"] == {"c0": 3, "c1": 3} and sum(last["failures"].values()) == 6
    assert last["failed"] == result.failed
    (reason,) = last["failures"]
    assert "shapes cannot be multiplied" in reason or "mat1" in reason
    for record in result.cell_records:
        assert record["closed_by"] == "all answered" and record["failed_counts"] == {reason: 3}
        assert not record["rejected"] and record["clock_s"] < 1.0  # virtual seconds: no deadline waited
    summary = json.loads((result.output_dir / runfiles.SUMMARY).read_text())
    assert summary["status"] == "failed" and summary["failed"] == result.failed


def test_devices_that_never_make_the_deadline_fail_the_job(tmp_path: Path) -> None:
    """Training takes 10 s on every device (the virtual clock: 10 steps at 1 step/s) and the device deadline
    is 5 s: every edge round closes on its deadline with nothing to aggregate. After ``max_stalled_rounds``
    such rounds the job fails and says why (it "finished" every round at the initial model's accuracy,
    exit 0, as `fedtier run --set runtime.device_deadline=0.01` did); a round with one device in time goes on."""
    cfg = small_config(tmp_path, run={"rounds": 6}, clock={"device_steps_per_s": 1.0})
    result = SimHierarchy(cfg).run()
    assert result.status == "failed" and [r["round"] for r in result.history] == [0, 1, 2]
    assert result.failed == "no device answered within the device deadline (6 tasked, every one late) in rounds 1-3"
    assert all(r["closed_by"] == "deadline" and not r["answered"] for r in result.cell_records)
    one_in_time = small_config(tmp_path / "b", run={"rounds": 4}, clock={"device_steps_per_s": 1.0})
    sim = SimHierarchy(one_in_time)
    sim.agents["c0-d0"].compute_delay = lambda device, payload: 0.0  # this one trains in no time
    assert sim.run().status == "finished"


def test_a_job_whose_every_device_went_offline_fails_instead_of_finishing(tmp_path: Path) -> None:
    """Walk-through: every agent of a running federation killed at round 30 of 400; each cell then closed its edge
    rounds at once with no device ("offline"), the cloud closed its rounds with nothing aggregated, and the job
    "finished" its 370 other rounds in 25 s, exit 0, at round 30's model. Rounds whose every device taking part
    is offline are a stall now: after ``max_stalled_rounds`` the job fails saying so. One device online goes on."""
    for online in ([], ["c1-d2"]):
        cfg = small_config(tmp_path / str(len(online)), run={"rounds": 8})
        cells: dict[str, Any] = {}

        def down(record: dict[str, Any], cells: dict[str, Any] = cells, online: list[str] = online) -> None:
            if record["round"] == 1:  # after round 1, every device but those ``online`` is down
                for cell in cells.values():
                    for d in list(cell.liveness.online):
                        cell.liveness.online[d] = d in online

        sim = SimHierarchy(cfg, write_output=False, on_round=down)
        cells.update(sim.cells)
        result = sim.run()
        if online:
            assert result.status == "finished" and len(result.history) == 8, result.failed
            continue
        assert result.status == "failed" and [r["round"] for r in result.history] == [0, 1, 2, 3, 4]
        assert result.failed == "no device online (6 taking part, every one offline) in rounds 3-5", result.failed


def test_a_job_whose_drawn_devices_are_offline_while_others_are_online_goes_on(tmp_path: Path) -> None:
    """Partial participation draws one device a round; the devices drawn in rounds 2-5 are offline, the others
    online (a fleet where some phones are off). Those rounds aggregate nothing, but the fleet is alive: no stall
    (the offline rule failed the job at round 4: 'no device online (1 taking part, every one offline)')."""
    cfg = small_config(tmp_path, run={"rounds": 6}, participation={"model": "uniform", "per_round": 1})
    from sim.hierarchy import participation

    drawn = {d for r in range(2, 6) for d in participation(cfg).participants(r)}
    assert len(drawn) < 6
    cells: dict[str, Any] = {}

    def down(record: dict[str, Any]) -> None:
        if record["round"] == 1:
            for cell in cells.values():
                for d in list(cell.liveness.online):
                    cell.liveness.online[d] = d not in drawn

    sim = SimHierarchy(cfg, write_output=False, on_round=down)
    cells.update(sim.cells)
    result = sim.run()
    assert result.status == "finished" and len(result.history) == 6, result.failed
    assert all(sum(r["devices"].values()) == 0 for r in result.history[2:6])  # nothing aggregated, yet no stall


def test_a_job_with_some_failing_devices_goes_on(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, run={"rounds": 4}, runtime={"max_stalled_rounds": 1})
    sim = SimHierarchy(cfg, write_output=False)
    configure = sim.agents.configure

    def one_wrong(agent: Any) -> None:
        configure(agent)
        if agent.device == "c0-d0":
            agent.data = LocalData(np.zeros((len(agent.data), 5), np.float32), agent.data.y)

    sim.agents.configure = one_wrong
    result = sim.run()
    assert result.status == "finished" and len(result.history) == 4
    assert [r["devices_failed"] for r in result.history] == [{"c0": 1}] * 4


# ------------------------------------------------------------------------------- over MQTT
def emulate(cfg: Any, monkeypatch: pytest.MonkeyPatch, cls: type, name: str, fn: Any) -> tuple[Any, float]:
    from sim.emulation import Emulation

    monkeypatch.setattr(cls, name, fn)
    t0 = time.monotonic()
    with EmbeddedBroker() as broker:
        result = Emulation(cfg, broker_url=broker.url, workers=1).run()
    return result, time.monotonic() - t0


def mqtt_config(tmp_path: Path) -> Any:
    return small_config(
        tmp_path,
        run={"rounds": 4},
        topology={"cells": 2, "devices_per_cell": 1},
        algorithm={"edge_rounds": 1, "local_steps": 2},
        runtime={"device_deadline": 300.0, "cell_deadline": 300.0, "startup_wait": 30.0, "heartbeat": 1.0},
    )


def test_an_exception_in_the_clouds_report_handler_fails_the_job(tmp_path: Path, monkeypatch) -> None:
    """The bug of the issue: a TypeError in the cloud's report handler left the round open (an emulation hung
    for more than 15 minutes). Now the job fails at once with the traceback logged and the reason."""
    from cloud.server import CloudServer

    def broken(self: Any, cell: str, msg: Any) -> int:
        raise TypeError("unsupported operand type(s) for +=: 'int' and 'str'")

    result, took = emulate(mqtt_config(tmp_path), monkeypatch, CloudServer, "_count", broken)
    assert result.status == "failed" and not result.history
    assert result.failed.startswith("cloud: report handler raised TypeError: unsupported operand")
    assert took < 120  # far from the 300 s deadlines
    assert json.loads((result.output_dir / runfiles.SUMMARY).read_text())["status"] == "failed"


def test_an_exception_in_a_cells_handler_fails_the_job(tmp_path: Path, monkeypatch) -> None:
    """A cell's aggregation raises in cell c1 only (a bug): c1 answers the round with a signed "failed" report
    and the cloud fails the job with c1's reason, instead of waiting out the cell deadline."""
    from cell_server.server import CellServer

    aggregate = CellServer._aggregate

    def broken(self: Any, why: str, results: dict, extra: Any = None) -> None:
        if self.cell == "c1":
            raise KeyError("weight")
        aggregate(self, why, results, extra)

    result, took = emulate(mqtt_config(tmp_path), monkeypatch, CellServer, "_aggregate", broken)
    assert result.status == "failed" and not result.history
    # raised where c1 aggregates: on the last result, or on a close it posted (both are c1's handlers)
    assert re.fullmatch(r"cell c1 failed in round 1: cell c1: .+ raised KeyError: 'weight'", result.failed)
    assert took < 120


def test_a_cloud_whose_cells_never_come_fails_with_a_non_zero_exit(tmp_path: Path) -> None:
    """``fedtier cloud`` alone (the cells' run name denied, or the cells down): it used to run every round alone
    and exit 0. Now it fails after ``max_stalled_rounds`` rounds, exit 3, the reason in summary.json."""
    config = tmp_path / "cloud.toml"
    config.write_text(
        f'[run]\nname = "lonely"\nrounds = 20\noutput = "{tmp_path / "out"}"\n'
        '[topology]\ncells = 2\ndevices_per_cell = 1\n[algorithm]\nname = "fedavg"\n'
        '[model]\nname = "mlp"\nhidden = [8]\n[data]\ndataset = "digits"\n'
        "[runtime]\nstartup_wait = 0.2\ncell_deadline = 0.2\nmax_stalled_rounds = 2\n"
    )
    from click.testing import CliRunner

    from fedtier.cli import main

    with EmbeddedBroker() as broker:  # the command in this process: no Python process to start and torch to import
        res = CliRunner().invoke(main, ["cloud", str(config), "--broker", broker.url, "--no-progress", "--insecure"])
    assert res.exit_code == JOB_FAILED, res.output
    assert "job failed: no cell answered in rounds 1-2" in " ".join(res.output.split())
    summary = json.loads((tmp_path / "out" / runfiles.SUMMARY).read_text())
    assert summary["status"] == "failed" and summary["failed"] == "no cell answered in rounds 1-2"
    metrics = [json.loads(line) for line in (tmp_path / "out" / runfiles.METRICS).read_text().splitlines()]
    assert [m["round"] for m in metrics] == [0, 1] and metrics[-1]["failed"] == summary["failed"]


def test_agents_of_another_model_fail_a_deployed_job(tmp_path: Path) -> None:
    """A deployed run whose agents were given another model (hidden = [16] against the cloud's [8]): each task
    raises on the device, the cell hears why at once, and the cloud fails the job with the reason counted
    (it used to "finish" at chance accuracy, exit 0)."""
    config = tmp_path / "deploy.toml"
    config.write_text(
        f'[run]\nname = "mismatch"\nrounds = 10\noutput = "{tmp_path / "out"}"\n'
        '[topology]\ncells = 1\ndevices_per_cell = 2\n[algorithm]\nname = "fedavg"\nedge_rounds = 1\n'
        'local_steps = 1\n[model]\nname = "mlp"\nhidden = [8]\n[data]\ndataset = "digits"\n'
        "[runtime]\ndevice_deadline = 300.0\nheartbeat = 1.0\nmax_stalled_rounds = 2\n"
    )
    cfg = load_config(config)
    prep = prepare(cfg)
    for device, data in prep.device_data.items():
        save_device_data(tmp_path / f"{device}.npz", data, prep.spec)
    with EmbeddedBroker() as broker:
        common = [str(config), "--broker", broker.url, "--insecure"]
        commands = {
            "cloud": [FEDTIER, "cloud", *common, "--no-progress"],
            "cell": [FEDTIER, "cell", *common, "--cell", "c0"],
            **{
                d: [
                    FEDTIER,
                    "agent",
                    *common,
                    "--device",
                    d,
                    "--data",
                    str(tmp_path / f"{d}.npz"),
                    "--set",
                    "model.hidden=[16]",
                ]
                for d in ("c0-d0", "c0-d1")
            },
        }
        procs = {n: popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n, c in commands.items()}
        try:
            outputs = {n: p.communicate(timeout=150)[0] for n, p in procs.items()}
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
    assert procs["cloud"].returncode == JOB_FAILED, outputs["cloud"]
    for name in ("cell", "c0-d0", "c0-d1"):  # the others leave when the job is over, as after a success
        assert procs[name].returncode == 0, f"{name}: {outputs[name]}"
    summary = json.loads((tmp_path / "out" / runfiles.SUMMARY).read_text())
    assert (
        summary["status"] == "failed"
        and "every device that answered failed or diverged (2 failed: " in summary["failed"]
    )
    metrics = [json.loads(line) for line in (tmp_path / "out" / runfiles.METRICS).read_text().splitlines()]
    assert all(m["devices_failed"] == {"c0": 2} and sum(m["failures"].values()) == 2 for m in metrics)


def test_a_failed_cell_is_left_out_when_the_job_must_not_depend_on_one_cell(tmp_path: Path) -> None:
    """runtime.fail_on_cell_failure = false (cells not all trusted: one with valid credentials must not end the
    job by saying it failed): c1's aggregation raises, its rounds answer "failed", the cloud leaves it out with
    the reason and goes on with c0."""
    cfg = small_config(tmp_path, run={"rounds": 3}, runtime={"fail_on_cell_failure": False})
    sim = SimHierarchy(cfg, write_output=False)
    c1 = sim.cells["c1"]

    def broken(*a: Any, **k: Any) -> None:
        raise KeyError("weight")

    c1._aggregate = broken  # type: ignore[method-assign]
    result = sim.run()
    assert result.status == "finished" and len(result.history) == 3
    for record in result.history:
        assert record["cells_reported"] == ["c0"] and record["closed_by"] == "all reported"
        assert record["cells_failed"] == {"c1": c1.failure} and "raised KeyError: 'weight'" in c1.failure


def test_fedtier_sim_exits_non_zero_when_the_job_fails(tmp_path: Path) -> None:
    """The one-shot commands say a failed job failed: the global model diverges (learning rate 1e30), so
    ``fedtier sim`` prints the reason and exits 3, with the reason in summary.json."""
    from click.testing import CliRunner

    from fedtier.cli import main

    config = tmp_path / "diverge.toml"
    config.write_text(
        f'[run]\nname = "d"\nrounds = 30\noutput = "{tmp_path / "out"}"\n[topology]\ncells = 2\ndevices_per_cell = 2\n'
        '[algorithm]\nname = "decomfl"\nedge_rounds = 1\nlocal_steps = 1\nperturbations = 2\nlr = 1e30\nmu = 1e-3\n'
        'batch_size = 16\n[model]\nname = "mlp"\nhidden = [8]\n[data]\ndataset = "digits"\n'
    )
    ran = CliRunner().invoke(main, ["sim", str(config), "--no-progress"])
    assert ran.exit_code == JOB_FAILED, ran.output
    said = " ".join(ran.output.split())
    assert "job failed: the global model diverged at round" in said
    summary = json.loads((tmp_path / "out" / runfiles.SUMMARY).read_text())
    assert summary["status"] == "failed" and summary["failed"].startswith("the global model diverged at round")
    # `fedtier monitor` on the folder says the job ended, failed (not a run still going, whose cells fall silent)
    shown = " ".join(CliRunner().invoke(main, ["monitor", str(tmp_path / "out"), "--once"]).output.split())
    assert "now failed: the global model diverged at round" in shown and "finished" not in shown, shown


def test_a_cloud_without_its_broker_connection_waits_it_out_and_the_job_goes_on(tmp_path: Path) -> None:
    """Walk-through (a provisioned fleet): the broker killed mid-job for 150 s, longer than 3 cell deadlines: every
    node reconnected when it came back, but the cloud had closed 3 rounds by their deadline meanwhile (no cell could
    report) and failed the job, 'no cell answered in rounds 5-7', of cells that were fine. In memory: nothing gets
    through for 5 cell deadlines from round 1's start, the cloud's connection down; the cloud closes no round while
    it is down, and the job finishes."""
    from protocols.transport.memory import MemoryTransport
    from sim.launcher import SimHierarchy

    sim = SimHierarchy(small_config(tmp_path, run={"rounds": 4}, topology={"cells": 1, "devices_per_cell": 2}))
    loop, deadline = sim.hub.loop, sim.cloud.cell_deadline
    outage: list[float] = []  # [start, end) in the hub's virtual seconds

    def down() -> bool:
        return bool(outage) and outage[0] <= loop.now() < outage[1]

    class CloudConnection(MemoryTransport):
        @property
        def connected(self) -> bool:
            return not down()

    sim.cloud.transport.__class__ = CloudConnection
    deliver = sim.hub._is_connected
    sim.hub._is_connected = lambda client: not down() and deliver(client)  # type: ignore[method-assign]
    begin = sim.cloud._begin_round

    def begin_round() -> None:
        if sim.cloud.round == 1 and not outage:
            outage.extend((loop.now(), loop.now() + 5 * deadline))
        begin()

    sim.cloud._begin_round = begin_round  # type: ignore[method-assign]
    result = sim.run()
    assert result.failed is None, result.failed
    closed = [(r["round"], r["closed_by"], r["clock_s"]) for r in result.history]  # (virtual seconds)
    assert closed[0][:2] == (0, "all reported") and closed[1][:2] == (1, "deadline") and len(closed) == 4, closed
    assert closed[1][2] == outage[1] and all(r[1] == "all reported" for r in closed[2:]), (closed, outage)


@pytest.mark.parametrize("runner", ["sim", "emulation"])
def test_what_a_callers_on_round_raises_is_raised_by_run_not_only_logged_as_the_jobs_failure(
    tmp_path: Path, runner: str
) -> None:
    """A caller's ``on_round`` that raises (a test's assertion) failed the job (the cloud's handler is guarded) and
    ``run()`` returned that failed result: a test that read nothing of it passed, its assertion lost (walking
    test_fleet_view). ``run()`` raises it now, after the job stopped at that round; a hook set on the sim's cloud
    directly counts too."""
    from sim.emulation import Emulation

    cfg = small_config(tmp_path, run={"rounds": 3}, topology={"cells": 1, "devices_per_cell": 2})
    seen: list[int] = []

    def check(record: dict[str, Any]) -> None:
        seen.append(record["round"])
        assert record["round"] < 1, "the caller's own assertion"

    with pytest.raises(AssertionError, match="the caller's own assertion"):
        if runner == "sim":
            sim = SimHierarchy(cfg, write_output=False)
            sim.cloud.on_round = check
            sim.run()
        else:
            with EmbeddedBroker() as broker:
                Emulation(cfg, broker_url=broker.url, on_round=check).run()
    assert seen == [0, 1]  # the job stopped there (failed), not run to its end
