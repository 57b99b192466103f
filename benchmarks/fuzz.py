"""Fuzzing a real ``fedtier run`` over Mosquitto with mutated genuine messages (issue 14, item 6).

For each of an unsigned and a signed run (same config, same keys file for the signed one):

1. a clean ``fedtier run`` (subprocess, over a Mosquitto this script starts) while a sniffer records
   every genuine message on ``fedtier/{run}/#``: the reference final model and message counts;
2. the same run again while a fuzzer, fed with the genuine messages of *this* run as they appear,
   publishes mutated copies at a bounded rate on every tier's topics (cloud -> cell tasks, cell -> device
   tasks, device -> cell results, cell -> cloud reports, status, round manifest, run control, telemetry):
   bit flips, truncation, extension, header field edits (round, edge round, kind, sender, cell, session,
   run, message id, payload length), metadata edits (weight, loss), replays (also onto other topics),
   reorders, duplicates, oversized and deeply nested headers, and forged chunk headers. Fuzzing starts
   when round 0 closes (the first cell report) and picks a tier first, so every tier gets its share.
   The unsigned run gets the corruptions and replays only: nothing authenticates a well-formed forged
   field there (the broker's ACLs are its defence, ``fedtier provision``); ``--forge-unsigned`` adds them.

Printed per run: messages sent (and the rate reached), exit status (crash or not), tracebacks in the
logs of every tier, rejections logged, accepted-but-invalid (genuine messages the nodes sent beyond the
clean run's: a node acted on something forged or stale; aggregation or round records whose planned /
answered / closed-by differ from the clean run's), and whether ``final_model.ftw`` equals the clean
run's byte for byte.

Usage: python benchmarks/fuzz.py [--messages 100000] [--rate 3000] [--rounds 12] [--only signed|unsigned]
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FEDTIER = str(Path(sys.executable).parent / "fedtier")

CONFIG = """
[run]
name = "fuzz"
seed = 3
rounds = {rounds}
output = "{out}"
[topology]
cells = 2
devices_per_cell = 3
[algorithm]
name = "fedavg"
edge_rounds = 2
local_steps = 5
batch_size = 16
lr = 0.1
[model]
name = "mlp"
hidden = [16]
[data]
dataset = "digits"
[runtime]
device_deadline = 120.0
heartbeat = 1.0
"""


# ----------------------------------------------------------------------------- mutations
def _flip(rng: random.Random, b: bytes) -> bytes:
    data = bytearray(b)
    for _ in range(rng.randint(1, 8)):
        if data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return bytes(data)


def _truncate(rng: random.Random, b: bytes) -> bytes:
    return b[: rng.randrange(len(b))] if b else b


def _extend(rng: random.Random, b: bytes) -> bytes:
    return b + rng.randbytes(rng.choice([1, 7, 64, 1000]))


def _splice(rng: random.Random, b: bytes) -> bytes:
    """Delete or duplicate a slice."""
    if len(b) < 2:
        return b + b
    i = rng.randrange(len(b))
    j = min(len(b), i + rng.randint(1, 64))
    return b[:i] + b[j:] if rng.random() < 0.5 else b[:j] + b[i:j] + b[j:]


def _header_edit(rng: random.Random, b: bytes) -> bytes:
    """Change one header field of an envelope (signature left as it was)."""
    from protocols.wire.envelope import MAGIC

    if b[:4] != MAGIC or len(b) < 8:
        return _json_edit(rng, b)
    (n,) = struct.unpack_from("<I", b, 4)
    try:
        head = json.loads(b[8 : 8 + n])
    except ValueError:
        return _flip(rng, b)
    key = rng.choice(["n", "e", "k", "s", "c", "z", "r", "i", "l", "x", "v", "g", "extra"])
    value = head.get(key, 0)
    head[key] = rng.choice(
        [
            value + 1 if isinstance(value, int) else 1,
            value - 1 if isinstance(value, int) else -1,
            2**63,
            -1,
            1e999 if rng.random() < 0.1 else 0.5,
            "",
            "c0-d1",
            "c1",
            "cloud",
            "x" * 200,
            None,
            [],
            {"a": 1},
            "device_task",
            "cell_report",
            "device_result",
            "status",
        ]
    )
    text = json.dumps(head).encode()
    return MAGIC + struct.pack("<I", len(text)) + text + b[8 + n :]


def _meta_edit(rng: random.Random, b: bytes) -> bytes:
    """Change the payload metadata of an envelope (weight, loss, codec, ...) and fix the lengths."""
    from protocols.wire.envelope import MAGIC

    if b[:4] != MAGIC or len(b) < 8:
        return _json_edit(rng, b)
    (n,) = struct.unpack_from("<I", b, 4)
    body = b[8 + n :]
    if len(body) < 4:
        return _flip(rng, b)
    (m,) = struct.unpack_from("<I", body)
    try:
        meta = json.loads(body[4 : 4 + m])
        head = json.loads(b[8 : 8 + n])
    except ValueError:
        return _flip(rng, b)
    if not isinstance(meta, dict) or not isinstance(head, dict):
        return _flip(rng, b)
    key = rng.choice(["weight", "loss", "codec", "seed", "steps", "samples", "upload_bytes", "round"])
    meta[key] = rng.choice([0, -1, 1e30, 10**400, True, "NaN", None, [1, 2], 3.5, "fedmrn", "ffffffffffffffff"])
    text = json.dumps(meta).encode()
    body = struct.pack("<I", len(text)) + text + body[4 + m :]
    head["l"] = len(body)
    htext = json.dumps(head).encode()
    return MAGIC + struct.pack("<I", len(htext)) + htext + body


def _json_edit(rng: random.Random, b: bytes) -> bytes:
    """A JSON record (status, manifest, control, telemetry): change, drop or add a field."""
    try:
        rec = json.loads(b)
    except ValueError:
        return _flip(rng, b)
    if not isinstance(rec, dict):
        return _flip(rng, b)
    key = rng.choice(list(rec) + ["state", "round", "session", "sig", "extra"])
    if rng.random() < 0.2:
        rec.pop(key, None)
    else:
        rec[key] = rng.choice(["online", "offline", "finished", 0, 10**6, -1, None, "x" * 100, [], {"n": 1}])
    return json.dumps(rec).encode()


def _oversized(rng: random.Random, b: bytes) -> bytes:
    """Header lengths and nesting past every bound, and chunk headers announcing huge messages."""
    from protocols.wire import chunking
    from protocols.wire.envelope import MAGIC, MAX_HEADER_BYTES

    kind = rng.randrange(5)
    if kind == 0:
        return MAGIC + struct.pack("<I", 0xFFFFFFFF) + b[8:]
    if kind == 1:
        deep = b"[" * (MAX_HEADER_BYTES - 16)
        return MAGIC + struct.pack("<I", len(deep)) + deep
    if kind == 2:
        pad = json.dumps({"r": "fuzz", "k": "device_result", "n": 0, "s": "x" * 5000, "i": "1", "l": 0}).encode()
        return MAGIC + struct.pack("<I", len(pad)) + pad
    if kind == 3:
        total = rng.choice([2**31, 2**40, 2**63])
        return chunking._HEAD.pack(chunking.MAGIC, rng.randbytes(16), 0, 2, 0xFFFFFFFF, total, 0, 0) + b"x"
    return b"[" * 60_000  # a record nested too deeply


CORRUPTIONS: dict[str, Callable[[random.Random, bytes], bytes]] = {
    "bit flip": _flip,
    "truncation": _truncate,
    "extension": _extend,
    "slice deleted/duplicated": _splice,
    "oversized header": _oversized,
}
FORGERIES: dict[str, Callable[[random.Random, bytes], bytes]] = {
    "header field edit": _header_edit,
    "metadata edit": _meta_edit,
    "record field edit": _json_edit,
}
TIERS = {  # topic pattern -> tier link
    r"/cell/[^/]+/down/task$": "cloud->cell",
    r"/cell/[^/]+/down/[^/]+/task$": "cell->device",
    r"/cell/[^/]+/up/[^/]+/result$": "device->cell",
    r"/cloud/up/[^/]+/report$": "cell->cloud",
    r"/status/": "status",
    r"/cloud/round$": "manifest",
    r"/cloud/control$": "control",
    r"/telemetry/": "telemetry",
}


def tier_of(topic: str) -> str:
    return next((t for pat, t in TIERS.items() if re.search(pat, topic)), "other")


# ----------------------------------------------------------------------------- MQTT side
@dataclass
class Traffic:
    """What a sniffer saw: genuine messages (never injected) per kind, first-seen order."""

    genuine: list[tuple[str, bytes]] = field(default_factory=list)
    by_tier: dict[str, list[tuple[str, bytes]]] = field(default_factory=lambda: collections.defaultdict(list))
    counts: collections.Counter = field(default_factory=collections.Counter)
    seen: set[bytes] = field(default_factory=set)


class Sniffer:
    """Subscribes to ``fedtier/{run}/#`` and records every message it did not inject itself."""

    def __init__(self, url: str, run: str, injected: set[bytes]) -> None:
        import paho.mqtt.client as mqtt

        self.traffic, self.injected, self.lock = Traffic(), injected, threading.Lock()
        host, port = url.removeprefix("mqtt://").split(":")
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"fuzz-sniffer-{os.getpid()}")
        self.client.on_message = self._on
        self.client.connect(host, int(port))
        self.client.subscribe(f"fedtier/{run}/#", qos=1)
        self.client.loop_start()

    def _on(self, _c: Any, _u: Any, msg: Any) -> None:
        digest = hashlib.sha1(msg.topic.encode() + b"\0" + msg.payload).digest()
        with self.lock:
            if digest in self.injected or digest in self.traffic.seen:
                return
            self.traffic.seen.add(digest)
            self.traffic.genuine.append((msg.topic, msg.payload))
            self.traffic.by_tier[tier_of(msg.topic)].append((msg.topic, msg.payload))
            self.traffic.counts[_kind_of(msg.topic, msg.payload)] += 1

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def _kind_of(topic: str, data: bytes) -> str:
    """A genuine message's class for counting: deterministic ones per tier, liveness apart."""
    tier = tier_of(topic)
    if tier == "status":
        return "status (heartbeats: timing-dependent)"
    if tier == "telemetry":
        return "telemetry"
    return tier


