"""FedALIGN's priority value F from the cells' reports, by the paper's weighted mean or by a weighted median.

Every number F is made of is a peer's word: a priority device's probe loss (finite, unbounded) and accuracy
(in [0, 1]), its cell's sums of them. F decides which free device every cell admits (``|F - l_k| <= eps``), so
with the paper's mean (``priority_statistic = "mean"``) one lying priority device, or one lying cell, puts F
anywhere: 1e30 and every free device opts in, trains and is refused; F set to the misaligned devices' loss and
exactly those are admitted.

``priority_statistic = "median"``: each cell also reports its priority devices' probes as parallel lists
(``prio_devices``, ``prio_weights``, ``prio_losses``, ``prio_accuracies``; at most one entry per priority device of
that cell, which the cloud checks), and the cloud takes the weighted median of all of them (pooled over the
cells; the midpoint where the cumulative weight meets exactly half, so two equal-weight devices give their mean).
What it holds: while the priority weight held by liars (lying devices, and every priority device of a lying
cell) is less than half of the round's priority weight, F lies within the honest devices' range of values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..numbers import finite_number
from ..rejections import Rejected, RejectKind
from ..wire.payload import Payload

PROBE_LISTS = ("prio_devices", "prio_weights", "prio_losses", "prio_accuracies")


def weighted_median(pairs: Sequence[tuple[float, float]]) -> float | None:
    """The weighted median of ``(value, weight)`` pairs (weights >= 0): the smallest value at which the
    cumulative weight reaches half the total, the midpoint with the next value where it meets half exactly;
    ``None`` without positive weight. Weights are scaled by the largest, so no sum overflows."""
    pairs = sorted((v, w) for v, w in pairs if w > 0)
    if not pairs:
        return None
    top = max(w for _, w in pairs)
    scaled = [(v, w / top) for v, w in pairs]
    half = sum(w for _, w in scaled) / 2
    cumulative = 0.0
    for i, (v, w) in enumerate(scaled):
        cumulative += w
        if cumulative == half and i + 1 < len(scaled):
            return v / 2 + scaled[i + 1][0] / 2
        if cumulative >= half:
            return v
    return scaled[-1][0]  # rounding left the sum short of half: the largest value


def probe_lists(probes: Mapping[str, tuple[float, float, float]]) -> dict[str, list[Any]]:
    """A cell's report lists of its priority devices' ``device -> (weight, loss, accuracy)`` (sorted by device)."""
    devices = sorted(probes)
    return {
        "prio_devices": devices,
        "prio_weights": [probes[d][0] for d in devices],
        "prio_losses": [probes[d][1] for d in devices],
        "prio_accuracies": [probes[d][2] for d in devices],
    }


def check_probe_lists(meta: Mapping[str, Any], what: str, priority: frozenset[str] | None) -> None:
    """Refuse a report whose probe lists are malformed: of unequal lengths, naming a device twice or one that is
    no priority device (``priority`` None: not checked), holding a weight, loss or accuracy that is no finite
    number in its range, or weights whose sum is not the report's ``prio_weight`` (the sum the cloud bounds by the
    cell's devices)."""
    lists = [meta.get(k) for k in PROBE_LISTS]
    if not all(isinstance(x, list) for x in lists) or len({len(x) for x in lists}) != 1:  # type: ignore[arg-type]
        raise Rejected(RejectKind.MALFORMED, f"{what}: {', '.join(PROBE_LISTS)} must be lists of one length")
    devices, weights, losses, accuracies = lists
    assert isinstance(devices, list) and isinstance(weights, list)
    if len(set(map(str, devices))) != len(devices) or not all(isinstance(d, str) for d in devices):
        raise Rejected(RejectKind.MALFORMED, f"{what}: prio_devices must be distinct device ids")
    stranger = next((d for d in devices if priority is not None and d not in priority), None)
    if stranger is not None:
        raise Rejected(RejectKind.INCONSISTENT, f"{what}: prio_devices names {stranger[:40]!r}, no priority device")
    for key, values, hi in (("prio_weights", weights, None), ("prio_losses", losses, None)):
        _in_range(values, key, what, hi)  # type: ignore[arg-type]
    _in_range(accuracies, "prio_accuracies", what, 1.0)  # type: ignore[arg-type]
    total, claimed = sum(float(w) for w in weights), float(meta["prio_weight"])
    if abs(total - claimed) > 1e-9 * max(1.0, claimed):
        raise Rejected(
            RejectKind.INCONSISTENT, f"{what}: prio_weights add up to {total:g}, prio_weight says {claimed:g}"
        )


def _in_range(values: list[object], key: str, what: str, hi: float | None) -> None:
    for v in values:
        number = finite_number(v)
        if number is None or number < 0 or (hi is not None and number > hi):
            raise Rejected(
                RejectKind.BOUND, f"{what}: {key} must hold finite numbers in [0, {hi or 'inf'}], got {str(v)[:40]}"
            )


def _ratio(total: float, weight: float) -> float | None:
    """A cell's mean ``total / weight``, None where it is beyond the float range."""
    try:
        return finite_number(total / weight)
    except OverflowError:
        return None


def priority_figures(
    statistic: str, reports: Mapping[str, Payload]
) -> tuple[float | None, float | None, dict[str, Any]]:
    """``(loss, accuracy, by_cell)`` of the priority devices this round, by ``statistic``: the paper's weighted
    mean of the cells' sums, or the weighted median of the cells' probe lists; ``by_cell`` is what each cell said
    (its mean, or its devices' probes), for the round's record. Values beyond the float range are the caller's."""
    by_cell: dict[str, Any] = {}
    for cell, r in reports.items():
        m = r.meta
        if statistic == "median":
            by_cell[cell] = {
                d: [w, loss, acc]
                for d, w, loss, acc in zip(m["prio_devices"], m["prio_weights"], m["prio_losses"], m["prio_accuracies"])
            }
        elif m["prio_weight"]:
            w = m["prio_weight"]
            by_cell[cell] = {"weight": w, "loss": _ratio(m["prio_loss"], w), "accuracy": _ratio(m["prio_accuracy"], w)}
    if statistic == "median":
        probes = [p for entries in by_cell.values() for p in entries.values()]
        loss = weighted_median([(float(p[1]), float(p[0])) for p in probes])
        acc = weighted_median([(float(p[2]), float(p[0])) for p in probes])
        return loss, acc, by_cell
    weight = sum(r.meta["prio_weight"] for r in reports.values())
    loss = sum(r.meta["prio_loss"] for r in reports.values()) / weight if weight else None
    acc = sum(r.meta["prio_accuracy"] for r in reports.values()) / weight if weight else None
    return loss, acc, by_cell
