"""The attacks of issues 13 and 31 against a signed ``fedtier run`` over Mosquitto, and the cost of signing.

1. Broker: ``fedtier provision`` writes the broker's TLS listener, certificate logins, ACL and revocation list;
   a Mosquitto with them refuses a device (with its own valid credentials) writing another device's result
   or reading another device's task, a device's or the monitor's login taking the cloud's session, and a
   renewed device's old certificate.
2. Nodes: a clean signed run (while an eavesdropper records genuine signed tasks), then the same run
   (same keys, same run name) under every attack of ``sim/attacker.py``. For each: what refused it,
   whether the refusal was logged with its reason, and whether the final model is the clean run's.
3. Signing: a signed ``fedtier sim`` against an unsigned one (bit-identical final model?), and per
   message the bytes a signature adds and the microseconds to sign and to verify it (median of
   repeats, on the run's model-sized messages).

4. A cell that lies under secure aggregation (``sim/lying_cell.py``, issue 27): key substitution and the
   dropout lie against signed devices over Mosquitto (refused? logged? the target's update recovered?), and
   the same attacks against the protocol as it was (unsigned keys; threshold 1/3), which recover it.

Usage: python benchmarks/attacks.py [--config examples/quickstart.toml] [--rounds 2] [--only-lying-cell]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@contextmanager
def captured_stderr(path: Path) -> Iterator[None]:
    """Send fd 2 (this process's and its worker processes' logs) to ``path`` meanwhile."""
    saved = os.dup(2)
    with open(path, "wb") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def broker_rows(cfg: Any, tmp: Path) -> list[tuple[str, str, bool, str]]:
    """(attack, refused by, refused?, note) for the two ACL attacks, on a provisioned Mosquitto."""
    import tomllib

    from fedtier.provisioning import provision
    from protocols.transport.broker import MosquittoBroker, free_port
    from protocols.transport.mqtt import MqttTransport
    from protocols.transport.threadloop import ThreadLoop
    from protocols.wire import topics

    port = free_port()
    done = provision(cfg, tmp / "prov", port=port)
    options = (done.broker / "listener.conf").read_text()
    got: list[str] = []
    arrived = threading.Event()
    run = cfg.run.name
    with MosquittoBroker(port=port, extra_config=options, allow_anonymous=False):
        loop = ThreadLoop("acl").start()

        def client(node: str) -> MqttTransport:
            d = done.bundles[node]
            b = tomllib.loads((d / "config.toml").read_text())["broker"]
            return MqttTransport(
                f"bench-{node}",
                loop,
                "127.0.0.1",
                port,
                username=node,
                password=b.get("password"),  # (none: the login is the certificate)
                ca_certs=str(d / "ca.crt"),
                certfile=str(d / "client.crt"),
                keyfile=str(d / "client.key"),
            )

        def on(topic: str, data: bytes) -> None:
            got.append(topic)
            if data == b"end":
                arrived.set()

        cell, dev = client("c0"), client("c0-d0")
        cell.subscribe(topics.device_results(run, "c0"), on)
        dev.subscribe(topics.device_task(run, "c0", "c0-d1"), on)
        dev.subscribe(topics.device_task(run, "c0", "c0-d0"), on)
        cell.connect(), dev.connect()
        cell.wait_subscribed(), dev.wait_subscribed()
        dev.publish(topics.device_result(run, "c0", "c0-d1"), b"forged")
        cell.publish(topics.device_task(run, "c0", "c0-d1"), b"secret task")
        cell.publish(topics.device_task(run, "c0", "c0-d0"), b"x")
        dev.publish(topics.device_result(run, "c0", "c0-d0"), b"end")
        arrived.wait(10)
        for t in (cell, dev):
            t.close()
        loop.stop()
    return [
        (
            "device writes another device's result topic",
            "broker (ACL)",
            topics.device_result(run, "c0", "c0-d1") not in got,
            "",
        ),
        (
            "device reads another device's task topic",
            "broker (ACL)",
            topics.device_task(run, "c0", "c0-d1") not in got,
            "",
        ),
    ]


def login_rows(cfg: Any, tmp: Path) -> list[tuple[str, str, bool, str]]:
    """(attack, refused by, refused?, note) for issue 31's broker attacks on a provisioned Mosquitto: a device's
    and the monitor's valid credentials under the cloud's client id (its session survives: a report queued
    while the cloud is away still reaches it), and a renewed device's old certificate (refused)."""
    import shutil
    import tomllib

    from fedtier.provisioning import provision
    from fedtier.renewal import renew
    from protocols.transport.broker import MosquittoBroker, free_port
    from protocols.transport.mqtt import MqttTransport
    from protocols.transport.threadloop import ThreadLoop
    from protocols.wire import topics

    port, run = free_port(), cfg.run.name
    done = provision(cfg, tmp / "login", port=port)
    options = (done.broker / "listener.conf").read_text()
    cloud_id, report = f"fedtier-{run}-cloud", topics.cell_report(run, "c0")
    password = tomllib.loads((done.bundles["cloud"] / "config.toml").read_text())["broker"].get("password")
    loop = ThreadLoop("login").start()

    def client(folder: Path, client_id: str, persistent: bool = False, user: str | None = None) -> MqttTransport:
        b = tomllib.loads((folder / "config.toml").read_text())["broker"]
        return MqttTransport(
            client_id,
            loop,
            "127.0.0.1",
            port,
            username=user or b["username"],
            password=password if user else b.get("password"),
            ca_certs=str(folder / "ca.crt"),
            certfile=str(folder / "client.crt"),
            keyfile=str(folder / "client.key"),
            persistent=persistent,
        )

    rows = []
    try:
        for intruder in ("c0-d0", "monitor"):
            got = threading.Event()
            with MosquittoBroker(port=port, extra_config=options, allow_anonymous=False):
                cloud = client(done.bundles["cloud"], cloud_id, persistent=True)
                cloud.subscribe(topics.cell_reports(run), lambda t, d: None)
                cloud.connect()
                cloud.wait_subscribed()
                cloud.close()  # away: its session keeps what comes
                cell = client(done.bundles["c0"], "bench-c0").connect()
                cell.publish(report, b"queued for the cloud")
                cell.flush()
                cell.close()
                client(done.bundles[intruder], cloud_id, user="cloud").connect().close()  # clean session, cloud's id
                back = client(done.bundles["cloud"], cloud_id, persistent=True)
                back.subscribe(topics.cell_reports(run), lambda t, d, got=got: got.set())
                back.connect()
                got.wait(10)
                back.close()
            rows.append((f"{intruder}'s login takes the cloud's session", "broker (login)", got.is_set(), ""))
        old = tmp / "old-c0-d0"
        shutil.copytree(done.bundles["c0-d0"], old)
        renew(done.out, ["c0-d0"])
        with MosquittoBroker(port=port, extra_config=options, allow_anonymous=False):
            try:
                client(old, "bench-old").connect().close()
                refused = False
            except ConnectionError:
                refused = True
            client(done.bundles["c0-d0"], "bench-new").connect().close()  # the renewed one logs in
        rows.append(("a renewed device's old certificate", "broker (CRL)", refused, ""))
    finally:
        loop.stop()
    return rows


