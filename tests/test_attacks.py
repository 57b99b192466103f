"""Every attack of issue 13 against a signed ``fedtier run`` over Mosquitto: each is refused with a
logged reason and the final model is the clean run's, bit for bit; the 500 MB chunk announcement
leaves the receiving process's peak memory where the clean run's was. (The broker-level ACL attacks:
``tests/test_provision.py``.)"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from protocols.transport.broker import MosquittoBroker, find_mosquitto
from protocols.wire.keys import generate_keys, write_keys
from sim.attacker import ATTACKS, Attacker
from sim.emulation import Emulation
from tests.conftest import small_config

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
MAX_CHUNK = 4096  # the model (9.6 KB) travels as signed chunks


def peak_rss_reset() -> None:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def run(cfg, broker, attacker_factory=None):
    attacker = attacker_factory(broker.url) if attacker_factory else None
    if attacker is not None:
        attacker.start()
    peak_rss_reset()
    base = rss_kb("VmRSS")
    try:
        result = Emulation(cfg, broker_url=broker.url, workers=1, max_chunk=MAX_CHUNK).run()
    finally:
        if attacker is not None:
            attacker.stop()
    return result, attacker, rss_kb("VmHWM") - base


def test_every_attack_is_refused_logged_and_the_model_is_the_clean_runs(tmp_path: Path, caplog, capfd) -> None:
    keys = tmp_path / "keys.toml"
    cfg0 = small_config(tmp_path, run={"rounds": 2}, runtime={"device_deadline": 5.0, "heartbeat": 0.5})
    ring = generate_keys(cfg0.topology)
    write_keys(keys, ring)
    cfg = small_config(tmp_path / "a", run={"rounds": 2}, security={"keys": str(keys)})
    with MosquittoBroker() as broker:
        # run A: clean, while an eavesdropper records genuine signed tasks (for the cross-run replays)
        clean, spy, clean_peak = run(cfg, broker, lambda url: Attacker.capture(cfg.run.name, url, ring))
        assert set(spy.captured) == {"cell_task", "device_task", "device_result"}
        # run B: same keys, same run name, under attack
        attacked_cfg = small_config(tmp_path / "b", run={"rounds": 2}, security={"keys": str(keys)})
        with caplog.at_level(logging.WARNING):
            attacked, attacker, attacked_peak = run(
                attacked_cfg, broker, lambda url: Attacker(cfg.run.name, url, ring, captured=spy.captured)
            )
    logs = caplog.text + capfd.readouterr().err  # the cells' (this process) and the agents' (a worker)
    assert sorted(attacker.fired) == sorted(a.name for a in ATTACKS), set(a.name for a in ATTACKS) - set(attacker.fired)
    missing = [a.name for a in ATTACKS if a.log not in logs]
    assert not missing, f"not refused with the expected reason: {missing}"
    assert len(attacked.history) == 2
    assert clean.params.keys() == attacked.params.keys()
    assert all(np.array_equal(clean.params[k], attacked.params[k]) for k in clean.params)
    records = attacked.cell_records
    assert all(
        sorted(r["answered"]) == sorted(r["planned"]) == sorted(cfg.topology.device_ids(r["cell"])) for r in records
    ), records  # no genuine answer lost, no device excluded
    # a 43-byte header announcing 500 MB costs the receiving cell nothing: peak RSS as in the clean run
    print(f"peak RSS growth: clean run {clean_peak} kB, attacked run {attacked_peak} kB")
    assert attacked_peak < 128 * 1024, (clean_peak, attacked_peak)  # MB of growth, far below the 500 MB announced
