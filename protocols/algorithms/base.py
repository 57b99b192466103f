"""The three roles every algorithm defines, and the algorithm bundle that builds them.

Roles are pure: no sockets, no clocks, no global RNG. They take state and messages (``Payload``)
and return state and messages; the runtimes (``edge_agent``, ``cell_server``, ``cloud``) own I/O,
timing, retries and persistence. Randomness comes from ``protocols.seeding.rng`` keyed by
``(seed, round, cell, device, purpose)``.

A round, as the runtimes drive it::

    cloud.plan(r, cells)            -> {cell: task}                  (cloud -> cell)
      cell.begin(r, task)
      repeat for e in range(cell.edge_rounds):
        cell.plan(e, available)     -> {device: task}                (cell -> device)
          device.train(task, ...)   -> result                        (device -> cell)
        cell.check(device, result)  raises Rejected on a bad result
        cell.aggregate(e, results)  -> Outcome (metrics, excluded)
      cell.report()                 -> report                        (cell -> cloud)
    cloud.check(cell, report)       raises Rejected on a bad report
    cloud.aggregate(r, reports)     -> Outcome (metrics, excluded, epsilon)
    cloud.stop_reason(r + 1)        -> None, or why the run ends here
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .. import plugins
from ..limits import MAX_ROUNDS, MAX_STEPS
from ..rejections import Rejected as Rejected  # re-exported: roles import it with the other role types
from ..trainer import LocalData, Trainer
from ..wire.payload import Payload
from .outcome import Outcome
from .traits import Layer, Trait, compose_traits, lacks

CHANNEL_WIDTHS = {"cnn": 2, "cnn4": 4}  # conv models: how many widths model.channels lists


OrInfinity = Annotated[float, Field(ge=0, allow_inf_nan=True)]
"""A non-negative parameter for which infinity means "no bound" (TrainParams refuses infinity elsewhere)."""


class ModelSpec(BaseModel):
    """Which zoo model every tier builds (see ``protocols.models.build_model``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "mlp"
    input_shape: tuple[int, ...] = (784,)
    num_classes: int = Field(default=10, ge=2)
    hidden: tuple[int, ...] = (200, 200)
    channels: tuple[int, ...] = (32, 64)
    fc: int = Field(default=512, ge=0)  # cnn: 0 = no hidden fully connected layer
    init_std: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _channels_fit(self) -> ModelSpec:
        need = CHANNEL_WIDTHS.get(self.name)
        if need is not None and len(self.channels) != need:
            raise ValueError(f"model {self.name} needs {need} channel widths, got {list(self.channels)}")
        return self

    def build_kwargs(self) -> dict[str, Any]:
        return {"hidden": self.hidden, "channels": self.channels, "fc": self.fc}

    def num_params(self) -> int:
        """Parameter count of the model (as ``protocols.models.build_model`` builds it), without torch for the
        zoo's; a registered model (``protocols.plugins.register_model``) is built once and counted."""
        if self.name in plugins.MODELS:
            return plugins.registered_num_params(self.name, self.input_shape, self.num_classes)
        return _zoo_num_params(self)

    def _zoo_count(self) -> int:
        n_in, k = int(np.prod(self.input_shape)), self.num_classes
        if self.name == "cnn4":
            c, h, w = self.input_shape if len(self.input_shape) == 3 else (1, *self.input_shape[-2:])
            total, side = 0, (h, w)
            for width in self.channels:
                total += c * width * 9 + 2 * width  # conv (no bias) + GroupNorm scale and shift
                c, side = width, (side[0] // 2, side[1] // 2)
            return total + c * side[0] * side[1] * k
        if self.name == "cnn":
            c, h, w = self.input_shape if len(self.input_shape) == 3 else (1, *self.input_shape[-2:])
            c1, c2 = self.channels
            flat = c2 * (h // 4) * (w // 4)
            head = (flat + 1) * self.fc + (self.fc + 1) * k if self.fc else (flat + 1) * k
            return (c * 25 + 1) * c1 + (c1 * 25 + 1) * c2 + head
        widths = [n_in, *(self.hidden if self.name == "mlp" else ()), k]
        return sum((a + 1) * b for a, b in zip(widths, widths[1:]))


@functools.lru_cache(maxsize=256)
def _zoo_num_params(spec: ModelSpec) -> int:
    """A zoo model's parameter count, counted once a spec (a frozen model: every agent a simulation builds asks)."""
    return spec._zoo_count()


_T = TypeVar("_T")


def non_defaults(model: BaseModel, keys: Mapping[str, _T]) -> dict[str, tuple[Any, _T]]:
    """The ``keys`` that ``model`` sets to other than their default: key -> (its value, what ``keys`` says of it).
    The one rule of the config's keys that other settings make ineffective (:meth:`TrainParams.idle_keys`, and
    the sections' own, ``protocols.config``): such a key set to other than its default is refused."""
    values = model.model_dump(include=set(keys))
    fields = type(model).model_fields
    return {
        key: (values[key], said)
        for key, said in keys.items()
        if values[key] != fields[key].get_default(call_default_factory=True)
    }


class TrainParams(BaseModel):
    """Parameters every algorithm shares. Algorithms subclass this with their own fields.

    ``edge_rounds`` is E (edge rounds per cloud round); a device runs ``local_steps`` (H) SGD steps
    per edge round, or ``local_epochs`` epochs when ``local_steps`` is 0. Infinite and NaN numbers are refused,
    unless a field says what infinity means (``Field(allow_inf_nan=True)``).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(description="the algorithm: fedavg, hist, fedalign, decomfl or fedmrn")
    edge_rounds: int = Field(default=1, ge=1, le=MAX_ROUNDS, description="E: edge rounds a cell runs per cloud round")
    local_steps: int = Field(
        default=0, ge=0, le=MAX_STEPS, description="H: local SGD steps a device runs per edge round (0: local_epochs)"
    )
    local_epochs: float = Field(
        default=1.0,
        ge=0,
        le=MAX_STEPS,
        description="epochs over its data a device runs per edge round (when local_steps = 0)",
    )
    batch_size: int = Field(default=32, ge=1, description="devices' minibatch size")
    lr: float = Field(default=0.05, gt=0, description="devices' learning rate")
    weight_decay: float = Field(default=0.0, ge=0, description="devices' L2 weight decay")
    server_lr: float = Field(
        default=1.0, gt=0, description="the cloud applies server_lr x the weighted mean of the cells' progress"
    )

    def layers(self) -> tuple[Layer, ...]:
        """The layers these parameters put over the base algorithm (codec, robust aggregation, server
        optimizer, asynchronous mode), innermost first; parameter mixins add theirs to ``super().layers()``."""
        return ()

    def idle_keys(self) -> dict[str, str]:
        """The keys that have no effect with the values of the others (``trim_beta`` without a trimmed mean), each
        with the setting it needs; config validation refuses one set to other than its default
        (``protocols.config.run.validate_algorithm``). Parameter mixins add theirs to ``super().idle_keys()``."""
        return {"local_epochs": "local_steps = 0 (local_steps counts the SGD steps)"} if self.local_steps else {}

    def check_topology(self, cells: Mapping[str, Sequence[str]]) -> None:
        """Raise ``ValueError`` naming the key when these parameters cannot do what they say on the run's device ids
        per cell (``compose`` asks; a trimmed mean that would cut nobody); mixins chain ``super()``."""

    def idle_settings(self) -> dict[str, tuple[Any, str]]:
        """The :meth:`idle_keys` set to other than their default: key -> (its value, the setting it needs)."""
        return non_defaults(self, self.idle_keys())

    @model_validator(mode="after")
    def _some_local_work(self) -> TrainParams:
        if self.local_steps == 0 and self.local_epochs == 0:
            raise ValueError("set local_steps or local_epochs to a positive value")
        return self


@dataclass(frozen=True)
class DeviceContext:
    """Who and when a device is training: keys for its random draws."""

    seed: int
    round: int
    edge_round: int
    cell: str
    device: str


class CloudRole(ABC):
    """Plans each cloud round and folds the cells' reports into the global state."""

    def weight_keys(self) -> dict[str, float]:
        """The sample counts of a cell's report (keys of its ``meta``), each with how many times its cell's weight
        bound (:func:`protocols.bounds.cell_weight_bound`) it may reach: 1 where a report counts each device once
        per cloud round, ``E`` where it adds every edge round's. The cloud's runtime refuses a report beyond any
        (``cloud.parts.report_refusal``), so no count is a lever."""
        return {"weight": 1.0}

    def member_keys(self) -> tuple[str, ...]:
        """The keys of a cell's report (its ``meta``) that list devices of that cell (DeComFL's ``answered``): the
        cloud's runtime refuses a report naming any other (``cloud.parts.report_refusal``), so a cell cannot count
        devices it does not have."""
        return ()

    def member_weight_keys(self) -> dict[str, str]:
        """``weights key -> devices key`` of a cell's report: lists that give each device it names (a
        :meth:`member_keys` list) a sample count; the cloud's runtime refuses a report giving one more than that
        device's bound (``cloud.parts.report_refusal``), so a cell cannot weigh one device with its others'."""
        return {}

    @abstractmethod
    def plan(self, round: int, cells: Sequence[str]) -> dict[str, Payload]:
        """The task of each cell this round."""

    def check(self, cell: str, report: Payload) -> None:  # noqa: B027 an optional hook, empty by default
        """Raise :class:`Rejected` if ``report`` cannot be aggregated."""

    idle_calls = False
    """Whether its process calls :meth:`idle` as it waits for the cells (``fedtier sim`` with cell processes): work
    the role would start at once may wait for it."""

    def idle(self) -> None:  # noqa: B027 an optional hook, empty by default
        """Its process waits for the cells now (its turn is over): work for later that needs nothing more may start
        (DeComFL's cloud draws the round's directions for its end)."""

    @abstractmethod
    def aggregate(self, round: int, reports: Mapping[str, Payload]) -> Outcome:
        """Update the global state from the reports that arrived (sorted by cell id); its outcome out."""

    def stop_reason(self, round: int) -> str | None:
        """Why cloud round ``round`` must not start (e.g. it would exceed a privacy budget), or None (go on)."""
        return None

    @abstractmethod
    def global_params(self) -> dict[str, np.ndarray]:
        """The global model, for evaluation and for the final output."""

    @abstractmethod
    def state(self) -> Payload:
        """Everything needed to resume after a restart, as a payload (checkpointed each round), but the log
        :meth:`log_tail` gives."""

    def log_tail(self, start: int) -> dict[str, np.ndarray] | None:
        """State that grows by one item a round and never changes once written (DeComFL's round log), kept out of
        :meth:`state` so that a checkpoint costs the same at every round: its items from ``start`` on, as arrays
        whose first axis is the item (the checkpoint appends them to a file beside it, ``cloud.round_log``, and
        gives :meth:`load_state` the whole log back among the state's tensors, each name's items joined). None:
        the role keeps no such log (the default)."""
        return None

    @abstractmethod
    def load_state(self, state: Payload) -> None:
        """Restore what :meth:`state` returned (and :meth:`log_tail` from round 0, among its tensors)."""

    def forget_devices(self) -> None:  # noqa: B027 an optional hook, empty by default
        """After :meth:`load_state`: the devices were recreated and lost any state they kept across rounds
        (``Trait.DEVICE_STATE``); plan as for devices never seen. Nothing to do by default."""


class CellRole(ABC):
    """Runs the edge rounds of one cell and reports to the cloud."""

    edge_rounds: int = 1

    @abstractmethod
    def begin(self, round: int, task: Payload) -> None:
        """Start cloud round ``round`` from the cloud's task."""

    @abstractmethod
    def plan(self, edge_round: int, available: Sequence[str]) -> dict[str, Payload]:
        """The task of each device taking part in this edge round (a subset of ``available``)."""

    def check(self, device: str, result: Payload) -> None:  # noqa: B027 an optional hook, empty by default
        """Raise :class:`Rejected` if ``result`` cannot be aggregated."""

    @abstractmethod
    def aggregate(self, edge_round: int, results: Mapping[str, Payload]) -> Outcome:
        """Fold the results that arrived (sorted by device id) into the cell state; its outcome out."""

    @abstractmethod
    def report(self) -> Payload:
        """The cell's report for this cloud round (carries its aggregation weight in ``meta``)."""

    def idle(self) -> None:  # noqa: B027 an optional hook, empty by default
        """Its process waits for the others now (``fedtier sim``'s cell processes, once they answered): work for
        a later round that needs nothing more may start (DeComFL draws its next round's directions)."""


class DeviceRole(ABC):
    """Local work of a device on its private data. ``reveals_data_size``: the device's runtime may tell its
    sample count (status records, secure aggregation's weight bound); False under differential privacy."""

    reveals_data_size: ClassVar[bool] = True
    writes_task: bool = True
    """Whether :meth:`train` may write into its task's arrays. A task's tensors are read-only views of the message's
    bytes, which the devices of a cell share in ``fedtier sim`` (one immutable payload, ``SharedPayload``): a role
    that may write into them (``torch.from_numpy`` then an in-place op) is handed private writable copies
    (:func:`task_for`); so is any role that does not declare otherwise, a plugin's by default. The built-in roles
    declare ``False`` (they copy what they change) and read the shared bytes; a wrapper declares its inner role's. A
    subclass that runs another class's :meth:`train` than the one its inherited declaration was made for (its own, a
    mixin's) declares for itself: unless it says ``writes_task = False`` again, it is True (a plugin subclassing a
    built-in role and writing into its task is safe by default)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        owner = next(i for i, c in enumerate(mro) if "train" in vars(c))  # whose train it runs (a mixin's too)
        if next(i for i, c in enumerate(mro) if "writes_task" in vars(c)) > owner:
            cls.writes_task = True  # the declaration it inherits was about another class's train, not this one

    @abstractmethod
    def train(self, task: Payload, data: LocalData, trainer: Trainer, ctx: DeviceContext) -> Payload:
        """Run the task; return the result to send to the cell."""


def task_for(role: DeviceRole, task: Payload) -> Payload:
    """``task`` as ``role`` is handed it: itself to a role that never writes into it (``writes_task = False``), else
    its tensors copied (writable, its own), so what it writes cannot change what another device of its cell reads. A
    role that declares nothing (one not derived from :class:`DeviceRole`) is taken to write."""
    if not getattr(role, "writes_task", True):
        return task
    return Payload(dict(task.meta), {k: np.array(v) for k, v in task.tensors.items()})


def train_role(role: DeviceRole, task: Payload, data: LocalData, trainer: Trainer, ctx: DeviceContext) -> Payload:
    """``role.train`` on ``task`` as the role is handed it (:func:`task_for`): its result, checked to be a
    :class:`Payload` (``TypeError`` saying what the role returned instead: the device fails its task with that
    reason, rather than the runtime failing later on a result it cannot read)."""
    result = role.train(task_for(role, task), data, trainer, ctx)
    if not isinstance(result, Payload):
        raise TypeError(f"{type(role).__name__}.train returned {type(result).__name__}, not a Payload")
    return result


class Algorithm(ABC):
    """Bundles an algorithm's parameters and builds its roles for a run."""

    name: ClassVar[str]
    Params: ClassVar[type[TrainParams]] = TrainParams
    traits: ClassVar[frozenset[Trait]] = frozenset()
    """What the base algorithm's roles do (``protocols.algorithms.traits``), before any layer."""
    without: ClassVar[dict[Trait, str]] = {}
    """For traits it lacks: why, in words (shown when a layer or a feature needs one)."""
    rounds: int | None = None
    """The run's cloud rounds (``run.rounds``), set by ``compose`` before :meth:`bind_topology`; ``None`` (an
    algorithm built by hand): any number (a check of what some round needs checks every round)."""

    @classmethod
    def model_message_params(cls, spec: ModelSpec, cells: int) -> int:
        """The float32 values of the largest model its tasks carry over ``cells`` cells (0: none carries one):
        ``runtime.max_message_bytes`` must hold them (``RunConfig.message_refusal``). The whole model here."""
        return spec.num_params()

    @classmethod
    def traits_with(cls, params: TrainParams) -> frozenset[Trait]:
        """The traits of this algorithm under the layers ``params`` configure."""
        return compose_traits(cls.traits, params.layers())

    @classmethod
    def lacks(cls, params: TrainParams, trait: Trait) -> str | None:
        """Why this algorithm with ``params`` lacks ``trait`` (the layer that took it away, or the base's
        own reason), or ``None`` when it has it."""
        return lacks(cls.name, cls.traits, cls.without, params.layers(), trait)

    def stack_traits(self) -> frozenset[Trait]:
        """The traits of the stack this object runs (wrappers add their own layers)."""
        return self.traits_with(self.params)

    def __init__(self, params: TrainParams, model: ModelSpec, seed: int, init_seed: int | None = None) -> None:
        self.params, self.model, self.seed = params, model, seed
        self.init_seed = seed if init_seed is None else init_seed

    def initial_params(self) -> dict[str, np.ndarray]:
        """The initial global model (built with torch: only the cloud calls this)."""
        from ..models import build_model, init_params

        spec = self.model
        return init_params(
            build_model(spec.name, spec.input_shape, spec.num_classes, **spec.build_kwargs()),
            self.init_seed,
            spec.init_std,
        )

    def bind_topology(self, cells: Mapping[str, Sequence[str]]) -> None:  # noqa: B027 an optional hook, empty by default
        """The run's device ids per cell, given by ``RunConfig.build_algorithm`` before any role is built.

        Algorithms whose parameters name devices (FedALIGN's priority set) override this and raise
        ``ValueError`` naming the config key when the parameters do not fit the topology.
        """

    def largest_message(self) -> tuple[int, int, str] | None:
        """The largest payload its roles may send over :attr:`rounds` besides a model (:meth:`model_message_params`)
        when it grows with the run: (bytes, bytes of its metadata, what it is in words); None: none does.
        ``RunConfig.build_algorithm`` refuses a run whose ``runtime.max_message_bytes`` (or the codec's metadata
        bound) it would exceed: the node it was sent to would refuse it, saying so in its own log only."""
        return None

    def tier_refusal(self, tier: str, memory: int | None = None) -> str | None:
        """Why ``memory`` (default: this machine's) cannot hold what the ``tier``'s role ("cloud" or "cell") keeps
        under these parameters, naming the key, or ``None``: the tier's node checks it before it starts (a device,
        which builds the algorithm too, holds none of it)."""
        return None

    @abstractmethod
    def cloud(self) -> CloudRole: ...

    @abstractmethod
    def cell(self, cell: str) -> CellRole: ...

    @abstractmethod
    def device(self, device: str) -> DeviceRole: ...
