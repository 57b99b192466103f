"""``fedtier sim``: the whole hierarchy in one process over the in-memory transport.

The cloud, cell and device runtimes are the very ones deployments use; only the transport differs
(messages are still encoded and decoded, so the bytes counted are the bytes MQTT would carry).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from cell_server.node import build_cell
from cloud.node import build_cloud
from edge_agent.node import build_agent
from protocols import runfiles
from protocols.checkpoint import save_params
from protocols.config import RunConfig
from protocols.transport.memory import MemoryHub

from .hierarchy import fresh_output, make_evaluator, participation, prepare


@dataclass
class RunResult:
    """What a run produced (also written to its output folder)."""

    config: RunConfig
    params: dict[str, np.ndarray]
    history: list[dict[str, Any]]
    cell_records: list[dict[str, Any]] = field(default_factory=list)
    output_dir: Path | None = None
    wall_s: float = 0.0

    @property
    def final_accuracy(self) -> float | None:
        for record in reversed(self.history):
            if "accuracy" in record:
                return record["accuracy"]
        return None

    def summary(self) -> dict[str, Any]:
        last = self.history[-1] if self.history else {}
        return {"run": self.config.run.name, "algorithm": self.config.train.name, "rounds": len(self.history),
                "accuracy": self.final_accuracy, "loss": last.get("loss"),
                "cumulative_bytes": last.get("cumulative_bytes", {}), "wall_s": round(self.wall_s, 3)}


def set_torch_threads(n: int = 1) -> None:
    """One torch thread per worker: on small models, more threads are much slower here."""
    import torch

    torch.set_num_threads(n)


def run_simulation(cfg: RunConfig, *, on_round: Callable[[dict[str, Any]], None] | None = None,
                   write_output: bool = True, resume: bool = False) -> RunResult:
    """Run ``cfg`` in memory and return the result; writes the run files unless ``write_output`` is off."""
    from protocols.torch_trainer import TorchTrainer

    set_torch_threads(1)
    t0 = time.perf_counter()
    prep = prepare(cfg)
    spec, ds = prep.spec, prep.dataset
    out = fresh_output(cfg, resume) if write_output else None
    algorithm = cfg.build_algorithm(spec)
    hub = MemoryHub()
    avail = participation(cfg)
    availability = (lambda r, e: avail.participants(r)) if cfg.participation.model != "always" else None

    cloud = build_cloud(cfg, hub.connect("cloud"), algorithm,
                        evaluator=make_evaluator(spec, ds.x_test, ds.y_test, cfg.runtime.device),
                        output_dir=out, resume=resume, on_round=on_round)
    cells = [build_cell(cfg, c, hub.connect(f"cell.{c}"), algorithm, availability=availability, output_dir=out)
             for c in cfg.topology.cell_ids()]
    trainer = TorchTrainer.from_spec(spec.name, spec.input_shape, spec.num_classes, cfg.runtime.device,
                                     **spec.build_kwargs())
    agents = [build_agent(cfg, d, hub.connect(f"device.{d}"), algorithm, prep.device_data[d], trainer)
              for d in cfg.topology.all_devices()]
    for node in (*cells, *agents):
        node.start()
    hub.loop.run()  # deliver the birth records before the first round
    cloud.start()
    hub.loop.run(until=lambda: cloud.finished)
    if not cloud.finished:
        raise RuntimeError("the simulation stalled before the last round (no events left)")
    result = RunResult(cfg, cloud.role.global_params(), cloud.history,
                       [r for c in cells for r in c.records], out, time.perf_counter() - t0)
    for node in (*agents, *cells):
        node.stop()
    cloud.stop()
    if out is not None:
        write_final(out, result)
    return result


def write_final(out: Path, result: RunResult) -> None:
    """The final model and a summary, next to the logs."""
    save_params(out / runfiles.FINAL_MODEL, result.params)
    (out / runfiles.SUMMARY).write_text(json.dumps(result.summary(), indent=2) + "\n", encoding="utf-8")
