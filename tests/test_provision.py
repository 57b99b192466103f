"""``fedtier provision`` against a real Mosquitto started with the provisioned listener options: TLS,
password file and the per-node ACL are enforced by the broker."""
from __future__ import annotations

import base64
import os
import stat
import threading
import tomllib
from pathlib import Path
from typing import Any, Iterator

import pytest
from click.testing import CliRunner

from fedtier.cli import main
from fedtier.provisioning import password_line
from protocols.transport.broker import MosquittoBroker, find_mosquitto, free_port
from protocols.transport.mqtt import MqttTransport
from protocols.transport.threadloop import ThreadLoop
from protocols.wire import topics
from protocols.wire.keys import load_keys
from tests.conftest import small_config

WAIT = 10.0
needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")


def test_password_lines_match_mosquitto_passwd_format() -> None:
    # the line mosquitto_passwd 2.0.11 writes for alice/secret with this salt
    assert password_line("alice", "secret", base64.b64decode("sqzBqxC1jNIuFmH7")) == (
        "alice:$7$101$sqzBqxC1jNIuFmH7$ybCLIMDqjN0Ftfpu3ZaKd59eTqga+5X6OhbGFGzvFA4VWTSxEm6a3ERz88M8qKBR4OU3Z"
        "fsAcdlEzxl+3cekxA==")


@pytest.fixture(scope="module")
def provisioned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("prov")
    cfg_path = tmp / "cfg.toml"
    cfg_path.write_text(small_config(tmp).to_toml())
    port = free_port()
    res = CliRunner().invoke(main, ["provision", str(cfg_path), "--out", str(tmp / "out"), "--port", str(port)])
    assert res.exit_code == 0, res.output
    return {"out": tmp / "out", "port": port, "cfg": cfg_path}


def test_provision_writes_bundles_with_only_what_a_node_needs(provisioned: dict[str, Any]) -> None:
    out = provisioned["out"]
    nodes = sorted(p.name for p in (out / "nodes").iterdir())
    assert nodes == sorted(["cloud", "monitor", "c0", "c1", "c0-d0", "c0-d1", "c0-d2", "c1-d0", "c1-d1", "c1-d2"])
    d = out / "nodes" / "c0-d1"
    ring = load_keys(d / "keys.toml")
    assert set(ring.private) == {"c0-d1"} and set(ring.public) == {"c0-d1", "c0", "cloud"}
    for secret in (d / "keys.toml", d / "client.key", d / "config.toml", out / "ca" / "ca.key",
                   out / "broker" / "passwd", out / "broker" / "server.key"):
        assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600, secret
    cfg = tomllib.loads((d / "config.toml").read_text())
    assert cfg["broker"]["url"] == f"mqtts://127.0.0.1:{provisioned['port']}"
    assert cfg["broker"]["username"] == "c0-d1" and cfg["security"]["keys"] == "keys.toml"
    acl = (out / "broker" / "acl").read_text()
    device = acl.split("user c0-d1\n")[1].split("\n\n")[0].splitlines()
    assert device == ["topic read fedtier/t/cell/c0/down/c0-d1/task", "topic write fedtier/t/cell/c0/up/c0-d1/result",
                      "topic read fedtier/t/cloud/control", "topic read fedtier/t/cloud/round",
                      "topic read fedtier/t/status/cloud", "topic write fedtier/t/cell/c0/status/device.c0-d1"]
    res = CliRunner().invoke(main, ["provision", str(provisioned["cfg"]), "--out", str(out)])
    assert res.exit_code == 2 and "already provisioned" in res.output  # never silently re-keys a fleet


@pytest.fixture(scope="module")
def broker(provisioned: dict[str, Any]) -> Iterator[MosquittoBroker]:
    options = (provisioned["out"] / "broker" / "listener.conf").read_text()
    with MosquittoBroker(port=provisioned["port"], extra_config=options, allow_anonymous=False) as b:
        yield b


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


@pytest.fixture
def connect(provisioned: dict[str, Any], broker: MosquittoBroker) -> Iterator[Any]:
    loop = ThreadLoop("acl").start()
    made: list[MqttTransport] = []

    def make(node: str, password: str | None = None) -> MqttTransport:
        d: Path = provisioned["out"] / "nodes" / node
        cfg = tomllib.loads((d / "config.toml").read_text())["broker"]
        t = MqttTransport(f"acl-{node}", loop, "127.0.0.1", provisioned["port"], username=node,
                          password=password or cfg["password"], ca_certs=str(d / "ca.crt"),
                          certfile=str(d / "client.crt"), keyfile=str(d / "client.key"))
        made.append(t)
        return t

    yield make
    for t in made:
        t.close(flush_timeout=1)
    loop.stop()


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
def test_broker_refuses_wrong_credentials(connect) -> None:
    with pytest.raises(ConnectionError, match="refused"):
        connect("c0-d0", password="guess").connect(WAIT)
