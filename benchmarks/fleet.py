"""Fleet scale of ``fedtier run``: thousands of real MQTT agents on one machine.

1. ``--agents`` agents (default 2,000) in ``--cells`` cells (20) on one Mosquitto, ``--rounds`` cloud
   rounds (3) of hierarchical FedAvg (E = 2 edge rounds of H = 2 local steps) on a 3.2 kB MLP and
   synthetic data (10 samples per device). Prints startup time (launch to round 0), seconds per
   round, whether every device answered every edge round, and the peak, over the run, of the whole
   process tree (launcher, agent workers, Mosquitto): memory (RSS), threads, file descriptors; and
   the CPU seconds each kind of process spent in each round after the first (and the agent workers'
   per device task): unlike seconds per round, those hardly depend on what else the machine runs.
   ``--signed`` signs and verifies every message (``[security] keys``). ``--engine cohort``: each
   agent worker trains its queued tasks as cohorts (``runtime.engine = "cohort"``, batched over
   devices); it then also prints how many cohorts and their mean size.
2. ``--bridged-agents`` agents (default 500) in ``--bridged-cells`` cells (10) with a Mosquitto per
   cell bridged to a cloud Mosquitto (``fedtier run --brokers per-cell``): bytes through the cloud
   broker vs the cell brokers (Mosquitto's ``$SYS`` counters).

    .venv/bin/python benchmarks/fleet.py                    # both
    .venv/bin/python benchmarks/fleet.py --skip-bridged     # only the 2,000-agent run
    .venv/bin/python benchmarks/fleet.py --skip-bridged --rounds 4 --signed
    .venv/bin/python benchmarks/fleet.py --skip-bridged --rounds 4 --engine cohort

Heavy (about a minute of startup and several GB): run it on a quiet machine, once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from protocols.config import parse_config  # noqa: E402
from sim.emulation import Emulation  # noqa: E402


def fleet_config(
    out: Path,
    agents: int,
    cells: int,
    rounds: int,
    signed: bool = False,
    engine: str = "device",
    heartbeat: float = 5.0,
    cohort_size: int = 64,
) -> Any:
    """``signed``: ``[security] keys`` (fresh Ed25519 keys in the run folder): every message signed and
    verified. ``engine``: ``runtime.engine`` of the agent workers."""
    per_cell = agents // cells
    return parse_config(
        {
            **({"security": {"keys": str(out / "keys.toml")}} if signed else {}),
            "run": {"name": "fleet", "seed": 0, "rounds": rounds, "output": str(out)},
            "topology": {"cells": cells, "devices_per_cell": per_cell},
            "algorithm": {"name": "fedavg", "edge_rounds": 2, "local_steps": 2, "batch_size": 10, "lr": 0.1},
            "model": {"name": "mlp", "hidden": [32]},
            "data": {"dataset": "synthetic", "partition": "iid", "n": 10 * per_cell * cells},
            "runtime": {
                "device_deadline": 120.0,
                "startup_wait": 600.0,
                "engine": engine,
                "heartbeat": heartbeat,
                "cohort_size": cohort_size,
            },
        }
    )


# ------------------------------------------------------------------------------- process tree
def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(name))
    return kids


TICK = os.sysconf("SC_CLK_TCK")


def tree_usage(root: int, cpu: dict[int, tuple[str, float]] | None = None) -> dict[str, int]:
    """RSS bytes, threads and open file descriptors summed over ``root`` and its descendants; with
    ``cpu``, also records each process's (kind, CPU seconds so far) in it."""
    kids, todo, total = _children(), [root], {"rss": 0, "threads": 0, "fds": 0, "processes": 0}
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, []))
        try:
            if cpu is not None:
                with open(f"/proc/{pid}/stat") as f:
                    fields_ = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
                kind = (
                    "launcher"
                    if pid == root
                    else "mosquitto"
                    if b"mosquitto" in cmd
                    else "agent workers"
                    if b"spawn_main" in cmd
                    else "other"
                )
                if pid in cpu and cpu[pid][0] != "other":
                    kind = cpu[pid][0]  # an exiting process has no command line any more
                cpu[pid] = (kind, (int(fields_[11]) + int(fields_[12])) / TICK)
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            total["rss"] += int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
            total["threads"] += int(fields["Threads"])
            total["fds"] += len(os.listdir(f"/proc/{pid}/fd"))
            total["processes"] += 1
        except (OSError, KeyError, ValueError):
            continue
    return total


