"""MqttTransport over a real broker (embedded amqtt and Mosquitto), ThreadLoop, broker helpers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import paho.mqtt.client as mqtt
import pytest

from protocols.transport import paho_client
from protocols.transport.base import Will
from protocols.transport.broker import EmbeddedBroker, MosquittoBroker, find_mosquitto, free_port, parse_broker_url
from protocols.transport.connecting import failure_kind
from protocols.transport.mqtt import MqttTransport
from protocols.transport.reactor import Reactor
from protocols.transport.subscriptions import pattern_covers
from protocols.transport.threadloop import ThreadLoop
from protocols.transport.traffic import publish_packet_bytes
from protocols.wire import chunking
from tests.conftest import wait_until

HAVE_MOSQUITTO = find_mosquitto() is not None
needs_mosquitto = pytest.mark.skipif(not HAVE_MOSQUITTO, reason="mosquitto binary not installed (/usr/sbin/mosquitto)")
BROKERS = ["amqtt", pytest.param("mosquitto", marks=needs_mosquitto)]
WAIT = 10.0


def make_broker(kind: str, port: int | None = None) -> EmbeddedBroker | MosquittoBroker:
    return EmbeddedBroker(port) if kind == "amqtt" else MosquittoBroker(port)


@pytest.fixture(scope="module", params=BROKERS)
def broker(request: pytest.FixtureRequest) -> Iterator[EmbeddedBroker | MosquittoBroker]:
    with make_broker(request.param) as b:
        yield b


@pytest.fixture
def loop() -> Iterator[ThreadLoop]:
    lp = ThreadLoop().start()
    yield lp
    lp.stop()


@pytest.fixture
def prefix() -> str:
    return f"t/{uuid.uuid4().hex[:8]}"


class Inbox:
    """Collects (topic, payload) from handlers and lets a test wait for a condition."""

    def __init__(self, loop: ThreadLoop) -> None:
        self.loop, self.items, self.cv = loop, [], threading.Condition()
        self.threads: set[str] = set()

    def __call__(self, topic: str, payload: bytes) -> None:
        self.threads.add(threading.current_thread().name)
        with self.cv:
            self.items.append((topic, bytes(payload)))
            self.cv.notify_all()

    def wait(self, pred: Callable[[list], bool], timeout: float = WAIT) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: pred(self.items), timeout)

    def wait_n(self, n: int, timeout: float = WAIT) -> list:
        assert self.wait(lambda items: len(items) >= n, timeout), f"got {len(self.items)} of {n}: {self.items!r:.300}"
        return list(self.items)


def connect(broker, cid: str, loop: ThreadLoop, **kw) -> MqttTransport:
    return MqttTransport.from_url(broker.url, cid, loop, **kw).connect(WAIT)


@pytest.fixture
def clients(broker, loop) -> Iterator[Callable[..., MqttTransport]]:
    made: list[MqttTransport] = []

    def make(cid: str | None = None, **kw) -> MqttTransport:
        t = connect(broker, cid or f"c-{uuid.uuid4().hex[:8]}", loop, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close(flush_timeout=1.0)


# -- pub/sub -----------------------------------------------------------------------------------


def test_pubsub_with_wildcards(clients, loop, prefix) -> None:
    pub, sub = clients(), clients()
    plus, hash_, exact = Inbox(loop), Inbox(loop), Inbox(loop)
    sub.subscribe(f"{prefix}/cell/+/up", plus)
    sub.subscribe(f"{prefix}/#", hash_)
    sub.subscribe(f"{prefix}/cell/c1/down", exact)
    assert sub.wait_subscribed(WAIT)
    pub.publish(f"{prefix}/cell/c1/up", b"u1")
    pub.publish(f"{prefix}/cell/c2/up", b"u2")
    pub.publish(f"{prefix}/cell/c1/down", b"d1")
    pub.publish(f"{prefix}/cell/c1/up/extra", b"deep")
    assert sorted(p for _, p in hash_.wait_n(4)) == [b"d1", b"deep", b"u1", b"u2"]
    assert sorted(p for _, p in plus.wait_n(2)) == [b"u1", b"u2"]
    assert exact.wait_n(1) == [(f"{prefix}/cell/c1/down", b"d1")]
    assert pub.flush(WAIT)
    time.sleep(0.1)  # nothing else may trickle in
    assert len(plus.items) == 2 and len(exact.items) == 1
    assert plus.threads == {loop.name}  # handlers run on the loop, never on paho's thread
    assert sub.stats.packets_in == 4  # overlapping filters do not double the traffic
    s = pub.stats.snapshot()
    assert s["messages_out"] == 4 and s["packets_out"] == 4 and s["acked"] == 4
    assert s["payload_bytes_out"] == 10
    sent = {"cell/c1/up": 2, "cell/c2/up": 2, "cell/c1/down": 2, "cell/c1/up/extra": 4}
    assert s["bytes_out"] == sum(publish_packet_bytes(len(f"{prefix}/{t}"), n) for t, n in sent.items())
    assert s["by_topic"][f"{prefix}/cell/c1/down"][0] == publish_packet_bytes(len(f"{prefix}/cell/c1/down"), 2)


def test_clients_disable_nagle_and_ping_pong(clients, loop, prefix) -> None:
    """Nagle's algorithm (paho leaves it on) made each small round trip ~90 ms: both clients' sockets must have
    TCP_NODELAY set (checked on the socket, not by timing, which flakes on a loaded machine), and
    request/answer round trips complete in order."""
    import socket

    a, b = clients(), clients()
    pongs = Inbox(loop)
    b.subscribe(f"{prefix}/ping", lambda t, p: b.publish(f"{prefix}/pong", p))
    a.subscribe(f"{prefix}/pong", pongs)
    assert a.wait_subscribed(WAIT) and b.wait_subscribed(WAIT)
    for c in (a, b):
        assert c._client.socket().getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    for i in range(15):
        a.publish(f"{prefix}/ping", b"%02d" % i)
        assert pongs.wait_n(i + 1)[-1] == (f"{prefix}/pong", b"%02d" % i)


def test_unsubscribe_stops_delivery(clients, loop, prefix) -> None:
    pub, sub = clients(), clients()
    a, b = Inbox(loop), Inbox(loop)
    sub.subscribe(f"{prefix}/a", a)
    sub.subscribe(f"{prefix}/b", b)
    assert sub.wait_subscribed(WAIT)
    sub.unsubscribe(f"{prefix}/a")
    pub.publish(f"{prefix}/a", b"1")
    pub.publish(f"{prefix}/b", b"2")
    b.wait_n(1)
    assert a.items == []


def test_unsubscribing_the_wide_filter_keeps_the_narrow_one(clients, loop, prefix) -> None:
    pub, sub = clients(), clients()
    wide, narrow = Inbox(loop), Inbox(loop)
    sub.subscribe(f"{prefix}/#", wide)
    sub.subscribe(f"{prefix}/a", narrow)
    assert sub.wait_subscribed(WAIT)
    sub.unsubscribe(f"{prefix}/#")
    assert sub.wait_subscribed(WAIT)
    pub.publish(f"{prefix}/b", b"b")
    pub.publish(f"{prefix}/a", b"a")
    assert narrow.wait_n(1) == [(f"{prefix}/a", b"a")]
    assert wide.items == []


def test_pattern_covers() -> None:
    assert pattern_covers("a/#", "a/b/c") and pattern_covers("a/#", "a") and pattern_covers("#", "a/+/#")
    assert pattern_covers("a/+/c", "a/b/c") and pattern_covers("a/+", "a/+")
    assert not pattern_covers("a/+", "a/#") and not pattern_covers("a/b", "a/+")
    assert not pattern_covers("a/+/c", "a/b") and not pattern_covers("a/+/#", "a")


def test_retained_message_reaches_late_subscriber(clients, loop, prefix) -> None:
    pub = clients()
    pub.publish(f"{prefix}/status/n1", b"online", retain=True)
    assert pub.flush(WAIT)
    late, inbox = clients(), Inbox(loop)
    late.subscribe(f"{prefix}/status/+", inbox)
    assert inbox.wait_n(1) == [(f"{prefix}/status/n1", b"online")]
    pub.publish(f"{prefix}/status/n1", b"", retain=True)  # clear it for later tests
    with pytest.raises(ValueError, match="one chunk"):
        pub.publish(f"{prefix}/big", b"x" * (pub.max_chunk + 1), retain=True)


def test_will_on_crash_not_on_close(clients, loop, prefix, broker) -> None:
    watcher, inbox = clients(), Inbox(loop)
    watcher.subscribe(f"{prefix}/status/+", inbox)
    assert watcher.wait_subscribed(WAIT)
    polite = connect(broker, "polite", loop, will=Will(f"{prefix}/status/polite", b"offline", retain=False))
    rude = connect(broker, "rude", loop, will=Will(f"{prefix}/status/rude", b"offline", retain=False))
    polite.publish(f"{prefix}/status/polite", b"bye")
    polite.close()
    rude.crash()
    assert rude.connected is False
    inbox.wait(lambda items: (f"{prefix}/status/rude", b"offline") in items)
    time.sleep(0.2)  # a will of the polite node would have arrived by now
    assert (f"{prefix}/status/polite", b"offline") not in inbox.items
    assert (f"{prefix}/status/polite", b"bye") in inbox.items


def _said_after_close(broker, loop: ThreadLoop, node: MqttTransport, status: str, inbox: Inbox) -> list[bytes]:
    """What ``status`` said up to the will of ``node``'s next connection (same client id, will), made once ``node``
    closed, which says its record and dies: a will of the closed one comes before that record (said as the broker
    dropped it, or as the next one took it over); the dead one's will comes (a killed node still reads offline)."""
    nxt = connect(broker, node.client_id, loop, will=node.will, persistent=node.persistent)
    nxt.publish(status, b"next", retain=True)
    assert inbox.wait(lambda items: (status, b"next") in items), inbox.items
    nxt.crash()
    assert inbox.wait(lambda items: items[-1:] == [(status, b"offline")]), inbox.items
    return [payload for _, payload in inbox.items]


