"""What ``fedtier monitor`` knows about a run: a pure state folded from telemetry records.

:class:`MonitorState` folds cell aggregation records and cloud round records (``protocols.records``),
plus liveness statuses and the nodes' retained current states, into one :class:`CellView` per cell;
:meth:`MonitorState.alerts` names the cells that fell silent for longer than their deadline, whose
participation dropped, that had results rejected or devices whose training diverged, and those the federation
revoked (the cloud's records name them: a revoked cell is shown revoked, never offline or silent). No I/O here;
``monitor/view.py`` draws it.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from protocols.numbers import finite_number
from protocols.records import BUFFER_FULL, TASKED, BadLine, BadLines, CellRecord, Record, Rejection, RoundRecord
from protocols.rejections import RejectKind
from protocols.round_text import nth, nth_edge
from protocols.status import IDLE, idle_deadline

STATES = ("silent", "offline", "drop", "revoked", "waiting", "idle", "ok", "ended")
"""A cell's state in the monitor, most serious first (``idle``: a long-lived cell up between jobs; ``revoked``: the
federation revoked it, out of the job for good; ``ended``: the run ended and none of the cell's records came, e.g. a
monitor opened after the job: telemetry is not retained)."""
GROUP_ALERTS = 5  # more cells than this with the same alert: one line for all of them
MAX_REVOKED_NAMED = 1000  # revoked devices a cell's view keeps the names of (its alert says "or more" past them)
Alert = tuple[float, str, str]
"""One cell's alert: (sort key, the worst first; the cell; the line)."""
CELL_ALERTS = (
    "silent",
    "offline",
    "revoked",
    "failed",
    "with revoked devices",
    "with a participation drop",
    "with rejected results",
    "with diverged devices",
)
"""The kinds of a cell's alerts, in the order they are listed."""


@dataclass
class CellView:
    """The latest known state of one cell."""

    cell: str
    last: CellRecord | None = None
    cut_off: frozenset[str] = frozenset()  # devices the record before ``last`` closed without (deadline, quorum)
    last_seen: float | None = None  # wall clock of the last record (or status)
    online: bool | None = None  # its status: online or idle (True), offline (False), none yet (None)
    idle: bool = False  # its status says idle: up, serving no job
    idle_until: float | None = None  # an idle status older than this (its heartbeat missed) counts as offline
    revoked: str | None = None  # why the federation revoked it (the cloud's round records: ``cells_revoked``)
    failed: str | None = None  # why it failed or refused to work (the cloud's round records: ``cells_failed``)
    failed_at: int = -1  # the newest cloud record listing it in ``cells_failed``
    reported_at: int = -1  # the newest cloud record listing it in ``cells_reported`` (after failed_at: back in the job)
    absent_at: int = -1  # the newest cloud record listing it in ``cells_absent`` (planned, and it did not answer)
    devices_revoked: set[str] = field(default_factory=set)  # its devices its records say were absent as revoked
    records: int = 0
    rejected_total: int = 0
    participation: deque[tuple[float, float | None]] = field(default_factory=lambda: deque(maxlen=11))  # (, when)

    @property
    def round(self) -> int | None:
        return self.last.round if self.last else None


def job_entries(listed: list) -> list[dict]:
    """The well-formed entries of a cloud's job list (``fedtier jobs``): ``job`` and ``state`` strings, ``reason`` a
    string, ``ended`` a finite time or none; others are left out (the list is the cloud's word, a frame must not
    raise on it)."""
    out = []
    for j in listed:
        if not isinstance(j, dict) or not isinstance(j.get("job"), str) or not isinstance(j.get("state"), str):
            continue
        ended = finite_number(j.get("ended"))
        reason = j.get("reason") if isinstance(j.get("reason"), str) else ""
        out.append({"job": j["job"], "state": j["state"], "reason": reason, "ended": ended})
    return out


