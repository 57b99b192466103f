"""Telemetry records (schema), ``fedtier logs``, ``fedtier report`` and ``fedtier monitor``."""

from __future__ import annotations

import base64
import html
import io
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from conftest import FullDisk, small_config  # noqa: E402

from fedtier.cli import main  # noqa: E402
from fedtier.cmd_logs import filter_records, parse_round_range  # noqa: E402
from fedtier.console import INTERRUPTED  # noqa: E402
from monitor.report import load_run, participation_matrix, write_report  # noqa: E402
from monitor.sources import RunDirFollower, TelemetryFeed  # noqa: E402
from monitor.state import MAX_REVOKED_NAMED  # noqa: E402
from monitor.view import CellFilter, MonitorState, render_text  # noqa: E402
from protocols import runfiles  # noqa: E402
from protocols.records import CellRecord, RoundRecord, parse_record, read_records, read_run  # noqa: E402
from sim.launcher import SimHierarchy  # noqa: E402


def _run(tmp: Path, name: str, silent: str | None = None):
    cfg = small_config(
        tmp, run={"name": name, "rounds": 3, "output": str(tmp / name)}, data={"max_train": 600, "max_test": 200}
    )
    sim = SimHierarchy(cfg)
    if silent:  # it trains and never sends its result: its cell closes every edge round on the deadline
        sim.agents[silent].publish_result = lambda *a, **k: None
    return sim.run()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run A: c0-d1 never answers (5 s deadline on the virtual clock); run B: everyone answers."""
    tmp = tmp_path_factory.mktemp("runs")
    return _run(tmp, "silent", silent="c0-d1"), _run(tmp, "plain")


# ---------------------------------------------------------------------- schema
def test_run_files_round_trip_through_the_schema(runs):
    for result in runs:
        out = result.output_dir
        for name in (runfiles.AGGREGATION, runfiles.METRICS):
            raw = [json.loads(line) for line in (out / name).read_text().splitlines()]
            records, bad = read_records(out / name)
            assert bad == [] and len(records) == len(raw) > 0
            assert [r.to_dict() for r in records] == raw  # exactly what was written
            assert [parse_record(r.to_json()) for r in records] == records
        order = lambda r: (r["round"], r["edge_round"], r["cell"])  # noqa: E731
        assert sorted((json.loads(json.dumps(r)) for r in result.cell_records), key=order) == sorted(
            (json.loads(x) for x in (out / runfiles.AGGREGATION).read_text().splitlines()), key=order
        )
    silent = [CellRecord.model_validate(r) for r in runs[0].cell_records if r["cell"] == "c0"]
    assert len(silent) == 6 and all(r.absent == {"c0-d1": "deadline"} and r.closed_by == "deadline" for r in silent)
    assert all(r.clock_s == 5.0 and r.deadline_s == 5.0 and r.participation == 2 / 3 for r in silent)
    rounds = [RoundRecord.model_validate(r) for r in runs[0].history]
    assert [r.clock_s for r in rounds] == [10.0, 20.0, 30.0] and [r.clock_start_s for r in rounds] == [0, 10, 20]
    assert all(r.rounds == 3 and r.run == "silent" for r in rounds)


def test_bad_lines_are_reported_not_fatal(tmp_path):
    good = CellRecord(
        round=0,
        edge_round=0,
        cell="c0",
        algorithm="fedavg",
        planned=["a", "b"],
        answered=["a"],
        absent={"b": "deadline"},
        rejected=[{"device": "x", "reason": "bad shape"}],
        closed_by="deadline",
        bytes_in=10,
        bytes_out=20,
        duration_s=0.5,
        metrics={"anything": [1, 2]},
    )
    lines = [
        good.to_json(),
        "not json",
        json.dumps({**good.to_dict(), "schema": 99}),
        json.dumps({**good.to_dict(), "bytes_in": -1}),
        json.dumps({**good.to_dict(), "surprise": 1}),
        json.dumps({"schema": 1, "event": "party"}),
        "",
        good.to_json(),
        '{"schema":1,"ev',
    ]
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(lines))
    records, bad = read_records(path)
    assert records == [good, good]
    assert [b.line for b in bad] == [2, 3, 4, 5, 6, 9]
    assert "schema version 99" in bad[1].error and "bytes_in" in bad[2].error and "surprise" in bad[3].error
    assert records[0].rejected[0].device == "x" and records[0].metrics == {"anything": [1, 2]}
    # a round record accepts extra evaluation numbers, but only numbers
    assert parse_record(
        {"schema": 1, "event": "round", "round": 0, "closed_by": "x", "duration_s": 0, "f1": 0.5}
    ).model_extra == {"f1": 0.5}
    with pytest.raises(ValueError, match="f1"):
        parse_record({"schema": 1, "event": "round", "round": 0, "closed_by": "x", "duration_s": 0, "f1": "high"})


# ---------------------------------------------------------------------- logs
def test_round_ranges():
    """``--round`` counts from 1, as the table, the monitor and the report show rounds; it selects the records'
    0-based rounds."""
    assert parse_round_range("1:3") == (0, 2) and parse_round_range("2:") == (1, None)
    assert parse_round_range(":1") == (None, 0) and parse_round_range("4") == (3, 3)
    for bad in ("a:b", "3:1", "1:x", "-1", ":-2", "0", "0:2"):  # a negative round matched no record and said nothing
        with pytest.raises(ValueError):
            parse_round_range(bad)


def test_logs_filters(runs):
    out = runs[0].output_dir
    records, _ = read_run(out)
    chosen = filter_records(records, cells=["c1"], rounds=(1, 2), events=["aggregation"])
    assert [(r.round, r.edge_round, r.cell) for r in chosen] == [(1, 0, "c1"), (1, 1, "c1"), (2, 0, "c1"), (2, 1, "c1")]
    res = CliRunner().invoke(main, ["logs", str(out), "--round", "2:", "--cell", "c0", "--json"])
    assert res.exit_code == 0, res.output
    got = [json.loads(line) for line in res.stdout.splitlines()]
    raw = [
        json.loads(x)
        for name in (runfiles.AGGREGATION, runfiles.METRICS)
        for x in (out / name).read_text().splitlines()
    ]
    expected = [r for r in raw if r["round"] >= 1 and r.get("cell", "c0") == "c0"]
    key = lambda r: (r["round"], r["event"] == "round", r.get("edge_round", 0))  # noqa: E731
    assert got == sorted(expected, key=key) and len(got) == 6
    res = CliRunner().invoke(main, ["logs", str(out), "--event", "round"])
    assert res.exit_code == 0 and "3 of 15 records" in res.output and "c0-d1: deadline" not in res.stdout
    rows = [line.split("│")[1:3] for line in res.stdout.splitlines() if line.startswith("│")]
    assert [[x.strip() for x in row] for row in rows] == [["round", str(n)] for n in (1, 2, 3)], res.stdout
    res = CliRunner().invoke(main, ["logs", str(out), "--event", "aggregation", "--cell", "c0", "--round", "1"])
    assert "c0-d1: deadline" in res.stdout and "2 of 15 records" in res.output
    rows = [line.split("│")[2].strip() for line in res.stdout.splitlines() if line.startswith("│")]
    assert rows == ["1.1", "1.2"], res.stdout  # round 1's edge rounds, as the monitor numbers them
    assert CliRunner().invoke(main, ["logs", str(out), "--round", "3:1"]).exit_code == 2
    res = CliRunner().invoke(main, ["logs", str(out), "--round", "9"])  # walked: an empty table, and nothing of why
    assert res.exit_code == 0 and "0 of 15 records (the records' rounds: 1-3)" in res.output, res.output
    res = CliRunner().invoke(main, ["logs", str(out), "--cell", "c9"])  # walked: the same empty table, no word why
    assert res.exit_code == 0 and "0 of 15 records (no records of c9; the records' cells: c0, c1)" in res.output


# ---------------------------------------------------------------------- report
def test_report_plots_the_runs_data(runs, tmp_path):
    dirs = [r.output_dir for r in runs]
    html_path, plots = write_report(dirs, tmp_path / "rep" / "report.html")
    page = html_path.read_text()
    names = {p.name for p in plots}
    assert names == {
        "metrics_vs_round",
        "metrics_vs_bytes",
        "metrics_vs_time",
        "bytes_per_tier",
        "participation",
        "cell_durations",
    }
    for p in plots:
        png = (tmp_path / "rep" / "report_plots" / f"{p.name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and base64.b64encode(png).decode() in page
    by = {p.name: p for p in plots}
    for result in runs:
        label = f"{result.config.run.name} (fedavg)"
        acc = [r["accuracy"] for r in result.history]
        assert by["metrics_vs_round"].series[f"{label}/accuracy"] == ([1, 2, 3], acc)
        # the figure holds the very same lines
        ax_acc = by["metrics_vs_round"].figure.axes[0]
        line = next(ln for ln in ax_acc.lines if ln.get_label() == label)
        assert list(line.get_ydata()) == acc
        cum = [sum(r["cumulative_bytes"].values()) / 1e6 for r in result.history]
        assert by["metrics_vs_bytes"].series[f"{label}/loss"] == (cum, [r["loss"] for r in result.history])
        last = result.history[-1]["cumulative_bytes"]
        assert by["bytes_per_tier"].series[f"{label}/total_mb"][1] == [
            last[t] / 1e6 for t in ("cloud_to_cell", "cell_to_cloud", "cell_to_device", "device_to_cell")
        ]
        durations = [r["duration_s"] for r in result.cell_records if r["cell"] == "c1"]
        assert by["cell_durations"].series[f"{label}/c1"][1] == durations
    # only the run whose (virtual) clock moved is on the time axes: 2 edge rounds x 5 s deadline per round
    assert by["metrics_vs_time"].series["silent (fedavg)/accuracy"][0] == [10.0, 20.0, 30.0]
    assert not any(k.startswith("plain") for k in by["metrics_vs_time"].series)
    heat = by["participation"].series["silent (fedavg)"]
    assert heat["devices"] == ["c0-d0", "c0-d1", "c0-d2", "c1-d0", "c1-d1", "c1-d2"]
    expected = np.ones((6, 3))
    expected[1] = 0  # the silent device
    np.testing.assert_array_equal(heat["matrix"], expected)
    # CLI
    res = CliRunner().invoke(main, ["report", str(dirs[0])])
    assert res.exit_code == 0, res.output
    assert (dirs[0] / "report.html").exists() and (dirs[0] / "report_plots" / "participation.png").exists()


def test_report_that_cannot_be_written_says_so_without_a_traceback(runs, tmp_path):
    (tmp_path / "file").write_text("")  # --out under a file: was a FileNotFoundError/NotADirectoryError traceback
    res = CliRunner().invoke(main, ["report", str(runs[0].output_dir), "--out", str(tmp_path / "file" / "r.html")])
    assert res.exit_code == 1 and "cannot write the report" in res.output and res.exception.__class__ is SystemExit
    page = tmp_path / "report.html"  # a full disk: it left a page cut off where the disk filled (walked on a tmpfs)
    page.write_text("the report before")
    opened = Path.open

    def full(self: Path, *args: Any, **kwargs: Any) -> Any:
        f = opened(self, *args, **kwargs)
        writes = "w" in (args[0] if args else kwargs.get("mode", "r"))
        return FullDisk(f) if writes and self.name.startswith("report.html") else f

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "open", full)
        res = CliRunner().invoke(main, ["report", str(runs[0].output_dir), "--out", str(page)])
    assert res.exit_code == 1 and "No space left on device" in res.output, res.output
    assert page.read_text() == "the report before" and [p.name for p in tmp_path.glob("report.html*")] == [page.name]


def test_report_of_a_run_killed_while_writing_its_last_round_record(runs, tmp_path):
    """A run killed mid-write: metrics.jsonl ends in half a line, and the cells' records hold the aggregations of
    the round the cloud never closed. The report is written (it raised IndexError in the participation plot),
    the heatmap has that round's column from the cells' records, and the bad line is named on stderr."""
    run_dir = tmp_path / "killed"
    shutil.copytree(runs[1].output_dir, run_dir)
    metrics = run_dir / runfiles.METRICS
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    res = CliRunner().invoke(main, ["report", str(run_dir)])
    assert res.exit_code == 0, res.output
    assert "metrics.jsonl:2" in "".join(res.output.split()) and (run_dir / "report.html").exists()
    devices, _, matrix = participation_matrix(load_run(run_dir))
    assert matrix.shape == (6, 3) and (matrix == 1).all()  # every device answered every edge round of the 3


def test_a_cell_record_of_a_far_round_does_not_size_the_heatmap(runs, tmp_path):
    """A record of round 1e12 in the cells' records (a cell's, collected before the cloud checked rounds): the
    report's heatmap was devices x 1e12 (a MemoryError); it now stops at the cloud's rounds and the cells' rounds
    right after them, so the run's own 3 rounds are plotted."""
    run_dir = tmp_path / "far"
    shutil.copytree(runs[1].output_dir, run_dir)
    aggregation = run_dir / runfiles.AGGREGATION
    far = {**json.loads(aggregation.read_text().splitlines()[0]), "round": 10**12}
    with aggregation.open("a") as fh:
        fh.write(json.dumps(far) + "\n")
    devices, _, matrix = participation_matrix(load_run(run_dir))
    assert matrix.shape == (6, 3) and (matrix == 1).all()
    assert CliRunner().invoke(main, ["report", str(run_dir)]).exit_code == 0


