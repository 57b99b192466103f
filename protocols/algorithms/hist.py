"""HIST: hierarchical independent submodel training (Fang, Han, Brinton).

Every cloud round the cloud draws, for each partitioned layer, a fresh uniformly random partition of its
units into one near-equal disjoint group per cell (``np.array_split`` of a seeded permutation). Cell ``j``
receives only its submodel: the slices of the full model that touch its units (a unit brings its input
weights, its bias and its output weights) plus the index sets. Cells and devices then run hierarchical
FedAvg on the small, dense submodel (E edge rounds of H device steps). The cloud writes each cell's
slices back where they came from (eq. 6: a scatter, no averaging across cells); the result goes through
the cloud optimizer (:mod:`.server_opt`, so amplification composes with HIST).

Which layers are partitioned. The paper's masks are disjoint and cover the model (eq. 3). With unit
groups that only holds when every weight tensor joins exactly one partitioned layer to one whole layer:
a weight between units of two different cells' groups would get no gradient in any submodel (one of its
ends is zeroed in each), and a weight between two whole layers would belong to every submodel. So the
partitioned layers alternate with whole ones, the input and the output being whole:

- ``mlp`` with an odd number of hidden layers: ``fc1, fc3, ...`` are partitioned, ``fc2, fc4, ...`` stay
  whole (the paper's 784-300-10 is the one-hidden-layer case). An even number of hidden layers has no
  such partition and is refused when the run is configured.
- ``cnn``: the channels of ``conv1`` (a channel brings its 5x5 filters, its bias and its input slice of
  ``conv2``) and the units of ``fc1``; ``conv2``'s output channels stay whole.

Every weight then belongs to exactly one submodel. The biases of whole layers (the output bias, and
``fc2``'s, ``conv2``'s) touch no partitioned unit: they are shared, trained by every cell and averaged
by the cloud (option (b) of the spec for the output bias). A neuron's bias travels with it (unlike the
authors' code, which never sends biases and re-initialises them every round). Devices train a physically
smaller dense model (``Trainer.for_model`` with the narrower widths): the same math as masking the full
model, with the compute and storage savings the paper claims.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .. import params as P
from ..rejections import OffPlan, Rejected, RejectKind
from ..seeding import rng
from ..trainer import LocalData, Trainer
from ..wire.payload import Payload
from .base import Algorithm, CellRole, CloudRole, DeviceContext, DeviceRole, ModelSpec
from .fedavg import FedAvgCell, FedAvgDevice, FedAvgParams, ModelCloud, check_delta
from .outcome import Outcome
from .robust import aggregate, robust_params
from .server_opt import ServerParams
from .traits import Trait

INDEX = "hist.index/"
Axes = tuple[str | None, ...]


def unit_axes(spec: ModelSpec) -> tuple[dict[str, int], dict[str, Axes]]:
    """The partitioned layers ``{layer: width}`` and, per parameter, which layer indexes each axis.

    Raises ``ValueError`` for a model without a disjoint covering partition (see the module docstring).
    """
    if spec.name == "mlp":
        depth = len(spec.hidden)
        if depth % 2 == 0:
            raise ValueError(
                f"HIST partitions hidden units into disjoint submodels that cover every weight; an mlp with "
                f"{depth} hidden layers has no such partition (the weights between two partitioned layers would "
                f"belong to no submodel, those between two whole layers to all): use 1, 3, 5... hidden layers "
                f"(fc1, fc3, ... are partitioned, fc2, fc4, ... stay whole)"
            )
        widths: dict[str, int] = {}
        axes: dict[str, Axes] = {}
        below: str | None = None  # the partitioned layer feeding this one (None: the input or a whole layer)
        for i, h in enumerate(spec.hidden, start=1):
            layer = f"fc{i}"
            own = layer if i % 2 else None
            if own:
                widths[layer] = int(h)
            axes[f"{layer}.weight"], axes[f"{layer}.bias"] = (own, below), (own,)
            below = own
        axes["out.weight"], axes["out.bias"] = (None, below), (None,)
        return widths, axes
    if spec.name == "cnn":
        axes = {
            "conv1.weight": ("conv1", None, None, None),
            "conv1.bias": ("conv1",),
            "conv2.weight": (None, "conv1", None, None),
            "conv2.bias": (None,),
            "fc1.weight": ("fc1", None),
            "fc1.bias": ("fc1",),
            "out.weight": (None, "fc1"),
            "out.bias": (None,),
        }
        return {"conv1": int(spec.channels[0]), "fc1": int(spec.fc)}, axes
    raise ValueError(f"HIST partitions hidden units: model {spec.name!r} has none (use mlp or cnn)")


def check_fits(spec: ModelSpec, cells: int) -> None:
    """Raise ``ValueError`` unless ``spec`` can be split into ``cells`` non-empty disjoint submodels."""
    widths, _ = unit_axes(spec)
    narrow = {layer: w for layer, w in widths.items() if w < cells}
    if narrow:
        raise ValueError(
            f"HIST gives every cell its own units: layer(s) {narrow} have fewer units than the "
            f"{cells} cells (model.hidden / model.channels / model.fc)"
        )


def draw_partition(
    seed: int, round: int, widths: Mapping[str, int], cells: Sequence[str]
) -> dict[str, dict[str, np.ndarray]]:
    """``{cell: {layer: sorted unit indices}}``: disjoint, covering, near-equal groups (cells in order)."""
    parts: dict[str, dict[str, np.ndarray]] = {c: {} for c in cells}
    for layer, width in widths.items():
        if width < len(cells):
            raise ValueError(f"layer {layer} has {width} units, fewer than the {len(cells)} cells")
        perm = rng(seed, round, "hist", layer).permutation(width)
        for cell, group in zip(cells, np.array_split(perm, len(cells))):
            parts[cell][layer] = np.sort(group).astype(np.int32)
    return parts


def _index(axes: Axes, idx: Mapping[str, np.ndarray], shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    return np.ix_(*(idx[a] if a else np.arange(n) for a, n in zip(axes, shape)))


def slice_model(
    model: Mapping[str, np.ndarray], axes: Mapping[str, Axes], idx: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The submodel of the units ``idx`` (eq. 2 as a dense model); shared parameters are copied whole."""
    return {
        k: (np.ascontiguousarray(v[_index(axes[k], idx, v.shape)]) if any(axes[k]) else v.copy())
        for k, v in model.items()
    }


