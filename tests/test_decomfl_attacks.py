"""DeComFL's scalars against a lying device and a lying cell (each with valid credentials).

A device's K x P scalars are its word: finite (checked) but unbounded, and its cell and the cloud average them into
every device's model. One device of six scaling its genuine scalars by 10^6 (its weight as bounded as ever) took the
loss from 2.3 to 10^16; by 10^30 it failed the job (the model diverged). ``algorithm.scalar_clip`` (opt-in; the paper
has none) bounds each device's scalars at its cell and a cell's summed scalars at the cloud (clip x its weight)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from protocols.algorithms.base import Rejected
from protocols.algorithms.decomfl import DeComFLCloud
from protocols.wire.payload import Payload
from sim.launcher import RunResult, SimHierarchy
from tests.conftest import small_config

CLIP = 5.0  # the honest devices' scalars here stay under 2


def config(tmp_path: Path, clip: float) -> Any:
    algorithm = {"name": "decomfl", "edge_rounds": 1, "local_steps": 2, "perturbations": 3, "lr": 0.02}
    if clip:
        algorithm["scalar_clip"] = clip
    return small_config(tmp_path, run={"rounds": 4}, algorithm=algorithm, model={"name": "mlp", "hidden": [16]})


def run(tmp_path: Path, clip: float, scale: float = 1.0) -> RunResult:
    """The run with c0-d0 (its own key) sending its genuine scalars times ``scale``."""
    sim = SimHierarchy(config(tmp_path, clip), write_output=False)
    configure = sim.agents.configure

    def compromised(agent: Any) -> None:
        configure(agent)
        if agent.device == "c0-d0":
            genuine = agent.publish_result
            agent.publish_result = lambda r, *a: genuine(
                Payload(r.meta, {k: (v * scale).astype(v.dtype) for k, v in r.tensors.items()}), *a
            )

    sim.agents.configure = compromised
    return sim.run()


def losses(result: RunResult) -> list[float]:
    return [r["loss"] for r in result.history]


def test_one_device_scaling_its_scalars_wrecks_the_model_without_a_clip_and_not_with_one(tmp_path: Path) -> None:
    clean = run(tmp_path / "clean", 0.0)
    assert losses(clean)[-1] < losses(clean)[0] < 2.5
    wrecked = run(tmp_path / "wrecked", 0.0, 1e6)
    assert losses(wrecked)[-1] > 1e6  # the attack works
    clipped_clean = run(tmp_path / "clipped-clean", CLIP)
    assert all(np.array_equal(a, b) for a, b in zip(clipped_clean.params.values(), clean.params.values()))
    for scale in (1e6, 1e30):
        clipped = run(tmp_path / f"clipped-{scale:g}", CLIP, scale)
        assert clipped.failed is None and len(clipped.history) == 4
        assert losses(clipped)[-1] < losses(clipped)[0] and abs(losses(clipped)[-1] - losses(clean)[-1]) < 0.1


def test_a_cell_whose_summed_scalars_exceed_the_clip_times_its_weight_is_refused(tmp_path: Path) -> None:
    train = config(tmp_path, CLIP).train
    cloud = DeComFLCloud(train, 0, {"w": np.zeros(3, np.float32)})  # type: ignore[arg-type]
    cloud.plan(0, ["c0"])
    meta = {"weight": 2, "answered": ["c0-d0", "c0-d1"], "need": 0}
    g = np.full((2, 3), 2 * CLIP)  # two devices, each at most CLIP: the sum at most 2 x CLIP
    cloud.check("c0", Payload(meta, {"g": g}))
    with pytest.raises(Rejected, match="a scalar of 10.5 above scalar_clip x weight \\(10\\)"):
        cloud.check("c0", Payload(meta, {"g": g + 0.5}))