class Fuzzer(threading.Thread):
    """Publishes mutated copies of the sniffer's genuine messages at ``rate`` per second, ``total`` in all."""

    def __init__(self, url: str, sniffer: Sniffer, total: int, rate: float, seed: int, forge: bool) -> None:
        import paho.mqtt.client as mqtt

        super().__init__(daemon=True)
        self.sniffer, self.total, self.rate = sniffer, total, rate
        self.rng = random.Random(seed)
        self.mutations = {**CORRUPTIONS, **(FORGERIES if forge else {})}
        host, port = url.removeprefix("mqtt://").split(":")
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"fuzz-injector-{os.getpid()}")
        self.client.max_inflight_messages_set(1000)
        self.client.max_queued_messages_set(5000)
        self.client.connect(host, int(port))
        self.client.loop_start()
        self.sent = 0
        self.by_mutation: collections.Counter = collections.Counter()
        self.by_tier: collections.Counter = collections.Counter()
        self.halt = threading.Event()
        self.started = self.ended = 0.0

    def _publish(self, topic: str, data: bytes, what: str) -> None:
        digest = hashlib.sha1(topic.encode() + b"\0" + data).digest()
        with self.sniffer.lock:
            self.sniffer.injected.add(digest)
        while not self.halt.is_set():
            info = self.client.publish(topic, data, qos=1)
            if info.rc == 0:
                break
            time.sleep(0.01)  # paho's queue is full: the broker is slower than our rate
        self.sent += 1
        self.by_mutation[what] += 1
        self.by_tier[tier_of(topic)] += 1

    def run(self) -> None:
        rng = self.rng
        # start once round 0 closed (the first cell report): every tier's messages are then in the pool
        while not self.halt.is_set():
            with self.sniffer.lock:
                if any(tier_of(t) == "cell->cloud" for t, _ in self.sniffer.traffic.genuine):
                    break
            time.sleep(0.05)
        self.started = time.monotonic()
        while self.sent < self.total and not self.halt.is_set():
            with self.sniffer.lock:  # (no copies: the pool grows to thousands of messages)
                traffic = self.sniffer.traffic
                msgs = traffic.by_tier[rng.choice(sorted(traffic.by_tier))]  # every tier alike, however chatty
                topic, data = rng.choice(msgs[-20:] if rng.random() < 0.7 else msgs)
                pool = traffic.genuine
                others = [rng.choice(pool) for _ in range(8)]
            roll = rng.random()
            if roll < 0.08:  # replay as it was, now (often a round later), up to 5 times
                for _ in range(rng.randint(1, 5)):
                    self._publish(topic, data, "replay/duplicate")
            elif roll < 0.12:  # replay onto another topic of the same tier or another tier
                self._publish(others[0][0], data, "replay on another topic")
            elif roll < 0.16:  # a reordered burst of earlier genuine messages
                for t, d in others:
                    self._publish(t, d, "reordered replay")
            else:
                name = rng.choice(list(self.mutations))
                self._publish(topic, self.mutations[name](rng, data), name)
            # pace: never ahead of the target rate
            ahead = self.sent / self.rate - (time.monotonic() - self.started)
            if ahead > 0:
                time.sleep(ahead)
        self.ended = time.monotonic()

    def stop(self) -> None:
        self.halt.set()
        self.join(10)
        self.client.loop_stop()
        self.client.disconnect()


