"""HIST: hierarchical independent submodel training (Fang, Han, Brinton).

Every cloud round the cloud draws, for each partitioned hidden layer, a fresh uniformly random
partition of its units into one near-equal disjoint group per cell (``np.array_split`` of a seeded
permutation). Cell ``j`` receives only its submodel: the slices of the full model that touch its
units (a unit brings its input weights, its bias and its output weights) plus the index sets, and
the parameters that touch no partitioned unit ("shared": the output bias; the conv layers of the
CNN). Cells and devices then run hierarchical FedAvg on the small, dense submodel (E edge rounds of
H device steps). The cloud writes each cell's slices back where they came from (eq. 6: a scatter,
no averaging across cells) and averages the shared parameters over cells; the result goes through
the cloud optimizer (:mod:`.server_opt`, so amplification composes with HIST).

Partitioned layers: the MLP's hidden layers ``fc1, fc2, ...`` (with several hidden layers, the
weights between units of different groups belong to no submodel and keep their value that round,
as in independent subnet training) and the CNN's ``fc1``. A neuron's bias travels with it (unlike
the authors' code, which never sends biases and re-initialises them every round). Devices train a
physically smaller dense model (``Trainer.for_model`` with the narrower widths): the same math as
masking the full model, with the compute and storage savings the paper claims.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from .. import params as P
from ..seeding import rng
from ..trainer import LocalData, Trainer
from ..wire.payload import Payload
from .base import Algorithm, CellRole, CloudRole, DeviceContext, DeviceRole, ModelSpec, Rejected
from .fedavg import FedAvgCell, FedAvgDevice, FedAvgParams, ModelCloud, check_delta
from .robust import aggregate
from .server_opt import ServerParams

INDEX = "hist.index/"
Axes = tuple[str | None, ...]


def unit_axes(spec: ModelSpec) -> tuple[dict[str, int], dict[str, Axes]]:
    """The partitioned layers ``{layer: width}`` and, per parameter, which layer indexes each axis."""
    if spec.name == "mlp":
        hidden = {f"fc{i}": int(h) for i, h in enumerate(spec.hidden, start=1)}
        names = list(hidden)
        axes: dict[str, Axes] = {}
        for i, layer in enumerate(names):
            axes[f"{layer}.weight"] = (layer, names[i - 1] if i else None)
            axes[f"{layer}.bias"] = (layer,)
        axes["out.weight"] = (None, names[-1] if names else None)
        axes["out.bias"] = (None,)
        if not hidden:
            raise ValueError("HIST partitions hidden units: the mlp needs at least one hidden layer")
        return hidden, axes
    if spec.name == "cnn":
        axes = {f"{c}.{p}": (None,) * (4 if p == "weight" else 1) for c in ("conv1", "conv2") for p in ("weight", "bias")}
        axes.update({"fc1.weight": ("fc1", None), "fc1.bias": ("fc1",), "out.weight": (None, "fc1"), "out.bias": (None,)})
        return {"fc1": int(spec.fc)}, axes
    raise ValueError(f"HIST partitions hidden units: model {spec.name!r} has none (use mlp or cnn)")


def draw_partition(seed: int, round: int, widths: Mapping[str, int], cells: Sequence[str]
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


def slice_model(model: Mapping[str, np.ndarray], axes: Mapping[str, Axes], idx: Mapping[str, np.ndarray]
                ) -> "dict[str, np.ndarray]":
    """The submodel of the units ``idx`` (eq. 2 as a dense model); shared parameters are copied whole."""
    return {k: (np.ascontiguousarray(v[_index(axes[k], idx, v.shape)]) if any(axes[k]) else v.copy())
            for k, v in model.items()}


def scatter(target: dict[str, np.ndarray], sub: Mapping[str, np.ndarray], axes: Mapping[str, Axes],
            idx: Mapping[str, np.ndarray]) -> None:
    """Write a submodel's partitioned slices back into ``target`` in place (eq. 6)."""
    for k, v in sub.items():
        if any(axes[k]):
            target[k][_index(axes[k], idx, target[k].shape)] = v


