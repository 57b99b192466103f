"""The benchmarks' shared sweep keeps every finished run in a journal: a killed sweep resumes where it stopped."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from benchmarks.tuning import Journal, grid_line, open_journal, pick, sweep

GRIDS = {"a": [0.1, 0.3, 1.0], "b": [0.1, 0.3, 1.0]}
SEEDS = [0, 1]
RUNS = len(GRIDS) * 3 * len(SEEDS)


def fake_run(method: str, value: float, seed: int, calls: str, fail: tuple = ()) -> dict:
    """A deterministic stand-in for a training run; appends its key to ``calls`` (runs in pool workers)."""
    with open(calls, "a") as f:
        f.write(f"{method} {value} {seed}\n")
    if (method, value, seed) in fail:
        raise RuntimeError(f"run {method} {value} {seed} killed")
    score = (1.0 if method == "a" else 2.0) * abs(math.log10(value) + 0.5) + 0.01 * seed
    return {"score": score, "curve": [value, score], "miss": math.inf, "hits": {"0.5": [seed, value]}}


def table(cells: dict) -> str:
    """What a benchmark prints from a sweep: tuning curves, winners, every run in order."""
    winners = pick(cells, "score", lower_is_better=True)
    lines = [f"{m}: " + grid_line(row, "score", lambda v: f"{v:.6f}") for m, row in cells.items()]
    lines += [f"{m} wins at {w.cell.value:g} edge={w.edge}" for m, w in winners.items()]
    lines += [json.dumps(c.runs) for row in cells.values() for c in row]
    return "\n".join(lines)


def calls(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def journal_lines(path: Path) -> list[dict]:
    return [x for x in map(json.loads, path.read_text().splitlines()) if "method" in x]


def test_an_interrupted_sweep_resumes_with_only_the_missing_runs_and_prints_the_same_table(tmp_path, capsys):
    whole = sweep(fake_run, GRIDS, SEEDS, 2, journal=Journal(None), calls=str(tmp_path / "c0"))
    assert len(calls(tmp_path / "c0")) == RUNS
    path = tmp_path / "j.jsonl"
    j = Journal(path, {"rounds": 5})
    with pytest.raises(RuntimeError, match="killed"):  # one run dies mid-sweep: the sweep stops
        sweep(fake_run, GRIDS, SEEDS, 2, journal=j, calls=str(tmp_path / "c1"), fail=(("b", 0.3, 1),))
    j.close()
    kept = journal_lines(path)
    assert 0 < len(kept) < RUNS and ("b", 0.3, 1) not in {(x["method"], x["value"], x["seed"]) for x in kept}
    assert all(x["cpu"] >= 0 and x["wall"] > 0 for x in kept)
    assert "the same command resumes" in capsys.readouterr().err

    j = Journal(path, {"rounds": 5})
    resumed = sweep(fake_run, GRIDS, SEEDS, 2, journal=j, calls=str(tmp_path / "c2"))
    j.close()
    ran = calls(tmp_path / "c2")
    assert len(ran) == RUNS - len(kept) and "b 0.3 1" in ran  # only the missing runs ran
    assert j.reused == len(kept) and j.ran == RUNS - len(kept)
    err = capsys.readouterr().err
    assert f"{len(kept)} reused" in err and "ETA" in err and f"[{RUNS}/{RUNS} runs" in err
    assert table(resumed) == table(whole)
    assert len(journal_lines(path)) == RUNS

    j = Journal(path, {"rounds": 5})  # complete: nothing runs, the same table
    again = sweep(fake_run, GRIDS, SEEDS, 2, journal=j, calls=str(tmp_path / "c3"))
    assert calls(tmp_path / "c3") == [] and j.reused == RUNS and table(again) == table(whole)


def test_a_truncated_last_line_is_dropped_with_a_warning_and_that_run_redone(tmp_path, capsys):
    path = tmp_path / "j.jsonl"
    j = Journal(path, {})
    whole = sweep(fake_run, GRIDS, SEEDS, 2, journal=j, calls=str(tmp_path / "c0"))
    j.close()
    text = path.read_text()
    last = text.rstrip("\n").rsplit("\n", 1)[1]
    path.write_text(text[: len(text) - len(last) // 2 - 1])  # killed halfway through writing the last run
    j = Journal(path, {})
    assert "truncated last line" in capsys.readouterr().err
    resumed = sweep(fake_run, GRIDS, SEEDS, 2, journal=j, calls=str(tmp_path / "c1"))
    j.close()
    lost = json.loads(last)
    assert calls(tmp_path / "c1") == [f"{lost['method']} {lost['value']} {lost['seed']}"]
    assert table(resumed) == table(whole)
    assert len(journal_lines(path)) == RUNS  # every line whole again: the file parses


def test_a_changed_setting_or_fresh_does_not_reuse_runs(tmp_path, monkeypatch):
    """Which journal a sweep reuses (one worker each: what runs is the journal's choice, not the pool's)."""
    monkeypatch.setattr("benchmarks.tuning.RESULTS", tmp_path / "results")
    args = argparse.Namespace(journal=None, fresh=False)
    paper = {"rounds": 100, "dataset": "fmnist"}
    j = open_journal(args, "benchmarks/x.py", "paper", paper)
    sweep(fake_run, GRIDS, SEEDS, 1, journal=j, calls=str(tmp_path / "c0"))
    j.close()
    assert j.path.name.startswith("x-paper-") and j.path.parent.name == "results"
    args = argparse.Namespace(journal=str(tmp_path / "j.jsonl"), fresh=False)
    j = open_journal(args, "benchmarks/x.py", "paper", paper)
    sweep(fake_run, GRIDS, SEEDS, 1, journal=j, calls=str(tmp_path / "c1"))
    j.close()
    other = open_journal(
        argparse.Namespace(journal=None, fresh=False), "benchmarks/x.py", "paper", {**paper, "rounds": 50}
    )
    other.close()
    assert (
        other.path
        != open_journal(argparse.Namespace(journal=None, fresh=False), "benchmarks/x.py", "paper", paper).path
    )
    with pytest.raises(SystemExit, match="other settings"):  # an explicit path written for other settings
        open_journal(args, "benchmarks/x.py", "paper", {**paper, "rounds": 50})
    j = open_journal(argparse.Namespace(journal=args.journal, fresh=True), "benchmarks/x.py", "paper", paper)
    sweep(fake_run, GRIDS, SEEDS, 1, journal=j, calls=str(tmp_path / "c2"))
    j.close()
    assert len(calls(tmp_path / "c2")) == RUNS and j.reused == 0
    assert len(list(tmp_path.glob("j.stale-*.jsonl"))) == 1  # the old journal kept aside, not deleted
    more = Journal(args.journal, {"rounds": 100, "dataset": "fmnist"}, label={"script": "x", "preset": "paper"})
    sweep(fake_run, {"a": [0.1, 0.3, 1.0, 3.0]}, [0, 1, 2], 1, journal=more, calls=str(tmp_path / "c3"))
    more.close()  # a wider grid and a third seed: only the new runs run
    assert len(calls(tmp_path / "c3")) == 4 * 3 - 3 * 2


def torch_threads_run(method: str, value: float, seed: int) -> dict:
    """A run that trains with torch: its score is the number of threads torch uses in the worker."""
    import torch

    return {"score": float(torch.get_num_threads())}


def test_runs_use_single_threaded_torch_whatever_the_environment(tmp_path, monkeypatch):
    """The workers do not import torch up front (it costs ~2 s of CPU each), yet a run that imports it gets
    one thread, even where the environment asks for more."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # what the spawned worker inherits
    cells = sweep(torch_threads_run, {"a": [0.1]}, [0], 1, progress=False)
    assert cells["a"][0].runs[0]["score"] == 1.0