def test_a_federation_jobs_folder_without_its_summary_ends_as_the_clouds_queue_says_in_report_and_monitor(
    runs, tmp_path
):
    """Walk-through: a fleet's cloud whose job folder became unwritable failed the job (its reason in jobs.json) but
    wrote no summary.json there: `fedtier report` of the folder plotted it like any finished job and `fedtier monitor
    --once` said nothing ended. Both now read the job's end from the cloud's queue next to the job folders; a job
    the queue does not list, or lists still running, reads as running, as before."""
    run_dir = tmp_path / "fed" / runfiles.JOB_FOLDERS / "j1"
    shutil.copytree(runs[1].output_dir, run_dir)
    (run_dir / runfiles.SUMMARY).unlink()
    why = "cannot write jobs/j1/summary.json: [Errno 30] Read-only file system"
    ended = [
        {"job": "j0", "state": "finished", "ended": 5.0},
        {"job": "j1", "state": "failed", "reason": why, "ended": 6.0},
    ]
    (tmp_path / "fed" / runfiles.JOBS).write_text(json.dumps({"format": 1, "jobs": ended}))
    res = CliRunner().invoke(main, ["report", str(run_dir)])
    assert res.exit_code == 0 and f"did not finish: failed: {why}" in " ".join(res.output.split()), res.output
    assert f"<td>failed: {html.escape(why)}</td>" in (run_dir / "report.html").read_text()
    assert [(s["phase"], s["reason"]) for s in RunDirFollower(run_dir).poll_states()] == [("failed", why)]
    (tmp_path / "fed" / runfiles.JOBS).write_text(
        json.dumps({"format": 1, "jobs": [{"job": "j1", "state": "running"}]})
    )
    assert RunDirFollower(run_dir).poll_states() == [] and load_run(run_dir).ended == "running"


def test_participation_matrix_counts_edge_rounds(runs):
    run = load_run(runs[1].output_dir)
    first = run.cells[0]
    first.answered = first.answered[:-1]  # one device missed one of the two edge rounds
    devices, cells, m = participation_matrix(run)
    assert cells == ["c0"] * 3 + ["c1"] * 3
    assert m[devices.index(first.planned[-1]), first.round] == 0.5 and m.sum() == 6 * 3 - 0.5


# ---------------------------------------------------------------------- monitor
def test_monitor_view_of_a_recorded_run(runs):
    records, bad = read_run(runs[0].output_dir)
    state = MonitorState()
    state.add_all(records, bad)
    last = max(r.time for r in records)
    text = render_text(state, now=last + 1)
    assert "fedtier monitor: silent" in text and "(2 cells)" in text
    rows = {m.group(1): line for line in text.splitlines() if (m := re.search(r"│ │ (c\d) ", line))}
    assert set(rows) >= {"c0", "c1"}
    # the cells' last records are round 2, edge round 1 counted from 0: shown from 1, as the cloud's "round 3/3"
    assert "2/3 (67%)" in rows["c0"] and "deadline" in rows["c0"] and " 3.2 " in rows["c0"] and " 3.2 " in rows["c1"]
    assert "3/3 (100%)" in rows["c1"] and "all answered" in rows["c1"]
    assert "round 3/3" in text and "finished" in text and "no alerts" in text
    assert f"{runs[0].history[-1]['accuracy']:.4f}" in text


def _cell(rnd: int, cell: str, answered: int, t: float, edge: int = 0) -> CellRecord:
    devices = [f"{cell}-d{i}" for i in range(4)]
    return CellRecord(
        run="live",
        round=rnd,
        edge_round=edge,
        cell=cell,
        algorithm="fedavg",
        planned=devices,
        answered=devices[:answered],
        absent={d: "deadline" for d in devices[answered:]},
        closed_by="quorum",
        duration_s=0.1,
        deadline_s=30.0,
        time=t,
    )


