"""``fedtier provision`` against real Mosquitto brokers started with the provisioned ``mosquitto.conf``
files: TLS client certificates (the only login) and the per-node ACLs are enforced by the brokers, and with ``--brokers
per-cell`` each cell broker bridges exactly its cell's topics to the cloud broker."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import stat
import subprocess
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from fedtier.cli import main
from fedtier.pki import CertificateAuthority, certificate, load_pki, new_key
from protocols.procs import popen
from protocols.transport.broker import find_mosquitto, wait_for_port
from protocols.transport.mqtt import MqttTransport
from protocols.transport.threadloop import ThreadLoop
from protocols.wire import topics
from protocols.wire.keys import load_keys
from tests.conftest import FullDisk, free_port_run, small_config

WAIT = 10.0
needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")


def broker_user() -> list[str]:
    """As root, Mosquitto drops to its service user (``mosquitto``) before reading its password file and
    keys: provision gives it the broker's files, as a deployment does (``--broker-user``)."""
    if os.geteuid() != 0:
        return []
    try:
        return ["--broker-user", pwd.getpwnam("mosquitto").pw_name]
    except KeyError:
        return ["--broker-user", "root"]


@pytest.fixture(scope="module")
def reachable_tmp() -> Iterator[Path]:
    """A folder the broker's service user can traverse (pytest's own tmp folders are mode 700)."""
    with tempfile.TemporaryDirectory(prefix="fedtier-prov-") as d:
        os.chmod(d, 0o711)
        yield Path(d)


def provision_cli(tmp: Path, name: str, *extra: str) -> dict[str, Any]:
    cfg_path = tmp / f"{name}.toml"
    cfg_path.write_text(small_config(tmp).to_toml())
    port = free_port_run(1)  # below the ephemeral range: no client connection of another test takes it
    res = CliRunner().invoke(
        main,
        [
            "provision",
            str(cfg_path),
            "--out",
            str(tmp / name),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            *broker_user(),
            *extra,
        ],
    )
    assert res.exit_code == 0, res.output
    return {"out": tmp / name, "port": port, "cfg": cfg_path}


@contextlib.contextmanager
def mosquitto(conf: Path, port: int) -> Iterator[subprocess.Popen]:
    """``mosquitto -c conf`` exactly as provisioned, until it listens on 127.0.0.1:port. Its log goes to
    ``mosquitto.log`` beside ``conf`` (a pipe nobody reads would stall the broker once full); a broker that died
    during the test prints the log's end, which pytest shows with the failure."""
    log_path = conf.parent / "mosquitto.log"
    with open(log_path, "ab") as log_file:
        proc = popen([find_mosquitto(), "-c", str(conf)], stdout=log_file, stderr=subprocess.STDOUT)
    tail = lambda: log_path.read_bytes()[-4000:].decode(errors="replace")  # noqa: E731
    try:
        try:
            wait_for_port("127.0.0.1", port, WAIT, alive=lambda: proc.poll() is None, pid=proc.pid)
        except (RuntimeError, TimeoutError):
            proc.kill()
            proc.wait(WAIT)
            raise AssertionError(tail()) from None
        yield proc
    finally:
        if proc.poll() is not None:
            print(f"mosquitto ({conf}) exited with {proc.returncode} during the test; its log ends:\n{tail()}")
        proc.terminate()
        try:
            proc.wait(WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(WAIT)


@pytest.fixture(scope="module")
def provisioned(reachable_tmp: Path) -> dict[str, Any]:
    return provision_cli(reachable_tmp, "out")


def test_provision_writes_bundles_with_only_what_a_node_needs(provisioned: dict[str, Any]) -> None:
    out = provisioned["out"]
    nodes = sorted(p.name for p in (out / "nodes").iterdir())
    assert nodes == sorted(
        ["cloud", "operator", "monitor", "c0", "c1", "c0-d0", "c0-d1", "c0-d2", "c1-d0", "c1-d1", "c1-d2"]
    )
    d = out / "nodes" / "c0-d1"
    ring = load_keys(d / "keys.toml")
    assert set(ring.private) == {"c0-d1"} and set(ring.public) == {"c0-d1", "c0", "cloud", "c0-d0", "c0-d2"}
    for secret in (
        d / "keys.toml",
        d / "client.key",
        d / "config.toml",
        out / "ca" / "ca.key",
        out / "broker" / "server.key",
    ):
        assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600, secret
    cfg = tomllib.loads((d / "config.toml").read_text())
    assert cfg["broker"]["url"] == f"mqtts://127.0.0.1:{provisioned['port']}"
    assert cfg["broker"]["username"] == "c0-d1" and cfg["security"]["keys"] == "keys.toml"
    acl = (out / "broker" / "acl").read_text()
    device = acl.split("user c0-d1\n")[1].split("\n\n")[0].splitlines()
    assert device == [
        "topic read fedtier/t/cell/c0/down/c0-d1/task",
        "topic write fedtier/t/cell/c0/up/c0-d1/result",
        "topic read fedtier/t/cloud/control",
        "topic read fedtier/t/cloud/round",
        "topic read fedtier/t/status/cloud",
        "topic readwrite fedtier/t/cell/c0/status/device.c0-d1",
        "topic read fedtier/t/cloud/job",
        "topic read fedtier/t/roster",
    ]
    # only the operator may submit jobs; the cloud alone verifies the operator's signature
    operator = acl.split("user operator\n")[1].split("\n\n")[0].splitlines()
    assert operator[0] == "topic write fedtier/t/jobs/submit" and "topic readwrite fedtier/t/roster" in operator
    assert all(" read " in g for g in operator[1:] if not g.endswith("/roster"))  # a roster needs the cloud's key
    assert set(load_keys(out / "nodes" / "operator" / "keys.toml").private) == {"operator"}
    assert "operator" in load_keys(out / "nodes" / "cloud" / "keys.toml").public
    res = CliRunner().invoke(main, ["provision", str(provisioned["cfg"]), "--out", str(out)])
    assert res.exit_code == 2 and "already provisioned" in res.output  # never silently re-keys a fleet


@pytest.fixture(scope="module")
def broker(provisioned: dict[str, Any]) -> Iterator[subprocess.Popen]:
    with mosquitto(provisioned["out"] / "broker" / "mosquitto.conf", provisioned["port"]) as proc:
        yield proc


class Inbox:
    def __init__(self) -> None:
        self.items: list[tuple[str, bytes]] = []
        self.cv = threading.Condition()

    def __call__(self, topic: str, data: bytes) -> None:
        with self.cv:
            self.items.append((topic, data))
            self.cv.notify_all()

    def wait_for(self, topic: str) -> list[tuple[str, bytes]]:
        with self.cv:
            assert self.cv.wait_for(lambda: any(t == topic for t, _ in self.items), WAIT), self.items
            return list(self.items)

    def wait_for_item(self, item: tuple[str, bytes]) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: item in self.items, WAIT), self.items

    def snapshot(self) -> list[tuple[str, bytes]]:
        with self.cv:
            return list(self.items)


