"""A second agent process under a live device id is refused loudly (``protocols/twin.py``), over a real
Mosquitto (two connections with one client id take the session from each other); a stale retained
"online" left by a crashed predecessor does not block a restart."""

from __future__ import annotations

import functools
import logging
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from edge_agent.runner import AgentProcess, BrokerOptions, make_trainer, save_device_data
from fedtier.cli import main
from protocols.config import RunConfig
from protocols.status import encode_status
from protocols.transport.broker import MosquittoBroker, find_mosquitto
from protocols.transport.mqtt import MqttTransport
from protocols.transport.threadloop import ThreadLoop
from protocols.twin import TwinError, twin_window
from protocols.wire import topics
from sim.hierarchy import prepare
from tests.conftest import small_config, wait_until
from tests.test_twin_node import Spy

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
DEVICE = "c0-d0"
WINDOW = twin_window(0.3)  # the live agent's reconnect, then the refused one's


until = functools.partial(wait_until, timeout=20.0)


def agents_of(tmp_path: Path, url: str, window: float | None, heartbeat: float = 0.3) -> AgentProcess:
    """The (unstarted) agent process of a 1-cell, 1-device config on the broker at ``url``; ``window``: its twin
    check's (None: none)."""
    cfg = small_config(tmp_path, topology={"cells": 1, "devices_per_cell": 1})
    prep = prepare(cfg)
    return AgentProcess(
        cfg,
        cfg.build_algorithm(prep.spec),
        {DEVICE: prep.device_data[DEVICE]},
        make_trainer("torch", prep.spec, cfg),
        BrokerOptions(url),
        heartbeat=heartbeat,
        twin_window=window,
    )


def _config_and_data(tmp_path: Path) -> tuple[RunConfig, Path, Path]:
    """A one-device config file and that device's data file, as ``fedtier agent`` takes them."""
    cfg = small_config(tmp_path, topology={"cells": 1, "devices_per_cell": 1})
    config, data = tmp_path / "run.toml", tmp_path / f"{DEVICE}.npz"
    config.write_text(cfg.to_toml())
    prep = prepare(cfg)
    save_device_data(data, prep.device_data[DEVICE], prep.spec)
    return cfg, config, data


def test_a_second_agent_under_a_live_device_id_is_refused_and_the_first_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fedtier.twin")
    with MosquittoBroker() as broker:
        first = agents_of(tmp_path, broker.url, 0.2).start()
        status = topics.device_status(first.run, "c0", DEVICE)
        spy = Spy(broker.url, status)
        try:
            assert until(lambda: any(r.get("instance") == first.twins.instance for r in spy.records))
            second = agents_of(tmp_path, broker.url, WINDOW)
            started = time.monotonic()
            with pytest.raises(TwinError, match=f"device {DEVICE}: another agent process .* is live"):
                second.start()
            assert time.monotonic() - started < WINDOW + 10
            assert second.twins.twin == (DEVICE, first.twins.instance)
            # the first took its session back, read the refusal, said so loudly and announced itself again
            assert until(lambda: first.twins.taken >= 1)
            assert any("took this agent's broker session" in r.getMessage() for r in caplog.records)
            assert until(lambda: spy.last_is("online", first.twins.instance))
            assert all(r.get("instance") != second.twins.instance or r["state"] == "other" for r in spy.records)
        finally:
            spy.close()
            first.stop()


def test_a_stale_retained_online_of_a_crashed_predecessor_does_not_block_a_restart(tmp_path: Path) -> None:
    with MosquittoBroker() as broker:
        probe = agents_of(tmp_path, broker.url, 0.0)
        status = topics.device_status(probe.run, "c0", DEVICE)
        loop = ThreadLoop("predecessor").start()
        stale = MqttTransport.from_url(broker.url, "predecessor", loop).connect()
        stale.publish(status, encode_status("online", topic=status, cell="c0", instance="crashed0"), retain=True)
        assert stale.flush(10.0)
        stale.close()
        loop.stop()
        spy = Spy(broker.url, status)
        assert until(lambda: [r.get("instance") for r in spy.records] == ["crashed0"])
        agents = agents_of(tmp_path, broker.url, 1.5)
        done = threading.Event()
        try:
            agents.start()
            done.set()
            assert agents.twins.twin is None and agents.twins.seen == {DEVICE: ["crashed0"]}
            assert until(lambda: spy.records[-1].get("instance") == agents.twins.instance)
            assert spy.records[-1]["state"] == "online"
        finally:
            spy.close()
            if done.is_set():
                agents.stop()


def test_fedtier_agent_under_a_live_device_id_exits_2_naming_it(tmp_path: Path) -> None:
    """The command a deployment runs: ``fedtier agent`` (default heartbeat: a 6 s window) refused, exit 2 (its
    systemd unit's ``RestartPreventExitStatus``: not restarted every 5 s, as a refused cloud or cell)."""
    assert twin_window(5.0) == 6.0
    _, config, data = _config_and_data(tmp_path)
    with MosquittoBroker() as broker:
        first = agents_of(tmp_path, broker.url, 0.2).start()
        try:
            command = ["agent", str(config), "--device", DEVICE, "--data", str(data), "--broker", broker.url]
            res = CliRunner().invoke(main, [*command, "--insecure"])  # in this process: no torch to import again
            said = " ".join(res.output.split())
            assert res.exit_code == 2, said + repr(res.exception)
            assert f"device {DEVICE}: another agent process (instance {first.twins.instance}) is live" in said
            assert said.count("refusing to start a second one") == 1, said  # once: it was logged, then said
            assert until(lambda: first.twins.taken >= 1)
        finally:
            first.stop()


def test_fedtier_agent_serve_under_a_live_device_id_is_refused_before_its_first_job_exit_2(tmp_path: Path) -> None:
    """``fedtier agent --serve`` met the check only when its first job started (its agents'): until then its watch
    connection, under the device's client id, took the live agent's broker session from it again and again and said
    the device idle over the live one's status. Its first watch connection is checked now (``protocols.twin.NodeTwin``
    on the device's status topic; the agents' wills name their instance, as the cloud's and cells' do, so the live one
    shows at each takeover): refused before it announces anything, exit 2, the same message."""
    cfg, config, data = _config_and_data(tmp_path)
    with MosquittoBroker() as broker:
        first = agents_of(tmp_path, broker.url, 0.2).start()
        status = topics.device_status(first.run, "c0", DEVICE)
        spy = Spy(broker.url, status)
        try:
            command = ["agent", str(config), "--serve", "--device", DEVICE, "--data", str(data), "--broker", broker.url]
            started = time.monotonic()
            res = CliRunner().invoke(main, [*command, "--insecure"])
            said = " ".join(res.output.split())
            assert res.exit_code == 2, said + repr(res.exception)
            assert f"device {DEVICE}: another agent process (instance {first.twins.instance}) is live" in said
            assert said.count("refusing to start a second one") == 1, said  # once: it was logged, then said
            assert f"device {DEVICE} of federation 't' (" in said and "then serving the federation's jobs" in said
            assert time.monotonic() - started < twin_window(cfg.runtime.heartbeat) + 5
            assert until(lambda: first.twins.taken >= 1)  # it saw the takeover and announced itself again
            assert until(lambda: spy.last_is("online", first.twins.instance))
            assert not any(r["state"] == "idle" for r in spy.records)  # the refused one never said the device idle
        finally:
            spy.close()
            first.stop()
