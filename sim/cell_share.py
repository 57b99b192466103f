"""One cell process of ``fedtier sim`` (``runtime.cell_processes``): a fixed share of the cells with their devices
(and their training, in this process) on a virtual loop of its own, trading the cloud's messages with the main
process, which runs the cloud (``sim/cell_processes.py``, the protocol both sides follow).

A frame from the main process is ``{"at": t, "msgs": [[topic, nbytes, retain, sender], ...]}`` with the messages'
encoded bytes one after the other (``sim/worker_frames.py``; nothing is pickled): the process moves its clock to ``t``,
delivers them (sorted by sender, as every side of a split run and a one-process run's loop orders what crosses to it:
:func:`deliver`), runs everything due then and answers likewise with what its nodes published for the cloud and
``"next"``, when its next timer fires; while it trains, ``{"beat": true}`` every few seconds. ``{"stop": true}``
ends it: its cells and devices stop and it answers its cells' records and its devices' traffic (JSON). The first
answer, unasked, is what its cells published as they started. An exception answers ``{"fatal": traceback}`` and
ends the process.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import tomllib
import traceback
from collections.abc import Sequence
from typing import Any

from edge_agent.agent import DeviceAgent
from protocols import directions
from protocols.algorithms.base import CellRole
from protocols.config import RunConfig, parse_config
from protocols.execution import ExecutionPlan, execution_plan, shared_threads
from protocols.heap import setup_frozen
from protocols.trainer import PROGRESS
from protocols.transport.memory import MemoryHub, VirtualLoop
from protocols.wire import topics
from protocols.wire.envelope import Segments

from .attack import attacked, byzantine_devices
from .cell_sums import cell_sums
from .clock import sim_clock
from .device_worker import set_torch_threads
from .executors import make_executor
from .hierarchy import prepare
from .population import Population
from .sim_cells import build_sim_cells
from .worker_context import become_worker
from .worker_frames import frame, unframe
from .worker_watch import check_period

Message = tuple[str, bytes, bool, str]  # topic, encoded bytes, retain, sender (its client id)


def message_frame(header: dict[str, Any], msgs: Sequence[Message]) -> bytes:
    """``header`` with ``msgs`` (their topics, sizes, retain flags and senders in it, their bytes as the body)."""
    return frame({**header, "msgs": [[t, len(p), r, s] for t, p, r, s in msgs]}, [m[1] for m in msgs])


def frame_messages(header: dict[str, Any], body: memoryview) -> list[Message]:
    """The messages of a :func:`message_frame`; a malformed list, or a body longer or shorter than its messages,
    raises ``ValueError``."""
    out: list[Message] = []
    at = 0
    for entry in header.get("msgs", ()):
        topic, n, retain, sender = entry if isinstance(entry, list) and len(entry) == 4 else (entry, None, None, None)
        if not (isinstance(topic, str) and isinstance(sender, str) and isinstance(n, int) and 0 <= n <= len(body) - at):
            raise ValueError(f"bad message entry {entry!r}")
        out.append((topic, bytes(body[at : at + n]), bool(retain), sender))
        at += n
    if at != len(body):
        raise ValueError(f"{len(body) - at} bytes past its messages")
    return out


def deliver(hub: MemoryHub, msgs: list[Message]) -> None:
    """Deliver on ``hub`` the messages that crossed to it from the other processes, sorted by sender (stably: each
    sender's in the order it sent them), the order a one-process run's loop gives what crosses between its sides
    (``protocols.transport.memory.VirtualLoop.cross``): so the same as one process, whichever process sent what."""
    for topic, payload, retain, _ in sorted(msgs, key=lambda m: m[3]):
        hub.inject(topic, payload, retain)


def share_plan(cfg: RunConfig) -> ExecutionPlan:
    """How a cell process's devices train: the run's plan, its cohorts with the process's torch threads
    (``runtime.cell_process_threads``, else its share of ``cohort_threads``, at least one)."""
    rt = cfg.runtime
    threads = rt.cell_process_threads or shared_threads(rt.cohort_threads, rt.cell_processes)
    return dataclasses.replace(execution_plan(cfg), threads=threads)


class CellShare:
    """The cells ``cells`` of the run of ``config_text``, their devices and their training, on a loop of their own."""

    def __init__(self, config_text: str, cells: Sequence[str], start_at: float = 0.0) -> None:
        """``start_at``: the virtual time they start at (a resumed run's, as the main process's loop)."""
        from protocols.torch_trainer import TorchTrainer

        set_torch_threads(1)
        self.cfg = cfg = parse_config(tomllib.loads(config_text))
        self.loop = loop = VirtualLoop()
        loop.start_at(start_at)
        prep = prepare(cfg)
        self.clock = clock = sim_clock(cfg, prep)
        self.hub = hub = MemoryHub(loop, link_delay=clock.link_delay if clock.enabled else None)
        spec = prep.spec
        directions.set_prefetch(cfg.runtime.direction_threads > 1)  # (free cores: its cells draw ahead)
        algorithm = cfg.build_algorithm(spec)
        self.cells = build_sim_cells(cfg, hub, algorithm, prep.device_data, None, cells)  # (the main process logs)
        trainer = TorchTrainer.from_spec(
            spec.name, spec.input_shape, spec.num_classes, cfg.runtime.device, **spec.build_kwargs()
        )
        self.byzantine = set(byzantine_devices(cfg))
        self.agents = Population(cfg, hub, algorithm, prep.device_data, lambda _d: trainer, self._configure)
        self.executor = make_executor(share_plan(cfg), self.agents.active(), spec, loop, trainer, None)
        sums = cell_sums(cfg, self.executor, trainer, spec)
        for cell in self.cells.values():
            cell.sums = sums
        self.local = topics.root(cfg.run.name) + "/cell/"  # a cell's own and its devices' topics stay here
        self.out: list[Message] = []
        self.sending = threading.Lock()  # answers and beats share the pipe
        hub.tap = self._tap

    def _configure(self, agent: DeviceAgent) -> None:
        agent.executor = self.executor
        agent.role = attacked(agent.role, agent.device, self.byzantine, self.cfg.attack)
        if self.clock.enabled:
            agent.compute_delay = self.clock.compute_delay

    def _tap(self, topic: str, payload: bytes | Segments, retain: bool, sender: str) -> None:
        if not topic.startswith(self.local):
            self.out.append((topic, bytes(payload), retain, sender))

    def answer(self, conn: Any) -> None:
        """Run what is due now; send what was published for the cloud, and when this process's next timer fires."""
        self.loop.run_due()
        out, self.out = self.out, []
        with self.sending:
            conn.send_bytes(message_frame({"next": self.loop.next_timer()}, out))
        for cell in self.cells.values():  # (their turn is over: work for a later round may start)
            if isinstance(cell.role, CellRole):  # (its idle hook, as the launcher gives the cloud's role)
                cell.role.idle()

    def beat(self, conn: Any, stop: threading.Event) -> None:
        """Every few seconds, a beat to the main process if training moved meanwhile (one stuck sends none: the
        main process ends the run after ``runtime.worker_stall_s`` of silence while it waits for an answer)."""
        last = PROGRESS.steps
        while not stop.wait(check_period(self.cfg.runtime.worker_stall_s)):
            if PROGRESS.steps != last:
                last = PROGRESS.steps
                try:
                    with self.sending:
                        conn.send_bytes(frame({"beat": True}))
                except OSError:  # the main process is gone
                    return

    def serve(self, conn: Any) -> None:
        """Start the cells and devices, then follow the main process's frames until it says stop."""
        stop = threading.Event()
        threading.Thread(target=self.beat, args=(conn, stop), daemon=True).start()
        try:
            self._serve(conn)
        finally:
            stop.set()

    def _serve(self, conn: Any) -> None:
        for cell in self.cells.values():
            cell.start()
        self.agents.start()
        self.answer(conn)
        while True:
            header, body = unframe(conn.recv_bytes())
            if header.get("stop"):
                break
            self.loop.advance(float(header["at"]))
            deliver(self.hub, frame_messages(header, body))
            self.answer(conn)
        records = {c: cell.records for c, cell in self.cells.items()}
        traffic = self.agents.traffic()
        self.agents.stop()
        for cell in self.cells.values():
            cell.stop()
        self.executor.close()
        with self.sending:
            conn.send_bytes(frame({"records": records, "traffic": traffic}))


def cell_process_main(
    conn: Any,
    config_text: str,
    cells: list[str],
    start_at: float = 0.0,
    parent: int | None = None,
    inherited: Any = None,
) -> None:
    """A cell process: build its share, then serve the main process (pid ``parent``; its output and environment:
    ``inherited``) until told to stop (or the main process is gone)."""
    become_worker(parent, inherited)
    try:
        share = CellShare(config_text, cells, start_at)
        with setup_frozen():
            share.serve(conn)
    except (EOFError, BrokenPipeError):
        sys.exit(1)  # the main process is gone
    except BaseException:
        try:
            conn.send_bytes(frame({"fatal": traceback.format_exc()}))
        except OSError:
            pass
        sys.exit(1)
