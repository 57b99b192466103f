"""scripts/check_sizes.py: the size rule of issue #34 flags long functions and files and passes a clean tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_sizes.py"


def _run(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=60)


def _function(name: str, body_lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(body_lines))
    return f"{indent}@staticmethod\n{indent}def {name}():\n{body}"


def test_flags_a_long_function_and_a_long_file(tmp_path: Path) -> None:
    (tmp_path / "sim").mkdir()
    # a method of 61 lines (def + 60), its decorator not counted; a function of exactly 60 lines passes
    (tmp_path / "sim" / "long.py").write_text("class Box:\n" + _function("fill", 60, "    ") + _function("ok", 59))
    (tmp_path / "monitor" / "deep").mkdir(parents=True)
    (tmp_path / "monitor" / "deep" / "big.py").write_text("".join(f"y{i} = {i}\n" for i in range(501)))
    # outside the product packages: never checked
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "huge.py").write_text(_function("t", 200) + "z = 0\n" * 600)
    done = _run(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "monitor/deep/big.py:1: file is 501 lines (limit 500)",
        "sim/long.py:3: Box.fill is 61 lines (limit 60)",
    ]


def test_passes_a_clean_tree(tmp_path: Path) -> None:
    (tmp_path / "fedtier").mkdir()
    (tmp_path / "fedtier" / "small.py").write_text(_function("fine", 59) + "".join(f"y{i} = {i}\n" for i in range(400)))
    done = _run(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("sizes ok: 1 files")
