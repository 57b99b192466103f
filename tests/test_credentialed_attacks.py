"""Attacks by nodes that hold valid credentials (a device's key, a cell's key), in-process on the sim's
transport (the same tier code and checks as a deployment; the broker's ACLs are tests/test_provision.py's).

Each test sends the attack, asserts the refusal (its logged reason in the records) and that the model is
the clean run's where nothing else changed."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud import async_server
from cloud.parts import resend_on_repeat
from protocols.algorithms.base import Rejected
from protocols.algorithms.fedalign import FedAlignCloud
from protocols.config import parse_config
from protocols.wire import topics
from protocols.wire.envelope import decode_message
from protocols.wire.payload import Payload
from sim.launcher import SimHierarchy, run_simulation
from tests.conftest import small_config


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def rejected(result, cell: str) -> list[dict]:
    return [x for r in result.cell_records if r["cell"] == cell for x in r["rejected"]]


# ------------------------------------------------------------------------------ a device's genuine results replayed
@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A clean signed 2-round sim (keys generated into its folder) and the c0-d0 results it published, verbatim."""
    tmp = tmp_path_factory.mktemp("replay")
    cfg = small_config(tmp / "clean", run={"rounds": 2}, security={"keys": str(tmp / "absent.toml")})
    sim = SimHierarchy(cfg)
    captured = capture(sim)
    result = sim.run()
    return {"result": result, "captured": captured, "keys": result.config.security.keys, "tmp": tmp}


def capture(sim: SimHierarchy) -> dict[tuple[int, int], bytes]:
    """An eavesdropper's record of c0-d0's results in ``sim`` as they travel, verbatim, by (round, edge round)."""
    captured: dict[tuple[int, int], bytes] = {}

    def record(topic: str, data: bytes) -> None:
        h, _ = decode_message(data)
        captured.setdefault((h.round, h.edge_round), data)

    sim.hub.connect("eavesdropper").subscribe(topics.device_result("t", "c0", "c0-d0"), record)
    return captured


def replaying(sim: SimHierarchy, packets: dict[tuple[int, int], bytes], *, from_: int = 1) -> list[tuple[int, int]]:
    """As c0 sends c0-d0 each task (the ``from_``-th on), publish the c0-d0 result of 0.0 in ``packets`` on c0-d0's
    result topic first (it reaches the cell before the device even has its task); returns when it fired."""
    intruder = sim.hub.connect("intruder")
    original, fired, sent = sim.cells["c0"].messenger.send, [], []

    def send_then_replay(topic, kind, payload, **kw):
        n = original(topic, kind, payload, **kw)
        key = (kw["round"], kw.get("edge_round", 0))
        if kind == "device_task" and topic.endswith("/c0-d0/task") and len(sent.append(key) or sent) > from_:
            intruder.publish(topics.device_result("t", "c0", "c0-d0"), packets[(0, 0)])
            fired.append(key)
        return n

    sim.cells["c0"].messenger.send = send_then_replay
    return fired


def test_a_devices_signed_result_replayed_into_a_later_round_is_not_taken(signed: dict, tmp_path: Path) -> None:
    """Its round 0.0 result, verbatim, offered first in every later (round, edge round) of the same run: the
    header binds the round and edge round (the cell takes answers for the open ones only), and its message id
    is one the cell has seen. The model is the clean run's (taken first, it would replace the genuine answer)."""
    cfg = small_config(tmp_path, run={"rounds": 2}, security={"keys": str(signed["keys"])})
    sim = SimHierarchy(cfg)
    fired = replaying(sim, capture(sim))
    result = sim.run()
    assert fired == [(0, 1), (1, 0), (1, 1)]
    assert same(result.params, signed["result"].params)
    assert all(sorted(r["answered"]) == sorted(r["planned"]) for r in result.cell_records)


def test_a_devices_signed_result_replayed_into_another_job_is_refused(signed: dict, tmp_path: Path) -> None:
    """Its genuine result of an earlier run (job) with the same keys and run name, offered first in every
    (round, edge round) of a new one: the header binds the cloud session, a new one per run (a job's in a
    federation); the copies after the first are dropped as a message already seen."""
    cfg = small_config(tmp_path, run={"rounds": 2}, security={"keys": str(signed["keys"])})
    sim = SimHierarchy(cfg)
    fired = replaying(sim, signed["captured"], from_=0)
    result = sim.run()
    assert fired == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert same(result.params, signed["result"].params)
    refusals = rejected(result, "c0")
    assert len(refusals) == 1 and refusals[0]["device"] == "c0-d0", refusals  # its later copies: one message id
    assert "result of session" in refusals[0]["reason"] and "the current one is" in refusals[0]["reason"]


# ------------------------------------------------------------------------------ numbers at the edge of the float range
def lying_device(sim: SimHierarchy, device: str, meta: dict) -> None:
    """``device`` (its own key: a compromised device) sends its genuine results with ``meta`` over theirs."""
    configure = sim.agents.configure

    def compromised(agent) -> None:
        configure(agent)
        if agent.device == device:
            genuine = agent.publish_result
            agent.publish_result = lambda r, *a: genuine(Payload({**r.meta, **meta}, r.tensors), *a)

    sim.agents.configure = compromised


@pytest.mark.parametrize("loss", [1e308, -1e308, 10**400], ids=["1e308", "-1e308", "10^400"])
def test_a_devices_loss_at_the_edge_of_the_float_range_fails_nothing(loss, signed: dict, tmp_path: Path) -> None:
    """The training loss a result reports is the device's word, for the cell's record only. A float whose spread
    from its neighbours' overflows (1e308 beside 2.3) or an int beyond the float range (valid JSON) raised in the
    cell's result handler, which failed the job; now the record leaves out what no float can say."""
    cfg = small_config(tmp_path, run={"rounds": 2}, security={"keys": str(signed["keys"])})
    sim = SimHierarchy(cfg)
    lying_device(sim, "c0-d0", {"loss": loss})
    result = sim.run()
    assert len(result.history) == 2 and same(result.params, signed["result"].params)
    for record in (r for r in result.cell_records if r["cell"] == "c0"):
        assert record["answered"] == ["c0-d0", "c0-d1", "c0-d2"]
        assert all(v is None or math.isfinite(v) for v in (record["loss_mean"], record.get("loss_std"))), record


def test_a_cells_upload_count_beyond_the_float_range_fails_nothing(signed: dict, tmp_path: Path) -> None:
    """A report's ``upload_bytes`` (for the full-model-units metric) is the cell's word: 10^400 (valid JSON) raised
    in the cloud's report handler, which failed the job; now a count beyond 2^53 counts nothing."""
    cfg = small_config(tmp_path, run={"rounds": 2}, security={"keys": str(signed["keys"])})
    sim = SimHierarchy(cfg)
    role = sim.cells["c0"].role
    honest = role.report
    role.report = lambda: Payload({**(r := honest()).meta, "upload_bytes": 10**400}, r.tensors)
    result = sim.run()
    assert len(result.history) == 2 and same(result.params, signed["result"].params)
    honest_units = signed["result"].history[-1]["metrics"]["upload_units_total"]
    assert result.history[-1]["metrics"]["upload_units_total"] == honest_units  # c1's alone: the same per device