def test_monitor_alerts_silence_drop_lag_and_rejections():
    state = MonitorState()
    for rnd in range(4):
        state.add(_cell(rnd, "c0", 4, 100.0 + rnd))
        state.add(_cell(rnd, "c1", 4 if rnd < 3 else 1, 100.0 + rnd))
    state.add(_cell(1, "c2", 4, 60.0))  # fell behind, and quiet since t=60
    state.add(
        RoundRecord(
            run="live",
            round=2,
            rounds=10,
            closed_by="deadline",
            cells_planned=["c0", "c1", "c2"],
            cells_reported=["c0", "c1"],
            cells_absent=["c2"],
            duration_s=1.0,
            accuracy=0.5,
        )
    )
    rejected = _cell(3, "c0", 4, 103.5, edge=1).to_dict()
    state.add(CellRecord.model_validate({**rejected, "rejected": [{"device": "c0-d9", "reason": "NaN in w"}]}))
    alerts = state.alerts(now=104.0)
    assert "cell c2 silent for 44 s (deadline 30 s)" in alerts
    assert "cell c1 participation dropped to 25% (was 100% on average)" in alerts
    assert any("c0 rejected 1 result(s) in round 4.2: NaN in w" in a for a in alerts)  # (records: 3.1, from 0)
    assert any("cloud round 3 closed by deadline without c2" in a for a in alerts)  # (record: round 2)
    assert not any("c0 silent" in a or "c0 participation" in a for a in alerts)
    assert state.lag(state.cells["c2"]) == 2 and state.lag(state.cells["c0"]) == 0
    text = render_text(state, now=104.0)
    assert "SILENT" in text and "DROP" in text and "round 3/10" in text
    state.add_status("cell.c3", "offline", received=104.0)  # announced, never aggregated
    assert "c3" in render_text(state, now=104.0) and "cell c3 is offline" in state.alerts(104.0)


def test_the_late_answer_of_a_device_an_edge_round_closed_without_raises_no_alert():
    """A round closed at the quorum or the deadline refuses the late answers of the devices it did not wait for
    (stale), in the next record: expected, and the monitor alerted on them every round ('rejected 2 result(s)'),
    as for forged or broken results. A stale answer of a device that was not cut off, or another kind, alerts."""

    def stale(device: str, kind: str = "stale") -> dict:
        return {"device": device, "kind": kind, "reason": f"{kind} answer for round 0.0 (now 0.1)"}

    state = MonitorState()
    state.add(_cell(0, "c0", 2, 100.0))  # c0-d2 and c0-d3 cut off
    second = _cell(0, "c0", 4, 101.0, edge=1).to_dict()
    state.add(CellRecord.model_validate({**second, "rejected": [stale("c0-d2"), stale("c0-d3")]}))
    assert not [a for a in state.alerts(now=101.5) if "rejected" in a]
    state = MonitorState()
    state.add(_cell(0, "c0", 2, 100.0))
    state.add(CellRecord.model_validate({**second, "rejected": [stale("c0-d1"), stale("c0-d2", "signature")]}))
    assert any("c0 rejected 2 result(s) in round 1.2" in a for a in state.alerts(now=101.5))


def test_an_idle_cell_shows_idle_and_turns_offline_once_its_idle_heartbeat_is_missed():
    """A long-lived cell between jobs says idle: up, in no job, so neither offline nor silent. One whose idle
    record declares a heartbeat and then misses three of them (it died, its will lost) is offline."""
    state = MonitorState()
    state.add(_cell(0, "c0", 4, 100.0))  # a record of an earlier job (its deadline: 30 s)
    state.add_status("cell.c0", "idle", received=101.0, heartbeat=10.0)
    state.add_status("cell.c1", "idle", received=101.0)  # an older node: it declares no heartbeat
    state.add_status("cell.c2", "offline", received=101.0)
    states = lambda now: [state.state_of(state.cells[c], now) for c in ("c0", "c1", "c2")]  # noqa: E731
    assert states(130.0) == ["idle", "idle", "offline"]
    assert state.alerts(now=130.0) == ["cell c2 is offline"]  # c0: no silence alert past its deadline
    text = render_text(state, now=130.0)
    assert "idle" in text and "2 idle" in text, text
    assert states(131.5) == ["offline", "idle", "offline"]  # three heartbeats missed
    assert "cell c0 is offline (idle, its heartbeat missed)" in state.alerts(now=131.5)
    state.add_status("cell.c0", "idle", received=131.6, heartbeat=10.0)  # a heartbeat after all
    assert states(140.0)[0] == "idle"
    state.add_status("cell.c0", "online", received=141.0)  # serving a job again
    assert states(142.0)[0] == "ok"


def test_an_idle_cell_that_misses_its_heartbeats_is_offline_after_a_finished_job_too():
    """Cells are idle between jobs, that is after one finished (the cloud's retained state says so to any monitor
    started later): an idle cell that dies with its will lost still turns offline; a finished job's cells are
    not flagged for their silence."""
    state = MonitorState()
    state.add(_cell(0, "c0", 4, 100.0))
    state.add_state({"node": "cloud", "phase": "finished", "since": 100.5, "waiting": []})  # the last job ended
    assert state.finished
    state.add_status("cell.c0", "idle", received=101.0, heartbeat=10.0)
    state.add_status("cell.c1", "idle", received=101.0, heartbeat=10.0)
    state.add_status("cell.c1", "idle", received=125.0, heartbeat=10.0)  # c1 beats on; c0 died
    assert [state.state_of(state.cells[c], 130.0) for c in ("c0", "c1")] == ["idle", "idle"]
    assert [state.state_of(state.cells[c], 131.5) for c in ("c0", "c1")] == ["offline", "idle"]
    assert state.alerts(now=131.5) == ["cell c0 is offline (idle, its heartbeat missed)"]


def test_a_revoked_cell_shows_revoked_never_silent_offline_or_absent_and_a_revoked_device_is_named():
    """The cloud's round records name the cells the federation revoked (``cells_revoked``), a cell's records its
    devices absent as ``revoked``: the monitor shows such a cell revoked (not silent past its deadline, not
    offline by its last status, not behind, not in the round's missing cells) and names the revoked device."""
    state = MonitorState()
    for cell in ("c0", "c1", "c2"):
        state.add(_cell(0, cell, 4, 100.0))
    state.add_status("cell.c1", "offline", received=100.0)  # its will, or a stale retained status: either way
    revoked_device = _cell(1, "c0", 3, 120.0).to_dict() | {"absent": {"c0-d3": "revoked"}}
    state.add(CellRecord.model_validate(revoked_device))
    state.add(_cell(1, "c2", 4, 120.0))
    c1 = state.cells["c1"]
    assert state.state_of(c1, 140.5) == "offline" and "cell c1 is offline" in state.alerts(140.5)  # before
    state.add(
        RoundRecord(
            run="live",
            round=1,
            rounds=10,
            closed_by="all reported",
            cells_planned=["c0", "c1", "c2"],
            cells_reported=["c0", "c2"],
            cells_absent=["c1"],
            cells_revoked={"c1": "revoked (roster version 3)"},
            duration_s=1.0,
        )
    )
    alerts = state.alerts(now=140.5)
    assert [state.state_of(state.cells[c], 140.5) for c in ("c0", "c1", "c2")] == ["ok", "revoked", "ok"]
    assert "cell c1 revoked (roster version 3) by the federation: out of the job" in alerts
    assert "cell c0: device(s) c0-d3 revoked by the federation" in alerts
    assert not any("c1 silent" in a or "c1 is offline" in a or "without c1" in a for a in alerts), alerts
    assert state.lag(c1) is None
    text = render_text(state, now=140.5)
    assert "1 revoked" in text and "behind" not in text, text
    assert render_text(state, now=140.5, flt=CellFilter(states=("revoked",))).count("c1") >= 1


def test_a_cell_naming_new_revoked_devices_in_each_record_holds_a_bounded_part_of_the_monitors_memory():
    """A cell with its own key names 200 new ids as revoked in each of its records: the monitor kept the union of
    every record's (10,000 names after 50 records, without bound for a cell that never stops: a live monitor runs
    for days), and sorted it all at each frame. Now at most MAX_REVOKED_NAMED names, the alert saying "or more"."""
    state = MonitorState()
    for rnd in range(50):
        revoked = {f"ghost-{rnd}-{i:03d}": "revoked" for i in range(200)}
        state.add(CellRecord.model_validate(_cell(rnd, "c0", 4, 100.0 + rnd).to_dict() | {"absent": revoked}))
    assert len(state.cells["c0"].devices_revoked) == MAX_REVOKED_NAMED
    assert (
        "cell c0: device(s) ghost-0-000, ghost-0-001, ghost-0-002, ghost-0-003, ghost-0-004 (+995 or more) revoked"
        in ("\n".join(state.alerts(150.0)))
    )