class Peak:
    """Samples the process tree every ``period`` seconds; keeps each figure's maximum."""

    def __init__(self, period: float = 2.0) -> None:
        """``period``: a sample scans all of /proc and each process's descriptors, in the launcher's
        process (its CPU counts as the launcher's): every 2 s costs it about a quarter of every 0.5 s."""
        self.peak = {"rss": 0, "threads": 0, "fds": 0, "processes": 0}
        self.cpu: dict[int, tuple[str, float]] = {}  # pid -> (kind, CPU seconds at its last sample)
        self.marks: list[dict[str, float]] = []  # CPU seconds by kind at each round's end
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def mark(self) -> None:
        """A round ended: snapshot every process's CPU seconds now (``per_round`` differences them)."""
        cpu: dict[int, tuple[str, float]] = {}
        tree_usage(os.getpid(), cpu)
        self.cpu.update(cpu)
        self.marks.append(self.cpu_by_kind())

    def per_round(self, kind: str | None) -> list[float]:
        """CPU seconds of ``kind`` (None: all) spent in each round (from the first round's end on: the
        first round starts when startup ends, which is not marked, so round 0 is left out)."""
        totals = [sum(m.values()) if kind is None else m.get(kind, 0.0) for m in self.marks]
        return [b - a for a, b in zip(totals, totals[1:])]

    def cpu_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for kind, seconds in self.cpu.values():
            out[kind] = out.get(kind, 0.0) + seconds
        return out

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            for k, v in tree_usage(os.getpid(), self.cpu).items():
                self.peak[k] = max(self.peak[k], v)


# ------------------------------------------------------------------------------------- runs
def shared_run(
    agents: int,
    cells: int,
    rounds: int,
    workers: int | None,
    signed: bool = False,
    engine: str = "device",
    heartbeat: float = 5.0,
    cohort_size: int = 64,
) -> None:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fedtier-fleet-") as tmp:
        cfg = fleet_config(Path(tmp) / "run", agents, cells, rounds, signed, engine, heartbeat, cohort_size)
        t0 = time.time()
        with Peak() as peak:
            em = Emulation(cfg, workers=workers, on_round=lambda r: peak.mark())
            result = em.run()
        h = result.history
        startup = h[0]["time"] - h[0]["duration_s"] - t0
        per_round = [r["duration_s"] for r in h]
        answered = all(
            len(r["answered"]) == cfg.topology.devices_per_cell and not r["absent"] for r in result.cell_records
        )
        model_bytes = sum(v.nbytes for v in result.params.values())
        p = peak.peak
        print(
            f"== {agents} agents in {cells} cells, one Mosquitto, {len(em.procs)} agent workers, "
            f"{os.cpu_count()} cores, {'signed' if signed else 'unsigned'}, engine {engine}, heartbeat "
            f"{heartbeat:g} s, load average before {load_before:.1f}"
        )
        print(f"startup (launch to round 0)  {startup:8.1f} s   (target <= 60 s)")
        print(f"seconds per round            {' '.join(f'{s:.2f}' for s in per_round)}   (target <= 5 s)")
        print(f"rounds / every device answered every edge round: {len(h)} / {answered}")
        print(
            f"cell records {len(result.cell_records)}, "
            f"device tasks {sum(t['tasks'] for t in result.device_traffic.values())}"
        )
        print(
            f"peak of the process tree: RSS {p['rss'] / 2**30:.2f} GB (target <= 6 GB), threads {p['threads']}, "
            f"fds {p['fds']}, processes {p['processes']}"
        )
        print(
            f"model {model_bytes:,} bytes; wall {result.wall_s:.1f} s; CPU seconds: "
            + ", ".join(f"{k} {v:.1f}" for k, v in sorted(peak.cpu_by_kind().items())),
            flush=True,
        )
        tasks_per_round = 2 * agents  # E = 2 edge rounds, every device answers each
        for kind in ("agent workers", "launcher", "mosquitto"):
            per = peak.per_round(kind)
            if per:
                print(
                    f"CPU s per round, {kind:<13} {' '.join(f'{c:.2f}' for c in per)}"
                    + (
                        f"   ({1e3 * sum(per) / len(per) / tasks_per_round:.2f} ms per device task)"
                        if kind == "agent workers"
                        else ""
                    )
                )
        sizes = [s for stats in em.agent_stats.values() for s in stats.get("cohort_sizes", [])]
        if sizes:
            cohorts = round(sum(1 / s for s in sizes))
            print(
                f"cohorts {cohorts} for {len(sizes)} device tasks: mean size {len(sizes) / cohorts:.1f}, "
                f"largest {max(sizes)} (runtime.cohort_size {cfg.runtime.cohort_size})"
            )
        print(
            f"CPU s per round, all          {' '.join(f'{c:.2f}' for c in peak.per_round(None))}"
            f"   (on {os.cpu_count()} cores, a round needs at least total / cores seconds)",
            flush=True,
        )


