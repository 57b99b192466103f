"""Broker-level trust over a real Mosquitto: TLS (server-authenticated and mutual) and user name /
password, with certificates from a throwaway CA made by the ``openssl`` CLI in a tmp dir; and the
whole stack at once: ``fedtier run`` over mutual TLS + password with signed messages."""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from protocols.transport.broker import MosquittoBroker, find_mosquitto
from protocols.transport.mqtt import MqttTransport
from protocols.transport.threadloop import ThreadLoop
from sim.emulation import Emulation
from sim.launcher import run_simulation
from tests.conftest import small_config

OPENSSL = shutil.which("openssl")
MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd")
pytestmark = [
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed"),
    pytest.mark.skipif(
        OPENSSL is None,
        reason="the openssl CLI is not installed (and the venv has no `cryptography` to make test certificates with)",
    ),
]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True)


def _key_and_csr(name: str, cn: str, d: Path) -> None:
    _openssl(
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        f"/CN={cn}",
        cwd=d,
    )


def _ca(name: str, d: Path) -> None:
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-days",
        "1",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.crt",
        "-subj",
        f"/CN={name}",
        cwd=d,
    )


def _sign(name: str, ca: str, d: Path, ext: str | None = None) -> None:
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.crt",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-out",
        f"{name}.crt",
        *(("-extfile", ext) if ext else ()),
        cwd=d,
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.crt; server.{crt,key} for 127.0.0.1 signed by it; client.{crt,key} signed by it; rogue.crt, an
    unrelated CA, and rogue-client.{crt,key} signed by that one."""
    d = tmp_path_factory.mktemp("pki")
    _ca("ca", d)
    _ca("rogue", d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, cn, ca, ext in [
        ("server", "127.0.0.1", "ca", "san.cnf"),
        ("client", "c0-d0", "ca", None),
        ("rogue-client", "c0-d0", "rogue", None),
    ]:
        _key_and_csr(name, cn, d)
        _sign(name, ca, d, ext)
    return d


def tls_config(d: Path, mutual: bool) -> str:
    return f"cafile {d / 'ca.crt'}\ncertfile {d / 'server.crt'}\nkeyfile {d / 'server.key'}\n" + (
        "require_certificate true\n" if mutual else ""
    )


@pytest.fixture
def loop() -> Iterator[ThreadLoop]:
    lp = ThreadLoop("tls-test").start()
    yield lp
    lp.stop()


def connect(broker: MosquittoBroker, loop: ThreadLoop, name: str, **kw: Any) -> MqttTransport:
    return MqttTransport(name, loop, "127.0.0.1", broker.port, **kw).connect(timeout=5.0)


def exchange(broker: MosquittoBroker, loop: ThreadLoop, **kw: Any) -> None:
    """Two clients with the same options: one publishes, the other receives it."""
    got: list[bytes] = []
    arrived = threading.Event()
    rx = connect(broker, loop, "rx", **kw)
    tx = connect(broker, loop, "tx", **kw)
    try:
        rx.subscribe("t/#", lambda _t, p: (got.append(p), arrived.set()))
        assert rx.wait_subscribed(5.0)
        tx.publish("t/x", b"over TLS" * 1000)
        assert arrived.wait(5.0) and got == [b"over TLS" * 1000]
    finally:
        tx.close()
        rx.close()


def test_tls_server_authentication(pki: Path, loop: ThreadLoop) -> None:
    with MosquittoBroker(extra_config=tls_config(pki, mutual=False)) as broker:
        exchange(broker, loop, ca_certs=str(pki / "ca.crt"))
        with pytest.raises(ConnectionError, match=r"closed the connection .*\(without TLS\).*require TLS"):
            connect(broker, loop, "plain")
        with pytest.raises(ConnectionError, match="TLS handshake .* failed: .*CERTIFICATE_VERIFY_FAILED"):
            connect(broker, loop, "wrong-ca", ca_certs=str(pki / "rogue.crt"))


def test_mutual_tls(pki: Path, loop: ThreadLoop) -> None:
    client = {"certfile": str(pki / "client.crt"), "keyfile": str(pki / "client.key")}
    with MosquittoBroker(extra_config=tls_config(pki, mutual=True)) as broker:
        exchange(broker, loop, ca_certs=str(pki / "ca.crt"), **client)
        with pytest.raises(ConnectionError, match=r"\(with TLS, no client certificate\).*client certificate"):
            connect(broker, loop, "no-cert", ca_certs=str(pki / "ca.crt"))
        with pytest.raises(ConnectionError, match="closed the connection"):
            connect(
                broker,
                loop,
                "rogue-cert",
                ca_certs=str(pki / "ca.crt"),
                certfile=str(pki / "rogue-client.crt"),
                keyfile=str(pki / "rogue-client.key"),
            )
        with pytest.raises(ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            connect(broker, loop, "wrong-ca", ca_certs=str(pki / "rogue.crt"), **client)


def password_file(d: Path, users: dict[str, str]) -> Path:
    path = d / "passwd"
    path.write_text("")
    for user, password in users.items():
        subprocess.run([MOSQUITTO_PASSWD, "-b", str(path), user, password], check=True, capture_output=True)
    return path


@pytest.mark.skipif(MOSQUITTO_PASSWD is None, reason="mosquitto_passwd is not installed")
def test_username_and_password(tmp_path: Path, loop: ThreadLoop) -> None:
    passwd = password_file(tmp_path, {"c0-d0": "s3cret", "other": "x"})
    with MosquittoBroker(extra_config=f"password_file {passwd}\n", allow_anonymous=False) as broker:
        exchange(broker, loop, username="c0-d0", password="s3cret")
        for kw in ({"username": "c0-d0", "password": "wrong"}, {"username": "nobody", "password": "s3cret"}, {}):
            with pytest.raises(ConnectionError, match=r"refused '.*': Not authorized"):
                connect(broker, loop, "bad", **kw)


@pytest.mark.skipif(MOSQUITTO_PASSWD is None, reason="mosquitto_passwd is not installed")
def test_fedtier_run_over_mutual_tls_and_password_with_signed_messages(pki: Path, tmp_path: Path) -> None:
    """Every node (cloud, cells, agents in a worker process) reaches Mosquitto over mutual TLS with a
    user name and password, and signs its messages: the same model as the unsigned sim."""
    passwd = password_file(tmp_path, {"fedtier": "pw"})
    broker_cfg = {
        "username": "fedtier",
        "password": "pw",
        "ca_certs": str(pki / "ca.crt"),
        "certfile": str(pki / "client.crt"),
        "keyfile": str(pki / "client.key"),
    }
    sim = run_simulation(small_config(tmp_path / "sim", run={"rounds": 2}))
    with MosquittoBroker(
        extra_config=tls_config(pki, mutual=True) + f"password_file {passwd}\n", allow_anonymous=False
    ) as broker:
        cfg = small_config(
            tmp_path / "run",
            run={"rounds": 2},
            broker={"url": broker.url, **broker_cfg},
            security={"keys": str(tmp_path / "keys.toml")},
        )
        result = Emulation(cfg, workers=1).run()
    assert all(np.array_equal(sim.params[k], result.params[k]) for k in sim.params)
    assert all(not r["rejected"] for r in result.cell_records) and len(result.history) == 2
    assert Path(result.config.security.keys) == (tmp_path / "run" / "run" / "keys.toml").resolve()  # generated