def monitor_rows() -> list[tuple[str, str, bool, str]]:
    """(attack, refused by, refused?, note): a cell's record published on another cell's telemetry topic, at a
    ``fedtier monitor`` feed of an unsigned run (the signed run's monitor refuses it by its signature too)."""
    import json

    from monitor.sources import TelemetryFeed
    from protocols.transport.memory import MemoryHub, VirtualLoop
    from protocols.wire import topics

    hub, run = MemoryHub(VirtualLoop()), "t"
    feed = TelemetryFeed(hub.connect("monitor"), run).start()
    record = {
        "schema": 1,
        "event": "aggregation",
        "run": run,
        "round": 0,
        "edge_round": 0,
        "cell": "c1",
        "algorithm": "fedavg",
        "planned": ["c1-d0"],
        "answered": ["c1-d0"],
        "closed_by": "all answered",
        "duration_s": 0.1,
        "time": 0.0,
    }
    hub.connect("c0").publish(topics.telemetry_cell(run, "c0"), json.dumps(record).encode(), qos=0)
    hub.loop.run()
    records, bad, _ = feed.poll()
    refused = not records and len(bad) == 1 and "record of cell 'c1' on telemetry/cell/c0" in bad[0].error
    return [("a cell's record on another cell's telemetry topic", "monitor (topic)", refused, "")]


