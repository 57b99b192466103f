"""The extension API (issue #34 item 7): a user's algorithm, model and dataset, registered or installed as a
package with entry points, run through ``fedtier sim``, its worker processes and ``fedtier run`` without editing
fedtier; a user model is sized from the built model; ``npz:PATH`` datasets; unknown names are clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from abc import abstractmethod
from pathlib import Path

import numpy as np
import pytest
import torch.nn as nn

from examples.normclip import NormClip, NormClipCell, NormClipDevice
from protocols import params as P
from protocols import plugins
from protocols.algorithms import ALGORITHMS, CellRole, DeviceContext, DeviceRole
from protocols.algorithms.base import ModelSpec
from protocols.config import ConfigError
from protocols.models import build_model
from protocols.rejections import Rejected, RejectKind
from protocols.seeding import rng
from protocols.torch_trainer import TorchTrainer
from protocols.trainer import LocalData, Trainer, correction
from protocols.wire.payload import Payload
from sim.datasets import dataset_geometry, load_dataset
from sim.testkit import assert_engines_agree
from tests.conftest import small_config

ROOT = Path(__file__).resolve().parent.parent

PLUGIN = '''
"""A plugin package as a user writes it: an algorithm, a model and a dataset."""
import numpy as np
import torch.nn as nn

from examples.normclip import NormClip


class ClipAvg(NormClip):
    name = "clipavg"


def wide(input_shape, num_classes):
    d = int(np.prod(input_shape))
    return nn.Sequential(nn.Flatten(), nn.Linear(d, 48), nn.ReLU(), nn.Linear(48, num_classes))


def blobs(n=600, seed=3):
    """Three separable Gaussian blobs in 8 dimensions."""
    g = np.random.default_rng(seed)
    centres = g.normal(0, 3, (3, 8))
    y = g.integers(0, 3, n + n // 4)
    x = (centres[y] + g.normal(0, 1, (len(y), 8))).astype(np.float32)
    return {"x_train": x[:n], "y_train": y[:n], "x_test": x[n:], "y_test": y[n:]}
'''

ENTRY_POINTS = """
[fedtier.algorithms]
clipavg = fedtier_testplugin:ClipAvg

[fedtier.models]
wide = fedtier_testplugin:wide

[fedtier.datasets]
blobs = fedtier_testplugin:blobs
"""

CONFIG = """
[run]
name = "plug"
rounds = 2
output = "{out}"
[topology]
cells = 2
devices_per_cell = 2
[algorithm]
name = "clipavg"
max_norm = 5.0
local_steps = 10
lr = 0.1
[model]
name = "wide"
[data]
dataset = "blobs"
[runtime]
device_deadline = 20.0
"""


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin package as installed into a site folder (what ``pip install --target`` leaves: the package and
    its ``.dist-info`` with ``entry_points.txt``; written directly: offline, and this venv's setuptools cannot
    build wheels). Only ``PYTHONPATH`` tells a process about it."""
    site = tmp_path_factory.mktemp("plugin-site")
    (site / "fedtier_testplugin").mkdir()
    (site / "fedtier_testplugin" / "__init__.py").write_text(PLUGIN)
    info = site / "fedtier_testplugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fedtier-testplugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return site


def fedtier(site: Path | None, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    [done] = fedtier_side_by_side((site, args), timeout=timeout)
    return done


def fedtier_side_by_side(
    *commands: tuple[Path | None, tuple[str, ...]], timeout: float = 240
) -> list[subprocess.CompletedProcess[str]]:
    """``fedtier ARGS`` with only ``site`` (and the repository) on its path, for each ``(site, args)``, all started
    at once (independent runs: the second core takes its share); their results, in order."""
    procs = []
    for site, args in commands:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([*([str(site)] if site else []), str(ROOT)]))
        argv = [sys.executable, "-c", "from fedtier.cli import main; main()", *args]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        done = []
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        return done
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_installed_plugin_runs_in_sim_workers_and_run(plugin_site: Path, tmp_path: Path) -> None:
    """The package's algorithm, model and dataset, found by entry points alone, learn in ``fedtier sim``, in its
    spawned workers (same model, byte for byte) and in ``fedtier run`` over MQTT (same model again). Without the
    package on the path (this process's: no Python to start for a refusal) its names are unknown."""
    from click.testing import CliRunner

    from fedtier.cli import main

    without = tmp_path / "c0.toml"
    without.write_text(CONFIG.format(out=tmp_path / "none"))
    runs = {"sim": ("sim",), "workers": ("sim", "--workers", "1"), "run": ("run",)}  # one spawned worker finds it
    for name in runs:
        (tmp_path / f"{name}.toml").write_text(CONFIG.format(out=tmp_path / name))
    res = CliRunner().invoke(main, ["sim", str(without), "--no-progress"])
    said = " ".join(res.output.split())  # (the console wraps it)
    assert res.exit_code == 2 and "unknown model 'wide'" in said and "unknown dataset 'blobs'" in said, res.output
    done = fedtier_side_by_side(
        *(
            (plugin_site, (cmd, str(tmp_path / f"{name}.toml"), "--no-progress", *extra))
            for name, (cmd, *extra) in runs.items()
        ),
    )

    models = []
    for name, res in zip(runs, done, strict=True):
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
        s = summary(tmp_path / name)
        assert s["rounds"] == 2 and s["accuracy"] > 0.8, s  # three blobs: chance is 1/3
        models.append((tmp_path / name / "final_model.ftw").read_bytes())
    assert models[0] == models[1] == models[2]