@needs_mosquitto
def test_a_clean_close_says_no_will_however_late_the_broker_reads_its_disconnect(loop, prefix) -> None:
    """A long-lived cloud's job server drops the job's subscriptions as it closes its connection (so its own status
    topic gets a subscription of its own, whose retained record the broker sends with its SUBACK). Closed at once after
    its DISCONNECT, the socket made the broker's answers fail to be written (Mosquitto reads one packet a connection per
    turn: "Client ... disconnected: Broken pipe."), the broker dropped the connection as lost with the DISCONNECT
    unread and said the will: the live cloud read offline between jobs (6 of 20 jobs in a row). The broker is paused
    here while the client subscribes and closes, so that it reads all of it after the close, every time: no will now
    (the socket waits for the broker's end); before, the will every time."""
    with MosquittoBroker() as broker:
        pub, watcher, inbox = connect(broker, "pub", loop), connect(broker, "watcher", loop), Inbox(loop)
        status = f"{prefix}/status/node"
        for i in range(3):  # each subscription below is answered by a SUBACK and this retained record
            pub.publish(f"{prefix}/kept/{i}", b"kept", retain=True)
        watcher.subscribe(status, inbox)
        assert pub.flush(WAIT) and watcher.wait_subscribed(WAIT)
        node = connect(broker, "node", loop, will=Will(status, b"offline", retain=True), persistent=True)
        node.publish(status, b"idle", retain=True)
        assert node.flush(WAIT)
        assert broker.pid is not None
        os.kill(broker.pid, signal.SIGSTOP)
        try:
            for i in range(3):
                node.subscribe(f"{prefix}/kept/{i}", lambda t, d: None)
            closing = threading.Thread(target=node.close, name="closing")
            closing.start()
            assert wait_until(lambda: node._client._sock is None, WAIT)  # DISCONNECT written, the socket let go
        finally:
            os.kill(broker.pid, signal.SIGCONT)
        closing.join(WAIT)
        assert _said_after_close(broker, loop, node, status, inbox) == [b"idle", b"next", b"offline"]
        pub.close()
        watcher.close()


def test_the_embedded_broker_delivers_what_a_client_sent_just_before_its_disconnect(loop, prefix) -> None:
    """amqtt 0.12.1's session loop broadcasts one message a turn and stopped at a DISCONNECT: what the client sent just
    before it was dropped, though acknowledged, whenever that loop was busy (e.g. awaiting the PUBACKs of the retained
    records it sends after a SUBACK). A device leaving its round said online, offline, then disconnected: its cell got
    online only and the broker kept online (tests/test_decomfl.py's onnx emulation under load: the cell sent that
    device its next task at once, to no connection). Forced here: the session loop is held 0.3 s on the device's
    SUBSCRIBE while its online, offline and DISCONNECT arrive in one write; both are delivered, offline is retained.
    (A later client may get that record twice: amqtt sends it after the CONNACK, the watcher's filter matching it, and
    again after the SUBACK; the first reaches the handler when it is subscribed before the record comes: see
    EmbeddedBroker.)"""
    with EmbeddedBroker() as broker:
        status, inbox = f"{prefix}/status/device", Inbox(loop)
        watcher = connect(broker, "watcher", loop)
        watcher.subscribe(status, inbox)
        assert watcher.wait_subscribed(WAIT)
        amqtt, handle = broker._broker, broker._broker._handle_subscription

        async def busy(*args: object) -> None:  # the loop awaits something (a PUBACK, say) before its next turn
            await asyncio.sleep(0.3)
            await handle(*args)

        amqtt._handle_subscription = busy
        with socket.create_connection(("127.0.0.1", broker.port), timeout=WAIT) as device:
            device.sendall(_packet(0x10, _text("MQTT") + bytes([4, 2, 0, 60]) + _text("device")))  # CONNECT (clean)
            assert device.recv(4)[:1] == b"\x20"  # CONNACK
            said = [_packet(0x33, _text(status) + bytes([0, i + 2]) + s) for i, s in enumerate((b"online", b"offline"))]
            subscribe = _packet(0x82, b"\0\1" + _text(f"{prefix}/task") + b"\1")
            device.sendall(subscribe + b"".join(said) + b"\xe0\0")  # then PUBLISH (QoS 1, retained) x2, DISCONNECT
            assert inbox.wait(lambda items: len(items) >= 2), inbox.items
        assert [p for _, p in inbox.items] == [b"online", b"offline"]
        amqtt._handle_subscription = handle
        later = connect(broker, "later", loop)
        kept = Inbox(loop)
        later.subscribe(status, kept)
        assert later.wait_subscribed(WAIT)
        assert {p for _, p in kept.wait_n(1)} == {b"offline"}, kept.items
        later.close()
        watcher.close()


def test_the_embedded_broker_keeps_a_subscription_for_the_current_connection_of_a_client_id(loop, prefix) -> None:
    """amqtt 0.12.1 left a connection that a clean CONNECT of its client id replaced running, and held one subscription
    per client id: the replaced connection's late SUBSCRIBE (its session loop behind, as under load) held the filter in
    its successor's place, and once it was disconnected what was published there went to no one (a device's first
    connection, closed before its SUBACK to sit a round out, against its rejoin's: its tasks lost). Forced here: the
    old connection subscribes after the new one connected, then the new one; a task published after the old one left
    reaches the new one."""
    with EmbeddedBroker() as broker:
        task, cloud = f"{prefix}/task", connect(broker, "cloud", loop)

        def client() -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", broker.port), timeout=WAIT)
            sock.sendall(_packet(0x10, _text("MQTT") + bytes([4, 2, 0, 60]) + _text("device")))  # CONNECT (clean)
            assert sock.recv(4)[:1] == b"\x20"  # CONNACK
            return sock

        subscribe = _packet(0x82, b"\0\1" + _text(task) + b"\1")
        with client() as old, client() as new:
            old.sendall(subscribe)
            assert old.recv(5)[:1] == b"\x90"  # its SUBACK (refused now: 0x80)
            new.sendall(subscribe)
            assert new.recv(5) == b"\x90\x03\0\1\1"  # its SUBACK: QoS 1
            old.sendall(b"\xe0\0")  # DISCONNECT
            assert old.recv(16) == b""  # the broker closed it
            cloud.publish(task, b"the task", qos=1)
            new.settimeout(2.0)
            try:
                got = new.recv(64)
            except TimeoutError:
                got = b""
        cloud.close()
        assert b"the task" in got, "the task reached no one"


def _text(s: str) -> bytes:
    """An MQTT string: its length (2 bytes) and its UTF-8 bytes."""
    return len(s.encode()).to_bytes(2, "big") + s.encode()


def _packet(kind: int, body: bytes) -> bytes:
    """An MQTT packet of fewer than 128 bytes after its fixed header: first byte ``kind``, then its length."""
    assert len(body) < 128
    return bytes([kind, len(body)]) + body