def test_a_live_monitor_shows_a_cell_the_signed_roster_revoked_as_revoked_between_jobs():
    """Between jobs no round record says a cell was revoked, and its retained idle status stays on the broker: a
    monitor with the keys reads the cloud's signed roster and shows the cell revoked (whether its status or the
    roster comes first); a roster not signed by the cloud is a bad record and revokes nothing."""
    from rich.console import Console

    from monitor.live import LiveView
    from protocols.config import TopologySection
    from protocols.roster import Roster, roster_topic, sign_roster
    from protocols.status import idle_status
    from protocols.transport.memory import MemoryHub
    from protocols.wire import topics
    from protocols.wire.keys import PublicKeys, Trust, generate_keys

    ring = generate_keys(TopologySection(cells=3, devices_per_cell=1))
    trust = {n: Trust(n, ring.private[n], ring.public) for n in ("cloud", "c0", "c1", "c2")}
    roster = Roster.from_topology("fed", {f"c{i}": [f"c{i}-d0"] for i in range(3)}, ring.public, 100.0)
    hub = MemoryHub()
    feed = TelemetryFeed(hub.connect("monitor"), "fed", PublicKeys(ring.public)).start()
    node = hub.connect("nodes")
    for cell in ("c0", "c1"):
        topic = topics.status("fed", f"cell.{cell}")
        node.publish(topic, idle_status(topic, trust[cell]), retain=True)
    node.publish(roster_topic("fed"), sign_roster(roster.without("c0"), trust["c2"].sign), retain=True)  # forged
    hub.loop.run()
    view = LiveView(0.75, None, CellFilter(), Console(file=io.StringIO()))
    view.pull(feed)
    states = lambda: {c: view.state.state_of(v, time.time()) for c, v in view.state.cells.items()}  # noqa: E731
    assert (
        states() == {"c0": "idle", "c1": "idle"}
        and view.state.bad.last is not None
        and "roster refused" in view.state.bad.last.error
    )
    node.publish(roster_topic("fed"), sign_roster(roster.without("c1").without("c2"), trust["cloud"].sign))
    hub.loop.run()
    view.pull(feed)
    topic = topics.status("fed", "cell.c2")  # c2's status comes after the roster that revoked it
    node.publish(topic, idle_status(topic, trust["c2"]), retain=True)
    hub.loop.run()
    view.pull(feed)
    assert states() == {"c0": "idle", "c1": "revoked", "c2": "revoked"}
    assert "cell c1 revoked (roster version 3) by the federation: out of the job" in view.state.alerts(time.time())


def test_a_live_monitor_takes_a_new_jobs_records_that_came_with_its_start_in_one_pull():
    """Walked: `fedtier monitor --config config.toml --exit-when-done` started right after `fedtier submit` of a short
    job drew 'cloud finished after round 30/30 (ended before this monitor started ...)' and its cells 'last seen:
    never': during its first listen the broker handed the ended job's retained end state, then the new job's start,
    rounds, statuses and end, and the view took every record first and the states after, so the new job's start
    forgot the new job's own rounds and cells' sightings. They are taken in the order they came now."""
    from rich.console import Console

    from monitor.live import LiveView
    from protocols.state import publish_state
    from protocols.status import idle_status
    from protocols.transport.memory import MemoryHub
    from protocols.wire import topics
    from protocols.wire.signed import seal_record

    hub = MemoryHub()
    node = hub.connect("nodes")
    publish_state(node, "fed", "cloud", "finished", since=100.0, started=90.0, round=29, rounds=30)  # job A's, retained
    hub.loop.run()
    feed = TelemetryFeed(hub.connect("monitor"), "fed").start()
    publish_state(node, "fed", "cloud", "starting", since=130.0, started=130.0)  # job B
    status = topics.status("fed", "cell.c0")
    node.publish(status, idle_status(status, None), retain=True)
    for rnd in range(3):
        cloud, cell = topics.telemetry_cloud("fed"), topics.telemetry_cell("fed", "c0")
        node.publish(cell, seal_record(_cell(rnd, "c0", 4, 131.0 + rnd).to_dict() | {"run": "fed"}, cell, None))
        record = RoundRecord(
            run="fed", round=rnd, rounds=3, closed_by="all reported", cells_reported=["c0"], duration_s=0.1, time=131.0
        )
        node.publish(cloud, seal_record(record.to_dict(), cloud, None))
    publish_state(node, "fed", "cloud", "finished", since=134.0, started=130.0, round=2, rounds=3)
    hub.loop.run()
    view = LiveView(0.75, None, CellFilter(), Console(file=io.StringIO()))
    view.pull(feed)  # all of it at once, as after the first listen
    assert view.state.finished and view.state.cloud is not None and view.state.cloud.round == 2, view.state.cloud
    assert view.state.cells["c0"].last is not None and view.state.cells["c0"].last_seen is not None
    assert "ended before this monitor started" not in render_text(view.state, now=135.0)


def test_a_monitor_started_mid_job_says_the_rounds_it_did_not_see_closed():
    """Walked: `fedtier monitor --config config.toml --once` 20 s into a job said 'cloud: no round closed yet' above
    'now round 32: waiting for c1' (telemetry is not retained: it had seen no round record)."""
    state = MonitorState()
    state.add_state({"node": "cloud", "phase": "waiting", "since": 100.0, "round": 31, "waiting": ["c1"]})
    text = render_text(state, now=101.0)
    assert "cloud: 31 rounds closed before this monitor started" in text and "no round closed yet" not in text, text
    state.add_state({"node": "cloud", "phase": "waiting", "since": 100.0, "round": 0, "waiting": ["c1"]})
    assert "cloud: no round closed yet" in render_text(state, now=101.0)


def test_monitor_alerts_on_diverged_devices_and_a_diverged_global_model():
    state = MonitorState()
    state.add(_cell(0, "c0", 4, 100.0))
    assert not any("diverged" in a for a in state.alerts(now=100.5))
    record = _cell(0, "c0", 3, 101.0, edge=1).to_dict()
    state.add(CellRecord.model_validate({**record, "diverged": {"c0-d3": "meta loss (inf) is not finite"}}))
    state.add(
        RoundRecord(
            run="live",
            round=0,
            rounds=10,
            closed_by="all reported",
            cells_planned=["c0"],
            cells_reported=["c0"],
            duration_s=1.0,
            diverged="loss = nan",
        )
    )
    alerts = state.alerts(now=101.5)
    assert alerts[0] == "the global model diverged in round 1 (loss = nan)"
    assert "cell c0: 1 device(s) diverged in round 1.2: meta loss (inf) is not finite" in alerts


@pytest.mark.timeout(30)  # before: --exit-when-done waited for the end of a killed run for ever
def test_the_monitor_says_a_killed_run_stopped_and_exit_when_done_leaves(runs, tmp_path):
    """A ``fedtier sim`` killed with ``kill -9`` leaves its records, no summary and its run.lock, which nobody
    holds any more: the monitor says it stopped (before: its cells 'ok' until the 120 s device deadline passed,
    then 'silent', and --exit-when-done never left), and --exit-when-done leaves with the status of an interrupted
    run (130: --resume continues it), not 0. While a process holds the lock, the run goes on."""
    import fcntl

    run_dir = tmp_path / "killed"
    shutil.copytree(runs[1].output_dir, run_dir)
    (run_dir / runfiles.SUMMARY).unlink()
    lock = run_dir / runfiles.LOCK
    lock.write_text("12345")
    with lock.open() as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        res = CliRunner().invoke(main, ["monitor", str(run_dir), "--once", "--width", "200"])
        assert res.exit_code == 0 and "stopped" not in res.output, res.output
    res = CliRunner().invoke(main, ["monitor", str(run_dir), "--once", "--width", "200"])
    assert (
        res.exit_code == 0
        and "now stopped: the fedtier sim|run process ended before the run did (interrupted or killed)" in res.output
    ), res.output
    res = CliRunner().invoke(main, ["monitor", str(run_dir), "--exit-when-done", "--refresh", "0.05"])
    assert res.exit_code == INTERRUPTED and "stopped" in res.output  # (0: 'monitor && next-step' went on)


@pytest.mark.timeout(30)
def test_a_run_killed_before_its_first_round_closed_says_so(tmp_path):
    """A ``fedtier sim`` killed in its first round leaves cell records and no round record: the monitor said "cloud
    stopped after round None (ended before this monitor started: its rounds are in the cloud's run folder)", of the
    very run folder it read."""
    run_dir = tmp_path / "killed"
    run_dir.mkdir()
    (run_dir / runfiles.AGGREGATION).write_text("".join(_cell(0, c, 4, 100.0).to_json() + "\n" for c in ("c0", "c1")))
    (run_dir / runfiles.LOCK).write_text("12345")  # held by no process
    res = CliRunner().invoke(main, ["monitor", str(run_dir), "--once", "--width", "200"])
    said = " ".join(res.output.split())
    assert res.exit_code == 0 and "cloud stopped before its first round closed" in said, res.output
    assert "round None" not in said and "its rounds are in the cloud's run folder" not in said
    assert "now stopped: the fedtier sim|run process ended before the run did (interrupted or killed)" in said


@pytest.mark.timeout(30)
def test_exit_when_done_exits_3_when_the_run_failed(runs, tmp_path):
    """``fedtier monitor RUN --exit-when-done && next-step`` went on after a failed run: it left with 0."""
    run_dir = tmp_path / "failed"
    shutil.copytree(runs[1].output_dir, run_dir)
    summary = run_dir / runfiles.SUMMARY
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "status": "failed", "failed": "diverged"}))
    res = CliRunner().invoke(main, ["monitor", str(run_dir), "--exit-when-done", "--refresh", "0.05"])
    assert res.exit_code == 3 and "failed: diverged" in res.output, res.output
    res = CliRunner().invoke(main, ["monitor", str(runs[1].output_dir), "--exit-when-done", "--refresh", "0.05"])
    assert res.exit_code == 0, res.output


