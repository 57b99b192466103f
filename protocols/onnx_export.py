"""Export a zoo model to ONNX for forward-only devices (torch side; agents only load the file).

The graph takes ``x`` [batch, features] float32 and every parameter, by its fedtier name and in model
order, as **graph inputs** (not initializers), and returns ``logits`` [batch, classes]. A device can
therefore perturb the parameters in numpy and evaluate the loss with onnxruntime alone.

The initial parameters x_0 (and the model spec) travel inside the file, as custom metadata
(``fedtier.params``: base64 of a ``tensors/v1`` payload), so an agent without torch or the ``onnx``
package starts from the same x_0 as every other party (see ``edge_agent.onnx_trainer``).
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .algorithms.base import ModelSpec
from .wire.payload import Payload, encode_payload

PARAMS_KEY = "fedtier.params"
SPEC_KEY = "fedtier.spec"
INIT_KEY = "fedtier.init"
"""What fixed x_0 (``RunConfig.x0_origin``: its seed, the model it started from), when the exporter knew it."""
OPSET = 17


def export_onnx(
    spec: ModelSpec, params: Mapping[str, np.ndarray], path: str | Path, origin: Mapping[str, Any] | None = None
) -> Path:
    """Write ``spec``'s model with parameters as inputs to ``path``; ``params`` are stored as x_0, and ``origin``
    (``RunConfig.x0_origin``), if given, as what fixed them: a long-lived device refuses a job that starts elsewhere."""
    import onnx
    import torch
    import torch.nn.functional as F

    from .models import build_model

    model = build_model(spec.name, spec.input_shape, spec.num_classes, **spec.build_kwargs()).eval()
    names = [k for k, _ in model.named_parameters()]
    if names != list(params):
        raise ValueError(f"parameters {list(params)[:3]}... do not match the model's {names[:3]}...")

    class ParamsAsInputs(torch.nn.Module):
        """The zoo's Sequential, run layer by layer with the parameters taken from the inputs
        (``torch.func.functional_call`` cannot be traced by the TorchScript-based exporter)."""

        def forward(self, x: torch.Tensor, *ps: torch.Tensor) -> torch.Tensor:
            p = dict(zip(names, ps))
            for name, layer in model.named_children():
                if isinstance(layer, torch.nn.Linear):
                    x = F.linear(x, p[f"{name}.weight"], p[f"{name}.bias"])
                elif isinstance(layer, torch.nn.Conv2d):
                    x = F.conv2d(x, p[f"{name}.weight"], p[f"{name}.bias"], layer.stride, layer.padding)
                elif any(True for _ in layer.parameters()):
                    raise ValueError(f"cannot export layer {name!r} ({type(layer).__name__}) with parameters")
                else:
                    x = layer(x)
            return x

    features = int(np.prod(spec.input_shape))
    example = (torch.zeros(2, features), *(torch.from_numpy(np.array(params[k], np.float32)) for k in names))
    buf = io.BytesIO()
    torch.onnx.export(
        ParamsAsInputs(),
        example,
        buf,  # type: ignore[arg-type]  # torch.onnx.export writes to a file object too (typed: paths only)
        input_names=["x", *names],
        output_names=["logits"],
        dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}},
        opset_version=OPSET,
        dynamo=False,
    )
    proto = onnx.load_from_string(buf.getvalue())
    x0 = base64.b64encode(encode_payload(Payload({}, {k: np.asarray(params[k], np.float32) for k in names})))
    meta = [(PARAMS_KEY, x0.decode()), (SPEC_KEY, spec.model_dump_json())]
    for key, value in meta + ([(INIT_KEY, json.dumps(dict(origin)))] if origin is not None else []):
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, str(path))
    return path
