"""What ``fedtier monitor`` shows: a pure state built from telemetry records, and its rendering.

:class:`MonitorState` folds cell aggregation records and cloud round records (``protocols.records``),
plus liveness statuses, into one row per cell; :meth:`MonitorState.alerts` names the cells that fell
silent for longer than their deadline, whose participation dropped, that had results rejected or devices
whose training diverged.
:func:`render` turns the state into a rich renderable for a given wall-clock ``now``: a summary line,
and the rows of the cells that matter most (all of them when they fit in ``top``), so that a fleet of
a thousand cells stays readable; :class:`CellFilter` narrows the rows to some cells or states. No I/O here.
"""

from __future__ import annotations

import fnmatch
import io
import time as _time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from protocols.records import BadLine, CellRecord, Record, RoundRecord

SPARK = "▁▂▃▄▅▆▇█"
STATES = ("silent", "offline", "drop", "waiting", "ok")
"""A cell's state in the monitor, most serious first."""
SORTS = ("severity", "lag", "drop", "silent", "name")
GROUP_ALERTS = 5  # more cells than this with the same alert: one line for all of them


@dataclass
class CellView:
    """The latest known state of one cell."""

    cell: str
    last: CellRecord | None = None
    last_seen: float | None = None  # wall clock of the last record (or status)
    online: bool | None = None
    records: int = 0
    rejected_total: int = 0
    participation: deque[float] = field(default_factory=lambda: deque(maxlen=11))

    @property
    def round(self) -> int | None:
        return self.last.round if self.last else None


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
    accuracy: list[tuple[int, float]] = field(default_factory=list)
    bad: list[BadLine] = field(default_factory=list)
    finished: bool = False
    states: dict[str, dict] = field(default_factory=dict)  # node -> its current state (protocols.state)
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
                view.last = record
                self._seen_round(record.round)
            view.records += 1
            view.rejected_total += len(record.rejected)
            if record.coverage is not None:
                view.participation.append(record.coverage)
            view.last_seen = max(filter(None, (view.last_seen, seen)), default=None)
            return
        if self.cloud is None or record.round >= self.cloud.round:
            self.cloud, self.cloud_seen = record, seen
            self._seen_round(record.round)
        for cell in record.cells_planned:
            self._cell(cell)
        if record.accuracy is not None:
            self.accuracy = sorted({**dict(self.accuracy), record.round: record.accuracy}.items())
        if record.rounds is not None and record.round + 1 >= record.rounds:
            self.finished = True

    def add_all(self, records: Iterable[Record], bad: Iterable[BadLine] = (), received: float | None = None) -> None:
        for record in records:
            self.add(record, received)
        self.bad.extend(bad)

    def add_status(self, node: str, state: str, received: float | None = None) -> None:
        """A liveness status of ``node`` (``cell.<id>``; other nodes are ignored)."""
        if node.startswith("cell."):
            view = self._cell(node[len("cell.") :])
            view.online = state == "online"
            if received is not None and view.last_seen is None:
                view.last_seen = received

    def add_state(self, state: dict) -> None:
        """A node's retained current state (``protocols.state``): the latest one counts."""
        node = state["node"]
        self.states[node] = state
        if node.startswith("cell."):
            self._cell(node[len("cell.") :])
        if node == "cloud" and state.get("phase") in ("finished", "stopped", "failed"):
            self.finished = True

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
            age = now - s["since"]
            if age <= deadline:
                continue
            what = (
                f"round {s.get('round')}"
                if node == "cloud"
                else f"{node.removeprefix('cell.')} edge round {s.get('round')}.{s.get('edge_round')}"
            )
            out.append(
                f"{'cloud ' if node == 'cloud' else 'cell '}{what} open for {age:.0f} s, past its "
                f"{deadline:g} s deadline, {waiting_text(s)}"
            )
        return out

    def _seen_round(self, rnd: int) -> None:
        self._max_round = rnd if self._max_round is None else max(self._max_round, rnd)

    def _cell(self, cell: str) -> CellView:
        if cell not in self.cells:
            self.cells[cell] = CellView(cell)
        return self.cells[cell]

    # ------------------------------------------------------------------ derived
    @property
    def current_round(self) -> int | None:
        """The most advanced cloud round any record mentions."""
        return self._max_round

    def lag(self, view: CellView) -> int | None:
        """Cloud rounds the cell is behind the most advanced round."""
        cur = self.current_round
        return None if cur is None else cur - view.round if view.round is not None else cur + 1

    def silent(self, view: CellView, now: float) -> float | None:
        """Seconds of silence when longer than the cell's deadline (and the run is not over)."""
        if self.finished or view.last_seen is None:
            return None
        deadline = self.deadline if self.deadline is not None else (view.last.deadline_s if view.last else None)
        quiet = now - view.last_seen
        return quiet if deadline is not None and quiet > deadline else None

    def dropped(self, view: CellView) -> tuple[float, float] | None:
        """(latest, previous mean) participation when the latest fell below ``drop_ratio`` x the mean."""
        if len(view.participation) < 2:
            return None
        *before, latest = view.participation
        mean = sum(before) / len(before)
        return (latest, mean) if latest < self.drop_ratio * mean else None

    def state_of(self, view: CellView, now: float) -> str:
        """The cell's state, one of :data:`STATES`."""
        if self.silent(view, now) is not None:
            return "silent"
        if view.online is False and not self.finished:
            return "offline"
        if self.dropped(view) is not None:
            return "drop"
        return "waiting" if view.last is None else "ok"

    def alerts(self, now: float) -> list[str]:
        """Human-readable alerts, most serious first; more than :data:`GROUP_ALERTS` cells with the same
        alert make one line (the worst first)."""
        silent: list[tuple[float, str, str]] = []
        offline: list[tuple[float, str, str]] = []
        drops: list[tuple[float, str, str]] = []
        rejects: list[tuple[float, str, str]] = []
        diverged: list[tuple[float, str, str]] = []
        for cell, view in sorted(self.cells.items()):
            quiet = self.silent(view, now)
            if quiet is not None:
                silent.append(
                    (
                        -quiet,
                        cell,
                        f"cell {cell} silent for {quiet:.0f} s (deadline "
                        f"{self.deadline if self.deadline is not None else view.last.deadline_s:g} s)",
                    )
                )
            if view.online is False and not self.finished:
                offline.append((0.0, cell, f"cell {cell} is offline"))
            drop = self.dropped(view)
            if drop is not None:
                drops.append(
                    (
                        drop[0] / drop[1],
                        cell,
                        f"cell {cell} participation dropped to {drop[0]:.0%} (was {drop[1]:.0%} on average)",
                    )
                )
            if view.last is not None and view.last.rejected:
                reasons = sorted({r.reason for r in view.last.rejected})
                rejects.append(
                    (
                        -len(view.last.rejected),
                        cell,
                        f"cell {cell} rejected {len(view.last.rejected)} result(s) in round "
                        f"{view.last.round}.{view.last.edge_round}: {'; '.join(reasons)[:120]}",
                    )
                )
            if view.last is not None and view.last.diverged:
                why = sorted(set(view.last.diverged.values()))
                diverged.append(
                    (
                        -len(view.last.diverged),
                        cell,
                        f"cell {cell}: {len(view.last.diverged)} device(s) diverged in round "
                        f"{view.last.round}.{view.last.edge_round}: {'; '.join(why)[:120]}",
                    )
                )
        out: list[str] = []
        cloud_state = self.states.get("cloud", {})
        if cloud_state.get("phase") == "failed":
            out.append(f"the job failed: {cloud_state.get('reason', '?')}")
        elif self.cloud is not None and self.cloud.failed:
            out.append(f"the job failed: {self.cloud.failed}")
        out += self.overdue(now)
        if self.cloud is not None and self.cloud.diverged:
            out.append(f"the global model diverged in round {self.cloud.round} ({self.cloud.diverged})")
        for what, found in (
            ("silent", silent),
            ("offline", offline),
            ("with a participation drop", drops),
            ("with rejected results", rejects),
            ("with diverged devices", diverged),
        ):
            if len(found) <= GROUP_ALERTS:
                out += [line for _, _, line in found]
            else:
                found.sort()
                names = ", ".join(cell for _, cell, _ in found[:GROUP_ALERTS])
                out.append(f"{len(found)} cells {what}: {names}, ... (worst: {found[0][2]})")
        if self.cloud is not None and self.cloud.cells_absent:
            absent = self.cloud.cells_absent
            names = ", ".join(absent[:GROUP_ALERTS]) + (
                f", ... ({len(absent)} cells)" if len(absent) > GROUP_ALERTS else ""
            )
            out.append(f"cloud round {self.cloud.round} closed by {self.cloud.closed_by} without {names}")
        if self.bad:
            out.append(f"{len(self.bad)} invalid record(s), last: {self.bad[-1]}")
        return out


