"""``[runtime]``: deadlines, liveness and stall rules, and where and how devices train (engines, workers, cell
processes, threads), checked by pydantic (unknown keys are errors)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..limits import MAX_MESSAGE_BYTES, MAX_PROCESSES, MAX_SECONDS, MAX_THREADS
from .sections import Section


class RuntimeSection(Section):
    device_deadline: float = Field(
        default=120.0,
        gt=0,
        le=MAX_SECONDS,
        description="seconds a cell waits for devices (async mode: how long a cell with no task outstanding waits "
        "before it sends one more task to its devices held back after too many returns in one version)",
    )
    cell_deadline: float | None = Field(
        default=None, gt=0, le=MAX_SECONDS, description="seconds the cloud waits for cells"
    )
    quorum: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="a cell closes an edge round once this fraction of its planned devices answered",
    )
    eval_every: int = Field(default=1, ge=1, description="the cloud evaluates the global model every this many rounds")
    device: str = Field(
        default="cpu",
        pattern=r"^(cpu|auto|cuda(:[0-9]+)?)$",
        description="torch device: cpu, cuda (cuda:N), or auto (CUDA when present; the cohort engine keeps "
        "small workloads on the CPU and logs its choice); cuda without a CUDA device is an error at start",
    )
    startup_wait: float = Field(
        default=60.0,
        ge=0,
        le=MAX_SECONDS,
        description="seconds the cloud waits, before its first round, for every cell's devices to be online (MQTT; "
        "not those unfit for the job or sitting the round out under participation); a one-shot `fedtier cell` or "
        "`fedtier agent` that finds its run already finished (the cloud offline, its `finished` record retained) "
        "waits this long for a new run's cloud, then leaves",
    )
    heartbeat: float = Field(
        default=5.0,
        ge=0,
        le=MAX_SECONDS,
        description="seconds between heartbeats of agents and cells (MQTT; 0: none, the broker's last will only)",
    )
    heartbeat_timeout: float = Field(
        default=30.0,
        ge=0,
        le=MAX_SECONDS,
        description="a cell deems a device offline when its last heartbeat is older than this (MQTT; 0: never)",
    )
    max_record_bytes: int | None = Field(
        default=256 << 20,
        gt=4096,
        description="a records file (metrics.jsonl, aggregation.jsonl, cells.jsonl) rotates past this size, the "
        "4 latest rotated files kept (file.1 ... file.4; readers take them all): bounded disk use for long-lived "
        "nodes; none: never rotate",
    )
    max_stalled_rounds: int = Field(
        default=3,
        ge=1,
        description="the job fails after this many cloud rounds in a row without progress: no cell answered "
        "(fewer than min_cells), every device that answered failed its task or diverged, every answer refused "
        "(a role's check), every device tasked "
        "missed device_deadline, or every device taking part was offline and no device of the job online; a job "
        "none of whose rounds made progress fails at its end, however few its rounds",
    )
    min_cells: int = Field(
        default=1,
        ge=1,
        description="a cloud round makes progress only when at least this many cells answered (at most the "
        "topology's cells; a job that runs on fewer, or loses some, needs all of its own); see max_stalled_rounds",
    )
    fail_on_cell_failure: bool = Field(
        default=True,
        description="a cell whose handler raised (a bug) answers its rounds 'failed' and the cloud fails the job; "
        "false: the cloud leaves that cell out of the round (cells_failed in its record) and the stall rule "
        "decides (a federation whose cells are not all trusted: a cell with valid credentials cannot end the job); "
        "asynchronous: the failed cell pushes 'failed' once, and false leaves it out of the job (runtime.min_cells)",
    )
    rejoin_wait: float = Field(
        default=30.0,
        ge=0,
        le=MAX_SECONDS,
        description="seconds a cell waits, before planning an edge "
        "round, for participating devices that are offline (rejoining; MQTT)",
    )
    rejoin_poll: float = Field(
        default=0.5,
        gt=0,
        le=MAX_SECONDS,
        description="seconds between an absent agent's reconnections "
        "to read the round manifest (participation in fedtier run)",
    )
    absent_ids: int = Field(
        default=100,
        ge=0,
        description="a cell's aggregation record names the absent devices "
        "of a reason (not participating, offline...) up to this many, and only counts them "
        "beyond (large populations)",
    )
    onnx_devices: list[str] = Field(
        default_factory=list,
        description="device ids that run forward-only on onnxruntime (sim/emulation); the others run torch",
    )
    onnx_model: str | None = Field(
        default=None, description="the .onnx file (fedtier export) that onnx-backend agents load"
    )
    sim_workers: int = Field(
        default=0,
        ge=0,
        le=MAX_PROCESSES,
        description="fedtier sim: worker processes (or Ray actors) that "
        "train the devices in parallel, each a fixed round-robin share; 0: in the main "
        "process. Same final model either way",
    )
    cell_processes: int = Field(
        default=0,
        ge=0,
        le=MAX_PROCESSES,
        description="fedtier sim: processes that each run a fixed share of the cells with their devices (and their "
        "training), the cloud staying in the main process; cloud-cell messages cross as their encoded bytes, and "
        "virtual time moves only when every process has nothing left to do before it, so the model, records and "
        "byte counts are those of one process (what crosses at one virtual instant arrives in sender order either "
        "way). Each process loads the whole data set (as the main process does) and trains its cohorts with its "
        "share of cohort_threads (cell_process_threads). Not with sim_workers or onnx_devices, nor an asynchronous "
        "algorithm without [clock] device_steps_per_s; 0: one process",
    )
    cell_process_threads: int | None = Field(
        default=None,
        ge=1,
        le=MAX_THREADS,
        description="engine = cohort with cell_processes: torch threads of each cell process's cohorts; none: its "
        "share of cohort_threads (cohort_threads // cell_processes, at least 1; the cloud's evaluation in the main "
        "process, which runs while they wait, takes all of cohort_threads). The run logs the plan",
    )
    sim_backend: Literal["processes", "ray"] = Field(
        default="processes",
        description="fedtier sim workers: local processes, or Ray actors (pip install 'fedtier[ray]')",
    )
    worker_stall_s: float = Field(
        default=300.0,
        gt=0,
        le=MAX_SECONDS,
        description="fedtier sim workers (and cell_processes): a worker (process or Ray actor) that owes results "
        "and has sent nothing, "
        "no result and no progress beat (one comes every few seconds while it trains), for this many seconds is "
        "taken as hung (stopped, deadlocked, stuck in a kernel): the run stops naming it, and --resume continues. "
        "A slow worker still beats; only one training step longer than this would be mistaken",
    )
    ray_address: str | None = Field(
        default=None,
        description="sim_backend = ray: the cluster to join (HEAD:6379 from a node of it, auto: the one ray start "
        "began here; ray://HEAD:10001, Ray Client, from elsewhere; local: a new local Ray instance); none: "
        "RAY_ADDRESS, else a cluster ray start began on this machine, else a new local Ray instance",
    )
    engine: Literal["device", "cohort"] = Field(
        default="device",
        description="fedtier sim and the agent "
        "workers of fedtier run: train each device alone (bit-identical "
        "between the two) or the queued devices as one batched model "
        "(edge_agent/cohort.py)",
    )
    cohort_size: int = Field(default=64, ge=1, description="engine = cohort: most devices trained at once")
    cohort_threads: int = Field(
        default=1,
        ge=1,
        le=MAX_THREADS,
        description="engine = cohort: torch threads a cohort computes with (the machine's cores, for large cohorts)",
    )
    direction_threads: int = Field(
        default=1,
        ge=1,
        le=64,
        description="seeded-direction algorithms (DeComFL): threads a process draws a step's P random directions "
        "in (each direction its own generator: the same bits with any number; less wall time on free cores); above "
        "1, fedtier sim's cloud and cells also draw a round's directions ahead, beside their other work (with "
        "cell_processes, once their process has handed its turn over: a cell the next round's as it reported), and "
        "a cell replays the round before for its devices in a thread of its own as its task comes",
    )
    cell_sums: Literal["auto", "host", "engine"] = Field(
        default="auto",
        description="fedtier sim: where a cell sums its devices' results (its weighted mean, Multi-Krum's kept "
        "mean, an async cell's staleness-weighted sum; the other robust aggregators stay on the host): auto: on "
        "the cohort engine's device when it is a GPU (engine = cohort; device = cuda, or auto choosing it) and a sum "
        "has at least 16 MiB of results, else the host; host: numpy on the host; engine: on the devices' torch "
        "device even when it is the CPU (tests: slower there). The same bits every way (float64, in sender "
        "order); fedtier run's cells sum on the host",
    )
    max_message_bytes: int | None = Field(
        default=None,
        gt=1024,
        le=MAX_MESSAGE_BYTES,
        description="largest message a node accepts "
        "(chunked sets are refused at their first chunk); none: 8 x the model's "
        "float32 size + 4 MiB",
    )
