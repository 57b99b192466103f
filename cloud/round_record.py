"""A closed cloud round's record (``protocols.records.RoundRecord``: what closed it, who answered, the counts,
the evaluation, the role's outcome) and the verdicts it carries: a global model that diverged, a job that
stalled (each fails the job after the round). The cloud server drives it through :class:`Host`."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from protocols.numbers import finite_number
from protocols.records import RoundRecord

from .parts import RoundCounts, drop_non_finite

if TYPE_CHECKING:
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


def divergence(evaluation: dict[str, float], rnd: int) -> tuple[str | None, str | None]:
    """Drop the non-finite numbers of the global model's ``evaluation`` (in place); if there were any, what was
    dropped (for the record) and why the job fails after round ``rnd`` (no later round can bring a diverged
    model back); ``(None, None)`` otherwise."""
    why = drop_non_finite(evaluation)
    if why is None:
        return None, None
    log.error(
        "round %d: the global model diverged (%s): the job fails after this round (a learning rate too large?)",
        rnd,
        why,
    )
    return why, f"the global model diverged at round {rnd} ({why})"


def stall(watch: StallWatch, rnd: int, reported: list[str], counts: RoundCounts) -> str | None:
    """Count round ``rnd`` in ``watch`` (no cell answered, or every device that answered failed or diverged);
    after ``max_stalled_rounds`` of them in a row, why the job fails after this round."""
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
    )


def end_figures(history: list[dict[str, Any]]) -> dict[str, float]:
    """The job's last figures for its retained end state (``protocols.state``): its latest accuracy and last loss,
    where finite (a monitor started after the job ended has no round record: telemetry is not retained)."""
    accuracy = next((r["accuracy"] for r in reversed(history) if "accuracy" in r), None)
    figures = {"accuracy": finite_number(accuracy), "loss": finite_number(history[-1].get("loss") if history else None)}
    return {k: v for k, v in figures.items() if v is not None}