# ---------------------------------------------------------------------- rendering
def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


def sparkline(values: list[float], width: int = 30) -> str:
    values = values[-width:]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = hi - lo or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * (len(SPARK) - 1) + 0.5))] for v in values)


def _ago(now: float, then: float | None) -> str:
    if then is None:
        return "never"
    s = max(0.0, now - then)
    return f"{s:.1f} s ago" if s < 60 else f"{s / 60:.1f} min ago" if s < 3600 else f"{s / 3600:.1f} h ago"


_STATE_STYLE = {
    "silent": ("SILENT", "bold red"),
    "offline": ("offline", "red"),
    "drop": ("DROP", "bold yellow"),
    "waiting": ("waiting", "dim"),
    "ok": ("ok", "green"),
}


@dataclass(frozen=True)
class CellFilter:
    """Which cells the table shows, and how many: ``patterns`` (globs on the cell id, any matches),
    ``states`` (of :data:`STATES`), at most ``top`` rows ordered by ``sort`` (one of :data:`SORTS`;
    default: by name when every selected cell fits, else by severity)."""

    patterns: tuple[str, ...] = ()
    states: tuple[str, ...] = ()
    top: int = 20
    sort: str | None = None

    def __post_init__(self) -> None:
        if self.top < 1:
            raise ValueError("top must be at least 1")
        if self.sort is not None and self.sort not in SORTS:
            raise ValueError(f"sort must be one of {', '.join(SORTS)}")
        if set(self.states) - set(STATES):
            raise ValueError(f"states must be among {', '.join(STATES)}")


