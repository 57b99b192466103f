"""The HIST paper's communication unit (per-device upload in full models) is derived from the bytes devices send,
counted over the devices actually aggregated: an uplink codec shrinks it, robust aggregation does not inflate it."""

from __future__ import annotations

import numpy as np
import pytest

from protocols.algorithms.codecs import make_codec
from protocols.algorithms.fedavg import FedAvgParams, sent_bytes
from sim.launcher import run_simulation


def _units(result) -> list[float]:
    return [rec["metrics"]["upload_units"] for rec in result.history]


def test_units_follow_the_bytes_an_uplink_codec_sends(make_config):
    dense = run_simulation(make_config(run={"rounds": 2}), write_output=False)
    signs = run_simulation(make_config(run={"rounds": 2}, algorithm={"uplink": "signsgd"}), write_output=False)
    assert _units(dense) == pytest.approx([2.0, 2.0])  # E = 2 edge rounds of the dense float32 model
    # signsgd: packed sign bits (and a scale a tensor); a unit is the dense model's 4 bytes a value
    model = dense.params
    full = 4 * sum(v.size for v in model.values())
    encoded = make_codec(FedAvgParams(name="fedavg", uplink="signsgd")).encode(
        {k: np.random.default_rng(0).normal(size=v.shape).astype(np.float32) for k, v in model.items()}, 0
    )
    assert _units(signs) == pytest.approx([2 * sent_bytes(encoded) / full] * 2)
    assert 2 / 32 <= _units(signs)[0] < 2 / 25  # ~1 bit of the dense model's 32 a value, not 2.0
    # the units fall with the measured device uplink bytes (those also carry framing and metadata)
    up = [r.history[-1]["cumulative_bytes"]["device_to_cell"] for r in (dense, signs)]
    assert up[0] / up[1] > 8 and _units(dense)[-1] / _units(signs)[-1] > up[0] / up[1]


def test_devices_robust_aggregation_leaves_out_do_not_inflate_the_units(make_config):
    # krum keeps one device of each cell's 3 an edge round: the unit counts what the kept devices sent,
    # per kept device (before: every device's values over the kept devices, up to 3x)
    cfg = make_config(run={"rounds": 2}, algorithm={"cell_aggregator": "krum", "uplink": "signsgd"})
    krum = run_simulation(cfg, write_output=False)
    mean = run_simulation(make_config(run={"rounds": 2}, algorithm={"uplink": "signsgd"}), write_output=False)
    assert any(rec.get("excluded") for rec in krum.cell_records)  # devices really were left out
    for k, m in zip(_units(krum), _units(mean)):
        # per kept device: 1 or 2 edge rounds' uploads (a device kept once counts one), never more than E
        assert m / 2 - 1e-9 <= k <= m + 1e-9