@pytest.mark.timeout(30)
def test_the_monitor_on_a_cells_own_job_folder_says_whose_it_is_and_how_the_job_ended(tmp_path):
    """``fedtier monitor runs/fed/jobs/JOB`` on a cell's (``fedtier cell --serve``) job folder: the cell's own records
    only, no cloud round record and no summary. It said "no round closed yet" and flagged the cell SILENT once its
    records were old, for a job long finished; it now says it is cell c0's folder, and how the cloud said the job
    ended (the cell's job record), and --exit-when-done leaves with that end's status."""
    folder = tmp_path / "jobs" / "B"
    folder.mkdir(parents=True)
    (folder / runfiles.AGGREGATION).write_text("".join(_cell(r, "c0", 4, 100.0 + r).to_json() + "\n" for r in range(3)))
    runfiles.write_cell_job(folder, "c0", "B", "running")
    res = CliRunner().invoke(main, ["monitor", str(folder), "--once", "--width", "200"])
    assert res.exit_code == 0 and "cell c0's job folder (job B)" in res.output, res.output
    assert "no round closed yet" not in res.output
    runfiles.write_cell_job(folder, "c0", "B", "failed", "diverged")
    res = CliRunner().invoke(main, ["monitor", str(folder), "--once", "--width", "200"])
    assert res.exit_code == 0 and "cell c0's job folder (job B)" in res.output and "failed: diverged" in res.output
    assert "silent" not in res.output.lower(), res.output  # its records are old: the job ended, the cell is not silent
    res = CliRunner().invoke(main, ["monitor", str(folder), "--exit-when-done", "--refresh", "0.05"])
    assert res.exit_code == 3, res.output
    res = CliRunner().invoke(main, ["report", str(folder)])  # it said "no cloud round records in metrics.jsonl"
    # the wrong folder given, exit 2 as for the federation's folder (it was 1: walking the fleet, the two differed)
    assert res.exit_code == 2 and "cell c0's job folder (job B)" in res.output, res.output
    federation = CliRunner().invoke(main, ["report", str(tmp_path)])  # the cell's output folder: its jobs/ in it
    assert federation.exit_code == 2 and "is a federation's folder, not a run's" in federation.output, federation.output
    (folder / runfiles.METRICS).write_text("")  # a folder the cloud writes to as well: a run folder, not a cell's
    assert RunDirFollower(folder).cell_folder() == []


def test_a_report_of_a_job_that_failed_before_its_first_round_says_how_it_ended(tmp_path):
    """Walked: `fedtier report runs/fed/jobs/job-n` of a job the cloud failed at once (its model not its held-out
    set's) said "no cloud round records in metrics.jsonl", a file the folder does not even have; its summary.json
    says why the job failed. The report says it now (exit 1 still: nothing to plot)."""
    folder = tmp_path / "job-n"
    folder.mkdir()
    why = "test.npz: samples of 1x8x8, but the job's model takes mnist: 1x28x28"
    (folder / runfiles.SUMMARY).write_text(
        json.dumps({"run": "fed", "job": "job-n", "status": "failed", "failed": why})
    )
    res = CliRunner().invoke(main, ["report", str(folder)])
    said = " ".join(res.output.split())
    assert (
        res.exit_code == 1 and f"no round to plot: the run ended before its first round closed (failed: {why})" in said
    )
    assert "no cloud round records" not in said, said
    # a summary.json whose reason is not text (hand-edited, another tool's) says how it ended, not a TypeError
    (folder / runfiles.SUMMARY).write_text(json.dumps({"status": "failed", "failed": {"why": 1}}))
    res = CliRunner().invoke(main, ["report", str(folder)])
    said = " ".join(res.output.split())
    assert res.exit_code == 1 and res.exc_info[0] is SystemExit, res.exc_info
    assert "no round to plot: the run ended before its first round closed (failed)" in said, said


def test_a_cells_job_record_that_cannot_be_replaced_leaves_the_last_one_whole_and_no_temporary_file(
    tmp_path, monkeypatch
):
    """The cell's job record is written as every state file (``write_durably``): a write that fails before its rename
    (a full disk, a rename refused) leaves the last record whole for the monitor, and no ``.tmp`` beside it."""
    runfiles.write_cell_job(tmp_path, "c0", "B", "running")

    def refuse(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError):
        runfiles.write_cell_job(tmp_path, "c0", "B", "finished")
    assert [(j["cell"], j["phase"]) for j in runfiles.cell_jobs(tmp_path)] == [("c0", "running")]
    assert sorted(p.name for p in tmp_path.iterdir()) == [runfiles.CELL_JOB.format(cell="c0")]


def test_run_dir_follower_tails_complete_lines(tmp_path):
    rec = [_cell(r, "c0", 4, float(r)).to_json() for r in range(3)]
    agg = tmp_path / runfiles.AGGREGATION
    agg.write_text(rec[0] + "\n" + rec[1][:20])
    follower = RunDirFollower(tmp_path)
    got, bad, _ = follower.poll()
    assert [r.round for r in got] == [0] and bad == []
    with agg.open("a") as fh:
        fh.write(rec[1][20:] + "\nbroken\n" + rec[2] + "\n")
    got, bad, _ = follower.poll()
    assert [r.round for r in got] == [1, 2] and [b.line for b in bad] == [3]
    assert follower.poll() == ([], [], [])
    assert follower.restarts == 0
    agg.write_text(rec[2] + "\n")  # a new run in the same folder
    assert [r.round for r in follower.poll()[0]] == [2] and follower.restarts == 1


def test_monitor_cli_once_on_a_run_dir(runs):
    res = CliRunner().invoke(main, ["monitor", str(runs[1].output_dir), "--once", "--width", "160"])
    assert res.exit_code == 0, res.output
    assert "fedtier monitor: plain" in res.stdout and "│ c0" in res.stdout and "│ c1" in res.stdout
    assert CliRunner().invoke(main, ["monitor", "--once"]).exit_code == 2


def test_monitor_follows_a_live_fedtier_run_over_mqtt(tmp_path):
    """``fedtier run`` (cloud, cells, an agent worker process, embedded broker): the telemetry the
    monitor's feed gets on an MqttTransport (what ``fedtier monitor --broker`` uses) is what the run
    logged, and the frame shows every cell."""
    from protocols.transport.broker import EmbeddedBroker
    from protocols.transport.mqtt import MqttTransport
    from protocols.transport.threadloop import ThreadLoop
    from sim.emulation import Emulation

    cfg = small_config(
        tmp_path,
        run={"name": "live", "rounds": 2, "output": str(tmp_path / "live")},
        data={"max_train": 400, "max_test": 100},
    )
    loop = ThreadLoop().start()
    with EmbeddedBroker() as broker:
        feed = TelemetryFeed(MqttTransport.from_url(broker.url, "monitor", loop).connect(), "live").start()
        assert feed.transport.wait_subscribed()
        result = Emulation(cfg, broker_url=broker.url, workers=1).run()
        expected = len(result.cell_records) + len(result.history)
        state = MonitorState()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            records, bad, statuses = feed.poll()
            state.add_all(records, bad, received=time.time())
            for node, s, *_ in statuses:
                state.add_status(node, s)
            if state_count(state) >= expected:
                break
            time.sleep(0.02)
        feed.close()
    loop.stop()
    assert state_count(state) == expected and len(state.bad) == 0
    assert state.cloud is not None and state.cloud.to_dict() == result.history[-1]
    text = render_text(state)
    for cell in ("c0", "c1"):
        assert re.search(rf"│ │ {cell} +│ +2\.2 │ 3/3 \(100%\)", text), text  # round 2 of 2, edge round 2 of 2
        assert state.cells[cell].last.to_dict() == [r for r in result.cell_records if r["cell"] == cell][-1]
    assert "round 2/2" in text and "finished" in text and "no alerts" in text


def state_count(state: MonitorState) -> int:
    return sum(v.records for v in state.cells.values()) + (state.cloud.round + 1 if state.cloud else 0)


def _fleet(cells: int = 1000) -> list[CellRecord | RoundRecord]:
    """Synthetic records of a 1,000-cell run at round 3: c0000-c0009 silent since t=10, c0010-c0019 with a
    participation drop, c0020-c0024 two rounds behind (and quiet, but not past their deadline)."""
    out: list[CellRecord | RoundRecord] = []
    for i in range(cells):
        cell = f"c{i:04d}"
        last = 1 if i < 10 or 20 <= i < 25 else 3
        for rnd in range(last + 1):
            t = 10.0 if i < 10 else 60.0 + rnd
            out.append(_cell(rnd, cell, 1 if 10 <= i < 20 and rnd == 3 else 4, t))
    out.append(
        RoundRecord(
            run="live",
            round=3,
            rounds=10,
            closed_by="deadline",
            cells_planned=[f"c{i:04d}" for i in range(cells)],
            cells_reported=[f"c{i:04d}" for i in range(25, cells)],
            cells_absent=[f"c{i:04d}" for i in range(25)],
            duration_s=1.0,
            accuracy=0.5,
        )
    )
    return out


def _rows(text: str) -> list[str]:
    return re.findall(r"│ (c\d{4}) ", text)