@dataclass
class MonitorState:
    """Everything the monitor knows about one run.

    ``drop_ratio``: alert when a cell's latest participation (answered / devices of the cell) is below
    this fraction of its mean over the previous (up to 10) records. ``deadline``: seconds of silence before a cell is
    flagged, overriding the ``deadline_s`` its records carry.
    """

    run: str | None = None
    drop_ratio: float = 0.75
    deadline: float | None = None
    cells: dict[str, CellView] = field(default_factory=dict)
    cloud: RoundRecord | None = None
    cloud_seen: float | None = None
    accuracy: list[tuple[int, float]] = field(default_factory=list)  # the latest ACCURACY_KEPT rounds, by round
    bad: BadLines = field(default_factory=BadLines)  # bounded: a publisher of garbage cannot grow it
    finished: bool = False
    states: dict[str, dict] = field(default_factory=dict)  # node -> its current state (protocols.state)
    revoked: dict[str, str] = field(default_factory=dict)  # node -> why, from round records or the signed roster
    jobs: list[dict] = field(default_factory=list)  # a federation's jobs, from the cloud's job list (job_entries)
    cell_folder: list[dict] = field(default_factory=list)  # a cell's own job folder: its job records (runfiles)
    link_lost: float | None = None  # live: since when the monitor's own broker connection is down (None: up)
    link_losses: int = 0  # live: how many times it went down
    folder: str | None = None  # the run folder it follows (None: live telemetry)
    folder_missing: bool = False  # that folder does not exist (yet)
    _max_round: int | None = None

    # ------------------------------------------------------------------ feeding
    def add(self, record: Record, received: float | None = None) -> None:
        """Fold one record in; ``received`` is when it arrived (default: the record's own time)."""
        seen = received if received is not None else record.time
        if self.run is None:
            self.run = record.run
        if isinstance(record, CellRecord):
            view = self._cell(record.cell)
            if view.last is None or (record.round, record.edge_round) >= (view.last.round, view.last.edge_round):
                if view.last is not None:
                    view.cut_off = frozenset(d for d, why in view.last.absent.items() if why in TASKED)
                view.last = record
                self._seen_round(record.round)
            view.records += 1
            view.rejected_total += len(record.rejected)
            if (room := MAX_REVOKED_NAMED - len(view.devices_revoked)) > 0:  # bounded: a cell with its own key
                revoked = (d for d, why in record.absent.items() if why == "revoked")  # may name new ids in each
                view.devices_revoked.update(itertools.islice(revoked, room))
            if record.coverage is not None:
                view.participation.append((record.coverage, seen))
            view.last_seen = max(filter(None, (view.last_seen, seen)), default=None)
            return
        if self.cloud is None or record.round >= self.cloud.round:
            self.cloud, self.cloud_seen = record, seen
            self._seen_round(record.round)
        for cell in record.cells_planned:
            self._cell(cell)
        self.add_revoked(record.cells_revoked or {})
        for cell, why in (record.cells_failed or {}).items():  # it answers every later task so: the first reason kept
            view = self._cell(cell)
            view.failed, view.failed_at = view.failed or why, max(view.failed_at, record.round)
        for cell in record.cells_reported:  # (an async cell that refused to work is back once restarted properly)
            view = self._cell(cell)
            view.reported_at = max(view.reported_at, record.round)
        for cell in record.cells_absent:
            view = self._cell(cell)
            view.absent_at = max(view.absent_at, record.round)
        if record.accuracy is not None:
            self._add_accuracy(record.round, record.accuracy)
        if record.rounds is not None and record.round + 1 >= record.rounds:
            self.finished = True

    def add_all(self, records: Iterable[Record], bad: Iterable[BadLine] = (), received: float | None = None) -> None:
        for record in records:
            self.add(record, received)
        self.bad.extend(bad)

    def add_status(self, node: str, state: str, received: float | None = None, heartbeat: float | None = None) -> None:
        """A liveness status of ``node`` (``cell.<id>``; other nodes are ignored). An ``idle`` one that
        declares its ``heartbeat`` period is deemed offline once :func:`~protocols.status.idle_deadline`
        passes without another (the node died and its will was lost)."""
        if node.startswith("cell."):
            view = self._cell(node[len("cell.") :])
            if view.idle and state == "online" and received is not None:
                view.last_seen = received  # in a job again: its silence counts from now
            view.online, view.idle = state in ("online", IDLE), state == IDLE
            view.idle_until = idle_deadline(received, heartbeat) if view.idle else None
            if received is not None and view.last_seen is None and state != "offline":  # (its will, maybe retained
                view.last_seen = received  # long ago: a monitor started after a run said its cells were "seen 0 s ago")

    def add_revoked(self, nodes: dict[str, str]) -> None:
        """Nodes the federation revoked, with why (a cloud round record's ``cells_revoked``, the signed roster's
        revoked ids): a cell among them is shown revoked, also one only heard of later. A revoked id stays
        revoked (ids are never reused): the first reason given is kept."""
        for node, why in nodes.items():
            self.revoked.setdefault(node, why)
            if node in self.cells:
                self.cells[node].revoked = self.revoked[node]

    def add_state(self, state: dict) -> None:
        """A node's retained current state (``protocols.state``): the latest one counts. A cloud started again after
        its job ended (a federation's next job) begins a new job here: see :meth:`next_job`."""
        node = state["node"]
        before = self.states.get(node, {})
        self.states[node] = state
        if node.startswith("cell."):
            self._cell(node[len("cell.") :])
        if node == "cloud" and state.get("phase") in ("finished", "stopped", "failed"):
            self.finished = True
        elif node == "cloud" and self.finished and state.get("started") != before.get("started"):
            self.next_job()

    def next_job(self) -> None:
        """Forget the ended job's rounds, keep what is known of the cells as nodes (up, idle, revoked). A monitor kept
        open on a federation showed the next job "finished" (and never a silent cell), and took none of its records
        until its rounds passed the ended job's last round number."""
        self.finished, self.cloud, self.cloud_seen, self.accuracy, self._max_round = False, None, None, [], None
        for name, view in self.cells.items():
            self.cells[name] = CellView(
                name, online=view.online, idle=view.idle, idle_until=view.idle_until, revoked=view.revoked
            )

    @property
    def done(self) -> bool:
        """The job is over and, on a federation, the cloud lists none running or queued (``--exit-when-done``: a
        monitor started right after a submission follows that job, not the end of the one before)."""
        return self.finished and not any(j["state"] in ("running", "queued") for j in self.jobs)

    def link(self, connected: bool, now: float) -> None:
        """Whether the monitor's own broker connection is up (live telemetry): while it is down, what the view shows is
        as last heard (a cell's will may even have said offline as the broker went away)."""
        if connected:
            self.link_lost = None
        elif self.link_lost is None:
            self.link_lost, self.link_losses = now, self.link_losses + 1

    def clear_end(self) -> None:
        """The run goes on: an end its folder said before (stopped, killed) no longer holds, e.g. once the run is
        resumed. Still finished when its last round record says so."""
        if self.states.get("cloud", {}).get("phase") in ("finished", "stopped", "failed"):
            del self.states["cloud"]
            c = self.cloud
            self.finished = c is not None and c.rounds is not None and c.round + 1 >= c.rounds

    def started(self) -> float | None:
        """Wall clock of the run's start: the cloud's state says it, else its first round record implies it."""
        cloud = self.states.get("cloud", {}).get("started")
        if isinstance(cloud, (int, float)):
            return float(cloud)
        return None

    def overdue(self, now: float) -> list[str]:
        """Rounds (cloud) and edge rounds (cells) open for longer than their deadline, with whom they wait for."""
        out = []
        for node, s in sorted(self.states.items()):
            deadline = s.get("deadline_s")
            if s.get("phase") != "waiting" or not isinstance(deadline, (int, float)):
                continue
            cell = self.cells.get(node.removeprefix("cell.")) if node.startswith("cell.") else None
            if cell is not None and self.offline(cell, now):  # a dead cell's last word: its offline alert says it
                continue
            age = now - s["since"]
            if age <= deadline:
                continue
            what = (
                f"round {nth(s.get('round'))}"
                if node == "cloud"
                else f"{node.removeprefix('cell.')} edge round {nth_edge(s.get('round'), s.get('edge_round'))}"
            )
            out.append(
                f"{'cloud ' if node == 'cloud' else 'cell '}{what} open for {age:.0f} s, past its "
                f"{deadline:g} s deadline, {waiting_text(s)}"
            )
        return out

    def _add_accuracy(self, rnd: int, accuracy: float) -> None:
        """Into ``accuracy``, kept sorted by round, a round's replacing any before: in place (it was rebuilt from a
        dict of every round at each record, quadratic: a monitor opened on 20,000 rounds took 95 s to draw)."""
        at = bisect.bisect_left(self.accuracy, rnd, key=lambda e: e[0])
        if at < len(self.accuracy) and self.accuracy[at][0] == rnd:
            self.accuracy[at] = (rnd, accuracy)
        else:
            self.accuracy.insert(at, (rnd, accuracy))
            del self.accuracy[:-ACCURACY_KEPT]  # bounded: a monitor following a run of 10^6 rounds held each one

    def _seen_round(self, rnd: int) -> None:
        self._max_round = rnd if self._max_round is None else max(self._max_round, rnd)

    def _cell(self, cell: str) -> CellView:
        if cell not in self.cells:
            self.cells[cell] = CellView(cell, revoked=self.revoked.get(cell))
        return self.cells[cell]

    # ------------------------------------------------------------------ derived
    @property
    def title(self) -> str:
        """What the monitor follows: the run its records name, else the folder it reads (a monitor started before its
        run: its title said "?"), else "?"."""
        return self.run or self.folder or "?"

    @property
    def current_round(self) -> int | None:
        """The most advanced cloud round any record mentions."""
        return self._max_round

    def lag(self, view: CellView) -> int | None:
        """Cloud rounds the cell is behind the most advanced round."""
        cur = self.current_round
        if view.revoked is not None:  # out of the job: not behind
            return None
        return None if cur is None else cur - view.round if view.round is not None else cur + 1

    def deadline_of(self, view: CellView) -> float | None:
        """Seconds of silence before the cell is flagged: ``deadline``, else the one its records carry."""
        return self.deadline if self.deadline is not None else (view.last.deadline_s if view.last else None)

    def offline(self, view: CellView, now: float) -> bool:
        """The cell said offline (and the run is not over), or its idle status missed its heartbeats (whether a job
        finished or not: a cell is idle between jobs). A revoked cell is revoked, not offline."""
        if view.revoked is not None:
            return False
        stale = view.idle and view.idle_until is not None and now > view.idle_until
        return stale or (view.online is False and (not self.finished or self.left_out(view)))

    def left_out(self, view: CellView) -> bool:
        """The job is over and its last round closed without the cell: planned and absent, or no longer planned (the
        cloud stops planning a cell offline for a cell deadline) after a round that was planned with it and closed
        without it, later than its last record. It dropped out before the end (died, cut off), not with the job (it
        showed ``ok``, or ``ended`` once its will said offline). Not a cell that cell-level participation merely
        did not draw since its last record (never absent), nor in an asynchronous job, whose cells' records count
        their own model versions."""
        c = self.cloud
        if not self.finished or c is None or view.revoked is not None or c.closed_by == BUFFER_FULL:
            return False
        behind = view.last is not None and view.last.round < min(c.round, view.absent_at + 1)
        return view.cell in c.cells_absent or (behind and view.cell not in c.cells_reported)

    def end_time(self) -> float | None:
        """When the job ended (the cloud's end state, else its last round record); None while it goes on."""
        since = self.states.get("cloud", {}).get("since") if self.finished else None
        if isinstance(since, (int, float)) and not isinstance(since, bool):
            return float(since)
        return self.cloud.time if self.finished and self.cloud is not None else None

    def silent(self, view: CellView, now: float) -> float | None:
        """Seconds of silence when longer than the cell's deadline (and the run is not over; an idle cell
        is not in a job: never silent). A cell whose state says it sent its report (``idle``: it owes nothing until
        the cloud's next round, which may wait for another cell) is not silent, nor one known offline (its will:
        that is its alert)."""
        if self.finished or view.last_seen is None or view.idle or view.revoked is not None:
            return None
        if self.states.get(f"cell.{view.cell}", {}).get("phase") == "idle" or self.offline(view, now):
            return None
        deadline = self.deadline_of(view)
        quiet = now - view.last_seen
        return quiet if deadline is not None and quiet > deadline else None

    def dropped(self, view: CellView) -> tuple[float, float] | None:
        """(latest, previous mean) participation when the latest fell below ``drop_ratio`` x the mean."""
        end = self.end_time()  # a record after it (a cell resumed once its job was over) took no part in the job
        kept = [p for p, when in view.participation if end is None or when is None or when <= end]
        if len(kept) < 2:
            return None
        *before, latest = kept
        mean = sum(before) / len(before)
        return (latest, mean) if latest < self.drop_ratio * mean else None

    def state_of(self, view: CellView, now: float) -> str:
        """The cell's state, one of :data:`STATES`."""
        if view.revoked is not None:
            return "revoked"
        if self.silent(view, now) is not None:
            return "silent"
        if self.offline(view, now):
            return "offline"
        if view.idle:
            return "idle"
        if self.left_out(view):  # (its will said offline: offline above)
            return "silent"
        if self.dropped(view) is not None:
            return "drop"
        if view.last is None:
            return "ended" if self.finished else "waiting"
        return "ended" if self.finished and view.online is False else "ok"  # the job over, the cell gone: ended

    def alerts(self, now: float) -> list[str]:
        """Human-readable alerts, most serious first; more than :data:`GROUP_ALERTS` cells with the same
        alert make one line (the worst first)."""
        out = self._job_alerts(now)
        found: dict[str, list[Alert]] = {what: [] for what in CELL_ALERTS}
        for cell, view in sorted(self.cells.items()):
            for what, alert in self._cell_alerts(cell, view, now):
                found[what].append(alert)
        for what, alerts in found.items():
            if len(alerts) <= GROUP_ALERTS:
                out += [line for _, _, line in alerts]
            else:
                alerts.sort()
                names = ", ".join(cell for _, cell, _ in alerts[:GROUP_ALERTS])
                out.append(f"{len(alerts)} cells {what}: {names}, ... (worst: {alerts[0][2]})")
        absent = [c for c in self.cloud.cells_absent if self._cell(c).revoked is None] if self.cloud else []
        if self.cloud is not None and absent:  # a revoked cell has its own alert: it is not missing, it is out
            names = ", ".join(absent[:GROUP_ALERTS]) + (
                f", ... ({len(absent)} cells)" if len(absent) > GROUP_ALERTS else ""
            )
            out.append(f"cloud round {nth(self.cloud.round)} closed by {self.cloud.closed_by} without {names}")
        if self.bad:
            out.append(f"{len(self.bad)} invalid record(s), last: {self.bad.last}")
        return out

    def _job_alerts(self, now: float) -> list[str]:
        """The job's own alerts: it failed, rounds past their deadline, the global model diverged."""
        out: list[str] = []
        cloud_state = self.states.get("cloud", {})
        if cloud_state.get("phase") == "failed":
            out.append(f"the job failed: {cloud_state.get('reason', '?')}")
        elif self.cloud is not None and self.cloud.failed:
            out.append(f"the job failed: {self.cloud.failed}")
        out += self.overdue(now)
        if self.cloud is not None and self.cloud.diverged:
            out.append(f"the global model diverged in round {nth(self.cloud.round)} ({self.cloud.diverged})")
        return out

    def _cell_alerts(self, cell: str, view: CellView, now: float) -> list[tuple[str, Alert]]:
        """``cell``'s alerts, each with its kind (one of :data:`CELL_ALERTS`)."""
        found: list[tuple[str, Alert]] = []
        quiet = self.silent(view, now)
        if quiet is not None:
            deadline = self.deadline_of(view)
            found.append(("silent", (-quiet, cell, f"cell {cell} silent for {quiet:.0f} s (deadline {deadline:g} s)")))
        last = view.last
        where = f"round {nth_edge(last.round, last.edge_round)}" if last is not None else ""  # from 1, as the table
        if self.offline(view, now):
            why = " (idle, its heartbeat missed)" if view.idle else ""
            why += f": {dropped_out(where)}" if self.left_out(view) else ""
            found.append(("offline", (0.0, cell, f"cell {cell} is offline{why}")))
        elif quiet is None and not view.idle and self.left_out(view):
            line = f"cell {cell} silent: {dropped_out(where)}"
            found.append(("silent", (0.0, cell, line)))
        if view.revoked is not None:
            found.append(("revoked", (0.0, cell, f"cell {cell} {view.revoked} by the federation: out of the job")))
        elif view.failed is not None and view.reported_at <= view.failed_at:
            found.append(("failed", (0.0, cell, f"cell {cell} failed, left out by the cloud: {view.failed}")))
        if view.devices_revoked:
            names = ", ".join(sorted(view.devices_revoked)[:GROUP_ALERTS])
            more = len(view.devices_revoked) - GROUP_ALERTS
            more_text = f" (+{more}{' or' if len(view.devices_revoked) >= MAX_REVOKED_NAMED else ''} more)"
            line = f"cell {cell}: device(s) {names}{more_text if more > 0 else ''} revoked by the federation"
            found.append(("with revoked devices", (-len(view.devices_revoked), cell, line)))
        drop = self.dropped(view) if view.revoked is None else None
        if drop is not None:
            line = f"cell {cell} participation dropped to {drop[0]:.0%} (was {drop[1]:.0%} on average)"
            found.append(("with a participation drop", (drop[0] / drop[1], cell, line)))
        # a late answer of a device the edge round before closed without (deadline, quorum) is no alarm
        rejected = [r for r in last.rejected if not late(r, view.cut_off)] if last is not None else []
        if last is not None and rejected:
            reasons = "; ".join(sorted({r.reason for r in rejected}))[:120]
            line = f"cell {cell} rejected {len(rejected)} result(s) in {where}: "
            found.append(("with rejected results", (-len(rejected), cell, line + reasons)))
        if last is not None and last.diverged:
            why = "; ".join(sorted(set(last.diverged.values())))[:120]
            line = f"cell {cell}: {len(last.diverged)} device(s) diverged in {where}: "
            found.append(("with diverged devices", (-len(last.diverged), cell, line + why)))
        return found


