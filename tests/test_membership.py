"""A fleet whose membership changes while it runs (``fedtier provision add-device|revoke``), as an operator
runs it: a provisioned federation (Mosquitto with TLS and ACLs, every node its own long-lived process from
its bundle), a job, then a device enrolled and another revoked with the broker up, then a second job: the
new device takes part, the revoked one is not planned, its login is refused, and no edge round waits out a
deadline. Below it, the cell's side: a device revoked mid-round is refused, counted, and not waited for."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edge_agent.runner import save_device_data
from fedtier.membership import load_federation
from fedtier.provisioning import provision
from protocols.jobs import canonical_job, read_job_file
from protocols.procs import popen
from protocols.trainer import LocalData
from protocols.transport.broker import find_mosquitto
from protocols.wire import topics
from sim.hierarchy import prepare
from tests.conftest import free_port_run, small_config, wait_until, with_keys
from tests.test_provision import WAIT, Inbox, broker_user, clients, mosquitto, provision_cli, reachable_tmp  # noqa: F401

FEDTIER = str(Path(sys.executable).parent / "fedtier")

JOB = """
[job]
id = "{id}"
[run]
seed = 1
rounds = 2
[algorithm]
name = "fedavg"
edge_rounds = 1
local_steps = 3
batch_size = 16
lr = 0.1
[model]
name = "mlp"
hidden = [16]
[data]
dataset = "digits"
partition = "iid"
max_train = 300
[runtime]
device_deadline = 60.0
startup_wait = 120.0
heartbeat = 1.0
"""


def _start(cmd: list[str], cwd: Path) -> subprocess.Popen:
    return popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _jobs(cloud_out: Path) -> dict[str, str]:
    try:
        return {j["job"]: j["state"] for j in json.loads((cloud_out / "jobs.json").read_text())["jobs"]}
    except (OSError, ValueError):
        return {}


def _scrape(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as res:
        return str(res.read().decode())


def _value(text: str, series: str) -> float:
    """The value of ``series`` (name and labels as exposed) in a scrape; NaN if absent."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return float("nan")


def _logins(*bundles: Path) -> list[str]:
    """Connect with each bundle's credentials and certificate as its agent does (its config, read from its
    folder); "ok" or the broker's refusal, for each."""
    from edge_agent.runner import BrokerOptions
    from protocols.config import load_config
    from protocols.transport.threadloop import ThreadLoop

    said = []
    for bundle in bundles:
        with contextlib.chdir(bundle):
            cfg = load_config("config.toml")
            loop = ThreadLoop("probe").start()
            try:
                t = BrokerOptions.from_config(cfg, None).transport("probe", cfg.run.name, loop, persistent=False)
                t.connect()
                t.close()
                said.append("ok")
            except ConnectionError as e:
                said.append(f"refused: {e}")
            finally:
                loop.stop()
    return said


def _say_last_words(outputs: dict[str, str], *logs: Path) -> None:
    """Print each node's output tail and each file's end (the broker's log, the cloud's queue): pytest shows what a
    test printed when it fails, wherever it fails (a job that did not end, a record not as expected)."""
    for name, out in outputs.items():
        print(f"--- {name}'s output ends:\n{out[-3000:]}")
    for path in logs:
        try:
            print(f"--- {path} ends:\n{path.read_bytes()[-4000:].decode(errors='replace')}")
        except OSError as exc:
            print(f"--- {path}: {exc}")


