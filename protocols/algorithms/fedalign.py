"""FedALIGN (Ravi & Shomorony, "Utilizing Free Clients in Federated Learning for Focused Model
Enhancement"): train for the objective of the priority devices, admit a non-priority ("free") device
in a round only when its loss on the current model matches the priority loss within epsilon.

The paper's round (spec ``fedalign.md`` sec. 2), for the broadcast model ``w`` of iteration ``i``::

    F   = sum_{k in P} D_k F_k(w) / sum_{k in P} D_k              priority loss of the broadcast model
    free k: l_k = F_k(w) (forward pass, before training); opts in iff l_k <= F + eps_i
    cell admits an opted-in k iff |F - l_k| <= eps_i              (two-sided)
    w  <- w + sum_{k in S} D_k (w^k - w) / sum_{k in S} D_k       S = P + admitted

The last line is eq. (15/16) with p_k = D_k / sum_P D_i and Z = 1 + sum_{admitted} p_k: a data-size
weighted FedAvg over S, one update per iteration (the authors' code applies it up to three times and
compares accuracies: we follow the paper; ``criterion = "accuracy"`` switches to accuracies on purpose).

**How F(w) reaches the free devices in a hierarchy.** Priority devices may sit in any cell, so F(w) is
known only at the cloud, after the priority devices evaluated ``w``. A matching iteration therefore
takes two cloud rounds (no staleness: the admission uses F of the very model the free devices probe):

1. phase ``priority``: every cell sends ``w`` to its priority devices; each measures ``F_k(w)`` before
   training, trains, and sends its update with ``F_k(w)``. Cells report the weighted update and the
   sums ``sum D_k F_k(w)``, ``sum D_k``; the cloud holds the updates and forms ``F``.
2. phase ``free``: the cloud sends ``(w, F, eps)``; free devices probe, opt in and train; cells admit.
   The cloud averages the held priority updates with the admitted free ones, then moves ``w``.

Every device receives ``w`` once and trains once per iteration, as in the paper; the cost is one more
cloud <-> cell exchange. Iterations that need no F take one cloud round: warm-up and ``eps = 0``
(phase ``solo``: priority devices only, exactly FedAvg on P) and ``eps = inf`` (phase ``all``: every
device, exactly FedAvg on all devices). So ``run.rounds`` counts cloud rounds; the iteration index and
phase of each cloud round are a pure function of the parameters (:class:`Schedule`).

Robust aggregation (``cell_aggregator`` / ``cloud_aggregator``, default the paper's mean): a cell combines its
priority and admitted free devices' deltas, the cloud the held priority-phase reports and this phase's, each a
delta of the same broadcast model ``w``. A priority device alone in its cell's phase is that cell's whole report:
under a median only the cloud's aggregator bounds it (``tests/test_robust_fedalign_fedmrn.py``); a Krum or trimmed
mean that a phase can never feed enough inputs is refused (``fedalign_inputs``).

Wire: ``epsilon`` travels as ``null`` for infinity (JSON has no inf). A free device that declines
answers with its probe values and no tensors, so its cell never waits for it until the deadline."""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from .. import params as P
from ..numbers import finite_number, is_count
from ..rejections import Rejected, RejectKind
from ..round_text import nth
from ..seeding import rng
from ..trainer import LocalData, Trainer
from ..wire.payload import Payload
from .base import Algorithm, CellRole, CloudRole, DeviceContext, DeviceRole, OrInfinity, TrainParams
from .fedalign_inputs import check_phase_inputs
from .fedalign_priority import check_probe_lists, priority_figures, probe_lists
from .fedalign_schedule import Schedule
from .fedavg import FedAvgCell, FedAvgDevice, check_delta
from .outcome import Outcome
from .robust import RobustParams, aggregate, robust_params
from .traits import Trait

log = logging.getLogger("fedtier.cloud")
PHASES = ("solo", "priority", "free", "all")
PRIO_KEYS = ("prio_weight", "prio_loss", "prio_accuracy")
HELD = "held/"