def test_monitor_stays_readable_at_a_thousand_cells():
    state = MonitorState()
    state.add_all(_fleet())
    now = 70.0
    text = render_text(state, now=now, width=160)
    assert "(1000 cells)" in text
    assert "cells 1000: 10 silent, 10 drop, 980 ok" in text
    assert "devices answered 3970/4000 (99%)" in text and "behind: 15 cells, up to 2 rounds" in text
    # 20 rows, the worst first: the silent cells, then the drops; the rest summed up in one row
    assert _rows(text) == [f"c{i:04d}" for i in range(20)]
    assert "... 980 more" in text
    assert len(text.splitlines()) < 45  # a frame, not a scroll of 1,000 rows
    alerts = state.alerts(now)
    assert len(alerts) == 3  # one line per kind, not one per cell
    assert alerts[0].startswith("10 cells silent: c0000, c0001, c0002, c0003, c0004, ... (worst: cell c0000 silent")
    assert alerts[1].startswith("10 cells with a participation drop: c0010")
    assert alerts[2] == ("cloud round 4 closed by deadline without c0000, c0001, c0002, c0003, c0004, ... (25 cells)")
    # top-N by lag, filters by state and by name
    by_lag = render_text(state, now=now, width=160, flt=CellFilter(top=5, sort="lag"))
    assert _rows(by_lag) == ["c0000", "c0001", "c0002", "c0003", "c0004"] and "... 995 more" in by_lag
    lag_only = render_text(state, now=now, width=160, flt=CellFilter(states=("ok",), sort="lag", top=5))
    assert _rows(lag_only) == ["c0020", "c0021", "c0022", "c0023", "c0024"]
    drops = render_text(state, now=now, width=160, flt=CellFilter(states=("drop",)))
    assert _rows(drops) == [f"c{i:04d}" for i in range(10, 20)] and "more" not in drops
    named = render_text(state, now=now, width=160, flt=CellFilter(patterns=("c099*", "c0005")))
    assert _rows(named) == ["c0005", *[f"c{i:04d}" for i in range(990, 1000)]]


def test_monitor_cli_filters_a_thousand_cell_run_dir(tmp_path):
    lines = [r.to_json() for r in _fleet()]
    (tmp_path / runfiles.AGGREGATION).write_text("\n".join(x for x in lines if '"aggregation"' in x) + "\n")
    (tmp_path / runfiles.METRICS).write_text("\n".join(x for x in lines if '"round"' in x) + "\n")
    res = CliRunner().invoke(
        main, ["monitor", str(tmp_path), "--once", "--width", "160", "--top", "3", "--sort", "drop", "--cell", "c001*"]
    )
    assert res.exit_code == 0, res.output
    assert _rows(res.stdout) == ["c0010", "c0011", "c0012"] and "... 7 more" in res.stdout
    res = CliRunner().invoke(main, ["monitor", str(tmp_path), "--once", "--state", "bogus"])
    assert res.exit_code == 2


def test_signed_telemetry_is_checked_by_a_monitor_with_the_keys(tmp_path):
    """A signed run signs its telemetry. A feed given the run's public keys (``fedtier monitor --keys``)
    takes every genuine record and rejects, as bad records saying why, an unsigned one, a genuine one
    moved to another cell's topic, and one altered after signing; a feed without keys reads the genuine
    records (the signature stripped) and cannot tell the forgeries."""
    from protocols.wire import topics
    from protocols.wire.keys import load_public_keys

    cfg = small_config(
        tmp_path,
        run={"name": "signed", "rounds": 2},
        data={"max_train": 400, "max_test": 100},
        security={"keys": "keys.toml"},
    )
    sim = SimHierarchy(cfg)
    keyed = TelemetryFeed(sim.hub.connect("monitor"), "signed", load_public_keys(sim.cfg.security.keys)).start()
    plain = TelemetryFeed(sim.hub.connect("monitor2"), "signed").start()
    sent: dict[str, list[bytes]] = {}
    sim.hub.connect("tap").subscribe(topics.telemetry_all("signed"), lambda t, d: sent.setdefault(t, []).append(d))
    result = sim.run()
    genuine = len(result.cell_records) + len(result.history)
    c0, c1 = topics.telemetry_cell("signed", "c0"), topics.telemetry_cell("signed", "c1")
    last = json.loads(sent[c0][-1])
    assert "sig" in last and all("sig" not in r for r in result.cell_records)  # the files stay unsigned
    altered = {**last, "loss_mean": 0.0}
    unsigned = {k: v for k, v in last.items() if k != "sig"}
    forger = sim.hub.connect("forger")
    for topic, data in ((c0, json.dumps(unsigned).encode()), (c0, sent[c1][-1]), (c0, json.dumps(altered).encode())):
        forger.publish(topic, data, qos=0)
    sim.hub.loop.run()
    records, bad, _ = keyed.poll()
    assert len(records) == genuine and [r.to_dict() for r in records if r.event == "round"] == result.history
    assert [b.error for b in bad] == [
        "rejected: unsigned record (the signature of 'c0' is required)",
        "rejected: bad signature: not signed by 'c0'",
        "rejected: bad signature: not signed by 'c0'",
    ]
    records, bad, _ = plain.poll()  # unsigned: c1's record on c0's topic is still refused, by its content
    assert len(records) == genuine + 2
    assert [b.error for b in bad] == [
        "record of cell 'c1' on telemetry/cell/c0: refused (its topic is fedtier/signed/telemetry/cell/c1)"
    ]
    assert [r.to_dict() for r in records[:genuine] if r.event == "round"] == result.history


def test_the_monitor_shows_record_text_as_it_is_never_as_markup():
    """Text from the network (a cell id, why an aggregation closed, the run) is escaped: rich markup in it is
    shown literally, and an unbalanced closing tag cannot break the frame."""
    state = MonitorState()
    evil = "[/bold] all [red]answered[link=http://x]"
    state.add_all(
        [
            CellRecord(
                run="[blink]r[/blink]",
                round=0,
                edge_round=0,
                cell="c0",
                algorithm="fedavg",
                planned=["c0-d0"],
                answered=["c0-d0"],
                closed_by=evil,
                duration_s=0.1,
                time=time.time(),
            )
        ]
    )
    text = render_text(state, width=240)
    assert evil in text and "[blink]r[/blink]" in text, text


def test_monitor_keys_option_checks(tmp_path):
    runner = CliRunner()
    out = runner.invoke(main, ["monitor", str(tmp_path), "--keys", "k.toml", "--once"])
    assert out.exit_code == 2 and "--keys" in out.output and "--broker" in out.output
    (tmp_path / "k.toml").write_text("not toml [")
    out = runner.invoke(
        main, ["monitor", "--broker", "mqtt://127.0.0.1:1", "--run", "r", "--keys", str(tmp_path / "k.toml"), "--once"]
    )
    assert out.exit_code == 2 and "not a readable TOML keys file" in " ".join(out.output.split())


def test_a_monitor_left_open_on_a_killed_run_shows_it_running_again_once_it_is_resumed(runs, tmp_path):
    """``fedtier monitor RUN`` open on a killed run said 'stopped' (right) and kept saying it after
    ``fedtier sim --resume`` took the run.lock again and wrote new records: the end state was sticky."""
    import fcntl

    from rich.console import Console

    from monitor.live import LiveView

    run_dir = tmp_path / "resumed"
    shutil.copytree(runs[1].output_dir, run_dir)
    (run_dir / runfiles.SUMMARY).unlink()
    metrics = run_dir / runfiles.METRICS
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text(lines[0])  # killed after round 1 of 3
    lock = run_dir / runfiles.LOCK
    lock.write_text("12345")
    view = LiveView(0.5, None, CellFilter(), Console(file=io.StringIO()))
    feed = RunDirFollower(run_dir)
    view.pull(feed)
    assert view.state.finished and "stopped" in render_text(view.state, now=time.time())
    with lock.open() as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the resumed run holds it, and writes round 2
        with metrics.open("a") as fh:
            fh.write(lines[1])
        view.pull(feed)
        text = render_text(view.state, now=time.time())
        assert not view.state.finished and "stopped" not in text and "round 2/3" in text, text
    view.pull(feed)  # killed again: stopped again
    assert view.state.finished and "stopped" in render_text(view.state, now=time.time())


def test_a_rejection_of_kind_late_raises_no_monitor_alert_whatever_the_record_before():
    """The cells name late answers 'late' now: the monitor needs no record before to know them (a monitor started
    mid-run has none); a stale answer without that record still alerts."""
    record = _cell(0, "c0", 4, 101.0, edge=1).to_dict()
    late = {"device": "c0-d2", "kind": "late", "reason": "late answer of device c0-d2 for round 0.0"}
    state = MonitorState()
    state.add(CellRecord.model_validate({**record, "rejected": [late]}))
    assert not [a for a in state.alerts(now=101.5) if "rejected" in a]
    state = MonitorState()
    state.add(CellRecord.model_validate({**record, "rejected": [{**late, "kind": "stale"}]}))
    assert any("c0 rejected 1 result(s) in round 1.2" in a for a in state.alerts(now=101.5))