def _operator(*args: str) -> subprocess.CompletedProcess:
    """``fedtier ARGS`` run in this process (the operator's commands: no torch to import, no process to start), its
    output on one line (the console wraps it)."""
    from click.testing import CliRunner

    from fedtier.cli import main

    res = CliRunner().invoke(main, list(args))
    unexpected = "" if res.exception is None or isinstance(res.exception, SystemExit) else repr(res.exception)
    return subprocess.CompletedProcess(args, res.exit_code, " ".join(res.output.split()) + unexpected)


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_enroll_and_revoke_between_jobs_on_a_running_federation(reachable_tmp: Path) -> None:  # noqa: F811
    tmp = reachable_tmp / "members"
    fed_cfg = small_config(tmp, run={"name": "fleet"}, topology={"cells": 1, "devices_per_cell": 2})
    # the broker's port and the long-lived nodes' /metrics ports, below the ephemeral range: a node binds its port
    # seconds after this, and meanwhile no client connection of another test can take it as its local port
    port = free_port_run(4)
    user = broker_user()
    prov = tmp / "prov"
    done = provision(
        fed_cfg,
        prov,
        port=port,
        bind="127.0.0.1",
        broker_user=user[1] if user else None,
        federation=True,
        fedtier_bin=FEDTIER,
        max_device_weight=1000,
    )
    nodes = done.out / "nodes"
    for name in ("A", "B"):
        (tmp / f"{name}.toml").write_text(JOB.format(id=name))
    cfg_a, _ = canonical_job(read_job_file(tmp / "A.toml").config, fed_cfg)
    prep = prepare(cfg_a)
    for device, data in prep.device_data.items():
        save_device_data(nodes / device / "data.npz", data, prep.spec)
    save_device_data(nodes / "cloud" / "test.npz", LocalData(prep.dataset.x_test, prep.dataset.y_test), prep.spec)
    cloud_out, cell_out = nodes / "cloud" / "runs" / "fleet", nodes / "c0" / "runs" / "fleet"

    def agent(device: str, *extra: str) -> subprocess.Popen:
        cmd = [FEDTIER, "agent", "config.toml", "--serve", "--device", device, "--data", "data.npz", *extra]
        return _start(cmd, nodes / device)

    metrics = {node: port + 1 + i for i, node in enumerate(("cloud", "cell", "c0-d0"))}  # long-lived nodes serve it
    with mosquitto(done.broker / "mosquitto.conf", port):
        procs = {
            "cloud": _start(
                [FEDTIER, "cloud", "config.toml", "--serve", "--test-data", "test.npz", "--metrics-port"]
                + [str(metrics["cloud"])],
                nodes / "cloud",
            ),
            "cell": _start(
                [FEDTIER, "cell", "config.toml", "--serve", "--cell", "c0", "--metrics-port", str(metrics["cell"])]
                + ["--set", "monitoring.device_metrics=true"],
                nodes / "c0",
            ),
            "c0-d0": agent("c0-d0", "--metrics-port", str(metrics["c0-d0"])),
            "c0-d1": agent("c0-d1"),
        }
        try:
            operator = nodes / "operator"
            with contextlib.chdir(operator):  # the operator's commands, from its bundle, in this process
                res = _operator("jobs", "--config", "config.toml", "--wait", "50")  # the cloud is up
                assert res.returncode == 0, res.stdout + (
                    procs["cloud"].poll() is not None and procs["cloud"].communicate()[0] or ""
                )
                res = _operator("submit", str(tmp / "A.toml"), "--config", "config.toml")
            assert res.returncode == 0 and "queued" in res.stdout, res.stdout
            assert wait_until(lambda: _jobs(cloud_out).get("A") == "finished", 240), _jobs(cloud_out)
            scraped = {node: _scrape(p) for node, p in metrics.items()}
            assert _value(scraped["cloud"], 'fedtier_cloud_rounds_total{closed_by="all_reported",run="fleet"}') == 2
            expiry = _value(scraped["cloud"], 'fedtier_certificate_expiry_timestamp_seconds{node="cloud",run="fleet"}')
            assert expiry - time.time() > 300 * 86400
            assert _value(scraped["cell"], 'fedtier_cell_devices_answered_total{cell="c0",run="fleet"}') == 4
            assert _value(scraped["c0-d0"], 'fedtier_agent_tasks_total{run="fleet"}') == 2

            # enroll c0-d2 and revoke c0-d1 while everything runs (the broker reloaded, the roster published)
            res = _operator("provision", "add-device", "--out", str(prov), "--cell", "c0", "--device", "c0-d2")
            assert res.returncode == 0 and "published roster version 2" in res.stdout, res.stdout
            assert "reloaded the broker" in res.stdout, res.stdout
            rng = np.random.default_rng(0)  # the new device's own data: some of the training set
            pick = rng.choice(len(prep.dataset.y_train), 60, replace=False)
            save_device_data(
                nodes / "c0-d2" / "data.npz",
                LocalData(prep.dataset.x_train[pick], prep.dataset.y_train[pick]),
                prep.spec,
            )
            procs["c0-d2"] = agent("c0-d2")
            res = _operator("provision", "revoke", "--out", str(prov), "--node", "c0-d1")
            assert res.returncode == 0 and "published roster version 3" in res.stdout, res.stdout
            revoked, enrolled = _logins(nodes / "c0-d1", nodes / "c0-d2")
            assert revoked.startswith("refused"), "a revoked device still logs in"
            assert enrolled == "ok"
            # and c0-d3, whose own data (784 features, no recorded geometry) cannot serve a digits job: it says so
            res = _operator("provision", "add-device", "--out", str(prov), "--cell", "c0", "--device", "c0-d3")
            assert res.returncode == 0 and "published roster version 4" in res.stdout, res.stdout
            np.savez(nodes / "c0-d3" / "data.npz", x=rng.random((30, 784), dtype=np.float32), y=np.arange(30) % 10)
            procs["c0-d3"] = agent("c0-d3")

            with contextlib.chdir(operator):  # --wait-end: followed to its end, the exit status says how it ended
                res = _operator("submit", str(tmp / "B.toml"), "--config", "config.toml", "--wait-end", "240")
            assert res.returncode == 0 and "job B: queued" in res.stdout and "job B: finished" in res.stdout, res.stdout
            assert _jobs(cloud_out).get("B") == "finished"
            # no job in progress is left retained: a node (re)started now waits for the next job, not B
            with clients() as make:
                inbox, current, listed = Inbox(), topics.current_job("fleet"), topics.job_list("fleet")
                watcher = make(nodes / "monitor", port)
                watcher.subscribe(current, inbox)  # first: its retained record comes before the list's
                watcher.subscribe(listed, inbox)
                watcher.connect(WAIT)
                inbox.wait_for(listed)
                assert [t for t, data in inbox.snapshot() if t == current and data] == []
            cell_metrics = _scrape(metrics["cell"])  # job B's devices, each once: job A's server is gone
            online = [
                line.split("}")[0] for line in cell_metrics.splitlines() if line.startswith("fedtier_device_online")
            ]
            assert sorted(online) == [
                f'fedtier_device_online{{cell="c0",device="{d}",run="fleet"' for d in ("c0-d0", "c0-d2", "c0-d3")
            ], online
            assert _value(
                cell_metrics, 'fedtier_cell_devices_absent_total{cell="c0",reason="cannot_serve",run="fleet"}'
            )
            assert _value(cell_metrics, 'fedtier_cell_devices_answered_total{cell="c0",run="fleet"}') == 8
        finally:
            outputs = {}
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for name, p in procs.items():
                try:
                    outputs[name] = p.communicate(timeout=20)[0]
                except subprocess.TimeoutExpired:
                    p.kill()
                    outputs[name] = p.communicate()[0]
            _say_last_words(outputs, done.broker / "mosquitto.log", cloud_out / "jobs.json")
    records = [json.loads(line) for line in (cell_out / "jobs" / "B" / "aggregation.jsonl").read_text().splitlines()]
    summary = [(r["planned"], r["answered"], r["absent"], r["closed_by"]) for r in records]
    assert records and all(r["answered"] == ["c0-d0", "c0-d2"] for r in records), summary
    why = "cannot serve: data.npz: 784 features per sample, but the model takes 1x8x8 = 64"
    assert all(r["absent"] == {"c0-d3": why} for r in records), summary
    jobs = {j["job"]: j for j in json.loads((cloud_out / "jobs.json").read_text())["jobs"]}
    first_round = json.loads((cloud_out / "jobs" / "B" / "metrics.jsonl").read_text().splitlines()[0])
    assert first_round["time"] - jobs["B"]["started"] < 60  # not its startup wait (120 s) for c0-d3
    assert all(r["closed_by"] == "all answered" and r["duration_s"] < 30 for r in records)  # no deadline waited
    first = [json.loads(line) for line in (cell_out / "jobs" / "A" / "aggregation.jsonl").read_text().splitlines()]
    assert first[0]["answered"] == ["c0-d0", "c0-d1"]
    for job in ("A", "B"):  # the monitor on the cell's own job folder: whose it is and that the job ended, not silent
        res = _operator("monitor", str(cell_out / "jobs" / job), "--once", "--width", "200")
        assert res.returncode == 0 and f"cell c0's job folder (job {job})" in res.stdout, res.stdout
        assert "now finished" in res.stdout and "silent" not in res.stdout.lower(), res.stdout
    fed = load_federation(prov)
    assert fed.roster.version == 4 and "c0-d1" in fed.roster.revoked
    assert fed.roster.members("c0") == ["c0-d0", "c0-d2", "c0-d3"]
    assert "user c0-d1\n" not in (prov / "broker" / "acl").read_text()
    assert "served 1 job (A)" in outputs["c0-d1"], outputs["c0-d1"]


