"""Buffered asynchronous aggregation (FedBuff, Nguyen et al. 2022) at cells and cloud, for ``fedavg``.

``algorithm.mode = "async"``: nobody waits for a round. A cell keeps each of its devices busy: a device
that answers gets the current cell model at once. Every ``async_buffer`` (K) results the cell applies

    x_cell <- x_cell + sum_i n_i w(s_i) delta_i / sum_i n_i,     w(s) = (1 + s)^(-staleness_exponent)

where ``n_i`` is the result's sample weight and ``s_i`` its staleness: how many cell updates happened
since the model version the device trained from (FedBuff's 1/sqrt(1 + s) by default; exponent 0: plain
weighted mean). The weights are not renormalised, so stale results count less, as in FedBuff. A result
whose staleness exceeds ``max_staleness``, or that names a version the cell never issued, is dropped
with a logged reason. Every ``async_push_every`` (M) cell updates, or ``async_push_seconds`` (T) when
that comes first, the cell pushes its progress since its last push to the cloud, stamped with the
cloud version it derives from. The cloud does the same over cells: every ``async_cloud_buffer`` pushes
(or more: the pushes waiting when it makes the version, ``cloud/async_server.py``) it forms the same
staleness-weighted step (staleness in cloud versions; a cell's pushes from one version, steps in sequence, count
as one push of their sum, summed as they come: :func:`sum_of_steps`) and hands it to the server
optimizer (``server_optimizer``, amplification), making a new cloud version, which it sends back to
the cells whose pushes it used. A cell that receives a new cloud model adopts it and re-applies the
progress it made since its last push (that progress is not in the cloud model yet).

``run.rounds`` counts cloud versions. The roles here are pure; ``cell_server/async_server.py`` and
``cloud/async_server.py`` own the timing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from .. import params as P
from ..rejections import Rejected, RejectKind
from ..wire.payload import Payload
from .codecs import make_codec
from .fedavg import ModelCloud, check_delta
from .outcome import Outcome
from .staleness import AsyncParams, Entry, StalenessBuffer


class FedBuffCell:
    """A cell's asynchronous state: its model and version, the device buffer, the progress to push."""

    def __init__(self, params: AsyncParams, cell: str) -> None:
        self.p, self.cell = params, cell
        self.codec = make_codec(params)
        self.buffer = StalenessBuffer(params.async_buffer, params.staleness_exponent, params.max_staleness)
        self.model: dict[str, np.ndarray] | None = None
        self.pushed: dict[str, np.ndarray] = {}  # the cell model at the last push (or adoption)
        self.version = -1  # cell model version: +1 on every update or adoption
        self.global_version = -1  # the cloud version the cell's model derives from
        self.updates = 0  # cell updates since the last push
        self.weight = 0.0  # sample weight aggregated since the last push
        self.devices: set[str] = set()

    @property
    def ready(self) -> bool:
        return self.model is not None

    def adopt(self, global_version: int, model: Mapping[str, np.ndarray]) -> None:
        """A new cloud model: keep the progress made since the last push on top of it."""
        if global_version <= self.global_version:
            raise Rejected(RejectKind.STALE, f"cloud model version {global_version}, already at {self.global_version}")
        if self.model is None:
            self.model = P.copy(model)
        else:
            P.check_like(model, self.model, "cloud model")
            self.model = P.add(P.copy(model), P.sub(self.model, self.pushed))
        self.pushed = P.copy(model)
        self.global_version = global_version
        self.version += 1

    def task(self) -> Payload:
        assert self.model is not None
        return Payload({}, self.model)

    def check(self, device: str, base: Any, result: Payload) -> int:
        """Raise :class:`Rejected` for a bad, future or too stale result; return its staleness."""
        what = f"result of device {device}"
        staleness = self.buffer.admit(self.version, base, what)
        assert self.model is not None
        check_delta(result, self.model, what, self.codec)
        return staleness

    def offer(self, device: str, base: int, result: Payload) -> None:
        assert self.model is not None
        self.buffer.add(device, base, result.meta["weight"], self.codec.decode(result, self.model))

    def aggregate(self) -> Outcome:
        """Apply the buffered results: a new cell version. Its outcome out (``senders``: the results used)."""
        assert self.model is not None
        step, total, out = self.buffer.flush(self.version)
        self.model = P.add(self.model, step)
        self.version += 1
        self.updates += 1
        self.weight += total
        self.devices |= set(out.senders)
        return out.with_metrics(version=self.version)

    def report(self) -> Payload:
        """The progress since the last push, with its weight; the push resets the counters."""
        assert self.model is not None
        out = Payload(
            {"weight": self.weight, "updates": self.updates, "devices": len(self.devices)},
            P.sub(self.model, self.pushed),
        )
        self.pushed = P.copy(self.model)
        self.updates, self.weight, self.devices = 0, 0.0, set()
        return out


