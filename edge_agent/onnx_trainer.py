"""The onnxruntime trainer backend: forward passes only, no torch.

Loads a model exported by ``fedtier export`` (``protocols.onnx_export``): the graph takes ``x`` and every
parameter as inputs, so the parameters live here as numpy arrays and are fed on each call. Enough for
zeroth-order training (DeComFL), evaluation and loss probes; ``loss_and_grad`` and ``sgd`` are not
available. Cross-entropy is computed in numpy (float64 log-sum-exp over the float32 logits).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from protocols.algorithms.base import ModelSpec
from protocols.onnx_export import INIT_KEY, PARAMS_KEY, SPEC_KEY  # torch is imported only when exporting
from protocols.trainer import PROGRESS, Trainer
from protocols.wire.payload import decode_payload


def cross_entropy(logits: np.ndarray, y: np.ndarray, reduction: str = "mean") -> float:
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    nll = np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(y)), y]
    return float(nll.mean() if reduction == "mean" else nll.sum())


class OnnxTrainer(Trainer):
    """A forward-only device backend on onnxruntime (CPU, one thread by default)."""

    def __init__(self, path: str | Path, threads: int = 1) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        meta = self.session.get_modelmeta().custom_metadata_map
        if PARAMS_KEY not in meta:
            raise ValueError(f"{path} was not exported by fedtier (no {PARAMS_KEY} metadata)")
        self.spec: dict[str, Any] = json.loads(meta.get(SPEC_KEY, "{}"))
        self.origin: dict[str, Any] | None = json.loads(meta[INIT_KEY]) if INIT_KEY in meta else None  # older: None
        self._x0 = decode_payload(base64.b64decode(meta[PARAMS_KEY])).tensors
        names = [i.name for i in self.session.get_inputs()]
        if names[0] != "x" or names[1:] != list(self._x0):
            raise ValueError(f"{path}: graph inputs {names[:4]}... do not match its parameters")
        self.params: dict[str, np.ndarray] = {k: v.copy() for k, v in self._x0.items()}

    def mismatch(self, spec: ModelSpec, origin: Mapping[str, Any] | None = None) -> str | None:
        """How ``spec`` (a job's model, as it takes this device's data) and ``origin`` (what fixes its x_0,
        ``RunConfig.x0_origin``) differ from the exported model, in words; None if it is the same model: the same spec
        (layers, widths, input shape, classes, init scale), as many parameters and, when the file says, the same x_0.
        A job whose model differs would feed this graph inputs of other shapes (or train other weights); one whose
        x_0 differs would have this device move its own x_0 while its cloud moves another."""
        theirs, mine = spec.model_dump(mode="json"), dict(self.spec)
        features = int(np.prod(spec.input_shape))
        shape = mine.get("input_shape")
        if spec.name == "mlp" and isinstance(shape, list) and int(np.prod(shape)) == features:
            mine["input_shape"] = theirs["input_shape"]  # an mlp takes flat samples: (1, 8, 8) is (64,)
        diffs = [
            f"{key} {theirs[key]} (this device's model: {mine.get(key)})"
            for key in theirs
            if mine.get(key) != theirs[key]
        ]
        have = sum(v.size for v in self._x0.values())
        if not diffs and have != spec.num_params():
            diffs.append(f"{spec.num_params():,} parameters (this device's model: {have:,})")
        if not diffs and origin is not None and self.origin is not None:
            diffs = [
                f"{k} {v} (this device's model: {self.origin.get(k)})"
                for k, v in origin.items()
                if self.origin.get(k) != v
            ]
        return "; ".join(diffs) or None

    def initial_params(self) -> dict[str, np.ndarray]:
        """x_0 as exported: every party of the run starts from these values."""
        return {k: v.copy() for k, v in self._x0.items()}

    def get_params(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.params.items()}

    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        if list(params) != list(self.params):
            raise ValueError("parameter names differ from the exported model's")
        for k, v in params.items():
            if v.shape != self.params[k].shape:
                raise ValueError(f"parameter {k!r}: shape {v.shape}, expected {self.params[k].shape}")
            self.params[k] = np.array(v, dtype=np.float32, copy=True)

    def logits(self, x: np.ndarray) -> np.ndarray:
        feed = {"x": np.ascontiguousarray(x, dtype=np.float32).reshape(len(x), -1), **self.params}
        return self.session.run(["logits"], feed)[0]

    def loss(self, x: np.ndarray, y: np.ndarray) -> float:
        return cross_entropy(self.logits(x), np.asarray(y))

    def evaluate(self, x: np.ndarray, y: np.ndarray, batch_size: int = 2048) -> tuple[float, float]:
        total, correct = 0.0, 0
        for start in range(0, len(y), batch_size):
            PROGRESS.tick()  # (an evaluation batch is progress: sim/worker_watch.py)
            out = self.logits(x[start : start + batch_size])
            yb = np.asarray(y[start : start + batch_size])
            total += cross_entropy(out, yb, "sum")
            correct += int((out.argmax(1) == yb).sum())
        n = max(1, len(y))
        return total / n, correct / n


def build_onnx_trainer(onnx_path: str | Path, threads: int = 1) -> OnnxTrainer:
    """The forward-only trainer of a device agent (``fedtier agent --backend onnx``)."""
    return OnnxTrainer(onnx_path, threads)
