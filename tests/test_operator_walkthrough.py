"""What a new operator runs, as the deployment tutorial writes it (``docs/tutorials/deploy-fleet.md``): relative
paths from the folder the fleet was provisioned in, a roster published after a change made without the
broker, a node started with the wrong certificate, a device's own data file. Each command either works or
fails at once with its reason and a non-zero exit, never with a traceback."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedtier.cli import main
from fedtier.provisioning import provision
from protocols.transport.broker import find_mosquitto, free_port
from tests.conftest import small_config, with_keys
from tests.test_provision import broker_user, mosquitto, reachable_tmp  # noqa: F401 (a fixture)


def _provision(where: Path, port: int, name: str = "fed") -> Path:
    user = broker_user()
    cfg = small_config(where, run={"name": name}, topology={"cells": 1, "devices_per_cell": 2})
    provision(
        cfg,
        where / name,
        port=port,
        bind="127.0.0.1",
        broker_user=user[1] if user else None,
        federation=True,
        max_device_weight=1000,
    )
    return where / name


def _cli(*args: str) -> tuple[int, str, BaseException | None]:
    res = CliRunner().invoke(main, list(args))
    unexpected = None if res.exception is None or isinstance(res.exception, SystemExit) else res.exception
    return res.exit_code, " ".join(res.output.split()), unexpected  # as one line: the console wraps it


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_membership_changes_publish_with_the_tutorials_relative_out_and_later_on_demand(
    reachable_tmp: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`fedtier provision revoke --out fed --node NODE` from the provisioning folder (as the tutorial runs it) publishes
    the new roster; a change made while the broker is down fails to publish with exit 1 and says how to do it
    later, and `fedtier provision publish --out fed` then does."""
    port = free_port()
    where = reachable_tmp / "walk-members"
    where.mkdir()
    _provision(where, port)
    monkeypatch.chdir(where)
    from protocols.transport.mqtt import MqttTransport

    connect, tries = MqttTransport.connect, []  # (it retries a refused connect 10 s: a broker may be starting)

    def connect_briefly(self, timeout=10.0):
        tries.append(timeout)
        return connect(self, min(timeout, 1.0))

    monkeypatch.setattr(MqttTransport, "connect", connect_briefly)
    code, out, exc = _cli("provision", "add-device", "--out", "fed", "--cell", "c0", "--device", "c0-d2")
    assert exc is None, f"a traceback instead of a reason: {exc!r}"
    assert code == 1 and "could not publish the roster" in out and "fedtier provision publish --out fed" in out, out
    # a revocation publishes before the broker reloads: a broker it could not reach then is not tried again after
    # (walked: 21 s of connection retries, twice the connect timeout, before the same error)
    tries.clear()
    code, out, exc = _cli("provision", "revoke", "--out", "fed", "--node", "c0-d2")
    monkeypatch.setattr(MqttTransport, "connect", connect)
    assert exc is None and code == 1 and "could not publish the roster" in out and len(tries) == 1, (exc, tries, out)
    with mosquitto(where / "fed" / "broker" / "mosquitto.conf", port):
        code, out, exc = _cli("provision", "publish", "--out", "fed")
        assert exc is None and code == 0 and "published roster version 3" in out, (exc, out)
        code, out, exc = _cli("provision", "revoke", "--out", "fed", "--node", "c0-d1")
        assert exc is None and code == 0 and "published roster version 4" in out, (exc, out)
    assert os.getcwd() == str(where)  # publishing read the operator's bundle from inside it, and came back


def test_a_node_started_with_the_wrong_certificate_fails_at_once_saying_why(
    reachable_tmp: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A certificate of another provisioning, another node's certificate, or a key that is not the
    certificate's: the node exits 2 naming the file and the defect, before it tries the broker (a long-lived
    node would retry a broker that refuses it for ever; another node's certificate would log it in as that
    node)."""
    where = reachable_tmp / "walk-certs"
    where.mkdir()
    fed, other = _provision(where, free_port()), _provision(where, free_port(), name="other")
    monkeypatch.chdir(fed / "nodes" / "c0")
    cases = {
        "is not signed by a CA in ca.crt": (
            str(other / "nodes" / "c0" / "client.crt"),
            str(other / "nodes" / "c0" / "client.key"),
        ),
        "is issued to 'c0-d0', but this node logs in as 'c0'": ("../c0-d0/client.crt", "../c0-d0/client.key"),
        "key values mismatch": ("client.crt", "../c0-d0/client.key"),
    }
    for why, (crt, key) in cases.items():  # the broker is not even up: the certificate is refused first
        code, out, exc = _cli("cell", "config.toml", "--serve", "--cell", "c0", "--certfile", crt, "--keyfile", key)
        assert exc is None and code == 2 and "broker client certificate" in out and why in out, (exc, code, out)
    monkeypatch.chdir(fed / "nodes" / "cloud")
    code, out, exc = _cli("cloud", "config.toml", "--serve", "--ca-certs", str(other / "nodes" / "cloud" / "ca.crt"))
    assert exc is None and code == 2 and "client.crt is not signed by a CA in" in out, (exc, code, out)


def test_a_long_lived_nodes_metrics_follow_each_job_without_stale_series() -> None:
    """One exporter across jobs (``--serve --metrics-port``): a cell's next job's server replaces the last one's
    device series (no duplicates, no device of the last job only), a failed job's flag is cleared when the
    next job starts, and an agent's counters appear once its process starts."""
    from types import SimpleNamespace

    from monitor.exporter import AgentCollector, MetricsExporter

    def cell(devices: list[str]) -> SimpleNamespace:
        online = dict.fromkeys(devices, True)
        return SimpleNamespace(observers=[], cell="c0", online=online, devices=devices, device_deadline=5.0, caps={})

    def cloud() -> SimpleNamespace:
        return SimpleNamespace(observers=[], failure_observers=[], cell_deadline=10.0, rounds=2)

    def samples(exporter: MetricsExporter, name: str) -> list[tuple[dict[str, str], float]]:
        return [(s.labels, s.value) for f in exporter.registry.collect() for s in f.samples if s.name == name]

    exporter = MetricsExporter("fed", devices=True)
    exporter.watch_cell(cell(["c0-d0", "c0-d1"]))
    exporter.watch_cell(cell(["c0-d0", "c0-d2"]))  # the next job, after c0-d1 was revoked and c0-d2 enrolled
    devices = sorted(labels["device"] for labels, _ in samples(exporter, "fedtier_device_online"))
    assert devices == ["c0-d0", "c0-d2"]
    exporter.watch_cloud(cloud())
    exporter.job_failed("no cell answered in rounds 0-2")
    assert [v for _, v in samples(exporter, "fedtier_cloud_job_failed")] == [1.0]
    exporter.watch_cloud(cloud())  # the next job
    assert [v for _, v in samples(exporter, "fedtier_cloud_job_failed")] == []
    agents = AgentCollector("fed", None)  # a long-lived agent before its first job
    exporter.registry.register(agents)
    assert samples(exporter, "fedtier_agent_tasks_total") == []
    agents.follow(SimpleNamespace(agents={"c0-d0": SimpleNamespace(tasks_done=3)}, train_seconds=1.5, connections={}))
    assert [v for _, v in samples(exporter, "fedtier_agent_tasks_total")] == [3.0]