class FedBuffCloud:
    """The cloud's asynchronous state around a :class:`ModelCloud` (model, server optimizer, checkpoint)."""

    def __init__(self, params: AsyncParams, inner: ModelCloud) -> None:
        self.p, self.inner = params, inner
        self.buffer = StalenessBuffer(params.async_cloud_buffer, params.staleness_exponent, params.max_staleness)
        self.version = 0

    def check(self, cell: str, base: Any, report: Payload) -> int:
        what = f"push of cell {cell}"
        staleness = self.buffer.admit(self.version, base, what)
        check_delta(report, self.inner.model, what)
        return staleness

    def offer(self, cell: str, base: int, report: Payload) -> None:
        """Buffer ``cell``'s push from version ``base``, summed into the one it already has buffered from ``base`` if
        any: a cell's pushes from one version count as one push of their sum (:func:`sum_of_steps`). So the buffer
        holds one model-sized entry per (cell, base), whatever the push rate (a cell flooding pushes with its own key
        included); each push is still journaled, and counted (``buffer.held``)."""
        weight, entries = float(report.meta["weight"]), self.buffer.entries
        for i, e in enumerate(entries):
            if (e.sender, e.base) == (cell, base):
                entries[i] = sum_of_steps(e, weight, report.tensors)
                return
        self.buffer.add(cell, base, weight, report.tensors)

    def aggregate(self, bound: Callable[[str], float | None] | None = None) -> Outcome:
        """A new cloud version from the buffered pushes, through the server optimizer (``senders``: the cells); a
        cell's pushes from one version count as one (:meth:`offer`), a cell weighing at most ``bound(cell)``
        (:func:`bounded_by_cell`)."""
        pushes = self.buffer.held
        self.buffer.entries = bounded_by_cell(self.buffer.entries, bound)
        step, total, out = self.buffer.flush(self.version)
        self.inner.model, amplified = self.inner.opt.step(self.version, self.inner.model, step)
        self.version += 1
        return out.with_metrics(weight=total, pushes=pushes, **({"amplified": 1} if amplified else {}))


def sum_of_steps(held: Entry, weight: float, delta: Mapping[str, np.ndarray]) -> Entry:
    """``held`` (a cell's buffered pushes from one version) and its next push from that version, as one entry: their
    sum, weighing their weights' sum. A cell pushes its progress since its last push, so its pushes from one version
    are steps in sequence (the second made on top of the first), not parallel estimates from that version to
    average: summed, a cell's progress counts the same whether the cloud takes it in one push or in several (a cloud
    slower than its cells takes every push waiting). Summed as they come, in float64 (:func:`params.weighted_sum`,
    term by term in arrival order: bit for bit the sum of them all made at once); an entry of one push is kept as it
    was (bit for bit)."""
    total = P.weighted_sum([(1.0, held.delta), (1.0, delta)])
    return Entry(held.sender, held.base, held.weight + weight, total, held.pushes + 1)


def bounded_by_cell(entries: list[Entry], bound: Callable[[str], float | None] | None = None) -> list[Entry]:
    """The cloud's buffered pushes with each cell's weighing at most ``bound(cell)`` (``None``: no bound known): a cell
    over it has its weights scaled down to it, so pushing often (or flooding pushes, with its own key) does not weigh
    it more than its bound in a version."""
    totals: dict[str, float] = {}
    for e in entries:
        totals[e.sender] = totals.get(e.sender, 0.0) + e.weight
    out = entries
    for cell, total in totals.items():
        most = bound(cell) if bound is not None else None
        if most is not None and total > most:
            out = [replace(e, weight=e.weight * most / total) if e.sender == cell else e for e in out]
    return out
