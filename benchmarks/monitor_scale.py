"""How ``fedtier monitor`` scales with the number of cells: seconds to fold a round of records in and to
render one frame (summary, top 20 rows, alerts), and the frame's height, for growing fleets.

    .venv/bin/python benchmarks/monitor_scale.py [--cells 100 1000 5000] [--rounds 5]

Synthetic records (4 devices per cell; 1 % of the cells silent, 1 % with a participation drop, 1 %
two rounds behind); the median of 5 frames counts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from monitor.view import MonitorState, render_text  # noqa: E402
from protocols.records import CellRecord, RoundRecord  # noqa: E402


def fleet(cells: int, rounds: int) -> list[CellRecord | RoundRecord]:
    out: list[CellRecord | RoundRecord] = []
    for i in range(cells):
        cell, kind = f"c{i:05d}", i % 100
        devices = [f"{cell}-d{j}" for j in range(4)]
        last = rounds - 3 if kind == 2 else rounds - 1
        for rnd in range(last + 1):
            answered = 1 if kind == 1 and rnd == last else 4
            out.append(
                CellRecord(
                    run="scale",
                    round=rnd,
                    edge_round=0,
                    cell=cell,
                    algorithm="fedavg",
                    planned=devices,
                    answered=devices[:answered],
                    absent={d: "deadline" for d in devices[answered:]},
                    closed_by="quorum",
                    duration_s=0.1,
                    deadline_s=30.0,
                    time=10.0 if kind == 0 else 100.0 + rnd,
                )
            )
    out.append(
        RoundRecord(
            run="scale",
            round=rounds - 1,
            rounds=rounds + 10,
            closed_by="deadline",
            cells_planned=[f"c{i:05d}" for i in range(cells)],
            duration_s=1.0,
            accuracy=0.5,
        )
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=int, nargs="+", default=[100, 1000, 5000])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    print("| cells | records | fold s/round | render s/frame | frame lines |")
    print("|---|---|---|---|---|")
    for n in args.cells:
        records = fleet(n, args.rounds)
        state = MonitorState()
        t0 = time.perf_counter()
        state.add_all(records)
        fold = (time.perf_counter() - t0) / args.rounds
        frames = []
        for _ in range(5):
            t0 = time.perf_counter()
            text = render_text(state, now=200.0, width=160)
            frames.append(time.perf_counter() - t0)
        print(f"| {n} | {len(records)} | {fold:.3f} | {statistics.median(frames):.3f} | {len(text.splitlines())} |")


if __name__ == "__main__":
    main()