def test_numbers_beyond_the_float_range_in_what_the_roles_check_are_refused_not_raised(tmp_path: Path) -> None:
    """JSON bounds no integer: a FedALIGN device's ``probe_loss`` of 10^400 (``math.isfinite`` raised
    OverflowError) failed the cell's job; now it is a logged rejection and every round runs."""
    align = {"name": "fedalign", "priority": ["c0-d1", "c1-d0"], "epsilon": 1.0, "edge_rounds": 1}
    sim = SimHierarchy(small_config(tmp_path, run={"rounds": 2}, algorithm=align))
    lying_device(sim, "c0-d0", {"probe_loss": 10**400})
    result = sim.run()
    assert len(result.history) == 2
    assert any("probe_loss must be a finite number" in x["reason"] for x in rejected(result, "c0"))


@pytest.mark.parametrize("count", [[], "3", None], ids=["a list", "a string", "null"])
def test_a_fedalign_cells_free_device_counts_that_are_no_counts_fail_nothing(count: object, tmp_path: Path) -> None:
    """A FedALIGN report's ``admitted`` and ``refused`` (free devices, summed into the round's metrics) are its cell's
    word: a list or null raised in the cloud's aggregation (``int()`` of it), failing the job; now refused."""
    align = {"name": "fedalign", "priority": ["c0-d1", "c1-d0"], "epsilon": 1.0, "edge_rounds": 1}
    sim = SimHierarchy(small_config(tmp_path, run={"rounds": 2}, algorithm=align))
    role = sim.cells["c0"].role
    honest = role.report
    role.report = lambda: Payload({**(r := honest()).meta, "admitted": count}, r.tensors)
    result = sim.run()
    assert len(result.history) == 2
    refused = [x for r in result.history for x in r["rejected"]]
    assert len(refused) == 2 and all("admitted must be a count" in x["reason"] for x in refused), refused


def test_a_fedmrn_cells_entry_weights_beyond_int64_fail_nothing(tmp_path: Path) -> None:
    """A FedMRN cell that forwards its devices' masks weighs them within its own mean (its own aggregate: its
    word); an entry weight of 10^30 (beyond int64: numpy's ``isfinite`` raised TypeError) failed the cloud's job.
    Equal weights, however large, are the same mean: the model is the clean run's (to float rounding)."""
    cfg = small_config(tmp_path, run={"rounds": 2}, algorithm={"name": "fedmrn", "cell_uplink": "masks"})
    clean = run_simulation(cfg, write_output=False)
    sim = SimHierarchy(cfg)
    role = sim.cells["c0"].role
    honest = role.report

    def lying_report() -> Payload:
        r = honest()
        entries = [[e, 10**30, seed] for e, _, seed in r.meta["entries"]]
        return Payload({**r.meta, "entries": entries}, r.tensors)

    role.report = lying_report
    result = sim.run()
    assert len(result.history) == 2 and not [x for r in result.history for x in r["rejected"]]
    assert all(np.allclose(result.params[k], clean.params[k], rtol=1e-5, atol=1e-7) for k in clean.params)


def test_a_devices_announced_cores_beyond_the_float_range_do_not_blind_its_cells_exporter(tmp_path: Path) -> None:
    """A device's signed status announces its capabilities; 10^400 cores (valid JSON) made every scrape of its cell's
    metrics port raise (the exporter's float of it), hiding the whole cell. Now that number is left out, as is a
    boolean (``true`` is no memory size: e98171c's MiB-to-bytes product made it 1 MiB)."""
    from prometheus_client import generate_latest

    from protocols.status import encode_status
    from tests.conftest import exported_cell

    cfg, hub, cell, exporter, peer = exported_cell(tmp_path)
    for device, cores in (("c0-d0", 10**400), ("c0-d1", 4)):
        topic = topics.device_status(cfg.run.name, "c0", device)
        caps = {"wire": 1, "cores": cores, "memory_mb": 10**30 if cores != 4 else True}
        peer.publish(topic, encode_status("online", topic=topic, cell="c0", samples=10, caps=caps), retain=True)
    hub.loop.run(until=lambda: {"c0-d0", "c0-d1"} <= set(cell.caps))
    text = generate_latest(exporter.registry).decode()
    assert 'fedtier_device_online{cell="c0",device="c0-d0",run="t"} 1.0' in text
    assert 'fedtier_device_cores{cell="c0",device="c0-d1",run="t"} 4.0' in text
    assert 'fedtier_device_cores{cell="c0",device="c0-d0"' not in text
    assert 'fedtier_device_memory_bytes{cell="c0",device="c0-d0",run="t"} 1.048576e+36' in text  # 10**30 MiB
    assert 'fedtier_device_memory_bytes{cell="c0",device="c0-d1"' not in text  # true


@pytest.mark.parametrize(
    "field, value",
    [("since", 10**400), ("waiting_count", "x"), ("waiting", [1, None])],
    ids=["since 10^400", "waiting_count x", "waiting numbers"],
)
def test_a_cells_signed_state_record_that_readers_cannot_compute_with_is_refused(field: str, value: object) -> None:
    """A cell's current-state record (signed with its own key, on its own topic) is read by ``fedtier monitor``:
    a ``since`` of 10^400, a ``waiting_count`` that is no number or a ``waiting`` of numbers made its frame raise
    (the live view died). Now the record is refused where it is decoded, and the frame shows the rest."""
    from monitor.state import MonitorState
    from monitor.view import render_text
    from protocols.state import decode_state
    from protocols.wire.keys import PublicKeys, Trust, generate_keys
    from protocols.wire.signed import seal_record

    ring = generate_keys(parse_config({"topology": {"cells": 1, "devices_per_cell": 1}}).topology)
    topic = topics.state("t", "cell.c0")
    good = {"node": "cell.c0", "phase": "waiting", "since": 100.0, "waiting": ["c0-d0"], "deadline_s": 5, "round": 1}
    sign = Trust("c0", ring.private["c0"], ring.public).sign
    keys = PublicKeys(ring.public)
    assert decode_state(seal_record(good, topic, sign), topic, keys) == good
    bad = seal_record({**good, field: value}, topic, sign)
    assert decode_state(bad, topic, keys) is None
    state = MonitorState()
    state.add_state({**good, field: value})  # what the monitor did with it
    with pytest.raises((OverflowError, ValueError, TypeError)):
        render_text(state, now=200.0)


def test_a_devices_unfit_reason_of_any_length_is_shown_as_its_cell_keeps_it() -> None:
    """A device's 'cannot serve' reason (and job) in its signed idle status may fill the 64 KB of a record:
    ``fedtier fleet`` showed it all (thousands of table lines for one device, in --json too). It shows it cut at
    ``MAX_REASON``, as the device's cell keeps it."""
    from rich.console import Console

    from monitor.fleet import Fleet, render
    from protocols.failures import MAX_REASON
    from protocols.status import idle_status
    from protocols.wire.keys import PublicKeys, Trust, generate_keys

    ring = generate_keys(parse_config({"topology": {"cells": 1, "devices_per_cell": 1}}).topology)
    fleet = Fleet("t", PublicKeys(ring.public))
    topic = topics.device_status("t", "c0", "c0-d0")
    trust = Trust("c0-d0", ring.private["c0-d0"], ring.public)
    fleet.on_status(topic, idle_status(topic, trust, unfit={"session": "j" * 20_000, "reason": "x " * 20_000}))
    shown = fleet.nodes["c0-d0"].as_dict(0.0)["cannot_serve"]
    assert shown is not None and len(shown["job"]) == len(shown["reason"]) == MAX_REASON
    out = Console(width=200, record=True)
    out.print(render(fleet))
    assert len(out.export_text().splitlines()) < 20