def test_run_plugins_key_loads_a_module(tmp_path: Path) -> None:
    """``[run] plugins`` imports a module that registers itself; the workers parse the same config."""
    (tmp_path / "my_norm.py").write_text(
        "from examples.normclip import NormClip\nfrom protocols.algorithms import "
        "register\n\nregister(type('Clip2', (NormClip,), {'name': 'clip2'}))\n"
    )
    cfg = tmp_path / "c.toml"
    text = (
        CONFIG.format(out=tmp_path / "out")
        .replace("rounds = 2", 'plugins = ["my_norm"]\nrounds = 1')
        .replace("local_steps = 10", "local_steps = 60")
    )
    cfg.write_text(
        text.replace('"clipavg"', '"clip2"').replace('"wide"', '"mlp"\nhidden = [16]').replace('"blobs"', '"digits"')
    )
    res = fedtier(tmp_path, "sim", str(cfg), "--no-progress", "--workers", "1")  # a spawned worker: imports it too
    assert res.returncode == 0, res.stderr[-3000:]
    assert summary(tmp_path / "out")["accuracy"] > 0.25  # digits: chance is 0.1


class Wide(nn.Module):
    def __init__(self, d: int, k: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, 300), nn.Linear(300, k)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.b(self.a(x.flatten(1)).relu())


def test_registered_model_is_sized_from_the_built_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The parameter count, hence the default message bound, is the built model's, not a one-layer guess."""
    monkeypatch.setitem(plugins.MODELS, "wide300", lambda shape, k: Wide(int(np.prod(shape)), k))
    cfg = small_config(tmp_path, model={"name": "wide300", "hidden": [200]})
    spec = cfg.model_spec((1, 8, 8), 10)
    built = build_model("wide300", (1, 8, 8), 10)
    assert isinstance(built, Wide)
    count = sum(p.numel() for p in built.parameters())
    assert spec.num_params() == count == 64 * 300 + 300 + 300 * 10 + 10  # the zoo's guess for "wide300": 650
    assert cfg.max_message_bytes(spec) >= 8 * 4 * count


def test_bad_plugins_are_clear_errors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.name.*unknown model 'resnet9'"):
        small_config(tmp_path, model={"name": "resnet9"})
    with pytest.raises(ConfigError, match=r"run\.plugins: cannot import 'no_such_plugin_mod'"):
        small_config(tmp_path, run={"plugins": ["no_such_plugin_mod"]})
    with pytest.raises(ConfigError, match=r"run\.plugins: 'os; rm' is not a module name"):
        small_config(tmp_path, run={"plugins": ["os; rm"]})
    with pytest.raises(plugins.PluginError, match="built in"):
        plugins.register_model("mlp", Wide)
    monkeypatch.setitem(plugins.MODELS, "notamodel", lambda shape, k: "nope")
    with pytest.raises(plugins.PluginError, match="not a torch.nn.Module"):
        ModelSpec(name="notamodel").num_params()