def bridged_run(agents: int, cells: int, rounds: int, workers: int | None) -> None:
    with tempfile.TemporaryDirectory(prefix="fedtier-fleet-") as tmp:
        cfg = fleet_config(Path(tmp) / "run", agents, cells, rounds)
        em = Emulation(cfg, workers=workers, brokers="per-cell")
        result = em.run()
        b = em.broker_bytes
        cloud = b["cloud"]["received"] + b["cloud"]["sent"]
        cell_total = sum(v["received"] + v["sent"] for k, v in b.items() if k != "cloud")
        answered = all(not r["absent"] for r in result.cell_records)
        print(
            f"== {agents} agents in {cells} cells, a Mosquitto per cell bridged to a cloud Mosquitto, "
            f"{rounds} rounds, every device answered: {answered}"
        )
        print(
            f"bytes through the cloud broker   {cloud:>12,}  (received {b['cloud']['received']:,}, "
            f"sent {b['cloud']['sent']:,})"
        )
        print(f"bytes through the cell brokers   {cell_total:>12,}  ({cells} brokers, bridges included)")
        print(f"cloud / cells                    {cloud / cell_total:12.3f}")
        print(f"wire bytes by tier (at the publishers): {result.wire_bytes}", flush=True)


# ------------------------------------------------------------------------- two jobs, one federation
def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def jobs_worker(job: dict[str, Any], results: Any) -> None:
    """A worker process of long-lived agents (``edge_agent.service.AgentService``): its devices serve every
    job the cloud publishes until the launcher terminates it; after each job it reports to ``results``."""
    import logging
    import signal

    from edge_agent.runner import AgentProcess, BrokerOptions, load_device_data, make_trainer
    from edge_agent.service import AgentService
    from protocols import procs
    from protocols.safe_text import log_to_stderr
    from protocols.transport.threadloop import ThreadLoop
    from protocols.wire import topics
    from sim.emulation import raise_fd_limit
    from sim.hierarchy import device_availability

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    procs.die_with_parent(job["parent"])
    log_to_stderr(logging.WARNING, "%(processName)s %(message)s")
    raise_fd_limit()
    bundle = parse_config(job["bundle"])
    data, shape, classes = {}, None, None
    for device, path in job["devices"].items():
        data[device], shape, classes = load_device_data(path)
    opts = BrokerOptions(**job["broker"])
    loop = ThreadLoop("agents-watch")
    first = topics.device_node(next(iter(data)))

    def build(cfg: Any, session: str) -> AgentProcess:
        spec = cfg.model_spec(shape, classes)
        algorithm = cfg.build_algorithm(spec)
        trainer = make_trainer("torch", spec, cfg)
        return AgentProcess(
            cfg, algorithm, data, trainer, opts, availability=device_availability(cfg), session=session, long_lived=True
        )

    service = AgentService(
        bundle,
        list(data),
        loop,
        lambda: opts.transport(first, bundle.run.name, loop, persistent=False).connect(),
        build,
        None,
    )
    service.on_job_end = lambda name: results.put((job["index"], name, time.time()))
    signal.signal(signal.SIGTERM, lambda *_: service.stop())
    service.serve()


