"""A short calibration of the machine a benchmark runs on, printed beside its figures.

Figures in seconds depend on the machine: the same fleet round took 2.1 s on one 2-core machine and 5.7 s on
another. Every benchmark prints :func:`calibration_line` so that figures from two machines can be put side by
side: the CPU model, the logical cores, the load when it ran, and two fixed workloads timed on one thread:

- ``torch step``: one SGD step (forward, backward, update) of a fixed MLP 784-256-10 on a batch of 64, in ms;
- ``python loop``: a fixed pure-Python loop of 10^6 iterations (an integer sum), in ms.

Both are timed in CPU seconds of this process (``time.process_time``), the fastest of a few repeats, so they
measure the core's speed rather than the share of it a busy machine leaves (the load says how busy it was); the
whole takes well under a second of CPU. ``python benchmarks/calibration.py`` prints the line alone.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

TORCH_STEPS, REPEATS, LOOP = 30, 3, 1_000_000


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` measured (CPU times in ms; ``torch_step_ms`` is None where torch is absent)."""

    cpu: str
    cores: int
    load: float
    torch_step_ms: float | None
    python_loop_ms: float

    def line(self) -> str:
        """One line for a benchmark's output and for benchmarks/README.md."""
        torch = f"{self.torch_step_ms:.3f} ms" if self.torch_step_ms is not None else "n/a (no torch)"
        return (
            f"calibration: {self.cpu}, {self.cores} logical cores, load {self.load:.2f}; 1-thread torch step "
            f"(MLP 784-256-10, batch 64) {torch}; python loop (10^6 adds) {self.python_loop_ms:.1f} ms (CPU time)"
        )


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo; elsewhere what the platform module says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _python_loop_ms() -> float:
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.process_time()
        total = 0
        for i in range(LOOP):
            total += i
        best = min(best, time.process_time() - t0)
    assert total == LOOP * (LOOP - 1) // 2
    return 1e3 * best


def _torch_step_ms() -> float | None:
    try:
        import torch
    except ImportError:
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(64, 784, generator=g), torch.randint(0, 10, (64,), generator=g)
        best = float("inf")
        for _ in range(REPEATS):
            t0 = time.process_time()
            for _ in range(TORCH_STEPS):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            best = min(best, (time.process_time() - t0) / TORCH_STEPS)
        return 1e3 * best
    finally:
        torch.set_num_threads(threads)


def calibrate() -> Calibration:
    """Measure this machine now (well under a second)."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return Calibration(cpu_model(), os.cpu_count() or 0, load, _torch_step_ms(), _python_loop_ms())


def calibration_line() -> str:
    """:func:`calibrate`'s one-line summary, for a benchmark to print beside its figures."""
    return calibrate().line()


if __name__ == "__main__":
    print(calibration_line())
