"""The cloud's run folder holds the whole run: cells' aggregation records reach it as signed telemetry
(``cloud.cell_records``), a forged or misplaced one is dropped, and readers merge the cloud's copy with a
cell's own file without counting a record twice."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from cloud.cell_records import CellRecordCollector
from cloud.node import build_cloud
from monitor.sources import RunDirFollower
from protocols import runfiles
from protocols.records import CellRecord, read_run
from protocols.transport.memory import MemoryHub
from protocols.wire import topics
from protocols.wire.keys import Trust, generate_keys
from protocols.wire.signed import seal_record
from sim.hierarchy import prepare
from tests.conftest import small_config, with_keys


def record(cell: str, rnd: int, edge: int) -> dict:
    return CellRecord(
        run="t",
        round=rnd,
        edge_round=edge,
        cell=cell,
        algorithm="fedavg",
        closed_by="all answered",
        duration_s=0.1,
        time=1000.0 + rnd * 10 + edge,
        planned=[f"{cell}-d0"],
        answered=[f"{cell}-d0"],
    ).to_dict()


def test_the_cloud_keeps_signed_cell_records_and_drops_forgeries(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    ring = generate_keys(cfg.topology)
    hub = MemoryHub()
    collector = CellRecordCollector(
        hub.connect("cloud"),
        "t",
        ["c0", "c1"],
        tmp_path / runfiles.CELL_RECORDS,
        Trust("cloud", ring.private["cloud"], ring.public),
    )
    collector.start()
    peer = hub.connect("cells")

    def send(cell_topic: str, rec: dict, signer: str | None) -> None:
        topic = topics.telemetry_cell("t", cell_topic)
        sign = Trust(signer, ring.private[signer], ring.public).sign if signer else None
        peer.publish(topic, seal_record(rec, topic, sign))

    send("c0", record("c0", 0, 0), "c0")  # genuine
    send("c1", record("c1", 0, 0), "c1")  # genuine
    send("c1", record("c1", 0, 1), "c0")  # c0 forging c1's record
    send("c0", record("c1", 0, 1), "c0")  # c0's signature, c1's record on c0's topic
    send("c0", record("c0", 0, 1), None)  # unsigned in a signed run
    send("c9", record("c9", 0, 0), None)  # not a cell of the job
    peer.publish(topics.telemetry_cell("t", "c0"), b"\xff not json")
    hub.loop.run()
    collector.close()
    written = [json.loads(line) for line in (tmp_path / runfiles.CELL_RECORDS).read_text().splitlines()]
    assert [(r["cell"], r["edge_round"]) for r in written] == [("c0", 0), ("c1", 0)]
    assert collector.written == 2 and collector.dropped == 5


def test_readers_merge_a_cells_file_with_the_clouds_copy(tmp_path: Path) -> None:
    """A cell that shares the cloud's folder (one machine): each record is in both files and counts once;
    the live follower does the same."""
    own = [record("c0", 0, 0), record("c0", 0, 1)]
    collected = [record("c0", 0, 0), record("c1", 0, 0), record("c0", 0, 1)]
    (tmp_path / runfiles.AGGREGATION).write_text("".join(json.dumps(r) + "\n" for r in own))
    (tmp_path / runfiles.CELL_RECORDS).write_text("".join(json.dumps(r) + "\n" for r in collected))
    records, bad = read_run(tmp_path)
    assert not bad and [(r.cell, r.edge_round) for r in records] == [("c0", 0), ("c1", 0), ("c0", 1)]
    follower = RunDirFollower(tmp_path)
    got, bad, _ = follower.poll()
    assert not bad and len(got) == 3
    with (tmp_path / runfiles.CELL_RECORDS).open("a") as fh:
        fh.write(json.dumps(record("c0", 0, 1)) + "\n" + json.dumps(record("c1", 0, 1)) + "\n")
    got, _, _ = follower.poll()
    assert [(r.cell, r.edge_round) for r in got] == [("c1", 1)]


def test_the_cloud_drops_a_cell_record_of_a_round_the_job_has_not_reached(tmp_path: Path) -> None:
    """A cell with its own key signs a record of round 1e12: it was kept, and `fedtier report` on the cloud's folder
    sized its participation heatmap by it (devices x 1e12 float64: a MemoryError). A record of the round in progress,
    or of the next (a record may overtake the cloud's closing of its round), is kept."""
    cfg = small_config(tmp_path)
    ring = generate_keys(cfg.topology)
    hub = MemoryHub()
    job = SimpleNamespace(round=3)
    collector = CellRecordCollector(
        hub.connect("cloud"),
        "t",
        ["c0"],
        tmp_path / runfiles.CELL_RECORDS,
        Trust("cloud", ring.private["cloud"], ring.public),
        job=job,
    )
    collector.start()
    peer, topic = hub.connect("cells"), topics.telemetry_cell("t", "c0")
    sign = Trust("c0", ring.private["c0"], ring.public).sign
    for rnd in (2, 3, 4, 10**12, 5):
        peer.publish(topic, seal_record(record("c0", rnd, 0), topic, sign))
    hub.loop.run()
    collector.close()
    written = [json.loads(line)["round"] for line in (tmp_path / runfiles.CELL_RECORDS).read_text().splitlines()]
    assert written == [2, 3, 4] and collector.dropped == 2


def test_a_cells_record_naming_a_device_not_its_own_is_dropped_by_the_deployed_cloud(tmp_path: Path) -> None:
    """A cell with its own key names another cell's device, or a thousand made-up ids, in its signed record: the
    deployed cloud kept it in ``cells.jsonl``, and `fedtier report` on the cloud's folder put c1-d0 in c0's row (and
    kept every made-up id: one 8 MiB record names ~800,000). Now dropped, named; a record naming its own devices,
    a revoked one among them, is kept."""
    cfg, ring = with_keys(small_config(tmp_path), tmp_path)
    hub = MemoryHub()
    cloud = build_cloud(
        cfg,
        hub.connect("cloud"),
        cfg.build_algorithm(prepare(cfg).spec),
        output_dir=tmp_path,
        collect_cell_records=True,
    )
    assert cloud.cell_records is not None
    cloud.cell_records.start()
    peer, topic = hub.connect("c0"), topics.telemetry_cell("t", "c0")
    sign = Trust("c0", ring.private["c0"], ring.public).sign
    honest = record("c0", 0, 0) | {"absent": {"c0-d1": "revoked"}}
    for rec in (
        honest,
        record("c0", 0, 1) | {"answered": ["c0-d0", "c1-d0"]},  # another cell's device
        record("c0", 0, 2) | {"absent": {f"ghost-{i}": "offline" for i in range(1000)}},  # made-up ids
        record("c0", 0, 3) | {"failed": {"c1-d2": "x"}},
    ):
        peer.publish(topic, seal_record(rec, topic, sign))
    hub.loop.run()
    cloud.cell_records.close()
    written = [json.loads(line) for line in (tmp_path / runfiles.CELL_RECORDS).read_text().splitlines()]
    assert [(r["edge_round"], r["absent"]) for r in written] == [(0, {"c0-d1": "revoked"})]
    assert cloud.cell_records.dropped == 3