def test_a_devices_own_data_file_is_checked_against_each_jobs_model_not_the_bundles(
    reachable_tmp: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A device's own ``.npz`` of ``x`` and ``y`` (no recorded geometry, as `fedtier agent --help` describes it):
    a long-lived agent starts with it (the bundle has no model: a job brings one), a malformed file still fails
    at once, and a job's model is refused for labels it has no output for (the task would raise every round)."""
    import numpy as np

    import fedtier.serve
    from fedtier.deploy_setup import spec_and_data
    from protocols.config import ConfigError

    where = reachable_tmp / "walk-data"
    where.mkdir()
    bundle = _provision(where, free_port()) / "nodes" / "c0-d0"
    rng = np.random.default_rng(0)
    x, y = rng.random((40, 64), dtype=np.float32), rng.integers(0, 10, 40)
    np.savez(bundle / "own.npz", x=x, y=y)  # digits-sized: 8x8 features, 10 classes
    (bundle / "broken.npz").write_bytes(b"not a zip")
    monkeypatch.chdir(bundle)
    served: list[int] = []
    monkeypatch.setattr(
        fedtier.serve, "serve_agent", lambda cfg, device, data, *a: (served.append(len(data)), ([], 0))[1]
    )
    code, out, exc = _cli("agent", "config.toml", "--serve", "--device", "c0-d0", "--data", "own.npz")
    assert exc is None and code == 0 and served == [40], (exc, code, out)
    code, out, exc = _cli("agent", "config.toml", "--serve", "--device", "c0-d0", "--data", "broken.npz")
    assert exc is None and code == 2 and "broken.npz: not a readable .npz" in out, (exc, code, out)

    job = small_config(where)  # a digits job: 10 classes
    assert spec_and_data(job, "own.npz")[0].num_classes == 10
    np.savez(bundle / "labels.npz", x=x, y=np.where(y == 3, 37, y))
    with pytest.raises(ConfigError, match="labels.npz: label 37, but the model has 10 classes"):
        spec_and_data(job, "labels.npz")
    # data that records another geometry (`fedtier partition` of another data set) needs another model: every
    # node must build the job's one (the cloud's model was refused by such a device every round instead)
    np.savez(bundle / "mnist.npz", x=np.zeros((4, 784), np.float32), y=np.zeros(4, np.int64), input_shape=[1, 28, 28])
    with pytest.raises(ConfigError, match="mnist.npz: samples of 1x28x28, but the job's model takes digits: 1x8x8"):
        spec_and_data(job, "mnist.npz")
    np.savez(bundle / "c20.npz", x=x, y=y, input_shape=[1, 8, 8], num_classes=20)
    with pytest.raises(ConfigError, match=r"c20.npz: 20 classes, but the job's model \(digits\) has 10"):
        spec_and_data(job, "c20.npz")


def _doc_commands(text: str) -> list[str]:
    """The ``fedtier COMMAND ...`` lines of a page's shell blocks and inline code (up to a shell separator)."""
    import re

    code, fence = [], None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = None if fence is not None else line.strip().strip("`")
        elif fence is None:
            code += re.findall(r"`([^`]+)`", line)
        elif fence in ("", "bash", "sh", "console", "text"):
            code.append(line)
    pattern = re.compile(r"(?<![-\w./])fedtier\s+([a-z][a-z-]*)(?=\s|$)([^#;|&)]*)")
    return [f"{m.group(1)} {m.group(2).strip()}".strip() for line in code for m in pattern.finditer(line)]


def test_every_fedtier_command_and_flag_the_docs_show_exists() -> None:
    """Each `fedtier ...` command line in the README and the docs names a command (and sub-command) that exists,
    and every flag it passes is one of that command's: an operator copying a line gets no 'No such command'."""
    import click

    root = Path(__file__).resolve().parents[1]
    wrong = []
    for page in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        for line in _doc_commands(page.read_text()):
            name, *rest = line.split()
            command = main.commands.get(name)
            if command is None:
                wrong.append(f"{page.name}: fedtier {line}: no command {name!r}")
                continue
            if isinstance(command, click.Group):  # provision: a sub-command, else its default (create)
                sub = rest[0] if rest and rest[0] in command.commands else "create"
                command, rest = command.commands[sub], rest[1:] if rest and rest[0] == sub else rest
            flags = {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help", "-h"}
            bad = [t for t in (t.split("=")[0].rstrip(".,:") for t in rest if t.startswith("-")) if t not in flags]
            if bad:
                wrong.append(f"{page.name}: fedtier {line}: {command.name} has no {', '.join(bad)}")
    assert not wrong, "\n".join(wrong)


def test_a_device_that_cannot_serve_a_job_is_absent_with_its_reason_and_not_waited_for(tmp_path: Path) -> None:
    """The cell's side, in memory with signed statuses: a device whose idle status says it cannot serve the
    cell's job (its data does not fit the model) is absent with its words, not "offline"; the cell's own
    status counts it, so the cloud deems the cell ready at once instead of waiting out its startup wait; the
    fleet view shows the reason. What it said of another job changes nothing."""
    from rich.console import Console

    from cell_server.node import build_cell
    from cloud.parts import CellPresence
    from monitor.fleet import Fleet, render
    from protocols.status import IDLE, decode_status, encode_status
    from protocols.transport.memory import MemoryHub
    from protocols.wire import topics
    from protocols.wire.keys import PublicKeys, Trust
    from protocols.wire.messenger import Messenger
    from sim.hierarchy import prepare

    cfg = small_config(tmp_path, topology={"cells": 1, "devices_per_cell": 3}, algorithm={"edge_rounds": 1})
    cfg, ring = with_keys(cfg, tmp_path)
    algorithm = cfg.build_algorithm(prepare(cfg).spec)
    run, hub = cfg.run.name, MemoryHub()
    cell = build_cell(cfg, "c0", hub.connect("cell.c0"), algorithm, heartbeats=True)
    cell.cloud.pin("job.0")
    peer = hub.connect("peer")
    tasks: list[str] = []
    cell_status: list[dict] = []
    fleet = Fleet(run, PublicKeys(ring.public))
    peer.subscribe(topics.device_statuses(run), fleet.on_status)
    for d in ("c0-d0", "c0-d1", "c0-d2"):
        peer.subscribe(topics.device_task(run, "c0", d), lambda t, data: tasks.append(t.split("/")[-2]))
    status_topic = topics.status(run, "cell.c0")
    peer.subscribe(status_topic, lambda t, data: cell_status.append(decode_status(data, t) or {}))
    cell.start()

    def trust(node: str) -> Trust:
        return Trust(node, ring.private[node], ring.public)

    def status(device: str, state: str, **extra: object) -> None:
        topic = topics.device_status(run, "c0", device)
        peer.publish(topic, encode_status(state, topic=topic, trust=trust(device), cell="c0", **extra), retain=True)

    STEPS = 100_000  # bounded: the heartbeats never run out
    why = "data.npz: 784 features per sample, but the model takes 1x8x8 = 64"
    status("c0-d0", "online", session="job.0")
    status("c0-d2", "online", session="job.0")
    status("c0-d1", IDLE, unfit={"session": "job.9", "reason": "another job's"})  # not this job's: offline
    forged = topics.device_status(run, "c0", "c0-d2")  # c0-d0 (valid keys) says c0-d2 cannot serve: not c0-d2's
    peer.publish(forged, encode_status(IDLE, topic=forged, trust=trust("c0-d0"), unfit={"session": "job.0"}))
    hub.loop.run(until=lambda: bool(cell_status) and cell_status[-1].get("devices_online") == 2, max_steps=STEPS)
    presence = CellPresence(["c0"])
    presence.heard("c0", cell_status[-1], 0.0)
    assert not presence.ready["c0"]  # one device offline: the cloud waits for it (up to its startup wait)
    status("c0-d1", IDLE, unfit={"session": "job.0", "reason": why})
    hub.loop.run(until=lambda: cell_status[-1].get("devices_unfit") == 1, max_steps=STEPS)
    presence.heard("c0", cell_status[-1], 0.0)
    assert presence.ready["c0"]  # nobody left to wait for
    hub.loop.run(until=lambda: fleet.received >= 4, max_steps=STEPS)
    out = Console(width=250, record=True)
    out.print(render(fleet))
    assert f"cannot serve job: {why}" in out.export_text()

    cloud = Messenger(peer, run, "cloud", trust=trust("cloud"))
    cloud.session = "job.0"
    cloud.send(topics.cell_task(run, "c0"), "cell_task", algorithm.cloud().plan(0, ["c0"])["c0"], round=0, cell="c0")
    hub.loop.run(until=lambda: len(tasks) == 2, max_steps=STEPS)
    assert sorted(tasks) == ["c0-d0", "c0-d2"] and cell.edge.absent == {"c0-d1": f"cannot serve: {why}"}


def test_the_fleet_lists_a_roster_member_never_heard_from() -> None:
    """`fedtier fleet` with the federation's keys reads the cloud's signed roster: an enrolled device that never
    started is listed as never seen (and counted against the nodes online), a roster not signed by the cloud is
    refused, and a revoked device (gone from the roster, never heard from) is listed as revoked, not counted among
    the nodes expected online."""
    from rich.console import Console

    from monitor.fleet import Fleet, render
    from protocols.config import TopologySection
    from protocols.roster import Roster, roster_topic, sign_roster
    from protocols.status import encode_status
    from protocols.wire import topics
    from protocols.wire.keys import PublicKeys, Trust, generate_keys

    ring = generate_keys(TopologySection(cells=1, devices_per_cell=3))
    fleet = Fleet("fed", PublicKeys(ring.public))

    def trust(node: str) -> Trust:
        return Trust(node, ring.private[node], ring.public)

    for node, topic in (("c0", topics.status("fed", "cell.c0")), ("c0-d0", topics.device_status("fed", "c0", "c0-d0"))):
        fleet.on_status(topic, encode_status("online", topic=topic, trust=trust(node)))
    roster = Roster.from_topology("fed", {"c0": ["c0-d0", "c0-d1", "c0-d2"]}, ring.public, 100.0)
    fleet.on_roster(roster_topic("fed"), sign_roster(roster, trust("c0").sign))  # not the cloud's: refused
    assert fleet.refused == 1 and len(fleet.rows()) == 2
    fleet.on_roster(roster_topic("fed"), sign_roster(roster.without("c0-d2"), trust("cloud").sign))
    rows = {r.node: r.as_dict(fleet.clock()) for r in fleet.rows()}
    assert sorted(rows) == ["c0", "c0-d0", "c0-d1", "c0-d2", "cloud"]
    assert (
        rows["c0-d2"]["state"] == "revoked" and not rows["c0-d2"]["online"] and rows["c0-d2"]["cell"] == "c0"
    )  # (the cloud's roster records the cell a revoked id was in: revoked_in)
    assert rows["c0-d1"]["state"] == "never seen" and not rows["c0-d1"]["online"] and rows["c0-d1"]["cell"] == "c0"
    assert rows["cloud"]["state"] == "never seen" and rows["cloud"]["heard_s_ago"] is None
    out = Console(width=200, record=True)
    out.print(render(fleet))
    text = out.export_text()
    assert "2/4 nodes online, 1 revoked" in text and "c0-d1" in text and "never seen" in text, text


def test_the_fleet_lists_a_device_revoked_after_its_cell_cleared_its_status_as_revoked() -> None:
    """`fedtier provision revoke` then `fedtier fleet`: the cell clears the revoked device's retained status, so a view
    opened after holds no status of it, only the signed roster naming it revoked; one open during the revocation
    saw its status, then the clear. Both list it `revoked` (not gone, as if never enrolled), in the table and the
    `--json` rows, and neither counts it among the nodes expected online."""
    from rich.console import Console

    from monitor.fleet import Fleet, render
    from protocols.config import TopologySection
    from protocols.roster import Roster, roster_topic, sign_roster
    from protocols.status import encode_status
    from protocols.wire import topics
    from protocols.wire.keys import PublicKeys, Trust, generate_keys

    ring = generate_keys(TopologySection(cells=1, devices_per_cell=2))

    def trust(node: str) -> Trust:
        return Trust(node, ring.private[node], ring.public)

    roster = Roster.from_topology("fed", {"c0": ["c0-d0", "c0-d1"]}, ring.public, 100.0)
    revoked = sign_roster(roster.without("c0-d1"), trust("cloud").sign)
    gone = topics.device_status("fed", "c0", "c0-d1")

    def statuses(fleet: Fleet, devices: tuple[str, ...]) -> None:
        where = {"cloud": topics.status("fed", "cloud"), "c0": topics.status("fed", "cell.c0")}
        where |= {d: topics.device_status("fed", "c0", d) for d in devices}
        for node, topic in where.items():
            fleet.on_status(topic, encode_status("online", topic=topic, trust=trust(node)))

    during = Fleet("fed", PublicKeys(ring.public))  # open during the revocation
    statuses(during, ("c0-d0", "c0-d1"))
    during.on_roster(roster_topic("fed"), sign_roster(roster, trust("cloud").sign))
    during.on_roster(roster_topic("fed"), revoked)
    during.on_status(gone, b"")  # its cell cleared it
    after = Fleet("fed", PublicKeys(ring.public))  # opened after: the broker holds no status of c0-d1
    statuses(after, ("c0-d0",))
    after.on_roster(roster_topic("fed"), revoked)
    for fleet, cell in ((during, "c0"), (after, "c0")):  # (after it, only the roster knows c0-d1: its revoked_in)
        rows = {r.node: r.as_dict(fleet.clock()) for r in fleet.rows()}
        assert sorted(rows) == ["c0", "c0-d0", "c0-d1", "cloud"], rows
        assert rows["c0-d1"]["state"] == "revoked" and not rows["c0-d1"]["online"] and rows["c0-d1"]["cell"] == cell
        assert rows["c0-d1"]["heard_s_ago"] is None and fleet.refused == 0
        out = Console(width=200, record=True)
        out.print(render(fleet))
        text = out.export_text()
        assert "fleet fed: 3/3 nodes online, 1 revoked" in text and "c0-d1" in text and "revoked" in text, text


def test_a_renewal_after_a_revocation_keeps_the_revoked_certificate_revoked(tmp_path: Path) -> None:
    """Revocation and renewal share one revocation list: a device revoked, then a certificate renewal, then
    another revocation leave every one of those certificates in every broker's CRL (a renewal wrote the CRL
    from its own list and un-revoked the revoked device; a revocation then un-revoked the renewed certificate)."""
    from cryptography import x509

    from fedtier.membership import add_device, revoke
    from fedtier.renewal import renew

    out = _provision(tmp_path, free_port())

    def serial(node: str) -> int:
        return x509.load_pem_x509_certificate((out / "nodes" / node / "client.crt").read_bytes()).serial_number

    def crl() -> set[int]:
        return {r.serial_number for r in x509.load_pem_x509_crl((out / "broker" / "ca.crl").read_bytes())}

    gone, old = serial("c0-d1"), serial("c0-d0")
    revoke(out, "c0-d1")
    assert gone in crl()
    renew(out, ["c0-d0"])
    assert {gone, old} <= crl(), "the renewal un-revoked the revoked device"
    add_device(out, "c0", "c0-d2")
    third = serial("c0-d2")
    revoke(out, "c0-d2")
    assert {gone, old, third} <= crl(), "the revocation un-revoked the renewed certificate"
    assert (out / "ca" / "ca.crl").read_bytes() == (out / "broker" / "ca.crl").read_bytes()
    (out / "ca" / "ca.crl").unlink()  # as a revocation before the fix left it: only the federation's state knew
    renew(out, ["c0-d0"])
    assert {gone, old, third} <= crl(), "a renewal does not heal a list that lacked the earlier revocations"


def test_a_rotated_identity_reaches_the_roster_so_cells_take_the_new_key_not_the_old(tmp_path: Path) -> None:
    """`fedtier provision renew --identity --node c0-d0` (a device's key leaked, say) rewrote the keys files but left
    the federation's roster at version 1 with the old key: every cell learns its devices' keys from the roster it holds
    (``cell_server.service.apply_roster``), so at each job it took the old key back, refused the device's new
    signatures and still took the old key's. And a rotated cloud left the folder unreadable (its roster signed by the
    old key: "not a provisioned federation"), and the cloud, restarted with its new keys, refused the roster it kept.
    The roster now gets a new version with the new keys, signed by the cloud's current key (the command says to
    publish it), and a restarted cloud takes its bundle's when the one it kept no longer verifies."""
    import contextlib
    from types import SimpleNamespace

    from cell_server.service import apply_roster
    from fedtier.membership import load_federation
    from fedtier.serve import federation_roster
    from protocols.config import load_config
    from protocols.roster import verify_roster
    from protocols.wire.envelope import WireError
    from protocols.wire.keys import Trust, load_keys, node_trust

    out = _provision(tmp_path, free_port())
    old = load_keys(out / "nodes" / "c0-d0" / "keys.toml").private["c0-d0"]
    code, said, exc = _cli("provision", "renew", "--out", str(out), "--node", "c0-d0", "--identity")
    assert code == 0 and exc is None and "roster version 2" in said and "fedtier provision publish" in said, said
    new = load_keys(out / "nodes" / "c0-d0" / "keys.toml").private["c0-d0"]
    roster = load_federation(out).roster
    cell = load_keys(out / "nodes" / "c0" / "keys.toml", need_private=False)  # the copied, rewritten keys file
    trust = Trust("c0", load_keys(out / "nodes" / "c0" / "keys.toml").private["c0"], cell.public)
    node = SimpleNamespace(devices=SimpleNamespace(position=lambda d: 0), trust=trust, max_weights={})
    node.revoke_members = lambda revoked: None
    apply_roster(node, "c0", roster)  # as a serving cell does at each job, and as each new roster comes
    data = b"a result"
    trust.verify("c0-d0", data, Trust("c0-d0", new, {}).sign(data))
    with pytest.raises(WireError, match="bad signature"):
        trust.verify("c0-d0", data, Trust("c0-d0", old, {}).sign(data))
    kept = (out / "nodes" / "cloud" / "roster.json").read_bytes()  # version 2, as the serving cloud keeps it
    code, said, exc = _cli("provision", "renew", "--out", str(out), "--node", "cloud", "--identity")
    assert code == 0 and exc is None and load_federation(out).roster.version == 3, said
    with contextlib.chdir(out / "nodes" / "cloud"):  # the cloud restarted with its new keys: the re-signed roster
        cfg = load_config("config.toml")
        cfg.output_dir().mkdir(parents=True)
        (cfg.output_dir() / "roster.json").write_bytes(kept)  # signed by its old key
        trust = node_trust(cfg, "cloud")
        assert verify_roster(federation_roster(cfg, trust)[0] or b"", trust.verify).version == 3


def test_a_cells_rotated_key_reaches_its_devices_through_the_roster(tmp_path: Path) -> None:
    """A device verifies its cell's tasks with its keys file, and learnt only its neighbours' keys from the roster:
    after `fedtier provision renew --identity --node c0` and the new roster's publish, the cell's tasks signed with its
    new key were refused by every device whose keys file was not copied yet, and the old key (a leaked one, say) still
    tasked them. A device takes its cell's key from the roster too (``edge_agent.secagg.learn_roster``)."""
    from types import SimpleNamespace

    from edge_agent.secagg import learn_roster
    from fedtier.membership import load_federation, rotate_identities
    from protocols.wire.envelope import WireError
    from protocols.wire.keys import Trust, load_keys

    out = _provision(tmp_path, free_port())
    before = load_keys(out / "nodes" / "c0-d0" / "keys.toml")  # the device's keys file, not copied again
    old = load_keys(out / "keys.toml").private["c0"]
    rotate_identities(out, ["c0"])
    new = load_keys(out / "keys.toml").private["c0"]
    device = SimpleNamespace(trust=Trust("c0-d0", before.private["c0-d0"], before.public), cell="c0", device="c0-d0")
    learn_roster(device, load_federation(out).roster)  # as each device does when the roster comes
    task = b"a task"
    device.trust.verify("c0", task, Trust("c0", new, {}).sign(task))
    with pytest.raises(WireError, match="bad signature"):
        device.trust.verify("c0", task, Trust("c0", old, {}).sign(task))


def test_revoking_a_node_revoked_before_says_so(tmp_path: Path) -> None:
    """Walked: `fedtier provision revoke --out fed c1-d1` a second time said "'c1-d1' is not a cell or a device of
    federation 'fed'", as of a mistyped id. Exit 2 still (nothing changed), saying it is revoked already.
    The node is named as by every other provision command, `--node NODE` (renew's; add-device's `--device`), the
    positional `revoke NODE` of earlier docs still taken; two different ones, or none, are refused before anything
    changes."""
    fed = _provision(tmp_path, free_port())
    revoke = ("provision", "revoke", "--out", str(fed), "--no-publish")
    for wrong, said in (((), "which node?"), (("--node", "c0-d0", "c0-d1"), "two nodes to revoke")):
        code, out, exc = _cli(*revoke, *wrong)
        assert exc is None and code == 2 and said in out, out
    assert json.loads((fed / "roster.json").read_text())["version"] == 1  # nothing changed
    assert _cli(*revoke, "--node", "c0-d1")[0] == 0
    code, out, exc = _cli(*revoke, "c0-d1")
    assert exc is None and code == 2 and "'c0-d1' is revoked already (roster version 2): nothing to do" in out, out
    code, out, _ = _cli(*revoke, "--node", "c0-d9", "c0-d9")  # (the same twice: one)
    assert code == 2 and "'c0-d9' is not a cell or a device of federation 'fed'" in out, out


def test_error_messages_keep_the_config_sections_they_name(
    reachable_tmp: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An error that names a config section in brackets prints it: the console took ``[broker]`` and
    ``[security]`` for markup and dropped them ("a job may not set : each node's bundle does")."""
    where = reachable_tmp / "walk-errors"
    where.mkdir()
    fed = _provision(where, free_port())
    monkeypatch.chdir(fed / "nodes" / "operator")
    Path("bk.toml").write_text('[job]\nid = "bk"\n[broker]\nurl = "mqtt://elsewhere:1883"\n')
    code, out, _ = _cli("submit", "bk.toml", "--config", "config.toml")
    assert code == 2 and "a job may not set [broker]: each node's bundle does" in out, out
    monkeypatch.chdir(fed / "nodes" / "c0")
    Path("unsigned.toml").write_text(Path("config.toml").read_text().replace('keys = "keys.toml"\n', ""))
    code, out, _ = _cli("cell", "unsigned.toml", "--serve", "--cell", "c0")
    assert code == 2 and "the config has no [security] keys" in out, out
    monkeypatch.chdir(fed / "nodes" / "monitor")  # walked: "security.keys: keys.toml has no [private] key", alone
    code, out, _ = _cli("jobs", "--config", "config.toml")
    assert code == 2 and "not an operator's keys" in out and "the operator bundle's config.toml" in out, out


def test_provisioning_a_federation_warns_of_settings_no_job_takes(tmp_path: Path) -> None:
    """A federation's bundles keep no training or timing config and jobs inherit none: provisioning says so of
    what the config sets (the tutorial's federation once set [runtime] deadlines that no job ever used)."""
    from fedtier.bundles import ignored_by_federation
    from protocols.config import load_config

    root = Path(__file__).resolve().parents[1]
    assert ignored_by_federation(load_config(root / "examples" / "federation.toml")) == []
    cfg = small_config(tmp_path, runtime={"startup_wait": 5.0})  # also rounds, [algorithm], [model] set
    assert ignored_by_federation(cfg) == ["run.rounds", "[algorithm]", "[model]", "[runtime]"]
    path = tmp_path / "fed.toml"
    path.write_text(cfg.to_toml())
    code, out, exc = _cli("provision", str(path), "--out", str(tmp_path / "p"), "--federation", *broker_user())
    assert exc is None and code == 0, out
    assert "warning: run.rounds, [algorithm], [model], [runtime]: no job takes these" in out, out


def test_a_jobs_setting_given_to_a_serving_node_is_said_ignored(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Walk (session 25): `fedtier cell config.toml --serve --cell c1 --set algorithm.lr=5.0` started without a word,
    and no job ever ran at that rate (each job brings its own settings). It now warns, naming them; a bundle as
    provisioned, and a forward-only device's own model (`--onnx-model`), say nothing."""
    from fedtier.deploy_setup import node_config

    monkeypatch.chdir(_provision(tmp_path, free_port()) / "nodes" / "c0")  # (as a node runs, in its bundle)
    config = "config.toml"
    lr = ("algorithm.name=fedavg", "algorithm.lr=5.0", "run.rounds=3", 'run.output="/var/lib/fedtier/c0"')
    said = lambda: " ".join(capsys.readouterr().err.split())  # noqa: E731
    node_config(config, lr, False, True, "cell")
    assert "warning: run.rounds, [algorithm] (its config or --set): ignored, a node started with --serve" in said()
    for overrides in ((), ('runtime.onnx_model="model.onnx"',)):
        node_config(config, overrides, False, True, "agent")
        assert "warning" not in said()


def test_submit_wait_end_exits_with_how_the_job_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fedtier submit --wait-end`: the job list the cloud signs, followed until the job ended: 0 finished,
    3 failed (with the reason), 1 cancelled or not ended in time."""
    import fedtier.cmd_jobs as cmd

    lists = {
        "finished": {"jobs": [{"job": "a", "state": "finished", "reason": ""}]},
        "failed": {"jobs": [{"job": "b", "state": "queued"}, {"job": "a", "state": "failed", "reason": "[x] stalled"}]},
        "cancelled": {"jobs": [{"job": "a", "state": "cancelled", "reason": "cancelled by the operator"}]},
        "running": {"jobs": [{"job": "a", "state": "running", "reason": ""}]},
    }

    class Session:
        fed = "fed"

        def __init__(self, record: dict) -> None:
            self.record = record

        def read(self, topic: str, signer: str, wait: float, until=None) -> dict | None:
            return self.record if until is None or until(self.record) else None

        def close(self) -> None:
            pass

        def cloud_status(self) -> list:
            return [{"state": "offline"}] if self.record is lists["running"] else [{"state": "online"}]

    said: list[str] = []
    monkeypatch.setattr(cmd, "print_error", lambda message, *a, **k: said.append(str(message)))
    for state, code in (("finished", 0), ("failed", 3), ("cancelled", 1), ("running", 1)):
        monkeypatch.setattr(cmd, "_connect", lambda config, wait, r=lists[state]: Session(r))
        with pytest.raises(SystemExit) as ended:
            cmd._wait_end("config.toml", "a", 5.0)
        assert ended.value.code == code, state
    # walked: a cloud that stopped on a full disk mid-job left `submit --wait-end 200` saying only that the job had not
    # ended; it says the cloud is offline, and that the job resumes when the cloud starts again
    assert said[-1].startswith("job a has not ended within 5 s, and the cloud is offline"), said


def test_a_refused_cancel_says_the_cancel_was_refused_not_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fedtier cancel` of a job that has ended is refused (exit 1): it said 'job a refused: ...', as if the
    finished job had been refused; it now says the cancel could not be done. A refused submission keeps its line."""
    import fedtier.cmd_jobs as cmd
    from protocols.jobs import JobRequest, cancel_record, submit_record

    class Session:
        fed = "fed"

        class transport:
            reconnects = 0

        def cloud_status(self) -> list:
            return []

        def read(self, topic: str, signer: str, wait: float) -> dict:
            return {"jobs": []}

        def request(self, record: dict, job: str, wait: float) -> dict:
            return {"accepted": False, "reason": "job 'a' has ended (finished)"}

        def close(self) -> None:
            pass

    said: list[str] = []
    monkeypatch.setattr(cmd, "print_error", lambda message, *a, **k: said.append(str(message)))
    for record, line in (
        (cancel_record("a"), "cannot cancel job a: job 'a' has ended (finished)"),
        (submit_record(JobRequest("a", "")), "job a refused: job 'a' has ended (finished)"),
    ):
        with pytest.raises(SystemExit) as refused:
            cmd._answer(Session(), record, "a", 1.0)  # type: ignore[arg-type]
        assert refused.value.code == 1 and said[-1] == line, said


def test_a_job_cancelled_in_its_startup_wait_ends_at_once(tmp_path: Path) -> None:
    """`fedtier cancel` of a job whose cloud still waits for its cells (a member not started: up to its
    startup wait) ends it at once, no round begun; it waited out the whole startup wait before."""
    from cloud.node import build_cloud
    from protocols.transport.memory import MemoryHub
    from sim.hierarchy import prepare

    cfg = small_config(tmp_path)
    hub = MemoryHub()
    node = build_cloud(cfg, hub.connect("cloud"), cfg.build_algorithm(prepare(cfg).spec), startup_wait=1000.0)
    node.start()  # no cell ever comes online
    node.request_stop("cancelled by the operator")
    hub.loop.run(until=lambda: node.finished, max_steps=100_000)
    assert node.finished and node.job_status == "stopped" and node.stopped == "cancelled by the operator"
    assert hub.loop.now() < 1000.0 and node.history == []


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_fedtier_jobs_says_when_the_list_is_an_offline_clouds(
    reachable_tmp: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The job list is retained: with the cloud down, `fedtier jobs` printed its last list as if all were well
    (a job 'running' that nothing runs). It now reads the cloud's signed status too and says it is offline."""
    from fedtier import cmd_jobs
    from protocols.jobs import seal_record
    from protocols.status import encode_status
    from protocols.wire import topics
    from protocols.wire.keys import Trust, load_keys
    from tests.test_provision import WAIT, clients

    port = free_port()
    where = reachable_tmp / "walk-jobs"
    where.mkdir()
    fed = _provision(where, port)
    ring = load_keys(fed / "nodes" / "cloud" / "keys.toml")
    trust = Trust("cloud", ring.private["cloud"], ring.public)
    listing, status = topics.job_list("fed"), topics.status("fed", "cloud")
    monkeypatch.chdir(fed / "nodes" / "operator")
    monkeypatch.setattr(cmd_jobs, "OFFLINE_GRACE", 0.2)  # this cloud stays offline: its 1.5 s would be waited out
    with mosquitto(fed / "broker" / "mosquitto.conf", port), clients() as make:
        # before any cloud ever served on the broker: said at once, not after the wait's silence (walked: 30 s)
        code, out, exc = _cli("jobs", "--config", "config.toml", "--wait", "1")
        assert exc is None and code == 1, out
        assert out.startswith("note: no cloud has said its status on this broker yet: waiting up to 1 s"), out
        cloud = make(fed / "nodes" / "cloud", port)
        cloud.connect(WAIT)
        jobs = {"jobs": [{"job": "a", "state": "running", "reason": "", "submitted": 1.0, "hash": "ab"}], "at": 1.0}
        cloud.publish(listing, seal_record(jobs, listing, trust.sign), retain=True)
        cloud.publish(status, encode_status("online", topic=status, trust=trust, session="a.x"), retain=True)
        assert cloud.flush(WAIT)
        code, out, exc = _cli("jobs", "--config", "config.toml", "--wait", "10")
        assert exc is None and code == 0 and "running" in out and "offline" not in out and "note" not in out, out
        cloud.publish(status, encode_status("offline", topic=status, trust=trust), retain=True)
        assert cloud.flush(WAIT)
        code, out, exc = _cli("jobs", "--config", "config.toml", "--wait", "10")
        assert exc is None and code == 0 and "warning: the cloud is offline: this is the list it left" in out, out
        assert "a job it lists running resumes when the cloud starts again" in out, out
        # a submission meanwhile: the broker keeps it in the cloud's session and the cloud takes it when it starts
        # again (walked: the job ran); it said 'is `fedtier cloud --serve` running?' as if nothing had been sent
        (fed / "nodes" / "operator" / "job.toml").write_text('[job]\nid = "b"\n\n[run]\nrounds = 1\n')
        code, out, exc = _cli("submit", "job.toml", "--config", "config.toml", "--wait", "1")
        assert exc is None and code == 1, out
        assert "the cloud is offline" in out and "the broker keeps this request for it" in out, out
        # said before the wait too (walked: 30 s of silence, then the error)
        assert out.startswith("note: the cloud is offline (its last status): waiting up to 1 s for it to answer"), out


def test_a_long_lived_agent_gives_each_job_its_data_as_that_jobs_model_takes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device's folder of 16x16 images serving a digits job (8x8): the job's agents train on the images
    resized for the job's model, not on what the agent loaded at its start (no job yet: their own size), which
    a model of another input size cannot take."""
    import numpy as np

    import edge_agent.service
    import fedtier.serve
    from edge_agent.broker import BrokerOptions
    from edge_agent.datasources import load_device_data, write_source
    from edge_agent.runner import make_trainer
    from fedtier.deploy_setup import spec_and_data
    from protocols.trainer import LocalData

    rng = np.random.default_rng(0)
    write_source(
        tmp_path / "imgs", LocalData(rng.random((20, 256), np.float32), np.arange(20) % 10), (1, 16, 16), 10, "images"
    )
    source = str(tmp_path / "imgs")
    at_start = load_device_data(source)[0]
    assert at_start.x.shape[1] == 256
    job = small_config(tmp_path)  # digits: 1x8x8
    built: list = []

    class Service:  # runs one job's build, as AgentService does when the job comes
        def __init__(self, bundle, devices, loop, watch, build, trust, **_) -> None:
            self.build, self.served, self.tasks, self.on_start, self.stopped_during = build, [], 0, None, None
            self.revoked = None

        def stop(self) -> None: ...

        def serve(self) -> None:
            built.append(self.build(job, "job.0"))

    monkeypatch.setattr(edge_agent.service, "AgentService", Service)
    monkeypatch.setattr(fedtier.serve, "on_signals", lambda *stops: None)
    fedtier.serve.serve_agent(
        job,
        "c0-d0",
        at_start,
        BrokerOptions("mqtt://127.0.0.1:1"),
        lambda cfg, spec: make_trainer("torch", spec, cfg),
        lambda cfg, _: spec_and_data(cfg, source),
    )
    assert built[0].data["c0-d0"].x.shape == (20, 64)
    built[0].discard()  # built, never started: its reactor's sockets closed now


def test_a_cell_down_at_submit_is_named_absent_at_start_in_the_summary_and_the_job_record(tmp_path: Path) -> None:
    """c1 is down when the job starts: after the startup wait the job runs with c0 alone (honest), and its
    summary.json and its record in the cloud's job list (`fedtier jobs`) name c1 as absent at start, with why;
    c0, which was there, is not named. A cell that joined later is said to have taken part from its round."""
    import json

    from cloud.jobs import Job, JobQueue
    from cloud.node import build_cloud
    from protocols.jobs import OPERATOR
    from protocols.status import encode_status
    from protocols.transport.memory import MemoryHub
    from protocols.wire import topics
    from sim.hierarchy import prepare
    from sim.launcher import RunResult, write_final

    cfg = small_config(tmp_path, runtime={"cell_deadline": 30.0, "startup_wait": 5.0})
    hub, run = MemoryHub(), cfg.run.name
    cloud = build_cloud(cfg, hub.connect("cloud"), cfg.build_algorithm(prepare(cfg).spec), startup_wait=5.0)
    cells = hub.connect("cells")
    topic = topics.status(run, topics.cell_node("c0"))
    cells.publish(topic, encode_status("online", topic=topic, devices_online=3, devices_total=3), retain=True)
    cloud.start()
    hub.loop.run(until=lambda: cloud.finished)
    assert [r["cells_planned"] for r in cloud.history] == [["c0"]] * 3  # it ran, with c0
    why = "offline at start: not online within the startup wait (5 s)"
    out = tmp_path / "job"
    out.mkdir()
    write_final(out, RunResult.of_cloud(cfg, cloud, out, 1.0))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cells_absent_at_start"] == {"c1": why}  # (no devices here: c0 never answered, it failed)
    queue = JobQueue(tmp_path / "jobs.json")
    queue.submit(Job("a", "x", "h", OPERATOR))
    queue.start("a")
    queue.end("a", "failed", str(cloud.failed), cloud.cells_absent_at_start)
    assert JobQueue(tmp_path / "jobs.json").listing()[0]["cells_absent_at_start"] == {"c1": why}  # durable
    history = [{"round": 0, "cells_reported": ["c0"]}, {"round": 1, "cells_reported": ["c0", "c1"]}]
    late = RunResult(cfg, {}, history, cells_absent_at_start={"c1": why})
    assert late.summary()["cells_absent_at_start"] == {"c1": f"{why}; took part from round 2"}


def test_a_fleet_jobs_summary_names_the_job_and_its_config_hash(tmp_path: Path) -> None:
    """Two jobs of one federation: each summary.json names its job and the config hash the cloud holds for it
    (`fedtier jobs`), beside the federation's run name (kept: the monitor and reports read it); a single run's
    summary (fedtier sim) is as it was, with no job."""
    import json

    from cloud.jobs import Job
    from cloud.node import build_cloud
    from fedtier.serve import write_job_final
    from protocols.jobs import OPERATOR, canonical_job, config_hash
    from protocols.transport.memory import MemoryHub
    from sim.hierarchy import prepare
    from sim.launcher import RunResult

    fed = small_config(tmp_path, run={"name": "fed"})
    summaries = []
    for name, rounds in (("a", 1), ("b", 2)):
        cfg, text = canonical_job(f"[run]\nrounds = {rounds}\n", fed)
        hub = MemoryHub()
        cloud = build_cloud(cfg, hub.connect("cloud"), cfg.build_algorithm(prepare(cfg).spec))
        cloud.start()
        hub.loop.run(until=lambda c=cloud: c.finished)
        out = tmp_path / "jobs" / name
        out.mkdir(parents=True)
        write_job_final(Job(name, text, config_hash(text), OPERATOR, started=1.0), cfg, cloud, out)
        summaries.append(json.loads((out / "summary.json").read_text()))
    a, b = summaries
    assert (a["run"], b["run"]) == ("fed", "fed") and (a["job"], b["job"]) == ("a", "b")
    assert a["config_hash"] == config_hash(canonical_job("[run]\nrounds = 1\n", fed)[1]) != b["config_hash"]
    assert "job" not in RunResult(fed, {}, []).summary() and "config_hash" not in RunResult(fed, {}, []).summary()


def test_a_monitor_opened_after_the_job_ended_shows_how_it_ended_and_the_fleets_jobs(tmp_path: Path) -> None:
    """`fedtier monitor` started once a job has ended: no round record comes (telemetry is not retained), so it
    used to show "no round closed yet". It now shows the job's end from the cloud's retained end state (how, after
    which round, its last accuracy and loss) and, on a federation, the cloud's signed job list: the last job that
    ended, the one running, how many queued. A job list not signed by the cloud is a bad record, not shown."""
    from rich.console import Console

    from cloud.jobs import Job, JobQueue
    from cloud.service import CloudService
    from monitor.live import LiveView
    from monitor.sources import TelemetryFeed
    from monitor.view import CellFilter, render_text
    from protocols.jobs import OPERATOR
    from protocols.transport.memory import MemoryHub
    from protocols.transport.threadloop import ThreadLoop
    from protocols.wire import topics
    from protocols.wire.keys import PublicKeys, Trust, new_seed, public_of
    from protocols.wire.signed import seal_record
    from sim.launcher import SimHierarchy

    cfg = small_config(tmp_path, run={"rounds": 2})
    sim = SimHierarchy(cfg, write_output=False)
    result = sim.run()
    assert result.status == "finished" and result.final_accuracy is not None
    queue = JobQueue(tmp_path / "jobs.json")
    for name in ("A", "B", "C"):
        queue.submit(Job(name, "x", "h", OPERATOR))
    queue.start("A")
    queue.end("A", "finished")
    queue.start("B")
    service = CloudService(cfg, ThreadLoop("t"), lambda: None, queue, lambda c: None, trust=None, operator=None)
    service._publish_list(sim.hub.connect("cloud-service"))  # as the federation's cloud does (retained)
    view = LiveView(0.75, None, CellFilter(), Console(width=200))
    view.state.run = cfg.run.name
    feed = TelemetryFeed(sim.hub.connect("monitor"), cfg.run.name).start()  # after the job: nothing but retained
    sim.hub.loop.run()
    view.pull(feed)
    frame = " ".join(render_text(view.state, width=200).split())
    assert "no round closed yet" not in frame, frame
    accuracy = f"accuracy {result.final_accuracy:.4f}"
    assert f"cloud finished after round 2/2, {accuracy}, loss " in frame, frame
    assert "jobs running B, 1 queued; last ended: A finished" in frame, frame
    # signed: a job list a cell signed (valid credentials, its own key) is refused; the cloud's is shown
    seeds = {n: new_seed() for n in ("cloud", "c0")}
    public = {n: public_of(s) for n, s in seeds.items()}
    keys = PublicKeys(public)

    hub, topic = MemoryHub(), topics.job_list("fed")
    signed = TelemetryFeed(hub.connect("monitor"), "fed", keys).start()
    lying = {"jobs": [{"job": "X", "state": "failed", "reason": "forged", "ended": 1.0}]}
    hub.connect("cell.c0").publish(topic, seal_record(lying, topic, Trust("c0", seeds["c0"], public).sign))
    hub.loop.run()
    assert signed.poll_jobs() is None and "signed by" in str(signed.poll()[1][0])
    hub.connect("cloud").publish(topic, seal_record(lying, topic, Trust("cloud", seeds["cloud"], public).sign))
    hub.loop.run()
    assert signed.poll_jobs() == lying["jobs"]


def test_a_monitor_on_a_finished_sims_output_shows_its_cells_ended_not_waiting(tmp_path: Path) -> None:
    """A tiny ``fedtier sim`` run, then the monitor's model and view (what ``fedtier monitor --once`` renders): on the
    run folder its cells are ``ok`` with their last records and the job finished; live after the job (its hub: only
    retained states, no records) the cells said ``waiting``, as if the job went on, beside a cloud line saying it
    finished. They are ``ended`` now, with the last round their retained states name."""
    from rich.console import Console

    from monitor.live import LiveView
    from monitor.sources import RunDirFollower, TelemetryFeed
    from monitor.view import CellFilter, render_text
    from sim.launcher import SimHierarchy

    cfg = small_config(tmp_path, run={"rounds": 2}, algorithm={"edge_rounds": 1, "local_steps": 2})
    sim = SimHierarchy(cfg)
    result = sim.run()
    assert result.status == "finished" and result.output_dir is not None
    folder = LiveView(0.75, None, CellFilter(), Console(width=200))
    folder.pull(RunDirFollower(result.output_dir))
    now = time.time()
    assert {c: folder.state.state_of(v, now) for c, v in folder.state.cells.items()} == {"c0": "ok", "c1": "ok"}
    frame = " ".join(render_text(folder.state, now, width=200).split())
    assert "cloud round 2/2 closed" in frame and "finished" in frame and "cells 2: 2 ok" in frame, frame
    live = LiveView(0.75, None, CellFilter(), Console(width=200))
    live.state.run = cfg.run.name
    feed = TelemetryFeed(sim.hub.connect("monitor"), cfg.run.name).start()  # after the job: nothing but retained
    sim.hub.loop.run()
    live.pull(feed)
    assert {c: live.state.state_of(v, now) for c, v in live.state.cells.items()} == {"c0": "ended", "c1": "ended"}
    frame = " ".join(render_text(live.state, now, width=200).split())
    assert f"cloud finished after round 2/2, accuracy {result.final_accuracy:.4f}" in frame, frame
    assert "cells 2: 2 ended" in frame and "waiting" not in frame, frame
    assert "│ c0 │ 2 │" in frame and "│ c1 │ 2 │" in frame, frame  # the last round of each (from 1), from its state


def test_a_jobs_end_state_carries_only_finite_figures_and_a_monitor_refuses_others() -> None:
    """The cloud's end state holds its last accuracy and loss where finite (an inf loss would make every monitor
    refuse the whole record); a state whose figures are not finite numbers (a lying node's) is refused."""
    from cloud.round_record import end_figures
    from protocols.state import decode_state
    from protocols.wire import topics
    from protocols.wire.signed import seal_record

    assert end_figures([{"round": 0, "accuracy": 0.5, "loss": 1.0}, {"round": 1, "loss": float("inf")}]) == {
        "accuracy": 0.5
    }
    assert end_figures([]) == {}
    topic = topics.state("fed", "cloud")
    base = {"node": "cloud", "phase": "finished", "since": 1.0, "waiting": [], "round": 2}
    assert decode_state(seal_record({**base, "accuracy": 0.5}, topic, None), topic) is not None
    for bad in ("x", float("nan"), True):
        assert decode_state(seal_record({**base, "accuracy": bad}, topic, None), topic) is None


class _JobsSession:
    """What `fedtier jobs` reads: the cloud's (signed) job list ``listed`` and its status records ``cloud``;
    ``settled``: what the cloud says while the command gives an offline status a moment (its ``settle`` waits)."""

    fed = "fed"

    def __init__(self, listed: dict, cloud: list | None = None, settled: list | None = None) -> None:
        self.listed, self.cloud, self.settled, self.waited = listed, cloud or [], settled or [], []

    def cloud_status(self) -> list:
        return self.cloud

    def read(self, topic: str, signer: str, wait: float, until=None) -> dict:
        return self.listed

    def settle(self, until, seconds: float) -> None:
        self.waited.append(seconds)
        self.cloud.extend(self.settled)

    def close(self) -> None:
        pass


def _fake_jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, session: _JobsSession) -> None:
    """`fedtier jobs --config config.toml` in ``tmp_path`` reads ``session``, not a broker."""
    import fedtier.cmd_jobs as cmd

    monkeypatch.setattr(cmd, "_connect", lambda config, wait: session)
    monkeypatch.chdir(tmp_path)
    Path("config.toml").write_text("")
    monkeypatch.setattr(cmd.console, "_width", 400)  # the CLI's console was made (its width read) at import


def _jobs_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listed: dict) -> tuple[int, str, BaseException | None]:
    """`fedtier jobs --config config.toml`, the cloud's (signed) job list read being ``listed``."""
    _fake_jobs(tmp_path, monkeypatch, _JobsSession(listed))
    return _cli("jobs", "--config", "config.toml")


def test_fedtier_jobs_names_the_cells_a_job_began_without(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`fedtier jobs` prints, with a job's reason, the cells it began without and why (the cloud's job record), and how
    many more than the list names (its first 10)."""
    why = "offline at start: not online within the startup wait (5 s)"
    job = {"job": "a", "state": "finished", "reason": "", "cells_absent_at_start": {"c1": why}}
    code, out, exc = _jobs_cli(tmp_path, monkeypatch, {"jobs": [job, {**job, "cells_absent_at_start_more": 32}]})
    assert exc is None and code == 0 and f"c1: {why}" in out, (exc, out)
    assert out.count(f"c1: {why}") == 2 and out.count("and 32 more cells absent at start") == 1, out


def test_fedtier_jobs_piped_prints_each_job_on_one_line_on_stdout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Walk-through: `fedtier jobs` in a pipe or a file broke each row over several lines at 80 columns (a job's id,
    state and reason in three pieces: unreadable to grep); off a terminal it prints the table 200 columns wide, on
    stdout (the command's output, as --json's), so a job is one line."""
    why = "stalled: no cell answered round 7 within its deadline (2 of 2 cells offline)"
    listed = {
        "jobs": [{"job": "job-with-a-long-name", "state": "failed", "reason": why, "submitted": 1.0, "hash": "ab"}]
    }

    _fake_jobs(tmp_path, monkeypatch, _JobsSession(listed))
    res = CliRunner().invoke(main, ["jobs", "--config", "config.toml"])
    assert res.exit_code == 0, res.output
    rows = [line for line in res.stdout.splitlines() if "job-with-a-long-name" in line]
    assert len(rows) == 1 and "failed" in rows[0] and why in rows[0] and len(rows[0]) > 80, res.stdout


@pytest.mark.parametrize("says_idle", [True, False])
def test_fedtier_jobs_waits_a_moment_before_saying_the_cloud_is_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, says_idle: bool
) -> None:
    """A fresh-clone suite: `fedtier jobs` right after a job ended warned "the cloud is offline" of a running cloud (a
    will of one of its connections, most likely, which its idle status replaces at once). An offline status is now
    given a moment (OFFLINE_GRACE) to be replaced: a live cloud's idle replaces it (no warning); a cloud that stays
    offline is still said to be."""
    import fedtier.cmd_jobs as cmd

    listed = {"jobs": [{"job": "a", "state": "cancelled", "reason": "cancelled by the operator"}]}
    session = _JobsSession(listed, [{"state": "offline"}], [{"state": "idle"}] if says_idle else [])
    _fake_jobs(tmp_path, monkeypatch, session)
    res = CliRunner().invoke(main, ["jobs", "--config", "config.toml", "--json"])
    assert res.exit_code == 0 and session.waited == [cmd.OFFLINE_GRACE], (res.output, session.waited)
    assert ("the cloud is offline" in res.output) is not says_idle, res.output
    assert json.loads(res.stdout)[0]["state"] == "cancelled"


def test_submit_wait_end_and_fedtier_jobs_say_how_well_an_ended_job_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Walk-through: `fedtier submit --wait-end` said "job job-b: finished" and `fedtier jobs` listed it finished, not
    how well. Both say the rounds and the cloud's last evaluation the job list carries (`cloud.jobs.final_figures`);
    a value that is no finite number (a cloud of another version, a bad record) is left out, not printed."""
    import fedtier.cmd_jobs as cmd

    done = {"job": "a", "state": "finished", "reason": "", "rounds": 20, "accuracy": 0.9220056, "loss": 0.3674045}
    odd = {"job": "b", "state": "failed", "reason": "stalled", "rounds": "20", "accuracy": "9" * 50, "loss": True}

    class Session:
        fed = "fed"

        def read(self, topic: str, signer: str, wait: float, until=None) -> dict:
            return {"jobs": [done, odd]}

        def cloud_status(self) -> list:
            return []

        def close(self) -> None:
            pass

    monkeypatch.setattr(cmd, "_connect", lambda config, wait: Session())
    for job, code in (("a", 0), ("b", 3)):
        with pytest.raises(SystemExit) as ended:
            cmd._wait_end("config.toml", job, 5.0)
        assert ended.value.code == code, job
    said = "".join(capsys.readouterr())
    assert "job a: finished (20 rounds, accuracy 0.9220, loss 0.3674)\n" in said, said
    assert "job b: failed: stalled\n" in said, said  # nothing of its odd values
    code, out, exc = _jobs_cli(tmp_path, monkeypatch, {"jobs": [done, odd]})
    assert exc is None and code == 0, (exc, out)
    assert "┃ job ┃ state ┃ submitted ┃ hash ┃ rounds ┃ accuracy ┃ reason ┃" in out, out
    assert "│ a │ finished │ 1970-01-01 00:00:00 │ │ 20 │ 0.9220 │ │" in out, out
    assert "│ b │ failed │ 1970-01-01 00:00:00 │ │ │ │ stalled │" in out, out


def test_fedtier_jobs_on_an_empty_queue_says_there_are_none_and_how_to_submit_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A federation no job was submitted to: `fedtier jobs` printed an empty table (headers, no row), which reads as
    a broken command; it says there are no jobs and the command that submits one, with the operator's config."""
    code, out, exc = _jobs_cli(tmp_path, monkeypatch, {"jobs": []})
    assert exc is None and code == 0, (exc, out)
    assert out == "no jobs: the cloud lists none; submit one with `fedtier submit JOB.toml --config config.toml`", out


def test_the_record_commands_on_a_federations_folder_name_its_jobs_run_folders(tmp_path: Path) -> None:
    """Walking the tutorial, an operator points ``fedtier monitor``, ``logs`` and ``report`` at the cloud's
    ``runs/fed`` (the folder the tutorial names, holding jobs.json and jobs/{job}). The monitor showed an empty
    run ("fed: ? (0 cells) cloud: no round closed yet", exit 0), logs said "has no records". Each now exits 2
    naming the jobs' run folders; on a job's folder they work as before."""
    from sim.launcher import SimHierarchy

    fed = tmp_path / "runs" / "fed"
    cfg = small_config(tmp_path, run={"rounds": 1, "output": str(fed / "jobs" / "job-a")}, algorithm={"local_steps": 1})
    assert SimHierarchy(cfg).run().status == "finished"
    (fed / "jobs.json").write_text('{"format": 1, "jobs": []}')
    for cmd in (["monitor", str(fed), "--once"], ["logs", str(fed)], ["report", str(fed)]):
        code, out, unexpected = _cli(*cmd)
        assert unexpected is None and code == 2, (cmd, code, out)
        assert "is a federation's folder, not a run's" in out, out
        assert f"{fed / 'jobs' / 'JOB'}(job-a)" in "".join(out.split()), out  # (a long path wraps anywhere)
    code, out, _ = _cli("logs", str(fed / "jobs" / "job-a"), "--event", "round")
    assert code == 0 and "│ round │ 1 │ cloud │ 2/2 cells │" in out, out


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_submit_whose_connection_another_operator_command_took_over_says_so(
    reachable_tmp: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two operator commands at once (seen: `fedtier jobs` beside `submit --wait-end`, submits 0.7 s apart): the
    broker keeps one connection per identity, so each takes the other's over. A submit whose answer was lost so
    said 'is `fedtier cloud --serve` running?' of a running cloud; it now names the takeover and `fedtier jobs`."""
    import threading

    from protocols.jobs import seal_record
    from protocols.wire import topics
    from protocols.wire.keys import Trust, load_keys
    from tests.test_provision import WAIT, clients

    port = free_port()
    where = reachable_tmp / "walk-takeover"
    where.mkdir()
    fed = _provision(where, port)
    ring = load_keys(fed / "nodes" / "cloud" / "keys.toml")
    listing = topics.job_list("fed")
    (fed / "nodes" / "operator" / "job.toml").write_text('[job]\nid = "b"\n\n[run]\nrounds = 1\n')
    monkeypatch.chdir(fed / "nodes" / "operator")
    with mosquitto(fed / "broker" / "mosquitto.conf", port), clients() as make:
        cloud = make(fed / "nodes" / "cloud", port)  # a cloud that lists its jobs and answers nothing
        cloud.connect(WAIT)
        cloud.publish(
            listing,
            seal_record({"jobs": [], "at": 1.0}, listing, Trust("cloud", ring.private["cloud"], ring.public).sign),
            retain=True,
        )
        assert cloud.flush(WAIT)
        other = make(fed / "nodes" / "operator", port)  # the other command, as the operator: it connects once the
        take_over = threading.Thread(target=lambda: other.connect(WAIT))  # submit's request is through, taking over
        cloud.subscribe(topics.job_submit("fed"), lambda _t, _d: take_over.start())  # (one request: one start)
        assert cloud.wait_subscribed(WAIT)
        # --wait 3: the submit's connection comes back (and counts) within its reconnect delay, at most 1.5 s
        code, out, exc = _cli("submit", "job.toml", "--config", "config.toml", "--wait", "3")
        take_over.join(WAIT)
    assert exc is None and code == 1, out
    assert "this command's connection to the broker was lost" in out and "`fedtier jobs` says whether job b" in out, out


def test_a_revoked_devices_status_cleared_by_its_cell_is_no_rejected_record(caplog: pytest.LogCaptureFixture) -> None:
    """A cell clears its revoked device's retained status (an empty retained message): a live `fedtier monitor`
    (keys given, as from the monitor bundle) logged "rejected a status record ...: not a JSON record" for it, a
    false alarm in the operator's terminal at every revocation. Cleared is no record; a forged one still is."""
    import logging

    from monitor.sources import TelemetryFeed
    from protocols.status import encode_status
    from protocols.transport.memory import MemoryHub
    from protocols.wire import topics
    from protocols.wire.keys import PublicKeys, Trust, new_seed, public_of

    seeds = {n: new_seed() for n in ("cloud", "c0", "c0-d0")}
    public = {n: public_of(s) for n, s in seeds.items()}
    hub = MemoryHub()
    feed = TelemetryFeed(hub.connect("monitor"), "fed", PublicKeys(public)).start()
    cell, topic = hub.connect("cell.c0"), topics.device_status("fed", "c0", "c0-d0")
    with caplog.at_level(logging.WARNING, logger="fedtier.status"):
        cell.publish(topic, b"", retain=True)  # the revoked device's status, cleared by its cell
        hub.loop.run()
        assert not [r for r in caplog.records if "rejected" in r.getMessage()], caplog.text
        forged = encode_status("online", topic=topic, trust=Trust("c0", seeds["c0"], public))  # not c0-d0's key
        cell.publish(topic, forged)
        hub.loop.run()
    assert "rejected a status record" in caplog.text  # a real bad record still says so
    _, _, statuses = feed.poll()
    assert statuses == []


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_running_node_whose_certificate_was_revoked_says_why_its_reconnects_fail(
    reachable_tmp: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A device revoked while connected keeps its connection until the broker restarts; then every reconnect
    presents the revoked certificate and the broker hangs up before its CONNACK. The node logged "lost
    connection ... (Unspecified error); reconnecting" every 30 s for ever, with no word of why; it now says the
    broker closed it before accepting it and names a revoked certificate among the causes."""
    import contextlib
    import logging

    from edge_agent.broker import BrokerOptions
    from protocols.config import load_config
    from protocols.transport.reactor import Reactor
    from protocols.transport.threadloop import ThreadLoop
    from tests.conftest import wait_until

    port, where = free_port(), reachable_tmp / "walk-revoked"
    where.mkdir()
    fed = _provision(where, port)
    conf = fed / "broker" / "mosquitto.conf"
    loop, reactor = ThreadLoop("device").start(), Reactor().start()
    caplog.set_level(logging.WARNING, logger="protocols.transport.mqtt")
    try:
        with mosquitto(conf, port):
            with contextlib.chdir(fed / "nodes" / "c0-d0"):
                cfg = load_config("config.toml")
                broker = BrokerOptions.from_config(cfg, None)
                device = broker.transport("device.c0-d0", "fed", loop, reactor=reactor, reconnect_min_delay=0.1)
                device.connect(5.0)
            monkeypatch.chdir(where)
            code, out, exc = _cli("provision", "revoke", "--out", "fed", "c0-d0")
            assert exc is None and code == 0, (exc, out)
        caplog.clear()
        with mosquitto(conf, port):  # the broker back: the device's reconnect is refused
            said = lambda: "closed the connection of" in caplog.text and "revoked" in caplog.text  # noqa: E731
            assert wait_until(said, 10.0), caplog.text
            assert wait_until(lambda: device._refusals >= 4, 10.0)  # retried (0.1 s, doubling): said once, not 4 times
            assert caplog.text.count("closed the connection of") == 1, caplog.text
        device.close(0.1)
    finally:
        reactor.stop()
        loop.stop()


def test_a_cancelled_timer_lets_go_of_what_it_would_have_called() -> None:
    """Walk-through: a long-lived cloud serving short jobs back to back held every ended job's server, model and
    connection (6 CloudServers after 6 jobs, freed only 40 s later) because a cancelled timer (the startup wait's,
    the idle heartbeat's) kept its callback in its loop's queue until it came due. A cancelled timer now drops it.
    The job is freed by its reference count the moment nothing holds it: no collection is run (three full ones over
    the suite's heap cost this test 2.7 s on a loaded machine)."""
    import weakref

    from protocols.transport.memory import VirtualLoop
    from protocols.transport.reactor import Reactor
    from protocols.transport.threadloop import ThreadLoop

    class Job:
        def begin(self) -> None:
            raise AssertionError("a cancelled timer ran")

    reactor = Reactor("r")
    for loop in (ThreadLoop("t"), VirtualLoop(), reactor):
        job = Job()
        gone = weakref.ref(job)
        handle = loop.call_later(600.0, job.begin)  # e.g. the startup wait of a job that ended before it
        loop.cancel(handle)
        del job
        assert gone() is None, type(loop).__name__
        assert handle.cancelled
    reactor.close()


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_device_revoked_between_jobs_leaves_no_status_on_the_broker(tmp_path: Path) -> None:
    """Walk-through: c0-d2 revoked while the federation was idle kept its last idle status, retained, for ever
    (its cell cleared the status only of a device revoked during a job it served), so every `fedtier fleet` and
    monitor logged it refused ("unknown signer"). The idle cell now clears it when the signed roster revokes it."""
    import threading

    from cell_server.service import CellService
    from protocols.config import TopologySection
    from protocols.roster import Roster, roster_topic, sign_roster
    from protocols.status import idle_status
    from protocols.transport.broker import MosquittoBroker
    from protocols.transport.mqtt import MqttTransport
    from protocols.transport.threadloop import ThreadLoop
    from protocols.wire import topics
    from protocols.wire.keys import Trust, generate_keys
    from sim.local_federation import federation_bundle
    from tests.conftest import wait_until

    bundle = federation_bundle(small_config(tmp_path, topology={"cells": 1, "devices_per_cell": 2}))
    run, ring = bundle.run.name, generate_keys(TopologySection(cells=1, devices_per_cell=2))
    trust = {n: Trust(n, ring.private[n], ring.public) for n in ("cloud", "c0", "c0-d1")}
    roster = Roster.from_topology(run, {"c0": ["c0-d0", "c0-d1"]}, ring.public, 100.0)
    gone = topics.device_status(run, "c0", "c0-d1")
    with MosquittoBroker() as broker:
        loop, watching = ThreadLoop("cell-c0"), ThreadLoop("watch").start()
        nodes = MqttTransport.from_url(broker.url, "nodes", watching).connect()
        nodes.publish(gone, idle_status(gone, trust["c0-d1"]), retain=True, qos=1)  # its last, before it went
        nodes.publish(roster_topic(run), sign_roster(roster.without("c0-d1"), trust["cloud"].sign), retain=True, qos=1)
        nodes.flush(5.0)
        seen: list[bytes] = []
        nodes.subscribe(gone, lambda _t, data: seen.append(data))
        assert wait_until(lambda: bool(seen), 5.0) and seen[0] != b"", seen  # retained: the broker holds it
        service = CellService(
            bundle,
            "c0",
            loop,
            lambda: MqttTransport.from_url(broker.url, "c0", loop).connect(),
            lambda *_: None,
            trust["c0"],
        )
        thread = threading.Thread(target=service.serve, name="cell-service", daemon=True)
        thread.start()
        try:
            assert wait_until(lambda: seen[-1:] == [b""], 10.0), seen  # cleared, with the cell idle
        finally:
            service.stop()
            thread.join(10)
            nodes.close()
            watching.stop()


def test_a_monitor_kept_open_on_a_federation_follows_the_next_job() -> None:
    """Walk-through: a `fedtier monitor` open across jobs said "finished" through the whole next job (the end state of
    the one before), never flagged a silent cell again, and took none of the next job's records until its rounds
    passed the ended job's last round number; with --exit-when-done, started right after a submission, it left at
    once with the ended job's exit status. A cloud started again after the end begins a new job in the view; and
    while the cloud lists a job running or queued the monitor is not done."""
    from monitor.state import MonitorState
    from protocols.records import CellRecord, RoundRecord

    def cell(rnd: int, t: float) -> CellRecord:
        return CellRecord(
            run="fed", round=rnd, edge_round=0, cell="c0", algorithm="fedavg", planned=["c0-d0"], answered=["c0-d0"],
            closed_by="all answered", duration_s=0.1, deadline_s=30.0, time=t,
        )  # fmt: skip

    def cloud(rnd: int, t: float) -> RoundRecord:
        return RoundRecord(
            run="fed", round=rnd, rounds=20, closed_by="all reported", cells_reported=["c0"], duration_s=0.1, time=t
        )

    state = MonitorState()
    for rnd in range(20):  # job A
        state.add(cell(rnd, 100.0 + rnd))
        state.add(cloud(rnd, 100.0 + rnd))
    state.add_state({"node": "cloud", "phase": "finished", "since": 120.0, "started": 99.0})
    assert state.finished and state.done
    state.jobs = [{"job": "A", "state": "finished", "reason": "", "ended": 120.0}, {"job": "B", "state": "queued"}]
    assert not state.done  # submitted: --exit-when-done follows B
    state.add_state({"node": "cloud", "phase": "starting", "since": 130.0, "started": 130.0})  # job B's cloud
    assert not state.finished and state.cloud is None and state.cells["c0"].last is None
    state.add(cell(0, 131.0))
    state.add(cloud(0, 131.0))
    assert state.cloud is not None and state.cloud.round == 0 and state.current_round == 0
    assert state.cells["c0"].last is not None and state.cells["c0"].last.round == 0
    assert state.silent(state.cells["c0"], 131.0 + 31.0) is not None  # silent past its deadline: flagged again
