"""Collecting one answer per planned party for the current round: the rule the cell applies to device
results and the cloud to cell reports, so both refuse the same things for the same reasons."""

from __future__ import annotations

from collections.abc import Callable

from .rejections import OffPlan, Rejected, RejectKind
from .round_text import round_key_text
from .wire.payload import Payload

CONTENT = frozenset(
    {
        RejectKind.SHAPE,
        RejectKind.NON_FINITE,
        RejectKind.BOUND,
        RejectKind.MALFORMED,
        RejectKind.OVERSIZED,
        RejectKind.INCONSISTENT,
    }
)
"""Refusals of what an answer holds, whatever round it is for (the others judge it against the current round, and
so does an :class:`~protocols.rejections.OffPlan` refusal of one of these kinds)."""


class Answers:
    """Answers of the parties planned for round ``key`` (e.g. ``(round, edge_round)``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "device" or "cell", for messages
        self.key: tuple[int, ...] | None = None
        self.pending: set[str] = set()
        self.received: dict[str, Payload] = {}
        self.settled: set[str] = set()
        self.closed: tuple[int, ...] | None = None  # the round closed last, and whom it closed without
        self.cut_off: set[str] = set()

    def open(self, key: tuple[int, ...], planned: list[str]) -> None:
        self.key, self.pending, self.received, self.settled = key, set(planned), {}, set()

    def close(self) -> None:
        """Close the round; the parties still pending were cut off (deadline, quorum): their answers to it,
        when they come, are refused as :attr:`RejectKind.LATE` (expected), not as stale."""
        if self.key is not None:
            self.closed, self.cut_off = self.key, set(self.pending)
        self.key = None

    @property
    def is_open(self) -> bool:
        return self.key is not None

    def offer(
        self,
        who: str,
        sender: str,
        key: tuple[int, ...],
        payload: Payload | None,
        check: Callable[[str, Payload], None],
    ) -> Rejected | None:
        """Take ``payload`` from ``who`` (the party named by the topic; ``sender`` signed the header);
        ``payload=None`` settles ``who`` (it answered, e.g. that its training diverged, with nothing to
        aggregate: no longer pending, not in ``received``).

        Returns ``None`` when taken or when it is a repeat of a taken answer (counted once), else why it is
        refused (a :class:`Rejected`, not raised).
        """
        wrong = sender_refusal(self.kind, who, sender)
        if wrong is not None:
            return wrong
        if key != self.key and key == self.closed and who in self.cut_off:
            return late_refusal(self.kind, who, key, payload, check, self.cut_off)
        if key != self.key:
            now = round_key_text(self.key) if self.key else "between rounds"
            return Rejected(RejectKind.STALE, f"stale answer for round {round_key_text(key)} (now {now})")
        if who in self.received or who in self.settled:
            return None
        if who not in self.pending:
            return Rejected(RejectKind.NOT_PLANNED, f"{self.kind} {who} was not planned for this round")
        if payload is None:  # settle: answered, with nothing to aggregate
            self.settled.add(who)
            self.pending.discard(who)
            return None
        try:
            check(who, payload)
        except Rejected as exc:
            return exc
        self.received[who] = payload
        self.pending.discard(who)
        return None


def late_refusal(
    kind: str,
    who: str,
    key: tuple[int, ...],
    payload: Payload | None,
    check: Callable[[str, Payload], None],
    cut_off: set[str],
) -> Rejected:
    """Why the first answer of ``who`` to round ``key``, closed without it, is refused: :attr:`RejectKind.LATE`
    (honest, too slow), unless its content fails ``check``: then the kind of that check (a broken, self-contradicting
    or hostile answer alerts whenever it comes); a second one is stale. ``check`` judges against the current round:
    only its refusals of the content count (:data:`CONTENT`, not :class:`~protocols.rejections.OffPlan`)."""
    cut_off.discard(who)
    refused = content_refusal(who, payload, check)
    if refused is not None:
        return refused
    return Rejected(
        RejectKind.LATE, f"late answer of {kind} {who} for round {round_key_text(key)}, which closed without it"
    )


def content_refusal(who: str, payload: Payload | None, check: Callable[[str, Payload], None]) -> Rejected | None:
    """Why ``check`` refuses what ``payload`` of ``who`` holds, whatever round it answers (:data:`CONTENT`, not an
    :class:`~protocols.rejections.OffPlan` refusal: ``check`` judges against the current round); ``None`` if not."""
    if payload is not None:
        try:
            check(who, payload)
        except Rejected as exc:
            if exc.kind in CONTENT and not isinstance(exc, OffPlan):
                return exc
    return None


def sender_refusal(kind: str, who: str, sender: str) -> Rejected | None:
    """Why a message on the topic of ``who`` (a ``kind``: device, cell) that ``sender`` signed is refused: another
    party published it; ``None`` when ``who`` sent it."""
    if sender != who:
        return Rejected(RejectKind.WRONG_SENDER, f"sender {sender!r} published on the topic of {kind} {who!r}")
    return None