@dataclass
class _Row:
    view: CellView
    state: str
    lag: int | None
    quiet: float  # seconds since last seen (0: never seen)
    drop: float  # latest / mean participation (1: no drop known)


def _rows(state: MonitorState, now: float, flt: CellFilter) -> tuple[list[_Row], int]:
    """The rows to show, and how many cells the filter selected."""
    rows = []
    for cell, view in state.cells.items():
        if flt.patterns and not any(fnmatch.fnmatchcase(cell, p) for p in flt.patterns):
            continue
        st = state.state_of(view, now)
        if flt.states and st not in flt.states:
            continue
        drop = state.dropped(view)
        rows.append(
            _Row(
                view,
                st,
                state.lag(view),
                now - view.last_seen if view.last_seen is not None else 0.0,
                drop[0] / drop[1] if drop else 1.0,
            )
        )
    sort = flt.sort or ("name" if len(rows) <= flt.top else "severity")
    keys = {
        "name": lambda r: r.view.cell,
        "severity": lambda r: (STATES.index(r.state), -(r.lag or 0), r.drop, -r.quiet, r.view.cell),
        "lag": lambda r: (-(r.lag or 0), r.view.cell),
        "drop": lambda r: (r.drop, r.view.cell),
        "silent": lambda r: (-r.quiet, r.view.cell),
    }
    rows.sort(key=keys[sort])
    return rows[: flt.top], len(rows)


