"""DP noise in deployments comes from a secret: a provisioned bundle (which holds ``run.seed``) cannot
regenerate it, unless the operator set an integer ``privacy.noise_seed``, which is kept with a warning
saying who can then remove the noise. ``fedtier sim``/``run`` keep their reproducible seeds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from click.testing import CliRunner

from fedtier.cli import main
from fedtier.provisioning import provision
from protocols.algorithms.base import DeviceContext, DeviceRole
from protocols.config import deployment_config, load_config
from protocols.privacy.dp import NOISE, DpSettings, PrivateDevice
from protocols.seeding import rng
from protocols.wire.payload import Payload
from tests.conftest import small_config

DP = {"dp": "local", "noise_multiplier": 1.0, "clip": 1.0}
CTX = DeviceContext(seed=0, round=2, edge_round=1, cell="c0", device="c0-d0")


class Zero(DeviceRole):
    """A device whose update is zero: what it sends under DP is its noise alone."""

    def train(self, task, data, trainer, ctx):  # type: ignore[no-untyped-def]
        return Payload({"weight": 30, "steps": 12}, {"w": np.zeros(64, np.float32)})


def noise_of(cfg) -> np.ndarray:  # type: ignore[no-untyped-def]
    """The noise a device of ``cfg`` adds, as its runtime builds the role."""
    pv = cfg.privacy
    dp = DpSettings(pv.dp, pv.clip, pv.noise_multiplier, cfg.run.seed if pv.noise_seed is None else pv.noise_seed)
    return PrivateDevice(Zero(), dp).train(Payload({}, {}), None, None, CTX).tensors["w"]  # type: ignore[arg-type]


def rebuilt_from(cfg) -> np.ndarray:  # type: ignore[no-untyped-def]
    """What anyone holding ``cfg`` regenerates: the noise drawn from its seed (run.seed or noise_seed)."""
    seed = cfg.privacy.noise_seed if isinstance(cfg.privacy.noise_seed, int) else cfg.run.seed
    gen = rng(seed, CTX.round, CTX.edge_round, CTX.cell, CTX.device, NOISE)
    return gen.normal(0.0, cfg.privacy.noise_multiplier * cfg.privacy.clip, 64).astype(np.float32)


def test_dp_noise_of_a_provisioned_device_is_not_reproducible_from_its_bundle(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, privacy=DP)
    assert np.array_equal(noise_of(cfg), rebuilt_from(cfg))  # fedtier sim / run: reproducible, as documented
    done = provision(cfg, tmp_path / "prov")
    bundle = load_config(done.bundles["c0-d0"] / "config.toml")
    assert bundle.privacy.noise_seed == "system"
    deployed, warning = deployment_config(bundle)  # what fedtier agent does with it
    assert warning is None
    first, second = noise_of(deployed), noise_of(deployed)
    assert np.std(first) > 0.5  # noise there is
    assert not np.allclose(first, rebuilt_from(bundle), atol=0.5)  # the bundle's run.seed does not give it
    assert not np.allclose(first, second, atol=0.5)  # nor does a second process of the same device


def test_an_explicit_noise_seed_stays_reproducible_and_the_deployment_warns(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, privacy={**DP, "noise_seed": 7})
    deployed, warning = deployment_config(cfg)
    assert deployed.privacy.noise_seed == 7 and np.array_equal(noise_of(deployed), rebuilt_from(cfg))
    assert warning is not None and "subtract" in warning and "every node" in warning
    path = tmp_path / "cfg.toml"
    path.write_text(cfg.to_toml())
    res = CliRunner().invoke(main, ["provision", str(path), "--out", str(tmp_path / "prov")])
    assert res.exit_code == 0, res.output
    assert "warning" in res.output and "noise_seed = 7" in res.output
    assert load_config(tmp_path / "prov" / "nodes" / "c0-d0" / "config.toml").privacy.noise_seed == 7


def test_a_config_without_dp_is_left_alone(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    assert deployment_config(cfg) == (cfg, None)
