"""A long-lived forward-only device (``fedtier agent --serve --backend onnx --onnx-model FILE``) serves each job with
its own onnx model, and refuses, for that job only, one it cannot serve: an algorithm that needs gradients, another
model. The service runs in memory (``edge_agent.service.AgentService`` on a ``MemoryHub``, the cloud's signed job
record, virtual time); its build is ``fedtier.serve``'s, up to the trainer."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_agent.process_state import JobView
from protocols.config import RunConfig
from protocols.twin import TwinWatch, new_instance
from tests.conftest import small_config

pytest.importorskip("onnxruntime")

DECOMFL = '[algorithm]\nname = "decomfl"\nlocal_steps = 1\nperturbations = 2\n'
REFUSED_GRADIENTS = "this device trains forward-only (onnx backend): the job's algorithm fedavg needs gradients"


@pytest.fixture(scope="module")
def onnx_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """The device's own model: ``fedtier export`` of a decomfl job's mlp [4] on digits, and its x_0 (in the file)."""
    from protocols.onnx_export import export_onnx

    tmp = tmp_path_factory.mktemp("model")
    cfg = small_config(tmp, algorithm={"name": "decomfl", "edge_rounds": 1}, model={"name": "mlp", "hidden": [4]})
    spec = cfg.model_spec((64,), 10)
    x0 = cfg.build_algorithm(spec).initial_params()
    return export_onnx(spec, x0, tmp / "m.onnx", cfg.x0_origin()), x0


class _Lacks:
    """Fails clearly on any member not given: the service needs it of a (built, unstarted) AgentProcess."""

    _name = "BuiltAgents"

    def __getattr__(self, name: str) -> Any:  # (only for a member not found the usual way)
        raise AttributeError(
            f"AgentService used {self._name}.{name}, which tests/test_forward_only_service.py's stand-in for its "
            "AgentProcess lacks: give it one there, as a built, unstarted AgentProcess has it"
        )


class _Links(_Lacks):
    """Its ``links`` (``edge_agent.connections.DeviceConnections``): only the instance nonce of its devices' wills."""

    _name = "BuiltAgents.links"

    def __init__(self, instance: str) -> None:
        self.instance = instance


class BuiltAgents(_Lacks):
    """Stands in for the AgentProcess ``fedtier.serve``'s build returns (no broker here): what AgentService uses of a
    process it starts and stops during its first job, and nothing more. Its twin watch and job view are the real
    ones; a member the service comes to need fails the test naming it (one edit here), not a namespace's bare
    AttributeError."""

    def __init__(self, session: str) -> None:
        self.twins, self.job = TwinWatch(new_instance()), JobView(session, long_lived=True)
        self.links, self.done, self.on_job_record = _Links(self.twins.instance), threading.Event(), None
        self.started = self.stopped = False

    def start(self) -> BuiltAgents:
        self.started = True
        return self

    def stop(self) -> None:
        self.stopped = True

    def stats(self) -> dict[str, dict[str, Any]]:
        return {}  # no device answered a task

    def tasks_answered(self, session: str | None) -> int:
        return 0


def _serve_one(
    tmp_path: Path, job_section: str, backend: Any, hidden: int = 4, seed: int = 0
) -> tuple[Any, str | None]:
    """What a long-lived agent on ``backend`` (an ``edge_agent.backends.DeviceBackend``) does with one job whose
    config holds ``job_section`` (and an mlp [``hidden``], ``run.seed``): (the trainer it built for it, None) or
    (None, the reason its signed idle status gives for not serving it)."""
    from edge_agent.service import AgentService
    from fedtier.deploy_setup import spec_and_data
    from protocols.jobs import CurrentJob, canonical_job, config_hash
    from protocols.transport.memory import MemoryHub
    from protocols.wire import topics
    from protocols.wire.keys import node_trust, with_run_keys
    from protocols.wire.signed import open_record, seal_record

    base = small_config(tmp_path, topology={"cells": 1, "devices_per_cell": 2}, security={"keys": "keys.toml"})
    bundle, device = with_run_keys(base, tmp_path), "c0-d0"
    model = f'[model]\nname = "mlp"\nhidden = [{hidden}]\n[data]\ndataset = "digits"\n'
    text = f"[run]\nrounds = 1\nseed = {seed}\n{model}{job_section}"
    canon = canonical_job(text, bundle)[1]
    current = CurrentJob("j", canon, config_hash(canon))
    hub, statuses, built, made = MemoryHub(), [], [], []
    status_topic = topics.device_status(bundle.run.name, "c0", device)
    hub.connect("spy").subscribe(status_topic, lambda t, d: statuses.append(open_record(d, t, device, None)))
    job_topic = topics.current_job(bundle.run.name)
    cloud = node_trust(bundle, "cloud")
    hub.connect("cloud").publish(job_topic, seal_record(current.record(), job_topic, cloud.sign), retain=True)

    def build(job_cfg: RunConfig, session: str) -> Any:  # fedtier.serve's build, up to the trainer (no broker)
        spec, _ = spec_and_data(job_cfg, None)
        built.append(backend.trainer(job_cfg, spec))
        service.stop()  # served: a stand-in for its AgentProcess ends the service
        made.append(BuiltAgents(session))
        return made[-1]

    trust = node_trust(bundle, device)
    service = AgentService(bundle, [device], hub.loop, lambda: hub.connect(topics.device_node(device)), build, trust)
    hub.loop.call_later(30.0, service.stop)  # (virtual time)
    service.serve()
    reasons = {s["unfit"]["reason"] for s in statuses if "unfit" in s}
    assert len(built) + len(reasons) == 1, (built, reasons)
    assert [(a.started, a.stopped) for a in made] == [(True, True)] * len(built)  # what it started, it stopped
    return (built[0], None) if built else (None, reasons.pop())