def cell_table(state: MonitorState, now: float, flt: CellFilter | None = None) -> Table:
    """The cells selected by ``flt`` (default: the 20 that matter most), and a last row for the others."""
    flt = flt or CellFilter()
    table = Table(expand=False, header_style="bold")
    for name, justify in (
        ("cell", "left"),
        ("round", "right"),
        ("answered", "right"),
        ("bytes in/out", "right"),
        ("loss", "right"),
        ("lag", "right"),
        ("closed by", "left"),
        ("last seen", "right"),
        ("state", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    rows, selected = _rows(state, now, flt)
    for row in rows:
        view, rec, lag = row.view, row.view.last, row.lag
        status = Text(*_STATE_STYLE[row.state])
        if rec is None:
            table.add_row(
                Text(view.cell),
                "-",
                "-",
                "-",
                "-",
                str(lag) if lag is not None else "-",
                "-",
                _ago(now, view.last_seen),
                status,
            )
            continue
        part = rec.participation
        answered = (
            f"{len(rec.answered)}/{len(rec.planned)}"
            + (f" ({part:.0%})" if part is not None else "")
            + (f" of {rec.cell_size}" if rec.cell_size != len(rec.planned) else "")
        )
        loss = (
            "-"
            if rec.loss_mean is None
            else f"{rec.loss_mean:.4f}" + (f" ± {rec.loss_std:.3f}" if rec.loss_std is not None else "")
        )
        table.add_row(
            Text(view.cell),  # Text: what came from the network is shown as it is, never read as markup
            f"{rec.round}.{rec.edge_round}",
            answered,
            f"{human_bytes(rec.bytes_in)} / {human_bytes(rec.bytes_out)}",
            loss,
            Text(str(lag), style="yellow" if lag else ""),
            Text(rec.closed_by),
            _ago(now, view.last_seen),
            status,
        )
    if selected > len(rows):
        table.add_row(Text(f"... {selected - len(rows)} more", style="dim"), *[""] * 8)
    return table


def summary_line(state: MonitorState, now: float) -> Text:
    """Counts of cells per state, devices answered in the cells' latest aggregations, the largest lag."""
    views = list(state.cells.values())
    counts = Counter(state.state_of(v, now) for v in views)
    text = Text.assemble(("cells ", "bold"), f"{len(views)}: ")
    text.append(", ".join(f"{counts[s]} {s}" for s in STATES if counts[s]) or "none")
    answered = sum(len(v.last.answered) for v in views if v.last is not None)
    planned = sum(len(v.last.planned) for v in views if v.last is not None)
    if planned:
        text.append(f"  devices answered {answered}/{planned} ({answered / planned:.0%})")
    lags = [lag for v in views if (lag := state.lag(v))]
    if lags:
        text.append(f"  behind: {len(lags)} cells, up to {max(lags)} rounds", style="yellow")
    return text


def waiting_text(s: dict) -> str:
    """``waiting for a, b (+3 more)`` of a state record."""
    names = list(s.get("waiting", []))
    more = int(s.get("waiting_count", len(names))) - len(names)
    return "waiting for " + (", ".join(names) or "nobody") + (f" (+{more} more)" if more > 0 else "")


def state_line(state: MonitorState, now: float) -> Text | None:
    """What the cloud is doing now (its retained state): the open round, since when, whom it waits for."""
    s = state.states.get("cloud")
    if s is None:
        return None
    text = Text.assemble(("now ", "bold"))
    phase = s.get("phase")
    if phase == "waiting":
        text.append(f"round {s.get('round')}: {waiting_text(s)} for {now - s['since']:.0f} s")
        deadline = s.get("deadline_s")
        if isinstance(deadline, (int, float)) and now - s["since"] > deadline:
            text.append(f" (deadline {deadline:g} s passed)", style="bold red")
    else:
        text.append(f"{phase}" + (f": {s['reason']}" if s.get("reason") else "") + f" since {now - s['since']:.0f} s")
    started = state.started()
    if started is not None:
        text.append(f"  age {now - started:.0f} s")
    return text


def cloud_line(state: MonitorState, now: float) -> Text:
    c = state.cloud
    if c is None:
        return Text("cloud: no round closed yet", style="dim")
    total = f"/{c.rounds}" if c.rounds else ""
    text = Text.assemble(("cloud ", "bold"), f"round {c.round + 1}{total} closed ({c.closed_by}), ")
    if state.accuracy:
        text.append(f"accuracy {state.accuracy[-1][1]:.4f} ", style="bold cyan")
        text.append(sparkline([a for _, a in state.accuracy]) + " ")
    if c.loss is not None:
        text.append(f"loss {c.loss:.4f}  ")
    if c.epsilon is not None:
        text.append(f"ε {c.epsilon:.3g}  ", style="magenta")
    text.append(f"bytes {human_bytes(sum(c.cumulative_bytes.values()))}  ")
    text.append(f"last {_ago(now, state.cloud_seen)}")
    if state.finished:
        text.append("  finished", style="bold green")
    return text


def render(state: MonitorState, now: float | None = None, flt: CellFilter | None = None) -> Group:
    """The monitor frame: header, cloud line, cell summary, the rows ``flt`` selects, alerts."""
    now = _time.time() if now is None else now
    alerts = state.alerts(now)
    alert_text = (
        Text("\n".join(f"! {a}" for a in alerts), style="bold red") if alerts else Text("no alerts", style="green")
    )
    title = f"fedtier monitor: {escape(state.run or '?')}  ({len(state.cells)} cells)"
    current = state_line(state, now)
    body = Group(
        cloud_line(state, now),
        *((current,) if current is not None else ()),
        summary_line(state, now),
        cell_table(state, now, flt),
    )
    return Group(
        Panel(body, title=title, title_align="left", expand=False),
        Panel(alert_text, title="alerts", title_align="left", expand=False),
    )


def render_text(state: MonitorState, now: float | None = None, width: int = 140, flt: CellFilter | None = None) -> str:
    """The frame as plain text (for ``--once`` in scripts and for tests)."""
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(render(state, now, flt))
    return console.file.getvalue()  # type: ignore[attr-defined]
