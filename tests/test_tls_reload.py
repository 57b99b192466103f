"""Certificate renewal on a running deployment, with the provisioned Mosquitto: ``fedtier provision renew``
reloads the running broker (SIGHUP: it refuses the revoked certificate from then on, live connections stay)
and prints the next steps; a node told to reload (SIGHUP) presents its renewed certificate at its next
reconnect and keeps serving, one that kept the old certificate is refused; unusable files are not taken."""

from __future__ import annotations

import datetime as dt
import logging
import os
import shutil
import signal
import socket
import ssl
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography import x509

from fedtier.cli import main
from fedtier.pki import load_pki, new_key, pem_cert, pem_key
from fedtier.serve import reload_on_sighup
from protocols.transport.tls_reload import check_material
from tests.conftest import wait_until
from tests.test_provision import WAIT, clients, mosquitto, needs_mosquitto, provision_cli, reachable_tmp  # noqa: F401


def _server_serial(port: int) -> int:
    """The serial number of the certificate the broker on ``port`` presents now."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as raw, ctx.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


@needs_mosquitto
def test_a_node_reloaded_on_sighup_keeps_serving_with_its_renewed_certificate(
    reachable_tmp: Path,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    p = provision_cli(reachable_tmp, "reload", "--federation")
    out, port = p["out"], p["port"]
    # each node's installed bundle (its host's /etc/fedtier/NODE), and a copy of c0-d0's original files
    installed = {n: reachable_tmp / "hosts" / n for n in ("c0-d0", "c0-d1")}
    for node, folder in installed.items():
        shutil.copytree(out / "nodes" / node, folder)
    kept = reachable_tmp / "kept-c0-d0"
    shutil.copytree(out / "nodes" / "c0-d0", kept)
    conf = out / "broker" / "mosquitto.conf"
    previous = reload_on_sighup()
    try:
        with clients() as make:
            with mosquitto(conf, port):
                a = make(installed["c0-d0"], port).connect(WAIT)
                b = make(installed["c0-d1"], port).connect(WAIT)
                served_before = _server_serial(port)
                res = CliRunner().invoke(main, ["provision", "renew", "--out", str(out)])
                assert res.exit_code == 0, res.output
                text = " ".join(res.output.split())
                assert f"reloaded the broker in {out / 'broker'}" in text, text
                for node in ("c0-d0", "c0-d1"):  # the exact next step, for every renewed node
                    crt = out / "nodes" / node / "client.crt"
                    assert (
                        f"next: copy {crt} and {crt.with_suffix('.key')} to /etc/fedtier/{node}/ on {node}'s host, "
                        f"then systemctl reload fedtier-{node}.service (SIGHUP: no restart)" in text
                    ), text
                # the broker reloaded: a new server certificate, the revoked client certificate refused at once;
                # live connections stay
                assert wait_until(lambda: _server_serial(port) != served_before, WAIT)
                with pytest.raises(ConnectionError):
                    make(kept, port).connect(WAIT)
                assert a.connected and b.connected
                # the operator copies c0-d0's renewed files to its host and reloads it; c0-d1 gets nothing
                for name in ("client.crt", "client.key"):
                    shutil.copy(out / "nodes" / "c0-d0" / name, installed["c0-d0"] / name)
                with caplog.at_level(logging.WARNING, logger="protocols.transport.tls_reload"):
                    os.kill(os.getpid(), signal.SIGHUP)
                    renewed = str(installed["c0-d0"] / "client.crt")
                    assert wait_until(lambda: f"now present {renewed}" in caplog.text, WAIT), caplog.text
            # the broker restarts: every node reconnects; the reloaded one is let in, the other is refused
            with mosquitto(conf, port):
                assert wait_until(lambda: a.connected, 3 * WAIT), "the reloaded node did not reconnect"
                assert not b.connected
                with pytest.raises(ConnectionError):  # what c0-d1's reconnects present
                    make(installed["c0-d1"], port).connect(WAIT)
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_reload_refuses_an_expired_a_foreign_or_a_mismatched_certificate(tmp_path: Path) -> None:
    """A node never swaps its working certificate for files it could not log in with: each is named."""
    res = CliRunner().invoke(main, ["provision", str(_config(tmp_path)), "--out", str(tmp_path / "p")])
    assert res.exit_code == 0, res.output
    bundle = tmp_path / "p" / "nodes" / "c0-d0"
    crt, key, ca = (str(bundle / f) for f in ("client.crt", "client.key", "ca.crt"))
    serial, _ = check_material(crt, key, ca)
    assert serial == x509.load_pem_x509_certificate(Path(crt).read_bytes()).serial_number
    pki, now = load_pki(tmp_path / "p"), dt.datetime.now(dt.UTC)
    own = new_key()
    expired = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "c0-d0")]))
        .issuer_name(pki.cert.subject)
        .public_key(own.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=10))
        .not_valid_after(now - dt.timedelta(days=1))
        .sign(pki.key, pki.cert.signature_hash_algorithm)  # type: ignore[arg-type]
    )
    (tmp_path / "old.crt").write_bytes(pem_cert(expired))
    (tmp_path / "old.key").write_bytes(pem_key(own))
    with pytest.raises(ValueError, match="is not valid now"):
        check_material(str(tmp_path / "old.crt"), str(tmp_path / "old.key"), ca)
    other = CliRunner().invoke(main, ["provision", str(_config(tmp_path)), "--out", str(tmp_path / "q")])
    assert other.exit_code == 0, other.output
    with pytest.raises(ValueError, match="not signed by a CA"):
        check_material(str(tmp_path / "q/nodes/c0-d0/client.crt"), str(tmp_path / "q/nodes/c0-d0/client.key"), ca)
    # a CA file of two (a rotation: the other CA first): a certificate of either is taken, as TLS takes it
    both = tmp_path / "both.crt"
    both.write_bytes((tmp_path / "q/nodes/c0-d0/ca.crt").read_bytes() + Path(ca).read_bytes())
    assert check_material(crt, key, str(both))[0] == serial
    q_crt, q_key = str(tmp_path / "q/nodes/c0-d0/client.crt"), str(tmp_path / "q/nodes/c0-d0/client.key")
    assert check_material(q_crt, q_key, str(both))[0] != serial
    with pytest.raises(ValueError, match="cannot load"):
        check_material(crt, str(tmp_path / "old.key"), ca)


def _config(tmp: Path) -> Path:
    from tests.conftest import small_config

    path = tmp / "cfg.toml"
    path.write_text(small_config(tmp).to_toml())
    return path


def _presented_serial(context: ssl.SSLContext, broker: Path) -> int:
    """The serial number of the client certificate ``context`` presents to a server that requires one (the
    provisioned broker's certificate and CA, over a socket pair); ``ValueError`` if the handshake fails."""
    import threading

    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(broker / "server.crt", broker / "server.key")
    server.verify_mode = ssl.CERT_REQUIRED
    server.load_verify_locations(broker / "ca.crt")
    a, b = socket.socketpair()
    seen: list[bytes | None] = []

    def serve() -> None:
        try:
            with server.wrap_socket(b, server_side=True) as tls:
                seen.append(tls.getpeercert(binary_form=True))
        except (ssl.SSLError, OSError):
            seen.append(None)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with context.wrap_socket(a, server_hostname="broker") as tls:
            tls.recv(1)  # the server's side of the handshake is over when it closes
    except (ssl.SSLError, OSError):
        pass
    thread.join(WAIT)
    if not seen or seen[0] is None:
        raise ValueError("the handshake failed")
    return x509.load_der_x509_certificate(seen[0]).serial_number


def test_a_reload_takes_the_files_it_checked_even_if_they_change_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The files may be replaced between the check and the load (the operator copies the next pair): the context
    takes the pair it checked, never a certificate with another key (which leaves it no usable key at all)."""
    from protocols.transport import tls_reload

    res = CliRunner().invoke(main, ["provision", str(_config(tmp_path)), "--out", str(tmp_path / "p")])
    assert res.exit_code == 0, res.output
    out, installed = tmp_path / "p", tmp_path / "installed"
    shutil.copytree(out / "nodes" / "c0-d0", installed)
    crt, key, ca = (str(installed / f) for f in ("client.crt", "client.key", "ca.crt"))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.load_cert_chain(crt, key)
    holder = type("Client", (), {"_ssl_context": context})()
    tls_reload.track(holder, crt, key, ca)
    first = _presented_serial(context, out / "broker")
    res = CliRunner().invoke(main, ["provision", "renew", "--out", str(out), "--node", "c0-d0"])
    assert res.exit_code == 0, res.output
    for name in ("client.crt", "client.key"):
        shutil.copy(out / "nodes" / "c0-d0" / name, installed / name)
    renewed = x509.load_pem_x509_certificate((installed / "client.crt").read_bytes()).serial_number
    checked = tls_reload.check_material

    def check_then_replaced(certfile: str, keyfile: str, ca_certs: str | None) -> tuple[int, dt.datetime]:
        found = checked(certfile, keyfile, ca_certs)
        if found[0] == renewed:  # (other tests' clients may be tracked too)
            shutil.copy(out / "nodes" / "c0-d1" / "client.key", key)  # another key lands right after the check
        return found

    monkeypatch.setattr(tls_reload, "check_material", check_then_replaced)
    [outcome] = [r for r in tls_reload.reload_all() if r.certfile == crt]
    assert outcome.error is None and outcome.serial == renewed != first
    assert _presented_serial(context, out / "broker") == renewed


def test_a_stale_broker_pid_file_signals_no_other_process(tmp_path: Path) -> None:
    """A broker killed hard (or its host rebooted) leaves ``data/mosquitto.pid`` behind, and its pid may now be
    another process's: renew, enrol and revoke reload only a Mosquitto (SIGHUP would end most processes)."""
    from fedtier.broker_files import reload_brokers

    folder = tmp_path / "broker"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "mosquitto.pid").write_text(f"{os.getpid()}\n")  # this test's pid: not a Mosquitto
    got: list[int] = []
    previous = signal.signal(signal.SIGHUP, lambda sig, _: got.append(sig))
    try:
        [line] = reload_brokers([folder])
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert not got, "SIGHUP sent to a process that is not the broker"
    assert "is not running" in line and "stale" in line, line


