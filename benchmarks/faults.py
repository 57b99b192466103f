"""Fault injection against a deployment (issue 14, item 5): scripted scenarios against a real Mosquitto and
separate tier processes (``fedtier cloud``, ``fedtier cell`` per cell, ``fedtier agent`` per device, each
its own OS process, as an operator runs them).

An uninterrupted run gives the reference (final model bytes, aggregation and round records). Each
scenario then runs the same deployment and injects its fault at a point detected from the run's own
messages (a watcher subscribed to ``fedtier/{run}/#`` decodes each header), never after a sleep:

* **kill -9 and restart** the cloud (``fedtier cloud --resume``), a cell (``--resume`` when the command
  has it), 30% of the agents, or the broker (Mosquitto with persistence, saving on every change), at
  *mid edge round* (cell c0 sent its 5 device tasks of round 1, edge round 0: they train), *during aggregation*
  (the last cell report of round 1 arrived: the cloud aggregates; for a cell, its last device result
  of round 1's last edge round) or *between rounds* (the cloud's round record of round 1 was
  published). The process is restarted as soon as it is dead;
* **duplicate and reorder deliveries**: a republisher sends every genuine task, result and report
  one to two more times after a seeded random delay (0-300 ms), so they arrive duplicated and out of order;
* **SIGSTOP past the deadline, then SIGCONT**: an agent stopped when its task of round 1 arrives, for
  ``device_deadline`` + 3 s; a cell stopped when its task of round 1 arrives, past ``cell_deadline``.

Printed per scenario: completed (the cloud finished every round and wrote the final model), rounds lost
(missing, or closed with no cell report), rounds short (with any device result lost), device results
lost (device results of the reference that did not reach the cloud's aggregate: absent from the cell's
aggregation record, or their cell's report absent from the round), final model equal to
the uninterrupted run's (bytes), recovery time (fault -> the next aggregation record of the affected
cell for cell and agent faults, the next cloud round record otherwise), tracebacks in the logs.

Usage: python benchmarks/faults.py [--only NAME ...] [--rounds 4] [--keep DIR] [--list]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
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
RUN = "faults"

CONFIG = """
[run]
name = "faults"
seed = 5
rounds = {rounds}
output = "{out}"
[topology]
cells = 2
devices_per_cell = 5
[algorithm]
name = "fedavg"
edge_rounds = 2
local_steps = 300
batch_size = 16
lr = 0.1
[model]
name = "mlp"
hidden = [16]
[data]
dataset = "digits"
[runtime]
device_deadline = {device_deadline}
cell_deadline = {cell_deadline}
heartbeat = 1.0
heartbeat_timeout = 5.0
rejoin_wait = 0.0
"""
DEVICE_DEADLINE, CELL_DEADLINE = 20.0, 60.0  # an edge round takes ~3 s here; on a loaded shared machine >10 s
LONG_DEADLINE = 120.0  # a dead device's scenario: what waiting out the deadline would cost


# ----------------------------------------------------------------------------- broker
class Broker:
    """Mosquitto on a fixed port with persistence (saved on every change), killable with SIGKILL and
    restartable on the same port and store."""

    def __init__(self, folder: Path) -> None:
        from protocols.transport.broker import find_mosquitto, free_port

        self.folder, self.port, self.binary = folder, free_port(), find_mosquitto()
        if self.binary is None:
            raise SystemExit("mosquitto is not installed")
        folder.mkdir(parents=True, exist_ok=True)
        self.conf = folder / "mosquitto.conf"
        root = "user root\n" if os.geteuid() == 0 else ""
        self.conf.write_text(
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\n{root}"
            f"persistence true\npersistence_location {folder}/\nautosave_interval 1\nautosave_on_changes true\n"
            "max_queued_messages 100000\nmax_queued_bytes 0\nmax_inflight_messages 64\nset_tcp_nodelay true\n"
            "log_type error\nlog_type warning\n"
        )
        self.proc: subprocess.Popen | None = None
        self.url = f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> Broker:
        from protocols.transport.broker import wait_for_port

        log = open(self.folder / "mosquitto.log", "ab")
        self.proc = subprocess.Popen([self.binary, "-c", str(self.conf)], stdout=log, stderr=subprocess.STDOUT)
        wait_for_port("127.0.0.1", self.port, 10.0, alive=lambda: self.proc.poll() is None)
        return self

    def kill9(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None


# ----------------------------------------------------------------------------- watcher
@dataclass
class Event:
    t: float
    topic: str
    kind: str
    round: int
    edge_round: int
    sender: str
    cell: str | None
    data: bytes


class Watcher:
    """Records every fedtier message of the run (decoded headers), reconnecting after a broker restart;
    :meth:`wait` blocks until a predicate over the events holds."""

    def __init__(self, url: str, republish: Callable[[Watcher, Event], None] | None = None) -> None:
        import paho.mqtt.client as mqtt

        self.events: list[Event] = []
        self.cond = threading.Condition()
        self.republish = republish
        host, port = url.removeprefix("mqtt://").split(":")
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"faults-watcher-{os.getpid()}")
        self.client.on_connect = lambda c, *_: c.subscribe(f"fedtier/{RUN}/#", qos=1)
        self.client.on_message = self._on
        self.client.reconnect_delay_set(0.2, 1.0)
        self.client.connect(host, int(port))
        self.client.loop_start()

    def _on(self, _c: Any, _u: Any, msg: Any) -> None:
        from protocols.wire.envelope import decode_message

        try:
            head, _ = decode_message(msg.payload)
            ev = Event(
                time.time(), msg.topic, head.kind, head.round, head.edge_round, head.sender, head.cell, msg.payload
            )
        except ValueError:  # a JSON record: status, manifest, telemetry
            ev = Event(time.time(), msg.topic, "record", -1, -1, "", None, msg.payload)
            if msg.topic.endswith("/telemetry/cloud"):
                try:
                    ev.kind, ev.round = "round_record", int(json.loads(msg.payload)["round"])
                except (ValueError, KeyError, TypeError):
                    pass
        with self.cond:
            self.events.append(ev)
            self.cond.notify_all()
        if self.republish is not None:
            self.republish(self, ev)

    def wait(self, pred: Callable[[list[Event]], bool], timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: pred(self.events), timeout)

    def publish(self, topic: str, data: bytes) -> None:
        self.client.publish(topic, data, qos=1)

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


# ----------------------------------------------------------------------------- deployment
class Deployment:
    """One cloud, its cells and agents as OS processes (own process groups, logs in files)."""

    def __init__(
        self, tmp: Path, name: str, rounds: int, data: Path, broker: Broker, device_deadline: float = DEVICE_DEADLINE
    ) -> None:
        self.folder = tmp / name
        self.folder.mkdir(parents=True, exist_ok=True)
        self.out = self.folder / "run"
        self.config = self.folder / "config.toml"
        cell_deadline = max(CELL_DEADLINE, 2 * device_deadline * 1.5 + 10)
        self.config.write_text(
            CONFIG.format(rounds=rounds, out=self.out, device_deadline=device_deadline, cell_deadline=cell_deadline)
        )
        self.data, self.broker = data, broker
        self.procs: dict[str, subprocess.Popen] = {}
        self.rc: int | None = None  # the cloud's exit code once everything exited
        self.cells = ["c0", "c1"]
        self.devices = [f"{c}-d{j}" for c in self.cells for j in range(5)]
        self.cell_resume = (
            "--resume" in subprocess.run([FEDTIER, "cell", "--help"], capture_output=True, text=True).stdout
        )

    def command(self, node: str, resume: bool = False) -> list[str]:
        common = [str(self.config), "--broker", self.broker.url, "--insecure"]
        if node == "cloud":
            return [
                FEDTIER,
                "cloud",
                *common,
                "--test-data",
                str(self.data / "test.npz"),
                "--no-progress",
                *(["--resume"] if resume else []),
            ]
        if node in self.cells:
            return [FEDTIER, "cell", *common, "--cell", node, *(["--resume"] if resume and self.cell_resume else [])]
        return [FEDTIER, "agent", *common, "--device", node, "--data", str(self.data / f"{node}.npz")]

    def start(self, node: str, resume: bool = False) -> None:
        log = open(self.folder / f"{node}.log", "ab")
        self.procs[node] = subprocess.Popen(
            self.command(node, resume), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def signal(self, node: str, sig: int) -> None:
        proc = self.procs[node]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)

    def kill9(self, node: str) -> None:
        self.signal(node, signal.SIGKILL)
        self.procs[node].wait()

    def wait(self, timeout: float) -> int | None:
        """The cloud's exit code once every process has exited, ``None`` on timeout."""
        end = time.monotonic() + timeout
        for _node, proc in list(self.procs.items()):
            try:
                proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                return None
        return self.procs["cloud"].returncode

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGCONT)
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()

    def tracebacks(self) -> int:
        return sum(
            p.read_text(errors="replace").count("Traceback (most recent call last)") for p in self.folder.glob("*.log")
        )


