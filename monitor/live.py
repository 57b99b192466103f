"""``fedtier monitor``'s terminal loop: records pulled from a feed (a run folder or live telemetry) into a
:class:`~monitor.state.MonitorState` and drawn, once or live."""

from __future__ import annotations

import time

from rich.console import Console
from rich.live import Live

from protocols.records import Record

from .log_lines import LineLog
from .sources import RunDirFollower, Status, TelemetryFeed, wait_quiet
from .state import MonitorState, job_entries
from .view import CellFilter, render


class LiveView:
    """The frames of one ``fedtier monitor``: drawn once, or live until Ctrl-C (or the run's end, with
    ``exit_when_done``)."""

    def __init__(self, drop_ratio: float, deadline: float | None, flt: CellFilter, out: Console) -> None:
        self.drop_ratio, self.deadline, self.flt, self.out = drop_ratio, deadline, flt, out
        self.state = MonitorState(drop_ratio=drop_ratio, deadline=deadline)
        self.restarts = 0

    def pull(self, feed: RunDirFollower | TelemetryFeed) -> None:
        """Everything new from ``feed`` into the state (a new run in a followed folder starts a fresh one; a folder's
        backlog is folded in a bounded piece at a time; live telemetry in the order it came)."""
        if isinstance(feed, TelemetryFeed):
            self._pull_live(feed)
            return
        while True:
            records, bad, statuses = feed.poll()
            if feed.restarts != self.restarts:  # a new run in the folder
                self.restarts = feed.restarts
                self.state = MonitorState(drop_ratio=self.drop_ratio, deadline=self.deadline)
            self._add(records, statuses, None)  # a folder: the records' time
            self.state.bad.extend(bad)
            if not feed.pending:
                break
        current = feed.poll_states()  # the end summary.json says (or the run.lock nobody holds)
        for each in current:
            self.state.add_state(each)
        if not current:  # the folder's run goes on (again: --resume)
            self.state.clear_end()
        self.state.cell_folder = feed.cell_folder()  # a cell's own job folder says so (it holds no cloud's records)
        self.state.folder, self.state.folder_missing = str(feed.run_dir), not feed.run_dir.is_dir()

    def _pull_live(self, feed: TelemetryFeed) -> None:
        """Live telemetry, records and statuses taken up to each state that came after them, then that state."""
        (records, bad, statuses), states = feed.poll_in_order()
        now, taken, heard = time.time(), 0, 0
        self.state.link(feed.transport.connected, now)  # the monitor's own broker connection
        for at, said, state in states:
            self._add(records[taken:at], statuses[heard:said], now)
            taken, heard = at, said
            self.state.add_state(state)
        self._add(records[taken:], statuses[heard:], now)
        self.state.bad.extend(bad)
        self.state.add_revoked(feed.poll_revoked())  # the cloud's round records name the revoked cells
        jobs = feed.poll_jobs()  # a federation's: what ended before this monitor came (telemetry is not kept)
        if jobs is not None:
            self.state.jobs = job_entries(jobs)

    def _add(self, records: list[Record], statuses: list[Status], received: float | None) -> None:
        self.state.add_all(records, received=received)
        for node, s, heartbeat, age in statuses:  # (age: of a retained idle record, from its published time)
            self.state.add_status(node, s, time.time() - age, heartbeat)

    def follow(
        self, feed: RunDirFollower | TelemetryFeed, once: bool, wait: float, refresh: float, exit_when_done: bool
    ) -> None:
        """One frame (``once``: after live telemetry went quiet, ``wait`` at most) or a live view redrawn every
        ``refresh`` seconds, where the output is no terminal a :class:`~monitor.log_lines.LineLog` (and the last
        frame on leaving); a telemetry feed is closed on leaving."""
        try:
            if once:
                if isinstance(feed, TelemetryFeed):
                    wait_quiet(feed, quiet=min(1.0, wait), timeout=wait)
                self.pull(feed)
                self.out.print(render(self.state, flt=self.flt))
                return
            if not self.out.is_terminal or self.out.is_dumb_terminal:  # a live display writes nothing there
                return self.log(feed, refresh, exit_when_done, wait)
            with Live(render(self.state, flt=self.flt), console=self.out, auto_refresh=False, transient=False) as live:
                while True:
                    self.pull(feed)
                    live.update(render(self.state, flt=self.flt), refresh=True)
                    if exit_when_done and self.state.done:
                        return
                    time.sleep(refresh)
        except KeyboardInterrupt:
            pass
        finally:
            if isinstance(feed, TelemetryFeed):
                feed.close()

    def log(self, feed: RunDirFollower | TelemetryFeed, refresh: float, exit_when_done: bool, wait: float) -> None:
        """A line each time something changed, checked every ``refresh`` seconds, and the last frame on leaving; on a
        telemetry feed, after listening ``wait`` seconds at most for the broker's retained records (a log's first lines
        said "0 cells", "no round closed yet" of a federation whose job had ended)."""
        lines = LineLog(self.out)
        if isinstance(feed, TelemetryFeed):
            wait_quiet(feed, quiet=min(1.0, wait), timeout=wait)
        try:
            while True:
                self.pull(feed)
                lines.update(self.state)
                if exit_when_done and self.state.done:
                    return
                time.sleep(refresh)
        finally:
            self.out.print(render(self.state, flt=self.flt))
