"""A second long-lived cloud or cell process of one node, on another folder or machine, is refused loudly
(``protocols.twin.NodeTwin``): over a real Mosquitto, where two connections with one client id take the session
from each other. The first says its session was taken and announces itself again; a restart right after a kill -9
(the predecessor's record and its will on the broker) is not refused."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from cell_server.service import CellService
from cloud.jobs import JobQueue
from cloud.service import CloudService
from edge_agent.broker import BrokerOptions, offline_will
from protocols import runfiles
from protocols.config import RunConfig
from protocols.status import IDLE, decode_status, encode_status
from protocols.transport.broker import MosquittoBroker, find_mosquitto
from protocols.transport.mqtt import MqttTransport
from protocols.transport.threadloop import ThreadLoop
from protocols.twin import NODE_WINDOW, SETTLE, TwinError
from protocols.wire import topics
from sim.local_federation import federation_bundle
from tests.conftest import small_config, wait_until

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
NODES = {"cloud": "cloud", "cell": "cell.c0"}  # kind -> node id (client id, status topic)
MQTT_LOG = "protocols.transport.mqtt"  # its logger: a lost connection is said there


def service_of(kind: str, bundle: RunConfig, url: str, folder: Path, window: float) -> Any:
    """An idle long-lived cloud or cell of ``bundle`` (its own run folder, ``fedtier cloud|cell --serve``'s will)."""
    loop, node = ThreadLoop(kind), NODES[kind]
    service: Any = None

    def connect() -> MqttTransport:
        will = offline_will(bundle.run.name, node, None, service.twin.instance)
        made = BrokerOptions(url).transport(node, bundle.run.name, loop, will=will)  # the CLI's client id
        return service.twin.borrow(made).connect()  # as fedtier/serve.py's

    if kind == "cloud":
        queue = JobQueue(folder / "jobs.json")
        service = CloudService(bundle, loop, connect, queue, None, trust=None, operator=None, twin_window=window)  # type: ignore[arg-type]
    else:
        service = CellService(bundle, "c0", loop, connect, lambda *_: None, None, twin_window=window)  # type: ignore[arg-type,return-value]
    return service


class Spy:
    """The node's retained status records, as a reader (the fleet view, a cell) gets them."""

    def __init__(self, url: str, topic: str) -> None:
        self.loop = ThreadLoop("spy").start()
        self.records: list[dict[str, Any]] = []
        self.transport = MqttTransport.from_url(url, "spy", self.loop)
        self.transport.subscribe(topic, lambda t, b: self.records.append(decode_status(b) or {"state": "other"}))
        self.transport.connect()

    def last_is(self, state: str, instance: str) -> bool:
        return (
            bool(self.records)
            and self.records[-1].get("state") == state
            and self.records[-1].get("instance") == instance
        )

    def close(self) -> None:
        self.transport.close()
        self.loop.stop()


@contextmanager
def serving(service: Any) -> Iterator[threading.Thread]:
    thread = threading.Thread(target=service.serve, name="first", daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        service.stop()
        thread.join(10)


@pytest.fixture
def broker() -> Iterator[MosquittoBroker]:
    with MosquittoBroker() as running:
        yield running


@pytest.mark.parametrize("kind", ["cloud", "cell"])
def test_a_second_process_of_a_live_cloud_or_cell_is_refused_naming_it_and_the_first_says_so(
    kind: str, tmp_path: Path, broker: MosquittoBroker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fedtier.twin")
    caplog.set_level(logging.INFO, logger=MQTT_LOG)
    bundle = federation_bundle(small_config(tmp_path, monitoring={"idle_heartbeat": 60.0}))  # no beat meanwhile
    first = service_of(kind, bundle, broker.url, tmp_path / "a", 0.3)
    spy = Spy(broker.url, topics.status(bundle.run.name, NODES[kind]))
    try:
        with serving(first):
            assert wait_until(lambda: spy.last_is(IDLE, first.twin.instance))
            second = service_of(kind, bundle, broker.url, tmp_path / "b", NODE_WINDOW)  # another folder or machine
            started = time.monotonic()
            with pytest.raises(TwinError) as refused:
                second.serve()
            said = f"node {NODES[kind]}: another {kind} process (instance {first.twin.instance}) is live"
            assert said in str(refused.value)
            assert time.monotonic() - started < NODE_WINDOW + 1  # it found the first within the window
            # the second lost its connection to the first taking the session back (how the first shows twice):
            # expected during its check, so said at info with why, not warned of before its refusal
            expected = [
                r for r in caplog.records if "lost connection" in r.getMessage() and "while checking" in r.getMessage()
            ]
            assert expected and all(r.levelno == logging.INFO for r in expected), caplog.text
            assert f"while checking that no other {kind} process is live under this id" in expected[0].getMessage()
            # the first took its session back, read the refusal, said so loudly and announced itself again
            assert wait_until(lambda: first.twin.watch.taken >= 1)
            assert any(f"took this {kind}'s broker session" in r.getMessage() for r in caplog.records)
            assert wait_until(lambda: spy.last_is(IDLE, first.twin.instance))
    finally:
        spy.close()


@pytest.mark.parametrize("kind", ["cloud", "cell"])
def test_a_restart_right_after_a_kill_9_is_not_refused(kind: str, tmp_path: Path, broker: MosquittoBroker) -> None:
    """The killed process left its idle record, then its will (the broker drops its connection), which its persistent
    session also queued for the node: the restarted one gets it twice on its first connection, as a queued message
    and as the retained record, and counts it once (it counted both before, and was refused: walked with
    tests/test_federation.py's kill -9 of the cloud)."""
    bundle = federation_bundle(small_config(tmp_path))
    node, fed = NODES[kind], bundle.run.name
    topic = topics.status(fed, node)
    loop = ThreadLoop("killed").start()
    killed = BrokerOptions(broker.url).transport(node, fed, loop, will=offline_will(fed, node, None, "killed0"))
    killed.subscribe(topic, lambda t, b: None)  # as a service does: its persistent session queues its will for it
    killed.connect().publish(topic, encode_status(IDLE, topic=topic, instance="killed0"), retain=True)
    assert killed.flush(10.0)
    killed.crash()  # kill -9: no DISCONNECT, the broker publishes the will
    loop.stop()
    spy = Spy(broker.url, topic)
    try:
        assert wait_until(lambda: spy.last_is("offline", "killed0"))
        restarted = service_of(kind, bundle, broker.url, tmp_path, NODE_WINDOW)
        started = time.monotonic()
        with serving(restarted):
            assert wait_until(lambda: spy.last_is(IDLE, restarted.twin.instance))
            assert time.monotonic() - started < SETTLE + 1  # never taken over: it did not wait the whole window
            assert restarted.twin.watch.twin is None and restarted.twin.watch.seen == {node: ["killed0"]}
    finally:
        spy.close()


def test_a_predecessors_will_held_until_a_resumed_job_takes_it_is_no_takeover(caplog) -> None:
    """A cloud restarted after a kill -9 with a job running: its check sees the predecessor's retained will once and
    starts; the copy its persistent session queued is held until the resumed job's handler of status/+ comes, and
    reached the watch after the check: it logged ERROR 'another cloud process (instance ...) connected under this
    node id and took this cloud's broker session; stop the other one' (walked: kill -9 of a serving cloud mid-job,
    restarted at once). A record of that instance in that burst is now said at info; one later, or of an instance
    the check never saw, is still a takeover."""
    from protocols.twin import GRACE, TwinWatch

    topic, taken = topics.status("fed", "cloud"), []
    watch = TwinWatch("restarted", kind="cloud", noun="node")
    will = offline_will("fed", "cloud", None, "killed0").payload
    watch.checking = True
    watch.on_status("cloud", topic, will, None, lambda: taken.append(1), epoch=0)
    watch.checking = False  # the check is over: one record of killed0, no twin
    assert watch.twin is None and watch.seen == {"cloud": ["killed0"]}
    with caplog.at_level(logging.INFO, logger="fedtier.twin"):
        watch.on_status("cloud", topic, will, None, lambda: taken.append(1))  # the held copy, late
        watch.on_status(
            "cloud", topic, encode_status(IDLE, topic=topic, instance="killed0"), None, lambda: taken.append(1)
        )
        assert taken == [] and not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
        assert "a record its predecessor (instance killed0) left on the broker came late" in caplog.text
        watch.on_status(
            "cloud", topic, offline_will("fed", "cloud", None, "live1").payload, None, lambda: taken.append(1)
        )
        assert taken == [1]  # an instance the check never saw: a takeover
        watch._late["killed0"] -= GRACE  # long after the burst
        watch.on_status("cloud", topic, will, None, lambda: taken.append(1))
        assert taken == [1, 1]


def test_a_predecessors_record_a_restored_broker_hands_again_is_no_twin(caplog: pytest.LogCaptureFixture) -> None:
    """Walked: a broker restored from an autosave taken before a node restarted still held the old process's retained
    status record, handed to the live node as it reconnected: the agent and the cloud logged ERROR 'another ...
    process (instance ...) announces itself under this ... id', and the old record stayed the node's. An instance
    started before this one (its nonce says when) is its predecessor: said once at info, and the node announces
    itself again at each of its records; one started after it is still another live process, said at error."""
    from protocols.twin import TwinWatch, new_instance, started_of

    assert abs((started_of(new_instance()) or 0) - time.time()) < 5 and started_of("killed0") is None
    topic, taken, now = topics.status("fed", "cloud"), [], int(time.time())
    old, later = f"{'0' * 16}-{now - 60:x}", f"{'1' * 16}-{now + 60:x}"
    watch = TwinWatch(f"{'2' * 16}-{now:x}", kind="cloud", noun="node")
    with caplog.at_level(logging.INFO, logger="fedtier.twin"):
        for record in (
            encode_status("online", topic=topic, instance=old),
            offline_will("fed", "cloud", None, old).payload,
        ):
            watch.on_status("cloud", topic, record, None, lambda: taken.append(1))
        said = [(r.levelno, r.getMessage()) for r in caplog.records]
        assert taken == [1, 1] and watch.taken == 0 and len(said) == 1 and said[0][0] == logging.INFO, said
        assert f"a record of its predecessor (instance {old}, started before this cloud)" in said[0][1]
        watch.on_status("cloud", topic, encode_status("online", topic=topic, instance=later), None, lambda: None)
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and f"(instance {later}) announces itself" in errors[0], errors


def test_a_refused_second_process_is_said_once_with_nothing_to_stop(caplog: pytest.LogCaptureFixture) -> None:
    """Walked: a second `fedtier cloud --serve` started by mistake beside a serving one, refused, exit 2. The serving
    cloud took its session back and got the refusal twice (queued in its session, then retained): it logged two
    identical ERRORs, each 'stop the other one' of a process that had exited. A refusal is said once, at warning,
    saying there is nothing to stop; a live process's will (a real takeover) is still an error, once per instance;
    every such record still re-announces this one."""
    from protocols.twin import TwinWatch

    topic, taken = topics.status("fed", "cloud"), []
    watch, refused = TwinWatch("serving", kind="cloud", noun="node"), TwinWatch("second", kind="cloud", noun="node")
    refusal = refused.refusal(topic, None)
    with caplog.at_level(logging.INFO, logger="fedtier.twin"):
        for _ in range(2):
            watch.on_status("cloud", topic, refusal, None, lambda: taken.append(1))
        said = [(r.levelno, r.getMessage()) for r in caplog.records]
        assert len(said) == 1 and said[0][0] == logging.WARNING, said
        assert "instance second) connected under this node id and took this cloud's broker session" in said[0][1]
        assert "it was refused and exited, nothing to stop" in said[0][1] and "stop the other" not in said[0][1]
        will = offline_will("fed", "cloud", None, "live1").payload
        for _ in range(2):
            watch.on_status("cloud", topic, will, None, lambda: taken.append(1))
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "instance live1" in errors[0] and "stop the other one" in errors[0], errors
    assert taken == [1, 1, 1, 1]


@pytest.mark.parametrize("kind", ["cloud", "cell"])
def test_fedtier_serve_beside_a_live_cloud_or_cell_exits_2_naming_it(
    kind: str, tmp_path: Path, broker: MosquittoBroker
) -> None:
    """The command a deployment runs: refused as the folder lock refuses, exit 2 (``RestartPreventExitStatus``),
    leaving its folder as it was but for its lock: no job queue (a cloud wrote an empty ``jobs.json`` before its
    check), nothing a later start there would take for its state."""
    from click.testing import CliRunner

    from fedtier.cli import main

    cfg = small_config(tmp_path / "a", monitoring={"idle_heartbeat": 60.0})
    first = service_of(kind, federation_bundle(cfg), broker.url, tmp_path / "a", 0.3)
    other = cfg.model_copy(update={"run": cfg.run.model_copy(update={"output": str(tmp_path / "b")})})
    config = tmp_path / "node.toml"
    config.write_text(other.to_toml())
    with serving(first):
        assert wait_until(lambda: first.twin.watch.own != {})
        args = [
            kind,
            str(config),
            "--serve",
            "--broker",
            broker.url,
            "--insecure",
            *(["--cell", "c0"] * (kind == "cell")),
        ]
        res = CliRunner().invoke(main, args)
        said = " ".join(res.output.split())
        assert res.exit_code == 2, said + repr(res.exception)
        assert f"node {NODES[kind]}: another {kind} process (instance {first.twin.instance}) is live" in said
        assert said.count("refusing to start a second one") == 1, said  # once: it was logged, then said as the error
        node = (
            "cloud" if kind == "cloud" else "cell c0"
        )  # its first line (a long-lived node said nothing until it stopped)
        assert f"{node} of federation 't' (its job" in said and f"connecting to {broker.url}, then" in said, said
        assert sorted(p.name for p in other.output_dir().iterdir()) == [f"{kind}{'-c0' * (kind == 'cell')}.lock"]


@pytest.mark.parametrize("kind", ["cloud", "cell"])
def test_a_cloud_or_cell_whose_connection_drops_announces_itself_again_over_its_will(
    kind: str, tmp_path: Path, broker: MosquittoBroker
) -> None:
    """A network blip: the broker loses the node's connection and says its will (offline, retained) while the process
    lives and reconnects. Nothing said it live again until its next beat (a cloud serving a job: until the job
    ended), so `fedtier jobs`, a monitor and the cells read a live cloud as offline. Its own will coming back on its
    new connection now makes it announce itself again; its clean offline as it stops does not."""
    import socket

    bundle = federation_bundle(small_config(tmp_path, monitoring={"idle_heartbeat": 60.0}))  # no beat meanwhile
    service = service_of(kind, bundle, broker.url, tmp_path / "a", 0.3)
    made: list[MqttTransport] = []
    name = "_connect" if kind == "cloud" else "connect"
    connect = getattr(service, name)
    setattr(service, name, lambda: made.append(connect()) or made[-1])
    spy = Spy(broker.url, topics.status(bundle.run.name, NODES[kind]))
    try:
        with serving(service):
            me = service.twin.instance
            assert wait_until(lambda: spy.last_is(IDLE, me))
            made[-1]._client.socket().shutdown(socket.SHUT_RDWR)  # the network drops it
            assert wait_until(lambda: any(r.get("state") == "offline" for r in spy.records)), spy.records  # its will
            assert wait_until(lambda: spy.last_is(IDLE, me), timeout=10.0), spy.records  # and back
        assert wait_until(lambda: spy.last_is("offline", me)), spy.records  # stopped: offline, not announced again
        time.sleep(0.3)  # (nothing may follow it: a re-announce would come within a few ms)
        assert spy.last_is("offline", me), spy.records
    finally:
        spy.close()


def test_fedtier_run_beside_a_live_run_of_its_name_exits_1_and_one_killed_does_not_block_it(
    tmp_path: Path, broker: MosquittoBroker
) -> None:
    """Two ``fedtier run``s of one name on one external broker both started: their clouds and cells took each
    other's sessions every second and neither closed round 0 in 10 minutes (walked, session 23). The second is
    refused now, naming the live one and what to do, by a client of its own (the live run loses nothing); a run of
    the name killed -9 (the broker said its will: offline) does not block it."""
    from click.testing import CliRunner

    from fedtier.cli import main
    from sim.local_federation import refuse_live_run

    cfg = small_config(tmp_path, run={"rounds": 1})
    config = tmp_path / "run.toml"
    config.write_text(cfg.to_toml())
    topic = topics.status(cfg.run.name, topics.cell_node("c1"))
    loop = ThreadLoop("live").start()
    live = BrokerOptions(broker.url).transport(
        "cell.c1", cfg.run.name, loop, will=offline_will(cfg.run.name, "cell.c1")
    )
    try:
        live.connect().publish(topic, encode_status("online", topic=topic, instance="live0"), retain=True)
        assert live.flush(10.0)
        res = CliRunner().invoke(main, ["run", str(config), "--broker", broker.url, "--no-progress"])
        said = " ".join(res.output.split())
        assert res.exit_code == 1, said + repr(res.exception)
        assert (
            f"run 't': another run or federation of this name is live on the broker at {broker.url} (its cell.c1"
            in said
        )
        assert "give this run another name (--set run.name=...), or stop the other run first" in said
        assert not (cfg.output_dir() / runfiles.METRICS).exists()  # refused before its cloud started
        live.crash()  # kill -9: the broker says its will
        spy = Spy(broker.url, topic)
        try:
            assert wait_until(lambda: bool(spy.records) and spy.records[-1].get("state") == "offline")
        finally:
            spy.close()
        refuse_live_run(BrokerOptions(broker.url), cfg)  # no live node of the run: nothing raised
    finally:
        live.close()
        loop.stop()


def test_a_refused_second_cell_leaves_what_the_live_cells_session_received_to_it(
    tmp_path: Path, broker: MosquittoBroker
) -> None:
    """Walked: a second `fedtier cell --serve` started by mistake beside a provisioned fleet's live cell mid-job; its
    check took the live cell's session over twice (as it must: two connections under one client id), and the device
    results the broker handed it meanwhile it acknowledged, so they were lost to the live cell: its round waited out
    its device deadline (20 s). The check holds every acknowledgement back now: a message sent to the cell while the
    second one held its session reaches the live cell when it takes the session back. Here the live cell is a
    connection of its client id with its will, subscribed to a stream of numbered messages sent every 20 ms for as
    long as the second process checks (without the fix 44-48 of ~60 were lost); and what the live cell publishes
    meanwhile (a stream of its own, as its tasks and reports) is not lost either: queued while its session is taken,
    sent as it is back."""
    bundle = federation_bundle(small_config(tmp_path))
    fed, node = bundle.run.name, NODES["cell"]
    stream, back, got, echoed = f"{fed}/test/stream", f"{fed}/test/back", [], []
    loop = ThreadLoop("live").start()
    live = BrokerOptions(broker.url).transport(node, fed, loop, will=offline_will(fed, node, None, "live0"))
    live.subscribe(stream, lambda t, b: got.append(int(b)))
    status = topics.status(fed, node)
    live.connect().publish(status, encode_status(IDLE, topic=status, instance="live0"), retain=True)  # as it serves
    sender_loop = ThreadLoop("sender").start()
    sender = MqttTransport.from_url(broker.url, "sender", sender_loop)
    sender.subscribe(back, lambda t, b: echoed.append(int(b)))
    sender.connect()
    sent, stop = [], threading.Event()

    def send() -> None:
        while not stop.wait(0.02):
            sent.append(len(sent))
            sender.publish(stream, str(sent[-1]).encode())
            live.publish(back, str(sent[-1]).encode())

    thread = threading.Thread(target=send, name="sender", daemon=True)
    try:
        thread.start()
        assert wait_until(lambda: len(got) >= 5)  # (and the live connection is older than paho_client.LONG_LIVED)
        second = service_of("cell", bundle, broker.url, tmp_path / "b", NODE_WINDOW)
        with pytest.raises(TwinError, match="instance live0"):
            second.serve()
        stop.set()
        thread.join(5)
        assert sender.flush(10.0) and wait_until(lambda: live.reconnects >= 2)  # the check took it over twice
        assert wait_until(lambda: set(got) >= set(sent), 10.0), sorted(set(sent) - set(got))
        assert wait_until(lambda: set(echoed) >= set(sent), 10.0), sorted(set(sent) - set(echoed))
    finally:
        stop.set()
        sender.close()
        live.close()
        sender_loop.stop()
        loop.stop()


def test_a_runs_long_lived_agents_alone_block_a_fedtier_run_of_its_name(
    tmp_path: Path, broker: MosquittoBroker
) -> None:
    """A federation whose cloud and cells are down, its long-lived agents idle: a `fedtier run` of its name on its
    broker was not refused (only a live cloud or cell blocked it); walked with two `fedtier agent --serve`: both
    took the run's job as their federation's ("job run-... taken"), and they and the run's devices, under one client
    id each, took each other's broker sessions ("another agent process ... took this agent's broker session"). An
    agent's idle record (what `fedtier agent --serve` says between jobs) blocks it now, naming the device; its will
    (the agent stopped or died) does not."""
    from edge_agent.broker import device_will
    from sim.local_federation import refuse_live_run

    cfg = small_config(tmp_path)
    run, topic = cfg.run.name, topics.device_status(cfg.run.name, "c0", "c0-d0")
    loop = ThreadLoop("agent").start()
    agent = BrokerOptions(broker.url).transport(
        "device.c0-d0", run, loop, persistent=False, will=device_will(run, "c0", "c0-d0", None, "agent0")
    )
    try:
        agent.connect().publish(topic, encode_status(IDLE, topic=topic, instance="agent0"), retain=True)
        assert agent.flush(10.0)
        with pytest.raises(
            TwinError, match=r"another run or federation of this name is live .* \(its device\.c0-d0, instance agent0"
        ):
            refuse_live_run(BrokerOptions(broker.url), cfg)
        agent.crash()  # the broker says its will
        spy = Spy(broker.url, topic)
        try:
            assert wait_until(lambda: bool(spy.records) and spy.records[-1].get("state") == "offline")
        finally:
            spy.close()
        refuse_live_run(BrokerOptions(broker.url), cfg)  # nothing raised
    finally:
        agent.close()
        loop.stop()
