"""``runtime.cell_processes``: ``fedtier sim``'s cells, with their devices and their training, in processes of their
own; the cloud stays in the main process. The main process's host work (framing, decoding, checking and summing
every device's message) then spreads over as many cores.

Each process has its own :class:`~protocols.transport.memory.VirtualLoop` and hub. A message published in one that
a node of another subscribes to crosses as its encoded bytes (``sim/cell_share.py``'s frames; nothing is pickled):
a cell's report, status, state and records go to the main process (everything outside ``.../cell/``, where a cell's
and its devices' own topics stay); what the cloud publishes goes to the process of the cell a topic names, or to all
(the round manifest, the cloud's status and control). The cells subscribe to nothing of each other's.

Time is synchronised conservatively: the main process runs what is due at the present, sends each cell process
what was published for it and the present, and each runs what is due then and answers; while messages still cross,
this repeats at the same time. Only when a whole exchange carried none (no process has anything left before the
next timer) does every clock move, to the earliest timer of all processes; the main process's timers due then fire
first. A message crossing at time ``t`` is delivered by the receiving hub, with ``[clock]``'s link delay for its
topic and size (the same function of them in every process), at the time it would be in one process; what crosses
in one exchange is delivered sorted by sender (``cell_share.deliver``: stably, each sender's in the order it sent
them), not in the order of the processes. A one-process run's loop takes the same turns (its cells and devices are
its cells' side: ``protocols.transport.memory.VirtualLoop``, ``sim_cells.loop_sides``): the cloud's side runs what it
has at the present, then the cells' side gets what crossed, sorted by sender, and runs what it has, and so on; at a
new instant the cloud's timers fire first. Every node thus sees its messages and timers in the same order either
way: pushes of several cells reaching an asynchronous cloud (FedBuff) at one instant, and a cloud timer due with a
cell's, included; so the model, the records and the byte counts are those of one process
(``tests/test_cell_processes.py``). Asynchronous cells whose devices train in no virtual time never run out of work
at an instant, so they could never hand the turn over: refused (one process keeps its one-sided loop for them).

A cell process that dies ends the run with :class:`CellProcessError`, naming it, its cells and its last words, and
so does one that owes an answer and sends nothing, not even a progress beat, for ``runtime.worker_stall_s`` (it is
killed). The
cells' aggregation log is written here, from the records they publish; their records and their devices' traffic
come back when the run ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocols import procs, runfiles
from protocols.config import ConfigError, RunConfig
from protocols.jsonl import JsonlWriter
from protocols.limits import processes_refusal
from protocols.transport.memory import MemoryHub
from protocols.wire import topics
from protocols.wire.envelope import Segments
from protocols.wire.signed import open_record

if TYPE_CHECKING:
    from protocols.algorithms.base import Algorithm

from .cell_share import Message, cell_process_main, deliver, frame_messages, message_frame, share_plan
from .sim_cells import untimed_async
from .worker_context import launch, worker_context
from .worker_frames import frame, unframe

log = logging.getLogger("fedtier.sim")


class CellProcessError(RuntimeError):
    """A cell process died or answered nonsense; the run cannot go on."""


def split_refusals(cfg: RunConfig, algorithm: Algorithm, prepared: bool = False) -> list[str]:
    """What ``runtime.cell_processes`` does not support (yet) in ``cfg`` run by ``algorithm``, each with why; empty:
    it may run."""
    rt, n = cfg.runtime, cfg.runtime.cell_processes
    out = []
    if n > cfg.topology.cells:
        out.append(f"more processes than cells ({cfg.topology.cells})")
    out += filter(None, [processes_refusal(n, "this machine")])
    if untimed_async(cfg, algorithm):
        out.append("an asynchronous algorithm whose devices train in no virtual time (set [clock] device_steps_per_s)")
    if rt.sim_workers:
        out.append("runtime.sim_workers (each cell process trains its devices itself)")
    if rt.onnx_devices:
        out.append("runtime.onnx_devices")
    if prepared:
        out.append("data prepared outside the config (each process prepares it from the config)")
    return out


def check_split(cfg: RunConfig, algorithm: Algorithm, prepared: bool = False) -> None:
    """Refuse (:class:`ConfigError`) a run ``runtime.cell_processes`` cannot do, naming what is not supported."""
    refused = split_refusals(cfg, algorithm, prepared) if cfg.runtime.cell_processes else []
    if refused:
        raise ConfigError(
            f"runtime.cell_processes = {cfg.runtime.cell_processes} does not support: {'; '.join(refused)}"
        )


def plan_line(cfg: RunConfig, groups: list[list[str]]) -> str:
    """The run's split in words, logged once: the processes, their cells, each one's torch threads."""
    rt, plan = cfg.runtime, share_plan(cfg)
    if not plan.cohort:
        threads = "one device at a time (engine = device), one torch thread each"
    elif rt.cell_process_threads:
        threads = f"{plan.threads} torch threads each for its cohorts (runtime.cell_process_threads)"
    else:
        threads = (
            f"{plan.threads} torch threads each for its cohorts (runtime.cohort_threads = {rt.cohort_threads} "
            f"shared; runtime.cell_process_threads sets it)"
        )
    cells = "; ".join(", ".join(g) for g in groups)
    return f"cell processes: {len(groups)} (cells {cells}), {threads}; each loads the whole data set"


class CellProcesses:
    """The main process's side: the cell processes, the messages between their hubs and this one, and time."""

    def __init__(self, cfg: RunConfig, hub: MemoryHub, output_dir: Path | None, start_at: float = 0.0) -> None:
        """``start_at``: the virtual time the cells start at (a resumed run's)."""
        self.topology = cfg.topology
        self.stall_s = cfg.runtime.worker_stall_s  # (not while a process starts: it may load a large data set)
        cells = cfg.topology.cell_ids()
        n = cfg.runtime.cell_processes
        self.groups = [cells[i::n] for i in range(n)]
        log.info("%s", plan_line(cfg, self.groups))
        self.owner = {c: i for i, group in enumerate(self.groups) for c in group}
        self.hub, self.loop = hub, hub.loop
        self.local = topics.root(cfg.run.name) + "/cell/"
        self.out: list[list[Message]] = [[] for _ in self.groups]
        self.nexts: list[float | None] = [None] * n
        self.finished = False  # finish() stopped the processes (they exit by themselves)
        self.waiting: Callable[[], None] | None = None  # called as this process waits for theirs (the cloud's idle)
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        # the cells' aggregation log, written here from the records they publish (the line order is the order the
        # processes' answers came in, not the one process's; each line is the same)
        self.log = JsonlWriter(output_dir / runfiles.AGGREGATION if output_dir else None, cfg.runtime.max_record_bytes)
        if output_dir is not None:  # (a run without output reads no record: each was opened, for nothing, a round)
            hub.connect("cell-records").subscribe(topics.telemetry_cell(cfg.run.name, "+"), self._logged)
        ctx = worker_context()  # never fork: this process has threads (a fork server, or spawn)
        text = cfg.to_toml()
        try:
            for i, group in enumerate(self.groups):
                mine, theirs = ctx.Pipe()
                proc = launch(ctx, cell_process_main, (theirs, text, group, start_at), f"fedtier-cell-process-{i}")
                theirs.close()  # our copy of its end: EOF reaches us when it dies
                self.procs.append(proc)
                self.conns.append(mine)
        except BaseException:
            self.close()
            raise
        hub.tap = self._tap

    def describe(self, i: int) -> str:
        return f"cell process {i} (pid {self.procs[i].pid}; cells {', '.join(self.groups[i])})"

    def _tap(self, topic: str, payload: bytes | Segments, retain: bool, sender: str) -> None:
        """A message published in the main process: to the process of the cell its topic names, else to all."""
        message = (topic, bytes(payload), retain, sender)
        if topic.startswith(self.local):
            owner = self.owner.get(topic[len(self.local) :].split("/", 1)[0])
            if owner is not None:
                self.out[owner].append(message)
            return
        for out in self.out:
            out.append(message)

    def _logged(self, topic: str, data: bytes) -> None:
        """A record a cell published (its process's own hub checked it): into the aggregation log."""
        self.log.write(open_record(data, topic, None, None))

    def _receive(self, i: int, stall_s: float | None = None) -> tuple[dict[str, Any], memoryview]:
        """Process ``i``'s next frame (beats skipped); a process that died, or (``stall_s``) sent nothing for that
        long (it is killed), raises :class:`CellProcessError` naming it."""
        conn = self.conns[i]
        try:
            while True:
                if stall_s is not None and not conn.poll(stall_s):
                    self.procs[i].kill()
                    raise CellProcessError(
                        f"{self.describe(i)} sent nothing, no answer and no progress beat, for {stall_s:g} s "
                        "(runtime.worker_stall_s): it is stopped, deadlocked or stuck, and was killed"
                    )
                header, body = unframe(conn.recv_bytes())
                if "beat" not in header:
                    break
        except (EOFError, OSError):
            proc = self.procs[i]
            proc.join(5.0)
            raise CellProcessError(f"{self.describe(i)} died with exit code {proc.exitcode}") from None
        except ValueError as exc:  # (a bug of ours: the processes are the run's own)
            raise CellProcessError(f"{self.describe(i)} answered a bad frame: {exc}") from None
        if "fatal" in header:
            raise CellProcessError(f"{self.describe(i)} failed:\n{str(header['fatal']).rstrip()}")
        return header, body

    def _take(self, i: int, stall_s: float | None = None) -> list[Message]:
        """The messages process ``i`` answered (and when its next timer fires)."""
        header, body = self._receive(i, stall_s)
        try:
            msgs = frame_messages(header, body)
            nxt = header.get("next")
            self.nexts[i] = None if nxt is None else float(nxt)
        except (TypeError, ValueError) as exc:
            raise CellProcessError(f"{self.describe(i)} answered a bad frame: {exc}") from None
        return msgs

    def start(self) -> None:
        """Wait for every process's first answer (what its cells published as they started) and deliver it."""
        deliver(self.hub, [m for i in range(len(self.procs)) for m in self._take(i)])
        self.loop.run_due()

    def exchange(self) -> bool:
        """Send each process the present and its messages; deliver their answers; whether any message came back."""
        at = self.loop.now()
        for i, conn in enumerate(self.conns):
            out, self.out[i] = self.out[i], []
            try:
                conn.send_bytes(message_frame({"at": at}, out))
            except OSError:
                self._receive(i)  # raises, naming how it died
        if self.waiting is not None:  # (this process's turn is over while theirs runs)
            self.waiting()
        msgs = [m for i in range(len(self.procs)) for m in self._take(i, self.stall_s)]
        deliver(self.hub, msgs)  # sorted by sender: the order one process gives them
        return bool(msgs)

    def run(self, until: Callable[[], bool]) -> None:
        """Run the split simulation until ``until()`` or nothing is left anywhere (a stall: the caller tells)."""
        while True:
            self.loop.run_due(until)
            if until():
                return
            if self.exchange():
                continue
            times = [t for t in (self.loop.next_timer(), *self.nexts) if t is not None]
            if not times:
                return
            self.loop.advance(min(times))

    def finish(self) -> tuple[list[dict[str, Any]], dict[str, dict[str, int]]]:
        """Stop the processes' cells and devices: the cells' records and the devices' traffic, in topology order
        (as one process lists them)."""
        self.finished = True
        for conn in self.conns:
            conn.send_bytes(frame({"stop": True}))
        records: dict[str, list[dict[str, Any]]] = {}
        traffic: dict[str, dict[str, int]] = {}
        for i in range(len(self.procs)):
            header, _ = self._receive(i, self.stall_s)  # (stopping trains nothing: it owes its answer at once)
            try:
                records.update(header.get("records", {}))
                traffic.update(header.get("traffic", {}))
            except (TypeError, ValueError) as exc:
                raise CellProcessError(f"{self.describe(i)} answered a bad frame: {exc}") from None
        ids = self.topology.devices()
        ordered = sorted(traffic.items(), key=lambda item: ids.position(item[0]) or 0)  # type: ignore[attr-defined]
        return [r for c in self.topology.cell_ids() for r in records.get(c, [])], dict(ordered)

    def close(self) -> None:
        """End the processes: those :meth:`finish` stopped exit by themselves (each waited for a few seconds),
        the others (a run that failed or was interrupted: nothing they hold is needed) are terminated at once;
        idempotent."""
        procs.end(self.procs, grace=5.0 if self.finished else 0.0, what="cell process" if self.finished else "")
        for conn in self.conns:
            conn.close()
        self.conns = []
        self.log.close()
