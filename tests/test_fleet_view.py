"""`fedtier fleet`: every node from its retained, signed status, with what agents announced; forged
records refused and counted, never shown; what the network sends is escaped before it is rendered."""

from __future__ import annotations

import json

from rich.console import Console

from monitor.fleet import Fleet, render
from protocols.config import TopologySection, load_config
from protocols.status import encode_status, idle_status
from protocols.transport.broker import EmbeddedBroker
from protocols.wire import topics
from protocols.wire.keys import PublicKeys, Trust, generate_keys

CONFIG = """
[run]
name = "fleetview"
rounds = 3
output = "{out}"
[topology]
cells = 1
devices_per_cell = 2
[algorithm]
name = "fedavg"
local_steps = 1
[model]
name = "mlp"
hidden = [8]
[data]
dataset = "digits"
max_train = 100
[runtime]
device_deadline = 30.0
heartbeat = 0.5
"""


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_fleet_takes_only_statuses_signed_by_the_node_their_topic_names():
    ring = generate_keys(TopologySection(cells=1, devices_per_cell=2))
    keys = PublicKeys(ring.public)
    clock = Clock()
    fleet = Fleet("fed", keys, clock=clock)

    def sign(node: str):
        return Trust(node, ring.private[node], ring.public)

    dev = topics.device_status("fed", "c0", "c0-d0")
    fleet.on_status(dev, encode_status("online", topic=dev, trust=sign("c0-d0"), caps={"cores": 4}))
    # a cell (valid credentials, valid key) forges its device's status, and a device claims to be the cloud
    other = topics.device_status("fed", "c0", "c0-d1")
    fleet.on_status(other, encode_status("online", topic=other, trust=sign("c0")))
    cloud = topics.status("fed", "cloud")
    fleet.on_status(cloud, encode_status("online", topic=cloud, trust=sign("c0-d0"), session="evil"))
    fleet.on_status(other, encode_status("online", topic=other))  # unsigned
    assert [v.node for v in fleet.rows()] == ["c0-d0"] and fleet.refused == 3
    clock.t = 103.0
    fleet.on_status(dev, encode_status("online", topic=dev, trust=sign("c0-d0"), caps={"cores": 4}))  # heartbeat
    row = fleet.rows()[0].as_dict(clock.t + 1)
    assert row["heartbeats_seen"] == 1 and row["heard_s_ago"] == 1.0 and row["capabilities"] == {"cores": 4}
    fleet.on_status(dev, b"")  # its retained status cleared (revoked): gone from the view
    assert fleet.rows() == []


def test_a_node_the_signed_roster_revoked_is_shown_revoked_whatever_its_retained_status_says():
    """Nothing clears a revoked cell's retained status (a revoked device's is cleared by its cell, but maybe not
    yet): the fleet shows the nodes the cloud's signed roster revoked as revoked, not online or idle, forgets their
    keys (a heartbeat they sign after is refused, not counted as a forgery), and a reader whose keys file already
    dropped them shows their refused retained status as revoked too, once the roster says so. A revoked node whose
    status the broker does not hold (never heard, or cleared by its cell) is listed revoked all the same, and no
    revoked node counts among the nodes expected online."""
    from protocols.roster import Roster, roster_topic, sign_roster

    ring = generate_keys(TopologySection(cells=2, devices_per_cell=2))
    members = {"c0": ["c0-d0", "c0-d1"], "c1": ["c1-d0", "c1-d1"]}
    roster = Roster.from_topology("fed", members, ring.public, 100.0)
    revoking = sign_roster(
        roster.without("c1").without("c0-d1"), Trust("cloud", ring.private["cloud"], ring.public).sign
    )

    def statuses(fleet: Fleet) -> None:
        for node in ("c0", "c1"):
            topic = topics.status("fed", f"cell.{node}")
            fleet.on_status(topic, idle_status(topic, Trust(node, ring.private[node], ring.public)))
        for node, cell in (("c0-d0", "c0"), ("c0-d1", "c0"), ("c1-d0", "c1")):
            topic = topics.device_status("fed", cell, node)
            trust = Trust(node, ring.private[node], ring.public)
            fleet.on_status(topic, encode_status("online", topic=topic, trust=trust))

    fleet = Fleet("fed", PublicKeys(ring.public), clock=Clock())  # a keys file from before the revocations
    statuses(fleet)
    state = lambda: {r.node: r.as_dict(100.0)["state"] for r in fleet.rows()}  # noqa: E731
    assert state()["c1"] == "idle" and state()["c0-d1"] == "online"  # before the roster: alive, as they say
    fleet.on_roster(roster_topic("fed"), revoking)
    alive, revoked = (
        {"cloud": "never seen", "c0": "idle", "c0-d0": "online"},
        dict.fromkeys(("c1", "c0-d1", "c1-d0", "c1-d1"), "revoked"),
    )
    assert state() == alive | revoked  # c1-d1 too: never heard, revoked
    assert not any(r.as_dict(100.0)["online"] for r in fleet.rows() if r.node in ("c1", "c0-d1", "c1-d0"))
    statuses(fleet)  # their heartbeats, signed with their real keys: refused now, still revoked, not a forgery
    assert fleet.refused == 0 and state()["c1"] == "revoked"
    fleet.on_roster(roster_topic("fed"), sign_roster(roster, Trust("cloud", ring.private["cloud"], ring.public).sign))
    assert fleet.refused == 1 and state()["c1"] == "revoked"  # the older roster, replayed: refused
    out = Console(width=200, record=True)
    out.print(render(fleet))
    assert "2/3 nodes online (1 idle), 4 revoked, 1 status records refused" in out.export_text(), out.export_text()

    current = PublicKeys({n: k for n, k in ring.public.items() if n not in ("c1", "c1-d0", "c1-d1", "c0-d1")})
    fleet = Fleet("fed", current, clock=Clock())  # the operator's refreshed keys file: theirs are gone
    statuses(fleet)
    assert fleet.refused == 3 and sorted(state()) == ["c0", "c0-d0"]  # unsigned by a known key: refused
    fleet.on_roster(roster_topic("fed"), revoking)
    assert fleet.refused == 0 and state() == alive | revoked
    fleet.on_status(topics.device_status("fed", "c0", "c0-d1"), b"")  # its cell cleared it: still revoked
    assert state() == alive | revoked