def node_rows(cfg_path: str, rounds: int, tmp: Path) -> tuple[list[tuple[str, str, bool, bool]], float]:
    from protocols.config import load_config
    from protocols.safe_text import log_to_stderr
    from protocols.transport.broker import MosquittoBroker
    from protocols.wire.keys import generate_keys, write_keys
    from sim.attacker import ATTACKS, Attacker
    from sim.emulation import Emulation

    keys = tmp / "keys.toml"

    def cfg_for(name: str) -> Any:
        return load_config(cfg_path, [f"run.rounds={rounds}", f'run.output="{tmp / name}"', f'security.keys="{keys}"'])

    clean_cfg = cfg_for("clean")
    ring = generate_keys(clean_cfg.topology)
    write_keys(keys, ring)
    with MosquittoBroker() as broker:
        spy = Attacker.capture(clean_cfg.run.name, broker.url, ring).start()
        try:
            clean = Emulation(clean_cfg, broker_url=broker.url).run()
        finally:
            spy.stop()
        attacker = Attacker(clean_cfg.run.name, broker.url, ring, captured=spy.captured).start()
        log_path = tmp / "attacked.log"
        try:
            with captured_stderr(log_path):
                log_to_stderr(logging.WARNING)
                t0 = time.perf_counter()
                attacked = Emulation(cfg_for("attacked"), broker_url=broker.url).run()
                wall = time.perf_counter() - t0
        finally:
            attacker.stop()
    logs = log_path.read_text(errors="replace")
    same = clean.params.keys() == attacked.params.keys() and all(
        np.array_equal(clean.params[k], attacked.params[k]) for k in clean.params
    )
    return [(a.name, a.refused_by, a.name in attacker.fired and a.log in logs, same) for a in ATTACKS], wall


def lying_cell_rows(cfg_path: str, tmp: Path) -> list[tuple[str, str, bool, bool]]:
    """(attack, refused by, refused and reason logged, target's update recovered) for a cell that lies under
    secure aggregation (``sim/lying_cell.py``): the two attacks against signed devices over Mosquitto (one
    round, one edge round), then the same attacks against what the protocol guarded before (unsigned keys;
    the threshold of one third), in ``fedtier sim``, where they recover the target's update exactly."""
    from protocols.config import load_config
    from protocols.safe_text import log_to_stderr
    from protocols.transport.broker import MosquittoBroker
    from sim.emulation import Emulation
    from sim.launcher import run_simulation
    from sim.lying_cell import LyingCell

    base = ["run.rounds=1", "algorithm.edge_rounds=1", "algorithm.local_steps=5", "privacy.secure_aggregation=true"]
    base += ["runtime.device_deadline=10.0", "topology.devices_per_cell=6"]
    rows = []
    for attack, name, log in (
        ("keys", "lying cell: its own keys for the target's neighbours", "substituted"),
        ("dropout", "lying cell: half told 'survived', half 'dropped'", "inconsistently"),
    ):
        keys = tmp / f"lie-{attack}.toml"
        cfg = load_config(cfg_path, [*base, f'run.output="{tmp / attack}"', f'security.keys="{keys}"'])
        liar = LyingCell(attack, "c0-d1")
        log_path = tmp / f"lie-{attack}.log"
        with captured_stderr(log_path), liar.install(), MosquittoBroker() as broker:
            log_to_stderr(logging.WARNING)
            Emulation(cfg, broker_url=broker.url).run()
        text = log_path.read_text(errors="replace")
        refused = liar.attempts > 0 and "cell c0 lied" in text and log in text
        rows.append((name, "signatures" if attack == "keys" else "consistency", refused, bool(liar.recovered)))
    for attack, name, extra in (
        ("keys", "  same, devices without identities (before)", []),
        ("dropout", "  same, threshold 1/3, views hidden (before)", ["privacy.secagg_threshold=0.34"]),
    ):
        cfg = load_config(cfg_path, [*base, *extra, f'run.output="{tmp / (attack + "-before")}"'])
        liar = LyingCell(attack, "c0-d1", hide=True)
        with liar.install():
            run_simulation(cfg, write_output=False)
        rows.append((name, "nothing", False, bool(liar.recovered)))
    return rows


