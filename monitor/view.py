"""What ``fedtier monitor`` shows: a pure state built from telemetry records, and its rendering.

:class:`MonitorState` folds cell aggregation records and cloud round records (``protocols.records``),
plus liveness statuses, into one row per cell; :meth:`MonitorState.alerts` names the cells that fell
silent for longer than their deadline, whose participation dropped, or that had results rejected.
:func:`render` turns the state into a rich renderable for a given wall-clock ``now``. No I/O here.
"""
from __future__ import annotations

import io
import time as _time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from protocols.records import BadLine, CellRecord, Record, RoundRecord

SPARK = "▁▂▃▄▅▆▇█"


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
            view.records += 1
            view.rejected_total += len(record.rejected)
            if record.coverage is not None:
                view.participation.append(record.coverage)
            view.last_seen = max(filter(None, (view.last_seen, seen)), default=None)
            return
        if self.cloud is None or record.round >= self.cloud.round:
            self.cloud, self.cloud_seen = record, seen
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
            view = self._cell(node[len("cell."):])
            view.online = state == "online"
            if received is not None and view.last_seen is None:
                view.last_seen = received

    def _cell(self, cell: str) -> CellView:
        if cell not in self.cells:
            self.cells[cell] = CellView(cell)
        return self.cells[cell]

    # ------------------------------------------------------------------ derived
    @property
    def current_round(self) -> int | None:
        """The most advanced cloud round any record mentions."""
        rounds = [v.round for v in self.cells.values() if v.round is not None]
        if self.cloud is not None:
            rounds.append(self.cloud.round)
        return max(rounds) if rounds else None

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

    def alerts(self, now: float) -> list[str]:
        """Human-readable alerts, most serious first."""
        out: list[str] = []
        for cell, view in sorted(self.cells.items()):
            quiet = self.silent(view, now)
            if quiet is not None:
                out.append(f"cell {cell} silent for {quiet:.0f} s (deadline "
                           f"{self.deadline if self.deadline is not None else view.last.deadline_s:g} s)")
            if view.online is False and not self.finished:
                out.append(f"cell {cell} is offline")
            drop = self.dropped(view)
            if drop is not None:
                out.append(f"cell {cell} participation dropped to {drop[0]:.0%} (was {drop[1]:.0%} on average)")
            if view.last is not None and view.last.rejected:
                reasons = sorted({r.reason for r in view.last.rejected})
                out.append(f"cell {cell} rejected {len(view.last.rejected)} result(s) in round "
                           f"{view.last.round}.{view.last.edge_round}: {'; '.join(reasons)[:120]}")
        if self.cloud is not None and self.cloud.cells_absent:
            out.append(f"cloud round {self.cloud.round} closed by {self.cloud.closed_by} without "
                       f"{', '.join(self.cloud.cells_absent)}")
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


def cell_table(state: MonitorState, now: float) -> Table:
    table = Table(expand=False, header_style="bold")
    for name, justify in (("cell", "left"), ("round", "right"), ("answered", "right"), ("bytes in/out", "right"),
                          ("loss", "right"), ("lag", "right"), ("closed by", "left"), ("last seen", "right"),
                          ("state", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for cell, view in sorted(state.cells.items()):
        rec = view.last
        lag = state.lag(view)
        if state.silent(view, now) is not None:
            status = Text("SILENT", style="bold red")
        elif view.online is False and not state.finished:
            status = Text("offline", style="red")
        elif state.dropped(view) is not None:
            status = Text("DROP", style="bold yellow")
        elif rec is None:
            status = Text("waiting", style="dim")
        else:
            status = Text("ok", style="green")
        if rec is None:
            table.add_row(cell, "-", "-", "-", "-", str(lag) if lag is not None else "-", "-",
                          _ago(now, view.last_seen), status)
            continue
        part = rec.participation
        answered = f"{len(rec.answered)}/{len(rec.planned)}" + (f" ({part:.0%})" if part is not None else "") + (
            f" of {rec.cell_size}" if rec.cell_size != len(rec.planned) else "")
        loss = "-" if rec.loss_mean is None else f"{rec.loss_mean:.4f}" + (
            f" ± {rec.loss_std:.3f}" if rec.loss_std is not None else "")
        table.add_row(cell, f"{rec.round}.{rec.edge_round}", answered,
                      f"{human_bytes(rec.bytes_in)} / {human_bytes(rec.bytes_out)}", loss,
                      Text(str(lag), style="yellow" if lag else ""), rec.closed_by, _ago(now, view.last_seen), status)
    return table


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
    text.append(f"bytes {human_bytes(sum(c.cumulative_bytes.values()))}  ")
    if c.clock_s:
        text.append(f"clock {c.clock_s:.1f} s  ")
    text.append(f"last {_ago(now, state.cloud_seen)}")
    if state.finished:
        text.append("  finished", style="bold green")
    return text


def render(state: MonitorState, now: float | None = None) -> Group:
    """The monitor frame: header, cloud line, one row per cell, alerts."""
    now = _time.time() if now is None else now
    alerts = state.alerts(now)
    alert_text = Text("\n".join(f"! {a}" for a in alerts), style="bold red") if alerts else Text("no alerts", style="green")
    title = f"fedtier monitor: {state.run or '?'}  ({len(state.cells)} cells)"
    return Group(Panel(Group(cloud_line(state, now), cell_table(state, now)), title=title, title_align="left",
                       expand=False),
                 Panel(alert_text, title="alerts", title_align="left", expand=False))


def render_text(state: MonitorState, now: float | None = None, width: int = 140) -> str:
    """The frame as plain text (for ``--once`` in scripts and for tests)."""
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(render(state, now))
    return console.file.getvalue()  # type: ignore[attr-defined]
