"""A serving node's lines per job (``fedtier cloud|cell|agent --serve``): one as it takes a job, one as the job ends
for it, nothing per round. Logged at INFO on their own logger, which the serving commands print as plain lines at the
default level (:func:`show_job_lines`): a node's journal says which jobs it served, without ``-v`` and its rounds'
detail."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from .numbers import finite_number, is_count
from .safe_text import SafeFormatter

job_log = logging.getLogger("fedtier.jobs")


class _Say(logging.Handler):
    def __init__(self, say: Callable[[str], None]) -> None:
        super().__init__()
        self.say = say
        self.setFormatter(SafeFormatter("%(message)s"))  # escaped as the CLI's other log lines are

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.say(self.format(record))
        except Exception:  # as every logging handler: a line that cannot be said never stops the node saying it
            self.handleError(record)


def show_job_lines(say: Callable[[str], None]) -> None:
    """Give :data:`job_log`'s lines to ``say`` alone (the CLI's console: one plain line each, as the node's start
    line; it replaces an earlier ``say``), whatever the CLI's level (``-vv`` keeps its DEBUG)."""
    for old in [h for h in job_log.handlers if isinstance(h, _Say)]:
        job_log.removeHandler(old)
    job_log.addHandler(_Say(say))
    job_log.propagate = False  # not again as a log record (the CLI's handler is the root's)
    # its own level, INFO or the root's DEBUG of now: left unset, it followed the root's level set later
    job_log.setLevel(min(logging.INFO, job_log.getEffectiveLevel()))


def say_taken(who: str, job: str, rounds: int, resumed: str | None = None) -> None:
    """``who`` (``cloud``, ``cell c0``, ``device c0-d0``) takes ``job`` of ``rounds`` rounds, ``resumed`` from what it
    names if it resumes the job (the cloud: ``its checkpoint``; a cell restarted mid-job: ``its journal``)."""
    job_log.info("%s: job %s taken (%s%s)", who, job, _rounds(rounds), f", resumed from {resumed}" if resumed else "")


def say_ended(
    who: str, job: str, how: str, reason: str | None = None, figures: Mapping[str, Any] | None = None
) -> None:
    """``job`` ended for ``who``: ``how`` (finished, failed, cancelled, stopped), why if it was not finished, and
    the cloud's ``figures`` (:func:`cloud.jobs.final_figures`: rounds closed, last accuracy and loss)."""
    said = figures_text(figures or {})
    job_log.info("%s: job %s %s%s%s", who, job, how, f" ({said})" if said else "", f": {reason}" if reason else "")


def job_figures(listed: Mapping[str, Any]) -> dict[str, str]:
    """How well an ended job did, as the cloud lists it (``cloud.jobs.final_figures``), what it has of its rounds,
    accuracy and loss, written out (``{"rounds": "20", "accuracy": "0.9220", "loss": "0.3674"}``); other values are
    left out."""
    said = {"rounds": str(rounds)} if is_count(rounds := listed.get("rounds")) else {}
    if (accuracy := finite_number(listed.get("accuracy"))) is not None:
        said["accuracy"] = f"{accuracy:.4f}"
    if (loss := finite_number(listed.get("loss"))) is not None:
        said["loss"] = f"{loss:.4g}"
    return said


def figures_text(listed: Mapping[str, Any]) -> str:
    """:func:`job_figures` in words: ``20 rounds, accuracy 0.9220, loss 0.3674`` (``""``: none)."""
    said = job_figures(listed)
    return ", ".join(_rounds(int(v)) if k == "rounds" else f"{k} {v}" for k, v in said.items())


def _rounds(n: int) -> str:
    return f"{n} round{'' if n == 1 else 's'}"