_FAKE_BROKER = """
import os, signal, sys, time
folder = sys.argv[1]
def reread(*_):
    time.sleep(float(sys.argv[2]))  # a broker busy in its loop: it rereads its files some moments after the signal
    began = time.monotonic()  # (CLOCK_MONOTONIC: one clock for every process)
    for name in ("ca.crl", "acl"):
        with open(os.path.join(folder, name)) as f:
            f.read()
    with open(os.path.join(folder, "reread"), "w") as f:
        f.write(repr(began))
signal.signal(signal.SIGHUP, reread if float(sys.argv[2]) >= 0 else signal.SIG_IGN)
with open(os.path.join(folder, "data", "mosquitto.pid"), "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(0.05)
"""


@pytest.mark.parametrize("delay", [0.6, -1.0])
def test_a_reload_returns_once_the_broker_has_reread_its_revocation_list_and_acl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, delay: float
) -> None:
    """``provision revoke`` returned at the SIGHUP, and Mosquitto rereads its files moments later in its own loop:
    a revoked certificate logged in right after the command (4 of 15 tries on 2 loaded cores, and once in CI).
    :func:`reload_brokers` now returns once the broker has read ``ca.crl`` and ``acl`` again; a broker that does
    not within ``RELOAD_WAIT`` is said so, not said reloaded. (A stand-in broker: a process named mosquitto.)"""
    import time

    from fedtier import broker_files
    from protocols.procs import popen

    if sys.platform != "linux":
        pytest.skip("inotify: Linux")
    folder = tmp_path / "broker"
    (folder / "data").mkdir(parents=True)
    for name in ("ca.crl", "acl", "mosquitto.conf"):
        (folder / name).write_text(name)
    python = tmp_path / "mosquitto"  # what _is_mosquitto reads: its command line's first word
    python.symlink_to(sys.executable)
    (tmp_path / "fake.py").write_text(_FAKE_BROKER)
    proc = popen([str(python), str(tmp_path / "fake.py"), str(folder), str(delay)])
    try:
        # its pid in the file, not the file alone: the stand-in creates it, then writes it, and a reload reading it
        # between took the broker for one not running (seen 5 in 400 starts polled as here, at load 10)
        pid = folder / "data" / "mosquitto.pid"
        assert wait_until(lambda: pid.exists() and pid.read_text() == str(proc.pid) and proc.poll() is None, 30)
        wait = 3.0 if delay >= 0 else 1.0  # the one that ignores it is waited for the whole time: 1 s is enough
        monkeypatch.setattr(broker_files, "RELOAD_WAIT", wait)
        started = time.monotonic()
        [line] = broker_files.reload_brokers([folder])
        returned = time.monotonic()
    finally:
        proc.kill()
        proc.wait()
    if delay < 0:  # it ignores the signal
        assert "did not reread its files within 1 s" in line and returned - started >= wait, line
        return
    assert line == f"reloaded the broker in {folder} (pid {proc.pid})", line
    reread = float((folder / "reread").read_text())
    assert started + delay <= reread <= returned, "returned before the broker had reread its files"


