"""Secure aggregation (SecAgg+, ``[privacy] secure_aggregation``): bytes and time per device-round.

One edge round of one cell of n devices (n = 10, 50, 200), the update of the MNIST MLP 784-200-200-10
(199,210 float32 values), driven through the protocol classes the runtimes use
(``protocols/privacy/secagg/``), every message framed as on the wire (envelope + tensors/v1 payload).
For each n and dropout fraction (devices that shared their secrets and then sent no result):

* bytes per device-round: what a device sends (keys, shares, masked result, reveal) and receives beyond
  its task (roster, routed shares, unmask request), against the plain framed update it would send
  without secure aggregation (target: at most 2x at n = 50);
* time: a device's own work (keys, sharing, masking: ChaCha20 masks for its ~3 log2 n neighbours), and the
  cell's unmasking (sum, self-masks, recovery of the dropped devices' pairwise masks), against the
  plain weighted sum of the same n float32 updates, measured alternately in the same run
  (target: unmasking <= 1 s at n = 200).

``--sim`` also runs ``fedtier sim`` (MNIST, one cell of n devices, 300 samples each, that MLP, E = 1,
H = 5, 2 cloud rounds), plain and with secure aggregation alternately, and prints the bytes per
device-round each way from the cell records and the wall time per cloud round.

    .venv/bin/python benchmarks/secagg.py [--sizes 10 50 200] [--dropout 0 0.1 0.3] [--repeat 3] [--values N] [--sim]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from protocols.privacy.secagg import RoundId, SecAggCell, SecAggDevice, SecAggSettings  # noqa: E402
from protocols.transport.memory import MemoryHub  # noqa: E402
from protocols.wire.envelope import decode_message  # noqa: E402
from protocols.wire.keys import Trust, new_seed, public_of  # noqa: E402
from protocols.wire.messenger import Messenger  # noqa: E402
from protocols.wire.payload import Payload, decode_payload  # noqa: E402

MLP_SHAPES = {
    "fc1.weight": (200, 784),
    "fc1.bias": (200,),
    "fc2.weight": (200, 200),
    "fc2.bias": (200,),
    "fc3.weight": (10, 200),
    "fc3.bias": (10,),
}


def framed(messenger: Messenger, kind: str, payload: Payload) -> tuple[int, Payload]:
    """Bytes of the message on the wire and the payload the receiver decodes."""
    data = messenger.frame(kind, payload, round=0, cell="c0")  # type: ignore[arg-type]
    return len(data), decode_payload(decode_message(data)[1])


def one_round(n: int, dropout: float, shapes: dict, seed: int) -> dict:
    g = np.random.default_rng(seed)
    settings = SecAggSettings(seed=seed)
    rid = RoundId("bench", "c0", seed, 0)
    ids = [f"c0-d{i}" for i in range(n)]
    hub = MemoryHub()
    msgr = {d: Messenger(hub.connect(d), "bench", d) for d in ["c0", *ids]}
    updates = {
        d: Payload(
            {"weight": 60, "loss": 0.5, "steps": 5},
            {k: g.normal(0, 0.01, s).astype(np.float32) for k, s in shapes.items()},
        )
        for d in ids
    }
    plain_bytes = framed(msgr[ids[0]], "device_result", updates[ids[0]])[0]
    up = dict.fromkeys(ids, 0)
    down = dict.fromkeys(ids, 0)
    dev_s = dict.fromkeys(ids, 0.0)
    seeds = {d: new_seed() for d in ids}  # signed: the actively secure protocol (signed keys and views)
    public = {d: public_of(s) for d, s in seeds.items()}
    devices = {d: SecAggDevice(settings, rid, d, 60.0, identity=Trust(d, seeds[d], public)) for d in ids}
    cell = SecAggCell(settings, rid, ids)

    def device_step(d: str, kind: str, fn, *args) -> Payload:
        t0 = time.perf_counter()
        out = fn(*args)
        dev_s[d] += time.perf_counter() - t0
        nbytes, received = framed(msgr[d], kind, out)
        up[d] += nbytes
        return received

    def to_device(d: str, kind: str, payload: Payload) -> Payload:
        nbytes, received = framed(msgr["c0"], kind, payload)
        down[d] += nbytes
        return received

    for d in ids:
        cell.add_keys(d, device_step(d, "secagg_keys", devices[d].advertise))
    for d, roster in cell.rosters().items():
        cell.add_shares(d, device_step(d, "secagg_shares", devices[d].share, to_device(d, "secagg_roster", roster)))
    for d, routed in cell.routes().items():
        t0 = time.perf_counter()
        devices[d].receive(to_device(d, "secagg_routed", routed))
        dev_s[d] += time.perf_counter() - t0
    dropped = set(g.choice(ids, int(round(dropout * n)), replace=False))
    for d in ids:
        masked = device_step(d, "device_result", devices[d].mask, updates[d])
        if d not in dropped:
            cell.add_masked(d, masked)
    requests = cell.unmask_requests()
    for d, req in requests.items():
        cell.add_consent(d, device_step(d, "secagg_consent", devices[d].consent, to_device(d, "secagg_unmask", req)))
    for d, views in cell.views().items():
        cell.add_reveal(d, device_step(d, "secagg_reveal", devices[d].reveal, to_device(d, "secagg_views", views)))
    survivors = sorted(requests)
    # the cell's unmasking vs the plain weighted sum of the same survivors' float32 updates, alternately
    t0 = time.perf_counter()
    out = cell.finish()
    unmask_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    plain_sum = {k: sum(updates[d].meta["weight"] * updates[d].tensors[k] for d in survivors) for k in shapes}
    plain_s = time.perf_counter() - t0
    err = max(float(np.max(np.abs(out.weighted_sum[k] - plain_sum[k]))) for k in shapes)
    return {
        "plain_bytes": plain_bytes,
        "up": statistics.mean(up.values()),
        "down": statistics.mean(down.values()),
        "device_s": statistics.mean(dev_s.values()),
        "unmask_s": unmask_s,
        "plain_sum_s": plain_s,
        "recovered": out.stats["recovered"],
        "degree": out.stats["degree"],
        "t": out.stats["threshold"],
        "max_err": err,
    }


def sim_rows(sizes: list[int]) -> None:
    from protocols.config import parse_config
    from sim.launcher import run_simulation, set_torch_threads

    set_torch_threads(1)
    print("\nfedtier sim, MNIST, 1 cell of n devices (300 samples each), MLP 784-200-200-10, E = 1, H = 5, 2 rounds")
    print(
        f"{'n':>4} {'secagg':>7} {'up B/dev-round':>15} {'down B/dev-round':>17} {'wall s/round':>13} {'accuracy':>9}"
    )
    for n in sizes:
        for secure in (False, True):
            cfg = parse_config(
                {
                    "run": {"name": f"bench-secagg-{n}-{secure}", "seed": 0, "rounds": 2},
                    "topology": {"cells": 1, "devices_per_cell": n},
                    "algorithm": {"name": "fedavg", "edge_rounds": 1, "local_steps": 5, "batch_size": 16, "lr": 0.1},
                    "model": {"name": "mlp", "hidden": [200, 200]},
                    "data": {"dataset": "mnist", "partition": "iid", "max_train": 300 * n},
                    "runtime": {"eval_every": 2},
                    "privacy": {"secure_aggregation": secure},
                }
            )
            t0 = time.perf_counter()
            result = run_simulation(cfg, write_output=False)
            wall = (time.perf_counter() - t0) / 2
            recs = result.cell_records
            rounds = sum(len(r["answered"]) for r in recs)
            up = sum(r["bytes_in"] for r in recs) / rounds
            down = sum(r["bytes_out"] for r in recs) / rounds
            print(
                f"{n:>4} {str(secure):>7} {up:>15,.0f} {down:>17,.0f} {wall:>13.2f} {result.final_accuracy or 0:>9.4f}",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 50, 200])
    ap.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1, 0.3])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--values", type=int, default=0, help="a flat update of this many values instead of the MLP")
    ap.add_argument("--sim", action="store_true", help="also time fedtier sim with and without secure aggregation")
    a = ap.parse_args()
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    shapes = {"w": (a.values,)} if a.values else MLP_SHAPES
    size = sum(int(np.prod(s)) for s in shapes.values())
    print(
        f"SecAgg+ per device-round, update of {size:,} float32 values; mean over {a.repeat} rounds "
        f"(bytes: framed messages; times: this machine, shared)"
    )
    print(
        f"{'n':>4} {'drop':>5} {'k':>3} {'t':>3} {'plain B':>9} {'up B':>9} "
        f"{'extra down B':>12} {'(up+down)/plain':>15} "
        f"{'device s':>9} {'unmask s':>9} {'plain sum s':>11} {'recovered':>9} {'max |err|':>10}"
    )
    for n in a.sizes:
        for drop in a.dropout:
            rows = [one_round(n, drop, shapes, seed) for seed in range(a.repeat)]
            m = {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
            ratio = (m["up"] + m["down"]) / m["plain_bytes"]
            print(
                f"{n:>4} {drop:>5.0%} {m['degree']:>3.0f} {m['t']:>3.0f} {m['plain_bytes']:>9,.0f} {m['up']:>9,.0f} "
                f"{m['down']:>12,.0f} {ratio:>15.3f} {m['device_s']:>9.3f} {m['unmask_s']:>9.3f} "
                f"{m['plain_sum_s']:>11.3f} {m['recovered']:>9.0f} {m['max_err']:>10.2e}",
                flush=True,
            )
    if a.sim:
        sim_rows(a.sizes)


if __name__ == "__main__":
    main()