def client_factory(loop: ThreadLoop, made: list[MqttTransport]) -> Any:
    def make(
        bundle: Path,
        port: int,
        password: str | None = None,
        username: str | None = None,
        client_id: str | None = None,
        persistent: bool = False,
    ) -> MqttTransport:
        cfg = tomllib.loads((bundle / "config.toml").read_text())["broker"]
        t = MqttTransport(
            client_id or f"acl-{bundle.name}-{len(made)}",
            loop,
            "127.0.0.1",
            port,
            username=username or cfg["username"],
            password=password or cfg.get("password"),
            ca_certs=str(bundle / "ca.crt"),
            certfile=str(bundle / "client.crt"),
            keyfile=str(bundle / "client.key"),
            persistent=persistent,
        )
        made.append(t)
        return t

    return make


@contextlib.contextmanager
def clients() -> Iterator[Any]:
    loop = ThreadLoop("acl").start()
    made: list[MqttTransport] = []
    try:
        yield client_factory(loop, made)
    finally:
        for t in made:
            t.close(flush_timeout=1)
        loop.stop()


@pytest.fixture
def connect(provisioned: dict[str, Any], broker: subprocess.Popen) -> Iterator[Any]:
    with clients() as make:
        yield lambda node, password=None: make(provisioned["out"] / "nodes" / node, provisioned["port"], password)


@needs_mosquitto
def test_a_login_is_the_certificate_and_no_broker_password_is_written(
    provisioned: dict[str, Any], broker, connect
) -> None:
    """Under ``use_identity_as_username`` Mosquitto checks no password, so provisioning writes and hands out
    none: no password file, no ``password_file`` or ``remote_password`` line, no password in any bundle.
    A node's certificate logs in with any password or none, always as the node its certificate names."""
    out = provisioned["out"]
    assert list(out.rglob("passwd")) == []
    for conf in out.rglob("mosquitto.conf"):
        assert "password" not in conf.read_text(), conf
    for bundle in (out / "nodes").iterdir():
        assert "password" not in tomllib.loads((bundle / "config.toml").read_text())["broker"], bundle
    for password in ("wrong", None):
        device = connect("c0-d0", password)
        device.connect(WAIT)
        inbox = Inbox()  # still c0-d0: its own task topic only
        device.subscribe(topics.device_task("t", "c0", "c0-d0"), inbox)
        assert device.wait_subscribed(WAIT)
        connect("c0", None).connect(WAIT).publish(topics.device_task("t", "c0", "c0-d0"), b"task")
        inbox.wait_for(topics.device_task("t", "c0", "c0-d0"))


@needs_mosquitto
def test_broker_refuses_a_device_writing_another_devices_result(connect) -> None:
    run = "t"
    cell, intruder = connect("c0"), connect("c0-d0")
    inbox = Inbox()
    cell.subscribe(topics.device_results(run, "c0"), inbox)
    cell.connect(WAIT), intruder.connect(WAIT)
    assert cell.wait_subscribed(WAIT)
    intruder.publish(topics.device_result(run, "c0", "c0-d1"), b"forged result")  # denied by the ACL
    intruder.publish(topics.device_result(run, "c0", "c0-d0"), b"own result")  # allowed, and sent after
    assert intruder.flush(WAIT)
    got = inbox.wait_for(topics.device_result(run, "c0", "c0-d0"))  # one publisher: in order
    assert got == [(topics.device_result(run, "c0", "c0-d0"), b"own result")]


@needs_mosquitto
def test_broker_refuses_a_device_reading_another_devices_task(connect) -> None:
    run = "t"
    cell, spy = connect("c0"), connect("c0-d0")
    inbox = Inbox()
    spy.subscribe(topics.device_task(run, "c0", "c0-d1"), inbox)  # another device's task: denied
    spy.subscribe(topics.device_task(run, "c0", "c0-d0"), inbox)
    spy.subscribe(topics.cell_task(run, "c0"), inbox)  # the cell's task: denied
    cell.connect(WAIT), spy.connect(WAIT)
    spy.wait_subscribed(WAIT)
    cell.publish(topics.device_task(run, "c0", "c0-d1"), b"task of d1")
    cell.publish(topics.device_task(run, "c0", "c0-d0"), b"task of d0")
    got = inbox.wait_for(topics.device_task(run, "c0", "c0-d0"))
    assert got == [(topics.device_task(run, "c0", "c0-d0"), b"task of d0")]


@needs_mosquitto
def test_a_device_subscribing_to_every_topic_reads_only_its_own(connect) -> None:
    """A device's valid login subscribing to ``#``: the broker delivers only what its ACL lets it read, not
    another device's task or result, a cell's report or telemetry, or another device's status."""
    run = "t"
    cell, other, spy = connect("c0"), connect("c0-d1"), connect("c0-d0")
    seen, inbox = Inbox(), Inbox()
    cell.subscribe(topics.device_results(run, "c0"), seen)
    cell.subscribe(topics.device_statuses(run, "c0"), seen)
    spy.subscribe("#", inbox)
    for t in (cell, other, spy):
        t.connect(WAIT)
    assert cell.wait_subscribed(WAIT) and spy.wait_subscribed(WAIT)
    other.publish(topics.device_result(run, "c0", "c0-d1"), b"result of d1")
    other.publish(topics.device_status(run, "c0", "c0-d1"), b"status of d1")
    seen.wait_for(topics.device_status(run, "c0", "c0-d1"))  # the broker has routed both (one publisher: in order)
    cell.publish(topics.device_task(run, "c0", "c0-d1"), b"task of d1")
    cell.publish(topics.cell_report(run, "c0"), b"report of c0")
    cell.publish(topics.telemetry_cell(run, "c0"), b"record of c0")
    cell.publish(topics.device_task(run, "c0", "c0-d0"), b"task of d0")  # the spy's own: the last
    got = inbox.wait_for(topics.device_task(run, "c0", "c0-d0"))
    assert got == [(topics.device_task(run, "c0", "c0-d0"), b"task of d0")]


