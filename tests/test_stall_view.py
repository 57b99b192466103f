"""Stalls are visible: the cloud and the cells publish a retained current state, so a monitor started in the
middle of a stalled round shows what each waits for and flags a round open past its deadline; its header
gives the run's age (not a monotonic clock)."""

from __future__ import annotations

import re
import time
from pathlib import Path

from cell_server.node import build_cell
from cloud.node import build_cloud
from monitor.sources import TelemetryFeed
from monitor.view import MonitorState, render_text
from protocols.status import encode_status
from protocols.transport.memory import MemoryHub
from protocols.wire import topics
from sim.hierarchy import prepare
from tests.conftest import small_config

DEADLINE = 50.0


def test_a_monitor_started_mid_stall_shows_it(tmp_path: Path) -> None:
    """c0's devices are online but never answer; c1 never came. A monitor that subscribes only now gets the
    retained states: the cloud waits for c0 and c1, c0's edge round waits for its three devices, and once the
    rounds are older than their deadlines both are flagged."""
    cfg = small_config(tmp_path, runtime={"heartbeat": 0.0, "heartbeat_timeout": 0.0, "device_deadline": DEADLINE})
    algorithm = cfg.build_algorithm(prepare(cfg).spec)
    hub = MemoryHub()
    cell = build_cell(cfg, "c0", hub.connect("cell.c0"), algorithm, heartbeats=True)
    cloud = build_cloud(cfg, hub.connect("cloud"), algorithm)
    devices = hub.connect("devices")
    for d in ("c0-d0", "c0-d1", "c0-d2"):
        topic = topics.device_status("t", "c0", d)
        devices.publish(topic, encode_status("online", topic=topic, cell="c0", samples=10), retain=True)
    cell.start()
    cloud.start()
    hub.loop.run(until=lambda: bool(cell.planned))
    t0 = time.time()

    feed = TelemetryFeed(hub.connect("monitor"), "t").start()
    got: list[dict] = []
    hub.loop.run(until=lambda: len(got.__iadd__(feed.poll_states())) >= 2)  # the retained ones, at once
    state = MonitorState(run="t")
    for s in got:
        state.add_state(s)
    fresh = render_text(state, now=t0 + 1, width=200)
    assert (
        "round 1: waiting for c0, c1 for" in fresh
    )  # its first round, counted from 1 as closed ones are and "no alerts" in fresh
    late = render_text(state, now=t0 + 4 * DEADLINE, width=200)
    assert "deadline" in late.split("now ", 1)[1].splitlines()[0]
    assert "cell c0 edge round 1.1 open for 200 s, past its 50 s deadline, waiting for c0-d0, c0-d1, c0-d2" in late
    assert "cloud round 1 open for 200 s, past its 160 s deadline, waiting for c0, c1" in late
    assert re.search(r"run started 20[0-2] s ago", late)  # the run started just before t0


def test_fedtier_monitor_started_mid_stall_over_mqtt_flags_it(tmp_path: Path) -> None:
    """Over a broker: the cloud and cell c0 run (in this process); c0's edge round hangs (its deadline timer is
    lost, as in the bug that hung an emulation). ``fedtier monitor --broker --once`` started afterwards shows
    whom c0 waits for and flags the edge round as past its deadline, from the retained states alone."""
    from click.testing import CliRunner

    from fedtier.cli import main
    from protocols.transport.broker import EmbeddedBroker
    from protocols.transport.mqtt import MqttTransport
    from protocols.transport.threadloop import ThreadLoop
    from sim.emulation import _on_loop
    from tests.conftest import wait_until

    cfg = small_config(
        tmp_path,
        run={"name": "stall"},
        topology={"cells": 1, "devices_per_cell": 2},
        runtime={"heartbeat": 0.0, "heartbeat_timeout": 0.0, "device_deadline": 0.5, "startup_wait": 0.0},
    )
    algorithm = cfg.build_algorithm(prepare(cfg).spec)
    loop = ThreadLoop("stall").start()
    with EmbeddedBroker() as broker:
        connect = lambda name: MqttTransport.from_url(broker.url, name, loop).connect()  # noqa: E731
        devices = connect("devices")
        for d in ("c0-d0", "c0-d1"):
            topic = topics.device_status("stall", "c0", d)
            devices.publish(topic, encode_status("online", topic=topic, cell="c0", samples=10), retain=True)
        cell = build_cell(cfg, "c0", connect("cell.c0"), algorithm, heartbeats=True)
        cloud = build_cloud(cfg, connect("cloud"), algorithm)
        try:
            _on_loop(loop, cell.start)
            cell.transport.wait_subscribed()
            _on_loop(loop, cloud.start)
            assert wait_until(lambda: bool(cell.planned) and cell._timer is not None, 30)
            _on_loop(loop, lambda: loop.cancel(cell._timer))  # the hang: nothing will close this edge round
            # no sleep for the edge round to outlast its 0.5 s deadline: --once draws its frame only once the
            # retained states went quiet for 1 s (min(1, --wait)), so the round is > 1 s old by then
            shown = CliRunner().invoke(  # the command in this process: no Python process to start
                main, ["monitor", "--broker", broker.url, "--run", "stall", "--once", "--wait", "3", "--width", "220"]
            )
        finally:
            for node in (cell, cloud):
                _on_loop(loop, node.stop)
            devices.close()
            loop.stop()
    out = " ".join(shown.output.split())
    assert shown.exit_code == 0, shown.output
    assert "round 1: waiting for c0 for" in out
    assert re.search(r"cell c0 edge round 1\.1 open for \d+ s, past its 0\.5 s deadline, waiting for c0-d0, c0-d1", out)