def test_a_device_revoked_by_the_roster_mid_round_is_refused_counted_and_not_waited_for(tmp_path: Path) -> None:
    """The cell's side, in memory on a virtual clock with signed messages: the cloud's roster revokes c0-d1 while
    the round waits for it (device deadline 100 s); the round closes at once with the others' results, and what
    c0-d1 then sends, signed with its real key, is refused and counted in the next record."""
    from cell_server.node import build_cell
    from cell_server.service import apply_roster
    from protocols.roster import Roster
    from protocols.transport.memory import MemoryHub
    from protocols.wire import topics
    from protocols.wire.envelope import decode_message
    from protocols.wire.keys import Trust
    from protocols.wire.messenger import Messenger
    from protocols.wire.payload import Payload

    cfg = small_config(
        tmp_path,
        topology={"cells": 1, "devices_per_cell": 3},
        algorithm={"edge_rounds": 2},
        runtime={"heartbeat": 1.0, "heartbeat_timeout": 4.0, "device_deadline": 100.0},
    )
    cfg, ring = with_keys(cfg, tmp_path)
    algorithm = cfg.build_algorithm(prepare(cfg).spec)
    run, hub = cfg.run.name, MemoryHub()
    cell = build_cell(cfg, "c0", hub.connect("cell.c0"), algorithm, heartbeats=True, assume_online=True)
    cell.cloud.pin("job.0")
    peer = hub.connect("peer")
    tasks: list[tuple[str, int]] = []
    for d in ("c0-d0", "c0-d1", "c0-d2"):
        peer.subscribe(
            topics.device_task(run, "c0", d),
            lambda t, data: tasks.append((t.split("/")[-2], decode_message(data)[0].edge_round)),
        )
    cell.start()

    def signed(node: str) -> Messenger:
        m = Messenger(peer, run, node, trust=Trust(node, ring.private[node], ring.public))
        m.session = "job.0"
        return m

    signed("cloud").send(
        topics.cell_task(run, "c0"), "cell_task", algorithm.cloud().plan(0, ["c0"])["c0"], round=0, cell="c0"
    )
    hub.loop.run(until=lambda: len(tasks) == 3)
    start = hub.loop.now()

    def answer(device: str, edge_round: int) -> None:
        signed(device).send(
            topics.device_result(run, "c0", device),
            "device_result",
            Payload({"diverged": "test"}),
            round=0,
            edge_round=edge_round,
            cell="c0",
        )

    answer("c0-d0", 0)
    answer("c0-d2", 0)
    hub.loop.run(until=lambda: cell.answers.pending == {"c0-d1"})
    roster = Roster.from_topology(run, {"c0": ["c0-d0", "c0-d1", "c0-d2"]}, ring.public, 100.0).without("c0-d1")
    apply_roster(cell, "c0", roster)
    assert cell.records[0]["absent"] == {"c0-d1": "revoked"} and hub.loop.now() == start  # no deadline waited
    hub.loop.run(until=lambda: len(tasks) == 5)
    assert sorted(d for d, e in tasks if e == 1) == ["c0-d0", "c0-d2"]  # not planned again
    answer("c0-d1", 1)  # it goes on, with its real key: refused, and counted in the next record
    answer("c0-d0", 1)
    answer("c0-d2", 1)
    hub.loop.run(until=lambda: len(cell.records) == 2)
    refused = cell.records[1]["rejected"]
    assert [(r["device"], r["kind"]) for r in refused] == [("c0-d1", "revoked")], refused
    from monitor.state import MonitorState
    from protocols.records import CellRecord

    monitor = MonitorState()  # fedtier monitor, from these records: the revoked device named
    monitor.add_all(CellRecord.model_validate(r) for r in cell.records)
    assert "cell c0: device(s) c0-d1 revoked by the federation" in monitor.alerts(now=cell.records[-1]["time"])


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_provisioned_broker_survives_a_reload_while_a_nodes_persistent_session_is_away(
    reachable_tmp: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``fedtier provision add-device|revoke|renew`` reload the running broker (SIGHUP). Mosquitto 2.0.11 then
    disconnects once more every persistent session that is away (no TLS connection, so no identity); with
    ``persistent_client_expiration`` set, that put the session in the broker's expiry list a second time, the
    node's return freed the session with its first entry still listed, and the broker's expiry check (every
    second) read freed memory: at some later moment it expired a live client or crashed (SIGSEGV), and the
    fleet's next job never ended. Provisioning no longer sets the option, and a reload takes it out of a broker
    provisioned before. Here the broker's freed memory is overwritten at once (glibc's MALLOC_PERTURB_, its
    per-thread cache off), so such a read crashes it within the second."""
    from fedtier.broker_files import reload_brokers
    from tests.test_provision import clients, provision_cli

    p = provision_cli(reachable_tmp, "reload")
    out, port = p["out"], p["port"]
    log, conf = out / "broker" / "mosquitto.log", out / "broker" / "mosquitto.conf"
    assert "persistent_client_expiration" not in conf.read_text()
    with conf.open("a") as f:  # as provisioned before: the reload below takes the line out
        f.write("persistent_client_expiration 7d\n")
    monkeypatch.setenv("MALLOC_PERTURB_", "170")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0")
    with mosquitto(conf, port) as broker, clients() as make:
        away = make(out / "nodes" / "cloud", port, persistent=True)
        away.connect(WAIT)
        away.close()  # its session stays on the broker, away
        [reloaded] = reload_brokers([out / "broker"])
        assert reloaded.startswith("reloaded the broker") and "removed persistent_client_expiration" in reloaded
        assert wait_until(lambda: "Reloading config." in log.read_text(errors="replace"), WAIT)
        back = make(out / "nodes" / "cloud", port, persistent=True)
        back.connect(WAIT)  # its old session is freed
        # The broker checks its expiry list in the first turn of its loop in each new second (of time()): a
        # publish it acknowledged in a later second than the takeover was read after such a check, and a second
        # one after the crash that check would have caused.
        later = int(time.time()) + 1
        assert wait_until(lambda: time.time() >= later, WAIT)
        for n in range(2):
            back.publish(topics.device_status("t", "c0", "c0-d0"), b"%d" % n)  # refused by the ACL, acknowledged
            assert wait_until(lambda: back.flush(0) or broker.poll() is not None, WAIT)
        assert broker.poll() is None, log.read_bytes()[-3000:].decode(errors="replace")


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_revoked_devices_live_connection_can_no_longer_read_or_write(reachable_tmp: Path) -> None:  # noqa: F811
    """Revocation cuts a session that is already up: the broker keeps the TCP connection (its certificate was
    checked at the handshake) but reloads its ACL without the device, so from then on it reads nothing (the
    manifest every device reads, its own task) and what it publishes reaches nobody, while its cell's other
    device goes on. Each check is ordered on the connections (a QoS 1 round trip), not timed."""
    from fedtier.membership import publish_roster, revoke
    from protocols.roster import roster_topic
    from protocols.wire import topics
    from tests.test_provision import WAIT, Inbox, clients, provision_cli

    p = provision_cli(reachable_tmp, "live-revoke")
    out, run = p["out"], "t"
    manifest, own_task = topics.round_manifest(run), topics.device_task(run, "c0", "c0-d0")
    with mosquitto(out / "broker" / "mosquitto.conf", p["port"]), clients() as make:
        cloud, cell, revoked, peer = (make(out / "nodes" / n, p["port"]) for n in ("cloud", "c0", "c0-d0", "c0-d1"))
        at_cell, at_revoked, at_peer = Inbox(), Inbox(), Inbox()
        cell.subscribe(topics.device_results(run, "c0"), at_cell)
        for topic in (manifest, own_task):
            revoked.subscribe(topic, at_revoked)
        peer.subscribe(manifest, at_peer)
        for t in (cloud, cell, revoked, peer):
            t.connect(WAIT)
        assert cell.wait_subscribed(WAIT) and revoked.wait_subscribed(WAIT) and peer.wait_subscribed(WAIT)

        def reaches_revoked(n: int) -> bool:
            """The cloud publishes manifest ``n``: once the peer has it and a QoS 1 publish of the revoked device
            came back acknowledged, whatever the broker routed to the revoked device has arrived."""
            cloud.publish(manifest, b"m%d" % n)
            at_peer.wait_for_item((manifest, b"m%d" % n))
            revoked.publish(topics.device_status(run, "c0", "c0-d0"), b"ping")
            assert revoked.flush(WAIT)
            return (manifest, b"m%d" % n) in at_revoked.snapshot()

        rosters = Inbox()  # the roster that revokes it, published before the reload: its agent learns it (and stops)
        revoked.subscribe(roster_topic(run), rosters)
        assert revoked.wait_subscribed(WAIT)
        assert reaches_revoked(0)  # before: it reads the manifest
        before = len(rosters.snapshot())
        # ACL rewritten, CRL, the roster published, then the broker reloaded (SIGHUP: asynchronous)
        change = revoke(out, "c0-d0", lambda: publish_roster(out))
        assert wait_until(lambda: len(rosters.snapshot()) > before, WAIT), "the revoked device never read its roster"
        newest = json.loads(rosters.snapshot()[-1][1])
        assert newest["version"] == change.version and "c0-d0" in newest["revoked"], newest
        n = iter(range(1, 10**6))
        assert wait_until(lambda: not reaches_revoked(next(n)), WAIT), "the live session still reads after revocation"
        assert revoked._client.is_connected()  # the connection itself stays
        cell.publish(own_task, b"task after revocation")
        revoked.publish(topics.device_result(run, "c0", "c0-d0"), b"result after revocation")
        assert revoked.flush(WAIT)
        peer.publish(topics.device_result(run, "c0", "c0-d1"), b"peer's result")  # routed after the revoked one's
        at_cell.wait_for_item((topics.device_result(run, "c0", "c0-d1"), b"peer's result"))
        assert not reaches_revoked(next(n))
        assert (own_task, b"task after revocation") not in at_revoked.snapshot()
        assert [p for _, p in at_cell.snapshot()] == [b"peer's result"]


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_revoked_device_that_keeps_publishing_its_status_is_cleared_again_each_time_and_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A device revoked while connected to a broker without per-node ACLs (here a plain Mosquitto; a provisioned one
    refuses it: test above) re-published its status after its cell cleared it, and it stayed retained until the
    broker restarted. The cell (idle, as `fedtier cell --serve` between jobs) now listens on each revoked device's
    status topic and clears whatever comes there again, saying so once, not once per status."""
    import threading

    from cell_server.service import CellService
    from protocols.config import TopologySection
    from protocols.roster import Roster, roster_topic, sign_roster
    from protocols.status import idle_status
    from protocols.transport.broker import MosquittoBroker
    from protocols.transport.mqtt import MqttTransport
    from protocols.transport.threadloop import ThreadLoop
    from protocols.wire.keys import Trust, generate_keys
    from sim.local_federation import federation_bundle

    bundle = federation_bundle(small_config(tmp_path, topology={"cells": 1, "devices_per_cell": 2}))
    run, ring = bundle.run.name, generate_keys(TopologySection(cells=1, devices_per_cell=2))
    trust = {n: Trust(n, ring.private[n], ring.public) for n in ("cloud", "c0", "c0-d1")}
    roster = Roster.from_topology(run, {"c0": ["c0-d0", "c0-d1"]}, ring.public, 100.0).without("c0-d1")
    gone = topics.device_status(run, "c0", "c0-d1")
    with MosquittoBroker() as broker:
        loop, watching = ThreadLoop("cell-c0"), ThreadLoop("watch").start()
        revoked = MqttTransport.from_url(broker.url, "c0-d1", watching).connect()  # still connected, its real key
        revoked.publish(roster_topic(run), sign_roster(roster, trust["cloud"].sign), retain=True, qos=1)
        seen: list[bytes] = []
        revoked.subscribe(gone, lambda _t, data: seen.append(bytes(data)))
        assert revoked.wait_subscribed(5.0)
        service = CellService(
            bundle,
            "c0",
            loop,
            lambda: MqttTransport.from_url(broker.url, "c0", loop).connect(),
            lambda *_: None,
            trust["c0"],
        )
        thread = threading.Thread(target=service.serve, name="cell-service", daemon=True)
        with caplog.at_level(logging.WARNING, logger="fedtier.cell.service"):
            thread.start()
            try:
                assert wait_until(lambda: service.revoked_devices.devices == {"c0-d1"}, 10.0)
                assert wait_until(lambda: seen == [b""], 10.0), seen  # cleared when the roster revoked it
                for n in range(1, 4):  # it publishes its status again, 3 times: each is cleared at once
                    status = idle_status(gone, trust["c0-d1"])
                    revoked.publish(gone, status, retain=True, qos=1)
                    assert wait_until(lambda: seen[2 * n - 1 :] == [status, b""], 10.0), seen  # noqa: B023
                assert service.revoked_devices.cleared_again == 3
                assert thread.is_alive() and service.revoked is None  # (its devices' revocations: it serves on)
                himself = sign_roster(roster.without("c0"), trust["cloud"].sign)  # walked: a revoked cell served on,
                revoked.publish(roster_topic(run), himself, retain=True, qos=1)  # in its job for ever
                thread.join(10)
                assert not thread.is_alive() and "cell c0 revoked from federation" in (service.revoked or "")
            finally:
                service.stop()
                thread.join(10)
                revoked.close()
                watching.stop()
    said = [r.getMessage() for r in caplog.records if "still publishes its status" in r.getMessage()]
    assert len(said) == 1 and "c0-d1" in said[0], said


