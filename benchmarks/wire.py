"""MQTT wire efficiency and control-plane time of ``fedtier run``: 50 agents in 5 cells.

Workload: hierarchical FedAvg, MNIST (max_train 10000, so 200 samples per device), MLP 784-200-200-10
(199,210 float32 parameters: a 796,840-byte model), E = 2 edge rounds x H = 10 local steps, 3 cloud
rounds; 2 agent worker processes with 25 devices each, every device on its own MQTT connection.

Figures:

- **wire / payload**: per device-round (one task down, one result up), the MQTT bytes of those two
  messages on the wire (PUBLISH framing, topic, packet ids, chunk headers, envelope and payload
  codec included; counted at the publishers) over the raw tensor bytes they carry (2 x the model);
  and the fixed overhead per message ``(wire - tensor bytes) / messages``.
- **control-plane time per edge round**: for each cloud round, the span from the first device task
  to the last edge-round close over all cells, minus the compute critical path (the busiest worker's
  total training time in that round: its devices train one after another), divided by E. It is the
  time the busiest worker sat idle: task fan-out, transfer, decoding/encoding, aggregation.

Usage: python benchmarks/wire.py [--broker mosquitto|amqtt|mqtt://host:port] [--rounds 3] [--hidden 200 200]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def config(out: Path, rounds: int, cells: int, per_cell: int, hidden: list[int]):
    from protocols.config import parse_config

    return parse_config(
        {
            "run": {"name": "wire", "seed": 0, "rounds": rounds, "output": str(out)},
            "topology": {"cells": cells, "devices_per_cell": per_cell},
            "algorithm": {"name": "fedavg", "edge_rounds": 2, "local_steps": 10, "batch_size": 32, "lr": 0.05},
            "model": {"name": "mlp", "hidden": hidden},
            "data": {"dataset": "mnist", "partition": "iid", "max_train": 10000, "max_test": 2000},
            "runtime": {"device_deadline": 120.0},
        }
    )


def control_plane(emu, result) -> list[float]:
    """Seconds per edge round beyond the compute critical path, one figure per cloud round."""
    E = result.config.train.edge_rounds
    worker_of = {d: i for i, group in enumerate(emu.groups) for d in group}
    figures = []
    for r in range(len(result.history)):
        recs = [x for x in result.cell_records if x["round"] == r]
        start = min(x["clock_end_s"] - x["clock_s"] for x in recs if x["edge_round"] == 0)
        end = max(x["clock_end_s"] for x in recs)
        busy = [0.0] * len(emu.groups)
        for device, stats in emu.agent_stats.items():
            busy[worker_of[device]] += sum(b - a for rr, _e, a, b in stats["compute"] if rr == r)
        figures.append((end - start - max(busy)) / E)
    return figures


def overhead_breakdown(result, model_bytes: int) -> dict[str, int]:
    """Where the bytes of one device result above the raw tensors go."""
    from protocols.transport.traffic import publish_packet_bytes
    from protocols.wire import chunking, topics
    from protocols.wire.messenger import Messenger
    from protocols.wire.payload import Payload

    class _Null:
        loop = None

    cfg = result.config
    frame = Messenger(_Null(), cfg.run.name, "c4-d9").frame(  # type: ignore[arg-type]
        "device_result",
        Payload({"loss": 0.123456, "samples": 200}, dict(result.params)),
        round=9,
        edge_round=1,
        cell="c4",
    )
    topic = topics.device_result(cfg.run.name, "c4", "c4-d9")
    parts = chunking.split(frame)
    mqtt = sum(publish_packet_bytes(len(topic), len(p)) - len(p) for p in parts)
    return {
        "envelope": len(frame) - model_bytes,
        "mqtt": mqtt,
        "chunks": len(parts),
        "chunk_headers": sum(len(p) for p in parts) - len(frame),
    }


def _tier_payload(summary: dict) -> int:
    """Payload bytes between the cloud and the cells, both ways."""
    return summary["cumulative_bytes"]["cloud_to_cell"] + summary["cumulative_bytes"]["cell_to_cloud"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--broker", default="mosquitto", help="mosquitto (default if installed), amqtt, or a URL")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cells", type=int, default=5)
    ap.add_argument("--devices-per-cell", type=int, default=10)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--hidden",
        type=int,
        nargs="+",
        default=[200, 200],
        help="MLP hidden sizes (e.g. --hidden 16: a 13 KB model isolates the control plane)",
    )
    args = ap.parse_args()
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below

    from protocols.transport.broker import EmbeddedBroker, MosquittoBroker, find_mosquitto
    from sim.emulation import Emulation

    kind = args.broker
    if kind == "mosquitto" and find_mosquitto() is None:
        kind = "amqtt"
    broker = None if "://" in kind else (MosquittoBroker() if kind == "mosquitto" else EmbeddedBroker()).start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = config(Path(tmp) / "run", args.rounds, args.cells, args.devices_per_cell, args.hidden)
            emu = Emulation(cfg, broker_url=broker.url if broker else kind, workers=args.workers, timing=True)
            result = emu.run()
            summary = json.loads((result.output_dir / "summary.json").read_text())
    finally:
        if broker is not None:
            broker.stop()

    import numpy as np

    model_bytes = sum(int(np.asarray(v).nbytes) for v in result.params.values())
    wire = summary["wire_bytes"]
    tasks = sum(s["tasks"] for s in emu.agent_stats.values())
    device_wire = wire["cell_to_device"] + wire["device_to_cell"]
    per_device_round = device_wire / tasks
    overhead = (per_device_round - 2 * model_bytes) / 2
    breakdown = overhead_breakdown(result, model_bytes)
    cp = control_plane(emu, result)
    compute = [b - a for s in emu.agent_stats.values() for _r, _e, a, b in s["compute"]]
    rows = [
        ("broker", kind),
        ("devices x cells", f"{args.devices_per_cell * args.cells} in {args.cells}"),
        ("device-rounds (tasks answered)", f"{tasks}"),
        ("model tensor bytes", f"{model_bytes:,}"),
        ("wire bytes per device-round (down + up)", f"{per_device_round:,.0f}"),
        ("wire / tensor bytes", f"{per_device_round / (2 * model_bytes):.5f}"),
        ("fixed overhead per message (bytes)", f"{overhead:,.0f}"),
        ("  of which: envelope header + tensor codec", f"{breakdown['envelope']:,}"),
        ("  of which: MQTT PUBLISH framing + topic", f"{breakdown['mqtt']:,} ({breakdown['chunks']} packets)"),
        ("  of which: chunk headers", f"{breakdown['chunk_headers']:,}"),
        (
            "wire / payload, cloud<->cell",
            f"{(wire['cloud_to_cell'] + wire['cell_to_cloud']) / _tier_payload(summary):.5f}",
        ),
        ("control-plane bytes (status, heartbeats, telemetry)", f"{wire['control']:,}"),
        ("mean device compute per task (s)", f"{np.mean(compute):.4f}"),
        ("control-plane time per edge round (ms), per cloud round", ", ".join(f"{1000 * x:.1f}" for x in cp)),
        ("control-plane time per edge round (ms), mean", f"{1000 * float(np.mean(cp)):.1f}"),
        ("run wall time (s)", f"{result.wall_s:.1f}"),
        ("final accuracy", f"{result.final_accuracy:.4f}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