def scatter(
    target: dict[str, np.ndarray],
    sub: Mapping[str, np.ndarray],
    axes: Mapping[str, Axes],
    idx: Mapping[str, np.ndarray],
) -> None:
    """Write a submodel's partitioned slices back into ``target`` in place (eq. 6)."""
    for k, v in sub.items():
        if any(axes[k]):
            target[k][_index(axes[k], idx, target[k].shape)] = v


def sub_spec(spec: ModelSpec, widths: Mapping[str, int]) -> ModelSpec:
    """``spec`` with the partitioned layers narrowed to ``widths``."""
    if spec.name == "mlp":
        hidden = tuple(int(widths.get(f"fc{i}", h)) for i, h in enumerate(spec.hidden, start=1))
        return spec.model_copy(update={"hidden": hidden})
    return spec.model_copy(update={"channels": (int(widths["conv1"]), spec.channels[1]), "fc": int(widths["fc1"])})


def widths_of(tensors: Mapping[str, np.ndarray], axes: Mapping[str, Axes], layers: Sequence[str]) -> dict[str, int]:
    """The width of each partitioned layer as the shapes of a submodel say."""
    widths: dict[str, int] = {}
    for name, ax in axes.items():
        for dim, layer in enumerate(ax):
            if layer is not None and layer not in widths and name in tensors and tensors[name].ndim > dim:
                widths[layer] = int(tensors[name].shape[dim])
    missing = [layer for layer in layers if layer not in widths]
    if missing:
        raise Rejected(RejectKind.SHAPE, f"submodel lacks the tensors of layer(s) {missing}")
    return widths


