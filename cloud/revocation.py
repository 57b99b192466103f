"""Cells the federation revoked while a job runs (its signed roster, which ``cloud.service`` adopts): the steps
``cloud.server.CloudServer.revoke`` takes, as small pure functions: refuse what comes on a revoked cell's topic,
take the cell out of the open round, and say when too few cells are left for the job to go on."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from protocols.rejections import RejectKind

if TYPE_CHECKING:
    from protocols.answers import Answers
    from protocols.wire.messenger import Messenger

    from .parts import RoundCounts


def refused_revoked(revoked: Mapping[str, str], topic: str, messenger: Messenger) -> bool:
    """Whether ``topic`` is a revoked cell's report topic: then its message is refused (logged, listed in the next
    record as ``revoked``) before it is decoded."""
    cell = topic.split("/")[-2]
    if cell not in revoked:
        return False
    messenger.reject(topic, RejectKind.REVOKED, f"cell {cell} was {revoked[cell]}", cell)
    return True


def leave_round(answers: Answers, counts: RoundCounts, cells: Iterable[str]) -> None:
    """``cells`` leave the open round: no longer waited for, and what they answered (a report taken before the
    revocation, a failure) neither aggregated nor counted."""
    for cell in cells:
        answers.pending.discard(cell)
        answers.settled.discard(cell)
        answers.received.pop(cell, None)
        for counted in (counts.devices, counts.diverged, counts.failed):
            counted.pop(cell, None)
        counts.cells_failed.pop(cell, None)


def too_few_cells(
    cells: list[str], revoked: Mapping[str, str], min_cells: int, new: list[str], why: str = "revoked by the federation"
) -> str | None:
    """Why the job fails once ``new`` are out of it (``revoked`` holds every cell out, them included; ``why``: how
    they went): fewer of its ``cells`` left than ``min_cells`` (at most all of them) needs; ``None`` if enough are
    left."""
    left, needed = len(cells) - len(revoked), min(min_cells, len(cells))
    if left >= needed:
        return None
    remain = "no cell of the job remains" if left == 0 else f"{left} cells remain, runtime.min_cells is {needed}"
    return f"{', '.join(new)} {why}: {remain}"