def test_a_revoked_node_never_seen_by_this_view_is_shown_with_its_role_and_cell_from_the_signed_roster():
    """The signed roster records the cell each revoked node was in: a view that never heard from it (started after
    the revocation) shows its role and cell; a roster signed before that was recorded (no ``revoked_in``) still
    verifies, and leaves them blank."""
    from protocols.roster import Roster, _canonical, roster_topic, verify_roster

    ring = generate_keys(TopologySection(cells=2, devices_per_cell=2))
    cloud = Trust("cloud", ring.private["cloud"], ring.public)
    members = {"c0": ["c0-d0", "c0-d1"], "c1": ["c1-d0", "c1-d1"]}
    roster = Roster.from_topology("fed", members, ring.public, 100.0).without("c0-d1").without("c1")
    body = roster.to_dict()
    assert body["revoked_in"] == {"c0-d1": "c0", "c1": "c1", "c1-d0": "c1", "c1-d1": "c1"}
    new = json.dumps({**body, "sig": cloud.sign(_canonical(body)).hex()}).encode()
    assert verify_roster(new, cloud.verify).revoked_cell("c1-d0") == "c1"
    fleet = Fleet("fed", PublicKeys(ring.public), clock=Clock())
    fleet.on_roster(roster_topic("fed"), new)
    shown = {r.node: (r.role, r.cell, r.state) for r in fleet.rows() if r.state == "revoked"}
    assert shown == {
        "c0-d1": ("device", "c0", "revoked"),
        "c1": ("cell", "c1", "revoked"),
        "c1-d0": ("device", "c1", "revoked"),
        "c1-d1": ("device", "c1", "revoked"),
    }
    out = Console(width=200, record=True)
    out.print(render(fleet))
    assert any(line.split()[:4] == ["c1-d1", "device", "c1", "revoked"] for line in out.export_text().splitlines())

    old = {k: v for k, v in body.items() if k != "revoked_in"}  # as signed before the cells were recorded
    fleet = Fleet("fed", PublicKeys(ring.public), clock=Clock())
    fleet.on_roster(roster_topic("fed"), json.dumps({**old, "sig": cloud.sign(_canonical(old)).hex()}).encode())
    assert {r.node: (r.role, r.cell) for r in fleet.rows() if r.state == "revoked"} == dict.fromkeys(
        ("c0-d1", "c1", "c1-d0", "c1-d1"), ("", None)
    )


def test_an_idle_node_is_online_with_its_versions_and_no_job():
    """Between jobs a long-lived node says idle (signed, with its machine's capabilities): the fleet shows
    it online and idle, with its versions, and no current job; an offline one stays offline."""
    from protocols.capabilities import machine_caps

    ring = generate_keys(TopologySection(cells=1, devices_per_cell=1))
    fleet = Fleet("fed", PublicKeys(ring.public), clock=Clock())
    for node, topic in (("cloud", topics.status("fed", "cloud")), ("c0", topics.status("fed", "cell.c0"))):
        fleet.on_status(topic, idle_status(topic, Trust(node, ring.private[node], ring.public)))
    dev = topics.device_status("fed", "c0", "c0-d0")
    fleet.on_status(dev, encode_status("offline", topic=dev, trust=Trust("c0-d0", ring.private["c0-d0"], ring.public)))
    rows = {r.node: r.as_dict(100.0) for r in fleet.rows()}
    assert fleet.refused == 0 and fleet.current_job() is None
    for node in ("cloud", "c0"):
        assert rows[node]["state"] == "idle" and rows[node]["online"] and rows[node]["session"] is None
        assert rows[node]["fedtier"] == machine_caps()["fedtier"] and rows[node]["wire"] == machine_caps()["wire"]
    assert rows["c0-d0"]["state"] == "offline" and not rows["c0-d0"]["online"]
    out = Console(width=200, record=True)
    out.print(render(fleet))
    assert "2/3 nodes online (2 idle)" in out.export_text()