class FedAlignParams(RobustParams):
    """FedALIGN's keys of the ``[algorithm]`` section, with the robust aggregators (``cell_aggregator`` over the
    priority and admitted free devices' deltas, ``cloud_aggregator`` over the cells' reports of both phases)."""

    priority: list[str] = Field(default_factory=list, description="priority device ids (e.g. c0-d3)")
    priority_fraction: float = Field(
        default=0.0, ge=0, le=1, description="or: this fraction of all devices, drawn with run.seed"
    )
    epsilon: OrInfinity = Field(default=0.2, description="matching threshold; 0 = priority only, inf = all")
    epsilon_later: OrInfinity = Field(default=0.0, description="threshold from epsilon_drop_round on (inf = all)")
    epsilon_drop_round: int = Field(default=0, ge=0, description="iteration of the drop (0 = no drop)")
    warmup_rounds: int = Field(default=0, ge=0, description="first iterations with priority devices only")
    criterion: Literal["loss", "accuracy"] = Field(
        default="loss", description="what a non-priority device matches against the priority devices' value"
    )
    priority_statistic: Literal["mean", "median"] = Field(
        default="mean",
        description="how the cloud makes F of the priority devices' probes: the paper's weighted mean, or their "
        "weighted median (cells then report each priority device's probe): F stays within the honest devices' range "
        "while liars (lying priority devices, every priority device of a lying cell) hold under half the weight",
    )

    def check_topology(self, cells: Mapping[str, Sequence[str]]) -> None:
        """The base checks only: the robust aggregators' inputs depend on the phases and the priority set, which
        ``FedAlign.bind_topology`` checks (``fedalign_inputs``), not on the whole cells and all the cells."""
        TrainParams.check_topology(self, cells)

    def idle_keys(self) -> dict[str, str]:
        out = super().idle_keys()
        if self.epsilon_drop_round == 0:
            out["epsilon_later"] = "epsilon_drop_round > 0"
        return out

    @model_validator(mode="after")
    def _fedalign_ok(self) -> FedAlignParams:
        if bool(self.priority) == (self.priority_fraction > 0):
            raise ValueError("set exactly one of priority (device ids) and priority_fraction")
        if len(set(self.priority)) != len(self.priority):
            raise ValueError("priority: device ids must be unique")
        if self.edge_rounds != 1:
            raise ValueError(
                "edge_rounds: FedALIGN aggregates once per round (the admission needs the cloud's "
                "priority loss of the model being trained), use edge_rounds = 1"
            )
        return self


def _finite(meta: Mapping[str, Any], key: str, what: str, lo: float = 0.0, hi: float = math.inf) -> float:
    v = meta.get(key)
    number = finite_number(v)
    if number is None or not lo <= number <= hi:
        raise Rejected(RejectKind.BOUND, f"{what}: {key} must be a finite number in [{lo}, {hi}], got {str(v)[:40]}")
    return number


def opts_in(criterion: str, value: float, F: float | None, eps: float | None) -> bool:
    """The free device's rule: the model is good enough for me (``l_k <= F + eps``; accuracy mirrored)."""
    if eps is None:
        return True
    if F is None:
        return False
    return value <= F + eps if criterion == "loss" else value >= F - eps


def admits(value: float, F: float | None, eps: float | None) -> bool:
    """The cell's two-sided rule ``|F - l_k| <= eps`` (``eps`` None: infinity)."""
    return eps is None or (F is not None and abs(F - value) <= eps)