def signing_figures(cfg_path: str, tmp: Path) -> dict[str, Any]:
    """Bit-identity of a signed sim, and per-message signing cost on the model-sized messages."""
    from protocols.config import load_config
    from protocols.transport.memory import MemoryHub, VirtualLoop
    from protocols.wire import topics
    from protocols.wire.keys import Trust, generate_keys
    from protocols.wire.messenger import Messenger
    from protocols.wire.payload import Payload
    from sim.launcher import run_simulation

    plain = run_simulation(load_config(cfg_path, ["run.rounds=1", f'run.output="{tmp / "plain"}"']))
    signed = run_simulation(
        load_config(
            cfg_path, ["run.rounds=1", f'run.output="{tmp / "signed"}"', f'security.keys="{tmp / "sim-keys.toml"}"']
        )
    )
    identical = all(np.array_equal(plain.params[k], signed.params[k]) for k in plain.params)
    cfg = plain.config
    ring = generate_keys(cfg.topology)
    device = Trust("c0-d0", ring.private["c0-d0"], ring.public)
    cell = Trust("c0", ring.private["c0"], ring.public)
    hub = MemoryHub(VirtualLoop())
    result = Payload({"weight": 100, "loss": 0.5}, {k: v.copy() for k, v in plain.params.items()})
    topic = topics.device_result(cfg.run.name, "c0", "c0-d0")
    out_plain = Messenger(hub.connect("a"), cfg.run.name, "c0-d0")
    out_signed = Messenger(hub.connect("b"), cfg.run.name, "c0-d0", trust=device)
    out_signed.session = "0123456789abcdef"
    recv = Messenger(hub.connect("c"), cfg.run.name, "c0", trust=cell)
    recv_plain = Messenger(hub.connect("d"), cfg.run.name, "c0")
    a = out_plain.frame("device_result", result, round=0, topic=topic)
    b = out_signed.frame("device_result", result, round=0, topic=topic)

    def median_us(fn: Any, n: int = 200) -> float:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6

    frames = [out_signed.frame("device_result", result, round=0, topic=topic) for _ in range(400)]
    frames_plain = [out_plain.frame("device_result", result, round=0, topic=topic) for _ in range(400)]
    it, it_plain = iter(frames), iter(frames_plain)
    sign_us = median_us(lambda: out_signed.frame("device_result", result, round=0, topic=topic)) - median_us(
        lambda: out_plain.frame("device_result", result, round=0, topic=topic)
    )
    verify_us = median_us(lambda: recv.receive(topic, next(it))) - median_us(
        lambda: recv_plain.receive(topic, next(it_plain))
    )
    from protocols.wire import chunking

    chunks = chunking.split(b, chunking.DEFAULT_MAX_CHUNK, topic=topic, auth=device)
    plain_chunks = chunking.split(b, chunking.DEFAULT_MAX_CHUNK, topic=topic)
    chunk_sign_us = median_us(
        lambda: chunking.split(b, chunking.DEFAULT_MAX_CHUNK, topic=topic, auth=device), 50
    ) - median_us(lambda: chunking.split(b, chunking.DEFAULT_MAX_CHUNK, topic=topic), 50)
    chunk_verify_us = median_us(
        lambda: [chunking.Reassembler(auth=cell).feed(topic, c) for c in chunks], 50
    ) - median_us(lambda: [chunking.Reassembler().feed(topic, c) for c in plain_chunks], 50)
    return {
        "identical": identical,
        "message_bytes": len(a),
        "extra_bytes": len(b) - len(a),
        "sign_us": sign_us,
        "verify_us": verify_us,
        "chunks": len(chunks),
        "chunk_sign_us": chunk_sign_us,
        "chunk_verify_us": chunk_verify_us,
    }


