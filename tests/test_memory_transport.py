"""In-memory transport: MQTT matching, deterministic order, retained messages, wills, virtual time."""

from __future__ import annotations

import pytest

from protocols.transport import Will, topic_matches
from protocols.transport.memory import MemoryHub, VirtualLoop


@pytest.mark.parametrize(
    "pattern, topic, expected",
    [
        ("a/b", "a/b", True),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/#", "a/b/c", True),
        ("a/#", "a", True),
        ("+/+/c", "x/y/c", True),
        ("a/b", "a/c", False),
        ("#", "anything/at/all", True),
        ("a/+/c", "a/b", False),
    ],
)
def test_topic_matching(pattern, topic, expected):
    assert topic_matches(pattern, topic) is expected


def test_delivery_order_is_publish_order_and_handlers_run_after_publisher_returns():
    hub = MemoryHub()
    a, b = hub.connect("a"), hub.connect("b")
    got: list[tuple[str, str, bytes]] = []
    b.subscribe("t/+", lambda t, p: got.append(("b1", t, p)))
    b.subscribe("t/#", lambda t, p: got.append(("b2", t, p)))

    def publish_two() -> None:
        a.publish("t/1", b"x")
        a.publish("t/2", b"y")
        assert got == []  # nothing re-entrant

    hub.loop.post(publish_two)
    hub.loop.run()
    assert got == [("b1", "t/1", b"x"), ("b2", "t/1", b"x"), ("b1", "t/2", b"y"), ("b2", "t/2", b"y")]


def test_retained_message_reaches_late_subscriber_and_empty_payload_clears_it():
    hub = MemoryHub()
    a = hub.connect("a")
    a.publish("s/x", b"online", retain=True)
    got = []
    hub.connect("late").subscribe("s/+", lambda t, p: got.append(p))
    hub.loop.run()
    assert got == [b"online"]
    a.publish("s/x", b"", retain=True)
    got2 = []
    hub.connect("later").subscribe("s/+", lambda t, p: got2.append(p))
    hub.loop.run()
    assert got2 == []


def test_will_published_on_crash_not_on_close():
    hub = MemoryHub()
    seen = []
    hub.connect("watcher").subscribe("status/#", lambda t, p: seen.append((t, p)))
    hub.connect("d1", will=Will("status/d1", b"offline")).crash()
    hub.connect("d2", will=Will("status/d2", b"offline")).close()
    hub.loop.run()
    assert seen == [("status/d1", b"offline")]


def test_disconnected_client_receives_nothing_and_takeover_replaces_session():
    hub = MemoryHub()
    got = []
    old = hub.connect("x")
    old.subscribe("t", lambda t, p: got.append("old"))
    new = hub.connect("x")  # same client id takes over
    new.subscribe("t", lambda t, p: got.append("new"))
    hub.connect("pub").publish("t", b"1")
    hub.loop.run()
    assert got == ["new"] and not old.connected


def test_virtual_timers_fire_in_time_order_and_cancel():
    loop = VirtualLoop()
    fired = []
    loop.call_later(5, lambda: fired.append((loop.now(), "late")))
    h = loop.call_later(1, lambda: fired.append("cancelled"))
    loop.call_later(2, lambda: fired.append((loop.now(), "early")))
    loop.cancel(h)
    loop.run()
    assert fired == [(2.0, "early"), (5.0, "late")]


def test_indexed_routing_matches_a_linear_scan_in_order_and_content():
    """Exact and wildcard subscriptions, retained messages, unsubscribes and takeovers, in random
    order: every delivery, and its order, is what scanning every subscription and retained message
    (the hub's reference semantics) gives."""
    import random

    from protocols.transport.base import topic_matches as matches

    rnd = random.Random(7)
    levels = ["a", "b", "c"]
    topics = ["/".join(rnd.choice(levels) for _ in range(rnd.randint(1, 3))) for _ in range(12)]
    patterns = topics + ["+", "#", "a/+", "a/#", "+/b", "a/+/c", "+/+/+", "b/#", "a/b/#", "+/#"]
    hub = MemoryHub()
    got: list[tuple[str, str, bytes]] = []
    subs: list[tuple[str, str, int]] = []  # reference: (client, pattern, tag), in subscription order
    retained: dict[str, bytes] = {}
    expected: list[tuple[str, str, bytes]] = []
    clients = {c: hub.connect(c) for c in ("x", "y", "z")}
    for step in range(600):
        op = rnd.random()
        client = rnd.choice(list(clients))
        if op < 0.3:
            pattern, tag = rnd.choice(patterns), step
            clients[client].subscribe(pattern, lambda t, p, tag=f"{client}{tag}": got.append((tag, t, p)))
            subs.append((client, pattern, step))
            expected += [(f"{client}{step}", t, p) for t, p in retained.items() if matches(pattern, t)]
        elif op < 0.4:
            pattern = rnd.choice(patterns)
            clients[client].unsubscribe(pattern)
            subs = [s for s in subs if not (s[0] == client and s[1] == pattern)]
        elif op < 0.43:
            clients[client] = hub.connect(client)  # takeover: the old session's subscriptions go
            subs = [s for s in subs if s[0] != client]
        else:
            topic, payload = rnd.choice(topics), rnd.choice([b"", b"1", b"22"])
            retain = rnd.random() < 0.4
            clients[client].publish(topic, payload, retain=retain)
            if retain and payload:
                retained[topic] = payload
            elif retain:
                retained.pop(topic, None)
            expected += [(f"{c}{tag}", topic, payload) for c, p, tag in subs if matches(p, topic)]
        if rnd.random() < 0.2:
            hub.loop.run()
    hub.loop.run()
    assert len(expected) > 500 and got == expected