# ----------------------------------------------------------------------------- scenarios
def first(kind: str, round_: int, edge: int | None = None, cell: str | None = None) -> Callable[[list[Event]], bool]:
    return lambda evs: any(
        e.kind == kind
        and e.round == round_
        and (edge is None or e.edge_round == edge)
        and (cell is None or e.cell == cell)
        for e in evs
    )


def all_of(
    kind: str, round_: int, n: int, edge: int | None = None, cell: str | None = None
) -> Callable[[list[Event]], bool]:
    """``n`` messages of ``kind`` on distinct topics (one per device or cell)."""
    return lambda evs: (
        len(
            {
                e.topic
                for e in evs
                if e.kind == kind
                and e.round == round_
                and (edge is None or e.edge_round == edge)
                and (cell is None or e.cell == cell)
            }
        )
        >= n
    )


def round_record(round_: int) -> Callable[[list[Event]], bool]:
    return first("round_record", round_)


MID_EDGE = ("mid edge round", lambda: all_of("device_task", 1, 5, 0, "c0"))  # c0's devices are training
CELL_AGG = ("during aggregation", lambda: all_of("device_result", 1, 5, 1, "c0"))
CLOUD_AGG = ("during aggregation", lambda: all_of("cell_report", 1, 2))
BETWEEN = ("between rounds", lambda: round_record(1))