def print_lies(lies: list[tuple[str, str, bool, bool]]) -> None:
    head = "a cell that lies under secure aggregation (target c0-d1)"
    print(f"\n| {head:<56} | {'refused by':<12} | refused, reason logged | target's update recovered |")
    print(f"|{'-' * 58}|{'-' * 14}|------------------------|---------------------------|")
    for name, by, ok, recovered in lies:
        print(f"| {name:<56} | {by:<12} | {'yes' if ok else 'no':<22} | {'YES' if recovered else 'no':<25} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "examples" / "quickstart.toml"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only-lying-cell", action="store_true", help="only the lying-cell rows (section 4)")
    args = ap.parse_args()
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    from protocols.config import load_config

    if args.only_lying_cell:
        with tempfile.TemporaryDirectory(prefix="fedtier-attacks-") as d:
            print_lies(lying_cell_rows(args.config, Path(d)))
        return
    with tempfile.TemporaryDirectory(prefix="fedtier-attacks-") as d:
        tmp = Path(d)
        cfg = load_config(args.config)
        rows = broker_rows(cfg, tmp) + login_rows(cfg, tmp) + monitor_rows()
        nodes, wall = node_rows(args.config, args.rounds, tmp)
        lies = lying_cell_rows(args.config, tmp)
        cost = signing_figures(args.config, tmp)
    print(
        f"\nattacks on a signed fedtier run ({Path(args.config).name}, {args.rounds} rounds, Mosquitto; attacked "
        f"run {wall:.1f} s)\n"
    )
    print(f"| {'attack':<50} | {'refused by':<14} | refused, reason logged | model unchanged |")
    print(f"|{'-' * 52}|{'-' * 16}|------------------------|----------------|")
    for name, by, ok, _ in rows:
        print(f"| {name:<50} | {by:<14} | {'yes' if ok else 'NO':<22} | {'n/a':<14} |")
    for name, by, ok, same in nodes:
        print(f"| {name:<50} | {by:<14} | {'yes' if ok else 'NO':<22} | {'yes' if same else 'NO':<14} |")
    print_lies(lies)
    print(f"\nsigned fedtier sim bit-identical to unsigned: {'yes' if cost['identical'] else 'NO'}")
    print(
        f"signing overhead per message: +{cost['extra_bytes']} bytes on a {cost['message_bytes']}-byte model-sized "
        f"message (session id + Ed25519 signature in the header; +66 bytes + sender id per chunk), "
        f"sign {cost['sign_us']:.0f} us, verify {cost['verify_us']:.0f} us (median, this machine)"
    )
    print(
        f"over MQTT the same message is {cost['chunks']} signed chunks of 256 KiB: +{cost['chunk_sign_us']:.0f} us to "
        f"sign them, +{cost['chunk_verify_us']:.0f} us to verify them"
    )


if __name__ == "__main__":
    main()
