"""A cell keeps a result of its device for a round it has not opened yet (a restarted cell's devices answered the
dead cell's task, 50158ed): what a device with valid credentials can make it keep is bounded. Only the next edge
round or the first of the next round, one result a device, its content checked before it is kept: a result for a
far round, or one its round would refuse (another shape, e.g. a tensor of megabytes), is refused at once, not held
model-sized or larger until its round."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from protocols.wire import topics
from protocols.wire.messenger import Messenger
from protocols.wire.payload import Payload
from sim.launcher import SimHierarchy
from tests.conftest import small_config

RUN = "t"


def test_a_device_cannot_make_its_cell_keep_a_far_rounds_or_a_malformed_result(tmp_path: Path) -> None:
    """c0-d0's credentials (in memory: its claim) send, as round 0 opens, a result for round 9 (the model's shapes)
    and one for round 1 holding a 4 MB tensor the model does not have: both refused with their kind, nothing kept;
    the genuine results still count (the clean run's model)."""
    clean = SimHierarchy(small_config(tmp_path / "clean", run={"rounds": 2})).run()
    sim = SimHierarchy(small_config(tmp_path / "attacked", run={"rounds": 2}))
    cell = sim.cells["c0"]
    liar = Messenger(sim.hub.connect("liar"), RUN, "c0-d0")
    topic = topics.device_result(RUN, "c0", "c0-d0")
    kept: list[int] = []
    fired: list[bool] = []
    original = cell.messenger.send

    def send_then_forge(t, kind, payload, **kw):
        n = original(t, kind, payload, **kw)
        if kind == "device_task" and kw["round"] == 0 and not fired:
            fired.append(True)
            model = sim.cloud.role.global_params()
            fit = Payload({"weight": 1.0, "loss": 0.0}, {k: np.zeros_like(v) for k, v in model.items()})
            huge = Payload({"weight": 1.0, "loss": 0.0}, {"x": np.zeros(1 << 20, np.float32)})
            liar.send(topic, "device_result", fit, round=9, edge_round=0, cell="c0")
            liar.send(topic, "device_result", huge, round=1, edge_round=0, cell="c0")
            sim.hub.loop.post(lambda: kept.append(len(cell._early)))
        return n

    cell.messenger.send = send_then_forge  # type: ignore[method-assign,assignment]
    attacked = sim.run()
    assert kept == [0]  # before: both kept (the latest, 4 MB, until round 1; round 9's until the job's end)
    rejected = [x for r in attacked.cell_records if r["cell"] == "c0" and r["round"] == 0 for x in r["rejected"]]
    assert sorted(x["kind"] for x in rejected) == ["shape", "stale"], rejected
    assert all(np.array_equal(clean.params[k], attacked.params[k]) for k in clean.params)
