"""Why a tier refuses a message: a fixed vocabulary of kinds, and the exception roles raise.

Every refusal carries a :class:`RejectKind` next to its free-text reason. The kind travels into the
telemetry records (``protocols.records.Rejection.kind``) and becomes the ``reason`` label of the
Prometheus counters (``monitor.exporter``), so rewording a message never changes a metric; the text
is for people reading logs.
"""

from __future__ import annotations

from enum import StrEnum


class RejectKind(StrEnum):
    """What was wrong with a refused message (a bounded metric label value)."""

    SIGNATURE = "signature"
    """unsigned where a signature is required, a bad signature, or a signature of another session"""
    UNKNOWN_SENDER = "unknown_sender"
    """signed by (or claiming) a node this tier has no key or membership for"""
    REVOKED = "revoked"
    """signed by (or claiming) a node the federation revoked (the signed roster lists it): refused from then on"""
    WRONG_SENDER = "wrong_sender"
    """a known sender on a topic, cell or run that is not its own (or not the one it may use)"""
    REPLAY = "replay"
    """a second copy of something already received (sent twice, a second roster or request)"""
    STALE = "stale"
    """for an old round, an old model version, or a version from the future"""
    LATE = "late"
    """the first answer of a party to the round before, which closed without it (deadline, quorum): expected of
    stragglers, so no alert; only a clean one: an answer whose content fails a check is filed under that check's
    kind (``inconsistent``, ``non_finite``...), whenever it comes"""
    NOT_PLANNED = "not_planned"
    """from a device or cell this round did not plan"""
    OUT_OF_ORDER = "out_of_order"
    """valid on its own but not in this phase of the protocol (e.g. secure aggregation's steps)"""
    OVERSIZED = "oversized"
    """larger than the bound on a message, a record or a field"""
    MALFORMED = "malformed"
    """cannot be decoded: bad framing, header, metadata, or a field of the wrong type"""
    SHAPE = "shape"
    """decodes, but the tensors, dtypes or shapes are not the expected ones"""
    NON_FINITE = "non_finite"
    """NaN or infinite values"""
    BOUND = "bound"
    """a number outside its allowed range (a weight above the device's bound, a negative scale...)"""
    INCONSISTENT = "inconsistent"
    """fields that contradict each other or this round's plan (index sets, layouts, neighbour sets)"""
    FAILED = "failed"
    """the sender reports its own failure (training failed)"""
    INVALID = "invalid"
    """none of the above (also: records written before kinds existed)"""


class Refusal(ValueError):
    """A refused message: ``kind`` says what was wrong (a :class:`RejectKind`), the text says it for people.

    Base of :class:`Rejected` (raised by roles) and ``protocols.wire.envelope.WireError`` (raised by the wire).
    """

    def __init__(self, kind: RejectKind, reason: str) -> None:
        if not isinstance(kind, RejectKind):  # a call written before kinds existed: Rejected("reason")
            raise TypeError(f"{type(self).__name__} needs a RejectKind first, got {kind!r}")
        super().__init__(reason)
        self.kind = kind

    def __reduce__(self) -> tuple[type[Refusal], tuple[RejectKind, str]]:
        return type(self), (self.kind, str(self))


class Rejected(Refusal):
    """A message a role refuses (wrong shape, non-finite values, wrong round...). Logged, dropped."""


class OffPlan(Rejected):
    """A refusal of what does not fit the current round's plan (HIST's partition, the layout of the other masked
    results), not of the message alone: a late answer (``protocols.answers``), judged against the round after its
    own, is not refused for it."""


def kind_of(exc: BaseException, default: RejectKind = RejectKind.INVALID) -> RejectKind:
    """The kind a refusal carries, or ``default`` for another exception (e.g. a plain ``ValueError``)."""
    return exc.kind if isinstance(exc, Refusal) else default
