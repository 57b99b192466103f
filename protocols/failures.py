"""Failures that end things: a task a device could not run, a bug in a tier's handler, a job that stalls.

- A device whose task raised answers with a small "failed" result (``meta = {"failed": reason}``, no
  tensors) instead of leaving its cell to wait out the deadline: the cell records it per reason, counts the
  device as answered and keeps it out of the aggregate (as a diverged device, ``protocols.divergence``).
- A cell whose handler raised (a bug) answers its round with a "failed" report of the same shape: the cloud
  fails the job with that reason (or leaves the cell out: ``runtime.fail_on_cell_failure``). An asynchronous
  cell that refuses to work in a job (restarted without its journal) says so with a "failed" push marked
  ``refused``: no bug, the cloud leaves it out.
- :func:`guarded` wraps a tier's message handlers and timers: an exception is logged with its traceback
  and handed to the tier's ``fail``, never left to leave a round open forever.
- :class:`StallWatch` is the cloud's rule for a job that cannot make progress (``runtime.max_stalled_rounds``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .jsonl import StorageError
from .round_text import rounds_span
from .wire.payload import Payload

log = logging.getLogger("fedtier.failures")

KEY = "failed"
REFUSED = "refused"  # meta flag of a cell's "failed" answer that is a refusal to work, not a bug
MAX_REASON = 200  # characters of a reason kept from another node
MAX_REASONS = 8  # distinct reasons counted per record; the rest under OTHER
OTHER = "other"


def failed_payload(reason: str, refused: bool = False) -> Payload:
    """The answer of a node that could not do its part (a device's task, a cell's round); ``refused``: it will
    not (an asynchronous cell restarted without its journal), which is no bug (:func:`is_refusal`)."""
    meta: dict[str, object] = {KEY: reason[:MAX_REASON] or "failed"}
    if refused:
        meta[REFUSED] = True
    return Payload(meta=meta)


def failed_reason(payload: Payload) -> str | None:
    """The reason of a "failed" answer (``None`` for any other payload)."""
    reason = payload.meta.get(KEY)
    if isinstance(reason, str) and not payload.tensors:
        return reason[:MAX_REASON] or "failed"
    return None


def is_refusal(payload: Payload) -> bool:
    """Whether a "failed" answer says its node refuses to work (``failed_payload(..., refused=True)``)."""
    return payload.meta.get(REFUSED) is True


def count_reasons(reasons: Mapping[str, str] | list[str], limit: int = MAX_REASONS) -> dict[str, int]:
    """``reason -> how many``, for at most ``limit`` distinct reasons (the rest under ``"other"``): a bounded
    record whatever the reasons hostile devices make up."""
    counts: dict[str, int] = {}
    for why in reasons.values() if isinstance(reasons, Mapping) else reasons:
        key = why if why in counts or len(counts) < limit else OTHER
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def merge_counts(into: dict[str, int], more: Any, limit: int = MAX_REASONS) -> None:
    """Add a reported ``reason -> count`` map (from another node: checked, bounded) to ``into``."""
    if not isinstance(more, dict):
        return
    for why, n in list(more.items())[: limit + 1]:
        if not isinstance(why, str) or not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            continue
        why = why[:MAX_REASON]
        key = why if why in into or len(into) < limit else OTHER
        into[key] = into.get(key, 0) + min(n, 1 << 31)


def guarded(fn: Callable[..., None], fail: Callable[[str], None], what: str) -> Callable[..., None]:
    """``fn`` as a handler or timer callback whose exception (a bug) is logged with its traceback and
    passed to ``fail`` as a reason, instead of vanishing into the event loop's log. A run file that could not be
    written (:class:`~protocols.jsonl.StorageError`: a full disk) is no bug: its one line names the file, no
    traceback."""

    def call(*args: Any) -> None:
        try:
            fn(*args)
        except StorageError as exc:
            log.error("%s: %s", what, exc.strerror)
            fail(f"{what}: {exc.strerror}"[: MAX_REASON * 2])
        except Exception as exc:
            log.exception("%s raised", what)
            fail(f"{what} raised {type(exc).__name__}: {exc}"[: MAX_REASON * 2])

    return call


class CallerHook:
    """A caller's callback run inside a node's handler (``on_round`` of ``sim.launcher.SimHierarchy`` and
    ``sim.emulation.Emulation``): what it raises fails the job there (:func:`guarded`) and is kept, so that the
    caller's ``run()`` raises it again (:meth:`reraise`). Before, a test's assertion in its callback only failed the
    job, which a test that read nothing of the result never saw."""

    def __init__(self, fn: Callable[[dict[str, Any]], None]) -> None:
        self.fn = fn
        self.raised: BaseException | None = None

    @classmethod
    def of(cls, fn: Callable[[dict[str, Any]], None] | None) -> CallerHook | None:
        return None if fn is None else cls(fn)

    def __call__(self, record: dict[str, Any]) -> None:
        try:
            self.fn(record)
        except BaseException as exc:
            if self.raised is None:
                self.raised = exc
            raise

    def reraise(self) -> None:
        """Raise what the callback raised first, if it raised."""
        if self.raised is not None:
            raise self.raised


@dataclass
class StallWatch:
    """Counts the cloud rounds in a row that made no progress; past ``max_rounds`` of them the job fails.

    A round makes no progress when fewer than ``min_cells`` cells reported (no cell at all, by default), or
    when devices answered and every one failed its task or diverged, or every device tasked missed the device
    deadline, or every device that was to take part was offline and no cell had a device online (nothing aggregated
    anywhere). A round whose devices were merely not drawn, or drawn offline while others are online, is not a
    stall: participation may leave a round empty. (An offline fleet made every round at once with no device, and
    "finished" the job, exit 0, at the last model it trained.)"""

    max_rounds: int = 3
    min_cells: int = 1
    stalled: int = 0
    first: int = 0  # the first round of the current stall

    def observe(
        self,
        rnd: int,
        reported: int,
        cells: int,
        aggregated: int,
        failed: Mapping[str, int],
        diverged: int,
        unmet: Mapping[str, int] | None = None,
        late: int = 0,
        offline: int = 0,
        last: bool = False,
        rejected: Mapping[str, int] | None = None,
        refused: Mapping[str, int] | None = None,
    ) -> str | None:
        """Count round ``rnd`` (cells that reported, cells of the job, devices aggregated, failed devices per
        reason, diverged devices, devices left out per unmet requirement, devices tasked that never answered
        in time, devices taking part that were offline where no cell had one online, devices tasked whose every
        answer was refused, per reason; messages this tier refused, per kind: a cell's report among them); the
        reason the job fails,
        once it stalled ``max_rounds`` rounds in a row, or at its ``last`` round when none of its rounds made
        progress (a job of fewer rounds than ``max_rounds`` whose devices all failed "finished", exit 0)."""
        needed = min(self.min_cells, cells)
        why = None
        if reported < needed:
            why = "no cell answered" if reported == 0 else f"fewer than {needed} cells answered"
            if refused:  # e.g. reports the decoder or the role's check refused: they came, and were not taken
                why += " (messages refused: " + ", ".join(f"{n} {kind}" for kind, n in sorted(refused.items())) + ")"
        elif aggregated == 0 and (failed or diverged):
            parts = [f"{n} failed: {r}" for r, n in failed.items()] + ([f"{diverged} diverged"] if diverged else [])
            why = "every device that answered failed or diverged (" + "; ".join(parts) + ")"
        elif aggregated == 0 and rejected:  # e.g. a role's check that refuses what its devices send
            parts = [f"{n} rejected: {r}" for r, n in rejected.items()] + ([f"{late} late"] if late else [])
            why = "no device's answer was taken (" + "; ".join(parts) + ")"
        elif aggregated == 0 and late:  # e.g. a device deadline shorter than the devices' training
            why = f"no device answered within the device deadline ({late} tasked, every one late)"
        elif aggregated == 0 and unmet:  # nobody could take part: the job asks what no device has
            why = "no device meets the job's requirements (" + "; ".join(f"{n}: {r}" for r, n in unmet.items()) + ")"
        elif aggregated == 0 and offline:  # every device that was to take part is down
            why = f"no device online ({offline} taking part, every one offline)"
        if why is None:
            self.stalled = 0
            return None
        if self.stalled == 0:
            self.first = rnd
        self.stalled += 1
        if self.stalled < self.max_rounds and not (last and self.first == 0):
            return None
        return f"{why} in {rounds_span(self.first, rnd)}"