class FedAlignCloud(CloudRole):
    """Sends ``w`` (and F in phase ``free``), forms F from the priority reports, averages over S."""

    def weight_keys(self) -> dict[str, float]:
        # prio_weight weighs the cells' priority losses in F; it adds every edge round's priority devices
        return {"weight": 1.0, "prio_weight": float(self.p.edge_rounds)}

    def member_keys(self) -> tuple[str, ...]:
        return ("prio_devices",)  # priority_statistic "median": the devices whose probes a cell reports

    def member_weight_keys(self) -> dict[str, str]:
        return {"prio_weights": "prio_devices"}  # ... and each one's sample count

    def __init__(
        self, params: FedAlignParams, initial: Mapping[str, np.ndarray], priority: frozenset[str] | None = None
    ) -> None:
        self.p, self.schedule = params, Schedule(params)
        self.priority = priority  # the priority devices a cell's probe lists may name (None: not checked)
        self.model = P.copy(initial)
        self.F: float | None = None  # criterion value of the current model (phase free)
        self.held: dict[str, Payload] = {}  # phase-priority reports awaiting the free phase
        self.phase = "solo"

    def plan(self, round: int, cells: Sequence[str]) -> dict[str, Payload]:
        it, self.phase = self.schedule.at(round)
        eps = self.schedule.epsilon(it)
        meta: dict[str, Any] = {
            "phase": self.phase,
            "iteration": it,
            "criterion": self.p.criterion,
            "epsilon": None if math.isinf(eps) else eps,
        }
        if self.phase == "free":
            meta["F"] = self.F
        task = Payload(meta, self.model)
        return {c: task for c in cells}

    def check(self, cell: str, report: Payload) -> None:
        if report.meta.get("phase") != self.phase:
            raise Rejected(
                RejectKind.OUT_OF_ORDER,
                f"report of cell {cell}: phase {report.meta.get('phase')!r}, expected {self.phase!r}",
            )
        weight, _, accuracy = (_finite(report.meta, k, f"report of cell {cell}") for k in PRIO_KEYS)
        if accuracy > weight:  # a sum of weight x accuracy, each accuracy in [0, 1]
            raise Rejected(
                RejectKind.INCONSISTENT,
                f"report of cell {cell}: prio_accuracy {accuracy:g} above prio_weight {weight:g}",
            )
        if self.p.priority_statistic == "median":
            check_probe_lists(report.meta, f"report of cell {cell}", self.priority)
        for key in ("admitted", "refused"):  # counts of free devices, summed into the round's metrics
            n = report.meta.get(key, 0)
            if not is_count(n):
                raise Rejected(RejectKind.MALFORMED, f"report of cell {cell}: {key} must be a count, got {str(n)[:40]}")
        if report.meta.get("weight") == 0 and not report.tensors:
            return
        check_delta(report, self.model, f"report of cell {cell}")

    def aggregate(self, round: int, reports: Mapping[str, Payload]) -> Outcome:
        it, phase = self.schedule.at(round)
        metrics: dict[str, Any] = {"iteration": it, "phase": phase}
        eps = self.schedule.epsilon(it)
        metrics["epsilon"] = None if math.isinf(eps) else eps
        if phase != "free":  # priority devices took part: F of the broadcast model
            loss, acc, by_cell = priority_figures(self.p.priority_statistic, reports)
            if loss is not None and not math.isfinite(loss):  # cells' figures, each finite, whose mean is not
                log.warning("round %s: the cells' priority loss is beyond the float range: none this round", nth(round))
                loss = None  # (the loss criterion: no F, as in a round without priority devices)
            self.F = loss if self.p.criterion == "loss" else acc
            metrics.update(
                priority_loss=loss,
                priority_accuracy=acc,
                priority_statistic=self.p.priority_statistic,
                priority_by_cell=by_cell,
            )
        else:
            metrics["F"] = self.F
        if phase != "solo":
            metrics["admitted"] = sum(int(r.meta.get("admitted", 0)) for r in reports.values())
            metrics["refused"] = sum(int(r.meta.get("refused", 0)) for r in reports.values())
        contributing = {c: r for c, r in sorted(reports.items()) if r.meta.get("weight")}
        if phase == "priority":
            self.held = contributing
            return Outcome(metrics)
        # every report is a delta of the same broadcast model w: the held priority-phase ones first, each named
        # "1:CELL" ("2:CELL" this phase's), so the mean sums them in the paper's order (held, then this phase's)
        items = [(f"1:{c}", r.meta["weight"], r.tensors) for c, r in self.held.items()] if phase == "free" else []
        items += [(f"2:{c}", r.meta["weight"], r.tensors) for c, r in contributing.items()]
        self.held = {}
        if not items:
            return Outcome(metrics)
        agg = aggregate(robust_params(self.p).cloud_aggregator, items, self.p)
        self.model = P.add(self.model, agg.delta, self.p.server_lr)
        metrics.update(weight=agg.weight, **agg.notes())
        said = {"1": " (priority phase)", "2": " (free phase)" if phase == "free" else ""}
        return Outcome(metrics, excluded={k[2:] + said[k[0]]: why for k, why in agg.excluded.items()})

    def global_params(self) -> dict[str, np.ndarray]:
        return self.model

    def state(self) -> Payload:
        tensors = dict(self.model)
        held_meta = {}
        for cell, r in self.held.items():
            held_meta[cell] = r.meta
            tensors.update({f"{HELD}{cell}/{k}": v for k, v in r.tensors.items()})
        return Payload({"F": self.F, "held": held_meta}, tensors)

    def load_state(self, state: Payload) -> None:
        model = {k: v for k, v in state.tensors.items() if not k.startswith(HELD)}
        P.check_like(model, self.model, "checkpoint")
        self.model = P.copy(model)
        self.F = state.meta.get("F")
        self.held = {}
        for cell, meta in dict(state.meta.get("held", {})).items():
            prefix = f"{HELD}{cell}/"
            delta = {k[len(prefix) :]: v for k, v in state.tensors.items() if k.startswith(prefix)}
            P.check_like(delta, self.model, f"held report of cell {cell}")
            self.held[cell] = Payload(dict(meta), P.copy(delta))


