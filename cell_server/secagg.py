"""The cell's side of secure aggregation at runtime: messages, phase deadlines, the record's numbers.

The protocol (what is checked, what is computed) is ``protocols.privacy.secagg.SecAggCell``; this class
moves its messages and decides when each phase ends: the key and share phases when every device
expected answered or after ``privacy.secagg_deadline`` seconds; the result phase is the cell's usual
one (all answered, quorum or ``runtime.device_deadline`` from the tasks); the consistency round and the
unmasking phase each when every survivor answered or after ``secagg_deadline``. Extra messages travel on
the existing topics: to a device on its task topic, from a device on its result topic. Nothing secret is
logged: the records carry counts, and a rejection's reason names the message, never its content.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from protocols.algorithms.base import CellRole
from protocols.answers import Answers, sender_refusal
from protocols.privacy.secagg import (
    Phase,
    RoundId,
    SecAggCell,
    SecAggFailure,
    SecAggSettings,
    masked_layout,
    unflatten,
)
from protocols.rejections import Rejected, RejectKind
from protocols.round_text import nth_edge
from protocols.wire import topics
from protocols.wire.messenger import Messenger
from protocols.wire.payload import Payload

from .parts import CellLimits, EdgeRound

if TYPE_CHECKING:
    from protocols.transport.base import EventLoop, TimerHandle
    from protocols.wire.envelope import MessageKind
    from protocols.wire.messenger import Incoming


log = logging.getLogger("fedtier.cell")


class Host(Protocol):
    """What secure aggregation needs of its cell server (``cell_server.server.CellServer`` is one): where the
    edge round is, its answers and its state (``edge``: absent devices, traffic, the results that close
    it), the cell's limits (quorum) and weight bounds, and the two steps it takes: close the edge round, and
    aggregate the unmasked results (``_aggregate``: private, as tests patch it to fail a cell)."""

    run: str
    cell: str
    round: int
    edge_round: int
    loop: EventLoop
    role: CellRole
    messenger: Messenger
    answers: Answers
    edge: EdgeRound
    limits: CellLimits

    def weight_bound(self, device: str) -> float | None: ...

    def _aggregate(self, why: str, results: dict[str, Payload], extra: dict[str, Any] | None = None) -> None: ...

    def close_edge(self, rnd: int, edge_round: int, why: str) -> None: ...


_ADD = {
    "secagg_keys": "add_keys",
    "secagg_shares": "add_shares",
    "secagg_consent": "add_consent",
    "secagg_reveal": "add_reveal",
}


class CellSecAgg:
    """Secure aggregation of one cell server's edge rounds."""

    def __init__(self, server: Host, settings: SecAggSettings, deadline: float) -> None:
        self.server, self.settings, self.deadline = server, settings, deadline
        self.state: SecAggCell | None = None
        self.key: tuple[int, int] | None = None
        self.failed: str | None = None
        self._timer: TimerHandle | None = None
        self._why = ""

    # ---------------------------------------------------------------- phases
    def begin(self, planned: list[str]) -> None:
        """The tasks of an edge round went out: wait for the planned devices' keys."""
        s = self.server
        self.cancel()
        self.key, self.failed = (s.round, s.edge_round), None
        self.state = SecAggCell(
            self.settings,
            RoundId(s.run, s.cell, s.round, s.edge_round),
            planned,
            weight_bound=s.weight_bound,
        )
        if planned:
            self._arm(Phase.KEYS)

    def _arm(self, phase: Phase) -> None:
        self.server.loop.cancel(self._timer)
        self._timer = self.server.loop.call_later(self.deadline, functools.partial(self._timeout, self.key, phase))

    def cancel(self) -> None:
        self.server.loop.cancel(self._timer)
        self.state = None

    def _timeout(self, key: tuple[int, int] | None, phase: Phase) -> None:
        if self.state is None or key != self.key or self.state.phase != phase:
            return
        self._advance()

    def _advance(self) -> None:
        """Close the current phase (everybody answered, or its deadline passed) and open the next."""
        st = self.state
        assert st is not None
        try:
            if st.phase == Phase.KEYS:
                self._send("secagg_roster", st.rosters())
                self._arm(Phase.SHARES)
            elif st.phase == Phase.SHARES:
                self.server.loop.cancel(self._timer)
                self._send("secagg_routed", st.routes())  # the result phase: the cell's deadline or quorum
                self._expect_results(st)
            elif st.phase == Phase.CONSENT:
                self._send("secagg_views", st.views())
                self._arm(Phase.REVEAL)
            elif st.phase == Phase.REVEAL:
                self.server.loop.cancel(self._timer)
                self._finish()
        except SecAggFailure as exc:
            self._fail(str(exc))

    def _expect_results(self, st: SecAggCell) -> None:
        """Only devices whose shares arrived can send a result: the others are absent already."""
        s = self.server
        for d in sorted(s.answers.pending - set(st.shared)):
            s.answers.pending.discard(d)
            s.edge.absent[d] = "no secagg keys" if d not in st.keys else "no secagg shares"
        s.edge.needed = math.ceil(s.limits.quorum * len(st.shared))

    def _send(self, kind: MessageKind, messages: Mapping[str, Payload]) -> None:
        s = self.server
        for d, payload in sorted(messages.items()):
            s.edge.bytes_out += s.messenger.send(
                topics.device_task(s.run, s.cell, d),
                kind,
                payload,
                round=s.round,
                edge_round=s.edge_round,
                cell=s.cell,
            )

    def _fail(self, why: str) -> None:
        """Give the edge round up: logged, recorded, nothing aggregated; the next one starts as usual."""
        assert self.key is not None  # set when the aggregation began
        log.warning("cell %s: secure aggregation of round %s failed: %s", self.server.cell, nth_edge(*self.key), why)
        self.failed = why
        if self.state is not None and self.state.phase != Phase.FAILED:
            self.state.phase = Phase.FAILED
        if self.server.answers.is_open:  # still collecting results: close the edge round now
            self.server.close_edge(self.server.round, self.server.edge_round, "secure aggregation failed")
        else:
            self._record_failure()

    def _record_failure(self) -> None:
        self.server.loop.cancel(self._timer)
        stats = self._stats()
        stats["failed"] = self.failed
        self.state = None
        self.server._aggregate("secure aggregation failed", {}, {"secagg": stats})

    def _stats(self) -> dict[str, Any]:
        st = self.state
        if st is None:
            return {}
        return {
            "keys": len(st.keys),
            "shared": len(st.sealed),
            "survivors": len(st.survivors),
            "dropped": len(st.dropped),
            "consents": len(st.consents),
            "reveals": len(st.reveals),
        }

    # ---------------------------------------------------------------- messages
    def on_message(self, topic: str, device: str, msg: Incoming) -> None:
        """A ``secagg_*`` message from ``device`` (its result topic)."""
        s, h = self.server, msg.header
        wrong = sender_refusal("device", device, h.sender)
        if wrong is not None:
            s.messenger.reject(topic, wrong.kind, str(wrong), device)
            return
        if self.state is None or (h.round, h.edge_round) != self.key:
            s.messenger.reject(
                topic,
                RejectKind.STALE,
                f"{h.kind} for round {nth_edge(h.round, h.edge_round)}, not the current aggregation "
                "(stale or replayed)",
                device,
            )
            return
        method = _ADD.get(h.kind)
        if method is None:
            s.messenger.reject(topic, RejectKind.MALFORMED, f"unexpected message kind {h.kind!r} from a device", device)
            return
        try:
            getattr(self.state, method)(device, msg.payload)
        except Rejected as exc:
            s.messenger.reject(topic, exc.kind, str(exc), device)
            return
        s.edge.bytes_in += msg.nbytes
        st = self.state
        if st.keys_complete or st.shares_complete or st.consents_complete or st.reveals_complete:
            self._advance()

    def check(self, device: str, result: Payload) -> None:
        """A masked ``device_result``: its vector fits its layout and (unmasked shapes) the cell role, judged
        first, in any phase (a late answer is refused for what it holds); then it fits the protocol's phase."""
        layout = masked_layout(result)
        zeros = unflatten(np.zeros(sum(int(np.prod(s)) for _, s in layout)), layout)
        self.server.role.check(device, Payload({"weight": result.meta.get("weight")}, zeros))
        if self.state is None:
            raise Rejected(RejectKind.OUT_OF_ORDER, "secure aggregation: no aggregation in progress")
        self.state.check_masked(device, result)

    def unmask(self, results: Mapping[str, Payload], why: str) -> None:
        """The result phase closed with ``results`` (masked): ask the survivors for their shares."""
        st = self.state
        if self.failed is not None:
            self._record_failure()
            return
        if st is None or st.phase != Phase.MASKED:
            self.failed = f"the result phase closed ({why}) before the shares were routed"
            self._record_failure()
            return
        st.masked = dict(results)
        self._why = why
        try:
            self._send("secagg_unmask", st.unmask_requests())
        except SecAggFailure as exc:
            self.failed = str(exc)
            self._record_failure()
            return
        self._arm(Phase.CONSENT)

    def _finish(self) -> None:
        st = self.state
        assert st is not None
        out = st.finish()  # SecAggFailure: handled by _advance
        self.state = None
        total = sum(out.weights.values())
        mean = {k: (v / total).astype(np.float32) for k, v in out.weighted_sum.items()}
        # the role sees every survivor with the cell's mean update and its own weight: its weighted
        # mean is then that mean, and its per-device bookkeeping (weights, uploads) stays right
        results = {d: Payload({"weight": w}, mean) for d, w in sorted(out.weights.items())}
        self.server._aggregate(self._why, results, {"secagg": out.stats})
