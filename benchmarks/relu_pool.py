"""The zoo CNNs' fused ReLU -> 2x2 max-pool (``protocols.models.relu_max_pool``) against the layers as written.

Times, in CPU seconds of one thread, a forward pass without autograd (evaluation, zeroth-order devices) and a
training step (forward + backward) of ``cnn`` (the DeComFL paper's MNIST CNN) and ``cnn4`` (the FedMRN paper
preset's), both ways alternately, checks that outputs and gradients are equal bit for bit, and prints the ratios.

    python benchmarks/relu_pool.py [--reps 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocols.models import build_model  # noqa: E402


def layer_by_layer(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    for layer in model.children():
        x = layer(x)
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cases = [("cnn", {"channels": (16, 32), "fc": 0}, 320), ("cnn4", {"channels": (16, 32, 64, 128)}, 64)]
    for name, kw, batch in cases:
        model = build_model(name, (1, 28, 28), 10, **kw)
        x, y, xe = torch.randn(batch, 784), torch.randint(0, 10, (batch,)), torch.randn(1000, 784)
        secs = {"fused": [0.0, 0.0], "layers": [0.0, 0.0]}
        out, grads = {}, {}
        for _ in range(a.reps):
            for side, fwd in (("fused", model), ("layers", lambda v, model=model: layer_by_layer(model, v))):
                c0 = time.process_time()
                with torch.no_grad():
                    out[side] = fwd(xe)
                c1 = time.process_time()
                model.zero_grad()
                F.cross_entropy(fwd(x), y).backward()
                c2 = time.process_time()
                grads[side] = [p.grad.clone() for p in model.parameters()]
                secs[side][0] += c1 - c0
                secs[side][1] += c2 - c1
        same = torch.equal(out["fused"], out["layers"]) and all(
            torch.equal(g, h) for g, h in zip(grads["fused"], grads["layers"])
        )
        f, l_ = secs["fused"], secs["layers"]
        print(
            f"{name}: forward of 1000 samples (no autograd) {1e3 * l_[0] / a.reps:.0f} -> {1e3 * f[0] / a.reps:.0f} ms "
            f"({l_[0] / f[0]:.2f}x); training step of batch {batch} {1e3 * l_[1] / a.reps:.1f} -> "
            f"{1e3 * f[1] / a.reps:.1f} ms ({l_[1] / f[1]:.2f}x); bit-identical outputs and gradients: {same}"
        )


if __name__ == "__main__":
    main()