def test_a_late_masked_result_that_cannot_be_summed_is_refused_for_what_it_holds() -> None:
    """Under secure aggregation a device cut off from a round answers after it closed: its first answer is 'late'
    (no alert) unless what it holds is broken. The cell's check asked for the masked phase and the device's shares
    first, so a late masked vector that matches no layout, sent while the aggregation is past that phase or by a
    device without shares in it, was 'late': the alert a broken result raises was lost. Its content is judged
    first now."""
    from protocols.answers import Answers
    from protocols.rejections import RejectKind
    from tests.test_secagg import Round

    r = Round(4)
    r.setup()
    r.send_results(drop=("c0-d3",))  # c0-d3 is cut off: the result phase closes without it
    r.cell.unmask_requests()
    good = r.devices["c0-d3"].mask(r.results["c0-d3"])
    short = Payload(dict(good.meta), {"masked": good.tensors["masked"][:-1]})
    answers = Answers("device")
    answers.open((1, 0), ["c0-d0", "c0-d3"])
    answers.close()
    answers.open((1, 1), ["c0-d0", "c0-d3"])
    refused = answers.offer("c0-d3", "c0-d3", (1, 0), short, lambda d, p: r.cell.check_masked(d, p) and None)
    assert refused is not None and refused.kind is RejectKind.SHAPE
    with pytest.raises(Rejected) as stray:
        r.cell.check_masked("c0-d9", short)  # a device never planned: its broken vector is still named broken
    assert stray.value.kind is RejectKind.SHAPE


def test_a_cell_cannot_give_the_monitor_a_jobs_end_state_the_cloud_did_not_sign() -> None:
    """The cloud's retained end state (phase, round, accuracy, loss) is what ``fedtier monitor`` shows of a job that
    ended before it started: a cell with valid keys that writes one (signed with its own key) on the cloud's state
    topic, or on its own topic naming the cloud, is refused; the cloud's own is taken."""
    from protocols.state import decode_state
    from protocols.wire.keys import PublicKeys, Trust, generate_keys
    from protocols.wire.signed import seal_record

    ring = generate_keys(parse_config({"topology": {"cells": 1, "devices_per_cell": 1}}).topology)
    keys = PublicKeys(ring.public)
    end = {"node": "cloud", "phase": "finished", "since": 1.0, "waiting": [], "round": 9, "accuracy": 0.99}
    cloud_topic, own_topic = topics.state("t", "cloud"), topics.state("t", "cell.c0")
    cell = Trust("c0", ring.private["c0"], ring.public).sign
    assert decode_state(seal_record(end, cloud_topic, cell), cloud_topic, keys) is None
    assert decode_state(seal_record(end, own_topic, cell), own_topic, keys) is None
    cloud = Trust("cloud", ring.private["cloud"], ring.public).sign
    assert decode_state(seal_record(end, cloud_topic, cloud), cloud_topic, keys) == end


def test_a_devices_announced_memory_beyond_the_float_range_does_not_break_the_fleet_view() -> None:
    """``fedtier fleet`` shows each device's announced memory in GiB: 10^400 MB (in its own signed status) made the
    table raise; now that cell of the table is left empty."""
    from rich.console import Console

    from monitor.fleet import Fleet, render
    from protocols.status import encode_status
    from protocols.wire.keys import PublicKeys, Trust, generate_keys

    ring = generate_keys(parse_config({"topology": {"cells": 1, "devices_per_cell": 2}}).topology)
    fleet = Fleet("t", PublicKeys(ring.public))
    for device, memory in (("c0-d0", 10**400), ("c0-d1", 2048)):
        topic = topics.device_status("t", "c0", device)
        trust = Trust(device, ring.private[device], ring.public)
        fleet.on_status(topic, encode_status("online", topic=topic, trust=trust, caps={"memory_mb": memory}))
    out = Console(width=200, record=True)
    out.print(render(fleet))
    assert fleet.refused == 0 and "2.0 GiB" in out.export_text()


TERMINAL_ATTACK = "\x1b]0;owned\x07\x1b[2J\x9b31m\u202eevil\x1b[0m"
"""What a node with valid keys may write where an operator's terminal shows it: a title set, the screen cleared
(ESC and the C1 CSI), a line reordered (RIGHT-TO-LEFT OVERRIDE)."""


def test_terminal_control_sequences_in_a_nodes_text_never_reach_the_operators_terminal() -> None:
    """A device's unfit reason and announced version (its signed idle status, shown by ``fedtier fleet``), a
    reason logged by a node and a job's reason in the live monitor are the senders' word: rich passed ESC and C1
    controls through as they are, so a device drove the terminal of whoever ran ``fedtier fleet``. Every console
    of the CLI and the monitor shows them escaped (``\\x1b``)."""
    import io
    import logging

    from fedtier import console as cli
    from monitor.fleet import Fleet, render
    from monitor.state import MonitorState
    from monitor.view import render_text
    from protocols.status import IDLE, idle_status
    from protocols.wire.keys import PublicKeys, Trust, generate_keys

    log = logging.getLogger("fedtier.test")
    ring = generate_keys(parse_config({"topology": {"cells": 1, "devices_per_cell": 1}}).topology)
    fleet = Fleet("t", PublicKeys(ring.public))
    topic = topics.device_status("t", "c0", "c0-d0")
    trust = Trust("c0-d0", ring.private["c0-d0"], ring.public)
    unfit = {"session": "job.0", "reason": TERMINAL_ATTACK}
    fleet.on_status(topic, idle_status(topic, trust, unfit=unfit))
    assert fleet.nodes["c0-d0"].state == IDLE and fleet.nodes["c0-d0"].unfit() is not None
    shown = []
    was = cli.console._file  # None: the console writes to whatever sys.stderr is when it prints (CliRunner's)
    level = logging.getLogger().level
    try:
        for say in (lambda: cli.console.print(render(fleet)), lambda: log.warning("c0-d0: %s", TERMINAL_ATTACK)):
            cli.console.file = io.StringIO()
            cli.setup_logging(1)
            say()
            shown.append(cli.console.file.getvalue())
    finally:
        cli.console._file = was  # (not .file, which reads back the stderr of now: pinned, later tests print there)
        logging.getLogger().handlers.clear()
        logging.getLogger().setLevel(level)  # setup_logging(1) set INFO: not for the tests after it in this process
    state = MonitorState()
    state.jobs = [{"job": "job.0", "state": "failed", "reason": TERMINAL_ATTACK, "ended": 0.0}]
    shown.append(render_text(state, now=0.0, width=400))
    fleet_table, logged, monitor = shown
    assert "\\x1b" in fleet_table  # the unfit reason, cut at the 80 columns of its table
    assert (
        "\\x1b]0;owned" in logged and "\\x1b]0;owned" in monitor and "\\u202e" in monitor
    )  # (cut: widths are measured before)
    assert not any(c in text for text in shown for c in "\x1b\x07\x9b\u202e")


