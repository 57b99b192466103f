"""``fedtier monitor`` where its output is no terminal (a file, a pipe to ``tee``, a systemd unit's journal, a CI
job's log): no live display, which redraws a frame in place and so writes nothing there until it ends, but a line
each time something changed, stamped with the wall-clock time and flushed at once."""

from __future__ import annotations

import re
import time

from rich.console import Console
from rich.text import Text

from protocols.round_text import nth, rounds_span

from .state import MonitorState, phase_name
from .view import cloud_line, jobs_line, link_line, summary_line

STAMP = "%Y-%m-%d %H:%M:%S"
_GAPS = re.compile(r" {3,}")  # where a part of a frame's line is left out
_SECONDS = re.compile(r"\d+(\.\d+)? s\b")  # how long a silence or an open round lasts: grows while nothing happens


def phase_text(state: MonitorState) -> str | None:
    """What the cloud's retained state says it does (its phase, round and reason), without how long it has."""
    s = state.states.get("cloud")
    if s is None:
        return None
    text = f"now {phase_name(s.get('phase'))}"
    if s.get("phase") == "waiting":
        text = f"now round {nth(s.get('round'))}: waiting"
    return text + (f": {s['reason']}" if s.get("reason") else "")


def log_lines(state: MonitorState, now: float) -> dict[str, str]:
    """The lines of the state, each under its topic: one is logged again when its text changed."""
    lines = {"run": f"fedtier monitor: {state.title} ({len(state.cells)} cells)"}
    link = link_line(state, now, log=True)
    if link is not None:
        lines["link"] = link.plain
    lines["cloud"] = cloud_line(state, now, log=True).plain
    phase = phase_text(state)
    jobs = jobs_line(state, now, log=True)
    if phase is not None:
        lines["now"] = phase
    if jobs is not None:
        lines["jobs"] = jobs.plain
    lines["cells"] = summary_line(state, now).plain
    return lines


class LineLog:
    """The lines of a followed run written to ``out`` as they change: the cloud's round, its phase, the jobs, the
    cells' summary, and each alert once when it is raised (``no alerts`` once they are all over)."""

    def __init__(self, out: Console) -> None:
        self.out = out
        self.said: dict[str, str] = {}
        self.alerts: set[str] = set()
        self.round: int | None = None  # the cloud's round of the last cloud line logged

    def update(self, state: MonitorState, now: float | None = None) -> None:
        """Log what changed in ``state`` since the last update."""
        now = time.time() if now is None else now
        lines = {key: _GAPS.sub("  ", line.strip()) for key, line in log_lines(state, now).items()}
        new = [
            self._skipped(state, line) if key == "cloud" else line
            for key, line in lines.items()
            if self.said.get(key) != line
        ]
        self.said = lines
        alerts = {_SECONDS.sub("N s", a): a for a in state.alerts(now)}
        new += [f"! {alerts[key]}" for key in alerts if key not in self.alerts]
        if self.alerts and not alerts:
            new.append("no alerts")
        self.alerts = set(alerts)
        stamp = time.strftime(STAMP, time.localtime(now))
        for line in new:
            self.out.print(Text(f"{stamp} {line}"), soft_wrap=True, highlight=False)

    def _skipped(self, state: MonitorState, line: str) -> str:
        """A new cloud line, saying which rounds closed since the one before it (it looks every ``--refresh``: a
        deployment closing two rounds a second had one in three left out, silently)."""
        rnd = state.cloud.round if state.cloud is not None else None
        before, self.round = self.round, rnd
        if rnd is None or before is None or rnd - before < 2:
            return line
        gap = rounds_span(before + 1, rnd - 1)
        return f"{line}  ({gap} closed since the line before: every round is in the run folder)"