def sub_spec(spec: ModelSpec, widths: Mapping[str, int]) -> ModelSpec:
    """``spec`` with the partitioned layers narrowed to ``widths``."""
    if spec.name == "mlp":
        return spec.model_copy(update={"hidden": tuple(int(widths[f"fc{i}"]) for i in range(1, len(spec.hidden) + 1))})
    return spec.model_copy(update={"fc": int(widths["fc1"])})


def widths_of(tensors: Mapping[str, np.ndarray], axes: Mapping[str, Axes], layers: Sequence[str]) -> dict[str, int]:
    """The width of each partitioned layer as the shapes of a submodel say."""
    widths: dict[str, int] = {}
    for name, ax in axes.items():
        for dim, layer in enumerate(ax):
            if layer is not None and layer not in widths and name in tensors and tensors[name].ndim > dim:
                widths[layer] = int(tensors[name].shape[dim])
    missing = [layer for layer in layers if layer not in widths]
    if missing:
        raise Rejected(f"submodel lacks the tensors of layer(s) {missing}")
    return widths


def split_task(task: Payload) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(parameter slices, index sets) of a HIST cell task or cell report."""
    idx = {k[len(INDEX):]: v for k, v in task.tensors.items() if k.startswith(INDEX)}
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
            raise Rejected(f"report of cell {cell}: no submodel was planned for it")
        delta, idx = split_task(report)
        planned = self.parts[cell]
        if set(idx) != set(planned) or any(not np.array_equal(idx[k], planned[k]) for k in planned):
            raise Rejected(f"report of cell {cell}: index sets differ from this round's partition")
        check_delta(Payload(report.meta, delta), self.shapes[cell], f"report of cell {cell}")

    def aggregate(self, round: int, reports: Mapping[str, Payload]) -> dict[str, float]:
        reports = {c: r for c, r in sorted(reports.items()) if r.meta.get("weight")}
        comm = self.comm.update(reports)
        if not reports:
            self.model, amplified = self.opt.step(round, self.model, None)
            return {"cells": 0, **comm, **({"amplified": 1} if amplified else {})}
        deltas = {c: split_task(r)[0] for c, r in reports.items()}
        full = P.zeros_like(self.model)
        for cell, delta in deltas.items():
            scatter(full, delta, self.axes, self.parts[cell])
        shared = [k for k, ax in self.axes.items() if not any(ax)]
        total, excluded = 0.0, {}
        if shared:
            agg = aggregate(getattr(self.p, "cloud_aggregator", "mean"),
                            [(c, r.meta["weight"], {k: deltas[c][k] for k in shared}) for c, r in reports.items()],
                            self.p)
            full.update(agg.delta)
            total, excluded = agg.weight, agg.excluded
        self.model, amplified = self.opt.step(round, self.model, full)
        return {"cells": len(reports), "weight": total or sum(r.meta["weight"] for r in reports.values()),
                **comm, **({"amplified": 1} if amplified else {}), **({"excluded": excluded} if excluded else {})}


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

    def __init__(self, params: ServerParams, spec: ModelSpec) -> None:
        self.spec = spec
        self.widths, self.axes = unit_axes(spec)
        self.inner = FedAvgDevice(params)

    def train(self, task: Payload, data: LocalData, trainer: Trainer, ctx: DeviceContext) -> Payload:
        if list(task.tensors) != list(self.axes):
            raise Rejected(f"HIST task has tensors {list(task.tensors)[:4]}..., expected {list(self.axes)[:4]}...")
        widths = widths_of(task.tensors, self.axes, list(self.widths))
        return self.inner.train(task, data, trainer.for_model(sub_spec(self.spec, widths)), ctx)


class Hist(Algorithm):
    """HIST: each cell trains a disjoint, freshly drawn submodel; the cloud reassembles them."""

    name = "hist"
    Params = FedAvgParams  # amplification at the cloud, any uplink codec (algorithm.uplink) on devices

    def cloud(self) -> CloudRole:
        return HistCloud(self.params, self.model, self.seed, self.initial_params())  # type: ignore[arg-type]

    def cell(self, cell: str) -> CellRole:
        return HistCell(self.params, cell)

    def device(self, device: str) -> DeviceRole:
        return HistDevice(self.params, self.model)  # type: ignore[arg-type]