def test_metadata_nested_past_32_levels_is_refused_where_it_is_decoded() -> None:
    """JSON nested to the parser's limit (~1000 levels, one ``loads`` of a 2 KB string) decodes, and leaves every
    recursive walk or re-encoding of it in the receiver (its journal, its records) a few stack frames from raising:
    whether it does depends on where the receiver stands. Metadata now nests at most 32 levels, checked without
    recursion where it is decoded, before any consumer."""
    import json
    import struct

    from protocols.wire.envelope import WireError
    from protocols.wire.payload import MAX_META_DEPTH, decode_payload, encode_payload

    def with_meta(text: str) -> bytes:
        base = encode_payload(Payload({}, {"w": np.zeros(2, np.float32)}))
        (n,) = struct.unpack_from("<I", base, 0)
        return struct.pack("<I", len(text)) + text.encode() + bytes(base[4 + n :])

    def nest(levels: int) -> str:  # the meta object itself is a level
        return '{"weight": 1, "x": ' + "[" * (levels - 1) + "]" * (levels - 1) + "}"

    ok = decode_payload(with_meta(nest(MAX_META_DEPTH)))
    assert ok.meta["weight"] == 1 and json.dumps(ok.meta).count("[") == MAX_META_DEPTH - 1
    for levels in (MAX_META_DEPTH + 1, 900):
        with pytest.raises(WireError, match=f"nested deeper than {MAX_META_DEPTH} levels"):
            decode_payload(with_meta(nest(levels)))


def test_a_cells_declared_counts_beyond_int64_reach_no_record_and_no_view(tmp_path: Path) -> None:
    """A report declares its devices' traffic and counts (the cell's word): 10^400 there went into the cloud's
    round records as it was. A cell's own aggregation record (its telemetry, which the cloud keeps in its run folder)
    with a round of 10^400 made ``fedtier monitor`` raise (a float of it). A declared count now counts up to 2^40
    (else nothing), and a record holds int64 counts only: the cloud's records parse and show, the forged one is a
    bad record."""
    import json

    from monitor.state import MonitorState
    from monitor.view import render_text
    from protocols.records import parse_record

    sim = SimHierarchy(small_config(tmp_path, run={"rounds": 2}))
    messenger = sim.cells["c0"].messenger
    frame = messenger.frame  # the report as it leaves, the counts its cell declares included
    huge = {"traffic": {"cell_to_device": 10**400, "device_to_cell": 10**400}, "devices": 10**400, "late": 10**400}

    def lying_frame(kind, payload, **kw):
        if kind == "cell_report":
            payload = Payload({**payload.meta, **huge}, payload.tensors)
        return frame(kind, payload, **kw)

    messenger.frame = lying_frame
    result = sim.run()
    assert len(result.history) == 2
    assert all(r["devices"]["c0"] == 0 and r["bytes"]["device_to_cell"] < 2**40 for r in result.history)
    state = MonitorState()
    for record in result.history:
        state.add(parse_record(json.dumps(record)), 0.0)
    render_text(state, now=1.0)
    forged = {**result.cell_records[0], "round": 10**400}
    with pytest.raises(ValueError, match="round"):
        parse_record(json.dumps(forged))


# ------------------------------------------------------------------------------ a cell's priority statistics (FedALIGN)
def fedalign_config() -> dict:
    return {
        "run": {"name": "fa", "rounds": 3, "seed": 3},
        "topology": {"cells": 2, "devices_per_cell": 3},
        "algorithm": {
            "name": "fedalign",
            "priority": ["c0-d1", "c1-d0"],
            "local_steps": 3,
            "lr": 0.1,
            "epsilon": 1.0,
            "warmup_rounds": 1,
        },
        "model": {"name": "logreg"},
        "data": {"dataset": "digits", "partition": "shards", "shards_per_device": 2, "max_train": 600},
    }


def test_a_cell_claiming_a_huge_priority_weight_cannot_set_fedaligns_priority_loss() -> None:
    """FedALIGN's F (the priority loss that decides which free devices every cell admits) is the cells'
    ``prio_loss`` sums over their ``prio_weight`` sums. A lying c1 claims 10^12 priority samples of loss 50:
    before the bound F was 50 and no free device anywhere was admitted; now its reports are refused."""
    cfg = parse_config(fedalign_config())
    clean = run_simulation(cfg, write_output=False)
    sim = SimHierarchy(cfg)
    role = sim.cells["c1"].role
    honest = role.report

    def lying_report() -> Payload:
        r = honest()
        if not r.meta.get("prio_weight"):
            return r
        return Payload({**r.meta, "prio_weight": 1e12, "prio_loss": 50e12, "prio_accuracy": 0.0}, r.tensors)

    role.report = lying_report
    result = sim.run()
    refused = [x for r in result.history for x in r["rejected"]]
    assert refused and all(x["from"] == "c1" and "prio_weight: weight 1e+12 exceeds" in x["reason"] for x in refused)
    clean_f, f = clean.history[2]["metrics"]["F"], result.history[2]["metrics"]["F"]
    assert math.isfinite(f) and f < 2 * clean_f < 50  # c0's priority devices' loss, not the liar's


def test_a_fedalign_report_with_more_priority_accuracy_than_weight_is_refused() -> None:
    """Each priority device's accuracy is in [0, 1]: a cell's weighted sum cannot exceed its weight."""
    cfg = parse_config(fedalign_config())
    cloud = FedAlignCloud(cfg.train, {"w": np.zeros(3, np.float32)})  # type: ignore[arg-type]
    cloud.plan(0, ["c0"])
    meta = {"phase": "solo", "prio_weight": 10.0, "prio_loss": 20.0, "weight": 0}
    cloud.check("c0", Payload({**meta, "prio_accuracy": 10.0}, {}))  # every priority sample right: taken
    with pytest.raises(Rejected, match="prio_accuracy 11 above prio_weight 10"):
        cloud.check("c0", Payload({**meta, "prio_accuracy": 11.0}, {}))


@pytest.mark.parametrize(
    "c0, c1",
    [
        ((0.0, 0.0), (1e-300, 1e10)),  # c0 has no priority device this round; c1's mean loss is beyond the floats
        ((1.0, 1e308), (1.0, 1e308)),  # two cells' sums: each finite, their sum not
    ],
)
def test_fedalign_priority_figures_whose_mean_overflows_fail_no_job(
    c0: tuple[float, float], c1: tuple[float, float]
) -> None:
    """Each within every check (finite, within its bound, accuracy under weight), cells' priority figures can still
    take F beyond the float range: F was inf, the cloud could not encode the next task (ValueError: the job failed)
    and its round record held an inf. Such a round now has no F, as one without priority devices (no free device
    is admitted), and the job goes on."""
    from protocols.wire.payload import encode_payload

    cloud = FedAlignCloud(parse_config(fedalign_config()).train, {"w": np.zeros(3, np.float32)})  # type: ignore[arg-type]
    for rnd in range(3):  # solo, priority, free
        cloud.plan(rnd, ["c0", "c1"])
        meta = {"phase": cloud.phase, "prio_accuracy": 0.0, "weight": 0}
        reports = {
            cell: Payload({**meta, "prio_weight": weight, "prio_loss": loss}, {})
            for cell, (weight, loss) in (("c0", c0), ("c1", c1))
        }
        for cell, report in reports.items():
            cloud.check(cell, report)
        metrics = cloud.aggregate(rnd, reports).metrics
        assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
        encode_payload(cloud.plan(rnd + 1, ["c0", "c1"])["c0"])
    assert cloud.F is None