def split_task(task: Payload) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(parameter slices, index sets) of a HIST cell task or cell report."""
    idx = {k[len(INDEX) :]: v for k, v in task.tensors.items() if k.startswith(INDEX)}
    return {k: v for k, v in task.tensors.items() if not k.startswith(INDEX)}, idx


class HistCloud(ModelCloud):
    def __init__(self, params: ServerParams, spec: ModelSpec, seed: int, initial: Mapping[str, np.ndarray]) -> None:
        super().__init__(params, initial)
        self.seed = seed
        self.widths, self.axes = unit_axes(spec)
        if list(self.axes) != list(self.model):
            raise ValueError(f"HIST: model tensors {list(self.model)} do not match the layout {list(self.axes)}")
        self.parts: dict[str, dict[str, np.ndarray]] = {}
        self.shapes: dict[str, dict[str, np.ndarray]] = {}

    def plan(self, round: int, cells: Sequence[str]) -> dict[str, Payload]:
        cells = sorted(cells)
        self.parts = draw_partition(self.seed, round, self.widths, cells) if cells else {}
        tasks: dict[str, Payload] = {}
        self.shapes = {}
        for cell, idx in self.parts.items():
            sub = slice_model(self.model, self.axes, idx)
            self.shapes[cell] = sub
            tasks[cell] = Payload({}, {**sub, **{INDEX + k: v for k, v in idx.items()}})
        return tasks

    def check(self, cell: str, report: Payload) -> None:
        if report.meta.get("weight") == 0 and not report.tensors:
            return
        if cell not in self.parts:
            raise Rejected(RejectKind.NOT_PLANNED, f"report of cell {cell}: no submodel was planned for it")
        delta, idx = split_task(report)
        planned = self.parts[cell]
        if set(idx) != set(planned) or any(not np.array_equal(idx[k], planned[k]) for k in planned):
            raise OffPlan(  # a late report holds its own round's partition
                RejectKind.INCONSISTENT, f"report of cell {cell}: index sets differ from this round's partition"
            )
        check_delta(Payload(report.meta, delta), self.shapes[cell], f"report of cell {cell}")

    def aggregate(self, round: int, reports: Mapping[str, Payload]) -> Outcome:
        reports = {c: r for c, r in sorted(reports.items()) if r.meta.get("weight")}
        comm = self.comm.update(reports)
        if not reports:
            self.model, amplified = self.opt.step(round, self.model, None)
            return Outcome({"cells": 0, **comm, **({"amplified": 1} if amplified else {})})
        deltas = {c: split_task(r)[0] for c, r in reports.items()}
        full = P.zeros_like(self.model)
        for cell, delta in deltas.items():
            scatter(full, delta, self.axes, self.parts[cell])
        shared = [k for k, ax in self.axes.items() if not any(ax)]
        total, excluded, notes = 0.0, {}, {}
        if shared:
            agg = aggregate(
                robust_params(self.p).cloud_aggregator,
                [(c, r.meta["weight"], {k: deltas[c][k] for k in shared}) for c, r in reports.items()],
                self.p,
            )
            full.update(agg.delta)
            total, excluded, notes = agg.weight, agg.excluded, agg.notes()
        self.model, amplified = self.opt.step(round, self.model, full)
        metrics = {
            "cells": len(reports),
            "weight": total or sum(r.meta["weight"] for r in reports.values()),
            **comm,
            **({"amplified": 1} if amplified else {}),
            **notes,  # the robust aggregator's (too few inputs)
        }
        return Outcome(metrics, excluded=excluded)


class HistCell(FedAvgCell):
    """Hierarchical FedAvg over the cell's submodel; the report carries the index sets back."""

    def begin(self, round: int, task: Payload) -> None:
        sub, self.index = split_task(task)
        super().begin(round, Payload(task.meta, sub))

    def report(self) -> Payload:
        report = super().report()
        if report.tensors:
            report.tensors.update({INDEX + k: v for k, v in self.index.items()})
        return report


class HistDevice(DeviceRole):
    """Trains the dense submodel it received on a trainer built for the submodel's widths."""

    writes_task = False  # it copies what it changes (its task is read-only, shared by its cell in sim)

    def __init__(self, params: ServerParams, spec: ModelSpec) -> None:
        self.spec = spec
        self.widths, self.axes = unit_axes(spec)
        self.inner = FedAvgDevice(params)

    def train(self, task: Payload, data: LocalData, trainer: Trainer, ctx: DeviceContext) -> Payload:
        if list(task.tensors) != list(self.axes):
            raise Rejected(
                RejectKind.SHAPE,
                f"HIST task has tensors {list(task.tensors)[:4]}..., expected {list(self.axes)[:4]}...",
            )
        widths = widths_of(task.tensors, self.axes, list(self.widths))
        return self.inner.train(task, data, trainer.for_model(sub_spec(self.spec, widths)), ctx)


class Hist(Algorithm):
    """HIST: each cell trains a disjoint, freshly drawn submodel; the cloud reassembles them."""

    name = "hist"
    Params = FedAvgParams  # amplification at the cloud, any uplink codec (algorithm.uplink) on devices
    traits = frozenset({Trait.CELL_SUM, Trait.CLOUD_SUM, Trait.PLAIN_DELTA_UPLINK})
    without = {Trait.VERSIONED: "HIST redraws its partition every synchronous cloud round"}

    @classmethod
    def model_message_params(cls, spec: ModelSpec, cells: int) -> int:
        """A cell's submodel at its widest (a layer's units split near-equally), with its unit indices."""
        try:
            widths = {layer: -(-w // max(cells, 1)) for layer, w in unit_axes(spec)[0].items()}
        except ValueError:  # no partition: refused when the run is built
            return spec.num_params()
        return sub_spec(spec, widths).num_params() + sum(widths.values())

    def bind_topology(self, cells: Mapping[str, Sequence[str]]) -> None:
        check_fits(self.model, len(cells))

    def cloud(self) -> CloudRole:
        return HistCloud(self.params, self.model, self.seed, self.initial_params())  # type: ignore[arg-type]

    def cell(self, cell: str) -> CellRole:
        return HistCell(self.params, cell)

    def device(self, device: str) -> DeviceRole:
        return HistDevice(self.params, self.model)  # type: ignore[arg-type]