def test_a_revoked_devices_last_offline_status_is_cleared_without_blaming_the_brokers_acls(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Walk (session 25): revoking c1's devices, cell c1 said 'revoked device c1-d0 still publishes its status (a
    broker without per-node ACLs passes it on)' of a provisioned Mosquitto: the device's agent, told by the roster
    (published before the broker reloads its ACLs), stopped and said itself offline, which came after the cell's
    clear. That first offline status is its last word, said at info; any other (online, idle, a second) the warning."""
    from cell_server.revoked_statuses import RevokedStatuses
    from protocols.config import TopologySection
    from protocols.roster import Roster
    from protocols.status import encode_status
    from protocols.transport.memory import MemoryHub
    from protocols.wire.keys import generate_keys

    ring, hub = generate_keys(TopologySection(cells=1, devices_per_cell=3)), MemoryHub()
    roster = Roster.from_topology("t", {"c0": ["c0-d0", "c0-d1", "c0-d2"]}, ring.public, 100.0)
    kept, device = RevokedStatuses("t", "c0"), hub.connect("devices")
    kept.take(roster.without("c0-d1").without("c0-d2"), hub.connect("cell.c0"))
    with caplog.at_level(logging.INFO, logger="fedtier.cell.service"):
        for d, state in (("c0-d1", "offline"), ("c0-d1", "offline"), ("c0-d2", "online"), ("c0-d2", "offline")):
            topic = topics.device_status("t", "c0", d)
            device.publish(topic, encode_status(state, topic=topic), retain=True)
        hub.loop.run()
    assert kept.cleared_again == 4  # each cleared, as before
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines == [
        (
            logging.INFO,
            "cell c0: revoked device c0-d1 said itself offline as it stopped (its last status, sent as it "
            "learnt it was revoked): cleared",
        ),
        (
            logging.WARNING,
            "cell c0: revoked device c0-d1 still publishes its status (a broker without per-node ACLs "
            "passes it on): cleared again, each time (logged once)",
        ),
        (
            logging.WARNING,
            "cell c0: revoked device c0-d2 still publishes its status (a broker without per-node ACLs "
            "passes it on): cleared again, each time (logged once)",
        ),
    ], lines


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_serving_agent_whose_device_the_roster_revokes_stops_and_says_why(tmp_path: Path) -> None:
    """Walking deploy-fleet.md: a device revoked while its `fedtier agent --serve` ran was never told; its process
    waited for jobs it could no longer take part in, for ever (its broker login gone, the cells refusing it), and
    restarted, it retried the broker for ever. The agent service reads the signed roster it already follows: once it
    revokes the device, serving ends with the reason (`fedtier agent --serve` exits 2 with it: NodeRevoked, a
    ConfigError, so a service unit does not restart it). A roster that revokes another device changes nothing."""
    import threading

    from edge_agent.service import AgentService
    from protocols.config import ConfigError, TopologySection
    from protocols.roster import NodeRevoked, Roster, roster_topic, sign_roster
    from protocols.transport.broker import MosquittoBroker
    from protocols.transport.mqtt import MqttTransport
    from protocols.transport.threadloop import ThreadLoop
    from protocols.wire.keys import Trust, generate_keys
    from sim.local_federation import federation_bundle

    bundle = federation_bundle(small_config(tmp_path, topology={"cells": 1, "devices_per_cell": 3}))
    run, ring = bundle.run.name, generate_keys(TopologySection(cells=1, devices_per_cell=3))
    trust = {n: Trust(n, ring.private[n], ring.public) for n in ("cloud", "c0-d1")}
    roster = Roster.from_topology(run, {"c0": ["c0-d0", "c0-d1", "c0-d2"]}, ring.public, 100.0)
    with MosquittoBroker() as broker:
        loop, op_loop = ThreadLoop("agent-c0-d1"), ThreadLoop("operator").start()
        operator = MqttTransport.from_url(broker.url, "operator", op_loop).connect()
        operator.publish(roster_topic(run), sign_roster(roster.without("c0-d2"), trust["cloud"].sign), retain=True)
        service = AgentService(
            bundle,
            ["c0-d1"],
            loop,
            lambda: MqttTransport.from_url(broker.url, "c0-d1", loop).connect(),
            lambda *_: pytest.fail("no job was submitted"),
            trust["c0-d1"],
        )
        idle: list[bytes] = []  # its idle status: said once it follows the roster (subscribed first, retained)
        operator.subscribe(topics.device_status(run, "c0", "c0-d1"), lambda _t, data: idle.append(data))
        thread = threading.Thread(target=service.serve, name="agent-service", daemon=True)
        thread.start()
        try:
            assert wait_until(lambda: any(idle), 10.0)
            thread.join(1.0)
            assert thread.is_alive() and service.revoked is None  # another device's revocation: it serves on
            newer = roster.without("c0-d2").without("c0-d1")
            operator.publish(roster_topic(run), sign_roster(newer, trust["cloud"].sign), retain=True)
            thread.join(10.0)
            assert not thread.is_alive(), "the revoked device's agent still serves"
        finally:
            service.stop()
            thread.join(10)
            operator.close()
            op_loop.stop()
    assert service.revoked is not None and "device c0-d1 revoked from federation" in service.revoked
    assert f"roster version {newer.version}" in service.revoked and service.served == []
    assert issubclass(NodeRevoked, ConfigError)  # fedtier agent --serve: exit 2, as a wrong config


def test_a_serving_agents_poll_mid_job_ends_once_its_running_devices_verified_a_roster_that_revokes_them(
    tmp_path: Path,
) -> None:
    """Mid-job, the agent service polls its running devices (their connections verify each roster: runner's
    _on_roster); a roster that revokes them ends the poll at once with the reason, whatever the job does, so serve()
    stops without counting the job served. One that revokes another device does not."""
    from types import SimpleNamespace

    from edge_agent.service import AgentService
    from protocols.config import TopologySection
    from protocols.roster import Roster
    from protocols.transport.threadloop import ThreadLoop
    from protocols.wire.keys import generate_keys
    from sim.local_federation import federation_bundle

    bundle = federation_bundle(small_config(tmp_path, topology={"cells": 1, "devices_per_cell": 2}))
    ring = generate_keys(TopologySection(cells=1, devices_per_cell=2))
    roster = Roster.from_topology(bundle.run.name, {"c0": ["c0-d0", "c0-d1"]}, ring.public, 100.0)
    service = AgentService(bundle, ["c0-d1"], ThreadLoop("agent"), lambda: None, lambda *_: None, None)
    job = SimpleNamespace(roster=roster.without("c0-d0"))
    service.agents = SimpleNamespace(job=job)  # type: ignore[assignment]  # its running devices' view of the roster
    polls: list[int] = []

    def job_runs() -> bool | None:  # the job never ends by itself here
        polls.append(1)
        if len(polls) == 2:
            job.roster = job.roster.without("c0-d1")  # verified by the device's connection meanwhile
        return None if len(polls) < 50 else True

    assert service._poll(job_runs) is None and len(polls) == 2  # noqa: SLF001
    assert service.revoked is not None and "device c0-d1 revoked from federation" in service.revoked
    # Walk (session 25): the revoked agent then said "served 0 jobs, 0 tasks" of a device that had answered 57 tasks of
    # the job it was revoked during; they count, and its line names that job (fedtier.serve.serve_agent)
    answered = SimpleNamespace(tasks_answered={"job-n.0": 57}.get)  # (its agents' tasks in job-n's session)
    service._left_during(SimpleNamespace(job="job-n", session="job-n.0"), answered)  # type: ignore[arg-type]  # noqa: SLF001
    assert (service.tasks, service.revoked_during, service.served) == (57, "job-n", [])


class Attempts(threading.Event):
    """A stop event whose waits return at once, recorded; set after ``n`` of them (a node's retries, not slept)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.waits = n, list[float]()

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(float(timeout or 0.0))
        if len(self.waits) >= self.n:
            self.set()
        return self.is_set()


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_revoked_node_never_told_retries_its_refusing_broker_rarely_and_says_so_once_then_rarely(
    reachable_tmp: Path,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A device revoked while its agent was down (or `provision revoke --no-publish`) is never told: it cannot read the
    roster that revokes it. Restarted, its `fedtier agent --serve` (connect_forever) retried the broker that refuses
    its certificate every 30 s for ever, each attempt a ~500-character warning (2,880 a day, and three lines in the
    broker's log each). It still retries (a refusal cannot be told from a broker's mended revocation list or password
    file), but backs off to 5 min while refused, says the refusal once with how to check whether it was revoked, then
    at the 10th, 100th, ... attempt only. 12 attempts here (the waits recorded, not slept; REFUSED_PATIENCE, 10 min
    of refusals before backing off beyond 30 s, shortened to 30 s)."""
    from fedtier.membership import revoke
    from fedtier.serve import BACKOFF_MAX, connect_forever
    from protocols.transport import connecting
    from protocols.transport.connecting import REFUSED_BACKOFF

    monkeypatch.setattr(connecting, "REFUSED_PATIENCE", 30.0)

    p = provision_cli(reachable_tmp, "unaware")
    out, port = p["out"], p["port"]
    bundle = out / "nodes" / "c0-d1"

    def refused() -> bool:
        """Whether a new connection with the device's certificate (under its agent's client id) is refused."""
        try:
            make(bundle, port, client_id=node).connect(WAIT).close()
        except ConnectionError:
            return True
        return False

    node = "fedtier-t-device.c0-d1"
    with mosquitto(out / "broker" / "mosquitto.conf", port), clients() as make:
        assert not refused()
        revoke(out, "c0-d1")  # the roster not published: its agent, down, is not told
        assert wait_until(refused, WAIT), "the broker still takes the revoked certificate"  # (its reload: SIGHUP)
        stopping = Attempts(12)
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            assert connect_forever(lambda: make(bundle, port, client_id=node), stopping, "device.c0-d1") is None
    assert stopping.waits[:4] == [1.0, 2.0, 4.0, 8.0] and stopping.waits[-1] == BACKOFF_MAX * REFUSED_BACKOFF == 300
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 2, said  # the first refusal and the 10th attempt: not one line each
    assert "device.c0-d1: cannot connect to the broker" in said[0] and "Is this certificate revoked" in said[0]
    assert "roster.json then lists it as revoked" in said[0]  # how an operator checks
    assert "still cannot connect to the broker, 10 attempts since" in said[1], said
    assert sum("still cannot connect" in r.getMessage() for r in caplog.records) == 11  # the others: debug


def test_a_node_that_cannot_reach_its_broker_retries_every_30_s_at_most_and_says_when_it_connects(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An unreachable broker (down, restarting) is not a refusal: the node backs off to BACKOFF_MAX only (it comes back
    soon after the broker does), says it once, and says when it connected."""
    from fedtier.serve import BACKOFF_MAX, connect_forever

    class Broker:
        def __init__(self, down_for: int) -> None:
            self.down_for = down_for

        def connect(self) -> Broker:
            self.down_for -= 1
            if self.down_for >= 0:
                raise ConnectionError("cannot connect to MQTT broker at h:1: connection refused")
            return self

    broker, stopping = Broker(12), Attempts(100)
    with caplog.at_level(logging.WARNING, logger="fedtier.serve"):
        assert connect_forever(lambda: broker, stopping, "cell c0") is broker
    assert stopping.waits == [1.0, 2.0, 4.0, 8.0, 16.0] + [BACKOFF_MAX] * 7
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3 and "retrying in 1 s" in said[0] and "10 attempts since" in said[1], said
    assert said[2].startswith("cell c0: connected to the broker after 12 failed attempts since"), said


def test_a_node_its_broker_refuses_for_a_few_minutes_still_retries_every_30_s_at_most() -> None:
    """A refusal is not always for ever: a broker full after its restart (its max_connections), a proxy in front of
    one restarting, a renewed certificate its node has not reloaded yet all hang up before the CONNACK for a few
    minutes, as a revoked node's broker does for good. Backing off to 5 min at once (ca8392c: 1, 2, 4 ... 256, 300 s)
    left such a node down up to 5 min after its broker took it again; it backs off beyond BACKOFF_MAX only once its
    refusals lasted REFUSED_PATIENCE (the waits between them), and comes back within 30 s of a 4-minute refusal."""
    from fedtier.serve import BACKOFF_MAX, connect_forever
    from protocols.transport.connecting import REFUSED_PATIENCE
    from protocols.transport.paho_client import Credentials, hung_up_before_connack

    class Full:
        """A broker that hangs up on the node's connects (Refused) for ``seconds`` of its waits, then takes it."""

        def __init__(self, seconds: float) -> None:
            self.seconds, self.stopping = seconds, Attempts(1000)

        def connect(self) -> Full:
            if sum(self.stopping.waits) < self.seconds:
                raise hung_up_before_connack("h:1", "device.c0-d1", Credentials(ca_certs="ca", certfile="c"))
            return self

    assert REFUSED_PATIENCE >= 600  # (a revoked node is still asked every 5 min after 10 min of refusals)
    brief = Full(240.0)
    assert connect_forever(lambda: brief, brief.stopping, "device.c0-d1") is brief
    waits = brief.stopping.waits
    assert max(waits) == BACKOFF_MAX and sum(waits) < 240.0 + BACKOFF_MAX, waits
    long = Full(3600.0)
    assert connect_forever(lambda: long, long.stopping, "device.c0-d1") is long
    assert max(long.stopping.waits) == 300.0  # refused for an hour: asked every 5 min, once refused for 10
    refused_for = 0.0
    for w in long.stopping.waits:
        assert w <= BACKOFF_MAX or refused_for >= REFUSED_PATIENCE, long.stopping.waits
        refused_for += w
