"""How ``fedtier report`` scales with the devices and rounds of a run: peak RSS, seconds and the HTML's size.

    .venv/bin/python benchmarks/report_scale.py [--sizes 1000x20000 100000x100] [--cells 10] [--per-round N]

Each size ``DEVICESxROUNDS`` gets a synthetic run folder in the format ``fedtier sim`` writes (``aggregation.jsonl``
with one record per cell and edge round naming its planned, answered and absent devices; ``metrics.jsonl`` with one
round record per cloud round; ``summary.json`` with every device's traffic; ``config.toml``), then ``fedtier
report`` runs on it in a fresh process under ``/usr/bin/time -v`` (its maximum RSS). Every device is planned every
round unless ``--per-round`` samples fewer (uniformly, like ``participation.model = "uniform"``); a planned device
answers with probability 0.9, else it is absent (``deadline``). :func:`write_run` is also the tests' generator.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ANSWER_P = 0.9  # a planned device answers with this probability


def _cell_record(rnd: int, edge: int, cell: str, planned: list[str], answered: list[str], cell_size: int) -> str:
    absent = sorted(set(planned) - set(answered))
    record: dict = {
        "schema": 1,
        "event": "aggregation",
        "run": "scale",
        "round": rnd,
        "edge_round": edge,
        "cell": cell,
        "algorithm": "fedavg",
        "time": 1.8e9 + rnd,
        "closed_by": "deadline" if absent else "all answered",
        "duration_s": 0.01 + 0.001 * (rnd % 7),
        "metrics": {},
        "planned": planned,
        "answered": answered,
        "absent": {d: "deadline" for d in absent},
        "rejected": [],
        "bytes_in": 100 * len(answered),
        "bytes_out": 100 * len(planned),
        "clock_s": float(rnd),
        "deadline_s": 5.0,
    }
    if cell_size > len(planned):  # the others are counted, not named (as the sim writes a sampled population)
        record["absent_counts"] = {"deadline": len(absent), "not participating": cell_size - len(planned)}
    return json.dumps(record, separators=(",", ":"))


def _round_record(rnd: int, rounds: int, cells: list[str], took_part: dict[str, int], total: dict[str, int]) -> str:
    sent = {"cloud_to_cell": 1000 * len(cells), "cell_to_cloud": 1000 * len(cells)}
    sent |= {"cell_to_device": 100 * sum(took_part.values()), "device_to_cell": 90 * sum(took_part.values())}
    for tier, n in sent.items():
        total[tier] = total.get(tier, 0) + n
    record = {
        "schema": 1,
        "event": "round",
        "run": "scale",
        "round": rnd,
        "time": 1.8e9 + rnd,
        "closed_by": "all reported",
        "duration_s": 0.05,
        "metrics": {},
        "rounds": rounds,
        "cells_planned": cells,
        "cells_reported": cells,
        "cells_absent": [],
        "devices": took_part,
        "rejected": [],
        "bytes": sent,
        "cumulative_bytes": dict(total),
        "clock_start_s": float(rnd),
        "clock_s": float(rnd + 1),
        "accuracy": 0.5 + 0.4 * rnd / rounds,
        "loss": 1.0 - 0.5 * rnd / rounds,
    }
    return json.dumps(record, separators=(",", ":"))


def write_run(
    out: Path, devices: int, rounds: int, cells: int = 10, per_round: int | None = None, edge_rounds: int = 1, seed=0
) -> Path:
    """Write a synthetic finished run of ``devices`` in ``cells`` cells (``c{i}-d{j}``) over ``rounds`` cloud rounds
    to the folder ``out``; ``per_round`` devices sampled a round (all: None). Deterministic in ``seed``."""
    rng, draw = np.random.default_rng(seed), random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    per_cell = devices // cells
    names = [[f"c{c}-d{j}" for j in range(per_cell)] for c in range(cells)]
    cell_names, total = [f"c{c}" for c in range(cells)], {}
    with (out / "aggregation.jsonl").open("w") as agg, (out / "metrics.jsonl").open("w") as met:
        for rnd in range(rounds):
            took_part: dict[str, int] = {}
            chosen = None if per_round is None else np.sort(draw.sample(range(per_cell * cells), per_round))
            for c, cell in enumerate(cell_names):
                if chosen is None:
                    planned = names[c]
                else:
                    mine = chosen[(chosen >= c * per_cell) & (chosen < (c + 1) * per_cell)] - c * per_cell
                    planned = [names[c][j] for j in mine]
                if not planned and per_round is not None:
                    continue  # a cell with nobody sampled writes no record (sparse test runs stay small)
                for edge in range(edge_rounds):
                    answered = [d for d, ok in zip(planned, rng.random(len(planned)) < ANSWER_P) if ok]
                    agg.write(_cell_record(rnd, edge, cell, planned, answered, per_cell) + "\n")
                    took_part[cell] = max(took_part.get(cell, 0), len(answered))
            met.write(_round_record(rnd, rounds, cell_names, took_part, total) + "\n")
    traffic = {d: {"bytes_in": 100 * rounds, "bytes_out": 90 * rounds, "tasks": rounds} for n in names for d in n}
    summary = {"run": "scale", "status": "finished", "algorithm": "fedavg", "rounds": rounds, "wall_s": 1.0}
    (out / "summary.json").write_text(json.dumps({**summary, "device_traffic": traffic}))
    (out / "config.toml").write_text('[run]\nname = "scale"\n\n[algorithm]\nname = "fedavg"\n')
    return out


def measure(run_dir: Path) -> dict:
    """``fedtier report`` of ``run_dir`` in a fresh process: peak RSS (MB), wall seconds, the HTML's size (MB)."""
    out = run_dir / "report.html"
    cmd = ["/usr/bin/time", "-v", str(ROOT / ".venv/bin/fedtier"), "report", str(run_dir), "--out", str(out)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    return {
        "exit": done.returncode,
        "peak_rss_mb": int(rss.group(1)) / 1024 if rss else float("nan"),
        "wall_s": wall,
        "html_mb": out.stat().st_size / 1e6 if out.exists() else float("nan"),
        "log_mb": sum(p.stat().st_size for p in run_dir.glob("*.json*")) / 1e6,
        "tail": done.stderr.strip().splitlines()[-25:] if done.returncode else [],
    }


def main() -> None:
    from benchmarks.calibration import calibration_line

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["1000x20000", "100000x100"], help="DEVICESxROUNDS")
    ap.add_argument("--cells", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=None, help="devices sampled a round (default: all)")
    args = ap.parse_args()
    print(calibration_line())
    print("| devices x rounds | log MB | peak RSS MB | wall s | HTML MB |")
    print("|---|---|---|---|---|")
    for size in args.sizes:
        devices, rounds = (int(x) for x in size.split("x"))
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = write_run(Path(tmp) / "run", devices, rounds, args.cells, args.per_round)
            m = measure(run_dir)
        if m["exit"]:
            print(f"{size}: fedtier report exited {m['exit']}:", *m["tail"], sep="\n  ")
        print(
            f"| {devices:,} x {rounds:,} | {m['log_mb']:.1f} | {m['peak_rss_mb']:.0f} | {m['wall_s']:.1f} | "
            f"{m['html_mb']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