class FedAlignCell(FedAvgCell):
    """Plans the phase's devices, admits free devices by loss matching, logs every decision."""

    def __init__(self, params: FedAlignParams, cell: str, priority: frozenset[str]) -> None:
        super().__init__(params, cell)
        self.priority = priority
        self.statistic = params.priority_statistic
        self.task: dict[str, Any] = {}
        self.planned: dict[str, str] = {}

    def begin(self, round: int, task: Payload) -> None:
        m = task.meta
        if m.get("phase") not in PHASES or m.get("criterion") not in ("loss", "accuracy"):
            raise Rejected(
                RejectKind.MALFORMED, f"cell task: bad phase/criterion {m.get('phase')!r}/{m.get('criterion')!r}"
            )
        eps, F = m.get("epsilon"), m.get("F")
        for key, v in (("epsilon", eps), ("F", F)):
            if v is not None and finite_number(v) is None:
                raise Rejected(RejectKind.MALFORMED, f"cell task: {key} must be a finite number or null, got {v!r}")
        super().begin(round, task)
        self.task = {
            "phase": m["phase"],
            "iteration": m.get("iteration"),
            "criterion": m["criterion"],
            "epsilon": eps,
            "F": F,
        }
        self.planned = {}
        self.decisions: dict[str, dict[str, Any]] = {}
        self.prio = {"prio_weight": 0.0, "prio_loss": 0.0, "prio_accuracy": 0.0}
        self.probes: dict[str, tuple[float, float, float]] = {}  # priority_statistic "median": each device's

    def plan(self, edge_round: int, available: Sequence[str]) -> dict[str, Payload]:
        phase, t = self.task["phase"], self.task
        prio_task = Payload({"role": "priority"}, self.model)
        free_task = Payload(
            {"role": "free", "criterion": t["criterion"], "epsilon": t["epsilon"], "F": t["F"]}, self.model
        )
        plan = {}
        for d in available:
            if d in self.priority and phase in ("solo", "priority", "all"):
                plan[d] = prio_task
            elif d not in self.priority and phase in ("free", "all"):
                plan[d] = free_task
        self.planned = {d: task.meta["role"] for d, task in plan.items()}
        return plan

    def check(self, device: str, result: Payload) -> None:
        what = f"result of device {device}"
        role = self.planned.get(device)
        if role is None:
            raise Rejected(RejectKind.NOT_PLANNED, f"{what}: not planned")
        _finite(result.meta, "probe_loss", what)
        _finite(result.meta, "probe_accuracy", what, 0.0, 1.0)
        trained = result.meta.get("trained")
        if not isinstance(trained, bool) or (role == "priority" and not trained):
            raise Rejected(
                RejectKind.MALFORMED,
                f"{what}: trained must be true/false (true for a priority device), got {trained!r}",
            )
        if trained:
            check_delta(result, self.model, what)
        else:
            _finite(result.meta, "weight", what)
            if result.tensors:
                raise Rejected(RejectKind.INCONSISTENT, f"{what}: a device that declined sends no tensors")

    def aggregate(self, edge_round: int, results: Mapping[str, Payload]) -> Outcome:
        t = self.task
        F, eps, crit = t["F"], t["epsilon"], t["criterion"]
        included: dict[str, Payload] = {}
        admission: dict[str, dict[str, Any]] = {}
        for d, r in sorted(results.items()):
            m = r.meta
            if self.planned[d] == "priority":
                included[d] = r
                w = float(m["weight"])
                self.prio["prio_weight"] += w
                # the loss is the device's word (finite, unbounded): its sum stays a float the report can carry
                self.prio["prio_loss"] = min(self.prio["prio_loss"] + w * m["probe_loss"], sys.float_info.max)
                self.prio["prio_accuracy"] += w * m["probe_accuracy"]
                self.probes[d] = (w, float(m["probe_loss"]), float(m["probe_accuracy"]))
                continue
            value = float(m["probe_loss"] if crit == "loss" else m["probe_accuracy"])
            ok = bool(m["trained"]) and admits(value, F, eps)
            if ok:
                included[d] = r
            admission[d] = {
                "admitted": ok,
                "by": None if ok else ("cell" if m["trained"] else "device"),
                "loss": m["probe_loss"],
                "accuracy": m["probe_accuracy"],
                "gap": None if F is None else value - F,
            }
        self.decisions.update(admission)
        robust = super().aggregate(edge_round, included)
        metrics: dict[str, Any] = {
            **robust.metrics,  # the robust aggregator's notes (too few inputs)
            "phase": t["phase"],
            "iteration": t["iteration"],
            "epsilon": eps,
            "priority": sorted(d for d in results if self.planned[d] == "priority"),
        }
        if t["phase"] in ("free", "all"):
            metrics.update(
                F=F,
                admission=admission,
                admitted=sorted(d for d, a in admission.items() if a["admitted"]),
                refused=sorted(d for d, a in admission.items() if not a["admitted"]),
            )
        return Outcome(metrics, excluded=robust.excluded)

    def report(self) -> Payload:
        report = super().report()
        admitted = sum(a["admitted"] for a in self.decisions.values())
        report.meta.update(
            phase=self.task["phase"], admitted=admitted, refused=len(self.decisions) - admitted, **self.prio
        )
        if self.statistic == "median":
            report.meta.update(probe_lists(self.probes))
        return report