def test_a_fedalign_priority_devices_loss_at_the_edge_of_the_float_range_fails_no_job() -> None:
    """A priority device's probe loss is its word: 1e308 (finite, as checked) times its sample count overflowed its
    cell's priority sum to inf, which no report can carry (the cell's handler raised ValueError, failing the job).
    The cell's sums now stay floats, and the job runs every round."""
    cfg = parse_config(fedalign_config())
    sim = SimHierarchy(cfg, write_output=False)
    lying_device(sim, "c0-d1", {"probe_loss": 1e308})
    result = sim.run()
    assert result.failed is None and len(result.history) == 3
    numbers = [v for r in result.history for v in r["metrics"].values() if isinstance(v, float)]
    assert numbers and all(math.isfinite(v) for v in numbers)


def _c0_also_names(sim: SimHierarchy, extra: list[str]) -> None:
    """Cell c0 (its own key) reports its devices and ``extra`` as answered, its weight one a name."""
    role = sim.cells["c0"].role
    honest = role.report

    def lying() -> Payload:
        r = honest()
        answered = [*r.meta["answered"], *extra]
        return Payload({**r.meta, "answered": answered, "weight": len(answered)}, r.tensors)

    role.report = lying


def test_a_decomfl_cell_cannot_count_devices_it_does_not_have(tmp_path: Path) -> None:
    """DeComFL (uniform weighting, its default) weighs a cell by the devices it says answered. c0 (its own key)
    listing 717 made-up ids beside its 3 devices claimed 720 (within its sample bound) against c1's 3, took
    240 times its share of the scalars, and left 717 ghost entries in the cloud's synced table. A report's device
    lists (CloudRole.member_keys) may now name only the cell's devices (the topology's, or the roster's)."""
    cfg = small_config(
        tmp_path,
        run={"rounds": 2},
        algorithm={"name": "decomfl", "local_steps": 1, "perturbations": 2, "lr": 0.02, "edge_rounds": 1},
    )
    sim = SimHierarchy(cfg)
    _c0_also_names(sim, [f"ghost{i}" for i in range(717)])
    result = sim.run()
    refused = [x for r in result.history for x in r["rejected"]]
    assert len(refused) == 2 and all("answered names 'ghost0', not a device of cell c0" in x["reason"] for x in refused)
    assert [r["metrics"]["devices"] for r in result.history] == [3, 3]  # c1's only
    assert not any(d.startswith("ghost") for t in sim.cloud.role.synced.values() for d in t)


def test_a_decomfl_cell_naming_another_cells_device_is_refused_without_a_weight_bound(tmp_path: Path) -> None:
    """The device-list check rode on the weight bounds: a deployed cloud with neither a roster nor
    ``security.max_device_weight`` (``cloud.node.config_cell_bounds``: no bounds) took c0's report naming c1's device
    c1-d0 beside its own, counting it twice. The lists are checked against the topology whatever the bounds."""
    from cloud.node import config_cell_bounds

    cfg = small_config(
        tmp_path,
        run={"rounds": 2},
        algorithm={"name": "decomfl", "local_steps": 1, "perturbations": 2, "lr": 0.02, "edge_rounds": 1},
    )
    assert cfg.security.max_device_weight is None
    sim = SimHierarchy(cfg)
    sim.cloud.cell_bounds = config_cell_bounds(cfg)  # what build_cloud takes without a launcher's bounds
    assert not sim.cloud.cell_bounds  # no weight bound known
    _c0_also_names(sim, ["c1-d0"])
    result = sim.run()
    refused = [x for r in result.history for x in r["rejected"]]
    assert len(refused) == 2 and all("answered names 'c1-d0', not a device of cell c0" in x["reason"] for x in refused)
    assert [r["metrics"]["devices"] for r in result.history] == [3, 3]  # c1's only


def test_a_fedbuff_cell_cannot_claim_a_fresher_base_than_the_cloud_sent_it(tmp_path: Path) -> None:
    """FedBuff weighs a push by its staleness (1/sqrt(1 + s) of the version it names as its base): c0 (its own key)
    naming the cloud's current version while it still trained on an older one took the weight of a fresh push, up
    to sqrt(1 + max_staleness) times its due. The cloud now refuses a base newer than the last version it sent that
    cell; an honest run is refused nothing."""
    algorithm = {
        "name": "fedavg",
        "mode": "async",
        "async_buffer": 2,
        "cell_aggregator": "mean",
        "cloud_aggregator": "mean",
        "edge_rounds": 1,
    }
    # a latency: the cells' pushes come apart, so a version goes to one cell and the other's lie names a version
    # never sent to it (pushes that come together make one version, sent to both: cloud.async_server)
    clock = {"device_steps_per_s": 10.0, "latency_s": 0.01}
    honest = SimHierarchy(small_config(tmp_path / "honest", run={"rounds": 8}, algorithm=algorithm, clock=clock)).run()
    assert not [x for r in honest.history for x in r["rejected"]]
    sim = SimHierarchy(small_config(tmp_path / "lie", run={"rounds": 8}, algorithm=algorithm, clock=clock))
    messenger = sim.cells["c0"].messenger
    frame, lies = messenger.frame, []

    def fresher(kind, payload, **kw):
        if kind == "cell_report" and kw["round"] < sim.cloud.round:
            lies.append(kw["round"])
            kw = {**kw, "round": sim.cloud.round}
        return frame(kind, payload, **kw)

    messenger.frame = fresher
    result = sim.run()
    refused = [x for r in result.history for x in r["rejected"]]
    assert lies and len(result.history) == 8
    assert refused and all(x["from"] == "c0" and "which was never sent to it" in x["reason"] for x in refused)


# ------------------------------------------------------------------------------ a cell repeating its own reports
def repeating_c0(sim: SimHierarchy) -> dict[str, Any]:
    """c0, with its own key, repeats its genuine reports on purpose (an honest cell repeats its last one once,
    restarted from its journal): whenever it gets the first task of a cloud round, every report it sent before,
    newest first, three times over (it is still awaited), then c1's last report on c0's topic and its own last
    on c1's (signed for another topic); after each report it sends, that report three times more. Returns what
    it sent (``repeats``, ``forged``), the repeats the cloud got before the run ended, the tasks c0 got by round,
    and every refusal the cloud logged."""
    run, intruder = sim.cfg.run.name, sim.hub.connect("intruder")
    seen: dict[str, list[bytes]] = {"c0": [], "c1": []}
    out: dict[str, Any] = {"repeats": 0, "taken_repeats": 0, "forged": 0, "tasks": Counter(), "refused": []}
    reject = sim.cloud.messenger.reject

    def refused(topic, kind, reason, sender):
        out["refused"].append((str(kind), sender, reason))
        reject(topic, kind, reason, sender)

    def publish(cell: str, data: bytes, times: int) -> None:
        for _ in range(times):
            intruder.publish(topics.cell_report(run, cell), data, qos=1)
        out["repeats" if data in seen[cell] else "forged"] += times

    def on_report(topic: str, data: bytes) -> None:
        cell = topic.split("/")[-2]
        if all(data not in sent for sent in seen.values()):  # a report as its cell sent it (not a copy)
            seen[cell].append(data)
            if cell == "c0":
                publish("c0", data, 3)

    def on_task(topic: str, data: bytes) -> None:
        rnd = decode_message(data)[0].round
        out["tasks"][rnd] += 1
        if out["tasks"][rnd] > 1 or not seen["c0"]:
            return
        for old in [*reversed(seen["c0"])] * 3:  # reordered, older rounds, many times
            publish("c0", old, 1)
        if seen["c1"]:
            publish("c0", seen["c1"][-1], 1)  # another cell's signature on c0's topic
        publish("c1", seen["c0"][-1], 1)  # c0's own on c1's topic

    receive = sim.cloud.messenger.receive

    def received(*args, **kw):
        msg = receive(*args, **kw)
        out["taken_repeats"] += msg is not None and msg.repeat
        return msg

    sim.cloud.messenger.reject = refused  # type: ignore[method-assign]
    sim.cloud.messenger.receive = received  # type: ignore[method-assign]
    spy = sim.hub.connect("spy")
    spy.subscribe(topics.cell_reports(run), on_report)
    spy.subscribe(topics.cell_task(run, "c0"), on_task)
    return out


