"""DeComFL (Li et al., ICLR 2025): zeroth-order FL where only seeds and scalars travel.

Round r, as the hierarchy runs it (E = 1 edge round per cloud round):

* **cloud** picks the round seed ``s_r`` (``protocols.directions.round_seed``) and keeps the history
  ``(s_j, Gbar_j)`` of the rounds some device still needs, plus ``synced[cell][device]`` = the last
  round each device took part in (0 for a device never seen: it still holds x_0). Its task to a cell
  carries the history from the oldest round that cell's devices need, the cell's ``synced`` table and
  ``s_r``. It optionally keeps the model x_r (``server_model``) for evaluation only.
* **cell** gives each planned device exactly its part: the seeds and averaged scalars of rounds
  ``synced[d] .. r-1`` and ``s_r``. It sums the devices' K x P scalars with weights (uniform as in the
  paper, or by samples) and reports the sum, the total weight, the devices that answered and ``need``
  = the oldest round any device of its roster still needs (the cloud prunes its history to the minimum over cells).
* **device** keeps its own model copy for the whole run (one packed vector, ``directions.Packed``). It replays
  the missed rounds (oldest first, k ascending; each step one shared update vector, ``directions.update``) to
  reach x_r, runs K local ZO steps with P forward-difference perturbations each (one minibatch per step,
  ``g = (f(x + mu z) - f(x)) / mu``, the P + 1 losses from ``Trainer.perturbed_losses``, update
  ``x -= (lr/P) sum_p g_p z_p``), returns the K x P scalars (float32) and **reverts** to the snapshot x_r
  (spec 1.3/5.2): the steps move copies of x_r, and the last step, whose model the revert discards, is not taken.
  With ``momentum`` beta > 0 (the paper's MNIST runs use 0.5 for every method; appendix A eqs. 8-9) the
  device and the cloud also keep the heavy-ball buffer of the global trajectory (torch's rule, as the
  paper's repository steps it; ``directions.apply_momentum_step``): local steps run on copies of both,
  both are reverted, and catch-up replays both, so a device that rejoins holds the cloud's x_r and buffer bit for bit.
  The device remembers the round it is synced to, so a history that starts earlier (the cloud missed a report) is
  skipped where already applied; one that starts later cannot be replayed and fails, except for a device back at
  x_0 (its process restarted): it answers ``{"resync": true}`` and the cloud sends it the whole history next round.
* **the cloud's log**: the seeds and scalars of every round since round 0, in memory (4KP bytes a round and
  :data:`LOG_ROUND_BYTES` more); each checkpoint appends its new rounds to a file beside it (``log_tail``,
  ``cloud.round_log``), so a checkpoint's bytes do not grow with the round. The history sent is the log from the
  oldest round a device needs, so it grows back for a device that resyncs, and a resumed run whose devices
  were all recreated (``forget_devices``: ``fedtier sim/run --resume``) replays it from round 0.

Bytes: device uplink = one ``(K, P)`` float32 tensor and ``{"weight": n}``; downlink = ``{"from": t}``, ``h + 1`` uint64
seeds and an ``(h, K, P)`` float32 tensor (h = rounds missed). None depends on the model size. Needs only forward
passes, so a device may run on onnxruntime (``edge_agent.onnx_trainer``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, cast

import numpy as np
from pydantic import Field, model_validator

from .. import directions as Z
from .. import params as P
from ..divergence import diverged_result
from ..limits import memory_refusal
from ..numbers import finite_number
from ..rejections import Rejected, RejectKind
from ..replay_ahead import replay_ahead
from ..seeding import rng
from ..trainer import LocalData, Trainer, batches
from ..wire.payload import Payload, all_finite
from . import decomfl_wire
from .base import Algorithm, CellRole, CloudRole, DeviceContext, DeviceRole, ModelSpec, TrainParams
from .decomfl_wire import check_report, expect_shape, history_payload, read_checkpoint_log, read_history, stack_rounds
from .outcome import Outcome
from .traits import Trait


class DeComFLParams(TrainParams):
    """``local_steps`` is K; ``perturbations`` is P; ``lr`` is eta (ZO rates are small); ``mu`` the smoothing."""

    local_steps: int = Field(default=1, ge=1, description="K: zeroth-order steps a device runs per edge round")
    lr: float = Field(default=1e-3, gt=0, description="eta: the ZO-SGD learning rate (ZO rates are small)")
    perturbations: int = Field(default=5, ge=1, description="P: seeded random directions per step")
    mu: float = Field(default=1e-3, gt=0, description="smoothing radius of the finite differences")
    direction: Literal["gaussian", "rademacher"] = Field(default="gaussian", description="the directions' distribution")
    weighting: Literal["uniform", "samples"] = Field(
        default="uniform", description="how a cell weights its devices' scalars: equally, or by sample count"
    )
    server_model: bool = Field(default=True, description="the cloud keeps x_r (evaluation only)")
    momentum: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="heavy-ball beta of the ZO-SGD steps; the "
        "buffer is replayed with the model (0: plain ZO-SGD, bit for bit)",
    )
    scalar_clip: float = Field(
        default=0.0,
        ge=0,
        description="bounds each device's scalars at its cell (|g| <= clip) and a cell's summed scalars at the cloud "
        "(clip x its weight): a lying device or cell moves the mean scalars by its weight's share of 2 x clip at most "
        "(0: no bound, the paper)",
    )

    @model_validator(mode="after")
    def _supported(self) -> DeComFLParams:
        if self.edge_rounds != 1:
            raise ValueError("decomfl runs one edge round per cloud round (edge_rounds = 1)")
        if self.weight_decay != 0 or self.server_lr != 1.0:
            raise ValueError("decomfl is plain ZO-SGD: weight_decay and server_lr are not supported")
        if (scalars := self.local_steps * self.perturbations) > 10**7:  # 80 MB of float64 a report, kept by the cloud
            raise ValueError(f"local_steps x perturbations = {scalars:,} scalars a round exceeds 10,000,000")
        return self


LOG_ROUND_BYTES = 200
"""What a round of the cloud's log holds besides its 4KP bytes of scalars (its seed, its array's header, the lists'
entries: 213 bytes a round with K x P = 5, measured). The log stays in memory; a checkpoint appends its rounds to a
file (8 + 4KP bytes a round and ~60 bytes an entry, once), and the tasks of cells that need it all (a resume that
recreated the devices) stack it whole: a run whose log would take more than a third of the cloud's memory is refused
(``DeComFL.tier_refusal``)."""


# --------------------------------------------------------------------------------------------- cloud
class DeComFLCloud(CloudRole):
    def weight_keys(self) -> dict[str, float]:
        return {"weight": float(self.p.edge_rounds)}  # a cell adds every edge round's answers

    def member_keys(self) -> tuple[str, ...]:
        return ("answered", "resync")  # (uniform weighting: the weight is the number answered)

    def __init__(self, params: DeComFLParams, seed: int, initial: Mapping[str, np.ndarray]) -> None:
        self.p, self.seed = params, seed
        self.K, self.P = params.local_steps, params.perturbations
        self.model = Z.packed(initial)
        self.buf = Z.packed(P.zeros_like(self.model)) if params.momentum else None  # heavy-ball buffer of x_r
        self.base = 0  # first round kept in the history
        self.seeds: list[int] = []  # round seeds of rounds base..
        self.g: list[np.ndarray] = []  # averaged K x P scalars of rounds base..
        self.log_seeds: list[int] = []  # the cloud's log: seeds and scalars of every round since 0, from
        self.log_g: list[np.ndarray] | None = []  # which devices that lost their replicas are rebuilt
        self.rows = decomfl_wire.LogRows(self.K, self.P)  # the log as one array a task's window is a slice of
        self.synced: dict[str, dict[str, int]] = {}
        self.need: dict[str, int] = {}
        self.cells: set[str] = set()
        self.round_seed, self.ahead = 0, cast(int | None, None)  # (ahead: a seed whose directions to draw ahead)

    def plan(self, round: int, cells: Sequence[str]) -> dict[str, Payload]:
        if round != self.base + len(self.g):
            raise ValueError(f"round {round} planned, but the history ends at {self.base + len(self.g)}")
        self.cells |= set(cells)
        self.round_seed = Z.round_seed(self.seed, round)
        self.ahead = self.round_seed if self.p.server_model else None  # drawn ahead (sim) for the round's end:
        if not self.idle_calls:  # now, or once its process waits for the cells (not among the tasks' handlers)
            self.idle()
        tasks: dict[str, Payload] = {}
        stacks: dict[int, np.ndarray] = {}  # one a window start: the cells that all need the log (a resume) share it
        rows = self.rows.of(self.log_g) if self.log_g is not None else None  # (the window: log rows base..)
        for c in cells:
            start = max(self.need.get(c, 0), self.base)
            i = start - self.base
            if i not in stacks:
                stacks[i] = rows[start:] if rows is not None else stack_rounds(self.g[i:], self.K, self.P)
            hist = stacks[i]
            synced = {"from": start, "synced": dict(sorted(self.synced.get(c, {}).items()))}
            tasks[c] = history_payload(synced, [*self.seeds[i:], self.round_seed], hist)
        return tasks

    def idle(self) -> None:
        if self.ahead is not None:
            Z.prefetch(self.ahead, self.K, self.P, self.model.shapes, self.p.direction)
            self.ahead = None

    def check(self, cell: str, report: Payload) -> None:
        p = self.p
        check_report(
            report, f"report of cell {cell}", (self.K, self.P), self.base + len(self.g), p.weighting, p.scalar_clip
        )

    def aggregate(self, round: int, reports: Mapping[str, Payload]) -> Outcome:
        total, acc, devices = 0.0, np.zeros((self.K, self.P), np.float64), 0
        for c, r in sorted(reports.items()):
            table = self.synced.setdefault(c, {})
            for d in r.meta["answered"]:
                table[d] = round
            for d in r.meta.get("resync", []):
                table.pop(d, None)  # back at x_0: its next task carries the history from round 0
            devices += len(r.meta["answered"])
            self.need[c] = int(r.meta["need"])
            if r.meta["weight"]:
                acc += r.tensors["g"]
                total += float(r.meta["weight"])
        gbar = (acc / total).astype(np.float32) if total > 0 else np.zeros((self.K, self.P), np.float32)
        self.seeds.append(self.round_seed)
        self.g.append(gbar)
        if self.log_g is not None:
            self.log_seeds.append(self.round_seed)
            self.log_g.append(gbar)  # the same array as the window's: no copy
        if self.p.server_model:
            Z.apply_round(self.model, self.round_seed, gbar, self.p.lr, self.p.direction, self.buf, self.p.momentum)
        self._prune(round + 1)
        return Outcome(
            {
                "cells": len(reports),
                "devices": devices,
                "weight": total,
                "history_rounds": len(self.g),
                "g_abs_mean": float(np.abs(gbar).mean()),
            }
        )

    def _prune(self, next_round: int) -> None:
        oldest = min((self.need.get(c, 0) for c in self.cells), default=0)
        if self.log_g is not None:  # the window is the log from the oldest round needed (it may grow back)
            self.base = min(oldest, next_round)
            self.seeds, self.g = self.log_seeds[self.base :], self.log_g[self.base :]
            return
        oldest = min(max(oldest, self.base), next_round)
        drop = oldest - self.base
        if drop > 0:
            del self.seeds[:drop], self.g[:drop]
            self.base = oldest

    def global_params(self) -> dict[str, np.ndarray]:
        return self.model

    def forget_devices(self) -> None:
        """Every device lost its replica (a launcher recreated them at x_0): from now on the tasks carry
        the history from round 0, from the cloud's log, and each device replays it (bit for bit the
        replica it had: the same rounds applied in the same order)."""
        if self.log_g is None:
            raise ValueError(
                "the checkpoint holds no round log (written by an older fedtier): devices that "
                "lost their replicas cannot be rebuilt; run again without --resume"
            )
        self.base, self.seeds, self.g = 0, list(self.log_seeds), list(self.log_g)
        self.synced, self.need = {}, {}

    def state(self) -> Payload:
        """The model, the buffer, the tables; the window only without a log (else it is the log's tail)."""
        meta = {"base": self.base, "synced": self.synced, "need": self.need, "cells": sorted(self.cells)}
        buf = {f"momentum:{k}": v for k, v in (self.buf or {}).items()}
        if self.log_g is not None:
            return Payload(meta, {**self.model, **buf})
        hist = {"history:s": np.asarray(self.seeds, np.uint64), "history:g": stack_rounds(self.g, self.K, self.P)}
        return Payload(meta, {**self.model, **buf, **hist})

    def log_tail(self, start: int) -> dict[str, np.ndarray] | None:
        """The cloud's log from round ``start`` (its seeds and scalars); None where it keeps none (resumed from an
        older fedtier's checkpoint that held its window only)."""
        if self.log_g is None:
            return None
        return {
            "log:s": np.asarray(self.log_seeds[start:], np.uint64),
            "log:g": stack_rounds(self.log_g[start:], self.K, self.P),
        }

    def load_state(self, state: Payload) -> None:
        t = dict(state.tensors)
        buf = {k[len("momentum:") :]: t.pop(k) for k in list(t) if k.startswith("momentum:")}
        self.base = int(state.meta["base"])
        self.log_seeds, self.log_g, self.seeds, self.g = read_checkpoint_log(t, self.base, self.K, self.P)
        P.check_like(t, self.model, "checkpoint")
        if self.buf is not None:
            P.check_like(buf, self.model, "checkpoint momentum")
            self.buf = Z.packed({k: buf[k] for k in self.model})
        self.model = Z.packed({k: t[k] for k in self.model})  # model order: the directions' order
        self.synced = {c: {d: int(r) for d, r in v.items()} for c, v in state.meta["synced"].items()}
        self.need = {c: int(v) for c, v in state.meta["need"].items()}
        self.cells = set(state.meta["cells"])


# --------------------------------------------------------------------------------------------- cell
class DeComFLCell(CellRole):
    def __init__(
        self,
        params: DeComFLParams,
        cell: str,
        roster: Sequence[str] | None = None,
        shapes: Z.Shapes | None = None,
        ahead: tuple[int, int | None] | None = None,
    ) -> None:
        """``roster``: every device of the cell (so ``need`` covers those never seen); None: unknown. ``shapes``:
        the model's, where the cell's devices draw in its process (``fedtier sim``): as its task comes it starts
        drawing the round's directions for them (``directions.prefetch``) and replaying the round before
        (``protocols.replay_ahead``). ``ahead``: the run's seed and rounds (``None``: unknown), with which it starts
        drawing the next round's once it reported and its process waits (:meth:`idle`: from the seed the cloud will
        pick, :func:`directions.round_seed`; a task of another seed is drawn when it comes, as without)."""
        self.p, self.cell, self.shapes, self.ahead = params, cell, shapes, ahead
        self.K, self.P = params.local_steps, params.perturbations
        self.roster = sorted(roster) if roster is not None else None
        self.round = -1
        self.reported: int | None = None  # the round it reported, until idle() starts the next one's draws

    def begin(self, round: int, task: Payload) -> None:
        self.round = round
        self.start, self.seeds, self.hist = read_history(task, round, self.K, self.P, f"task of cell {self.cell}")
        if self.shapes is not None:
            Z.prefetch(int(self.seeds[-1]), self.K, self.P, self.shapes, self.p.direction)
            replay_ahead(self.seeds, self.hist)
        synced = task.meta.get("synced", {})
        if not isinstance(synced, dict) or not all(isinstance(v, int) and 0 <= v < round for v in synced.values()):
            raise Rejected(RejectKind.MALFORMED, f"task of cell {self.cell}: bad synced table")
        self.synced: dict[str, int] = dict(synced)
        self.sum = np.zeros((self.K, self.P), np.float64)
        self.weight = 0.0
        self.answered: list[str] = []
        self.resync: list[str] = []  # devices that lost their replica (restarted): back at x_0

    def plan(self, edge_round: int, available: Sequence[str]) -> dict[str, Payload]:
        tasks = {}
        for d in available:
            t = self.synced.get(d, 0)
            if t < self.start:
                continue  # the cloud no longer holds this device's history (cannot happen with a roster)
            i = t - self.start
            tasks[d] = history_payload({"from": t}, self.seeds[i:], self.hist[i:])
        return tasks

    def check(self, device: str, result: Payload) -> None:
        what = f"result of device {device}"
        if "resync" in result.meta:
            if result.meta != {"resync": True} or result.tensors:
                raise Rejected(RejectKind.INCONSISTENT, f"{what}: a resync answer carries nothing else")
            return
        w = result.meta.get("weight")
        if (number := finite_number(w)) is None or number <= 0:
            raise Rejected(RejectKind.BOUND, f"{what}: weight must be a positive number, got {str(w)[:40]}")
        expect_shape(result.tensors.get("g"), (self.K, self.P), "float32", f"{what} scalars")

    def aggregate(self, edge_round: int, results: Mapping[str, Payload]) -> Outcome:
        for d, r in sorted(results.items()):
            if r.meta.get("resync"):
                self.resync.append(d)
                continue
            w = 1.0 if self.p.weighting == "uniform" else float(r.meta["weight"])
            g, clip = r.tensors["g"].astype(np.float64), self.p.scalar_clip
            self.sum += w * (np.clip(g, -clip, clip) if clip else g)  # a device's scalars are its word
            self.weight += w
            self.answered.append(d)
        resync = {"resync": len(self.resync)} if self.resync else {}  # (answered: the results, resyncs too)
        return Outcome({"answered": len(results), **resync} if results else {})

    def _need(self) -> int:
        if self.roster is None:
            return 0  # unknown roster: a device never seen may still need round 0
        after = {**self.synced, **{d: self.round for d in self.answered}, **{d: 0 for d in self.resync}}
        return min((after.get(d, 0) for d in self.roster), default=self.round)

    def idle(self) -> None:
        if self.shapes is None or self.ahead is None or self.reported != self.round:
            return
        self.reported, (seed, rounds) = None, self.ahead  # (once a round)
        if rounds is None or self.round + 1 < rounds:
            Z.prefetch(Z.round_seed(seed, self.round + 1), self.K, self.P, self.shapes, self.p.direction)

    def report(self) -> Payload:
        self.reported = self.round  # (its process idle next: idle() draws the next round's directions)
        meta = {
            "weight": self.weight,
            "answered": sorted(self.answered),
            "need": self._need(),
            **({"resync": sorted(self.resync)} if self.resync else {}),
        }
        if self.weight == 0:
            return Payload({**meta, "weight": 0}, {})
        return Payload(meta, {"g": self.sum})


# --------------------------------------------------------------------------------------------- device
class DeComFLDevice(DeviceRole):
    """One device for the whole run: holds x_{synced} (and its momentum buffer) between rounds."""

    writes_task = False  # it copies what it changes (its task is read-only, shared by its cell in sim)

    def __init__(self, params: DeComFLParams, initial: Callable[[], Mapping[str, np.ndarray]]) -> None:
        self.p, self.initial = params, initial
        self.K, self.P = params.local_steps, params.perturbations
        self.model: dict[str, np.ndarray] | None = None
        self.buf: dict[str, np.ndarray] | None = None  # heavy-ball buffer of x_{synced} (momentum > 0)
        self.synced = 0
        self.key: bytes | None = None  # x_{synced}'s key in the process's replay cache (directions.replay)

    def _init(self, trainer: Trainer) -> None:
        # a forward-only backend ships x_0 with its exported model; torch devices build it from the spec
        source = getattr(trainer, "initial_params", None)
        self.model = Z.packed(source() if callable(source) else self.initial())
        self.buf = Z.packed(P.zeros_like(self.model)) if self.p.momentum else None
        self.key = Z.trajectory_key(self.model, self.buf, self.p.lr, self.p.momentum, self.p.direction)

    def catch_up(self, start: int, seeds: np.ndarray, hist: np.ndarray) -> None:
        """Replay rounds ``start .. start+h-1`` on the device model (skipping those already applied)."""
        assert self.model is not None
        if start > self.synced:
            raise ValueError(f"history starts at round {start}, but this device is synced to round {self.synced}")
        skip, p = self.synced - start, self.p  # (the replicas of a process share their replays: directions.replay)
        self.model, self.buf, self.key = Z.replay(  # (x and buf may be shared, read-only, with the other replicas)
            self.model, self.buf, self.key, seeds[skip:], hist[skip:], p.lr, p.direction, p.momentum
        )
        self.synced = start + len(hist)

    def train(self, task: Payload, data: LocalData, trainer: Trainer, ctx: DeviceContext) -> Payload:
        if self.model is None:
            self._init(trainer)
        start, seeds, hist = read_history(task, ctx.round, self.K, self.P, "task")
        if start > self.synced == 0:  # a device that lost its replica (restarted): x_0 again, ask for it all
            return decomfl_wire.resync_answer(ctx.device, ctx.round, start)
        self.catch_up(start, seeds, hist)
        assert self.model is not None  # _init set it
        # x and the buffer stay x_r's exactly: the local steps run on copies (a revert by copy)
        g = self.local_update(self.model, int(seeds[-1]), data, trainer, ctx, self.buf)
        if not all_finite(g):  # a "diverged" answer: the cell records it, never aggregates it
            k = int(np.argmin(np.isfinite(g).all(axis=1)))
            return diverged_result(f"non-finite ZO scalars at local step {k} (lr or mu too large?)")
        return Payload({"weight": len(data)}, {"g": g})

    def local_update(
        self,
        x: Mapping[str, np.ndarray],
        round_seed: int,
        data: LocalData,
        trainer: Trainer,
        ctx: DeviceContext,
        buf: Mapping[str, np.ndarray] | None = None,
    ) -> np.ndarray:
        """K ZO-SGD steps from ``x`` (and the momentum buffer ``buf``), neither modified: the steps move copies,
        made at the first step, and the last step is not taken (the device reverts to x_r: its model is never
        used). Returns the K x P float32 scalars (at the first step whose scalars are not finite, with that
        step's row)."""
        p, shapes = self.p, Z.shapes_of(x)
        g = np.zeros((self.K, self.P), np.float32)
        order = batches(
            len(data), p.batch_size, self.K, rng(ctx.seed, ctx.round, ctx.edge_round, ctx.cell, ctx.device, "batches")
        )
        moved: Z.Packed | None = None  # the copies the steps move (x's and the buffer's)
        moved_buf: Z.Packed | None = None
        for k, idx in enumerate(order):
            xb, yb = data.batch(idx)
            zs = Z.direction_vectors(round_seed, k, self.P, shapes, p.direction)  # (runtime.direction_threads)
            f0, *fs = trainer.perturbed_losses(x, zs, p.mu, xb, yb)  # f(x) and the P perturbed losses (one batch)
            g[k] = [(f - f0) / p.mu for f in fs]  # (each rounded once to float32, as np.float32 rounds it)
            if not np.isfinite(g[k]).all():
                return g  # the answer is "diverged" whatever the later steps give
            if k == self.K - 1:
                break
            if moved is None:
                moved, moved_buf = Z.packed(x), (Z.packed(buf) if buf is not None else None)
                x = moved
            if p.momentum:
                assert moved_buf is not None, "momentum needs its buffer"
                Z.apply_momentum_step(moved, moved_buf, round_seed, k, g[k], p.lr, p.momentum, p.direction, False)
            else:
                Z.apply_step(moved, round_seed, k, g[k], p.lr, p.direction, share=False)
        return g


class DeComFL(Algorithm):
    """DeComFL over the hierarchy: seeds down, K x P scalars up, history replay for absent devices."""

    name = "decomfl"
    Params = DeComFLParams
    traits = frozenset({Trait.DEVICE_STATE, Trait.FORWARD_ONLY})
    without = {
        Trait.CELL_SUM: "DeComFL's uplink is K x P scalars per device: the keys and shares of secure aggregation "
        "would cost more than the scalars, and its cells replay per-device histories; not supported",
        Trait.CLOUD_SUM: "DeComFL's cloud averages scalars per seeded direction, not model deltas",
        Trait.PLAIN_DELTA_UPLINK: "DeComFL's devices send K x P scalars",
        Trait.VERSIONED: "DeComFL's devices replay the cloud's round history",
    }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        n = self.params.perturbations  # type: ignore[attr-defined]  # compose built DeComFLParams
        if why := memory_refusal(4 * n * self.model.num_params(), "algorithm.perturbations"):
            raise ValueError(f"{why} (a step's {n} directions, drawn at once, each the model's size)")
        self._x0: dict[str, np.ndarray] | None = None
        self.rosters: dict[str, list[str]] = {}

    @classmethod
    def model_message_params(cls, spec: ModelSpec, cells: int) -> int:
        return 0  # seeds down, K x P scalars up: none depends on the model's size

    def bind_topology(self, cells: Mapping[str, Sequence[str]]) -> None:
        self.rosters = {c: list(devices) for c, devices in cells.items()}

    def tier_refusal(self, tier: str, memory: int | None = None) -> str | None:
        """The cloud's log: :data:`LOG_ROUND_BYTES` and 4KP bytes a round of ``run.rounds``, kept, sent and read
        back by a resume (three times that)."""
        p, rounds = self.params, self.rounds or 0
        per_round = LOG_ROUND_BYTES + 4 * p.local_steps * p.perturbations  # type: ignore[attr-defined]
        what = f"run.rounds: {rounds:,} rounds of the cloud's log ({per_round:,} bytes a round: kept, sent, read back)"
        why = memory_refusal(3 * rounds * per_round, what, memory) if tier == "cloud" else None
        return f"{why}; set fewer rounds, or fewer algorithm.local_steps x perturbations" if why else None

    def largest_message(self) -> tuple[int, int, str] | None:
        """A cell's task in the last round with the whole log (``decomfl_wire.largest_task``); None: rounds unknown."""
        p = self.params
        if self.rounds is None:
            return None
        return decomfl_wire.largest_task(self.rounds, p.local_steps, p.perturbations, self.rosters)  # type: ignore[attr-defined]

    def initial_params(self) -> dict[str, np.ndarray]:
        if self._x0 is None:
            self._x0 = super().initial_params()
        return P.copy(self._x0)

    def cloud(self) -> CloudRole:
        return DeComFLCloud(self.params, self.seed, self.initial_params())  # type: ignore[arg-type]

    def cell(self, cell: str) -> CellRole:
        shapes = Z.shapes_of(self.initial_params()) if Z.prefetching() else None  # (its devices draw here: sim)
        ahead = (self.seed, self.rounds)  # (the next round's seed: drawn ahead where the process draws ahead)
        return DeComFLCell(self.params, cell, self.rosters.get(cell), shapes, ahead)  # type: ignore[arg-type]

    def device(self, device: str) -> DeviceRole:
        return DeComFLDevice(self.params, self.initial_params)  # type: ignore[arg-type]