# ----------------------------------------------------------------------------- runs
@dataclass
class Outcome:
    rc: int | None
    wall: float
    model: bytes
    log: str
    counts: collections.Counter
    records: list[tuple]
    fuzzer: Fuzzer | None = None


def _records(out: Path) -> list[tuple]:
    """What must not change under fuzzing: who was planned and answered in each aggregation and round."""
    from protocols.records import CellRecord, read_run

    recs, _ = read_run(out)
    rows = []
    for r in recs:
        if isinstance(r, CellRecord):
            rows.append(
                (
                    "cell",
                    r.round,
                    r.edge_round,
                    r.cell,
                    tuple(sorted(r.planned)),
                    tuple(sorted(r.answered)),
                    r.closed_by,
                )
            )
        else:
            rows.append(("round", r.round, tuple(sorted(r.cells_reported)), tuple(sorted(r.devices.items()))))
    return sorted(rows, key=str)


def run_once(
    tmp: Path, name: str, rounds: int, keys: Path | None, fuzz: tuple[int, float, bool] | None, timeout: float
) -> Outcome:
    from protocols.transport.broker import MosquittoBroker

    out = tmp / name
    config = tmp / f"{name}.toml"
    config.write_text(CONFIG.format(rounds=rounds, out=out))
    broker = MosquittoBroker().start()  # a fresh broker: no retained message of an earlier run
    url = broker.url
    cmd = [FEDTIER, "run", str(config), "--broker", url, "--no-progress", "--workers", "2"]
    if keys is not None:
        cmd += ["--keys", str(keys)]
    injected: set[bytes] = set()
    sniffer = Sniffer(url, "fuzz", injected)
    fuzzer = Fuzzer(url, sniffer, fuzz[0], fuzz[1], seed=14, forge=fuzz[2]) if fuzz else None
    log_path = tmp / f"{name}.log"
    t0 = time.monotonic()
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        if fuzzer is not None:
            fuzzer.start()
        try:
            rc: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # on a timeout, or this script interrupted: end the run's whole process group
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    wall = time.monotonic() - t0
    if fuzzer is not None:
        fuzzer.stop()
    time.sleep(0.5)  # the last records in flight to the sniffer
    sniffer.stop()
    broker.stop()
    model_path = out / "final_model.ftw"
    return Outcome(
        rc,
        wall,
        model_path.read_bytes() if model_path.exists() else b"",
        log_path.read_text(errors="replace"),
        sniffer.traffic.counts,
        _records(out),
        fuzzer,
    )


