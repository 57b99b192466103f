"""A serving node's lines per job (``fedtier cloud|cell|agent --serve``): one as it takes a job, one as the job ends
for it, nothing per round. Logged at INFO on their own logger, which the serving commands print as plain lines at the
default level (:func:`show_job_lines`): a node's journal says which jobs it served, without ``-v`` and its rounds'
detail."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from .safe_text import SafeFormatter

job_log = logging.getLogger("fedtier.jobs")


class _Say(logging.Handler):
    def __init__(self, say: Callable[[str], None]) -> None:
        super().__init__()
        self.say = say
        self.setFormatter(SafeFormatter("%(message)s"))  # escaped as the CLI's other log lines are

    def emit(self, record: logging.LogRecord) -> None:
        self.say(self.format(record))


def show_job_lines(say: Callable[[str], None]) -> None:
    """Give :data:`job_log`'s lines to ``say`` alone (the CLI's console: one plain line each, as the node's start
    line; it replaces an earlier ``say``), whatever the CLI's level (``-vv`` keeps its DEBUG)."""
    for old in [h for h in job_log.handlers if isinstance(h, _Say)]:
        job_log.removeHandler(old)
    job_log.addHandler(_Say(say))
    job_log.propagate = False  # not again as a log record (the CLI's handler is the root's)
    if job_log.getEffectiveLevel() > logging.INFO:
        job_log.setLevel(logging.INFO)


def say_taken(who: str, job: str, rounds: int, resumed: bool = False) -> None:
    """``who`` (``cloud``, ``cell c0``, ``device c0-d0``) takes ``job`` of ``rounds`` rounds (the cloud: ``resumed``
    from its checkpoint)."""
    job_log.info(
        "%s: job %s taken (%s%s)", who, job, _rounds(rounds), ", resumed from its checkpoint" if resumed else ""
    )


def say_ended(
    who: str, job: str, how: str, reason: str | None = None, figures: Mapping[str, float] | None = None
) -> None:
    """``job`` ended for ``who``: ``how`` (finished, failed, cancelled, stopped), why if it was not finished, and
    the cloud's ``figures`` (:func:`cloud.jobs.final_figures`: rounds closed, last accuracy and loss)."""
    figures = figures or {}
    shown = [_rounds(int(figures["rounds"]))] if "rounds" in figures else []
    shown += [f"{key} {figures[key]:.4g}" for key in ("accuracy", "loss") if key in figures]
    said = f" ({', '.join(shown)})" if shown else ""
    job_log.info("%s: job %s %s%s%s", who, job, how, said, f": {reason}" if reason else "")


def _rounds(n: int) -> str:
    return f"{n} round{'' if n == 1 else 's'}"
