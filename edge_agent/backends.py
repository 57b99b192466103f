"""Trainer backends of a device agent (torch, or onnxruntime forward-only); a backend module is imported only
when its factory is called (torch only by the torch backend)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocols.algorithms.base import ModelSpec
from protocols.algorithms.compose import needs
from protocols.algorithms.traits import Trait
from protocols.config import ConfigError, RunConfig, UnusableFile
from protocols.trainer import Trainer

if TYPE_CHECKING:
    from .onnx_trainer import OnnxTrainer

TrainerFactory = Callable[[ModelSpec, RunConfig], Trainer]


def _torch_trainer(spec: ModelSpec, cfg: RunConfig) -> Trainer:
    import torch

    from protocols.torch_trainer import TorchTrainer

    torch.set_num_threads(1)  # small models: one thread per process is fastest, and processes share cores
    return TorchTrainer.from_spec(
        spec.name, spec.input_shape, spec.num_classes, cfg.runtime.device, **spec.build_kwargs()
    )


def _onnx_trainer(spec: ModelSpec, cfg: RunConfig) -> Trainer:
    """Forward-only (onnxruntime, no torch): the file of ``runtime.onnx_model`` (``fedtier export``)."""
    if not cfg.runtime.onnx_model:
        raise ConfigError("runtime.onnx_model: the onnx backend needs a model from `fedtier export` (--onnx-model)")
    return load_onnx(cfg.runtime.onnx_model, "runtime.onnx_model")


def load_onnx(path: str, setting: str) -> OnnxTrainer:
    """The forward-only trainer of the model at ``path``; :class:`UnusableFile` naming ``setting`` if it cannot be
    loaded (onnxruntime's own errors, NoSuchFile, InvalidProtobuf..., are no ``ValueError``)."""
    from .onnx_trainer import build_onnx_trainer

    try:
        return build_onnx_trainer(path)
    except ImportError:
        raise
    except Exception as exc:
        raise UnusableFile(setting, f"{path}: cannot load it: {exc}") from None


BACKENDS: dict[str, TrainerFactory] = {"torch": _torch_trainer, "onnx": _onnx_trainer}
"""Trainer backends by name; a backend module is imported only when its factory is called."""


def make_trainer(backend: str, spec: ModelSpec, cfg: RunConfig) -> Trainer:
    """The trainer of ``backend`` (a key of :data:`BACKENDS`) for ``spec``; ``ConfigError`` if it is unknown."""
    try:
        factory = BACKENDS[backend]
    except KeyError:
        raise ConfigError(f"backend {backend!r}: expected one of {sorted(BACKENDS)}") from None
    return factory(spec, cfg)


@dataclass(frozen=True)
class DeviceBackend:
    """A long-lived device's own trainer backend and onnx model (``fedtier agent --serve --backend onnx --onnx-model
    FILE``): node-local, like its data. Every job's trainer is built with them. A job's ``runtime.onnx_model`` is not
    read: it would be a path on every device chosen by the job's signer, and the device owner ships the model. A
    job they cannot serve is refused (``ConfigError``, the reason the device's idle status gives for that job)."""

    name: str
    onnx_model: str | None = None

    def check(self) -> None:
        """Refuse, before any job, an unknown backend, or onnx without a model or with one onnxruntime cannot load."""
        if self.name not in BACKENDS:
            raise ConfigError(f"backend {self.name!r}: expected one of {sorted(BACKENDS)}")
        if self.name == "onnx":
            self._load()

    def trainer(self, job_cfg: RunConfig, spec: ModelSpec) -> Trainer:
        """The trainer for a job (``job_cfg``, its model ``spec``); ``ConfigError`` naming why it cannot serve it."""
        if self.name != "onnx":
            return make_trainer(self.name, spec, job_cfg)
        if (why := needs(job_cfg.train, Trait.FORWARD_ONLY)) is not None:
            raise ConfigError(
                f"this device trains forward-only (onnx backend): the job's algorithm {job_cfg.train.name} needs "
                f"gradients ({why})"
            )
        trainer = self._load()
        if (mismatch := trainer.mismatch(spec, job_cfg.x0_origin())) is not None:
            raise ConfigError(f"the job's model is not this device's onnx model: {mismatch}")
        return trainer

    def _load(self) -> OnnxTrainer:
        if not self.onnx_model:
            raise ConfigError("--backend onnx: the device's model from `fedtier export` is needed (--onnx-model)")
        return load_onnx(self.onnx_model, "--onnx-model")