@needs_mosquitto
def test_closing_many_connections_to_a_broker_that_stopped_answering_costs_one_wait_not_one_each(
    loop, prefix, monkeypatch
) -> None:
    """An agent worker stopping its devices (each says offline at QoS 1, then closes) against a broker that stopped
    answering (SIGSTOPped here): each close waited for its PUBACK (the flush) and for the broker's end of the socket
    (``LINGER_WAIT``), 2 s each bare and 7 after a publish (20 devices: 40 s, 140 s; 500: minutes). Once one such
    wait timed out the others do not wait for that broker: 20 closes take about one wait. What they did not wait for
    still happens: resumed, the broker reads each DISCONNECT and says no will."""
    monkeypatch.setattr(paho_client, "LINGER_WAIT", 1.0)  # (the same for any value: 2 s in production)
    reactor = Reactor().start()
    with MosquittoBroker() as b, contextlib.ExitStack() as stack:
        stack.callback(reactor.close)
        watcher, inbox = connect(b, "watcher", loop), Inbox(loop)
        watcher.subscribe(f"{prefix}/status/#", inbox)
        assert watcher.wait_subscribed(WAIT)
        wills = {i: Will(f"{prefix}/status/d{i}", b"will", retain=True) for i in range(20)}
        devices = [connect(b, f"d{i}", loop, will=wills[i], reactor=reactor) for i in range(20)]
        assert b.pid is not None
        os.kill(b.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            for i, device in enumerate(devices):
                if i % 2 == 0:  # (half of them with a publish the broker does not acknowledge)
                    device.publish(wills[i].topic, b"offline", retain=True)
                device.close(flush_timeout=paho_client.LINGER_WAIT)
            took = time.monotonic() - started
        finally:
            os.kill(b.pid, signal.SIGCONT)
        assert took < 3 * paho_client.LINGER_WAIT, f"20 closes took {took:.1f} s"
        assert all(d._client.lingered.wait(WAIT) for d in devices), b.log_text()  # the broker closed each socket
        watcher.publish(f"{prefix}/status/end", b"end")  # after any will the broker said
        assert inbox.wait(lambda items: (f"{prefix}/status/end", b"end") in items), inbox.items
        offline = [(wills[i].topic, b"offline") for i in range(0, 20, 2)]
        assert sorted(inbox.items) == sorted([*offline, (f"{prefix}/status/end", b"end")]), b.log_text()
        watcher.close()


def test_a_broker_marked_silent_is_waited_for_again_once_any_of_its_packets_comes(
    broker, loop, prefix, monkeypatch
) -> None:
    """A close-time wait that timed out marks its broker silent: the process's next closes to it do not wait (the test
    above). The mark went only at a CONNACK, a PINGRESP or a lingering socket's close, not at the PUBACKs and messages
    that a live connection reads all the time, so a broker that was only slow stayed unwaited for until a keepalive or
    a new connection: closes meanwhile returned before the broker read their DISCONNECT (a same-id connection opened
    next could take the old one over, and the broker say its will). Any packet the broker sends now clears it."""
    monkeypatch.setattr(paho_client, "_silent", set())  # this test's marks only
    pub, sub, inbox = connect(broker, "pub", loop), connect(broker, "sub", loop), Inbox(loop)
    sub.subscribe(f"{prefix}/x", inbox)
    assert sub.wait_subscribed(WAIT)
    key = (pub._client._host, pub._client._port)
    paho_client._silent.add(key)  # as a close's timed-out wait does
    pub.publish(f"{prefix}/x", b"1")
    assert pub.flush(WAIT)  # its PUBACK
    assert key not in paho_client._silent
    paho_client._silent.add(key)
    other = connect(broker, "other", loop)  # (its CONNACK: an answer too)
    assert key not in paho_client._silent
    paho_client._silent.add(key)
    other.publish(f"{prefix}/x", b"2", qos=0)  # nothing comes back to it: only sub reads the broker's PUBLISH
    inbox.wait_n(2)
    assert key not in paho_client._silent
    for t in (pub, sub, other):
        t.close()


def test_no_will_from_a_close_right_after_subscriptions_change_on_amqtt(loop, prefix) -> None:
    """The same on amqtt, which answers a SUBSCRIBE and an UNSUBSCRIBE from a task of its own (after a PINGREQ's
    answer, say): the will came in 14 of 20 of a long-lived cloud's jobs; here, before, in about half of the tries."""
    with EmbeddedBroker() as broker:
        pub, watcher = connect(broker, "pub", loop), connect(broker, "watcher", loop)
        for i in range(10):
            pub.publish(f"{prefix}/kept/{i}", b"kept", retain=True)
        assert pub.flush(WAIT)
        for attempt in range(6):
            status, inbox = f"{prefix}/status/node{attempt}", Inbox(loop)
            watcher.subscribe(status, inbox)
            assert watcher.wait_subscribed(WAIT)
            node = connect(broker, f"node{attempt}", loop, will=Will(status, b"offline", retain=True), persistent=True)
            node.publish(status, b"idle", retain=True)
            for i in range(10):  # (QoS 0: amqtt waits 5 s for the closed client's PUBACK of a QoS-1 delivery)
                node.subscribe(f"{prefix}/kept/{i}", lambda t, d: None, qos=0)
            node.unsubscribe(f"{prefix}/kept/0")
            node.close()
            assert _said_after_close(broker, loop, node, status, inbox) == [b"idle", b"next", b"offline"], attempt
        pub.close()
        watcher.close()


def test_large_payload_chunked_and_delivered_once(clients, loop, prefix) -> None:
    pub = clients(max_chunk=64 * 1024)
    sub, inbox = clients(max_chunk=64 * 1024), Inbox(loop)
    sub.subscribe(f"{prefix}/big/#", inbox)
    assert sub.wait_subscribed(WAIT)
    data = os.urandom(3 * 512 * 1024)  # 1.5 MiB
    pub.publish(f"{prefix}/big/model", data)
    pub.publish(f"{prefix}/big/after", b"small")
    got = inbox.wait_n(2)
    assert got[0] == (f"{prefix}/big/model", data)  # whole, and before what was published after it
    assert got[1] == (f"{prefix}/big/after", b"small")
    n = -(-len(data) // (64 * 1024 - chunking.HEADER_BYTES))
    assert pub.flush(WAIT)
    assert pub.stats.packets_out == n + 1 and pub.stats.messages_out == 2
    assert sub.stats.messages_in == 2 and sub.stats.packets_in == n + 1
    assert sub.stats.bytes_in == pub.stats.bytes_out > len(data) + n * chunking.HEADER_BYTES
    assert sub.reassembly_bytes == 0
    time.sleep(0.1)
    assert len(inbox.items) == 2


def test_a_task_framed_as_segments_goes_out_chunked_as_its_joined_bytes(clients, loop, prefix, monkeypatch) -> None:
    """A signed 1.2 MB task as segments (the in-memory transport's form) published on MQTT: joined once, chunked,
    and delivered as exactly the bytes ``Messenger.frame`` makes; the device's messenger accepts its signature. A
    messenger on MQTT frames its messages joined (MQTT does not take segments)."""
    import numpy as np

    from protocols.wire import messenger as messenger_module
    from protocols.wire.keys import Trust, new_seed, public_of
    from protocols.wire.messenger import Messenger
    from protocols.wire.payload import Payload

    seeds = {"c0": new_seed(), "c0-d0": new_seed()}
    public = {n: public_of(s) for n, s in seeds.items()}
    pub, sub, inbox = clients(max_chunk=64 * 1024), clients(max_chunk=64 * 1024), Inbox(loop)
    topic = f"{prefix}/cell/c0/down/c0-d0/task"
    sub.subscribe(topic, inbox)
    assert sub.wait_subscribed(WAIT) and not pub.takes_segments
    cell = Messenger(pub, "t", "c0", trust=Trust("c0", seeds["c0"], public))
    task = Payload({"from": 1}, {"w": np.linspace(-1, 1, 300_000, dtype=np.float32)})
    ids = iter(["a" * 16, "a" * 16, "b" * 16])  # the same message framed both ways, then another
    monkeypatch.setattr(messenger_module, "new_msg_id", lambda: next(ids))
    seg = cell.frame_shared("device_task", task, round=1, cell="c0", topic=topic)
    joined = cell.frame("device_task", task, round=1, cell="c0", topic=topic)
    assert bytes(seg) == joined and len(joined) > 1_200_000
    pub.publish(topic, seg)
    sent = cell.send(topic, "device_task", task, round=2, cell="c0")
    got = inbox.wait_n(2)
    assert got[0] == (topic, joined) and len(got[1][1]) == sent
    device = Messenger(sub, "t", "c0-d0", trust=Trust("c0-d0", seeds["c0-d0"], public))
    for _, data in got:
        msg = device.receive(topic, data)
        assert msg is not None and msg.nbytes == len(data)
        np.testing.assert_array_equal(msg.payload.tensors["w"], task.tensors["w"])
    assert pub.flush(WAIT) and pub.stats.packets_out > 2 * 18  # each message in 64 KiB chunks


def test_reassembly_memory_bound(clients, loop, prefix, caplog) -> None:
    pub = clients(max_chunk=4096)
    sub, inbox = clients(max_chunk=4096, max_reassembly_bytes=50_000), Inbox(loop)
    sub.subscribe(f"{prefix}/m/+", inbox)
    assert sub.wait_subscribed(WAIT)
    with caplog.at_level(logging.WARNING, logger="protocols.wire.chunking"):
        pub.publish(f"{prefix}/m/huge", os.urandom(60_000))
        pub.publish(f"{prefix}/m/fits", fits := os.urandom(40_000))
        assert inbox.wait_n(1) == [(f"{prefix}/m/fits", fits)]
    assert "exceeds the bound of 50000" in caplog.text and sub.reassembly_bytes == 0
    assert caplog.text.count("exceeds the bound") == 1  # refused at its first chunk, the rest quietly


def test_duplicate_chunks_and_duplicate_messages(clients, loop, prefix) -> None:
    pub = clients(max_chunk=4096)
    sub, inbox = clients(max_chunk=4096), Inbox(loop)
    sub.subscribe(f"{prefix}/dup", inbox)
    assert sub.wait_subscribed(WAIT)
    data = os.urandom(20_000)
    parts = chunking.split(data, 4096)
    raw = pub._client  # inject at the MQTT level, as a broker redelivery would
    for p in [parts[0], *parts, parts[2]]:
        raw.publish(f"{prefix}/dup", p, qos=1)
    for p in parts:  # the same whole message again
        raw.publish(f"{prefix}/dup", p, qos=1)
    pub.publish(f"{prefix}/dup", b"end")
    got = inbox.wait_n(2)
    assert got == [(f"{prefix}/dup", data), (f"{prefix}/dup", b"end")]
    assert sub.reassembly_bytes == 0 and sub._reasm.pending == 0


def test_overlapping_handlers_and_bad_handler(clients, loop, prefix, caplog) -> None:
    pub, sub = clients(), clients()
    inbox = Inbox(loop)

    def bad(topic: str, payload: bytes) -> None:
        raise RuntimeError("handler bug")

    sub.subscribe(f"{prefix}/x", bad)
    sub.subscribe(f"{prefix}/x", inbox)
    assert sub.wait_subscribed(WAIT)
    with caplog.at_level(logging.ERROR, logger="protocols.transport.threadloop"):
        pub.publish(f"{prefix}/x", b"1")
        pub.publish(f"{prefix}/x", b"2")
        assert [p for _, p in inbox.wait_n(2)] == [b"1", b"2"]
    assert "handler bug" in caplog.text


def test_connect_failure_is_clear(loop) -> None:
    port = free_port()
    t = MqttTransport("nobody", loop, "127.0.0.1", port)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        t.connect(timeout=0.5)
    assert time.monotonic() - t0 < 3


def test_an_agents_refused_first_connects_say_once_that_they_retry_and_fail_with_why(loop, caplog) -> None:
    """An agent's devices (one reactor, ``retry_refused``) given a wrong broker address: one line at the first
    refusal for all of them (not one a retry), and each fails at its connect timeout saying the connection was
    refused, not "no CONNACK" (what an agent said, after 30 s of silence)."""
    port = free_port()
    reactor = Reactor("io-refused")
    reactor.start()
    try:
        devices = [
            MqttTransport(f"d{i}", loop, "127.0.0.1", port, reactor=reactor, retry_refused=True, backoff_seed=i)
            for i in range(3)
        ]
        with caplog.at_level(logging.INFO, logger="protocols.transport.mqtt"):
            for t in devices:
                t.start_connect(1.5)
            for t in devices:
                why = rf"MQTT broker at 127.0.0.1:{port} within the connect timeout \(1.5 s\): connection refused \("
                with pytest.raises(ConnectionError, match=why):
                    t.finish_connect()
    finally:
        reactor.close()
    assert all(t._attempts >= 2 for t in devices)  # each retried
    said = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(said) == 1 and f"broker at 127.0.0.1:{port} refused the connection (" in said[0], said
    assert "retrying until" in said[0] and "the connect timeout, 1.5 s" in said[0]


def test_a_node_retrying_a_broker_that_is_down_says_the_transports_retry_once_until_it_connects(loop, caplog) -> None:
    """Walk (session 25): `fedtier agent --serve` given a wrong --broker port said "broker at ... refused the
    connection; retrying until ..." at each of its attempts (every 40 s at most, for ever), beside its own "cannot
    connect to the broker ... retrying in 1 s" said once, then at the 10th, 100th... (``fedtier.serve.Retrying``). The
    transport's line is said once per broker address until a connect there succeeds, then again at a new failure."""
    port = free_port()
    node = lambda: MqttTransport("d0", loop, "127.0.0.1", port)  # noqa: E731
    said = lambda: [r.getMessage() for r in caplog.records if "retrying until" in r.getMessage()]  # noqa: E731
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # a node's attempts (fedtier.serve.connect_forever), refused
            with pytest.raises(ConnectionError, match="connection refused"):
                node().connect(timeout=0.1)
            time.sleep(0.15)  # its backoff (1 s, then longer): past the attempt's connect timeout
        assert len(said()) == 1, said()
        with socket.create_server(("127.0.0.1", port)) as server:  # a broker there now: it accepts, CONNACK
            threading.Thread(
                target=lambda: (c := server.accept()[0]).recv(64) and c.sendall(b"\x20\x02\x00\x00")
            ).start()
            node().connect(timeout=5.0).close()
        with pytest.raises(ConnectionError, match="connection refused"):
            node().connect(timeout=0.1)
    assert len(said()) == 2, said()  # down again after a connect: said again


def test_a_first_connect_names_what_failed(loop) -> None:
    """A broker that takes the TCP connection but never answers: "no CONNACK"; a failed TCP connect in words."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        with pytest.raises(ConnectionError, match=f"no CONNACK from MQTT broker at 127.0.0.1:{port} within"):
            MqttTransport("s", loop, "127.0.0.1", port).connect(timeout=0.5)
    assert failure_kind(socket.gaierror(socket.EAI_NONAME, "Name or service not known")) == "name not resolved"
    assert failure_kind(ConnectionRefusedError(111, "Connection refused")) == "connection refused"
    assert failure_kind(TimeoutError()) == "timed out"


def test_a_connection_its_broker_refused_is_not_also_said_hung_up_on_before_accepting_it(loop, caplog) -> None:
    """Walked: `fedtier agent --serve` with a wrong --password retried every few seconds, and every other attempt
    said, after 'refused the connection: Not authorized', 'MQTT broker ... closed the connection ... (without TLS)
    before accepting it: does its listener require TLS ...? Is this certificate revoked ...?': the broker's hang-up
    after its refusing CONNACK, when it came before the failed connect closed the transport. A hang-up with no
    CONNACK before it is still said so. A first connect's refusal is not logged: it is raised, with what it may mean."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.reasoncodes import ReasonCode

    t = MqttTransport("dev", loop, "127.0.0.1", free_port())
    t._ever_connected = True  # a reconnect: nobody raises its refusal
    hang_up = ReasonCode(PacketTypes.DISCONNECT, "Unspecified error")
    with caplog.at_level(logging.WARNING, logger="protocols.transport.mqtt"):
        t._on_connect(t._client, None, None, ReasonCode(PacketTypes.CONNACK, "Not authorized"), None)
        t._on_disconnect(t._client, None, None, hang_up, None)
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and "refused the connection: Not authorized" in said[0], said
        assert "or this node was revoked: `fedtier provision revoke` drops its login" in said[0]  # what it may mean
        assert "roster.json then lists it as revoked" in said[0]  # how to check
        t2 = MqttTransport("dev2", loop, "127.0.0.1", free_port())
        t2._ever_connected = True
        t2._connack.set()  # (its first connect's)
        t2._on_disconnect(t2._client, None, None, hang_up, None)  # a reconnect hung up on before its CONNACK
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 2 and "before accepting it" in said[1], said
        first = MqttTransport("dev3", loop, "127.0.0.1", free_port())
        first._on_connect(first._client, None, None, ReasonCode(PacketTypes.CONNACK, "Not authorized"), None)
        assert len(caplog.records) == 2  # a first connect's: raised by finish_connect
        with pytest.raises(ConnectionError, match="refused 'dev3': Not authorized .*this node was revoked"):
            first.finish_connect()


def test_a_broker_that_refuses_a_reconnect_for_ever_is_said_so_rarely_and_asked_rarely(loop, caplog) -> None:
    """A node whose connection dropped and whose every reconnect the broker refuses (revoked while it was away, its
    roster never read) said so at every attempt, every 30 s for ever (refused logins), or every 10th (hang-ups): a
    log that grows without bound. Now the 1st, 10th, 100th, ... of a run, whichever way it is refused, and its retry
    delay grows to REFUSED_BACKOFF times the longest (a node's: 5 min), not the usual 30 s, once refused for
    REFUSED_PATIENCE (a broker full after its restart refuses for a while: the node comes back soon after it); a
    connect resets them."""
    from types import SimpleNamespace

    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.reasoncodes import ReasonCode

    from protocols.transport.connecting import REFUSED_BACKOFF, REFUSED_PATIENCE, said_rarely

    assert [n for n in range(1, 1001) if said_rarely(n)] == [1, 10, 100, 1000]
    t = MqttTransport("dev", loop, "127.0.0.1", free_port(), reconnect_max_delay=30.0, backoff_seed=0)
    t._ever_connected = True
    t._connack.set()  # (its first connect's)
    refused = ReasonCode(PacketTypes.CONNACK, "Not authorized")
    hang_up = ReasonCode(PacketTypes.DISCONNECT, "Unspecified error")
    with caplog.at_level(logging.WARNING, logger="protocols.transport.mqtt"):
        for n in range(100):
            if n % 2:
                t._on_connect(t._client, None, None, refused, None)
            t._on_disconnect(t._client, None, None, hang_up, None)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3 and "before accepting it" in said[0], said  # the 1st, 10th, 100th
    assert "refused again (10 times in a row: Not authorized)" in said[1] and "(100 times in a row" in said[2]
    delays = [t.next_backoff(refused=True) for _ in range(40)]
    brief = [d for i, d in enumerate(delays) if sum(delays[:i]) < REFUSED_PATIENCE]  # refused for less than it
    assert len(brief) > 12 and max(brief) < 30.0 * 1.5, brief  # the usual delays, jittered
    assert 30.0 * REFUSED_BACKOFF * 0.5 <= delays[-1] < 30.0 * REFUSED_BACKOFF * 1.5 and max(delays) > 45.0
    t._on_connect(
        t._client, None, SimpleNamespace(session_present=False), ReasonCode(PacketTypes.CONNACK, "Success"), None
    )
    assert t._refusals == 0 and t._attempts == 0 and t._refused_for == 0


# -- reconnect -------------------------------------------------------------------------------


def test_embedded_broker_restarts_on_its_port_after_a_shutdown_that_timed_out() -> None:
    """amqtt's shutdown can outlast ``stop``'s timeout on a loaded machine (seen once in CI); the listening
    socket is closed anyway, so the broker starts again on the same port (it failed: "address already in
    use")."""
    b = EmbeddedBroker(free_port()).start()
    port = b.port

    async def hangs() -> None:
        await asyncio.sleep(3600)

    b._broker.shutdown = hangs  # a shutdown that never finishes
    b.stop(timeout=0.2)
    b.start()
    try:
        assert b.port == port
    finally:
        b.stop()


@pytest.mark.parametrize("kind", BROKERS)
def test_reconnect_after_broker_restart_resubscribes(kind: str, loop) -> None:
    b = make_broker(kind, free_port()).start()
    try:
        kw = dict(reconnect_min_delay=0.1, reconnect_max_delay=0.5)
        pub, sub, inbox = connect(b, "r-pub", loop, **kw), connect(b, "r-sub", loop, **kw), Inbox(loop)
        sub.subscribe("r/+", inbox)
        assert sub.wait_subscribed(WAIT)
        pub.publish("r/1", b"before")
        inbox.wait_n(1)
        b.stop()
        deadline = time.monotonic() + WAIT
        while (sub.connected or pub.connected) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not sub.connected and not pub.connected
        pub.publish("r/2", b"queued while down")  # never blocks, sent after reconnecting
        b.start()
        assert sub.wait_subscribed(WAIT) and pub.flush(WAIT)
        pub.publish("r/3", b"after")
        got = inbox.wait(lambda items: (b"after") in [p for _, p in items])
        assert got, inbox.items
        pub.close()
        sub.close()
    finally:
        b.stop()


# -- ThreadLoop ------------------------------------------------------------------------------


def test_threadloop_timers_in_order_and_cancel() -> None:
    lp = ThreadLoop()
    fired: list[str] = []
    lp.call_later(0.03, lambda: fired.append("c"))
    lp.call_later(0.01, lambda: fired.append("a"))
    h = lp.call_later(0.02, lambda: fired.append("cancelled"))
    lp.call_later(0.02, lambda: fired.append("b"))
    lp.post(lambda: fired.append("now"))
    lp.cancel(h)
    lp.cancel(h)
    lp.cancel(None)
    t0 = lp.now()
    assert lp.run(until=lambda: len(fired) >= 4, timeout=5)
    assert fired == ["now", "a", "b", "c"]
    assert 0.025 <= lp.now() - t0 < 1.0


def test_threadloop_survives_exceptions_and_serialises(caplog) -> None:
    lp = ThreadLoop().start()
    active, seen, done = [0], [], threading.Event()

    def work(i: int) -> None:
        active[0] += 1
        assert active[0] == 1
        seen.append(i)
        active[0] -= 1
        if len(seen) == 200:
            done.set()

    def boom() -> None:
        raise ValueError("boom")

    with caplog.at_level(logging.ERROR):
        posters = [
            threading.Thread(
                target=lambda k=k: [lp.post(boom if j == 0 else (lambda v=k * 100 + j: work(v))) for j in range(101)]
            )
            for k in range(2)
        ]
        for p in posters:
            p.start()
        assert done.wait(5)
    assert "boom" in caplog.text and sorted(seen) == sorted(k * 100 + j for k in range(2) for j in range(1, 101))
    lp.stop()
    lp.stop()  # idempotent
    assert not lp.running


def test_threadloop_run_timeout_and_stop_from_callback() -> None:
    lp = ThreadLoop()
    t0 = time.monotonic()
    assert lp.run(until=lambda: False, timeout=0.05) is False
    assert time.monotonic() - t0 < 1
    lp.call_later(0.01, lp.stop)
    assert lp.run(timeout=5) is True


# -- brokers ---------------------------------------------------------------------------------


def test_parse_broker_url() -> None:
    assert parse_broker_url("mqtt://127.0.0.1:1884") == ("127.0.0.1", 1884)
    assert parse_broker_url("mqtt://broker.local") == ("broker.local", 1883)
    assert parse_broker_url("localhost:9") == ("localhost", 9)
    for bad in ("http://x:1", "mqtt://:1883", "mqtt://h:notaport", "mqtt://h:1/path"):
        with pytest.raises(ValueError):
            parse_broker_url(bad)


def test_mosquitto_missing_binary_is_clear() -> None:
    with pytest.raises(FileNotFoundError, match="mosquitto"):
        MosquittoBroker(binary="/nonexistent/mosquitto")


@needs_mosquitto
def test_a_persistent_client_whose_session_is_gone_says_so_and_re_announces(loop, caplog) -> None:
    """A broker that kept no session for a persistent client when it comes back (expired after its
    ``persistent_client_expiration``, here: restarted without persistence) is noticed: a warning saying what
    was lost, a count, and the ``on_session_lost`` hook (an agent re-announces itself there); the client
    resubscribes and receives again. A clean client says nothing."""
    b = MosquittoBroker(free_port()).start()
    try:
        kw = dict(reconnect_min_delay=0.1, reconnect_max_delay=0.5)
        node = connect(b, "fedtier-t-c0-d0", loop, persistent=True, **kw)
        clean = connect(b, "clean", loop, **kw)
        told = threading.Event()
        node.on_session_lost = told.set
        inbox = Inbox(loop)
        node.subscribe("s/+", inbox)
        assert node.wait_subscribed(WAIT)
        with caplog.at_level(logging.INFO):
            b.stop()
            b.start()
            assert told.wait(WAIT) and node.wait_subscribed(WAIT)
            clean.publish("s/1", b"after")
            assert inbox.wait(lambda items: b"after" in [p for _, p in items]), inbox.items
        assert node.sessions_lost == 1 and clean.sessions_lost == 0
        lost = [r.getMessage() for r in caplog.records if "kept no session" in r.getMessage()]
        assert len(lost) == 1 and lost[0].startswith("fedtier-t-c0-d0:") and "are lost" in lost[0], lost
        assert "another process connected under this client id" in lost[0], lost  # a takeover says the same
        node.close()
        clean.close()
    finally:
        b.stop()


@needs_mosquitto
def test_a_message_that_arrives_while_a_persistent_client_closes_goes_to_its_next_session(loop, prefix) -> None:
    """A QoS-1 message reaching a persistent client after ``close()`` began (its handlers no longer run) was
    acknowledged by paho and dropped: lost, though the session outlives the connection (seen: a ``fedtier submit``
    the cloud never answered, sent as it closed one job's connection for the next). It is left unacknowledged now,
    and the broker hands it to the client's next session."""

    class Closing(ThreadLoop):  # close() cancels its expiry timer between marking itself closed and DISCONNECT
        late: Callable[[], None] = staticmethod(lambda: None)

        def cancel(self, handle) -> None:  # type: ignore[no-untyped-def]
            super().cancel(handle)
            self.late()

    with MosquittoBroker() as b:
        closing = Closing("closing").start()
        node = connect(b, "fedtier-t-cloud", closing, persistent=True)
        node.subscribe(f"{prefix}/submit", lambda t, p: None)
        assert node.wait_subscribed(WAIT)
        operator = connect(b, "operator", loop)
        arrived = threading.Event()
        on_message = node._client.on_message
        node._client.on_message = lambda *a: (on_message(*a), arrived.set())  # type: ignore[func-returns-value]

        def submit() -> None:  # the node is closing: published now, it arrives before the DISCONNECT
            closing.late = lambda: None
            operator.publish(f"{prefix}/submit", b"job B")
            assert arrived.wait(WAIT)

        closing.late = submit
        node.close()
        closing.stop()
        inbox = Inbox(loop)
        again = connect(b, "fedtier-t-cloud", loop, persistent=True)  # its next session (the next job's)
        again.subscribe(f"{prefix}/submit", inbox)
        assert inbox.wait_n(1) == [(f"{prefix}/submit", b"job B")]
        again.close()
        operator.close()


@needs_mosquitto
def test_a_closed_client_leaves_no_socket_for_the_garbage_collector(loop) -> None:
    """A client driven by paho's own thread (no reactor: ``fedtier cloud|cell --serve``, which connect again for
    every job, the operator's commands) left paho's wake-up socket pair open after ``close()`` until the garbage
    collector found the client: 2 descriptors a connection in a long-lived process. ``close()`` closes them."""
    import gc

    def open_files() -> int:
        return len(os.listdir("/proc/self/fd"))

    with MosquittoBroker() as b:
        connect(b, "warm-up", loop).close()
        gc.disable()
        try:
            before = open_files()
            for i in range(3):
                connect(b, f"job-{i}", loop, persistent=True).close()
            after = open_files()
        finally:
            gc.enable()
    assert after == before, (before, after)


@needs_mosquitto
def test_a_message_taken_but_not_yet_handled_when_a_persistent_client_closes_goes_to_its_next_session(
    loop, prefix
) -> None:
    """Seen on a running federation: a ``fedtier submit`` reached the cloud as it closed one job's connection for
    the next. paho took it and it was acknowledged, posted to the cloud's loop; by the time the loop ran it the
    connection was closed, so its handler did not run: the job was never queued nor answered, and the broker had
    forgotten it. A message is acknowledged once its handlers ran now; one its closed client dropped goes to the
    next session."""
    with MosquittoBroker() as b:
        busy = ThreadLoop("busy").start()
        try:
            node = connect(b, "fedtier-t-cloud", busy, persistent=True)
            node.subscribe(f"{prefix}/submit", lambda t, p: None)
            assert node.wait_subscribed(WAIT)
            release, blocked = threading.Event(), threading.Event()
            busy.post(lambda: (blocked.set(), release.wait(WAIT)))  # the loop busy with the job's end
            assert blocked.wait(WAIT)
            operator = connect(b, "operator", loop)
            operator.publish(f"{prefix}/submit", b"job B")
            deadline = time.monotonic() + WAIT
            while node.stats.messages_in == 0 and time.monotonic() < deadline:  # taken, posted, not handled
                time.sleep(0.01)
            assert node.stats.messages_in == 1
            node.close()
            release.set()
        finally:
            busy.stop()
        inbox = Inbox(loop)
        again = connect(b, "fedtier-t-cloud", loop, persistent=True)
        again.subscribe(f"{prefix}/submit", inbox)
        assert inbox.wait_n(1) == [(f"{prefix}/submit", b"job B")]
        again.close()
        operator.close()


@needs_mosquitto
@pytest.mark.parametrize("persistent", [True, False])
def test_more_refused_messages_than_the_brokers_window_do_not_stall_a_client(loop, prefix, persistent) -> None:
    """QoS-1 messages are acknowledged by hand: one never acknowledged holds a place in the broker's in-flight
    window for the client (64, ``max_inflight_messages``) and, 64 of them, the broker sends it nothing more. Refused
    (too large; a garbled chunk), dropped (its handler raises) or not whole yet: 3 x 70 of them, then a good one,
    which arrives."""
    with MosquittoBroker() as b:
        node = connect(b, f"node-{persistent}", loop, persistent=persistent)
        node.configure_wire(max_message_bytes=2000)
        inbox = Inbox(loop)

        def handler(topic: str, payload: bytes) -> None:
            if payload != b"good":
                raise ValueError("refused by its handler")
            inbox(topic, payload)

        node.subscribe(f"{prefix}/in", handler)
        assert node.wait_subscribed(WAIT)
        sender = connect(b, "sender", loop)
        raw = sender._client  # at the MQTT level: what a lying peer or a broken sender sends
        first_chunk = chunking.split(os.urandom(3000), 1000)[0]  # too large (2000 B) at its first chunk
        for i in range(70):  # (each kind more than the window; the handler's first: Mosquitto
            # does not hold a persistent client's window strictly once it had acknowledgements)
            raw.publish(f"{prefix}/in", b"bad %d" % i, qos=1)  # its handler raises
        for _ in range(70):
            raw.publish(f"{prefix}/in", os.urandom(2001), qos=1)  # one message over the bound
            raw.publish(f"{prefix}/in", first_chunk[: chunking.HEADER_BYTES + 1], qos=1)  # a truncated chunk
        sender.publish(f"{prefix}/in", b"good")
        assert inbox.wait_n(1) == [(f"{prefix}/in", b"good")]
        assert node.stats.messages_in >= 71
        sender.close()
        node.close()


def test_a_message_a_persistent_client_drops_as_it_closes_is_not_acknowledged(loop) -> None:
    """``close()`` may run on another thread while paho's hands the client a message: one ``_receive`` drops because
    the client closed meanwhile was acknowledged all the same (lost to the session, as before manual ack)."""
    node = MqttTransport("fedtier-t-cloud", loop, "127.0.0.1", 1, persistent=True)  # never connected
    node.subscribe("t/submit", lambda t, p: None)
    receive = node._receive

    def closed_meanwhile(msg, ack=None):  # type: ignore[no-untyped-def]
        node._closed = True  # close() on the loop's thread, between _on_message's check and this one
        return receive(msg, ack)

    node._receive = closed_meanwhile  # type: ignore[method-assign]
    acks: list[int] = []

    class Client:
        def ack(self, mid: int, qos: int) -> None:
            acks.append(mid)

    msg = mqtt.MQTTMessage(7, b"t/submit")
    msg.payload, msg.qos = b"job B", 1
    node._on_message(Client(), None, msg)  # type: ignore[arg-type]
    assert acks == []  # left to the broker: the node's next session gets it


@needs_mosquitto
def test_a_persistent_clients_message_is_acknowledged_only_once_its_handler_returned(loop, prefix) -> None:
    """The async cloud journals a push (fsynced) in its handler before it counts. The message was acknowledged before
    its handler ran: a cloud killed in the handler, before the journal had the push, lost it (the broker had forgotten
    it; note13). Acknowledged once the handler returned now: killed in its handler (here: the connection dropped, no
    DISCONNECT, the handler stops), the node's next session (``--resume``) gets the push again and journals it, once;
    a push whose handler returned is not handed again."""
    journal: list[bytes] = []

    def dies_before_journaling(topic: str, payload: bytes) -> None:
        node.publish(f"{prefix}/status", b"busy")  # the broker answers it after whatever this client sent before
        assert node.flush(WAIT)
        node.crash()  # killed here: nothing of the push journaled

    with MosquittoBroker() as b:
        node = connect(b, "fedtier-t-cloud", loop, persistent=True)
        node.subscribe(f"{prefix}/up/c0/report", dies_before_journaling)
        assert node.wait_subscribed(WAIT)
        cell = connect(b, "cell", loop)
        cell.publish(f"{prefix}/up/c0/report", b"push 1")
        deadline = time.monotonic() + WAIT
        while not node.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert node.closed
        inbox = Inbox(loop)

        def journals(topic: str, payload: bytes) -> None:
            journal.append(payload)
            inbox(topic, payload)

        again = connect(b, "fedtier-t-cloud", loop, persistent=True)  # --resume: its next session
        again.subscribe(f"{prefix}/up/c0/report", journals)
        assert inbox.wait_n(1) == [(f"{prefix}/up/c0/report", b"push 1")]
        cell.publish(f"{prefix}/up/c0/report", b"push 2")
        assert inbox.wait_n(2)[1] == (f"{prefix}/up/c0/report", b"push 2")
        again.close()
        later = Inbox(loop)
        third = connect(b, "fedtier-t-cloud", loop, persistent=True)  # both handled: neither comes again
        third.subscribe(f"{prefix}/up/c0/report", later)
        assert third.wait_subscribed(WAIT)
        cell.publish(f"{prefix}/up/c0/report", b"push 3")
        assert later.wait_n(1) == [(f"{prefix}/up/c0/report", b"push 3")]
        assert journal == [b"push 1", b"push 2"]
        third.close()
        cell.close()


@needs_mosquitto
def test_a_chunked_message_whose_handler_was_killed_comes_whole_in_the_next_session(loop, prefix, caplog) -> None:
    """A push larger than ``max_chunk`` travels as chunks; its first chunks were acknowledged as they came (so a large
    message does not fill the broker's in-flight window), so a node killed in its handler got only the last chunk
    again, which expired: the push was lost. Its chunks are held unacknowledged together now (within a budget well
    under the window) and acknowledged once its handler returned: the next session gets it whole, once; and three
    such messages in a row, more chunks than the budget, are each held whole (no warning) and arrive whole."""
    push = os.urandom(9000)  # 10 chunks of 1000 bytes

    def dies_in_the_handler(topic: str, payload: bytes) -> None:
        assert payload == push
        node.publish(f"{prefix}/status", b"busy")  # the broker answers it after whatever this client sent before
        assert node.flush(WAIT)
        node.crash()  # killed here: nothing of the push journaled

    with MosquittoBroker() as b:
        node = connect(b, "fedtier-t-cloud", loop, persistent=True)
        node.subscribe(f"{prefix}/up/c0/report", dies_in_the_handler)
        assert node.wait_subscribed(WAIT)
        cell = connect(b, "cell", loop, max_chunk=1000)
        cell.publish(f"{prefix}/up/c0/report", push)
        assert wait_until(lambda: node.closed, WAIT)
        assert node.stats.packets_in == 10
        inbox = Inbox(loop)
        again = connect(b, "fedtier-t-cloud", loop, persistent=True)  # --resume: its next session
        again.subscribe(f"{prefix}/up/c0/report", inbox)
        assert inbox.wait_n(1) == [(f"{prefix}/up/c0/report", push)]
        more = [os.urandom(9000) for _ in range(3)]  # 30 chunks in all: one set after the other
        with caplog.at_level(logging.WARNING, logger="protocols.transport.mqtt"):
            for payload in more:
                cell.publish(f"{prefix}/up/c0/report", payload)
            assert [p for _, p in inbox.wait_n(4)[1:]] == more
        assert again._chunk_acks.held == 0
        assert not [r for r in caplog.records if "chunk by chunk" in r.getMessage()]
        assert wait_until(lambda: again._taking is None, WAIT)  # the last handler returned: its chunks acknowledged
        again.close()
        third = connect(b, "fedtier-t-cloud", loop, persistent=True)  # all handled: none comes again
        _gets_only_what_comes_now(third, f"{prefix}/up/c0/report", cell, b"push 5", loop)
        cell.close()


def _gets_only_what_comes_now(
    session: MqttTransport, topic: str, publisher: MqttTransport, payload: bytes, loop: ThreadLoop
) -> None:
    """A next session of a persistent client, subscribed to ``topic``, is handed ``payload`` published now and
    nothing before it (no message its previous session handled comes again); then it closes."""
    later = Inbox(loop)
    session.subscribe(topic, later)
    assert session.wait_subscribed(WAIT)
    publisher.publish(topic, payload)
    assert later.wait_n(1) == [(topic, payload)]
    session.close()


@needs_mosquitto
@pytest.mark.parametrize("io", ["paho thread", "reactor"])
def test_a_persistent_client_that_closes_and_reconnects_at_once_is_not_handed_again_what_it_handled(
    io: str, loop, prefix
) -> None:
    """Mosquitto reads one packet a connection per turn of its loop: a busy broker that reads a node's next CONNECT
    (a cloud opening its next session at once) before the PUBACKs its last session wrote takes the old connection
    over with them unread, and handed the next session again the messages already handled (seen under load: a
    chunked one's set in part, then more chunk sets acknowledged chunk by chunk). Here the broker is stopped while
    the handlers acknowledge and runs again 0.3 s later: ``close()`` now waits for a PINGREQ's answer first."""
    handled, gate = Inbox(loop), threading.Event()
    reactor = Reactor().start() if io == "reactor" else None

    def handles(topic: str, payload: bytes) -> None:
        gate.wait(WAIT)
        handled(topic, payload)

    with MosquittoBroker() as b, contextlib.ExitStack() as stack:
        if reactor is not None:
            stack.callback(reactor.close)
        node = connect(b, "fedtier-t-cloud", loop, persistent=True, reactor=reactor)
        node.subscribe(f"{prefix}/up", handles)
        assert node.wait_subscribed(WAIT)
        cell = connect(b, "cell", loop)
        for i in range(20):
            cell.publish(f"{prefix}/up", b"push %d" % i)
        assert wait_until(lambda: node.stats.messages_in == 20, WAIT)  # all at the node, none acknowledged yet
        assert b.pid is not None
        os.kill(b.pid, signal.SIGSTOP)
        resume = threading.Timer(0.3, os.kill, (b.pid, signal.SIGCONT))
        try:
            gate.set()  # the handlers return: their PUBACKs wait in the stopped broker's socket
            assert len(handled.wait_n(20)) == 20 and wait_until(lambda: node._taking is None, WAIT)
            resume.start()
            node.close()
            again = connect(b, "fedtier-t-cloud", loop, persistent=True)
        finally:
            resume.cancel()
            os.kill(b.pid, signal.SIGCONT)
        _gets_only_what_comes_now(again, f"{prefix}/up", cell, b"next", loop)
        cell.close()


@needs_mosquitto
def test_closing_a_persistent_client_whose_broker_dies_meanwhile_does_not_wait_for_an_answer(loop, prefix) -> None:
    """``close()`` waits for a PINGREQ's answer (above); a broker killed while it waits never answers: the lost
    connection ends the wait at once, not its timeout (nor paho's first reconnect, 30 s away here)."""
    with MosquittoBroker() as b:
        node = connect(b, "fedtier-t-cloud", loop, persistent=True, reconnect_min_delay=30.0)
        inbox = Inbox(loop)
        node.subscribe(f"{prefix}/up", inbox)
        assert node.wait_subscribed(WAIT)
        cell = connect(b, "cell", loop)
        cell.publish(f"{prefix}/up", b"push")
        inbox.wait_n(1)
        assert wait_until(lambda: node._taking is None, WAIT)  # acknowledged: close() asks for a round trip
        cell.close()
        assert b.pid is not None
        os.kill(b.pid, signal.SIGSTOP)  # no answer to the PINGREQ ...
        threading.Timer(0.2, b.kill).start()  # ... and then no broker
        started = time.monotonic()
        node.close(flush_timeout=5.0)
        assert time.monotonic() - started < 2.0


@needs_mosquitto
def test_a_chunked_message_whose_session_ends_before_its_last_chunk_comes_whole_to_the_next(loop, prefix) -> None:
    """A long-lived node closes its connection and opens the next (a serving cloud per job) while a chunked message is
    under way: its first chunks were acknowledged as they came, so the next session got only the rest, an incomplete
    set that expired. Held unacknowledged with their set now, the broker hands them to the next session: whole."""
    push = os.urandom(9000)
    chunks = chunking.split(push, 1000)  # 10
    with MosquittoBroker() as b:
        node = connect(b, "fedtier-t-cloud", loop, persistent=True)
        node.subscribe(f"{prefix}/up/c0/report", lambda t, p: None)
        assert node.wait_subscribed(WAIT)
        cell = connect(b, "cell", loop)
        for chunk in chunks[:4]:  # at the MQTT level: the chunks as the cell's transport sends them
            cell._client.publish(f"{prefix}/up/c0/report", chunk, qos=1)
        assert wait_until(lambda: node.stats.packets_in == 4, WAIT)
        node.close()
        for chunk in chunks[4:]:
            cell._client.publish(f"{prefix}/up/c0/report", chunk, qos=1)
        inbox = Inbox(loop)
        again = connect(b, "fedtier-t-cloud", loop, persistent=True)
        again.subscribe(f"{prefix}/up/c0/report", inbox)
        assert inbox.wait_n(1) == [(f"{prefix}/up/c0/report", push)]
        again.close()
        cell.close()


@needs_mosquitto
def test_a_chunked_message_over_the_unacknowledged_budget_still_arrives_whole(loop, prefix, caplog) -> None:
    """More chunks than the budget (12; the broker's window is 64 here): acknowledged as they come, as before, with
    a warning naming its size (a node killed in its handler would lose it), once a connection (a device warned at
    every task otherwise, a cell at every device's result); it arrives whole, and so do the messages sent after it."""
    big = os.urandom(40 * 950)  # 40 chunks of 1000 bytes
    with MosquittoBroker() as b:
        inbox = Inbox(loop)
        node = connect(b, "fedtier-t-cloud", loop, persistent=True)
        node.subscribe(f"{prefix}/up/#", inbox)
        assert node.wait_subscribed(WAIT)
        cell = connect(b, "cell", loop, max_chunk=1000)
        with caplog.at_level(logging.WARNING, logger="protocols.transport.mqtt"):
            cell.publish(f"{prefix}/up/big", big)
            cell.publish(f"{prefix}/up/small", os.urandom(5000))
            cell.publish(f"{prefix}/up/big", big[::-1])
            cell.publish(f"{prefix}/up/other", big)
            got = inbox.wait_n(4)
        assert got[0] == (f"{prefix}/up/big", big) and len(got[1][1]) == 5000 and got[2][1] == big[::-1]
        assert got[3] == (f"{prefix}/up/other", big)
        assert node._chunk_acks.held == 0
        said = [r.getMessage() for r in caplog.records if "chunk by chunk" in r.getMessage()]
        assert len(said) == 1 and f"of {len(big)} bytes (40 chunks)" in said[0], said
        node.close()
        cell.close()


def test_the_chunks_held_of_a_set_that_never_completes_are_acknowledged_when_it_expires() -> None:
    """A persistent client holds a chunked message's chunks unacknowledged until it is whole and handled; a set that
    never completes (its sender died) would keep their places in the broker's in-flight window for good: they are
    acknowledged when the set expires (or is evicted), and the budget they took is free again."""
    clock = [0.0]
    node = MqttTransport("fedtier-t-cloud", ThreadLoop("acks"), "127.0.0.1", 1, persistent=True, chunk_timeout=5.0)
    node._reasm.clock = lambda: clock[0]
    acks: list[int] = []

    class Client:
        def ack(self, mid: int, qos: int) -> None:
            acks.append(mid)

    node._client = Client()  # type: ignore[assignment]
    node.subscribe("t/push", lambda t, p: None)
    for mid, chunk in enumerate(chunking.split(os.urandom(4000), 1000)[:3], start=1):  # 3 of its 5 chunks
        msg = mqtt.MQTTMessage(mid, b"t/push")
        msg.payload, msg.qos = chunk, 1
        node._on_message(Client(), None, msg)  # type: ignore[arg-type]
    assert acks == [] and node._chunk_acks.held == 5
    clock[0] = 6.0
    with node._reasm_lock:
        assert node._reasm.expire() == 1
    assert sorted(acks) == [1, 2, 3] and node._chunk_acks.held == 0


def test_a_message_is_acknowledged_once_all_its_handlers_returned_and_not_when_one_is_interrupted() -> None:
    """A persistent client's message is acknowledged once its handler returned (a node killed in it gets it again).
    Two handlers: it was acknowledged when the first returned, so a node killed in the second lost it. A handler
    interrupted (Ctrl-C in ``fedtier cloud``: ``KeyboardInterrupt`` raised in the async cloud's push handler before
    it journaled) had it acknowledged all the same (``finally``), and the push was lost; it is left to the broker
    now. A handler that raises an ``Exception`` (a poison message) has it acknowledged: it does not come for ever."""
    loop = ThreadLoop("acks")
    node = MqttTransport("fedtier-t-cloud", loop, "127.0.0.1", 1, persistent=True)  # never connected
    acks: list[int] = []

    class Client:
        def ack(self, mid: int, qos: int) -> None:
            acks.append(mid)

    node._client = Client()  # type: ignore[assignment]
    calls: list[str] = []
    acked_before: list[int] = []  # acknowledgements made when the second handler ran
    first_returns = calls.append

    def second(topic: str, payload: bytes) -> None:
        calls.append(topic)
        if payload == b"interrupted":
            raise KeyboardInterrupt
        if payload == b"poison":
            raise ValueError("refused by its handler")
        acked_before.append(len(acks))

    node.subscribe("t/#", lambda t, p: first_returns(t))
    node.subscribe("t/push", second)

    def receive(mid: int, payload: bytes) -> None:
        msg = mqtt.MQTTMessage(mid, b"t/push")
        msg.payload, msg.qos = payload, 1
        node._on_message(Client(), None, msg)  # type: ignore[arg-type]  # posted to the loop, not acknowledged

    receive(1, b"push")
    assert loop.run(until=lambda: len(calls) == 2, timeout=WAIT)
    assert acked_before == [0] and acks == [1]  # once both returned
    receive(2, b"interrupted")
    with pytest.raises(KeyboardInterrupt):
        loop.run(until=lambda: len(calls) == 4, timeout=WAIT)
    assert len(calls) == 4 and acks == [1]  # left to the broker: the next session gets it
    receive(3, b"poison")
    assert loop.run(until=lambda: len(calls) == 6, timeout=WAIT)
    assert acks == [1, 3]


def test_a_lost_connection_whose_user_says_it_itself_is_said_at_info(loop, caplog) -> None:
    """Walked (session 25): `fedtier monitor --broker URL > log` printed the transport's 'monitor-8a6d02ef: lost
    connection to ...; reconnecting' warning beside its own 'broker connection lost, reconnecting' line at each drop.
    A transport whose user says a drop itself (``own_drop_line``: the monitor's) says its line at info."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.reasoncodes import ReasonCode

    hang_up = ReasonCode(PacketTypes.DISCONNECT, "Unspecified error")
    said: list[tuple[int, str]] = []
    for own in (False, True):
        t = MqttTransport("monitor-x", loop, "127.0.0.1", free_port())
        t.own_drop_line = own
        t._ever_connected = t._connected = True
        t._connack.set()  # (its first connect's)
        with caplog.at_level(logging.INFO, logger="protocols.transport.mqtt"):
            caplog.clear()
            t._on_disconnect(t._client, None, None, hang_up, None)
        said += [(r.levelno, r.getMessage()) for r in caplog.records if "lost connection" in r.getMessage()]
        t.close()
    assert [level for level, _ in said] == [logging.WARNING, logging.INFO], said
    assert said[1][1].startswith("monitor-x: lost connection to 127.0.0.1:"), said


@needs_mosquitto
def test_a_connection_the_broker_closes_without_a_reason_says_what_closes_one_so(loop, caplog) -> None:
    """Another client connecting under a client id (a second agent under a live device's id, as its twin check
    connects) makes Mosquitto close the first's connection, which MQTT 3.1.1 gives no reason for: it logged "lost
    connection to HOST:PORT (Unspecified error); reconnecting" (paho's name of no reason), which told the operator
    nothing. It names what closes a connection so, a client under the same id among them."""
    b = MosquittoBroker(free_port()).start()
    try:
        first = connect(b, "fedtier-t-twin", loop, reconnect_min_delay=5.0, reconnect_max_delay=5.0)
        with caplog.at_level(logging.WARNING, logger="protocols.transport.mqtt"):
            second = connect(b, "fedtier-t-twin", loop, reconnect_min_delay=5.0, reconnect_max_delay=5.0)
            lost = lambda: [r.getMessage() for r in caplog.records if "lost connection" in r.getMessage()]  # noqa: E731
            assert wait_until(lambda: lost(), WAIT), caplog.text
        said = lost()[0]
        assert said.startswith("fedtier-t-twin: lost connection to") and "Unspecified error" not in said, said
        assert "another client that connected under this client id" in said, said
        second.close()
        first.close()
    finally:
        b.stop()


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_broker_whose_free_port_another_process_took_first_starts_on_another_not_answering_as_the_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A free port is free only a moment: another test's broker, started at the same instant, can take it before this
    one binds it. This Mosquitto then exited, but the start waited only for something to accept on the port, so the
    test went on with the OTHER broker (its clients' messages mixed with another test's run; suspected in a loaded
    fresh-clone suite, a model apart by ~0.01). The start now requires its own process to hold the listening socket,
    and takes another free port."""
    import socket
    import subprocess

    from protocols.transport import broker as broker_module
    from protocols.transport.broker import listens

    with socket.socket() as squatter:  # the other process's listener, on the port "found free"
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        assert listens(os.getpid(), taken) in (True, None)  # (None: no /proc here)
        gone = subprocess.Popen(["true"])  # a broker that exited (its port taken) as the start looked: it holds nothing
        gone.wait()  # (it said None, "cannot tell": once in a loaded xdist run the start took the squatter's port)
        assert listens(gone.pid, taken) is (False if os.path.exists("/proc/net/tcp") else None)
        ports = iter([taken])
        real = broker_module.free_port
        monkeypatch.setattr(broker_module, "free_port", lambda host="127.0.0.1": next(ports, None) or real(host))
        with MosquittoBroker() as broker:
            assert broker.port != taken
            assert listens(broker._proc.pid, broker.port) in (True, None)  # type: ignore[union-attr]


def test_a_connection_of_long_standing_lost_is_tried_again_at_once_then_backs_off() -> None:
    """A live cell whose session a second process of it took over for a moment (``protocols.twin``'s check) waited the
    1 s reconnect delay each time, and its job with it. A connection that lasted ``LONG_LIVED`` is tried again after
    ``TAKEN_BACK_DELAY``; a try that fails then waits the usual delays, and so does a connection that did not last (the
    one that came back at once, taken over in turn: two processes that keep taking one session still back off)."""
    from protocols.transport.paho_client import LONG_LIVED, TAKEN_BACK_DELAY, Credentials, _Client, new_client

    c = new_client("node", True, Credentials(), None, 1 << 16, (1.0, 30.0), 64)
    assert isinstance(c, _Client)
    c.connected_at = time.monotonic() - LONG_LIVED  # accepted that long ago, lost now
    assert [c.next_wait() for _ in range(4)] == [TAKEN_BACK_DELAY, 1.0, 2.0, 4.0]
    c._reconnect_delay = None  # accepted again (paho resets it on a CONNACK) ...
    c.connected_at = time.monotonic()  # ... and lost at once
    assert c.next_wait() == 1.0


def test_a_free_port_is_drawn_below_the_ephemeral_range_where_no_outgoing_connection_holds_it() -> None:
    """A port of the system's ephemeral range (what binding port 0 gives) may be any outgoing connection's next local
    port, held by it and then 60 s in TIME_WAIT, and a listener cannot bind it meanwhile, SO_REUSEADDR or not (shown
    with this test's own connection, closed first): a test's broker started on a port found free seconds before (a
    provisioning first), or restarted on its port, could fail to start under xdist (~200 such ports held at any moment
    in a loaded suite). :func:`free_port` draws below that range, one port or consecutive ones."""
    from protocols.transport.broker import _ephemeral_low

    low = _ephemeral_low()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        held = client.getsockname()[1]
        client.close()  # first: its port waits in TIME_WAIT
        accepted.close()
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                listener.bind(("127.0.0.1", held))
    assert held >= low
    for count in (1, 4):
        bases = [free_port(count=count) for _ in range(20)]
        assert all(base + count <= low for base in bases), (bases, low)
        assert len(set(bases)) > 1  # drawn, not one port for every caller


@needs_mosquitto
def test_a_connection_told_to_stay_down_is_not_made_again_once_taken_over(loop) -> None:
    """A second process of a node, refused by its twin check, leaves with ``stay_down``: the live process taking its
    session back meanwhile must not be taken over once more by its reconnect (paho's thread, or a reactor's: both
    reconnect within 1.6 s without it)."""
    reactor = Reactor().start()
    with MosquittoBroker() as b:
        try:
            leaving = {
                io: connect(b, f"node-{io}", loop, persistent=True, reactor=r)
                for io, r in (("thread", None), ("reactor", reactor))
            }
            for t in leaving.values():
                t.stay_down()
            live = {io: connect(b, f"node-{io}", loop, persistent=True) for io in leaving}  # taken back
            assert all(wait_until(lambda t=t: not t.connected, WAIT) for t in leaving.values())
            time.sleep(1.6)  # longer than either's first reconnect delay (1 s; a reactor's 0.5 to 1.5 s)
            assert [t.reconnects for t in live.values()] == [0, 0] and all(t.connected for t in live.values())
            for t in (*leaving.values(), *live.values()):
                t.close()
        finally:
            reactor.close()