@dataclass
class Scenario:
    name: str
    point: str
    trigger: Callable[[], Callable[[list[Event]], bool]] | None
    fault: Callable[[Deployment, Broker, Watcher], None] | None
    scope: str  # "cloud" or a cell: where recovery is measured
    republish: bool = False
    note: str = ""
    device_deadline: float | None = None  # this scenario's runtime.device_deadline (else DEVICE_DEADLINE)


def restart(node: str) -> Callable[[Deployment, Broker, Watcher], None]:
    def act(d: Deployment, _b: Broker, _w: Watcher) -> None:
        d.kill9(node)
        d.start(node, resume=True)

    return act


def kill(node: str) -> Callable[[Deployment, Broker, Watcher], None]:
    def act(d: Deployment, _b: Broker, _w: Watcher) -> None:
        d.kill9(node)  # and no restart: it is gone for good

    return act


def restart_agents(d: Deployment, _b: Broker, _w: Watcher) -> None:
    victims = [dev for dev in d.devices if dev.endswith(("-d0", "-d3", "-d4"))][:3]  # 3 of 10
    for v in victims:
        d.kill9(v)
    for v in victims:
        d.start(v)


def restart_broker(_d: Deployment, b: Broker, _w: Watcher) -> None:
    b.kill9()
    b.start()


def pause(node: str, seconds: float) -> Callable[[Deployment, Broker, Watcher], None]:
    def act(d: Deployment, _b: Broker, _w: Watcher) -> None:
        d.signal(node, signal.SIGSTOP)
        time.sleep(seconds)  # the fault itself is the length of the pause
        d.signal(node, signal.SIGCONT)

    return act


def scenarios() -> list[Scenario]:
    out = []
    for point, trig in (MID_EDGE, CLOUD_AGG, BETWEEN):
        out.append(Scenario("kill -9 cloud + --resume", point, trig, restart("cloud"), "cloud"))
    for point, trig in (MID_EDGE, CELL_AGG, BETWEEN):
        out.append(Scenario("kill -9 cell c0 + restart", point, trig, restart("c0"), "c0"))
    out.append(Scenario("kill -9 30% of agents + restart", MID_EDGE[0], MID_EDGE[1], restart_agents, "c0"))
    for point, trig in (MID_EDGE, CLOUD_AGG, BETWEEN):
        out.append(Scenario("kill -9 broker + restart", point, trig, restart_broker, "cloud"))
    out.append(Scenario("duplicate + reorder deliveries", "whole run", None, None, "cloud", republish=True))
    out.append(
        Scenario(
            f"SIGSTOP agent c0-d1 {DEVICE_DEADLINE + 3:g} s",
            "its task of round 1",
            lambda: first("device_task", 1, 0, "c0"),
            pause("c0-d1", DEVICE_DEADLINE + 3),
            "c0",
            note="past the device deadline: the cell closes the edge round without it (by design)",
        )
    )
    out.append(
        Scenario(
            f"kill -9 agent c0-d1, no restart (device_deadline {LONG_DEADLINE:g} s)",
            "its task of round 1 (training)",
            lambda: lambda evs: any(e.kind == "device_task" and e.round == 1 and "/c0-d1/" in e.topic for e in evs),
            kill("c0-d1"),
            "c0",
            note="the time lost is the recovery: its will says offline at once, the edge round waits heartbeat_timeout",
            device_deadline=LONG_DEADLINE,
        )
    )
    out.append(
        Scenario(
            f"SIGSTOP cell c1 {CELL_DEADLINE + 3:g} s",
            "its task of round 1",
            lambda: first("cell_task", 1, None, "c1"),
            pause("c1", CELL_DEADLINE + 3),
            "cloud",
            note="past the cell deadline: the cloud closes the round without it (by design)",
        )
    )
    return out


