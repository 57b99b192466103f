"""Every benchmark prints a calibration of its machine beside its figures (benchmarks/calibration.py)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS.parent))

from benchmarks.calibration import calibrate  # noqa: E402


def test_calibration_measures_both_workloads_and_names_the_cpu():
    c = calibrate()
    assert c.cpu and c.cores >= 1
    assert c.torch_step_ms is not None and 0 < c.torch_step_ms < 1000
    assert 0 < c.python_loop_ms < 10_000
    line = c.line()
    assert re.search(r"torch step .* [0-9.]+ ms; python loop .* [0-9.]+ ms \(CPU time\)$", line), line
    assert c.cpu in line and f"{c.cores} logical cores" in line


def test_every_benchmark_main_prints_the_calibration():
    missing = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        tree = ast.parse(path.read_text())
        main = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)
        if main is None:
            continue  # a helper module (tuning, calibration)
        calls = {n.func.id for n in ast.walk(main) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        if "calibration_line" not in calls:
            missing.append(path.name)
    assert not missing, f"benchmarks whose main() prints no calibration: {missing}"