def test_a_cell_repeating_its_reports_on_purpose_gets_one_task_again_a_round_and_changes_no_model(
    tmp_path: Path,
) -> None:
    """Signed, 4 rounds: c0 repeats its earlier reports (older rounds, reordered, three times each, before it
    answers) and each report it sends (three times more), and sends reports signed for another topic. The
    cloud sends c0 its task again once a round at most (its first repeat of an earlier round while awaited), its
    bytes counted apart (``bytes_resent``: the round's ``bytes`` are the honest run's); every later repeat is
    refused as ``replay`` and on the record, the reports signed for another topic as ``signature``; the model is
    the honest run's, byte for byte."""
    config = {"run": {"rounds": 4}, "security": {"keys": str(tmp_path / "keys.toml")}}
    honest = run_simulation(small_config(tmp_path / "honest", **config))
    sim = SimHierarchy(small_config(tmp_path / "repeats", **config))
    attack = repeating_c0(sim)
    result = sim.run()
    assert same(result.params, honest.params)
    assert [h["cells_reported"] for h in result.history] == [["c0", "c1"]] * 4
    assert attack["tasks"] == {0: 1, 1: 2, 2: 2, 3: 2}, attack["tasks"]  # one resend a round, no more
    # the first sends' bytes are the honest run's; each resend is counted apart, the size of c0's task
    assert [h["bytes"] for h in result.history] == [h["bytes"] for h in honest.history]
    resent = [(h.get("bytes_resent") or {}).get("cloud_to_cell", 0) for h in result.history]
    assert resent == [0] + [h["bytes"]["cloud_to_cell"] // 2 for h in honest.history[1:]], resent
    replays = [x for x in attack["refused"] if x[0] == "replay"]
    assert all(sender == "c0" for _, sender, _ in replays)
    assert attack["taken_repeats"] >= attack["repeats"] - 3  # the last report's three came after the end
    assert len(replays) == attack["taken_repeats"] - 4  # one repeat a round is let be (the resend, or dropped)
    assert len([x for x in attack["refused"] if x[0] == "signature"]) == attack["forged"] > 0
    recorded = [x for h in result.history for x in h["rejected"] if x["kind"] == "replay"]
    assert recorded and all(x["from"] == "c0" for x in recorded)


def test_an_async_cell_repeating_its_pushes_on_purpose_gets_one_version_again_a_version_at_most(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same attack on the asynchronous cloud (signed, 8 versions). A repeat of an older push while c0 has pushed
    nothing from the last version it was sent is a restarted cell's sign: the cloud sends c0 the current version,
    once a version (a fresher base, honestly weighed by its staleness; so not the honest run's model byte for byte),
    and every further repeat is refused as ``replay``, on the record."""
    algorithm = {"mode": "async", "async_buffer": 2, "edge_rounds": 1}
    config = {"run": {"rounds": 8}, "algorithm": algorithm, "security": {"keys": str(tmp_path / "keys.toml")}}
    sim = SimHierarchy(small_config(tmp_path / "repeats", **config))
    attack, resends = repeating_c0(sim), Counter()

    def counted(counts, messenger, msg, rnd, pending) -> bool:
        again = resend_on_repeat(counts, messenger, msg, rnd, pending)
        resends[sim.cloud.round] += again
        return again

    monkeypatch.setattr(async_server, "resend_on_repeat", counted)
    result = sim.run()
    assert len(result.history) == 8 and all(np.isfinite(v).all() for v in result.params.values())
    assert sum(resends.values()) > 0 and max(resends.values()) == 1, resends  # once a version at most
    replays = [x for x in attack["refused"] if x[0] == "replay"]
    assert all(sender == "c0" for _, sender, _ in replays)
    assert len(replays) >= attack["taken_repeats"] - (len(result.history) + 1) > 0  # one let be a version
    recorded = [x for h in result.history for x in h["rejected"] if x["kind"] == "replay"]
    assert recorded and all(x["from"] == "c0" for x in recorded)


def test_an_async_cell_asking_for_the_model_again_and_again_gets_one_version_again_a_version_at_most(
    tmp_path: Path,
) -> None:
    """Signed, 8 versions: every time c0 is sent a version, a liar with c0's key flips c0's status between holding a
    model and asking for one (needs_model) three times. Each new ask of a cell heard holding a model is a restarted
    cell's sign: the cloud sends c0 the current version, once a version (RoundCounts.first_resend, the bound of a
    repeated push), never more."""
    from protocols.status import encode_status

    algorithm = {"mode": "async", "async_buffer": 2, "edge_rounds": 1}
    config = {"run": {"rounds": 8}, "algorithm": algorithm, "security": {"keys": str(tmp_path / "keys.toml")}}
    sim = SimHierarchy(small_config(tmp_path / "asks", **config))
    run, tasks = sim.cfg.run.name, Counter()
    status = topics.status(run, topics.cell_node("c0"))
    liar = sim.hub.connect("liar")

    def on_task(topic: str, data: bytes) -> None:
        tasks[decode_message(data)[0].round] += 1
        trust = sim.cells["c0"].trust
        for _ in range(3):
            for ask in (False, True):
                extra = {"needs_model": True} if ask else {}
                liar.publish(status, encode_status("online", topic=status, trust=trust, **extra), retain=True)

    sim.hub.connect("spy").subscribe(topics.cell_task(run, "c0"), on_task)
    result = sim.run()
    assert len(result.history) == 8 and all(np.isfinite(v).all() for v in result.params.values())
    assert max(tasks.values()) == 2, tasks  # its version, and one again at most


def test_another_cells_repeats_on_a_cells_topic_do_not_use_up_that_cells_one_resend_a_round(tmp_path: Path) -> None:
    """Signed, 2 rounds: as c0 gets round 1's task, c1 (its own key, a lying cell) signs a report for c0's topic and
    sends it twice, then c0 repeats its round-0 report, as a cell restarted from its journal does. c1's copies are
    refused as ``wrong_sender``, its repeat included: it is not c0's one repeat of the round, so c0 is sent its task
    again (before, c1's repeat counted as c0's and c0's own was refused as ``replay``: a cell that lost its task then
    waited out its deadline)."""
    config = {"run": {"rounds": 2}, "security": {"keys": str(tmp_path / "keys.toml")}}
    sim = SimHierarchy(small_config(tmp_path / "run", **config))
    run, intruder, spy = sim.cfg.run.name, sim.hub.connect("intruder"), sim.hub.connect("spy")
    reports: list[bytes] = []
    tasks: Counter[int] = Counter()
    refused: list[tuple[str, str]] = []
    reject = sim.cloud.messenger.reject

    def refusing(topic, kind, reason, sender):
        refused.append((str(kind), reason))
        reject(topic, kind, reason, sender)

    def on_task(topic: str, data: bytes) -> None:
        rnd = decode_message(data)[0].round
        tasks[rnd] += 1
        if rnd == 1 and tasks[rnd] == 1:
            forged = sim.cells["c1"].messenger.frame(
                "cell_report", Payload({"weight": 1.0}), round=0, cell="c0", topic=topics.cell_report(run, "c0")
            )
            for data in (forged, forged, reports[0]):
                intruder.publish(topics.cell_report(run, "c0"), data, qos=1)

    sim.cloud.messenger.reject = refusing  # type: ignore[method-assign]
    spy.subscribe(topics.cell_report(run, "c0"), lambda topic, data: reports.append(data))
    spy.subscribe(topics.cell_task(run, "c0"), on_task)
    result = sim.run()
    assert [h["cells_reported"] for h in result.history] == [["c0", "c1"]] * 2
    assert tasks == {0: 1, 1: 2}, (tasks, refused)  # c0's repeat got its task again
    assert [kind for kind, _ in refused] == ["wrong_sender", "wrong_sender"], refused


# ------------------------------------------------------------------------------ a device's masked input (SecAgg+)
def secure_sum(shift: float) -> object:
    """One SecAgg+ aggregation of 6 devices of weight 1 (updates ~ N(0, 0.1), clip bound 1) in which c0-d0 (its
    own keys) adds ``shift`` to coordinate 0 of the sum through its masked vector, past its own clipping (a mask is
    additive mod 2^32: the cell cannot tell). The outcome: the unmasked weighted sum, or the failure."""
    from protocols.privacy.secagg import RoundId, SecAggCell, SecAggDevice, SecAggFailure, SecAggSettings
    from protocols.privacy.secagg.encoding import scale_for
    from protocols.wire.keys import Trust, new_seed, public_of
    from protocols.wire.payload import decode_payload, encode_payload

    def wire(p: Payload) -> Payload:
        return decode_payload(encode_payload(p))

    settings, rid = SecAggSettings(seed=3), RoundId("r", "c0", 0, 0)
    names = [f"c0-d{i}" for i in range(6)]
    seeds = {d: new_seed() for d in names}
    public = {d: public_of(s) for d, s in seeds.items()}
    devices = {d: SecAggDevice(settings, rid, d, 1.0, identity=Trust(d, seeds[d], public)) for d in names}
    g = np.random.default_rng(0)
    results = {d: Payload({"weight": 1.0}, {"w": g.normal(0, 0.1, 8).astype(np.float32)}) for d in names}
    cell = SecAggCell(settings, rid, names)
    for d, dev in devices.items():
        cell.add_keys(d, wire(dev.advertise()))
    for d, roster in cell.rosters().items():
        cell.add_shares(d, wire(devices[d].share(wire(roster))))
    for d, routed in cell.routes().items():
        devices[d].receive(wire(routed))
    for d in names:
        masked = wire(devices[d].mask(results[d]))
        if d == "c0-d0":
            vec = masked.tensors["masked"].copy()
            step = int(round(shift * scale_for(settings, cell.total_weight))) & 0xFFFFFFFF
            vec[0] = np.uint32((int(vec[0]) + step) & 0xFFFFFFFF)
            masked = Payload(masked.meta, {"masked": vec})
        cell.add_masked(d, masked)
    for d, req in cell.unmask_requests().items():
        cell.add_consent(d, wire(devices[d].consent(wire(req))))
    for d, views in cell.views().items():
        cell.add_reveal(d, wire(devices[d].reveal(wire(views))))
    try:
        return cell.finish()
    except SecAggFailure as exc:
        return exc


def test_a_devices_masked_input_moves_the_cells_mean_anywhere_in_the_clip_box_and_no_further() -> None:
    """Under secure aggregation the cell sees only the sum (Z_2^32, scaled so the clip bound x the total weight just
    fits): a device's masked input is not clipped by anyone but itself. c0-d0 (weight 1 of 6) moves coordinate 0 of
    the sum by 4, four times one device's honest reach, and nothing refuses it: the limit the security page states.
    What holds: the sum wraps within the box, so the cell's mean stays within the clip bound, whatever it sends."""
    from protocols.privacy.secagg import SecAggFailure

    honest = secure_sum(0.0)
    within = secure_sum(4.0)
    assert not isinstance(honest, SecAggFailure) and not isinstance(within, SecAggFailure)
    moved = within.weighted_sum["w"][0] - honest.weighted_sum["w"][0]  # type: ignore[union-attr]
    assert moved == pytest.approx(4.0, abs=1e-3)
    for shift in (8.0, 1e6, -1e6):
        out = secure_sum(shift)
        assert not isinstance(out, SecAggFailure)
        mean = out.weighted_sum["w"] / sum(out.weights.values())  # type: ignore[union-attr]
        assert np.all(np.abs(mean) <= 1.0 + 1e-6), mean  # the clip bound (SecAggSettings.bound)


# ------------------------------------------------------------------------------ statuses for another node
def test_a_status_signed_by_another_node_hides_no_node_and_shows_none_alive() -> None:
    """A status record's signer is the node its topic names: c0-d0's own key signing ``offline`` on c0-d1's topic
    (to hide it) and the cell's key signing ``online`` on c0-d2's (the cell may write its devices' status topics, to
    clear a revoked one: to show a dead device alive) are refused by the cell's and the fleet view's checks."""
    from monitor.fleet import Fleet
    from protocols.status import decode_status, encode_status
    from protocols.wire.keys import PublicKeys, Trust, generate_keys

    ring = generate_keys(parse_config({"topology": {"cells": 1, "devices_per_cell": 3}}).topology)
    keys = PublicKeys(ring.public)

    def signed_by(node: str, state: str, device: str) -> tuple[str, bytes]:
        topic = topics.device_status("t", "c0", device)
        return topic, encode_status(state, topic=topic, trust=Trust(node, ring.private[node], ring.public), cell="c0")

    fleet = Fleet("t", keys)
    genuine = [signed_by("c0-d1", "online", "c0-d1"), signed_by("c0-d2", "offline", "c0-d2")]
    forged = [signed_by("c0-d0", "offline", "c0-d1"), signed_by("c0", "online", "c0-d2")]
    for topic, data in genuine + forged:
        fleet.on_status(topic, data)
    for topic, data in forged:
        assert decode_status(data, topic, keys) is None  # as the cell reads its devices' statuses
    states = {v.node: v.state for v in fleet.rows()}
    assert fleet.refused == 2 and states == {"c0-d1": "online", "c0-d2": "offline"}, states


def test_terminal_control_sequences_in_a_nodes_text_reach_no_log_line_raw(tmp_path: Path) -> None:
    """A cell logs a device's 'cannot serve' reason, and an exception that quotes a peer's text, as they are: a
    ``fedtier run|sim`` worker logged them to stderr (a terminal, or a log file read later with ``cat``) with the
    device's ESC, C1 and bidi characters raw. Every handler fedtier sets up formats through ``SafeFormatter``:
    the worker's (``log_to_stderr``, to a file here), the CLI's (its RichHandler), and no module of fedtier or its
    benchmarks makes another (a new one would have to be made safe the same way)."""
    import ast
    import logging

    from cell_server.liveness import Liveness
    from fedtier import console as cli
    from protocols.safe_text import SafeFormatter, log_to_stderr

    root = logging.getLogger()
    before = root.handlers[:], root.level
    path = tmp_path / "worker.log"
    try:
        with open(path, "w") as stream, pytest.MonkeyPatch.context() as mp:
            mp.setattr("sys.stderr", stream)
            log_to_stderr(logging.WARNING, "%(processName)s %(message)s")
            Liveness("c0", ["c0-d0"]).cannot_serve("c0-d0", TERMINAL_ATTACK)
            try:
                raise ValueError(f"bad shape from c0-d0: {TERMINAL_ATTACK}")
            except ValueError:
                logging.getLogger("cell_server").exception("c0-d0's result")
        for terminal in (True, False):  # a terminal: rich's handler; a journal, a file, a pipe: a plain one
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(cli.console, "_force_terminal", terminal)
                cli.setup_logging(0)
            (handler,) = root.handlers
            assert isinstance(handler.formatter, SafeFormatter), handler
    finally:
        root.handlers[:], _ = before
        root.setLevel(before[1])
    logged = path.read_text()
    assert "cannot serve this job: \\x1b]0;owned\\x07\\x1b[2J\\x9b31m\\u202eevil" in logged
    assert logged.count("\\x1b]0;owned") == 2  # the reason, and the message of the exception logged
    assert not any(c in logged for c in "\x1b\x07\x9b\u202e")

    repo = Path(__file__).resolve().parent.parent
    makers = {"basicConfig", "StreamHandler", "FileHandler", "RichHandler", "dictConfig", "fileConfig", "Formatter"}
    made = []
    for package in ("fedtier", "protocols", "sim", "cloud", "cell_server", "edge_agent", "monitor", "benchmarks"):
        for source in sorted((repo / package).rglob("*.py")):
            for node in ast.walk(ast.parse(source.read_text())):
                if isinstance(node, ast.Call):
                    name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                    if name in makers:
                        made.append(f"{source.relative_to(repo)}:{name}")
    assert sorted(set(made)) == [
        "benchmarks/gpu.py:StreamHandler",  # with a SafeFormatter
        "fedtier/console.py:RichHandler",  # its formatter asserted above
        "fedtier/console.py:basicConfig",  # with it, or off a terminal its plain handler (formatter asserted above)
        "protocols/safe_text.py:StreamHandler",
        "protocols/safe_text.py:basicConfig",
    ]


def test_a_peers_line_break_cannot_forge_a_log_record() -> None:
    """A device's reason with a line break and a record-like line after it ('cannot serve: x\\nINFO c1: all
    devices answered') was logged as two lines, the second one the device's. Every line a ``SafeFormatter`` writes
    at the margin is one it began: the message's own breaks go on indented, an exception's traceback is as it was,
    and a lone carriage return is written as its escape."""
    import logging

    from protocols.safe_text import CONTINUATION, SafeFormatter

    formatter = SafeFormatter("%(levelname)s %(name)s: %(message)s")
    forged = "x\nINFO cell_server: c0 all devices answered\rINFO cloud: fine"
    record = logging.LogRecord("cell_server", logging.WARNING, __file__, 1, "c0-d0 cannot serve: %s", (forged,), None)
    try:
        raise ValueError("shape")
    except ValueError:
        import sys

        record.exc_info = sys.exc_info()
    lines = formatter.format(record).split("\n")
    assert lines[0] == "WARNING cell_server: c0-d0 cannot serve: x"
    assert lines[1] == CONTINUATION[1:] + "INFO cell_server: c0 all devices answered\\rINFO cloud: fine"
    assert lines[2] == "Traceback (most recent call last):"  # the traceback's own lines stay as Python wrote them
    assert [line for line in lines if line.startswith("INFO")] == []
    assert record.getMessage().count("\n") == 1  # the record itself is left as it was, for other handlers


def test_peer_text_in_a_runs_records_runs_no_script_in_the_report_and_drives_no_terminal_in_logs(
    tmp_path: Path,
) -> None:
    """A run's records hold its cells' words: a cell's name, its algorithm (the report's label when the folder has
    no config), a device's absence reason, and a line that is no record at all. ``fedtier report`` writes them
    HTML-escaped (no ``<script>`` or event handler the operator's browser would run) and its plots still draw;
    ``fedtier logs`` shows them with their control characters escaped, in its table and as JSON."""
    import json
    from html.parser import HTMLParser

    from click.testing import CliRunner

    from fedtier.cli import main
    from monitor.report import write_report
    from protocols import runfiles

    out = run_simulation(small_config(tmp_path, run={"rounds": 1})).output_dir
    script = '<script>alert("x")</script><img src=x onerror=alert(1)>'
    lines = (out / runfiles.AGGREGATION).read_text().splitlines()
    forged = []
    for line in lines:
        record = json.loads(line)
        record.update(cell=f"c0{script}", algorithm=f"{script}$\\notacommand$")
        record["absent"] = {"c0-d0": TERMINAL_ATTACK + script}
        forged.append(json.dumps(record))
    (out / runfiles.AGGREGATION).write_text("\n".join(forged) + "\n")
    (out / runfiles.CONFIG).unlink()
    with open(out / runfiles.METRICS, "a") as f:
        f.write(f"{script}\n")

    page = write_report([out], tmp_path / "report.html")[0].read_text()
    tags: list[tuple[str, list[tuple[str, str | None]]]] = []
    parser = HTMLParser()
    parser.handle_starttag = lambda tag, attrs: tags.append((tag, attrs))  # type: ignore[method-assign]
    parser.feed(page)
    assert {tag for tag, _ in tags} == {
        "html",
        "head",
        "meta",
        "title",
        "style",
        "body",
        "h1",
        "h2",
        "table",
        "tr",
        "th",
        "td",
        "img",
        "pre",
    }
    assert not [a for _, attrs in tags for a, _ in attrs if a.startswith("on")]  # no event handler
    assert all(dict(attrs)["src"].startswith("data:image/png;base64,") for tag, attrs in tags if tag == "img")
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page  # in the label and the invalid lines
    res = CliRunner().invoke(main, ["logs", str(out), "--event", "aggregation"])
    assert res.exit_code == 0, res.output
    assert "\\x1b]0;owned" in res.output and not any(c in res.output for c in "\x1b\x07\x9b\u202e")
    res = CliRunner().invoke(main, ["logs", str(out), "--event", "aggregation", "--json"])  # as JSON escapes it
    assert res.exit_code == 0 and "\\u001b]0;owned" in res.output
    assert not any(c in res.output for c in "\x1b\x07\x9b\u202e")
