"""Nothing lost to a broker restart or a disconnected subscriber: persistent MQTT sessions, Mosquitto
persistence, publishers re-sending what the broker never acknowledged (issue #14)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from protocols import runfiles
from protocols.transport.broker import EmbeddedBroker, MosquittoBroker, free_port
from protocols.transport.hold import Hold, HoldLimits
from protocols.transport.mqtt import MqttTransport
from protocols.transport.reactor import Reactor
from protocols.transport.threadloop import ThreadLoop
from sim.emulation import Emulation, Faults
from sim.launcher import run_simulation
from tests.conftest import small_config, wait_until
from tests.test_mqtt_transport import BROKERS, WAIT, Inbox, make_broker, needs_mosquitto

FAST = dict(reconnect_min_delay=0.1, reconnect_max_delay=0.5)


@pytest.fixture
def loop() -> Iterator[ThreadLoop]:
    lp = ThreadLoop().start()
    yield lp
    lp.stop()


def client(broker: EmbeddedBroker | MosquittoBroker, cid: str, loop: ThreadLoop, **kw) -> MqttTransport:
    return MqttTransport.from_url(broker.url, cid, loop, max_chunk=4096, **{**FAST, **kw})


@pytest.mark.parametrize("kind", BROKERS)
def test_persistent_session_receives_what_was_queued_while_away(kind: str, loop) -> None:
    """A subscriber that left (cleanly or not) and comes back under the same client id gets the QoS-1
    messages published meanwhile, a chunked one included, each once; a clean-session one does not."""
    with make_broker(kind) as b:
        for name, persistent in (("keep", True), ("clean", False)):
            inbox = Inbox(loop)
            sub = client(b, f"p-{name}", loop, persistent=persistent)
            sub.subscribe(f"q/{name}/+", inbox)
            sub.connect(WAIT)
            assert sub.wait_subscribed(WAIT)
            sub.close()
            pub = client(b, f"pub-{name}", loop).connect(WAIT)
            big = os.urandom(30_000)  # 8 chunks
            pub.publish(f"q/{name}/1", b"small")
            pub.publish(f"q/{name}/2", big)
            assert pub.flush(WAIT)
            pub.close()
            back = client(b, f"p-{name}", loop, persistent=persistent)
            back.subscribe(f"q/{name}/+", inbox)
            back.connect(WAIT)
            if persistent:
                got = inbox.wait_n(2)
                assert sorted(got) == [(f"q/{name}/1", b"small"), (f"q/{name}/2", big)]
            assert back.wait_subscribed(WAIT)
            time.sleep(0.2)  # nothing more may trickle in (a repeat, or the clean session's loss)
            assert len(inbox.items) == (2 if persistent else 0)
            back.close()


@pytest.mark.parametrize("kind", BROKERS)
def test_queued_messages_reach_a_handler_subscribed_after_the_reconnect(kind: str, loop) -> None:
    """A node restarted under its client id connects first and subscribes its handlers later (a cell
    builds its model in between): what the broker queued for it while it was down arrives right after
    the CONNACK, is held, and goes to the handler subscribed later, each message once and in order."""
    with make_broker(kind) as b:
        inbox = Inbox(loop)
        first = client(b, "restarted", loop, persistent=True)
        first.subscribe("r/+/result", inbox)
        first.connect(WAIT)
        assert first.wait_subscribed(WAIT)
        first.crash()  # kill -9: no DISCONNECT
        pub = client(b, "devices", loop).connect(WAIT)
        big = os.urandom(20_000)  # chunked
        sent = [("r/d0/result", b"one"), ("r/d1/result", big), ("r/d2/result", b"three")]
        for topic, data in sent:
            pub.publish(topic, data)
        assert pub.flush(WAIT)
        back = client(b, "restarted", loop, persistent=True).connect(WAIT)
        assert wait_until(lambda: back.held[0] == 3, WAIT), back.held  # delivered before any handler
        assert back.held[1] == sum(len(d) for _, d in sent)
        back.subscribe("r/+/status", Inbox(loop))  # another pattern takes none of them
        assert back.held[0] == 3
        back.subscribe("r/+/result", inbox)
        assert inbox.wait_n(3) == sent and back.held == (0, 0)
        assert back.wait_subscribed(WAIT)
        pub.publish("r/d3/result", b"live")  # and the subscription works as usual
        assert inbox.wait_n(4)[3] == ("r/d3/result", b"live")
        for t in (pub, back):
            t.close()


def test_the_hold_is_bounded_in_messages_bytes_and_time(caplog) -> None:
    """Hostile or stale deliveries cannot grow the hold: beyond its message count or byte budget a
    message is dropped, after ``seconds`` unclaimed ones expire; each drop is logged."""
    now = [0.0]
    hold = Hold("cell.c0", HoldLimits(messages=3, bytes=100, seconds=10.0), clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="protocols.transport.hold"):
        assert hold.offer("a/1", b"x" * 40) and hold.offer("b/1", b"y" * 40)
        assert not hold.offer("a/2", b"z" * 30)  # 110 bytes > 100
        assert hold.offer("a/3", b"z" * 20)
        assert not hold.offer("a/4", b"")  # 3 messages already
        assert (len(hold), hold.nbytes, hold.dropped) == (3, 100, 2)
        assert "the hold is full" in caplog.text
        assert hold.take("a/+") == [("a/1", b"x" * 40), ("a/3", b"z" * 20)]
        assert (len(hold), hold.nbytes) == (1, 40)
        now[0] = 5.0
        assert hold.offer("c/1", b"w")
        now[0] = 10.5  # b/1 is older than 10 s, c/1 is not
        assert hold.take("#") == [("c/1", b"w")]
        assert (len(hold), hold.nbytes, hold.dropped) == (0, 0, 3)
        assert "found no handler within 10 s" in caplog.text


@needs_mosquitto
@pytest.mark.parametrize("io", ["thread", "reactor"])
def test_broker_sigkill_and_restart_loses_nothing(io: str, loop, tmp_path) -> None:
    """Mosquitto with persistence killed with SIGKILL mid-stream: what it queued for a disconnected
    subscriber survives (from its last save), and what publishers sent while it was down (or never saw
    acknowledged) is re-sent after their reconnect and reaches the persistent subscriber once."""
    b = MosquittoBroker(free_port(), persistence=tmp_path / "db").start()
    reactor = Reactor().start() if io == "reactor" else None
    kw = dict(persistent=True, reactor=reactor) if reactor else dict(persistent=True)
    try:
        away, live, inbox_away, inbox_live = None, None, Inbox(loop), Inbox(loop)
        away = client(b, "away", loop, **kw)
        away.subscribe("k/+", inbox_away)
        away.connect(WAIT)
        assert away.wait_subscribed(WAIT)
        away.close()
        live = client(b, "live", loop, **kw)
        live.subscribe("k/+", inbox_live)
        live.connect(WAIT)
        assert live.wait_subscribed(WAIT)
        pub = client(b, "pub", loop, **kw).connect(WAIT)
        big = os.urandom(20_000)
        pub.publish("k/before", big)
        assert pub.flush(WAIT) and inbox_live.wait_n(1)
        assert b.save()  # the broker's periodic save (every AUTOSAVE_INTERVAL s) happened after that
        b.kill()
        assert wait_until(lambda: not pub.connected and not live.connected)
        for i in range(5):  # published while the broker is down: queued by the client
            pub.publish(f"k/down{i}", bytes([i]) * 5000)
        b.start()
        assert pub.flush(WAIT), "publishes made while the broker was down were never acknowledged"
        want = {"k/before": big, **{f"k/down{i}": bytes([i]) * 5000 for i in range(5)}}
        live_got = dict(inbox_live.wait_n(6))
        assert live_got == want
        back = client(b, "away", loop, **kw)
        back.subscribe("k/+", inbox_away)
        back.connect(WAIT)
        assert dict(inbox_away.wait_n(6)) == want
        time.sleep(0.2)
        assert len(inbox_live.items) == 6 and len(inbox_away.items) == 6  # each once
        for t in (pub, live, back):
            t.close()
    finally:
        b.stop()
        if reactor is not None:
            reactor.close()


def test_mosquitto_config_persistence(tmp_path) -> None:
    b = MosquittoBroker(persistence=tmp_path / "db", autosave_interval=7)
    conf = b._persistence_config()
    assert "persistence true" in conf and f"persistence_location {tmp_path / 'db'}/" in conf
    assert "autosave_interval 7" in conf
    assert MosquittoBroker()._persistence_config() == "persistence false\n"
    # by default a save a minute, on time (not on changes: a full rewrite per queued or acknowledged message)
    default = MosquittoBroker(persistence=tmp_path / "db")._persistence_config().splitlines()
    assert "autosave_interval 60" in default and not any("autosave_on_changes" in line for line in default)


@needs_mosquitto
def test_broker_sigkill_mid_round_loses_no_result(tmp_path: Path) -> None:
    """``fedtier run``'s Mosquitto is killed with SIGKILL in round 1 while c0-d0 is training (every
    other device of its cell has answered, so the kill point is fixed), started again on the same port,
    and only then does c0-d0 finish and publish: every edge round still closes with all devices and the
    final model equals the uninterrupted (simulated) run's, byte for byte."""
    cfg = small_config(tmp_path / "emu", run={"rounds": 2}, runtime={"device_deadline": 60.0})
    go = tmp_path / "go"
    emu = Emulation(cfg, faults=Faults(hold={"c0-d0": (1, 0, str(go))}))
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = emu.run()
        except BaseException as exc:  # reported below
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="emulation")
    thread.start()
    try:
        reference = run_simulation(small_config(tmp_path / "sim", run={"rounds": 2}))  # while its agents start
        assert wait_until(lambda: Path(f"{go}.held").exists() or not thread.is_alive(), 120)
        assert wait_until(lambda: len(emu.cells["c0"].answers.received) == 2 or not thread.is_alive(), 30)
        broker = emu.started_brokers["shared"]
        assert broker.save()  # its periodic save (every AUTOSAVE_INTERVAL s) has happened
        broker.kill()
        broker.start()
    finally:
        go.touch()
        thread.join(180)
    assert not thread.is_alive() and "error" not in outcome, outcome.get("error")
    result = outcome["result"]
    assert [r["closed_by"] for r in result.history] == ["all reported"] * 2
    for record in result.cell_records:
        assert record["closed_by"] == "all answered" and not record["absent"], record
    assert (result.output_dir / runfiles.FINAL_MODEL).read_bytes() == (
        reference.output_dir / runfiles.FINAL_MODEL
    ).read_bytes()