@needs_mosquitto
def test_a_cell_subscribing_to_every_topic_reads_nothing_of_another_cell(connect) -> None:
    """A cell's valid login subscribing to ``#``: another cell's task, its devices' results and statuses and its
    report never reach it (the cloud's broker carries every cell in a one-broker federation)."""
    run = "t"
    spy, other, device, cloud = connect("c0"), connect("c1"), connect("c1-d0"), connect("cloud")
    inbox, seen = Inbox(), Inbox()
    spy.subscribe("#", inbox)
    cloud.subscribe(topics.cell_reports(run), seen)
    for t in (spy, other, device, cloud):
        t.connect(WAIT)
    assert spy.wait_subscribed(WAIT) and cloud.wait_subscribed(WAIT)
    device.publish(topics.device_result(run, "c1", "c1-d0"), b"result of c1-d0")
    device.publish(topics.device_status(run, "c1", "c1-d0"), b"status of c1-d0")
    assert device.flush(WAIT)
    other.publish(topics.cell_report(run, "c1"), b"report of c1")
    seen.wait_for(topics.cell_report(run, "c1"))
    cloud.publish(topics.cell_task(run, "c1"), b"task of c1")
    cloud.publish(topics.cell_task(run, "c0"), b"task of c0")  # the spy's own: the last
    got = inbox.wait_for(topics.cell_task(run, "c0"))
    assert got == [(topics.cell_task(run, "c0"), b"task of c0")], got


@needs_mosquitto
def test_a_device_cannot_leave_retained_records_on_topics_it_may_not_write(connect) -> None:
    """Retained messages outlive their publisher: a device's valid login tries to leave them on the cloud's
    manifest, control and roster topics, its cell's status, another device's status and under its own status
    topic; a reader of all of those (the monitor) finds only the device's own status."""
    run = "t"
    device = connect("c0-d0").connect(WAIT)
    planted = b"planted by c0-d0"
    for topic in (
        topics.round_manifest(run),
        topics.control(run),
        "fedtier/t/roster",
        topics.status(run, topics.cell_node("c0")),
        topics.device_status(run, "c0", "c0-d1"),
        topics.device_status(run, "c0", "c0-d0") + "/more",
    ):
        device.publish(topic, planted, retain=True)
    own = topics.device_status(run, "c0", "c0-d0")
    device.publish(own, b"own status", retain=True)
    assert device.flush(WAIT)
    monitor, inbox = connect("monitor"), Inbox()
    for pattern in (
        topics.round_manifest(run),
        topics.control(run),
        "fedtier/t/roster",
        topics.statuses(run),
        topics.device_statuses(run),
    ):
        monitor.subscribe(pattern, inbox)
    monitor.connect(WAIT)
    assert monitor.wait_subscribed(WAIT)
    device.publish(own, b"live status")  # after the retained ones were queued to the monitor
    inbox.wait_for_item((own, b"live status"))
    items = inbox.snapshot()
    assert [p for _, p in items if p == planted] == [] and (own, b"own status") in items, items


@needs_mosquitto
def test_no_cell_or_device_can_leave_the_clouds_job_list_end_state_or_status(connect) -> None:
    """What ``fedtier jobs`` and the live monitor read as the cloud's word (the retained job list, the job in
    progress, the cloud's state with a job's end figures, its status) is the cloud's topics alone: a cell's and a
    device's valid logins leave retained records on each; a reader of all of them (the monitor) finds none."""
    run = "t"
    forged = [topics.job_list(run), topics.current_job(run), topics.state(run, "cloud"), topics.status(run, "cloud")]
    liars = [connect("c0").connect(WAIT), connect("c0-d0").connect(WAIT)]
    for liar in liars:
        for topic in forged:
            liar.publish(topic, b"planted", retain=True)
        assert liar.flush(WAIT)
    own = topics.state(run, topics.cell_node("c0"))
    liars[0].publish(own, b"own state", retain=True)
    assert liars[0].flush(WAIT)
    monitor, inbox = connect("monitor"), Inbox()
    for pattern in (topics.job_list(run), topics.current_job(run), topics.states(run), topics.statuses(run)):
        monitor.subscribe(pattern, inbox)
    monitor.connect(WAIT)
    assert monitor.wait_subscribed(WAIT)
    liars[0].publish(own, b"live state")  # after the retained ones were queued to the monitor
    inbox.wait_for_item((own, b"live state"))
    items = inbox.snapshot()
    assert [t for t, p in items if p == b"planted"] == [] and (own, b"own state") in items, items


@needs_mosquitto
def test_broker_refuses_a_certificate_of_another_ca(provisioned: dict[str, Any], broker, tmp_path: Path) -> None:
    """The login is the client certificate (its common name is the user): one that claims to be the cloud
    but comes from another CA is refused, whatever user name and password it sends."""
    key = new_key()
    CertificateAuthority("another CA", key, certificate("another CA", key, "another CA", key, ca=True)).issue(
        tmp_path, "client", "cloud"
    )
    (tmp_path / "config.toml").write_text((provisioned["out"] / "nodes" / "cloud" / "config.toml").read_text())
    (tmp_path / "ca.crt").write_bytes((provisioned["out"] / "ca" / "ca.crt").read_bytes())  # trusts the broker
    with clients() as make, pytest.raises(ConnectionError):
        make(tmp_path, provisioned["port"]).connect(WAIT)