def dropped_out(where: str) -> str:
    """Why a cell the job ended without is flagged (:meth:`MonitorState.left_out`), its last record ``where``."""
    return f"it dropped out before the job's end (its last record: {where or 'none'})"


def late(rejection: Rejection, cut_off: frozenset[str]) -> bool:
    """Whether ``rejection`` is the late answer of a device its cell's previous edge round closed without: its kind
    says so, or (records written before that kind existed) a stale answer of a device cut off the round before."""
    return rejection.kind == RejectKind.LATE or (rejection.kind == RejectKind.STALE and rejection.device in cut_off)


PHASE_WORDS = {"idle": "between rounds"}
"""The monitor's words for a cloud state's phase whose name misleads: the cloud is ``idle`` from a round's close (its
record out, its checkpoint being written) to the next round's start, not out of the job."""


def phase_name(phase: object) -> str:
    """A cloud state's phase as the monitor says it (:data:`PHASE_WORDS`)."""
    return PHASE_WORDS.get(phase, phase) if isinstance(phase, str) else str(phase)


ACCURACY_KEPT = 64
"""Evaluated rounds whose accuracy the monitor keeps, the latest (its sparkline draws the last 30)."""


def waiting_text(s: dict) -> str:
    """``waiting for a, b (+3 more)`` of a state record."""
    names = list(s.get("waiting", []))
    more = int(s.get("waiting_count", len(names))) - len(names)
    return "waiting for " + (", ".join(names) or "nobody") + (f" (+{more} more)" if more > 0 else "")
