"""Forward-only devices in a launched hierarchy: ``[runtime] onnx_devices`` run on onnxruntime."""

from __future__ import annotations

import tempfile
from pathlib import Path

from protocols.algorithms.base import Algorithm, ModelSpec
from protocols.config import ConfigError, RunConfig
from protocols.onnx_export import export_onnx
from protocols.trainer import Trainer

ONNX_MODEL = "model.onnx"


def onnx_trainers(
    cfg: RunConfig, spec: ModelSpec, algorithm: Algorithm, output_dir: Path | None = None
) -> dict[str, Trainer]:
    """``device -> OnnxTrainer`` for the devices listed in ``runtime.onnx_devices`` (one shared session).

    The model is exported with the run's x_0 to ``output_dir/model.onnx`` (or a temporary file that
    is removed once loaded); an agent elsewhere can use the same file.
    """
    ids = list(cfg.runtime.onnx_devices)
    if not ids:
        return {}
    check_onnx_devices(cfg)
    from edge_agent.onnx_trainer import build_onnx_trainer

    if output_dir is not None:
        trainer = build_onnx_trainer(export_onnx(spec, algorithm.initial_params(), output_dir / ONNX_MODEL))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = build_onnx_trainer(export_onnx(spec, algorithm.initial_params(), Path(tmp) / ONNX_MODEL))
    return {d: trainer for d in ids}


def with_onnx_model(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``runtime.onnx_model`` = ``RUN_DIR/model.onnx`` (absolute), for agents in other processes."""
    check_onnx_devices(cfg)
    path = str((cfg.output_dir() / ONNX_MODEL).resolve())
    return cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"onnx_model": path})})


def refuse_own_onnx_model(cfg: RunConfig) -> None:
    """``fedtier sim`` and ``run`` export the run's model for their forward-only devices themselves: a
    ``runtime.onnx_model`` of the config would be silently replaced (or unused), so it is refused."""
    if cfg.runtime.onnx_model:
        raise ConfigError(
            f"runtime.onnx_model = {cfg.runtime.onnx_model!r}: fedtier sim and run export the run's own model "
            f"(RUN_DIR/{ONNX_MODEL}) for runtime.onnx_devices; the key is for fedtier agent --backend onnx"
        )


def check_onnx_devices(cfg: RunConfig) -> None:
    unknown = sorted(d for d in set(cfg.runtime.onnx_devices) if cfg.topology.cell_of(d) is None)
    if unknown:
        raise ConfigError(f"runtime.onnx_devices: {unknown} are not devices of the topology")