@needs_mosquitto
def test_no_node_can_take_the_clouds_session(
    provisioned: dict[str, Any], broker, caplog: pytest.LogCaptureFixture
) -> None:
    """A device's and the monitor's valid credentials, connecting with the cloud's client id (and its user
    name and password), neither kick the cloud off nor inherit or wipe its persistent session: the broker
    names every session after its certificate (``use_identity_as_username``, ``use_username_as_clientid``).
    A report queued for the cloud while it is away reaches it when it comes back, after both intruders."""
    import logging

    nodes, port, run = provisioned["out"] / "nodes", provisioned["port"], "t"
    cloud_id = "fedtier-t-cloud"
    password = "any password"  # the broker checks none (use_identity_as_username)
    report = topics.cell_report(run, "c0")
    with caplog.at_level(logging.INFO), clients() as make:
        inbox = Inbox()
        cloud = make(nodes / "cloud", port, client_id=cloud_id, persistent=True)
        cloud.subscribe(topics.cell_reports(run), inbox)
        cloud.connect(WAIT)
        assert cloud.wait_subscribed(WAIT)
        cell = make(nodes / "c0", port).connect(WAIT)
        for n, node in enumerate(("c0-d0", "monitor"), 1):  # while the cloud is connected: it is not kicked off
            intruder = make(nodes / node, port, password, "cloud", client_id=cloud_id)
            intruder.connect(WAIT)
            cell.publish(report, f"report while {node} is connected".encode())
            with inbox.cv:
                assert inbox.cv.wait_for(lambda n=n: len(inbox.items) == n, WAIT), inbox.items
            intruder.close()
        cloud.close()  # away, its session kept: a report is queued for it
        cell.publish(report, b"queued for the cloud")
        assert cell.flush(WAIT)
        for node in ("c0-d0", "monitor"):  # a clean session under the cloud's client id would wipe it
            make(nodes / node, port, password, "cloud", client_id=cloud_id).connect(WAIT).close()
        back = Inbox()
        cloud = make(nodes / "cloud", port, client_id=cloud_id, persistent=True)
        cloud.subscribe(topics.cell_reports(run), back)
        cloud.connect(WAIT)
        assert back.wait_for(report) == [(report, b"queued for the cloud")]
    assert "fedtier-t-cloud: lost connection" not in caplog.text


@needs_mosquitto
def test_provisioned_broker_keeps_queued_messages_across_a_restart(reachable_tmp: Path) -> None:
    """The provisioned broker has persistence on (as ``fedtier run``'s): a result published while the
    cell is away is queued in the cell's persistent session, survives a restart of the broker, and
    reaches the cell when it comes back under its client id."""
    p = provision_cli(reachable_tmp, "persist")
    conf, nodes, run = p["out"] / "broker" / "mosquitto.conf", p["out"] / "nodes", "t"
    text = conf.read_text()
    assert "persistence true" in text
    for line in (  # logins bound to sessions, revocation, a bounded queue per client (issue 31)
        "use_identity_as_username true",
        "use_username_as_clientid true",
        f"crlfile {(p['out'] / 'broker').resolve()}/ca.crl",
        f"max_queued_bytes {512 * 1024 * 1024}",
        "max_queued_messages 100000",
        "autosave_interval 60",  # not every second: a full rewrite of the database each time (flash wear)
    ):
        assert line in text.splitlines(), line
    topic = topics.device_result(run, "c0", "c0-d0")
    with mosquitto(conf, p["port"]), clients() as make:
        cell = make(nodes / "c0", p["port"], client_id="cell-c0", persistent=True)
        cell.subscribe(topics.device_results(run, "c0"), Inbox())
        cell.connect(WAIT)
        assert cell.wait_subscribed(WAIT)
        cell.close()
        device = make(nodes / "c0-d0", p["port"]).connect(WAIT)
        device.publish(topic, b"result while the cell is away")
        assert device.flush(WAIT)
    assert (p["out"] / "broker" / "data" / "mosquitto.db").exists()  # saved at the clean stop
    with mosquitto(conf, p["port"]), clients() as make:
        inbox = Inbox()
        back = make(nodes / "c0", p["port"], client_id="cell-c0", persistent=True).connect(WAIT)
        back.subscribe(topics.device_results(run, "c0"), inbox)
        assert inbox.wait_for(topic) == [(topic, b"result while the cell is away")]


# ------------------------------------------------------------------------------- per-cell brokers
RUN = "t"


@pytest.fixture(scope="module")
def per_cell(reachable_tmp: Path) -> Iterator[dict[str, Any]]:
    """The cloud broker and the brokers of cells c0 and c1 (on one host: each its own port), each started
    with its provisioned mosquitto.conf. The
    test adds one user to the cloud broker, ``observer``, who may read every fedtier topic: it sees
    whatever reaches the cloud broker, whichever ACL would hide it from the cloud."""
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    cell_port = free_port_run(2)  # c0 and c1 listen on consecutive ports
    p = provision_cli(
        reachable_tmp, "cells", "--brokers", "per-cell", "--cell-host", "127.0.0.1", "--cell-port", str(cell_port)
    )
    p["cell_port"] = cell_port
    cloud_broker = p["out"] / "broker"
    observer = p["out"] / "nodes" / "observer"  # its login is its certificate, issued by the deployment's CA
    load_pki(p["out"]).issue(observer, "client", "observer")
    (observer / "config.toml").write_text((p["out"] / "nodes" / "monitor" / "config.toml").read_text())
    with open(cloud_broker / "acl", "a") as f:
        f.write("\nuser observer\ntopic read fedtier/#\n")
    with (
        mosquitto(cloud_broker / "mosquitto.conf", p["port"]),
        mosquitto(p["out"] / "cells" / "c0" / "mosquitto.conf", cell_port),
        mosquitto(p["out"] / "cells" / "c1" / "mosquitto.conf", cell_port + 1),
    ):
        yield p


def test_per_cell_provisioning_splits_users_between_brokers(per_cell: dict[str, Any]) -> None:
    out = per_cell["out"]
    users = lambda f: sorted(u[5:] for u in f.read_text().splitlines() if u.startswith("user "))  # noqa: E731
    assert users(out / "broker" / "acl") == ["bridge.c0", "bridge.c1", "cloud", "monitor", "observer", "operator"]
    assert users(out / "cells" / "c0" / "acl") == ["c0", "c0-d0", "c0-d1", "c0-d2"]
    acl = (out / "broker" / "acl").read_text()
    assert acl.split("user bridge.c0\n")[1].split("\n\n")[0].splitlines() == [
        "topic read fedtier/t/cell/c0/down/task",
        "topic read fedtier/t/cloud/round",
        "topic read fedtier/t/cloud/control",
        "topic read fedtier/t/status/cloud",
        "topic read fedtier/t/cloud/job",
        "topic read fedtier/t/roster",
        "topic write fedtier/t/cloud/up/c0/report",
        "topic write fedtier/t/status/cell.c0",
        "topic write fedtier/t/telemetry/cell/c0",
        "topic write fedtier/t/state/cell.c0",
    ]
    for node, port in (("cloud", per_cell["port"]), ("c0", per_cell["cell_port"]), ("c0-d2", per_cell["cell_port"])):
        cfg = tomllib.loads((out / "nodes" / node / "config.toml").read_text())
        assert cfg["broker"]["url"] == f"mqtts://127.0.0.1:{port}"
    for secret in (out / "cells" / "c0" / "mosquitto.conf", out / "cells" / "c0" / "bridge.key"):
        assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600, secret  # the bridge's key