def test_a_model_or_dataset_registers_once_under_a_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both registries: the same callable again is a no-op, a non-callable or another callable under a taken
    name is refused, naming the plugin."""
    monkeypatch.setattr(plugins, "MODELS", {})
    monkeypatch.setattr(plugins, "DATASETS", {})
    for register, kind, role, fn in (
        (plugins.register_model, "model", "factory", Wide),
        (plugins.register_dataset, "dataset", "loader", np.load),
    ):
        assert register("mine", fn) is fn and register("mine", fn) is fn
        with pytest.raises(plugins.PluginError, match=rf"{kind} 'mine' is already registered"):
            register("mine", lambda *a, **k: None)
        with pytest.raises(plugins.PluginError, match=rf"{kind} 'other': the {role} must be callable, got int"):
            register("other", 3)  # type: ignore[arg-type]
    assert plugins.MODELS == {"mine": Wide} and plugins.DATASETS == {"mine": np.load}


def test_npz_dataset(tmp_path: Path) -> None:
    """``npz:PATH``: any feature shape, geometry from the file, labels checked; parses as a config value."""
    g = np.random.default_rng(0)
    path = tmp_path / "d.npz"
    x, y = g.normal(size=(50, 2, 3, 3)).astype(np.float32), g.integers(0, 4, 50)
    np.savez(path, x_train=x[:40], y_train=y[:40], x_test=x[40:], y_test=y[40:], num_classes=5)
    name = f"npz:{path}"
    assert dataset_geometry(name) == ((2, 3, 3), 5)
    ds = load_dataset(name)
    assert ds.x_train.shape == (40, 18) and np.array_equal(ds.y_test, y[40:])
    cfg = small_config(tmp_path, data={"dataset": name})
    assert cfg.data.dataset == name
    bad = tmp_path / "bad.npz"
    np.savez(bad, x_train=x[:40], y_train=y[:40] - 1, x_test=x[40:], y_test=y[40:])
    with pytest.raises(ValueError, match="labels span -1"):
        load_dataset(f"npz:{bad}")
    with pytest.raises(ValueError, match="cannot read"):
        load_dataset(f"npz:{tmp_path / 'missing.npz'}")


class Corrected(NormClip):
    """NormClip whose devices add a fixed, seeded per-device offset to every gradient (SCAFFOLD's ``c - c_i``
    in shape: the grad_transform hook as an outside algorithm uses it)."""

    name = "corrected-test"

    def device(self, device: str) -> DeviceRole:
        return CorrectedDevice(self.params)  # type: ignore[arg-type]


class CorrectedDevice(NormClipDevice):
    def train(self, task: Payload, data: LocalData, trainer: Trainer, ctx: DeviceContext) -> Payload:
        p, g = self.p, rng(ctx.seed, ctx.cell, ctx.device, "offset")
        offset = {k: (0.05 * g.standard_normal(v.shape)).astype(np.float32) for k, v in task.tensors.items()}
        trainer.set_params(task.tensors)
        stats = trainer.sgd(
            data,
            steps=p.local_steps,
            batch_size=p.batch_size,
            lr=p.lr,
            rng=rng(ctx.seed, ctx.round, ctx.edge_round, ctx.cell, ctx.device, "batches"),
            momentum=0.5,
            grad_transform=correction(offset),
        )
        return Payload({"weight": len(data), "loss": stats.loss}, P.sub(trainer.get_params(), task.tensors))


@pytest.mark.parametrize("model", [{"name": "mlp", "hidden": [16]}, {"name": "cnn", "channels": [2, 4], "fc": 8}])
def test_grad_transform_runs_batched_in_the_cohort_engine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model: dict
) -> None:
    """Each device's own correction, batched by the cohort engine, gives the per-device engine's results."""
    monkeypatch.setitem(ALGORITHMS, Corrected.name, Corrected)
    cfg = small_config(
        tmp_path,
        algorithm={"name": Corrected.name, "max_norm": 10.0, "local_steps": 4},
        model=model,
        run={"rounds": 2},
        data={"max_train": 300, "max_test": 100},
    )
    assert_engines_agree(cfg)


def test_grad_transform_adds_to_each_step(tmp_path: Path) -> None:
    """One SGD step with ``correction(c)`` is ``w - lr (grad + c)``; a state that does not fit is refused."""
    trainer = TorchTrainer.from_spec("mlp", (1, 8, 8), 10, "cpu", hidden=(8,))
    g = np.random.default_rng(0)
    x, y = g.normal(size=(16, 64)).astype(np.float32), g.integers(0, 10, 16)
    w0 = trainer.get_params()
    _, grad = trainer.loss_and_grad(x, y)
    offset = {k: g.normal(size=v.shape).astype(np.float32) for k, v in w0.items()}
    trainer.sgd(
        LocalData(x, y), steps=1, batch_size=16, lr=0.1, rng=np.random.default_rng(1), grad_transform=correction(offset)
    )
    for k, w in trainer.get_params().items():
        np.testing.assert_allclose(w, w0[k] - 0.1 * (grad[k] + offset[k]), rtol=1e-5, atol=1e-6)
    bad = {k: v[..., :1] for k, v in offset.items()}
    with pytest.raises(ValueError, match="grad_transform state"):
        trainer.sgd(
            LocalData(x, y),
            steps=1,
            batch_size=16,
            lr=0.1,
            rng=np.random.default_rng(1),
            grad_transform=correction(bad),
        )


def test_entry_points_register_and_a_broken_one_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each group's entry points register under their names; one that fails to import is a PluginError naming
    it (not a half-registered registry, not a traceback from deep inside validation)."""
    from importlib.metadata import EntryPoint

    from protocols import plugin_loading

    eps = {
        "fedtier.algorithms": [EntryPoint("corrected-test", "tests.test_plugins:Corrected", "fedtier.algorithms")],
        "fedtier.models": [EntryPoint("widex", "tests.test_plugins:Wide", "fedtier.models")],
        "fedtier.datasets": [EntryPoint("blobsx", "numpy:load", "fedtier.datasets")],
    }
    monkeypatch.setattr(plugin_loading, "entry_points", lambda group: eps[group])
    saved = dict(plugins.MODELS), dict(plugins.DATASETS), dict(ALGORITHMS)
    plugin_loading.load_entry_points.cache_clear()
    try:
        assert len(plugin_loading.load_entry_points()) == 3
        # (the entry point imports tests.test_plugins anew: the same classes by name)
        assert plugins.MODELS["widex"].__qualname__ == "Wide" and plugins.DATASETS["blobsx"] is np.load
        assert ALGORITHMS["corrected-test"].__qualname__ == "Corrected"
        # an algorithm's entry point is named as its algorithm (else algorithm.name = its name would be unknown)
        eps["fedtier.algorithms"] = [EntryPoint("clipx", "tests.test_plugins:Corrected", "fedtier.algorithms")]
        plugin_loading.load_entry_points.cache_clear()
        with pytest.raises(plugins.PluginError, match="clipx = 'tests.test_plugins:Corrected': the class's name is"):
            plugin_loading.load_entry_points()
        eps["fedtier.algorithms"] = []
        eps["fedtier.models"] = [EntryPoint("gone", "no_such_module_xyz:f", "fedtier.models")]
        plugin_loading.load_entry_points.cache_clear()
        with pytest.raises(plugins.PluginError, match=r"plugin gone \(fedtier.models = 'no_such_module_xyz:f'\)"):
            plugin_loading.load_entry_points()
    finally:
        for registry, old in zip((plugins.MODELS, plugins.DATASETS, ALGORITHMS), saved):
            registry.clear()
            registry.update(old)
        plugin_loading.load_entry_points.cache_clear()