@pytest.mark.timeout(60)
def test_a_monitor_whose_output_is_no_terminal_logs_each_round_as_it_comes_flushed(runs, tmp_path):
    """``fedtier monitor RUN > log.txt`` (or ``| tee``, a systemd unit's journal, a CI job) wrote nothing until it
    ended: rich's live display draws only on a terminal. There it logs a stamped line per change, flushed at once
    (read back here from the file on disk while the monitor follows), and the last frame when it leaves."""
    import threading

    from conftest import wait_until

    from monitor.live import LiveView
    from protocols.terminal import SafeConsole

    run_dir = tmp_path / "going"
    shutil.copytree(runs[1].output_dir, run_dir)
    for done in (runfiles.SUMMARY, runfiles.LOCK):
        (run_dir / done).unlink(missing_ok=True)
    metrics = run_dir / runfiles.METRICS
    rounds = metrics.read_text().splitlines(keepends=True)
    metrics.write_text(rounds[0])
    log = tmp_path / "log.txt"
    with log.open("w", buffering=1 << 16) as out:
        view = LiveView(0.75, None, CellFilter(), SafeConsole(file=out))
        follow = threading.Thread(
            target=view.follow, args=(RunDirFollower(run_dir), False, 1.0, 0.05, True), daemon=True
        )
        follow.start()
        try:
            assert wait_until(lambda: "cloud round 1/3 closed" in log.read_text(), 20), log.read_text()
            with metrics.open("a") as fh:
                fh.writelines(rounds[1:])  # the last round: --exit-when-done leaves
        finally:
            follow.join(20)
    said = log.read_text()
    assert not follow.is_alive() and "cloud round 3/3 closed" in said and "finished" in said, said
    first = next(line for line in said.splitlines() if "cloud round 1/3" in line)
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d cloud round 1/3 closed \(all reported\), accuracy", first), said
    assert said.count("cloud round 1/3 closed") == 1 and "╭─ fedtier monitor: plain" in said  # once; the frame last