def republisher(seed: int) -> Callable[[Watcher, Event], None]:
    rng = random.Random(seed)
    lock = threading.Lock()
    done: set[bytes] = set()  # what was republished already: its copies come back to the watcher too

    def on(w: Watcher, ev: Event) -> None:
        if ev.kind not in ("cell_task", "device_task", "device_result", "cell_report"):
            return
        with lock:
            key = hashlib.sha1(ev.topic.encode() + b"\0" + ev.data).digest()
            if key in done:
                return
            done.add(key)
            delays = [rng.uniform(0, 0.3) for _ in range(rng.randint(1, 2))]
        for d in delays:
            threading.Timer(d, w.publish, (ev.topic, ev.data)).start()

    return on


# ----------------------------------------------------------------------------- measuring
@dataclass
class Result:
    name: str
    point: str
    completed: bool
    rounds_lost: int
    rounds_short: int
    results_lost: int
    model_equal: bool
    recovery_s: float | None
    tracebacks: int
    wall_s: float
    note: str = ""
    detail: list[str] = field(default_factory=list)


def read(out: Path) -> tuple[dict, dict, bytes]:
    """(cell answered per (round, edge, cell), round records per round, final model bytes)."""
    from protocols.records import CellRecord, read_run

    recs, _ = read_run(out)
    answered: dict[tuple[int, int, str], set[str]] = {}
    rounds: dict[int, Any] = {}
    for r in recs:
        if isinstance(r, CellRecord):
            answered.setdefault((r.round, r.edge_round, r.cell), set()).update(r.answered)
        else:
            rounds[r.round] = r  # a resumed round's last record
    model = out / "final_model.ftw"
    return answered, rounds, model.read_bytes() if model.exists() else b""


def losses(ref: tuple[dict, dict, bytes], got: tuple[dict, dict, bytes]) -> tuple[int, int, int, list[str]]:
    """(rounds lost: missing or closed with no cell report, rounds short: with any device result lost,
    device results lost, details)."""
    ref_ans, ref_rounds, _ = ref
    ans, rounds, _ = got
    lost_rounds = short = lost = 0
    detail: list[str] = []
    for n, rr in sorted(ref_rounds.items()):
        r = rounds.get(n)
        if r is None or (rr.cells_reported and not r.cells_reported):
            lost_rounds += 1
        here = 0
        for (rn, e, c), devs in sorted(ref_ans.items()):
            if rn != n:
                continue
            missing = devs if r is None or c not in r.cells_reported else devs - ans.get((rn, e, c), set())
            here += len(missing)
            if missing:
                detail.append(
                    f"round {n} edge round {e} cell {c}: lost {sorted(missing)}"
                    + ("" if r is None or c in r.cells_reported else " (no report of the cell)")
                )
        short += here > 0
        lost += here
    return lost_rounds, short, lost, detail


def recovery(out: Path, scope: str, since: float | None) -> float | None:
    from protocols.records import CellRecord, read_run

    if since is None:
        return None
    recs, _ = read_run(out)
    times = [
        r.time
        for r in recs
        if r.time is not None
        and r.time > since
        and (isinstance(r, CellRecord) and r.cell == scope if scope != "cloud" else not isinstance(r, CellRecord))
    ]
    return min(times) - since if times else None