def test_a_forward_only_device_serves_a_job_with_its_own_onnx_model(tmp_path, onnx_model):
    """The device's ``--onnx-model`` became the bundle's ``runtime.onnx_model``, but each job's trainer was built from
    the job's config (only broker, security, monitoring are the bundle's): every job that did not name a model file
    was refused ('runtime.onnx_model: the onnx backend needs a model'). Now its own model serves the job, and a
    job's ``runtime.onnx_model`` is never read (a path on every device, chosen by the job's signer)."""
    from edge_agent.backends import DeviceBackend
    from edge_agent.onnx_trainer import OnnxTrainer

    own = DeviceBackend("onnx", str(onnx_model[0]))
    own.check()
    for i, extra in enumerate(("", '[runtime]\nonnx_model = "/nonexistent/x.onnx"\n')):
        trainer, refused = _serve_one(tmp_path / f"j{i}", DECOMFL + extra, own)
        assert refused is None and isinstance(trainer, OnnxTrainer)
        x0 = trainer.initial_params()  # the file's x_0: the job's too (same model, same seed)
        assert list(x0) == list(onnx_model[1]) and all(np.array_equal(x0[k], v) for k, v in onnx_model[1].items())


def test_a_forward_only_device_refuses_for_that_job_one_that_needs_gradients_or_another_model(
    tmp_path, onnx_model, caplog
):
    """A job the device cannot serve is refused for that job, the reason in its idle status (as a data mismatch is):
    one needing gradients (every task would have failed: 'OnnxTrainer cannot run SGD'), one whose model is not the
    onnx file's (the graph's inputs would not take its parameters), one whose x_0 is not the file's (another seed:
    the device would have moved the file's x_0 while its cloud moved another, a silently wrong model)."""
    from edge_agent.backends import DeviceBackend
    from protocols.config import ConfigError

    own = DeviceBackend("onnx", str(onnx_model[0]))
    with caplog.at_level(logging.ERROR, logger="fedtier.jobs"):
        _, why = _serve_one(tmp_path / "fedavg", "", own)
    assert why is not None and why.startswith(REFUSED_GRADIENTS), why
    assert f"device c0-d0 cannot serve job j: {REFUSED_GRADIENTS}" in caplog.text  # one device: not 'devices c0-d0'
    _, why = _serve_one(tmp_path / "wider", DECOMFL, own, hidden=8)
    assert why == "the job's model is not this device's onnx model: hidden [8] (this device's model: [4])", why
    _, why = _serve_one(tmp_path / "seed", DECOMFL, own, seed=7)
    assert why == "the job's model is not this device's onnx model: init_seed 7 (this device's model: 0)", why
    with pytest.raises(ConfigError, match="--backend onnx: the device's model from `fedtier export` is needed"):
        DeviceBackend("onnx", None).check()  # fedtier agent --serve exits 2 before its first job
    torch_device = DeviceBackend("torch")
    trainer, refused = _serve_one(tmp_path / "torch", "", torch_device)  # a torch device serves fedavg as before
    assert refused is None and trainer is not None


def test_fedtier_agent_serve_on_onnx_without_a_usable_model_exits_2_before_its_first_job(tmp_path):
    """Before, ``--serve --backend onnx`` without ``--onnx-model`` (or with a file onnxruntime cannot load) started,
    and refused every job. Now it exits 2 at once, naming the option (before it reads its data or connects)."""
    from click.testing import CliRunner

    from fedtier.cli import main

    config, data, bad = tmp_path / "c.toml", tmp_path / "data.npz", tmp_path / "m.onnx"
    config.write_text('[algorithm]\nname = "decomfl"\nedge_rounds = 1\n')
    data.write_bytes(b"")
    bad.write_bytes(b"not onnx")
    args = [
        "agent",
        str(config),
        "--serve",
        "--device",
        "c0-d0",
        "--data",
        str(data),
        "--insecure",
        "--backend",
        "onnx",
    ]
    for extra, says in (
        ([], "--backend onnx: the device's model from `fedtier export` is needed (--onnx-model)"),
        (["--onnx-model", str(bad)], f"--onnx-model: {bad}: cannot load it"),
    ):
        res = CliRunner().invoke(main, [*args, "--broker", "mqtt://127.0.0.1:1", *extra])
        assert res.exit_code == 2 and says in " ".join(res.output.split()), res.output
