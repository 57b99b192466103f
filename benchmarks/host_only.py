"""``benchmarks/decomfl.py --host-only``: importing this module replaces the forward passes by a stand-in (seeded
random outputs of their shape; the cloud's evaluation a constant), so that a run is its host side alone, as
benchmarks/README.md's "Time a round" A/Bs measure it: its accuracies mean nothing, its messages and bytes are the
run's.

Imported by the benchmark's run before it wraps the forwards in timers, and preloaded by the fork server the cell
processes (``runtime.cell_processes``) start from (:func:`reach_cell_processes`), so that their forwards are the
stand-in too (where the platform has no fork server, they stay real).
"""

from __future__ import annotations

from typing import Any

import torch

import protocols.cohort_trainer as engine
import protocols.torch_trainer as device

_gen = torch.Generator().manual_seed(0)


def _forward(model: Any, params: Any, x: Any, shared: int = 1) -> Any:
    first, last = next(iter(params.values())), next(reversed(params.values()))  # (the last: the output's bias)
    return 0.01 * torch.randn(first.shape[0], x.shape[1], last.shape[-1], generator=_gen)


engine.batched_forward = _forward
device.TorchTrainer.evaluate = lambda self, x, y, batch_size=2048: (1.0, 0.1)  # type: ignore[method-assign]


def reach_cell_processes() -> None:
    """Have the fork server that this process's cell processes start from import this module too (before it
    starts: its first worker). The server's ``sys.path`` is its own (``PYTHONPATH``, its working directory), so
    the repository's root goes into ``PYTHONPATH`` (a module it cannot import, it skips in silence)."""
    import os
    from pathlib import Path

    import sim.worker_context as ctx

    if __name__ not in ctx.PRELOAD:
        ctx.PRELOAD = (*ctx.PRELOAD, __name__)
    root = str(Path(__file__).resolve().parents[1])
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, paths)])