def run_scenario(
    tmp: Path, sc: Scenario | None, rounds: int, data: Path, timeout: float
) -> tuple[Deployment, float | None, float]:
    name = "reference" if sc is None else f"{sc.name} @ {sc.point}".replace(" ", "_").replace("/", "_")
    broker = Broker(tmp / name / "broker").start()
    deadline = sc.device_deadline if sc is not None and sc.device_deadline else DEVICE_DEADLINE
    d = Deployment(tmp, name, rounds, data, broker, deadline)
    w = Watcher(broker.url, republisher(7) if sc is not None and sc.republish else None)
    fault_at: float | None = None
    t0 = time.monotonic()
    try:
        d.start("cloud")
        if not w.wait(lambda evs: any(e.topic.endswith("/status/cloud") for e in evs), 60):
            raise RuntimeError("the cloud did not come up")
        for node in [*d.cells, *d.devices]:
            d.start(node)
        if sc is not None and sc.trigger is not None and sc.fault is not None:
            trigger = sc.trigger()
            while time.monotonic() - t0 < timeout and d.procs["cloud"].poll() is None:
                if w.wait(trigger, 1.0):
                    fault_at = time.time()
                    sc.fault(d, broker, w)
                    break
        d.rc = d.wait(max(1.0, timeout - (time.monotonic() - t0)))
    finally:
        d.close()
        w.stop()
        broker.stop()
    return d, fault_at, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a scenario may take")
    ap.add_argument("--only", nargs="*", default=None, help="scenarios whose name or point contains any of these")
    ap.add_argument("--keep", default=None, help="keep run folders and logs here")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that every scenario's processes are ended
    chosen = [s for s in scenarios() if not args.only or any(o in f"{s.name} @ {s.point}" for o in args.only)]
    if args.list:
        for s in chosen:
            print(f"{s.name} @ {s.point}")
        return

    from edge_agent.runner import save_device_data
    from protocols.config import load_config
    from protocols.trainer import LocalData
    from sim.hierarchy import prepare

    tmp = Path(args.keep or tempfile.mkdtemp(prefix="fedtier-faults-"))
    tmp.mkdir(parents=True, exist_ok=True)
    data = tmp / "data"
    base = tmp / "base.toml"
    base.write_text(
        CONFIG.format(
            rounds=args.rounds, out=tmp / "base", device_deadline=DEVICE_DEADLINE, cell_deadline=CELL_DEADLINE
        )
    )
    prep = prepare(load_config(base))
    for device, local in prep.device_data.items():
        save_device_data(data / f"{device}.npz", local, prep.spec)
    save_device_data(data / "test.npz", LocalData(prep.dataset.x_test, prep.dataset.y_test), prep.spec)

    ref_dep, _, ref_wall = run_scenario(tmp, None, args.rounds, data, args.timeout)
    ref = read(ref_dep.out)
    if ref_dep.rc != 0 or not ref[2]:
        raise SystemExit(f"the uninterrupted run failed (exit {ref_dep.rc}); logs in {ref_dep.folder}")
    gaps = sorted(
        b.time - a.time
        for a, b in zip(
            sorted(ref[1].values(), key=lambda r: r.round), sorted(ref[1].values(), key=lambda r: r.round)[1:]
        )
    )
    print(
        f"uninterrupted run: {ref_wall:.0f} s, {len(ref[1])} rounds, a round every "
        f"{gaps[len(gaps) // 2]:.1f} s (median); tracebacks {ref_dep.tracebacks()}",
        flush=True,
    )
    results = []
    for sc in chosen:
        d, fault_at, wall = run_scenario(tmp, sc, args.rounds, data, args.timeout)
        got = read(d.out)
        lost_rounds, short, lost, detail = losses(ref, got)
        completed = d.rc == 0 and bool(got[2]) and len(got[1]) == len(ref[1])
        res = Result(
            sc.name,
            sc.point,
            completed,
            lost_rounds,
            short,
            lost,
            got[2] == ref[2],
            recovery(d.out, sc.scope, fault_at),
            d.tracebacks(),
            wall,
            sc.note,
            detail,
        )
        if sc.trigger is not None and fault_at is None:
            res.note = "fault point never reached"
        results.append(res)
        print(
            f"{sc.name} @ {sc.point}: completed {'yes' if completed else 'NO'} (exit {d.rc}), "
            f"rounds lost {lost_rounds}, rounds short {short}, device results lost {lost}, "
            f"model equal {'yes' if res.model_equal else 'no'}, "
            f"recovery {'-' if res.recovery_s is None else f'{res.recovery_s:.1f} s'}, tracebacks "
            f"{res.tracebacks}, {wall:.0f} s" + "".join(f"\n    {x}" for x in detail),
            flush=True,
        )
    print(
        "\n| scenario | fault point | completed | rounds lost | rounds short | device results lost | "
        "final model equal | recovery (s) | tracebacks |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r.name} | {r.point} | {'yes' if r.completed else 'no'} | {r.rounds_lost} | {r.rounds_short} | "
            f"{r.results_lost} | "
            f"{'yes' if r.model_equal else 'no'} | {'-' if r.recovery_s is None else f'{r.recovery_s:.1f}'} | "
            f"{r.tracebacks} |" + (f" {r.note}" if r.note else "")
        )
    print(f"(logs: {tmp})")


if __name__ == "__main__":
    main()
