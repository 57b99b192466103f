"""The arithmetic floor of the small-model workload: what one round's training costs on one core,
without any simulation around it.

One round of ``benchmarks/overhead.py --workload small`` trains 5 devices x 5 SGD steps of batch 16
through an MLP 784-64-10. This script times that training alone (random data, one torch thread):

- ``per-device``: 25 steps of a torch ``nn.Module`` with autograd and ``torch.optim.SGD`` (what the
  per-device engine and the bare loop do);
- ``batched, autograd``: 5 batched steps over the 5 devices (``batched_forward`` + autograd, the cohort
  engine's path for models without a written-out gradient);
- ``batched, written out``: 5 batched steps with the cohort engine's written-out mlp gradient
  (``mlp_loss_and_grads``, what ``runtime.engine = "cohort"`` runs for mlp and logreg).

- ``batched, written out, N threads`` (``--threads N``, N > 1): the same on N torch threads
  (``runtime.cohort_threads = N``).

The ratio per-device / batched bounds what batching can gain on this workload before any of the
simulation's per-round work (messages, aggregation, records) is counted.
Usage: python benchmarks/cohort_floor.py [--rounds 300] [--repeat 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

D, B, STEPS, LR = 5, 16, 5, 0.05


def main() -> None:
    import torch
    import torch.nn.functional as F

    from protocols.cohort_kernels import batched_forward, device_losses, mlp_chain, mlp_loss_and_grads
    from protocols.models import build_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="N > 1: also the written-out side on N threads")
    args = ap.parse_args()
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x_all, y_all = torch.rand(60000, 784), torch.randint(0, 10, (60000,))
    model = build_model("mlp", (784,), 10, hidden=(64,))
    chain = mlp_chain(model)
    mask = torch.ones(D, B)

    def batched(written_out: bool) -> None:
        params = {
            k: v.detach().unsqueeze(0).repeat(D, *[1] * v.dim()).requires_grad_(not written_out)
            for k, v in model.named_parameters()
        }
        leaves = list(params.values())
        for _ in range(args.rounds):
            idx = torch.randint(0, 60000, (D * STEPS * B,))
            xs, ys = x_all.index_select(0, idx).view(D, STEPS, B, 784), y_all.index_select(0, idx).view(D, STEPS, B)
            for s in range(STEPS):
                if written_out:
                    _, grads = mlp_loss_and_grads(chain, params, xs[:, s], ys[:, s], mask)
                else:
                    loss = device_losses(batched_forward(model, params, xs[:, s]), ys[:, s], mask)
                    grads = torch.autograd.grad(loss.sum(), leaves)
                with torch.no_grad():
                    torch._foreach_add_(leaves, list(grads), alpha=-LR)

    def per_device() -> None:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for _ in range(args.rounds):
            for _ in range(D):
                for _ in range(STEPS):
                    idx = torch.randint(0, 60000, (B,))
                    opt.zero_grad()
                    F.cross_entropy(model(x_all.index_select(0, idx)), y_all.index_select(0, idx)).backward()
                    opt.step()

    def threaded() -> None:
        torch.set_num_threads(args.threads)
        try:
            batched(True)
        finally:
            torch.set_num_threads(1)

    sides = {
        "per-device": per_device,
        "batched, autograd": lambda: batched(False),
        "batched, written out": lambda: batched(True),
    }
    if args.threads > 1:
        sides[f"written out, {args.threads} threads"] = threaded
    best: dict[str, float] = {}
    for _ in range(args.repeat):  # alternate the sides; the fastest run of each counts
        for name, run in sides.items():
            t0 = time.perf_counter()
            run()
            best[name] = min(best.get(name, float("inf")), (time.perf_counter() - t0) / args.rounds)
    print(
        f"training of one round ({D} devices x {STEPS} steps of batch {B}, MLP 784-64-10, one thread), "
        f"best of {args.repeat}:"
    )
    for name, t in best.items():
        print(f"  {name:28} {t * 1e3:7.2f} ms/round  ({best['per-device'] / t:.2f}x the per-device training)")


if __name__ == "__main__":
    main()
