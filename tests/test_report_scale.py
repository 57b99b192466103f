"""``fedtier report`` of research-scale runs: the participation heatmap is a bounded grid of exact bucket rates,
folded in one pass without holding devices x rounds (monitor/heatmap.py, monitor/run_data.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from monitor import heatmap as heat_module  # noqa: E402
from monitor import round_series  # noqa: E402
from monitor.heatmap import MAX_COLUMNS, MAX_ROWS, Participation  # noqa: E402
from monitor.report import Plot, plot_participation, write_report  # noqa: E402
from monitor.run_data import heatmap, load_run  # noqa: E402
from monitor.state import ACCURACY_KEPT  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "report_scale.py"
spec = importlib.util.spec_from_file_location("report_scale", SCRIPT)
report_scale = sys.modules["report_scale"] = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
spec.loader.exec_module(report_scale)  # type: ignore[union-attr]


def full_matrix(records: list[dict], rounds: int) -> tuple[list[str], dict[str, str], np.ndarray]:
    """The unbucketed matrix, computed directly: (devices by (cell, name), their cell, share[device, round])."""
    cell_of = {d: r["cell"] for r in records for d in (*r["planned"], *r.get("absent", {}), *r["answered"])}
    devices = sorted(cell_of, key=lambda d: (cell_of[d], d))
    row = {d: i for i, d in enumerate(devices)}
    edges: dict[tuple[str, int], set[int]] = {}
    for r in records:
        edges.setdefault((r["cell"], r["round"]), set()).add(r["edge_round"])
    full = np.zeros((len(devices), rounds))
    for r in records:
        for d in r["answered"]:
            full[row[d], r["round"]] += 1 / len(edges[(r["cell"], r["round"])])
    return devices, cell_of, full


def bucket_means(full: np.ndarray, row_groups: list[list[int]], width: int) -> np.ndarray:
    cols = -(-full.shape[1] // width)
    out = np.zeros((len(row_groups), cols))
    for i, rows in enumerate(row_groups):
        for c in range(cols):
            out[i, c] = full[rows, c * width : (c + 1) * width].mean()
    return out


def test_a_report_of_2000_devices_over_3000_rounds_draws_a_bounded_grid_of_exact_rates_in_bounded_memory(
    tmp_path: Path,
) -> None:
    """A run of 2,000 devices in 4 cells over 3,000 cloud rounds (one device sampled a round, answering 9 times in
    10): the heatmap is 4 cell rows x 500 columns of 6 rounds, each the mean of the full matrix's entries it covers,
    computed here from the records directly; reading the run and folding it peaked far below the 48 MB of the
    full matrix (before: the matrix itself, and every record held)."""
    devices, rounds = 2000, 3000
    run_dir = report_scale.write_run(tmp_path / "run", devices, rounds, cells=4, per_round=1)
    tracemalloc.start()
    try:
        run = load_run(run_dir)
        heat = heatmap(run)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < devices * rounds * 8 / 4, peak  # 48 MB of float64 for the full matrix; measured ~7 MB
    assert run.cells == [] and run.folded is not None  # too many records to keep: folded as they were read
    assert heat.matrix.shape == (4, MAX_COLUMNS) and heat.width == 6 and heat.per_row == "cell"
    records = [json.loads(line) for line in (run_dir / "aggregation.jsonl").read_text().splitlines()]
    names, cell_of, full = full_matrix(records, rounds)
    cells = sorted(set(cell_of.values()))
    groups = [[i for i, d in enumerate(names) if cell_of[d] == c] for c in cells]
    np.testing.assert_allclose(heat.matrix, bucket_means(full, groups, 6), rtol=1e-12, atol=1e-15)
    assert 0 < heat.matrix.max() and heat.rows[0] == f"c0 ({len(groups[0]):,} devices)"
    plot = plot_participation([run])
    axis = plot.figure.axes[0]
    assert axis.get_xlabel().startswith("cloud rounds 1-3,000 in 500 columns of 6")
    assert axis.get_images()[0].get_array().shape == (4, MAX_COLUMNS)


def _record(cell: str, rnd: int, edge: int, planned: list[str], answered: list[str]) -> dict:
    """What the heatmap reads of a cell record (a validated one costs ~0.2 ms: 14,400 of them, 3 s)."""
    return dict(round=rnd, edge_round=edge, cell=cell, planned=planned, answered=answered, absent={}, duration_s=0.1)


@pytest.mark.parametrize("shape", ["device rows", "device groups", "cell groups"])
def test_bucketed_rows_are_devices_else_groups_of_a_cells_devices_else_groups_of_cells(shape: str, monkeypatch) -> None:
    """Columns of 3 rounds (1,200 rounds) of 6 cells of 2 devices; rows: the 12 devices (<= MAX_ROWS); with MAX_ROWS
    at 8 and 3 cells of 4 devices, pairs of a cell's devices; with MAX_ROWS at 4, the 6 cells two by two (more cells
    than rows). Edge rounds count as shares (2 edge rounds: answering one is 0.5), as in the unbucketed matrix."""
    cells, per_cell = (3, 4) if shape == "device groups" else (6, 2)
    monkeypatch.setattr(heat_module, "MAX_ROWS", {"device rows": MAX_ROWS, "device groups": 8, "cell groups": 4}[shape])
    rng = np.random.default_rng(1)
    rounds, records = 1200, []
    for rnd in range(rounds):
        for c in range(cells):
            devices = [f"c{c}-d{j}" for j in range(per_cell)]
            for edge in range(2):
                records.append(_record(f"c{c}", rnd, edge, devices, [d for d in devices if rng.random() < 0.6]))
    fold = Participation(rounds)
    for r in records:
        fold.add(SimpleNamespace(**r))
    heat = fold.finish()
    names, cell_of, full = full_matrix(records, rounds)
    if shape == "device rows":
        assert heat.rows == names and heat.matrix.shape == (12, 400) <= (MAX_ROWS, MAX_COLUMNS)
        expected = bucket_means(full, [[i] for i in range(12)], 3)
    elif shape == "device groups":
        assert heat.rows[:2] == ["c0-d0..c0-d1 (2 devices)", "c0-d2..c0-d3 (2 devices)"] and len(heat.rows) == 6
        assert heat.per_row == "2 devices of a cell" and heat.cells == ["c0", "c0", "c1", "c1", "c2", "c2"]
        expected = bucket_means(full, [[i, i + 1] for i in range(0, 12, 2)], 3)
    else:
        assert heat.rows == ["c0..c1 (4 devices)", "c2..c3 (4 devices)", "c4..c5 (4 devices)"]
        expected = bucket_means(full, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], 3)
    np.testing.assert_allclose(heat.matrix, expected, rtol=1e-12)
    assert heat.width == 3 and 0.2 < heat.matrix.mean() < 0.8


def test_a_monitor_opened_on_a_long_runs_folder_folds_its_backlog_a_bounded_piece_at_a_time(
    tmp_path: Path, monkeypatch
) -> None:
    """`fedtier monitor RUN_DIR` read each file's whole backlog in one poll and parsed it into records at once (1.2 GB
    of RSS for a 109 MB log of 1,000 devices x 5,000 rounds). Read MAX_READ_BYTES a poll (here 400 bytes, less than
    a line: a line split between reads is joined), one pull still folds the whole run."""
    from rich.console import Console

    from monitor import sources
    from monitor.live import LiveView
    from monitor.sources import RunDirFollower
    from monitor.view import CellFilter, render_text

    run_dir = report_scale.write_run(tmp_path / "run", 40, 300, cells=4)
    lines = (run_dir / "aggregation.jsonl").read_text().splitlines()
    assert min(map(len, lines)) > 400
    monkeypatch.setattr(sources, "MAX_READ_BYTES", 400)
    follower = RunDirFollower(run_dir)
    records, bad, _ = follower.poll()
    assert len(records) <= 3 and not bad and follower.pending  # at most a line a file
    view = LiveView(0.75, None, CellFilter(), Console(width=200))
    view.pull(RunDirFollower(run_dir))
    state = view.state
    assert state.cloud is not None and state.cloud.round == 299 and state.finished and not state.bad
    assert {c: (v.round, v.records) for c, v in state.cells.items()} == {f"c{i}": (299, 300) for i in range(4)}
    assert [r for r, _ in state.accuracy] == list(range(300 - ACCURACY_KEPT, 300))  # the latest
    assert "cloud round 300/300 closed" in " ".join(render_text(state, 0.0, width=200).split())


def test_the_monitors_accuracy_series_stays_sorted_by_round_in_linear_time() -> None:
    """The monitor rebuilt its accuracy series from a dict of every round at each round record: 20,000 rounds took
    95 s to fold (`fedtier monitor --once`). Now in place: a round's replaces an earlier one of it, a late round goes
    in its place; 10,000 rounds fold in well under a second (the quadratic rebuild: ~10 s). It keeps the latest
    ACCURACY_KEPT (its sparkline draws 30): a monitor following a run of 10^6 rounds held 10^6 pairs (~120 MB)."""
    import time

    from monitor.state import MonitorState
    from protocols.records import RoundRecord

    first = RoundRecord(run="r", round=0, closed_by="all reported", duration_s=0.1, accuracy=0.0, rounds=20_000)
    state = MonitorState()
    for rnd, acc in ((3, 0.3), (1, 0.1), (2, 0.2), (1, 0.15), (0, 0.0)):
        state.add(first.model_copy(update={"round": rnd, "accuracy": acc}))
    assert state.accuracy == [(0, 0.0), (1, 0.15), (2, 0.2), (3, 0.3)]
    many = [first.model_copy(update={"round": rnd, "accuracy": rnd / 10_000}) for rnd in range(10_000)]
    start = time.process_time()
    state.add_all(many)
    assert time.process_time() - start < 3.0
    assert state.accuracy == [(rnd, rnd / 10_000) for rnd in range(10_000 - ACCURACY_KEPT, 10_000)]


def test_a_record_in_both_the_cells_file_and_the_clouds_collection_counts_once(tmp_path: Path) -> None:
    """A deployed cloud's folder: the cells' records in aggregation.jsonl and again in cells.jsonl (with one of
    its own): each counts once, as read_run counts them; a sim's folder (no cells.jsonl) is read without holding
    a key per record."""
    from protocols.records import read_run

    run_dir = report_scale.write_run(tmp_path / "run", 8, 3, cells=2)
    alone = load_run(run_dir)
    assert len(alone.cells) == 6 and (heatmap(alone).matrix > 0).any()
    lines = (run_dir / "aggregation.jsonl").read_text().splitlines()
    extra = {**json.loads(lines[-1]), "round": 3}
    (run_dir / "cells.jsonl").write_text("\n".join([*lines, json.dumps(extra)]) + "\n")
    both = load_run(run_dir)
    cells = [r for r in read_run(run_dir)[0] if r.__class__.__name__ == "CellRecord"]
    assert len(both.cells) == len(cells) == 7 and both.cells[-1].round == 3
    assert heatmap(both).matrix.shape == (8, 4)  # round 3: the cells' round after the cloud's last


def test_a_long_runs_round_series_are_bounded_strides_keeping_the_first_last_and_best_rounds_and_exact_figures(
    tmp_path: Path, monkeypatch
) -> None:
    """1,000 cloud rounds evaluated every other round (odd rounds: a stride over even rounds would draw none), with
    MAX_POINTS lowered to 100: every per-round series holds 50-100 points plus the first, the last and the
    best-accuracy round (round 777, 0.99, on no stride), each point its record's figures; the table's rounds, final
    accuracy and total bytes are exact, and the page says what was thinned (before: all 1,000 rounds held and drawn,
    ~0.5 KB each: 500 MB at 10^6 rounds)."""
    monkeypatch.setattr(round_series, "MAX_POINTS", 100)
    monkeypatch.setattr(Plot, "png", lambda self: b"")  # the series and the page's text are checked: 2.6 s saved
    run_dir = report_scale.write_run(tmp_path / "run", 10, 1000, cells=1, per_round=1)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        r["accuracy"] = (0.99 if r["round"] == 777 else r["accuracy"]) if r["round"] % 2 else None
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    by_round = {r["round"]: r for r in records}
    out, plots = write_report([run_dir], tmp_path / "report.html")
    by = {p.name: p for p in plots}
    x, acc = by["metrics_vs_round"].series["scale (fedavg)/accuracy"]
    assert 50 <= len(x) <= 102 and x[0] == 2 and x[-1] == 1000 and acc[x.index(778)] == 0.99, x
    assert all(a == by_round[r - 1]["accuracy"] for r, a in zip(x, acc))
    x, per_round = by["bytes_per_tier"].series["scale (fedavg)/device_to_cell"]
    assert 50 <= len(x) <= 103 and {1, 778, 1000} <= set(x) and x == sorted(x), x
    assert all(b == by_round[r - 1]["bytes"]["device_to_cell"] / 1e6 for r, b in zip(x, per_round))
    page = out.read_text()
    total = sum(records[-1]["cumulative_bytes"].values()) / 1e6
    assert f"<td>1000</td><td>{records[-1]['accuracy']:.4f}</td><td>{total:,.2f}</td>" in page
    assert "Downsampled: scale (fedavg): 500 evaluated rounds drawn as " in page
    assert f"scale (fedavg): 1,000 rounds drawn as {len(x)} points (the first of each 16 rounds" in page


def test_a_run_folder_or_a_topic_full_of_garbage_is_counted_with_its_first_lines_kept_not_held_whole(
    tmp_path: Path,
) -> None:
    """A report of a folder whose files hold 5,000 invalid lines, and a monitor fed 5,000 invalid records (a broker
    user with valid credentials publishing garbage to the records' topics, for as long as the monitor runs): both held
    every one of them (~200 bytes each, without bound). They count them and keep the first 50 and the last; the page
    and the warnings list those 50 and say how many more there were."""
    from monitor.state import MonitorState
    from protocols.records import KEPT_BAD_LINES, BadLine

    run_dir = report_scale.write_run(tmp_path / "run", 8, 3, cells=2)
    cell_record = json.loads((run_dir / "aggregation.jsonl").read_text().splitlines()[-1])
    with open(run_dir / "metrics.jsonl", "a") as fh:  # a cell's record there too (read again once rounds are known)
        fh.writelines(f'{{"event": "round", "junk": {i}}}\n' for i in range(2500))
        fh.write(json.dumps({**cell_record, "round": 3}) + "\n")
    with open(run_dir / "aggregation.jsonl", "a") as fh:
        fh.writelines("not json\n" for _ in range(2500))
    run = load_run(run_dir)
    assert len(run.bad) == 5000 and len(run.bad.first) == KEPT_BAD_LINES and run.series.count == 3
    assert len(run.cells) == 7 and run.cells[-1].round == 3
    assert run.bad.last is not None and run.bad.last.error != run.bad.first[-1].error  # the last one, not the 50th
    warned: list[str] = []
    page, _ = write_report([run_dir], tmp_path / "r.html", on_bad=warned.append)
    assert len(warned) == KEPT_BAD_LINES + 1 and "4,950 more not listed (5,000 in all)" in warned[-1]
    assert "4,950 more (5,000 in all)" in page.read_text()

    state = MonitorState()
    for i in range(5000):
        state.add_all([], [BadLine("fed/records/c0", i, "not json")])
    assert len(state.bad) == 5000 and len(state.bad.first) == KEPT_BAD_LINES
    assert any("5000 invalid record(s), last: fed/records/c0:4999: not json" in a for a in state.alerts(0.0))