def test_a_monitor_logging_off_a_terminal_waits_for_the_brokers_retained_records_before_its_first_lines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Walk-through (deploy-fleet.md step 5, `fedtier monitor --config config.toml > log`, between jobs): its first
    stamped lines said `fed (0 cells)`, `cloud: no round closed yet`, `cells 0: none`, a second before the retained
    records came and it said the job had finished and both cells were idle. It now listens for them (`--wait`) first."""
    from types import SimpleNamespace

    from rich.console import Console

    import monitor.live
    from monitor.live import LiveView
    from protocols.status import idle_status
    from protocols.transport.memory import MemoryHub
    from protocols.transport.threadloop import ThreadLoop
    from protocols.wire import topics

    loop = ThreadLoop("hub").start()
    hub = MemoryHub(loop=loop)  # type: ignore[arg-type]
    node = hub.connect("nodes")

    def retained() -> None:  # reaching the monitor a little after it subscribed (a broker's latency)
        for cell in ("c0", "c1"):
            topic = topics.status("fed", f"cell.{cell}")
            node.publish(topic, idle_status(topic, None), retain=True)

    loop.call_later(0.2, retained)
    feed = TelemetryFeed(hub.connect("monitor"), "fed").start()

    def interrupt(_: float) -> None:  # Ctrl-C after the first lines
        raise KeyboardInterrupt

    monkeypatch.setattr(monitor.live, "time", SimpleNamespace(sleep=interrupt, time=time.time))  # its loop's sleep only
    out = io.StringIO()
    try:
        # (--wait 2: the records came 0.2 s late, then 1 s of quiet; a 0.5 s wait was too short on a busy machine)
        LiveView(0.75, None, CellFilter(), Console(file=out, width=120)).follow(feed, False, 2.0, 0.05, False)
    finally:
        loop.stop()
    first = out.getvalue().split("╭")[0]  # the lines logged, before the last frame
    # "(0 cells)", not "0 cells": a line stamped at hh:mm:s0 reads "...:20 cells 2: 2 idle"
    assert "(2 cells)" in first and "2 idle" in first and "(0 cells)" not in first, out.getvalue()


def test_a_live_monitor_says_when_its_own_broker_connection_is_lost_and_when_it_is_back():
    """Walked: the broker of a `fedtier run` stopped for 15 s under `fedtier monitor --broker URL > log`: the log said
    "cells 2: 2 offline" and "! cell c0 is offline" (the cells' wills, sent as the broker went away), nothing about the
    monitor's own connection but a transport warning on stderr, and the frame showed the cells as if heard live. Now
    the frame and the log say the connection is lost, the view as last heard, and the log says when it is back."""
    from rich.console import Console

    from monitor.live import LiveView
    from monitor.log_lines import LineLog

    class Link:  # the transport's side the feed uses: subscriptions, and whether it is connected
        connected = True

        def subscribe(self, *_: object, **__: object) -> None:
            pass

    link, out = Link(), io.StringIO()
    feed = TelemetryFeed(link, "live").start()  # type: ignore[arg-type]
    view, lines = LiveView(0.75, None, CellFilter(), Console(file=io.StringIO())), LineLog(Console(file=out, width=200))
    said = []
    for connected in (True, False, False, True):
        link.connected = connected
        view.pull(feed)
        lines.update(view.state, now=100.0)
        said.append(" ".join(render_text(view.state, now=view.state.link_lost or 0.0).split()))
    log = out.getvalue()
    assert "broker" not in said[0] and "broker" not in log.split("\n")[0], said[0]
    lost = "broker connection lost 0 s ago, reconnecting: the cells and rounds below are as last heard"
    assert lost in said[1] and lost in said[2], said[1]
    assert "broker" not in said[3], said[3]  # back: the frame is as it was
    assert log.count("broker connection lost, reconnecting") == 1 and log.count("broker connection back") == 1, log
    assert view.state.link_losses == 1


def test_the_cloud_between_two_rounds_is_shown_between_rounds_not_idle():
    """Walked: `fedtier monitor --broker URL > log` of a `fedtier run` logged "now idle" in the middle of the job
    (the cloud's state from a round's close to the next round's start), which reads as a cloud out of the job."""
    from monitor.log_lines import log_lines

    state = MonitorState()
    state.add_state({"node": "cloud", "phase": "idle", "since": 100.0, "round": 6})
    text = " ".join(render_text(state, now=102.0).split())
    assert "now between rounds for 2 s" in text and "idle" not in text, text
    assert log_lines(state, 102.0)["now"] == "now between rounds"


def test_a_monitor_logging_off_a_terminal_writes_its_last_frame_when_terminated(runs, tmp_path):
    """Walked: `fedtier monitor RUN > log` stopped by SIGTERM (`kill`, `systemctl stop`, a CI job's timeout) died with
    nothing more said; only Ctrl-C wrote the last frame the docs promise "when it leaves"."""
    import signal
    import subprocess
    import sys

    from conftest import wait_until

    from protocols.procs import popen

    log = tmp_path / "log.txt"
    cmd = [str(Path(sys.executable).parent / "fedtier"), "monitor", str(runs[1].output_dir), "--refresh", "0.05"]
    with log.open("w") as out:
        proc = popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: "cloud round 3/3 closed" in log.read_text(), 60), log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        proc.kill()
    said = log.read_text()
    assert said.rstrip().endswith("╰───────────╯") and "╭─ fedtier monitor: plain" in said, said


def test_a_dead_cell_is_offline_and_the_live_cell_waiting_on_the_cloud_is_not_silent():
    """Walked: `fedtier cloud`, two `fedtier cell`s and their agents over one broker, `fedtier monitor --broker` beside
    them, cell c1 killed (-9): 20 s later the log said "cells 2: 2 silent", "! cell c0 silent for 20 s" (c0 had sent
    its report and waited for the cloud's next round, which waited for c1), "! cell c1 silent" beside "! cell c1 is
    offline", and "! cell c1 edge round 31.1 open for 20 s, past its 20 s deadline, waiting for c1-d0" (the dead
    cell's last retained state blamed its device). Every round the cloud waited for c1, c0 was flagged again."""
    state = MonitorState()
    for cell in ("c0", "c1"):
        state.add(_cell(30, cell, 2, 100.0))  # (deadline_s 30)
        state.add_state({"node": f"cell.{cell}", "phase": "idle", "since": 100.0, "round": 30})
    state.add_state(
        {"node": "cell.c1", "phase": "waiting", "since": 101.0, "round": 31, "edge_round": 0, "deadline_s": 20.0}
        | {"waiting": ["c1-d0"]}
    )
    state.add_status("cell.c1", "offline", received=101.5)  # its will
    now = 140.0
    assert [state.state_of(state.cells[c], now) for c in ("c0", "c1")] == ["ok", "offline"]
    assert state.alerts(now) == ["cell c1 is offline"], state.alerts(now)
    state.add_state({"node": "cell.c0", "phase": "waiting", "since": 101.0, "round": 31, "edge_round": 0})
    assert state.state_of(state.cells["c0"], now) == "silent"  # in an edge round and quiet: silent, as before


def test_a_cells_offline_status_is_no_sighting():
    """Walked: `fedtier monitor --broker URL --run quickstart --once` 33 s after a `fedtier run` ended showed its cells
    `ended`, "last seen 0.0 s ago": the cells' retained offline statuses counted as seeing them at the monitor's start.
    """
    state = MonitorState()
    state.add_state({"node": "cloud", "phase": "finished", "since": 100.0, "started": 90.0, "round": 1, "rounds": 2})
    state.add_status("cell.c0", "offline", received=133.0)
    assert state.cells["c0"].last_seen is None
    row = next(line for line in render_text(state, now=133.0).splitlines() if "c0" in line)
    assert "never" in row and "ended" in row and "s ago" not in row, row
    state.add_status("cell.c1", "online", received=133.0)  # a node that says it is up was seen
    assert state.cells["c1"].last_seen == 133.0


def test_a_cell_gone_after_its_job_ended_is_ended_not_ok():
    """Walked: `fedtier monitor --broker URL > log` of a `fedtier run` logged at its end "cells 2: 2 idle", then
    "cells 2: 2 ok" (the cells' offline statuses as the run's process closed them) and stayed so: a monitor started
    a moment later showed the same cells `ended`."""
    state = MonitorState()
    for cell in ("c0", "c1"):
        state.add(_cell(1, cell, 4, 100.0))
        state.add_status(f"cell.{cell}", "idle", received=101.0, heartbeat=10.0)
    state.add_state({"node": "cloud", "phase": "finished", "since": 101.0, "started": 90.0, "round": 1, "rounds": 2})
    assert [state.state_of(state.cells[c], 102.0) for c in ("c0", "c1")] == ["idle", "idle"]
    state.add_status("cell.c0", "offline", received=102.0)
    assert [state.state_of(state.cells[c], 102.5) for c in ("c0", "c1")] == ["ended", "idle"]
    assert "cells 2: 1 idle, 1 ended" in render_text(state, now=102.5)


def test_a_logging_monitor_says_which_rounds_closed_between_two_of_its_lines():
    """Walked: a logging monitor beside a deployment closing two rounds a second logged 28 of its 40 rounds
    (3, 4, 6, 8, 9, ...: it looks every --refresh), and nothing said rounds were left out."""
    from rich.console import Console

    from monitor.log_lines import LineLog

    out = io.StringIO()
    lines, state = LineLog(Console(file=out, width=300)), MonitorState()
    first = RoundRecord(run="r", round=0, rounds=10, closed_by="all reported", duration_s=0.1, accuracy=0.5)
    for batch in ((0,), (1, 2, 3), (4,), (6,)):
        for rnd in batch:
            state.add(first.model_copy(update={"round": rnd}))
        lines.update(state, now=100.0)
    said = [line for line in out.getvalue().splitlines() if "cloud round" in line]
    assert len(said) == 4 and all("closed since" not in line for line in said[::2]), said
    assert said[1].endswith("(rounds 2-3 closed since the line before: every round is in the run folder)"), said
    assert "cloud round 4/10" in said[1] and "cloud round 7/10" in said[3], said
    assert said[3].endswith("(round 6 closed since the line before: every round is in the run folder)"), said


def _dead_mid_run(status: bool) -> MonitorState:
    """c0 and c1 in a 4-round job; c1's records stop after round 1 (died), the cloud closes rounds 2-3 without it;
    ``status``: its will said offline, and the cloud plans it no more in round 3 (as walked: offline for a cell
    deadline)."""
    state = MonitorState()
    for rnd in range(4):
        state.add(_cell(rnd, "c0", 4, 100.0 + rnd))
        if rnd < 2:
            state.add(_cell(rnd, "c1", 4, 100.0 + rnd))
        elif rnd == 2 and status:
            state.add_status("cell.c1", "offline", received=102.0)  # its will
        unplanned = status and rnd == 3
        state.add(
            RoundRecord(
                run="live",
                round=rnd,
                rounds=4,
                closed_by="deadline" if rnd >= 2 and not unplanned else "all reported",
                cells_planned=["c0"] if unplanned else ["c0", "c1"],
                cells_reported=["c0"] if rnd >= 2 else ["c0", "c1"],
                cells_absent=["c1"] if rnd >= 2 and not unplanned else [],
                duration_s=1.0,
                time=100.5 + rnd,
            )
        )
    return state


def test_a_cell_dead_mid_run_is_silent_or_offline_once_the_run_finished_not_ok():
    """A cell that died in round 3 of 4 showed `ok` once the run finished (a run folder: no statuses), or `ended` (its
    will said offline), as if it had stopped with the job; only the cloud's 'closed without c1' told otherwise, and
    not even that once the cloud no longer planned it (walked: 'cells 2: 2 ended', 'no alerts')."""
    folder = _dead_mid_run(status=False)
    assert folder.finished and folder.state_of(folder.cells["c1"], 200.0) == "silent"
    assert "cell c1 silent: it dropped out before the job's end (its last record: round 2.1)" in folder.alerts(200.0)
    assert folder.state_of(folder.cells["c0"], 200.0) == "ok"  # it took part to the end
    live = _dead_mid_run(status=True)
    assert live.state_of(live.cells["c1"], 200.0) == "offline"
    assert "cell c1 is offline: it dropped out before the job's end (its last record: round 2.1)" in live.alerts(200.0)
    assert "cells 2: 1 offline, 1 ok" in render_text(live, now=200.0)
    versions = MonitorState()  # asynchronous: a cell's records count its own model versions, behind by design
    versions.add(_cell(1, "c1", 4, 100.0))
    versions.add(RoundRecord(run="live", round=5, rounds=6, closed_by="buffer full", duration_s=1.0, time=101.0))
    assert versions.finished and versions.state_of(versions.cells["c1"], 200.0) == "ok"


def test_cells_that_cell_level_participation_took_in_turn_are_not_flagged_as_dropped_out_at_the_end():
    """examples/amplified.toml (participation.level = "cell", cyclic: one cell a round, in turn): once the run
    finished, every cell but the last round's showed SILENT, 'it dropped out before the job's end', though none
    was ever planned and absent: the cloud had merely not drawn them since."""
    state = MonitorState()
    for rnd, cell in enumerate(("c0", "c3", "c1", "c2")):
        state.add(_cell(rnd, cell, 4, 100.0 + rnd))
        state.add(
            RoundRecord(
                run="live",
                round=rnd,
                rounds=4,
                closed_by="all reported",
                cells_planned=[cell],
                cells_reported=[cell],
                duration_s=1.0,
                time=100.5 + rnd,
            )
        )
    assert state.finished and not [line for line in state.alerts(200.0) if "dropped out" in line], state.alerts(200.0)
    assert {state.state_of(view, 200.0) for view in state.cells.values()} == {"ok"}


def test_a_record_of_a_cell_resumed_after_its_job_ended_raises_no_participation_drop():
    """A cell resumed once its job was over replays its open edge round alone (its devices gone with the job): its
    record, 0 of 4 answered, raised 'participation dropped to 0%' on a job that had ended. A drop within the job still
    alerts."""
    state = MonitorState()
    for rnd in range(3):
        for cell in ("c0", "c1"):
            state.add(_cell(rnd, cell, 4 if rnd < 2 or cell == "c1" else 1, 100.0 + rnd))
        state.add(
            RoundRecord(
                run="live",
                round=rnd,
                rounds=3,
                closed_by="all reported",
                cells_planned=["c0", "c1"],
                cells_reported=["c0", "c1"],
                duration_s=1.0,
                time=100.5 + rnd,
            )
        )
    state.add(_cell(2, "c1", 0, 400.0, edge=1))  # resumed 5 min after the end
    alerts = state.alerts(401.0)
    assert "cell c0 participation dropped to 25% (was 100% on average)" in alerts, alerts  # in the job: alerts
    assert not any("c1 participation" in a for a in alerts), alerts
    assert state.state_of(state.cells["c1"], 401.0) == "ok"


def test_a_monitor_started_before_its_run_folder_names_it_and_waits(runs, tmp_path):
    """`fedtier monitor RUN_DIR` started before the run titled itself 'fedtier monitor: ?' and said 'no round closed
    yet'; it names the folder and says it does not exist yet, then the run's name once its records come."""
    from rich.console import Console

    from monitor.live import LiveView

    run_dir = tmp_path / "later"
    view = LiveView(0.75, None, CellFilter(), Console(file=io.StringIO()))
    feed = RunDirFollower(run_dir)
    view.pull(feed)
    text = " ".join(render_text(view.state, now=time.time(), width=200).split())
    assert f"fedtier monitor: {run_dir}" in text and f"cloud: {run_dir} does not exist yet" in text, text
    shutil.copytree(runs[0].output_dir, run_dir)
    view.pull(feed)
    text = " ".join(render_text(view.state, now=time.time(), width=200).split())
    assert f"fedtier monitor: {view.state.run} " in text and "does not exist" not in text and "round 3/3" in text, text