def test_a_topics_subscriptions_are_looked_up_once_until_a_subscription_changes(monkeypatch):
    """A run publishes on the same topics every round: the hub looks a topic's subscriptions up once, and again
    after any subscribe or unsubscribe (the new subscriber gets the next message, the one gone does not)."""
    hub = MemoryHub()
    lookups: list[str] = []
    match = hub._match
    monkeypatch.setattr(hub, "_match", lambda topic: lookups.append(topic) or match(topic))
    got: list[tuple[str, bytes]] = []
    a, b = hub.connect("a"), hub.connect("b")
    a.subscribe("r/+/result", lambda t, p: got.append(("a", p)))
    for i in range(3):
        b.publish("r/d1/result", b"%d" % i)
    hub.loop.run()
    assert lookups == ["r/d1/result"] and got == [("a", b"0"), ("a", b"1"), ("a", b"2")]
    b.subscribe("r/d1/#", lambda t, p: got.append(("b", p)))
    a.publish("r/d1/result", b"3")
    a.unsubscribe("r/+/result")
    a.publish("r/d1/result", b"4")
    hub.loop.run()
    assert lookups == ["r/d1/result"] * 3 and got[3:] == [("a", b"3"), ("b", b"3"), ("b", b"4")]


def test_a_subscription_that_comes_or_goes_looks_up_again_only_the_topics_it_matches(monkeypatch):
    """A sim's device agent subscribes its own task topic as it is built and unsubscribes as it is dropped: only the
    topics a wildcard pattern matches are looked up again, not every topic the run publishes on (each was, every round),
    and an exact one's topic not at all; what each subscriber gets is as before."""
    hub = MemoryHub()
    lookups: list[str] = []
    match = hub._match
    monkeypatch.setattr(hub, "_match", lambda topic: lookups.append(topic) or match(topic))
    got: list[tuple[str, str]] = []
    cell, pop, d1 = hub.connect("cell"), hub.connect("population"), hub.connect("d1")
    cell.subscribe("r/+/result", lambda t, p: got.append(("cell", t)))
    pop.subscribe("t/+/task", lambda t, p: got.append(("pop", t)))
    topics = ["r/d1/result", "r/d2/result", "t/d1/task", "t/d2/task"]

    def publish_all() -> None:
        for topic in topics:
            cell.publish(topic, b"x")
        hub.loop.run()

    publish_all()
    d1.subscribe("t/d1/task", lambda t, p: got.append(("d1", t)))  # exact: that topic alone
    publish_all()
    d1.subscribe("t/+/#", lambda t, p: got.append(("d1#", t)))  # a wildcard: the topics it matches
    publish_all()
    d1.close()  # both gone: the topics they matched
    publish_all()
    # (an exact subscription's topic is not looked up again: its route is kept with the subscription merged in or out)
    assert lookups == [*topics, "t/d1/task", "t/d2/task", "t/d1/task", "t/d2/task"]
    each = [("cell", "r/d1/result"), ("cell", "r/d2/result"), ("pop", "t/d1/task"), ("pop", "t/d2/task")]
    assert got == [
        *each,
        *each[:3],
        ("d1", "t/d1/task"),
        each[3],
        *each[:3],
        ("d1", "t/d1/task"),
        ("d1#", "t/d1/task"),
        each[3],
        ("d1#", "t/d2/task"),
        *each,
    ]


def test_kept_routes_are_what_matching_again_finds_as_subscriptions_come_and_go():
    """Routes kept across subscriptions that come and go (exact ones merged in and out in place, wildcard ones
    forgetting what they match) are, at every step, what matching every subscription again finds, in order."""
    import random

    rnd = random.Random(7)
    hub = MemoryHub()
    topics = [f"t/{c}/{d}/task" for c in ("c0", "c1") for d in ("d0", "d1", "d2")]
    patterns = [*topics, "t/+/+/task", "t/c0/#", "t/c1/+/task", "#"]
    clients = [hub.connect(f"n{i}") for i in range(4)]
    for _ in range(300):
        client = rnd.choice(clients)
        if rnd.random() < 0.6:
            client.subscribe(rnd.choice(patterns), lambda t, p: None)
        elif rnd.random() < 0.8:
            client.unsubscribe(rnd.choice(patterns))
        else:
            client.close()
            clients[clients.index(client)] = hub.connect(client.client_id)
        for topic in rnd.sample(topics, 3):  # some routes kept, some not
            hub._matching(topic)
        for topic, route in hub._routes.items():
            fresh = hub._match(topic)
            assert [s.seq for s in route] == [s.seq for s in fresh], topic
            assert hub._reached.get(topic, frozenset(s.side for s in fresh)) == frozenset(s.side for s in fresh)


def test_a_will_made_when_due_is_published_on_a_crash_only():
    """A sim's device agent connects with what makes its will (a signed status record), called only if it crashes."""
    hub = MemoryHub()
    made: list[str] = []

    def will(name: str) -> Will:
        made.append(name)
        return Will(f"status/{name}", b"offline")

    got: list[tuple[str, bytes]] = []
    watcher = hub.connect("watcher")
    watcher.subscribe("status/+", lambda t, p: got.append((t, p)))
    quiet, lost = hub.connect("quiet", will=lambda: will("quiet")), hub.connect("lost", will=lambda: will("lost"))
    quiet.close()
    lost.crash()
    hub.loop.run()
    assert made == ["lost"] and got == [("status/lost", b"offline")]