def jobs_run(agents: int, cells: int, rounds: int, jobs: int, workers: int | None) -> None:
    """``jobs`` jobs back to back on one federation of long-lived nodes: the cloud and cells as services in
    this process (``CloudService``, ``CellService``), the agents in worker processes that serve every job
    (``AgentService``), one Mosquitto; unsigned. Prints, per job, when it ended and when the next one's
    round 0 began, and the process tree's RSS and threads after each job."""
    import multiprocessing as mp

    from cell_server.node import build_cell
    from cell_server.service import CellService
    from cloud.jobs import JobQueue
    from cloud.service import CloudService, JobParts
    from edge_agent.runner import BrokerOptions, save_device_data
    from protocols import procs, runfiles
    from protocols.jobs import JobRequest, submit_record
    from protocols.transport.broker import MosquittoBroker
    from protocols.transport.threadloop import ThreadLoop
    from protocols.wire import topics
    from protocols.wire.signed import seal_record
    from sim.emulation import agent_workers, worker_groups
    from sim.hierarchy import edge_availability, make_evaluator, prepare

    with tempfile.TemporaryDirectory(prefix="fedtier-fleet-jobs-") as tmp:
        root = Path(tmp)
        cfg = fleet_config(root / "run", agents, cells, rounds)
        fed = cfg.run.name
        prep = prepare(cfg)
        files = {}
        (root / "devices").mkdir(parents=True)
        for device, data in prep.device_data.items():
            files[device] = str(root / "devices" / f"{device}.npz")
            save_device_data(Path(files[device]), data, prep.spec)
        broker = MosquittoBroker().start()
        opts = BrokerOptions(broker.url)
        bundle = {"run": {"name": fed, "output": str(root / "cloud")}, "topology": cfg.topology.model_dump()}
        cloud_bundle = parse_config(bundle)
        cell_bundle = parse_config({**bundle, "run": {"name": fed, "output": str(root / "cells")}})
        t0 = time.time()

        cloud_loop = ThreadLoop("cloud")
        evaluator = make_evaluator(prep.spec, prep.dataset.x_test, prep.dataset.y_test, "cpu")
        cloud = CloudService(
            cloud_bundle,
            cloud_loop,
            lambda: opts.transport("cloud", fed, cloud_loop).connect(),
            JobQueue(root / "cloud" / "jobs.json"),
            lambda c: JobParts(c.build_algorithm(prep.spec), evaluator),
            trust=None,
            operator=None,
        )
        threads = [threading.Thread(target=cloud.serve, name="cloud", daemon=True)]
        services = [cloud]
        for c in cfg.topology.cell_ids():
            loop = ThreadLoop(f"cell-{c}")

            def build(job_cfg: Any, transport: Any, c: str = c) -> Any:
                job_cfg.output_dir().mkdir(parents=True, exist_ok=True)
                return build_cell(
                    job_cfg,
                    c,
                    transport,
                    job_cfg.build_algorithm(prep.spec),
                    output_dir=job_cfg.output_dir(),
                    heartbeats=True,
                    availability=edge_availability(job_cfg),
                )

            node = topics.cell_node(c)
            cell = CellService(
                cell_bundle, c, loop, lambda n=node, lp=loop: opts.transport(n, fed, lp).connect(), build, None
            )
            services.append(cell)
            threads.append(threading.Thread(target=cell.serve, name=f"cell-{c}", daemon=True))
        for t in threads:
            t.start()
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        groups = worker_groups(cfg.topology.all_devices(), workers or agent_workers(agents))
        workers_ = []
        for i, group in enumerate(groups):
            job = {
                "index": i,
                "parent": os.getpid(),
                "bundle": bundle,
                "broker": opts.__dict__,
                "devices": {d: files[d] for d in group},
            }
            proc = ctx.Process(target=jobs_worker, args=(job, results), name=f"fedtier-agents-{i}", daemon=True)
            procs.spawn(proc.start)
            workers_.append(proc)

        while cloud.transport is None or not cloud.transport.wait_subscribed(1.0):  # its first session: until
            time.sleep(0.1)  # it subscribed, a submission would reach nobody
        operator_loop = ThreadLoop("operator").start()
        operator = opts.transport("operator", fed, operator_loop, persistent=False).connect()
        names = [f"job{j + 1}" for j in range(jobs)]
        for j, name in enumerate(names):
            job_cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"seed": j})})
            text = job_cfg.to_toml(exclude=("broker", "security", "monitoring"))
            topic = topics.job_submit(fed)
            operator.publish(topic, seal_record(submit_record(JobRequest(name, text)), topic, None))
        usage = []
        for name in names:
            waited = 0
            while (job := cloud.queue.get(name)) is None or job.state not in ("finished", "failed", "cancelled"):
                time.sleep(0.2)
                waited += 1
                if waited % 50 == 0 and os.environ.get("FLEET_DEBUG"):
                    node = cloud.node
                    print(
                        f"  {name}: {job.state if job else 'unknown'}, cloud round "
                        f"{node.round if node else None}, ready {node.presence.ready if node else None}, "
                        f"results so far {results.qsize()}",
                        flush=True,
                    )
            time.sleep(1.0)  # the agents leave the job and go back to waiting
            usage.append(tree_usage(os.getpid()))
            print(
                f"{name}: {job.state} at +{job.ended - t0:.1f} s; process tree RSS {usage[-1]['rss'] / 2**30:.2f} GB, "
                f"threads {usage[-1]['threads']}",
                flush=True,
            )
        for a, b in zip(names, names[1:]):
            first = json.loads((root / "cloud" / "jobs" / b / runfiles.METRICS).read_text().splitlines()[0])
            ended = cloud.queue.get(a).ended
            print(f"{a} end -> {b} round 0 start: {first['time'] - first['duration_s'] - ended:.1f} s (target <= 10 s)")
        for name in names:
            records = [r for f in (root / "cells" / "jobs" / name).glob("aggregation*.jsonl") for r in _jsonl(f)]
            answered = sum(len(r["answered"]) for r in records)
            planned = sum(len(r["planned"]) for r in records)
            rounds_done = len((root / "cloud" / "jobs" / name / runfiles.METRICS).read_text().splitlines())
            print(
                f"{name}: {rounds_done} rounds, {len(records)} cell records, {answered} of {planned} planned device "
                f"tasks answered"
            )
        if len(usage) > 1:
            u, v = usage[0], usage[-1]
            print(
                f"after the last job vs after the first: RSS {100 * (v['rss'] / u['rss'] - 1):+.1f}%, "
                f"threads {100 * (v['threads'] / u['threads'] - 1):+.1f}% (target within 5%)",
                flush=True,
            )
        for s in services:
            s.stop()
        for p in workers_:
            p.terminate()
        for p in workers_:
            p.join(10)
        operator.close()
        operator_loop.stop()
        broker.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=2000)
    ap.add_argument("--cells", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=None, help="agent worker processes (default: fedtier run's)")
    ap.add_argument("--bridged-agents", type=int, default=500)
    ap.add_argument("--bridged-cells", type=int, default=10)
    ap.add_argument("--skip-shared", action="store_true")
    ap.add_argument("--skip-bridged", action="store_true")
    ap.add_argument("--signed", action="store_true", help="[security] keys: sign and verify every message")
    ap.add_argument(
        "--engine",
        choices=("device", "cohort"),
        default="device",
        help="runtime.engine of the agent workers (cohort: batched over the queued devices)",
    )
    ap.add_argument("--cohort-size", type=int, default=64, help="runtime.cohort_size (with --engine cohort)")
    ap.add_argument("--heartbeat", type=float, default=5.0, help="runtime.heartbeat of agents and cells (0: none)")
    ap.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="instead: JOBS jobs back to back on one federation of long-lived nodes (--agents, --cells, --rounds)",
    )
    args = ap.parse_args()
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    if args.jobs:
        jobs_run(args.agents, args.cells, args.rounds, args.jobs, args.workers)
        return
    if not args.skip_shared:
        shared_run(
            args.agents,
            args.cells,
            args.rounds,
            args.workers,
            args.signed,
            args.engine,
            args.heartbeat,
            args.cohort_size,
        )
    if not args.skip_bridged:
        bridged_run(args.bridged_agents, args.bridged_cells, args.rounds, args.workers)


if __name__ == "__main__":
    main()