def test_cell_broker_bridges_only_the_cells_topics_to_the_cloud(per_cell: dict[str, Any]) -> None:
    nodes, cloud_port, cell_port = per_cell["out"] / "nodes", per_cell["port"], per_cell["cell_port"]
    with clients() as make:
        cloud, observer = make(nodes / "cloud", cloud_port), make(nodes / "observer", cloud_port, "watch", "observer")
        cell, device = make(nodes / "c0", cell_port), make(nodes / "c0-d0", cell_port)
        at_cloud, at_cell = Inbox(), Inbox()
        observer.subscribe(f"fedtier/{RUN}/#", at_cloud)
        cell.subscribe(topics.cell_task(RUN, "c0"), at_cell)
        for t in (cloud, observer, cell, device):
            t.connect(WAIT)
        assert observer.wait_subscribed(WAIT) and cell.wait_subscribed(WAIT)
        # the bridge is up (and subscribed at the cloud broker) once the cell's status crosses it
        cell.publish(topics.status(RUN, topics.cell_node("c0")), b"cell up", retain=True)
        at_cloud.wait_for(topics.status(RUN, topics.cell_node("c0")))
        cloud.publish(topics.cell_task(RUN, "c0"), b"task for c0")
        assert at_cell.wait_for(topics.cell_task(RUN, "c0")) == [(topics.cell_task(RUN, "c0"), b"task for c0")]
        device.publish(topics.device_result(RUN, "c0", "c0-d0"), b"device result")  # stays in the cell
        assert device.flush(WAIT)  # the cell broker has it before the report below
        cell.publish(topics.cell_report(RUN, "c0"), b"report of c0")
        got = at_cloud.wait_for(topics.cell_report(RUN, "c0"))  # one bridge: in order
        assert [t for t, _ in got] == [
            topics.status(RUN, topics.cell_node("c0")),
            topics.cell_task(RUN, "c0"),
            topics.cell_report(RUN, "c0"),
        ]  # and no device result
        # another cell's device: its certificate (the deployment's CA) logs it in, but c0's broker grants it nothing
        outsider, results, spied = make(nodes / "c1-d0", cell_port).connect(WAIT), Inbox(), Inbox()
        outsider.subscribe(f"fedtier/{RUN}/#", spied)
        cell.subscribe(topics.device_results(RUN, "c0"), results)
        assert outsider.wait_subscribed(WAIT) and cell.wait_subscribed(WAIT)
        outsider.publish(topics.device_result(RUN, "c0", "c0-d0"), b"forged")
        assert outsider.flush(WAIT)
        device.publish(topics.device_result(RUN, "c0", "c0-d0"), b"genuine")
        assert results.wait_for(topics.device_result(RUN, "c0", "c0-d0")) == [
            (topics.device_result(RUN, "c0", "c0-d0"), b"genuine")
        ]
        assert spied.items == []


def test_per_cell_brokers_on_one_host_each_get_their_own_port_and_bridge(per_cell: dict[str, Any]) -> None:
    out, cloud_port, first = per_cell["out"], per_cell["port"], per_cell["cell_port"]
    for cell, port in (("c0", first), ("c1", first + 1)):
        assert f"listener {port} 127.0.0.1\n" in (out / "cells" / cell / "mosquitto.conf").read_text()
        for node in (cell, f"{cell}-d0"):
            assert f"127.0.0.1:{port}" in (out / "nodes" / node / "config.toml").read_text()
    with clients() as make:
        observer = make(out / "nodes" / "observer", cloud_port, "watch", "observer")
        at_cloud = Inbox()
        observer.subscribe(f"fedtier/{RUN}/#", at_cloud)
        observer.connect(WAIT)
        assert observer.wait_subscribed(WAIT)
        c1 = make(out / "nodes" / "c1", first + 1).connect(WAIT)  # c1's broker, bridged to the cloud's
        c1.publish(topics.status(RUN, topics.cell_node("c1")), b"c1 up", retain=True)
        got = at_cloud.wait_for(topics.status(RUN, topics.cell_node("c1")))
        assert (topics.status(RUN, topics.cell_node("c1")), b"c1 up") in got


def test_cell_broker_refuses_a_device_reading_another_devices_task(per_cell: dict[str, Any]) -> None:
    nodes, cell_port = per_cell["out"] / "nodes", per_cell["cell_port"]
    with clients() as make:
        cell, spy = make(nodes / "c0", cell_port), make(nodes / "c0-d0", cell_port)
        inbox = Inbox()
        spy.subscribe(topics.device_task(RUN, "c0", "c0-d1"), inbox)  # denied by the cell broker's ACL
        spy.subscribe(topics.device_task(RUN, "c0", "c0-d0"), inbox)
        cell.connect(WAIT), spy.connect(WAIT)
        assert spy.wait_subscribed(WAIT)
        cell.publish(topics.device_task(RUN, "c0", "c0-d1"), b"task of d1")
        cell.publish(topics.device_task(RUN, "c0", "c0-d0"), b"task of d0")
        assert inbox.wait_for(topics.device_task(RUN, "c0", "c0-d0")) == [
            (topics.device_task(RUN, "c0", "c0-d0"), b"task of d0")
        ]


