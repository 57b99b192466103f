"""Collecting one answer per planned party for the current round: the rule the cell applies to device
results and the cloud to cell reports, so both refuse the same things for the same reasons."""

from __future__ import annotations

from collections.abc import Callable

from .rejections import Rejected, RejectKind
from .wire.payload import Payload


class Answers:
    """Answers of the parties planned for round ``key`` (e.g. ``(round, edge_round)``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "device" or "cell", for messages
        self.key: tuple[int, ...] | None = None
        self.pending: set[str] = set()
        self.received: dict[str, Payload] = {}
        self.settled: set[str] = set()

    def open(self, key: tuple[int, ...], planned: list[str]) -> None:
        self.key, self.pending, self.received, self.settled = key, set(planned), {}, set()

    def close(self) -> None:
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
        if key != self.key:
            now = ".".join(map(str, self.key)) if self.key else "between rounds"
            return Rejected(RejectKind.STALE, f"stale answer for round {'.'.join(map(str, key))} (now {now})")
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


def sender_refusal(kind: str, who: str, sender: str) -> Rejected | None:
    """Why a message on the topic of ``who`` (a ``kind``: device, cell) that ``sender`` signed is refused: another
    party published it; ``None`` when ``who`` sent it."""
    if sender != who:
        return Rejected(RejectKind.WRONG_SENDER, f"sender {sender!r} published on the topic of {kind} {who!r}")
    return None