def test_metrics_that_json_would_change_are_refused(tmp_path):
    j = Journal(tmp_path / "j.jsonl", {})
    with pytest.raises(TypeError, match="survive JSON"):
        j.record("a", 0.1, 0, {"hits": {0.5: (1, 2.0)}}, 1.0, 1.0)
    j.close()


def test_a_second_process_on_the_same_journal_is_refused(tmp_path):
    import subprocess
    import sys

    j = Journal(tmp_path / "j.jsonl", {})
    code = (
        "import sys; sys.path.insert(0, '.'); from benchmarks.tuning import Journal; "
        f"Journal({str(tmp_path / 'j.jsonl')!r}, {{}})"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )
    j.close()
    assert out.returncode != 0 and "in use by another process" in out.stderr


def slow_run(method: str, value: float, seed: int, calls: str) -> dict:
    """Instant at value 0.1, otherwise a run that would take minutes; records its worker's pid."""
    import os
    import time

    with open(calls, "a") as f:
        f.write(f"{os.getpid()}\n")
    if value != 0.1:
        time.sleep(300)
    return {"score": value}


def test_sigterm_stops_the_sweep_and_its_workers_and_keeps_the_finished_runs(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    code = (
        "import sys; sys.path.insert(0, '.'); from benchmarks.tuning import Journal, sweep; "
        "from tests.test_tuning import slow_run; "
        f"sweep(slow_run, {{'a': [0.1, 1.0, 3.0]}}, [0], 2, journal=Journal({str(tmp_path / 'j.jsonl')!r}, {{}}), "
        f"calls={str(tmp_path / 'calls')!r})"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (
        (tmp_path / "j.jsonl").exists() and journal_lines(tmp_path / "j.jsonl") and len(calls(tmp_path / "calls")) >= 2
    ):
        time.sleep(0.05)
    assert journal_lines(tmp_path / "j.jsonl"), "the instant run was not journaled"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert "the same command resumes" in err
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err  # stopped, said so: no traceback
    workers = {int(p) for p in calls(tmp_path / "calls")}
    deadline = time.monotonic() + 15
    alive = set(workers)
    while alive and time.monotonic() < deadline:
        for pid in list(alive):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                alive.discard(pid)
        time.sleep(0.05)
    assert not alive, f"workers {alive} outlived the sweep"
    assert [x["value"] for x in journal_lines(tmp_path / "j.jsonl")] == [0.1]


def test_tune_runs_the_grids_on_the_tuning_seeds_then_only_the_winners_on_the_rest(tmp_path):
    from benchmarks.tuning import tune

    path = tmp_path / "j.jsonl"
    j = Journal(path, {})
    cells, winners = tune(fake_run, GRIDS, [0], [0, 1, 2], 2, "score", True, journal=j, calls=str(tmp_path / "c0"))
    j.close()
    assert len(calls(tmp_path / "c0")) == 6 + 2 * 2  # every grid value on seed 0, each winner on seeds 1 and 2
    assert {m: w.cell.value for m, w in winners.items()} == {"a": 0.3, "b": 0.3}  # |log10(v) + 0.5| is least
    assert all(len(w.cell.runs) == 3 and len(cells[m][0].runs) == 1 for m, w in winners.items())
    j = Journal(path, {})
    again = tune(fake_run, GRIDS, [0], [0, 1, 2], 2, "score", True, journal=j, calls=str(tmp_path / "c1"))
    j.close()
    assert calls(tmp_path / "c1") == [] and j.reused == 10
    assert [w.cell.runs for w in again[1].values()] == [w.cell.runs for w in winners.values()]
