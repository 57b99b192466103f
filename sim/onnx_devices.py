"""Forward-only devices in a launched hierarchy: ``[runtime] onnx_devices`` run on onnxruntime."""
from __future__ import annotations

import tempfile
from pathlib import Path

from protocols.algorithms.base import Algorithm, ModelSpec
from protocols.config import ConfigError, RunConfig
from protocols.trainer import Trainer

ONNX_MODEL = "model.onnx"


def onnx_trainers(cfg: RunConfig, spec: ModelSpec, algorithm: Algorithm,
                  output_dir: Path | None = None) -> dict[str, Trainer]:
    """``device -> OnnxTrainer`` for the devices listed in ``runtime.onnx_devices`` (one shared session).

    The model is exported with the run's x_0 to ``output_dir/model.onnx`` (or a temporary file that
    is removed once loaded); an agent elsewhere can use the same file.
    """
    ids = list(cfg.runtime.onnx_devices)
    if not ids:
        return {}
    unknown = sorted(set(ids) - set(cfg.topology.all_devices()))
    if unknown:
        raise ConfigError(f"runtime.onnx_devices: {unknown} are not devices of the topology")
    from edge_agent.onnx_trainer import build_onnx_trainer
    from protocols.onnx_export import export_onnx

    if output_dir is not None:
        trainer = build_onnx_trainer(export_onnx(spec, algorithm.initial_params(), output_dir / ONNX_MODEL))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = build_onnx_trainer(export_onnx(spec, algorithm.initial_params(), Path(tmp) / ONNX_MODEL))
    return {d: trainer for d in ids}