def report(label: str, clean: Outcome, fuzzed: Outcome) -> dict[str, Any]:
    f = fuzzed.fuzzer
    assert f is not None
    during = f.ended - f.started if f.ended else fuzzed.wall
    tracebacks = fuzzed.log.count("Traceback (most recent call last)")
    rejections = len(re.findall(r"rejected|rejecting|dropping|refused|stale", fuzzed.log))
    # only more than the clean run counts: fewer can be a replay the sniffer saw before the genuine copy
    extra = {
        k: fuzzed.counts[k] - clean.counts[k]
        for k in clean.counts | fuzzed.counts
        if not k.startswith("status") and fuzzed.counts[k] > clean.counts[k]
    }
    rec_diff = len(set(fuzzed.records) ^ set(clean.records))
    row = {
        "run": label + ("" if f.mutations.keys() >= FORGERIES.keys() else " (corruptions, replays)"),
        "sent": f.sent,
        "rate": f.sent / during if during > 0 else 0.0,
        "fuzz_s": during,
        "crashed": fuzzed.rc != 0,
        "rc": fuzzed.rc,
        "tracebacks": tracebacks,
        "rejections_logged": rejections,
        "extra_genuine": extra,
        "records_differing": rec_diff,
        "model_equal": bool(clean.model) and fuzzed.model == clean.model,
        "wall_clean": clean.wall,
        "wall_fuzzed": fuzzed.wall,
        "by_tier": dict(f.by_tier),
        "by_mutation": dict(f.by_mutation),
    }
    print(
        f"\n== {row['run']} run: {f.sent:,} mutated messages in {during:.0f} s ({row['rate']:,.0f}/s); "
        f"run took {fuzzed.wall:.0f} s (clean {clean.wall:.0f} s)"
    )
    if f.sent < f.total:
        print(f"   NOTE: the run ended after {f.sent:,} of {f.total:,} messages: raise --rounds")
    print(f"   by tier: {', '.join(f'{k} {v:,}' for k, v in sorted(f.by_tier.items()))}")
    print(f"   by mutation: {', '.join(f'{k} {v:,}' for k, v in sorted(f.by_mutation.items()))}")
    print(
        f"   crashed: {'YES (exit ' + str(fuzzed.rc) + ')' if row['crashed'] else 'no'}; tracebacks in the logs: "
        f"{tracebacks}; rejection lines logged: {rejections:,}"
    )
    print(
        f"   accepted-but-invalid: genuine messages beyond the clean run's {extra or 'none'}; "
        f"records differing from the clean run's: {rec_diff}"
    )
    print(f"   final model equal to the clean run's (bytes): {'yes' if row['model_equal'] else 'NO'}")
    if tracebacks:
        first = fuzzed.log.index("Traceback (most recent call last)")
        print("   first traceback:\n" + "\n".join("     " + ln for ln in fuzzed.log[first:].splitlines()[:25]))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=100_000, help="mutated messages per fuzzed run")
    ap.add_argument("--rate", type=float, default=3000.0, help="most messages per second")
    ap.add_argument("--rounds", type=int, default=300, help="long enough for the messages at the rate reached")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a fuzzed run may take")
    ap.add_argument("--only", choices=["signed", "unsigned"], default=None)
    ap.add_argument("--keep", default=None, help="keep the run folders and logs here")
    ap.add_argument(
        "--forge-unsigned",
        action="store_true",
        help="also send well-formed forgeries (field edits) in the unsigned run, where nothing "
        "authenticates them: they are accepted by design (the broker's ACLs are the defence)",
    )
    args = ap.parse_args()
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the run under test is ended too

    from protocols.config import load_config
    from protocols.wire.keys import generate_keys, write_keys

    tmp = Path(args.keep or tempfile.mkdtemp(prefix="fedtier-fuzz-"))
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "base.toml").write_text(CONFIG.format(rounds=args.rounds, out=tmp / "base"))
    keys = tmp / "keys.toml"
    write_keys(keys, generate_keys(load_config(tmp / "base.toml").topology), overwrite=True)
    rows = []
    for label in ("unsigned", "signed"):
        if args.only and label != args.only:
            continue
        k = keys if label == "signed" else None
        clean = run_once(tmp, f"{label}-clean", args.rounds, k, None, args.timeout)
        print(
            f"clean {label} run: exit {clean.rc}, {clean.wall:.0f} s, genuine messages "
            f"{dict(sorted(clean.counts.items()))}"
        )
        forge = label == "signed" or args.forge_unsigned
        fuzzed = run_once(tmp, f"{label}-fuzzed", args.rounds, k, (args.messages, args.rate, forge), args.timeout)
        rows.append(report(label, clean, fuzzed))
    print(
        "\n| run | mutated messages | rate (msg/s) | crashes | tracebacks | accepted-but-invalid | final model equal |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        extra = sum(r["extra_genuine"].values()) + r["records_differing"]
        print(
            f"| {r['run']} | {r['sent']:,} | {r['rate']:,.0f} | {int(r['crashed'])} | {r['tracebacks']} | "
            f"{extra} | {'yes' if r['model_equal'] else 'no'} |"
        )
    print(f"(run folders and logs: {tmp})")


if __name__ == "__main__":
    main()
