"""``benchmarks/async.py`` gives sync the same tuning effort as async (issue #26): a grid of device deadlines
and quorums, every setting's time to the target and accuracy, and the headline against the best sync
setting, not the untuned one. A tiny federation (8 devices, digits) runs the whole script in seconds."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_async_benchmark_tunes_sync_and_compares_with_the_best_setting(monkeypatch, capsys) -> None:
    """The script as its command line runs it (``__main__``), in this process: torch is imported already."""
    args = "--devices 8 --cells 2 --rounds 2 --deadlines 0,2 --quorums 1,0.5 --dataset digits --max-train 800"
    script = str(ROOT / "benchmarks" / "async.py")
    monkeypatch.setattr(sys, "argv", [script, *args.split(), "--max-rounds", "6"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # (the script puts the repository first)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:  # (argparse's way out)
        pytest.fail(f"benchmarks/async.py exited with {exc.code}: {capsys.readouterr().err[-3000:]}")
    out = capsys.readouterr().out
    assert "calibration:" in out
    target = float(re.search(r"virtual s to ([0-9.]+) \|", out).group(1))
    rows = {}
    for m in re.finditer(r"^\| (sync, deadline \S+, quorum \S+) \| \d+ \| ([0-9.]+|never) \| ([0-9.]+) \|", out, re.M):
        rows[m.group(1)] = (float("inf") if m.group(2) == "never" else float(m.group(2)), float(m.group(3)))
    assert len(rows) == 4, out  # every setting of the 2 x 2 grid has its row
    assert rows["sync, deadline none, quorum 1"][1] == target  # the untuned setting's accuracy is the target
    assert re.search(r"^\| async \(FedBuff\) \|", out, re.M)
    best = re.search(r"^best sync: (sync, deadline \S+, quorum \S+), ([0-9.]+) virtual s", out, re.M)
    assert best is not None, out
    assert float(best.group(2)) == min(t for t, _ in rows.values())  # the headline is against the best
    assert best.group(1).rstrip(",") in rows
