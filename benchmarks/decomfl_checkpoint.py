"""What a DeComFL cloud's checkpoint costs at a round of a long run: bytes written and seconds (fsyncs included).

    .venv/bin/python benchmarks/decomfl_checkpoint.py [--horizons 1000 5000 10000] [--kp 5] [--saves 5]

The cloud role (``protocols.algorithms.decomfl``, K x P = ``--kp`` scalars a round, a 1,000-parameter model) closes
rounds from two cells' synthetic reports up to each horizon; one cell's ``need`` stays 0 (a device never seen), so
its window is the whole log (as where a device left for good). At each horizon the cloud checkpoints one round,
then each of ``--saves`` rounds more (``cloud.checkpoint.CloudCheckpoint``, as ``cloud.server`` does after every
round); the figures are the mean of those saves: bytes passed to ``write`` (``/proc/self/io``'s ``wchar``), wall
milliseconds (the fsyncs' share moves with the disk's load) and CPU milliseconds. A run checkpoints every round,
so its total is the sum of the per-round figures over its rounds.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from cloud.checkpoint import CloudCheckpoint
from protocols.algorithms.decomfl import DeComFLCloud, DeComFLParams
from protocols.wire.payload import Payload


def written() -> int:
    """Bytes this process has passed to ``write`` so far."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def close_round(cloud: DeComFLCloud, r: int, rng: np.random.Generator) -> None:
    cloud.plan(r, ["c0", "c1"])
    reports = {
        c: Payload({"weight": 1, "answered": [f"{c}-d0"], "need": 0 if c == "c0" else r + 1}, {"g": g})
        for c, g in (("c0", rng.standard_normal((cloud.K, cloud.P))), ("c1", rng.standard_normal((cloud.K, cloud.P))))
    }
    cloud.aggregate(r, reports)


def save(ckpt: CloudCheckpoint, cloud: DeComFLCloud, r: int) -> None:
    args = (r, "bench", {"device": 0}, 0, cloud.state(), {"round": r})
    if hasattr(cloud, "log_tail"):
        ckpt.save(*args, log=cloud.log_tail)
    else:  # a fedtier whose checkpoint stacked the log into each save
        ckpt.save(*args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--horizons", type=int, nargs="+", default=[1000, 5000, 10000])
    ap.add_argument("--kp", type=int, default=5, help="K x P (K = 1)")
    ap.add_argument("--saves", type=int, default=5)
    a = ap.parse_args()
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)
    params = DeComFLParams(name="decomfl", local_steps=1, perturbations=a.kp, server_model=False)
    cloud, rng = DeComFLCloud(params, 0, {"w": np.zeros(1000, np.float32)}), np.random.default_rng(0)
    r = 0
    with tempfile.TemporaryDirectory() as folder:
        ckpt = CloudCheckpoint(Path(folder) / "checkpoint.ftw")
        for horizon in sorted(a.horizons):
            while r < horizon:
                close_round(cloud, r, rng)
                r += 1
            save(ckpt, cloud, r - 1)  # (the first save after a resume may write the whole log)
            nbytes, seconds, cpu = 0, 0.0, 0.0
            for _ in range(a.saves):
                close_round(cloud, r, rng)
                before, t0, c0 = written(), time.perf_counter(), time.process_time()
                save(ckpt, cloud, r)
                seconds += time.perf_counter() - t0
                cpu += time.process_time() - c0
                nbytes += written() - before
                r += 1
            print(
                f"round {horizon:>6,}: {nbytes / a.saves:>12,.0f} bytes, {1e3 * seconds / a.saves:8.2f} ms "
                f"({1e3 * cpu / a.saves:6.2f} CPU ms) a checkpoint",
                flush=True,
            )


if __name__ == "__main__":
    main()
