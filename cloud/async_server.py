"""The cloud runtime of ``algorithm.mode = "async"`` (FedBuff over cells; the maths in
``protocols/algorithms/fedbuff.py``).

Cells push their progress whenever they have some; once ``async_cloud_buffer`` pushes are buffered the cloud makes a
new model version (one round record each, evaluated every ``eval_every`` versions; ``pushes`` in its metrics: how
many it took), taking every push already waiting too, up to a bound (``_version_due``: a cloud slower than its cells
keeps up; a cell's pushes past its share of a version wait for the next, so one flooding pushes passes over no other
cell's), and sends it to the cells whose pushes it used. A push names the cloud version it derives from (``round``
in its header): a future version, or one staler than ``max_staleness``, is rejected and logged. ``run.rounds`` counts
cloud versions. A cell that sends a push of before the last version it was sent again, and has pushed nothing
from that version, came back from a crash and may have lost it: it is sent the current version, once a version
(``RoundCounts.lost_task``, as the cloud of rounds does; ``cell_server.async_recovery``). It checkpoints every
version as the cloud of rounds checkpoints a round, and journals every push it takes, durably before it counts, until
a version applies it (``cloud.async_journal``): ``--resume`` continues from the checkpoint's version with those
pushes buffered again, sends every cell the current version, and a cell that holds it sends its last push again
(one its broker session held for it, acknowledged as held, when the cloud stopped; a push being handled is
acknowledged only once journaled, ``protocols.transport.inbound``: the broker hands it again, if it was one
chunk; a chunked push killed in its handler is lost unless it was the cell's last). A cell whose status
newly asks for a model (``needs_model``: one restarted afresh, or started after the first version went out, which
it never got) is sent the current version too, under the same bound (``RoundCounts.first_resend``). The cells heard
holding a model are journaled too (``PushJournal.holders``): a version to one of them says ``held``, resumed or not,
so a cell restarted without its journal refuses it, saying to resume, rather than stall; and the newest version sent
each cell, before it goes (``PushJournal.sent``): a push from a version never sent its cell is refused, resumed or not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from protocols import runfiles
from protocols.algorithms.fedbuff import FedBuffCloud
from protocols.failures import failed_reason, is_refusal
from protocols.records import BUFFER_FULL
from protocols.rejections import Rejected, RejectKind
from protocols.status import decode_status
from protocols.transport.base import TimerHandle, Transport
from protocols.wire.envelope import WireError
from protocols.wire.messenger import Incoming
from protocols.wire.payload import Payload

from .async_journal import PushJournal
from .parts import resend_on_repeat
from .revocation import refused_revoked, too_few_cells
from .server import CloudServer

log = logging.getLogger("fedtier.cloud")

ASK_WAIT = 1.0
"""Seconds the cloud waits before it answers the ask for a model of a cell it never heard holding one: one just
started may have the start's version in flight (it stops asking once it adopts it)."""


UNACKED_WAITING = 4
"""Pushes past their cell's share (:data:`TAKE_PER_CELL`) that wait behind a version unacknowledged at once, in all:
the broker hands them to a resumed cloud if this one dies before it takes (journals) them. Each keeps a place of the
broker's in-flight window for the cloud (Mosquitto's ``max_inflight_messages``: 20 by default, 64 where fedtier writes
the config; ``protocols.transport.chunk_acks`` keeps 12 for chunks), until the version is made and it is taken: so
few, that a cell flooding pushes cannot fill the window ahead of another cell's push; one more waits acknowledged."""

UNACKED_PER_CELL = 1
"""The most of the :data:`UNACKED_WAITING` places one cell holds: a cell flooding pushes past its share (a node with its
credentials) takes one, and leaves the others to the pushes of other cells waiting at the same time (it took them
all, and another cell's waiting push was acknowledged at once: lost if the cloud died before it took it). It takes
:data:`UNACKED_WAITING` cells flooding so to fill them."""