def test_an_idle_records_published_time_that_is_no_time_is_taken_as_now():
    """A node (with valid keys) may put anything in its idle record's ``published`` time: an integer too large
    for a float, a string, a time ahead of the reader's clock is read as "just now", never an exception in the
    reader's handler; a past time ages the record (it was first received retained)."""
    import time

    from protocols.status import published_age

    ring = generate_keys(TopologySection(cells=1, devices_per_cell=1))
    trust = Trust("c0", ring.private["c0"], ring.public)
    topic = topics.status("fed", "cell.c0")
    for bad in (10**400, -(10**400), "soon", True, time.time() + 3600):
        assert published_age({"published": bad}) == 0.0
        fleet = Fleet("fed", PublicKeys(ring.public), clock=Clock())
        fleet.on_status(topic, idle_status(topic, trust, heartbeat=10.0, published=bad))
        assert fleet.refused == 0 and fleet.nodes["c0"].as_dict(100.0)["state"] == "idle"
    fleet = Fleet("fed", PublicKeys(ring.public), clock=Clock())
    fleet.on_status(topic, idle_status(topic, trust, heartbeat=10.0, published=time.time() - 31.0))
    assert fleet.nodes["c0"].as_dict(100.0)["state"] == "offline"  # three 10 s heartbeats missed


def test_an_idle_heartbeat_that_is_no_period_is_refused_as_one():
    """An idle record's ``heartbeat`` is the node's word: ``true`` passed as a 1 s period (the node deemed offline
    after 3 s of a healthy idle), NaN, infinity or 10**400 are no period either; the record is idle, never aged."""
    import math

    from protocols.status import idle_deadline

    for bad in (True, math.nan, math.inf, 1e400, 10**400, -5.0, "10"):
        assert idle_deadline(100.0, bad) is None, bad
    assert idle_deadline(100.0, 10) == idle_deadline(100.0, 10.0) == 130.0
    ring = generate_keys(TopologySection(cells=1, devices_per_cell=1))
    trust = Trust("c0", ring.private["c0"], ring.public)
    topic = topics.status("fed", "cell.c0")
    for beat, state in ((True, "idle"), (10**400, "idle"), (1, "offline")):
        clock = Clock()
        fleet = Fleet("fed", PublicKeys(ring.public), clock=clock)
        fleet.on_status(topic, idle_status(topic, trust, heartbeat=beat))
        assert fleet.nodes["c0"].as_dict(clock.t + 5.0)["state"] == state, beat


def test_an_idle_heartbeat_that_is_no_period_never_breaks_the_views():
    """An idle record's declared ``heartbeat`` is the node's word too: one too large for a float (or infinite)
    means no deadline, never an exception in fedtier fleet's or fedtier monitor's handling."""
    from monitor.state import MonitorState

    ring = generate_keys(TopologySection(cells=1, devices_per_cell=1))
    trust = Trust("c0", ring.private["c0"], ring.public)
    topic = topics.status("fed", "cell.c0")
    for bad in (10**400, float("inf")):
        fleet = Fleet("fed", PublicKeys(ring.public), clock=Clock())
        fleet.on_status(topic, idle_status(topic, trust, heartbeat=bad))
        assert fleet.nodes["c0"].as_dict(1e9)["state"] == "idle"
        state = MonitorState()
        state.add_status("cell.c0", "idle", received=100.0, heartbeat=bad)
        assert state.state_of(state.cells["c0"], 1e9) == "idle" and not state.alerts(now=1e9)


def test_what_nodes_send_is_escaped_before_it_is_rendered():
    fleet = Fleet("fed", None, clock=Clock())
    topic = topics.device_status("fed", "c0", "[red]x")
    fleet.on_status(topic, encode_status("online", topic=topic, caps={"fedtier": "[bold]1.0", "backends": ["[i]"]}))
    out = Console(width=200, record=True)
    out.print(render(fleet))
    text = out.export_text()
    assert "[red]x" in text and "[bold]1.0" in text and "[i]" in text


