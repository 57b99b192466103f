"""A closed cloud round's record (``protocols.records.RoundRecord``: what closed it, who answered, the counts,
the evaluation, the role's outcome) and the verdicts it carries: a global model that diverged, a job that
stalled (each fails the job after the round). The cloud server drives it through :class:`Host`."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from protocols.divergence import largest, nonfinite, update_norm
from protocols.numbers import finite_number
from protocols.records import RoundRecord
from protocols.round_text import nth
from protocols.wire.payload import Payload

from .parts import RoundCounts, drop_non_finite

if TYPE_CHECKING:
    from protocols.algorithms.base import CloudRole
    from protocols.algorithms.outcome import Outcome
    from protocols.failures import StallWatch
    from protocols.transport.base import EventLoop

    from .telemetry import CloudTelemetry

log = logging.getLogger("fedtier.cloud")


class Host(Protocol):
    """What a round's record needs of its cloud server (``cloud.server.CloudServer`` is one)."""

    run: str
    round: int
    rounds: int
    planned: list[str]
    counts: RoundCounts
    cumulative: dict[str, int]
    revoked: dict[str, str]
    loop: EventLoop
    telemetry: CloudTelemetry
    role: CloudRole


def round_record(
    cloud: Host,
    why: str,
    reported: list[str],
    absent: list[str],
    outcome: Outcome,
    evaluation: dict[str, float],
    **verdicts: str | None,
) -> dict[str, Any]:
    """The round's record: what closed it, who answered, the counts, the evaluation, the role's outcome
    (robust aggregation's exclusions, privacy spent) and the ``verdicts`` (``diverged``, ``failed``); the
    rejections it lists are counted afresh from now on."""
    epsilon = outcome.epsilon  # differential privacy: spent so far
    rejected, rejected_more = cloud.telemetry.take_rejections()
    c = cloud.counts
    return RoundRecord(
        run=cloud.run,
        round=cloud.round,
        rounds=cloud.rounds,
        closed_by=why,
        cells_planned=cloud.planned,
        cells_reported=reported,
        cells_absent=absent,
        cells_failed=c.cells_failed or None,
        cells_revoked=dict(cloud.revoked) or None,
        devices=c.devices,
        devices_diverged=c.diverged or None,
        devices_failed=c.failed or None,
        failures=c.failures or None,
        rejected=rejected,
        rejected_more=rejected_more,
        bytes=dict(c.bytes),
        bytes_resent=dict(c.resent) or None,
        cumulative_bytes=dict(cloud.cumulative),
        clock_start_s=round(c.t0, 6),
        clock_s=round(cloud.loop.now(), 6),
        **evaluation,
        excluded=outcome.excluded or None,  # robust aggregation: cells left out, why
        epsilon=epsilon if epsilon is not None and np.isfinite(epsilon) else None,
        epsilon_by_party=outcome.epsilon_by_party,  # ... against each party
        epsilon_basis=outcome.epsilon_basis,  # ... and why
        **verdicts,
        metrics=dict(outcome.metrics),
        duration_s=round(time.perf_counter() - c.wall0, 6),
        time=round(time.time(), 3),
    ).to_dict()


Updates = Iterable[tuple[str, Mapping[str, np.ndarray]]]
"""The updates a model aggregate took: ``(sender, its tensors)``, a sender possibly more than once."""


def divergence(
    cloud: Host, evaluation: dict[str, float], updates: Updates = (), unit: str = "round"
) -> tuple[str | None, str | None]:
    """Drop the non-finite numbers of the global model's ``evaluation`` (in place); if there were any, or the model's
    parameters hold one (checked every ``unit``, evaluated or not: one pass of the model), what was wrong (for the
    record) and why the job fails after this ``unit`` (no later round can bring a diverged model back): with the
    contributors of the aggregate that made it, the largest update norms first, and the devices their reports name so
    (:func:`blame`), since a node sending huge (finite) values overflows the model as a learning rate too large does;
    ``(None, None)`` otherwise."""
    why = drop_non_finite(evaluation) or nonfinite(Payload({}, dict(cloud.role.global_params())))
    if why is None:
        return None, None
    blamed = blame(updates, unit, cloud.counts.largest)
    at = nth(cloud.round) if unit == "round" else cloud.round  # (an asynchronous model version: its number)
    failure = f"the global model diverged at {unit} {at} ({why}){blamed}"
    log.error("%s: the job fails after this %s", failure, unit)
    return why, failure


def blame(updates: Updates, unit: str, devices: Mapping[str, Mapping[str, int]]) -> str:
    """What a diverged model's failure says of its aggregate's ``updates``: how many senders, the
    :data:`~protocols.divergence.MAX_BLAMED` largest update norms (:func:`~protocols.divergence.update_norm`; one per
    sender, its largest), each with the devices of the largest update norms its reports named (``devices``: cell ->
    device -> the norm's decimal exponent, ``largest_updates``: the cell's word), and what to do about it."""
    norms: dict[str, float] = {}
    for sender, tensors in updates:
        norms[sender] = max(norms.get(sender, 0.0), update_norm(tensors))
    cells = f"{len(norms)} cell" + ("s" if len(norms) != 1 else "")
    named = ", ".join(f"{c} {n:.3g}{_its_devices(c, devices.get(c))}" for c, n in largest(norms))
    took = f"; largest update norms of its {cells}: {named}" if norms else ""
    robust = (
        "robust aggregation leaves one out: algorithm.cloud_aggregator or cell_aggregator = median, trimmed_mean, krum"
        if unit == "round"
        else "robust aggregation needs mode = sync"
    )
    return f"{took}: a node sending huge updates (revoke it; {robust}) or a learning rate too large?"


def _its_devices(cell: str, exponents: Mapping[str, int] | None) -> str:
    """The devices ``cell``'s reports named of its largest updates, said to be its word (a lying cell can name any
    of its own devices; :meth:`RoundCounts.count` took no other cell's)."""
    if not exponents:
        return ""
    return f" (its devices: {', '.join(f'{d} ~1e{e:+03d}' for d, e in largest(exponents))}, as {cell} reports)"


def stall(
    watch: StallWatch, rnd: int, reported: list[str], counts: RoundCounts, last: bool, telemetry: CloudTelemetry
) -> str | None:
    """Count round ``rnd`` in ``watch`` (no cell answered, or every device that answered failed or diverged);
    after ``max_stalled_rounds`` of them in a row, or at the job's ``last`` round if no round made progress, why
    the job fails after this round (with the messages the cloud refused in the round, per kind, as ``telemetry``
    lists them for its record, where no cell answered: a cell's report the cloud refused came, and was not taken)."""
    aggregated = sum(counts.devices.get(c, 0) for c in reported)
    return watch.observe(
        rnd,
        len(reported),
        counts.expected,  # cell participation may leave a round to fewer cells, or none
        aggregated,
        counts.failures,
        sum(counts.diverged.values()),
        counts.unmet,
        counts.late,
        counts.offline if not counts.online else 0,  # devices drawn offline while others are online: no stall
        last=last,
        rejected=counts.rejected,
        refused=Counter(r["kind"] for r in telemetry.rejected),
    )


def end_figures(history: list[dict[str, Any]]) -> dict[str, float]:
    """The job's last figures for its retained end state (``protocols.state``): its latest accuracy and last loss,
    where finite (a monitor started after the job ended has no round record: telemetry is not retained)."""
    accuracy = next((r["accuracy"] for r in reversed(history) if "accuracy" in r), None)
    figures = {"accuracy": finite_number(accuracy), "loss": finite_number(history[-1].get("loss") if history else None)}
    return {k: v for k, v in figures.items() if v is not None}