def test_a_reload_watch_sees_its_files_read_even_when_replaced_after_it_began(tmp_path: Path) -> None:
    """The reload's watch (``fedtier.file_reads``) watched each file's inode: an ``acl`` or ``ca.crl`` replaced
    after it began (``pki.write_file`` renames a new file over it: another provisioning command at the same moment)
    was read by the broker as the new file, and the reload waited out its 10 s and said the broker 'did not reread
    its files'. It watches their folder too, by name; what else the broker reads there does not count, and a file
    read by its inode under another folder (bind-mounted alone into a broker's container; here a hard link) counts."""
    from fedtier.file_reads import watch_reads

    if sys.platform != "linux":
        pytest.skip("inotify: Linux")
    crl, acl, other = tmp_path / "ca.crl", tmp_path / "acl", tmp_path / "server.crt"
    for f in (crl, acl, other):
        f.write_text(f.name)
    with watch_reads([crl, acl]) as reread:
        (tmp_path / "acl.tmp").write_text("acl, rewritten")
        os.replace(tmp_path / "acl.tmp", acl)
        crl.read_text(), other.read_text()
        assert reread(0.05) is False  # the acl not read yet
        assert acl.read_text() == "acl, rewritten"
        assert reread(5.0) is True
    (tmp_path / "mounted").mkdir()
    for f in (crl, acl):
        os.link(f, tmp_path / "mounted" / f.name)
    with watch_reads([crl, acl]) as reread:
        for f in (crl, acl):
            (tmp_path / "mounted" / f.name).read_text()
        assert reread(5.0) is True