def test_fleet_lists_every_node_of_a_live_run_with_its_capabilities(tmp_path):
    from protocols.capabilities import machine_caps
    from sim.emulation import Emulation

    config = tmp_path / "run.toml"
    config.write_text(CONFIG.format(out=tmp_path / "out"))
    cfg = load_config(config)
    seen: list[list[dict]] = []
    tables: list = []  # click.testing.Result
    with EmbeddedBroker() as broker:

        def during_round(_record: dict) -> None:
            if seen:
                return
            from click.testing import CliRunner

            from fedtier.cli import main

            fleet = ["fleet", "--broker", broker.url, "--run", "fleetview", "--wait", "1.5", "--json"]
            res = CliRunner().invoke(main, fleet)  # in this process: no Python process to start
            assert res.exit_code == 0 and res.exception is None, res.output
            seen.append([json.loads(line) for line in res.stdout.splitlines()])
            tables.append(CliRunner().invoke(main, fleet[:-2] + ["0.5"]))  # the table (on stderr, it was)

        Emulation(cfg, broker_url=broker.url, on_round=during_round).run()
    rows = {r["node"]: r for r in seen[0]}
    assert set(rows) == {"cloud", "c0", "c0-d0", "c0-d1"} and all(r["state"] == "online" for r in rows.values())
    table = tables[0]  # on stdout, as `fedtier jobs`' (`fedtier fleet > file` wrote nothing there)
    assert table.exit_code == 0 and table.stdout.startswith("fleet fleetview: "), table.output
    assert "c0-d1" in table.stdout and not table.stderr, table.output
    assert rows["c0"]["devices_total"] == 2 and rows["cloud"]["session"]
    caps = machine_caps()
    for device in ("c0-d0", "c0-d1"):
        r = rows[device]
        assert r["cell"] == "c0" and r["samples"] > 0 and r["heartbeats_seen"] >= 1  # alive, not just retained
        assert r["fedtier"] == caps["fedtier"] and r["capabilities"]["cores"] == caps["cores"]


def test_a_cells_metrics_port_shows_its_devices_as_the_fleet_view_does(tmp_path):
    """The daemons export the fleet: a cell's exporter lists each device online or not, with the versions and
    capabilities its signed status announced (label text from devices made plain)."""
    from prometheus_client import generate_latest

    from tests.conftest import exported_cell

    cfg, hub, cell, exporter, peer = exported_cell(tmp_path)
    topic = topics.device_status(cfg.run.name, "c0", "c0-d0")
    caps = {
        "fedtier": "0.1.0",
        "wire": 1,
        "accelerator": "none",
        "backends": ["onnx", "torch"],
        "cores": 4,
        "memory_mb": 2048,
        "gpu": "<b>x</b>\n",
    }
    peer.publish(topic, encode_status("online", topic=topic, cell="c0", samples=10, caps=caps), retain=True)
    hub.loop.run(until=lambda: "c0-d0" in cell.caps)
    text = generate_latest(exporter.registry).decode()
    assert 'fedtier_device_online{cell="c0",device="c0-d0",run="t"} 1.0' in text
    assert 'fedtier_device_online{cell="c0",device="c0-d1",run="t"} 0.0' in text
    assert 'fedtier_device_cores{cell="c0",device="c0-d0",run="t"} 4.0' in text
    assert 'fedtier_device_memory_bytes{cell="c0",device="c0-d0",run="t"} 2.147483648e+09' in text  # 2048 MiB
    info = [line for line in text.splitlines() if line.startswith("fedtier_device_info{")]
    assert info == [
        'fedtier_device_info{accelerator="_b_x__b__",backends="onnx,torch",cell="c0",device="c0-d0",'
        'fedtier="0.1.0",run="t",wire="1"} 1.0'
    ]


def test_the_fleet_table_at_80_columns_shows_every_node_and_state_whole():
    """`fedtier fleet` piped, or in an 80-column terminal: 11 ruled columns cut every node id and state to
    "c0-…", "onl…". The ids, roles, cells, states and last-heard times stay whole; the capabilities wrap."""
    from protocols.capabilities import machine_caps

    ring = generate_keys(TopologySection(cells=2, devices_per_cell=3))
    fleet = Fleet("fed", PublicKeys(ring.public), clock=Clock())
    for node in ring.private:
        cell = node.split("-")[0]
        topic = (
            topics.status("fed", "cloud")
            if node == "cloud"
            else topics.status("fed", f"cell.{node}")
            if "-" not in node
            else topics.device_status("fed", cell, node)
        )
        fleet.on_status(topic, idle_status(topic, Trust(node, ring.private[node], ring.public)))
    out = Console(width=80, record=True)
    out.print(render(fleet))
    text = out.export_text()
    assert "…" not in text, text
    lines = text.splitlines()
    for node in ring.private:
        assert any(line.split()[:1] == [node] and "online, idle" in line for line in lines), (node, text)
    assert f"fedtier {machine_caps()['fedtier']}" in text and all(len(line) <= 80 for line in lines)