TAKE_PER_CELL = 32
"""A cloud version takes at most this many pushes of one cell (and at least ``async_cloud_buffer``): the pushes waiting
when it is made, up to this bound a cell; a cell's push past it waits behind the version (``_over_share``), so a cell
flooding pushes never passes over another cell's waiting push. Generous: a bound that binds in an honest job delays
pushes while more wait (walk-through, 2 cells of 2 digits devices over Mosquitto: at 4 a cell staleness still
climbed to max_staleness, 92 pushes refused; at 32 a version took at most 4). It bounds a version's work and its push
journal, not its memory: a cell's pushes from one version are summed as they come (``FedBuffCloud.offer``), so the
buffer holds a model per (cell, base version) whatever the push rate."""


class AsyncCloudServer(CloudServer):
    """The cloud in asynchronous mode; records, evaluation, checkpoints and start-up as :class:`CloudServer`."""

    def __init__(self, transport: Transport, *, fedbuff: FedBuffCloud, **kwargs: Any) -> None:
        super().__init__(transport, role=fedbuff.inner, **kwargs)  # resumed: the checkpoint's model and version
        self.fb = fedbuff
        self.fb.version = self.round
        self._notify = list(self.cells)  # the cells the next model version goes to (all, at the start)
        self._sent: dict[str, int] = {}  # cell -> the newest version sent to it
        path = self.checkpoint.path.with_name(runfiles.CLOUD_JOURNAL) if self.checkpoint is not None else None
        self.journal = PushJournal(path, self.round if self.resumed else None) if path is not None else None
        if self.resumed:  # what the cloud that stopped sent (journaled); not known: the current version to every cell
            known = self.journal.sent if self.journal is not None else None
            self._sent = dict(known) if known is not None else dict.fromkeys(self.cells, self.round)
        self._pushed_from: dict[str, int] = {}  # cell -> the version its last push taken derives from
        self.refusing: dict[str, str] = {}  # cell -> why it refused to work in this job (no version goes to it)
        self._readmitted: dict[str, int] = {}  # cell -> the version in which it last came back after refusing
        self._asking: set[str] = set()  # cells whose latest status asks for a model (``needs_model``)
        self._holding: set[str] = set()  # cells heard holding a model since they last asked
        self._ask_timers: dict[str, TimerHandle] = {}  # cell -> its ask's wait (cancelled at the job's end)
        # cells ever heard holding a model of this job (or pushing: they held one): their versions say so; journaled
        self._held: set[str] = set(self.journal.holders) if self.journal is not None else set()
        self.take_per_cell = max(fedbuff.p.async_cloud_buffer, TAKE_PER_CELL)
        """The most pushes of one cell a version takes (:meth:`_over_share`)."""
        self._version_posted = False  # a version is posted behind the pushes waiting
        self._waiting: dict[str, int] = {}  # cell -> its pushes past its share, waiting behind the version posted
        self._unacked: dict[str, int] = {}  # cell -> ... of them unacknowledged (UNACKED_PER_CELL, UNACKED_WAITING)
        self._handed_back: tuple[str, Callable[[], None]] | None = None  # (cell, ack) of the waiting push handed back
        self._stopped = False  # stopped (a ``--serve`` cloud's loop goes on): it makes no version

    def _begin_round(self) -> None:
        """Send the current version to the cells that need it, and start counting the next record (once per
        version: a push that came before the posted start ran has started it already, see ``_on_report``)."""
        if self._in_round:
            return
        if self.journal is not None:  # (the cells _send_tasks plans: a role plans a task for each)
            self.journal.sending([c for c in self._notify if c in self._allowed()], self.round)
        self._send_tasks(self._notify)
        self._sent.update((cell, self.round) for cell in self.planned)
        self._in_round = True
        self._replay()

    def _replay(self) -> None:
        """Resumed: the pushes journaled for this version when the cloud stopped are taken again, before any other
        (at the start, or before a push its broker session held for it comes in first), as they came first."""
        if self.journal is not None:
            for topic, data in self.journal.replay():
                self._on_report(topic, data)

    def _leave_round(self, cells: list[str]) -> None:
        """Revoked ``cells``: their pushes still buffered are dropped (never aggregated), no version goes to them."""
        gone = set(cells)
        self.fb.buffer.entries = [e for e in self.fb.buffer.entries if e.sender not in gone]
        self._notify = [c for c in self._notify if c not in gone]
        for cell in gone:
            self.counts.devices.pop(cell, None)

    def _on_report(self, topic: str, data: bytes) -> None:
        if self.journal is not None and self.journal.pending:
            self._replay()
        if refused_revoked(self.revoked, topic, self.messenger):
            return
        if self._over_share(topic.split("/")[-2]):
            self._wait_behind(topic.split("/")[-2], topic, data)
            return
        msg = self.messenger.receive(topic, data, kinds=("cell_report",), repeats=True)
        if msg is None or self.finished or self.round >= self.rounds:  # (resumed when done: its finish is posted)
            return
        h, cell = msg.header, topic.split("/")[-2]
        failure = failed_reason(msg.payload)
        if failure is not None:
            self._refuses(topic, cell, msg, failure)
            return
        if msg.repeat:
            self._repeated(cell, msg)
            return
        try:
            if cell not in self.cells or h.sender != cell:
                raise Rejected(RejectKind.WRONG_SENDER, f"push of {h.sender!r} on the topic of cell {cell!r}")
            refused = self._bad_report(cell, msg)  # its cell, and its session in signed runs
            if refused is not None:
                raise refused
            if h.round > self._sent.get(cell, -1):  # a fresher base than it had: a higher staleness weight
                raise Rejected(RejectKind.STALE, f"push of {cell} from version {h.round}, which was never sent to it")
            self.fb.check(cell, h.round, msg.payload)
        except Rejected as exc:
            self.messenger.reject(topic, exc.kind, str(exc), cell)
            if exc.kind == RejectKind.STALE and h.sender == cell and h.round < self.fb.version:
                self._too_stale(cell)
            return
        if (self.started or self.resumed) and not self._in_round:
            # the last version goes out (and its record's counts start) before this push counts; a resumed cloud's
            # cells work on: a push its broker session held for it, before its start, begins the version too
            self._begin_round()
        if self.journal is not None:
            self.journal.taken(self.round, topic, data)  # durable before it counts
        self.fb.offer(cell, h.round, msg.payload)
        self._hold(cell)
        self._pushed_from[cell] = h.round
        self.counts.devices[cell] = self.counts.devices.get(cell, 0) + self._count(cell, msg)
        self._version_due()

    def _over_share(self, cell: str) -> bool:
        """True if a push on ``cell``'s topic must wait behind the version posted: the buffer holds
        :attr:`take_per_cell` pushes of ``cell`` already. It is handed to the loop again, behind the version, and taken
        into the next one (before :meth:`Messenger.receive`: not a repeat then). So a cell flooding pushes takes at most
        its share of a version, and another cell's push waiting when the version came due is taken by it, never passed
        over (a version is only ever made behind the pushes waiting). Not with no version posted (none is coming: the
        cloud stopped, or its rounds are done): taken then, as before. A push waiting so is not journaled yet: the first
        :data:`UNACKED_WAITING` wait unacknowledged (a resumed cloud gets them again), the others are lost if the cloud
        dies before it takes them (only a cell past its share, which no honest job reaches)."""
        if not self._version_posted:
            return False
        return sum(e.pushes for e in self.fb.buffer.entries if e.sender == cell) >= self.take_per_cell

    def _wait_behind(self, cell: str, topic: str, data: bytes) -> None:
        """Hand ``cell``'s push past its share to the loop again, behind the version posted; refused (logged, in the
        version's record) when :attr:`take_per_cell` of its pushes wait so already: a push waiting acknowledged no
        longer holds the broker's in-flight window, so a flooding cell's pushes would pile up in memory a version
        after another (each model-sized). Up to :data:`UNACKED_WAITING` of them (in all, :data:`UNACKED_PER_CELL` a
        cell) wait unacknowledged, the broker handing them to a resumed cloud if this one dies first: acknowledged
        once taken (journaled), or refused; past that they wait acknowledged (lost if the cloud dies first). A push
        handed back and still past its share waits again (its acknowledgement kept). In a signed run a push waits
        only once signed by ``cell``: a node signing pushes on another cell's topic (a broker without the provisioned
        ACL) filled that cell's waiting count and its unacknowledged place, and the cell's own next push was refused."""
        if (forged := self._not_signed_by(cell, topic, data)) is not None:
            self.messenger.reject(topic, forged.kind, str(forged), None)
            return
        waiting = self._waiting.get(cell, 0)
        if waiting >= self.take_per_cell:
            why = (
                f"push of {cell} past its share of version {self.round}, with {waiting} more waiting: pushing too fast"
            )
            self.messenger.reject(topic, RejectKind.BOUND, why, cell)
            return
        self._waiting[cell] = waiting + 1
        ack = None
        if self._handed_back is not None and self._handed_back[0] == cell:  # this push's: handed back, it waits again
            ack, self._handed_back = self._handed_back[1], None
        unacked = self._unacked.get(cell, 0)
        if ack is None and unacked < UNACKED_PER_CELL and sum(self._unacked.values()) < UNACKED_WAITING:
            ack = self.transport.keep_ack()
            self._unacked[cell] = unacked + (ack is not None)

        def again() -> None:
            self._waiting[cell] -= 1
            self._handed_back = (cell, ack) if ack is not None else None
            try:
                self._on_report(topic, data)
            finally:
                left, self._handed_back = self._handed_back, None
                if left is not None:  # taken (journaled), refused or dropped: acknowledged
                    self._unacked[cell] -= 1
                    left[1]()

        self.loop.post(self._guard(again, "report handler"))

    def _not_signed_by(self, cell: str, topic: str, data: bytes) -> WireError | Rejected | None:
        """Why a push on ``cell``'s topic is not ``cell``'s (signed runs: a bad signature, another sender), else
        ``None`` (an unsigned run: no node's word is checked)."""
        if self.trust is None:
            return None
        try:
            sender = self.messenger.authentic(topic, data, ("cell_report",)).sender
        except WireError as exc:
            return exc
        return None if sender == cell else Rejected(RejectKind.WRONG_SENDER, f"push of {sender!r} on {cell!r}'s topic")

    def _version_due(self) -> None:
        """Once the buffer holds ``async_cloud_buffer`` pushes, post the version behind the pushes already waiting
        (handed to the loop while the cloud was busy, e.g. evaluating the last version): it takes them all, up to
        :attr:`take_per_cell` a cell (:meth:`_over_share`). So a cloud slower than its cells' pushes absorbs them all, a
        version at a time, rather than queueing them ever staler (FedBuff's server takes what is buffered; the
        staleness weight of each push is its own), and a cell pushing fast can neither grow a version's work without
        bound nor make a version at once, ahead of another cell's waiting push."""
        if self.fb.buffer.full and not self._version_posted:
            self._version_posted = True
            self.loop.post(self._guard(self._posted_version, "cloud version"))

    def _posted_version(self) -> None:
        self._version_posted = False
        self._make_version()

    def _make_version(self) -> None:
        """A new cloud version from the pushes buffered (if still ``async_cloud_buffer`` or more: a revoked cell's
        are dropped), recorded with how many it took (``pushes``), checkpointed, and sent to the cells it used."""
        if not self.fb.buffer.full or self.finished or self._stopped or self.round >= self.rounds:
            return
        updates = [(e.sender, e.delta) for e in self.fb.buffer.entries]
        out = self.fb.aggregate(self._version_bound)
        self._notify = sorted(set(out.senders))
        self._in_round = False
        self._record_round(BUFFER_FULL, self._notify, [], out, updates, "version")  # checkpointed: buffer in model
        if self.journal is not None:
            self.journal.applied(self.round)

    def _version_bound(self, cell: str) -> float | None:
        """The most one version weighs ``cell``: what ``async_cloud_buffer`` of its pushes may claim (each at most its
        bound, ``cloud.parts.report_refusal``), as when a version took that many; ``None`` with no bound known."""
        bound = self.cell_bounds.get(cell) if self.cell_bounds is not None else None
        if bound is None:
            return None
        return bound * self.role.weight_keys().get("weight", 1.0) * self.fb.p.async_cloud_buffer

    def _refuses(self, topic: str, cell: str, msg: Incoming, why: str) -> None:
        """``cell``'s "failed" push, saying ``why`` (``cell_server.async_server``): a handler of it raised (a bug), and
        with ``runtime.fail_on_cell_failure`` the job fails with it, as the cloud of rounds does; else, or when the
        cell refuses to work in this job (``protocols.failures.is_refusal``: restarted without its journal), it is
        left out of the job (no version goes to it; the record of the version open lists it in ``cells_failed``)
        until its status says it no longer refuses (:meth:`_readmit`), and with fewer cells left than
        ``runtime.min_cells`` the job fails, saying so."""
        refused = (
            Rejected(RejectKind.WRONG_SENDER, f"push of {msg.header.sender!r} on the topic of cell {cell!r}")
            if cell not in self.cells or msg.header.sender != cell
            else self._bad_report(cell, msg)
        )
        if refused is not None:
            self.messenger.reject(topic, refused.kind, str(refused), cell)
            return
        refusal = is_refusal(msg.payload)
        if not refusal and self.fail_on_cell_failure:  # the job cannot go on as planned
            self.fail(f"cell {cell} failed at version {msg.header.round}: {why}")
            return
        if cell in self.refusing:
            return
        if (self.started or self.resumed) and not self._in_round:
            self._begin_round()  # the version open records it
        self.refusing[cell] = why
        self.counts.cells_failed[cell] = why
        self._notify = [c for c in self._notify if c != cell]
        what = "refuses to work" if refusal else "failed"
        log.error("cloud: cell %s %s (left out of the job: no version goes to it): %s", cell, what, why)
        out = {**self.revoked, **self.refusing}
        failure = too_few_cells(
            self.cells, out, self.stall.min_cells, [cell], f"{'refused to work' if refusal else 'failed'} ({why})"
        )
        if failure is not None:
            self.fail(failure)

    def _readmit(self, cell: str, status: dict[str, Any]) -> bool:
        """``cell`` refused to work; True if its ``status`` says it is back in the job: online and refusing no more
        (a new start of it: restarted with its journal and ``--resume``, as its reason said), at most once a version
        (a cell that refuses again, on the next version it is sent, is left out again: once a version too)."""
        if (
            status.get("state") != "online"
            or status.get("refused") is not None
            or self._readmitted.get(cell) == self.round
        ):
            return False
        self._readmitted[cell] = self.round
        del self.refusing[cell]
        log.warning("cloud: cell %s no longer refuses to work (restarted): back in the job", cell)
        return True

    def _allowed(self) -> set[str]:
        """As the cloud of rounds, less the cells that refused to work."""
        return super()._allowed() - self.refusing.keys()

    def stop(self, idle_heartbeat: float | None = None) -> None:
        super().stop(idle_heartbeat)
        self._stopped = True  # a version posted (or a push handed to the loop) makes none: journaled, for --resume
        self._cancel_asks()
        if self.journal is not None:
            self.journal.close()

    def _finish(self) -> None:
        self._cancel_asks()
        super()._finish()

    def _cancel_asks(self) -> None:
        """The asks' waits are cancelled: each holds this server, and a ``--serve`` cloud's loop outlives the job."""
        for handle in self._ask_timers.values():
            self.loop.cancel(handle)
        self._ask_timers.clear()

    def _repeated(self, cell: str, msg: Incoming) -> None:
        """A push handled before, again: a cell back from a crash that may have lost the last version it was sent
        is sent the current one (:func:`cloud.parts.resend_on_repeat`, as the cloud of rounds)."""
        if self.started and not self._in_round:
            self._begin_round()  # the last version goes out (and its record's counts start) first, as for a push
        sent = self._sent.get(cell, -1)
        awaited = {cell} if self._pushed_from.get(cell, -1) < sent else set()  # nothing pushed from it yet
        if resend_on_repeat(self.counts, self.messenger, msg, sent, awaited):
            self._resend(cell)

    def _too_stale(self, cell: str) -> None:
        """``cell``'s push was refused as too stale: it works from a version it was sent long ago (it missed the later
        ones, or restarted with an old one), and, its pushes never used, would never be sent another: it is sent the
        current version unless it already was, once a version (``RoundCounts.first_resend``)."""
        if not self.started or self.finished or cell in self.revoked:
            return
        if not self._in_round:
            self._begin_round()  # the last version goes out (and its record's counts start) first, as for a push
        if self._sent.get(cell, -1) < self.round and self.counts.first_resend(cell):
            log.warning("cloud: %s pushes from a version too old: version %d sent", cell, self.round)
            self._resend(cell)

    def tasks_again(self, cells: Iterable[str] | None = None) -> None:
        """Nothing here: a cell of an asynchronous job that lacks the current version asks for it."""

    def _send_task(self, cell: str, again: bool = False) -> None:
        """As the cloud of rounds; a version to a cell heard holding one before says so (``held`` in its meta): a
        cell whose first model it is restarted, and must know from its journal the versions its devices had
        (``cell_server.async_server``)."""
        task = self.counts.tasks[cell]
        if cell in self._held and task.meta.get("held") is not True:
            self.counts.tasks = {**self.counts.tasks, cell: Payload({**task.meta, "held": True}, task.tensors)}
        super()._send_task(cell, again)

    def _resend(self, cell: str) -> None:
        """Send ``cell`` the current version (again), unless it refused to work."""
        if cell in self.refusing:
            return
        self.counts.tasks = {**self.counts.tasks, **self.role.plan(self.round, [cell])}
        if self.journal is not None:
            self.journal.sending([cell], self.round)
        self._send_task(cell, again=self._sent.get(cell, -1) >= self.round)  # it was sent this version: a resend
        self._sent[cell] = self.round

    def _on_status(self, topic: str, data: bytes) -> None:
        """As the cloud of rounds; and a cell whose status newly asks for a model is sent the current version, once
        a version (a heartbeat repeating the ask is not a new one): at once from a cell heard holding one before (it
        restarted afresh), else after :data:`ASK_WAIT` if it still asks (a cell that just started may have the
        start's version in flight)."""
        super()._on_status(topic, data)
        node = topic.rsplit("/", 1)[-1]
        cell = node[len("cell.") :] if node.startswith("cell.") else ""
        record = decode_status(data, topic, self.trust) if cell in self.cells else None
        if record is None or cell in self.revoked or record.get("session", self.session) != self.session:
            return
        if cell in self.refusing and not self._readmit(cell, record):
            return
        if record.get("state") != "online":
            self._asking.discard(cell)
        elif record.get("needs_model") is not True:
            self._asking.discard(cell)
            self._holding.add(cell)
            self._hold(cell)
        elif cell not in self._asking:
            self._asking.add(cell)
            if cell in self._holding:
                self._holding.discard(cell)
                self._send_asked(cell)
            else:
                self.loop.cancel(self._ask_timers.get(cell))
                asked = self._guard(lambda: self._send_asked(cell), "model resend")
                self._ask_timers[cell] = self.loop.call_later(ASK_WAIT, asked)

    def _hold(self, cell: str) -> None:
        """``cell`` holds a model of this job (journaled: a resumed cloud still knows, see ``_send_task``)."""
        self._held.add(cell)
        if self.journal is not None:
            self.journal.holding(cell)

    def _send_asked(self, cell: str) -> None:
        """``cell`` asks for a model: send it the current version (once a version: ``RoundCounts.first_resend``)."""
        self.loop.cancel(self._ask_timers.pop(cell, None))  # its wait is over, or no longer needed
        if cell not in self._asking or not self.started or self.finished or cell in self.revoked:
            return  # it has one by now, or the start sends every cell the first
        if not self._in_round:
            self._begin_round()  # the last version goes out (and its record's counts start) first, as for a push
            if cell in self.planned:
                return  # it just went to this cell
        if self.counts.first_resend(cell):
            log.warning(
                "cloud: %s asks for a model (restarted afresh or started late): version %d sent", cell, self.round
            )
            self._resend(cell)