class FedAlignDevice(FedAvgDevice):
    """Probes the received model on the local data, then trains (a free device only if it opts in)."""

    writes_task = False  # it copies what it changes, as FedAvg's device (its own train: declared again)

    def train(self, task: Payload, data: LocalData, trainer: Trainer, ctx: DeviceContext) -> Payload:
        role = task.meta.get("role")
        if role not in ("priority", "free"):
            raise ValueError(f"task role must be priority or free, got {role!r}")
        trainer.set_params(task.tensors)
        loss, acc = trainer.evaluate(data.x, data.y)  # F_k(w) of the received model, before training
        probe = {"weight": len(data), "probe_loss": loss, "probe_accuracy": acc}
        if not (math.isfinite(loss) and math.isfinite(acc)):
            raise ValueError(f"the received model has a non-finite loss on the local data ({loss})")
        if role == "free":
            value = loss if task.meta.get("criterion", "loss") == "loss" else acc
            if not opts_in(task.meta.get("criterion", "loss"), value, task.meta.get("F"), task.meta.get("epsilon")):
                return Payload({**probe, "trained": False}, {})
        result = super().train(task, data, trainer, ctx)
        result.meta.update(probe, trained=True)
        return result


def draw_priority(devices: Sequence[str], fraction: float, seed: int) -> list[str]:
    """``max(1, floor(fraction * N))`` devices drawn without replacement with ``run.seed``."""
    k = max(1, int(math.floor(fraction * len(devices) + 1e-9)))
    idx = rng(seed, None, None, None, "fedalign.priority").choice(len(devices), size=k, replace=False)
    return sorted(devices[i] for i in idx)


class FedAlign(Algorithm):
    """FedALIGN on top of (hierarchical, E = 1) FedAvg; ``epsilon = 0`` / ``inf`` are its baselines."""

    name = "fedalign"
    Params = FedAlignParams
    traits = frozenset({Trait.CLOUD_SUM})
    without = {
        Trait.CELL_SUM: "FedALIGN's cell admits each non-priority device by its own loss, so it must see each result",
        Trait.PLAIN_DELTA_UPLINK: "FedALIGN's devices answer with their admission probes (a declined device "
        "sends no delta)",
        Trait.VERSIONED: "FedALIGN's phases are synchronous rounds",
    }

    def bind_topology(self, cells: Mapping[str, Sequence[str]]) -> None:
        devices = [d for c in sorted(cells) for d in cells[c]]
        p: FedAlignParams = self.params  # type: ignore[assignment]
        if p.priority:
            unknown = [d for d in p.priority if d not in set(devices)]
            if unknown:
                raise ValueError(
                    f"algorithm.priority: {', '.join(map(repr, unknown))} not in the topology "
                    f"(device ids look like {devices[0]} ... {devices[-1]})"
                )
            self.priority = frozenset(p.priority)
        else:
            self.priority = frozenset(draw_priority(devices, p.priority_fraction, self.seed))
        check_phase_inputs(p, Schedule(p).reachable_phases(self.rounds), cells, self.priority)  # the run's rounds

    def _priority(self) -> frozenset[str]:
        if not hasattr(self, "priority"):
            if not self.params.priority:  # type: ignore[attr-defined]
                raise ValueError(
                    "algorithm.priority_fraction needs the topology: build the algorithm with "
                    "RunConfig.build_algorithm (or call bind_topology)"
                )
            self.priority = frozenset(self.params.priority)  # type: ignore[attr-defined]
        return self.priority

    def cloud(self) -> CloudRole:
        return FedAlignCloud(self.params, self.initial_params(), self._priority())  # type: ignore[arg-type]

    def cell(self, cell: str) -> CellRole:
        return FedAlignCell(self.params, cell, self._priority())  # type: ignore[arg-type]

    def device(self, device: str) -> DeviceRole:
        return FedAlignDevice(self.params)