def test_register_refuses_what_would_fail_later_or_silently(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A built-in name (it would silently replace that algorithm in every run naming it), a class without a name,
    something not an Algorithm, a name another class holds: each a PluginError naming it, and through a
    ``run.plugins`` module a config error; the same class again (or imported anew) is taken."""
    from protocols.algorithms import register

    monkeypatch.setattr("protocols.algorithms.ALGORITHMS", dict(ALGORITHMS))  # undone after the test
    from protocols import algorithms

    with pytest.raises(plugins.PluginError, match="algorithm name 'fedavg' is built in"):
        register(type("Shadow", (NormClip,), {"name": "fedavg"}))
    assert algorithms.ALGORITHMS["fedavg"].__name__ == "FedAvg"
    with pytest.raises(plugins.PluginError, match=r"register\(Nameless\): the class declares no name"):
        register(type("Nameless", (NormClip,), {"name": None}))
    with pytest.raises(plugins.PluginError, match="not an Algorithm subclass"):
        register(NormClipDevice)  # type: ignore[arg-type]
    for attrs, says in (  # declarations a run would trip over later, with a bare traceback or silently
        ({"device": abstractmethod(lambda self, device: None)}, r"it does not define device \(each role"),
        ({"Params": dict}, "Params = <class 'dict'> is not a TrainParams subclass"),
        ({"traits": None}, "traits = None is not a set of protocols.algorithms.traits.Trait"),
        ({"traits": frozenset({"cel_sum"})}, "traits = frozenset.*'cel_sum'.* is not a set of"),
        ({"without": {"cell_sum": 3}}, r"without\['cell_sum'\] is not a reason in words"),
    ):
        with pytest.raises(plugins.PluginError, match=r"register\(Broken\): " + says):
            register(type("Broken", (NormClip,), {"name": "broken", **attrs}))
    assert "broken" not in algorithms.ALGORITHMS
    mine = type("Mine", (NormClip,), {"name": "mine-clip", "__module__": "my_lab.clip"})
    assert register(mine) is mine and register(mine) is mine
    assert register(type("Mine", (NormClip,), {"name": "mine-clip", "__module__": "my_lab.clip"}))  # re-imported
    with pytest.raises(plugins.PluginError, match="'mine-clip' is already registered by my_lab.clip.Mine"):
        register(type("Other", (NormClip,), {"name": "mine-clip"}))

    (tmp_path / "shadowing.py").write_text(
        "from examples.normclip import NormClip\nfrom protocols.algorithms import register\n\n"
        "register(type('Shadow', (NormClip,), {'name': 'fedavg'}))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="run.plugins: cannot import 'shadowing'.*'fedavg' is built in"):
        small_config(tmp_path, run={"plugins": ["shadowing"]})
    with pytest.raises(ConfigError, match="unknown algorithm 'nope'.*its module in run.plugins"):
        small_config(tmp_path, algorithm={"name": "nope"})


class DictDevice(NormClipDevice):
    """A role with a mistake: it returns its result's parts, not a Payload."""

    def train(self, task: Payload, data: LocalData, trainer: Trainer, ctx: DeviceContext) -> Payload:
        out = super().train(task, data, trainer, ctx)
        return {"weight": out.meta["weight"], "delta": out.tensors}  # type: ignore[return-value]


class ReturnsDict(NormClip):
    name = "returns-dict-test"

    def device(self, device: str) -> DeviceRole:
        return DictDevice(self.params)  # type: ignore[arg-type]


@pytest.mark.parametrize("engine", ["device", "cohort"])
def test_a_device_role_that_returns_no_payload_fails_its_tasks_saying_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, engine: str
) -> None:
    """Each device fails its task with the role's mistake as the reason and the job fails with it (the sim
    crashed with an AttributeError from deep in the agent, and ``fedtier run``'s agents hung)."""
    from sim.launcher import run_simulation

    monkeypatch.setitem(ALGORITHMS, ReturnsDict.name, ReturnsDict)
    cfg = small_config(
        tmp_path,
        algorithm={"name": ReturnsDict.name, "local_steps": 2, "edge_rounds": 1},
        run={"rounds": 5},
        runtime={"engine": engine, "max_stalled_rounds": 1},
        data={"max_train": 120, "max_test": 30},
    )
    result = run_simulation(cfg)
    assert result.status == "failed" and len(result.history) == 1
    assert "DictDevice.train returned dict, not a Payload" in str(result.failed)  # (6 failed: ...)


