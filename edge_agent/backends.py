"""Trainer backends of a device agent (torch, or onnxruntime forward-only); a backend module is imported only
when its factory is called (torch only by the torch backend)."""

from __future__ import annotations

from collections.abc import Callable

from protocols.algorithms.base import ModelSpec
from protocols.config import ConfigError, RunConfig, UnusableFile
from protocols.trainer import Trainer

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
    from .onnx_trainer import build_onnx_trainer

    if not cfg.runtime.onnx_model:
        raise ConfigError("runtime.onnx_model: the onnx backend needs a model from `fedtier export` (--onnx-model)")
    try:
        return build_onnx_trainer(cfg.runtime.onnx_model)
    except ImportError:
        raise
    except Exception as exc:  # onnxruntime's own errors (NoSuchFile, InvalidProtobuf, ...) are no ValueError
        raise UnusableFile("runtime.onnx_model", f"{cfg.runtime.onnx_model}: cannot load it: {exc}") from None


BACKENDS: dict[str, TrainerFactory] = {"torch": _torch_trainer, "onnx": _onnx_trainer}
"""Trainer backends by name; a backend module is imported only when its factory is called."""


def make_trainer(backend: str, spec: ModelSpec, cfg: RunConfig) -> Trainer:
    """The trainer of ``backend`` (a key of :data:`BACKENDS`) for ``spec``; ``ConfigError`` if it is unknown."""
    try:
        factory = BACKENDS[backend]
    except KeyError:
        raise ConfigError(f"backend {backend!r}: expected one of {sorted(BACKENDS)}") from None
    return factory(spec, cfg)