@needs_mosquitto
def test_the_monitor_bundle_watches_signed_telemetry_over_tls(
    provisioned: dict[str, Any], broker: subprocess.Popen, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fedtier monitor --config config.toml --once`, run from inside the provisioned monitor bundle, reaches
    the TLS broker with the monitor's user and certificate and checks signatures with the bundle's public
    keys: c0's signed aggregation record makes its row; an unsigned one that c1 publishes on its own
    telemetry topic (the ACL lets it) is counted as invalid, with the reason."""
    import time

    from protocols.records import CellRecord
    from protocols.wire.keys import Trust
    from protocols.wire.signed import seal_record

    nodes, port = provisioned["out"] / "nodes", provisioned["port"]
    ring = load_keys(nodes / "c0" / "keys.toml")
    record = CellRecord(
        run="t",
        round=0,
        edge_round=0,
        cell="c0",
        algorithm="fedavg",
        planned=["c0-d0", "c0-d1"],
        answered=["c0-d0", "c0-d1"],
        closed_by="all answered",
        duration_s=0.1,
        time=time.time(),
    ).to_dict()
    c0_topic, c1_topic = topics.telemetry_cell("t", "c0"), topics.telemetry_cell("t", "c1")
    signed = seal_record(record, c0_topic, Trust("c0", ring.private["c0"], ring.public).sign)
    unsigned = seal_record({**record, "cell": "c1"}, c1_topic, None)
    monkeypatch.chdir(nodes / "monitor")
    with clients() as make:
        c0, c1 = make(nodes / "c0", port), make(nodes / "c1", port)
        c0.connect(WAIT), c1.connect(WAIT)
        listened = threading.Event()

        def publish() -> None:  # until the monitor has listened its 2 s
            while not listened.wait(0.2):
                c0.publish(c0_topic, signed, qos=0)
                c1.publish(c1_topic, unsigned, qos=0)

        publishing = threading.Thread(target=publish, name="telemetry", daemon=True)
        publishing.start()
        try:  # in this process (its commands are click's): no Python process to start, as before (~1-3 s)
            res = CliRunner().invoke(
                main, ["monitor", "--config", "config.toml", "--once", "--wait", "2", "--width", "220"]
            )
        finally:
            listened.set()
            publishing.join(WAIT)
    output = res.output
    assert res.exit_code == 0 and res.exception is None, output
    assert "│ c0 " in output and "2/2" in output, output
    assert "invalid record(s)" in output and "unsigned record (the signature of 'c1' is required)" in output, output
    assert "│ c1 " not in output, output


@needs_mosquitto
def test_a_renewed_certificate_logs_in_and_the_old_one_is_refused(reachable_tmp: Path) -> None:
    """`fedtier provision renew --node c0-d0` gives the device a new key and certificate from the deployment's
    CA and revokes the old one: after the broker restarts the new one logs in, a kept copy of the old key and
    certificate is refused, other nodes are untouched; the exporter shows the renewed certificate's days left."""
    import shutil

    from monitor.exporter import MetricsExporter

    p = provision_cli(reachable_tmp, "renew")
    out, port = p["out"], p["port"]
    bundle, old = out / "nodes" / "c0-d0", reachable_tmp / "old-c0-d0"
    shutil.copytree(bundle, old)
    conf = out / "broker" / "mosquitto.conf"
    with mosquitto(conf, port), clients() as make:
        make(old, port).connect(WAIT)  # the original certificate logs in
    res = CliRunner().invoke(main, ["provision", "renew", "--out", str(out), "--node", "c0-d0", "--days", "30"])
    assert res.exit_code == 0, res.output
    assert (bundle / "client.crt").read_bytes() != (old / "client.crt").read_bytes()
    assert (bundle / "client.key").read_bytes() != (old / "client.key").read_bytes()  # the key is rotated
    assert stat.S_IMODE(os.stat(bundle / "client.key").st_mode) == 0o600
    with mosquitto(conf, port), clients() as make:
        make(bundle, port).connect(WAIT)
        make(out / "nodes" / "c0-d1", port).connect(WAIT)  # not renewed, not revoked
        with pytest.raises(ConnectionError):
            make(old, port).connect(WAIT)
    exporter = MetricsExporter("t")
    exporter.watch_certificate("c0-d0", bundle / "client.crt")
    expiry = exporter.registry.get_sample_value(
        "fedtier_certificate_expiry_timestamp_seconds", {"run": "t", "node": "c0-d0"}
    )
    assert expiry is not None and 29.9 < (expiry - time.time()) / 86400 <= 30.01, expiry
    res = CliRunner().invoke(main, ["provision", "renew", "--out", str(out), "--node", "nobody"])
    assert res.exit_code == 2 and "nobody" in res.output
    res = CliRunner().invoke(main, ["provision", "renew", "--out", str(out)])  # everything: bundles, the broker
    n = len(list((out / "nodes").glob("*/client.crt"))) + 1
    assert res.exit_code == 0 and f"renewed {n} certificates" in " ".join(res.output.split()), res.output


def test_renew_identity_rotates_a_nodes_ed25519_key_in_every_bundle_that_knows_it(reachable_tmp: Path) -> None:
    """`fedtier provision renew --node c0-d0 --identity`: a new Ed25519 key for c0-d0 in OUT/keys.toml and its
    bundle; its cell, the cloud's keys file if it knows it, and the monitor get the new public key: a message
    signed with the old key is refused by the cell, one signed with the new key verified."""
    from protocols.wire.envelope import WireError
    from protocols.wire.keys import PublicKeys, Trust, load_keys, public_of

    out = provision_cli(reachable_tmp, "identity")["out"]
    old = load_keys(out / "nodes" / "c0-d0" / "keys.toml").private["c0-d0"]
    res = CliRunner().invoke(main, ["provision", "renew", "--out", str(out), "--node", "c0-d0", "--identity"])
    assert res.exit_code == 0, res.output
    new = load_keys(out / "nodes" / "c0-d0" / "keys.toml").private["c0-d0"]
    assert new != old and load_keys(out / "keys.toml").private["c0-d0"] == new
    for peer in ("c0", "monitor"):
        assert load_keys(out / "nodes" / peer / "keys.toml", need_private=False).public["c0-d0"] == public_of(new)
    assert "c0-d0" not in load_keys(out / "nodes" / "c1" / "keys.toml").public  # another cell never knew it
    cell = PublicKeys(load_keys(out / "nodes" / "c0" / "keys.toml").public)
    cell.verify("c0-d0", b"result", Trust("c0-d0", new, {}).sign(b"result"))
    with pytest.raises(WireError, match="bad signature"):
        cell.verify("c0-d0", b"result", Trust("c0-d0", old, {}).sign(b"result"))
    assert stat.S_IMODE(os.stat(out / "nodes" / "c0" / "keys.toml").st_mode) == 0o600
    res = CliRunner().invoke(main, ["provision", "renew", "--out", str(out), "--identity"])
    assert res.exit_code == 2 and "--node" in res.output


# ------------------------------------------------------------------------- root without --broker-user
def root_cli(tmp: Path, monkeypatch: pytest.MonkeyPatch, mosquitto_user: bool) -> tuple[str, Path, list[str]]:
    """``fedtier provision`` as if run by root (euid 0), on a host with or without a ``mosquitto`` user."""
    import shutil

    def getpwnam(name: str) -> Any:
        if name == "mosquitto" and mosquitto_user:
            return pwd.struct_passwd(("mosquitto", "x", 104, 107, "", "/var/lib/mosquitto", "/usr/sbin/nologin"))
        raise KeyError(name)

    chowned: list[str] = []
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(pwd, "getpwnam", getpwnam)
    monkeypatch.setattr(
        shutil, "chown", lambda path, user=None, group=None: chowned.append(f"{Path(path).name}:{user}")
    )
    cfg = tmp / "root.toml"
    cfg.write_text(small_config(tmp).to_toml())
    res = CliRunner().invoke(main, ["provision", str(cfg), "--out", str(tmp / "root"), "--bind", "127.0.0.1"])
    assert res.exit_code == 0, res.output
    return res.output, tmp / "root" / "broker", chowned


def test_provision_as_root_without_broker_user_gives_the_broker_files_to_mosquitto(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    output, broker, chowned = root_cli(tmp_path, monkeypatch, mosquitto_user=True)
    assert "user mosquitto\n" in (broker / "mosquitto.conf").read_text()
    assert {"acl:mosquitto", "server.key:mosquitto", "mosquitto.conf:mosquitto", "data:mosquitto"} <= set(chowned)
    assert "without --broker-user" in " ".join(output.split()) and "'mosquitto'" in output


def test_provision_as_root_without_broker_user_or_mosquitto_user_warns_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    output, broker, chowned = root_cli(tmp_path, monkeypatch, mosquitto_user=False)
    assert chowned == [] and "\nuser " not in (broker / "mosquitto.conf").read_text()
    said = " ".join(output.split())
    assert "warning:" in said and "cannot read them" in said and "give --broker-user USER" in said


def test_a_federation_whose_roster_does_not_fit_one_chunk_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """The signed roster travels retained, as one message (~85 bytes a device): past ~3,000 devices at the default
    --max-chunk, provisioning wrote every certificate and bundle, and then the serving cloud's first publish of
    the roster raised (``retained message ... must fit in one chunk``) and `fedtier provision publish|revoke`
    could never bring a revocation to the nodes. Now provisioning exits 2 at once naming the --max-chunk it needs,
    and writes nothing."""
    cfg_path = tmp_path / "big.toml"
    cfg_path.write_text(small_config(tmp_path, topology={"cells": 31, "devices_per_cell": 100}).to_toml())
    args = ["provision", str(cfg_path), "--out", str(tmp_path / "big"), "--federation", "--max-device-samples", "100"]
    res = CliRunner().invoke(main, args)
    said = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert "roster of 3,100 devices is" in said and "--max-chunk 262,144" in said, said
    assert "needs --max-chunk 393216 or more" in said, said
    assert not (tmp_path / "big").exists()


def test_enrolling_a_device_the_roster_has_no_room_for_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """add-device checks the roster as provisioning does, before any file changes: refused, exit 2, no login, no
    bundle, the roster as it was."""
    out = provision_cli(tmp_path, "fed", "--federation", "--max-chunk", "1200")["out"]
    said, added = "", 0
    while added < 6:
        res = CliRunner().invoke(
            main,
            ["provision", "add-device", "--out", str(out), "--cell", "c0", "--device", f"new-{added}", "--no-publish"],
        )
        said = " ".join(res.output.split())
        if res.exit_code != 0:
            break
        added += 1
    assert res.exit_code == 2 and 0 < added < 6, said
    assert "--max-chunk 1,200) can carry" in said, said
    roster = json.loads((out / "roster.json").read_text())
    assert roster["version"] == 1 + added and f"new-{added}" not in roster["cells"]["c0"]["devices"]
    assert not (out / "nodes" / f"new-{added}").exists() and f"new-{added}" not in (out / "broker" / "acl").read_text()


# ------------------------------------------------------------------------------------------ moved folder
@needs_mosquitto
def test_a_moved_provisioning_folder_works_again_after_relocate(reachable_tmp: Path) -> None:
    """Mosquitto resolves relative config paths against its working directory, so the configs hold absolute
    ones: a moved folder's broker cannot start until ``fedtier provision relocate`` rewrites them."""
    cell_port = free_port_run(2)
    p = provision_cli(
        reachable_tmp, "before-move", "--brokers", "per-cell", "--cell-host", "127.0.0.1", "--cell-port", str(cell_port)
    )
    moved = reachable_tmp / "after-move"
    p["out"].rename(moved)
    conf = moved / "broker" / "mosquitto.conf"
    with pytest.raises(AssertionError, match="Unable to"), mosquitto(conf, p["port"]):
        pass  # it names files under the old folder: it exits
    res = CliRunner().invoke(main, ["provision", "relocate", "--out", str(moved)])
    assert res.exit_code == 0, res.output
    assert "before-move" not in conf.read_text() and f"acl_file {moved.resolve()}/broker/acl" in conf.read_text()
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    for cell in ("c0", "c1"):  # each cell broker's config and its bridge section too
        assert "before-move" not in (moved / "cells" / cell / "mosquitto.conf").read_text()
    with mosquitto(conf, p["port"]), mosquitto(moved / "cells" / "c0" / "mosquitto.conf", cell_port), clients() as make:
        assert make(moved / "nodes" / "cloud", p["port"]).connect(WAIT).connected
        assert make(moved / "nodes" / "c0-d0", cell_port).connect(WAIT).connected
    again = CliRunner().invoke(main, ["provision", "relocate", "--out", str(moved)])
    assert again.exit_code == 0 and "nothing to do" in again.output


def test_a_device_added_to_a_per_cell_federation_points_at_its_own_cells_port(tmp_path: Path) -> None:
    from fedtier.membership import add_device
    from fedtier.provisioning import provision

    cfg = small_config(tmp_path, topology={"cells": 2, "devices_per_cell": 1})
    done = provision(cfg, tmp_path / "fed", per_cell=True, cell_host="127.0.0.1", cell_port=9000, federation=True)
    assert sorted(done.cell_brokers) == ["c0", "c1"]
    change = add_device(tmp_path / "fed", "c1", "c1-d9")
    assert change.bundle is not None
    broker = tomllib.loads((change.bundle / "config.toml").read_text())["broker"]
    assert broker["url"] == "mqtts://127.0.0.1:9001"  # c1's broker, not c0's (9000)


def test_a_cell_revoked_in_a_per_cell_federation_has_its_bridge_certificate_revoked(tmp_path: Path) -> None:
    """A per-cell broker's bridge logs in at the cloud broker with its own certificate (``cells/CELL/bridge.crt``):
    revoking the cell revoked its nodes' certificates but not that one, so the revoked cell's broker could still
    connect to the cloud broker. Now every broker's revocation list holds it (the other cell's bridge untouched)
    and the cloud broker's ACL no longer names the revoked bridge."""
    from cryptography import x509

    from fedtier.membership import revoke
    from fedtier.provisioning import provision

    cfg = small_config(tmp_path, topology={"cells": 2, "devices_per_cell": 1})
    out = tmp_path / "fed"
    provision(cfg, out, per_cell=True, cell_host="127.0.0.1", cell_port=9000, federation=True)

    def serial(crt: Path) -> int:
        return x509.load_pem_x509_certificate(crt.read_bytes()).serial_number

    revoke(out, "c1")
    for folder in (out / "broker", out / "cells" / "c0", out / "ca"):
        crl = x509.load_pem_x509_crl((folder / "ca.crl").read_bytes())
        revoked = {r.serial_number for r in crl}
        assert serial(out / "cells" / "c1" / "bridge.crt") in revoked, folder
        assert serial(out / "nodes" / "c1" / "client.crt") in revoked
        assert serial(out / "cells" / "c0" / "bridge.crt") not in revoked
    acl = (out / "broker" / "acl").read_text()
    assert "user bridge.c0" in acl and "bridge.c1" not in acl


def test_renewal_never_reissues_a_revoked_nodes_certificate(tmp_path: Path) -> None:
    """``fedtier provision renew`` (all) re-issued every bundle's certificate, revoked nodes' included, and a revoked
    cell's bridge certificate: fresh credentials, off the revocation list, for nodes the operator had shut out. Now
    renewing all passes them over (and the revoked cell's broker's), saying so in one line, and naming one is refused
    (exit 2, the reason), also where the folder's roster is gone (its certificate is on the revocation list)."""
    from cryptography import x509

    from fedtier.federation import STATE_FILE
    from fedtier.membership import revoke
    from fedtier.provisioning import provision

    cfg = small_config(tmp_path, topology={"cells": 2, "devices_per_cell": 1})
    out = tmp_path / "fed"
    provision(cfg, out, per_cell=True, cell_host="127.0.0.1", cell_port=9000, federation=True)
    revoke(out, "c1")  # with its device c1-d0 and its broker's bridge login
    revoke(out, "c0-d0")

    def serials() -> dict[str, int]:
        files = [*(out / "nodes").glob("*/client.crt"), *(out / "cells").glob("*/*.crt"), out / "broker" / "server.crt"]
        return {
            f"{f.parent.name}/{f.name}": x509.load_pem_x509_certificate(f.read_bytes()).serial_number
            for f in files
            if f.name != "ca.crt"
        }

    before = serials()
    res = CliRunner().invoke(main, ["provision", "renew", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "passed over the revoked c0-d0, c1, c1-d0: a revoked node's certificate is never re-issued" in res.output
    after = serials()
    kept = {"c0-d0/client.crt", "c1/client.crt", "c1-d0/client.crt", "c1/bridge.crt", "c1/server.crt"}
    assert {f for f in before if after[f] == before[f]} == kept
    for node in ("c1-d0", "c1"):
        res = CliRunner().invoke(main, ["provision", "renew", "--out", str(out), "--node", node, "--identity"])
        assert res.exit_code == 2 and f"{node} was revoked" in res.output, res.output
    (out / STATE_FILE).unlink()  # no federation state (and so no roster): the revocation list still says
    res = CliRunner().invoke(main, ["provision", "renew", "--out", str(out), "--node", "c0-d0"])
    assert res.exit_code == 2 and "c0-d0 was revoked" in res.output, res.output
    assert serials() == after


def test_renewal_with_a_damaged_bundle_certificate_exits_2_naming_it_and_renews_nothing(tmp_path: Path) -> None:
    """Renewal reads every bundle's certificate to tell the revoked nodes (their serial on the revocation list): one
    that is not a certificate (a bad copy) was a traceback, also for ``--node`` of another node. Now exit 2 naming
    the file, nothing renewed (whether that node was revoked is unknown)."""
    from fedtier.provisioning import provision

    out = tmp_path / "fed"
    provision(small_config(tmp_path, topology={"cells": 1, "devices_per_cell": 2}), out)
    (out / "nodes" / "c0-d0" / "client.crt").write_text("not a certificate")
    before = (out / "nodes" / "c0-d1" / "client.crt").read_bytes()
    for extra in ([], ["--node", "c0-d1"]):
        res = CliRunner().invoke(main, ["provision", "renew", "--out", str(out), *extra])
        said = "".join(res.output.split())  # (the console wraps long paths anywhere)
        assert res.exit_code == 2 and "c0-d0/client.crtisnotareadablecertificate" in said, res.output
        assert "whetherc0-d0wasrevokedisunknown,sonothingisrenewed" in said, res.output
        assert res.exception is None or isinstance(res.exception, SystemExit)
    assert (out / "nodes" / "c0-d1" / "client.crt").read_bytes() == before


def test_a_revocation_list_rewritten_on_a_full_disk_keeps_what_it_revoked(tmp_path: Path, monkeypatch) -> None:
    """The deployment's revocation list (``ca/ca.crl``) is where renewal and revocation read the serials already
    revoked. It was rewritten in place with no fsync: a full disk (or a power loss) while a certificate was revoked
    left it empty, and the next revocation, reading it, un-revoked every certificate revoked before. Now the old
    file stays whole until the new one is durable; a replaced file keeps its mode (and owner)."""
    from fedtier.pki import write_file

    crl = tmp_path / "ca" / "ca.crl"
    write_file(crl, b"serials 1 2 3")
    os.chmod(crl, 0o640)
    fdopen = os.fdopen

    real_open = Path.open
    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: FullDisk(fdopen(fd, *a, **k)))
    monkeypatch.setattr(Path, "open", lambda self, *a, **k: FullDisk(real_open(self, *a, **k)))
    with pytest.raises(OSError):
        write_file(crl, b"serials 1 2 3 4")
    monkeypatch.undo()
    assert crl.read_bytes() == b"serials 1 2 3" and [p.name for p in crl.parent.iterdir()] == ["ca.crl"]
    write_file(crl, b"serials 1 2 3 4")
    assert crl.read_bytes() == b"serials 1 2 3 4" and stat.S_IMODE(crl.stat().st_mode) == 0o640
    write_file(tmp_path / "ca" / "ca.key", b"secret", secret=True)
    assert stat.S_IMODE((tmp_path / "ca" / "ca.key").stat().st_mode) == 0o600