class StrictCell(NormClipCell):
    """A cell role with a mistake: its check reads a key its devices never send."""

    def check(self, device: str, result: Payload) -> None:
        if "samples" not in result.meta:
            raise Rejected(RejectKind.MALFORMED, f"result of {device}: no 'samples'")


class Strict(NormClip):
    name = "strict-test"

    def cell(self, cell: str) -> CellRole:
        return StrictCell(self.params)  # type: ignore[arg-type]


def test_a_cell_role_that_refuses_every_answer_fails_the_job_saying_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every answer refused by the role's check: the job fails naming the refusal (it said "no device answered
    within the device deadline (6 tasked, every one late)": they answered, each edge round waited for its deadline
    with their refused answers pending)."""
    from sim.launcher import run_simulation

    monkeypatch.setitem(ALGORITHMS, Strict.name, Strict)
    cfg = small_config(
        tmp_path,
        algorithm={"name": Strict.name, "local_steps": 2, "edge_rounds": 1},
        run={"rounds": 5},
        runtime={"max_stalled_rounds": 2},
        data={"max_train": 120, "max_test": 30},
    )
    result = run_simulation(cfg)
    assert result.status == "failed" and len(result.history) == 2
    assert result.failed == (
        "no device's answer was taken (6 rejected: malformed: result of DEVICE: no 'samples') in rounds 1-2"
    )
