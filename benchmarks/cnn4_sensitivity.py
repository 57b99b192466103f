"""How sensitive CNN4 training is to float rounding at the FedMRN paper preset's initialisation.

The FedMRN preset (``benchmarks/fedmrn.py``) draws conv and linear weights from N(0, 0.01^2); its convs have
no bias and each is followed by GroupNorm, so the loss does not depend on a conv's weight scale and its
gradient grows as the weights shrink (here larger than the weights themselves). This script trains one
device's CNN4 (widths 16-32-64-128, MNIST, batch 64, lr 0.05) for 10 SGD steps twice, the second time with
one weight tensor scaled by (1 + 1e-7), and prints how far apart the two models end; it also prints the
relative difference between the cohort engine's batched gradient and the per-device gradient of one step.
When the first figure is large, two runs that differ only in float rounding (the per-device and the cohort
engine, or 1 and 2 threads) give different models and accuracies: compare such runs over seeds, not one by one.
Usage: python benchmarks/cnn4_sensitivity.py [--std 0.01] [--lr 0.05]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F

    from protocols.cohort_kernels import batched_forward, device_losses
    from protocols.models import build_model, init_params, set_params
    from sim.datasets import load_dataset

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--std", type=float, default=0.01, help="init_std (0: torch's default initialisation)")
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args()
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    torch.set_num_threads(1)
    ds = load_dataset("mnist")
    model = build_model("cnn4", (1, 28, 28), 10, channels=(16, 32, 64, 128))
    p0 = init_params(model, 0, std=args.std or None)
    x = torch.from_numpy(np.array(ds.x_train[:640])).view(10, 64, 784)
    y = torch.from_numpy(np.array(ds.y_train[:640])).view(10, 64)

    params = {k: torch.from_numpy(v).unsqueeze(0).repeat(2, *[1] * v.ndim).requires_grad_() for k, v in p0.items()}
    loss = device_losses(batched_forward(model, params, x[:2]), y[:2], torch.ones(2, 64))
    batched = torch.autograd.grad(loss.sum(), list(params.values()))
    model.zero_grad()
    F.cross_entropy(model(x[0]), y[0]).backward()
    step = max(float((g[0] - p.grad).abs().max() / p.grad.abs().max()) for g, p in zip(batched, model.parameters()))

    def train(scale: float) -> dict[str, torch.Tensor]:
        set_params(model, {k: v * np.float32(scale) if k == "out.weight" else v for k, v in p0.items()})
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        for s in range(10):
            opt.zero_grad()
            F.cross_entropy(model(x[s]), y[s]).backward()
            opt.step()
        return {k: v.detach().clone() for k, v in model.named_parameters()}

    a, b = train(1.0), train(1 + 1e-7)
    drift = max(float((a[k] - b[k]).abs().max() / a[k].abs().max()) for k in a)
    print(
        f"CNN4, init_std {args.std or 'torch default'}, lr {args.lr}: one step, batched vs per-device gradient: "
        f"{step:.1e} relative; 10 steps from weights 1e-7 apart end {drift:.1e} apart (relative max difference)"
    )


if __name__ == "__main__":
    main()
