"""A job fails when none of its rounds made progress (bbbd6fe), or when every answer is refused (707697e): what
fails it is that nothing was aggregated anywhere, so devices lying with valid credentials, or a buggy device role,
cannot fail a job whose honest devices answer, and a round closed by its quorum with few answers is progress."""

from __future__ import annotations

from pathlib import Path

from protocols.failures import failed_payload
from protocols.rejections import Rejected, RejectKind
from protocols.wire import topics
from protocols.wire.messenger import Messenger
from protocols.wire.payload import Payload
from sim.launcher import SimHierarchy
from tests.conftest import small_config

RUN = "t"


def test_liars_refused_or_failing_every_task_cannot_fail_a_short_job_whose_honest_devices_answer(
    tmp_path: Path,
) -> None:
    """2 rounds (fewer than max_stalled_rounds, where a job of no progress fails at its end), quorum 0.5: c0-d0's
    every answer refused by its cell's check, c0-d1 answering every task 'failed' before its training does (its
    credentials, its own failure), every answer of c1's devices refused: c0-d2 is aggregated (and
    c0-d1 when its training answers first), and the job
    finishes with both rounds, naming what it refused."""
    cfg = small_config(tmp_path, run={"rounds": 2}, runtime={"quorum": 0.5})
    sim = SimHierarchy(cfg)
    for name, cell in sim.cells.items():
        check = cell.role.check

        def refusing(device: str, result: Payload, check=check, name=name) -> None:
            if name == "c1" or device == "c0-d0":
                raise Rejected(RejectKind.MALFORMED, f"result of {device}: a lie")
            check(device, result)

        cell.role.check = refusing  # type: ignore[method-assign]
    buggy = Messenger(sim.hub.connect("buggy"), RUN, "c0-d1")
    topic = topics.device_result(RUN, "c0", "c0-d1")

    def on_task(_topic: str, data: bytes) -> None:
        msg = buggy.receive(_topic, data)
        if msg is not None:
            h = msg.header
            buggy.send(topic, "device_result", failed_payload("boom"), round=h.round, edge_round=h.edge_round)

    buggy.transport.subscribe(topics.device_task(RUN, "c0", "c0-d1"), on_task)
    result = sim.run()
    assert result.status == "finished" and result.failed is None and len(result.history) == 2
    c0 = [r for r in result.cell_records if r["cell"] == "c0"]
    assert all("c0-d2" in r["answered"] and [x["device"] for x in r["rejected"]] == ["c0-d0"] for r in c0), c0
    assert any(r.get("failed") == {"c0-d1": "boom"} for r in c0)
    c1 = [x["kind"] for r in result.cell_records if r["cell"] == "c1" for x in r["rejected"]]
    assert c1 and set(c1) == {"malformed"}
