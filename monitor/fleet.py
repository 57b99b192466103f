"""The fleet view: every node of a federation from its retained, signed status records.

Each node (the cloud, every cell, every device) keeps a retained status on the broker: online (serving
a job), idle (a long-lived node up between jobs) or offline, and the capabilities it announced
(``protocols.capabilities``: agents always, the cloud and cells while idle). A reader that
subscribes gets them all at once, then each heartbeat as it comes, so the view says which nodes are up,
when each was last heard (while the view listens), what each runs and can do, and which job the cloud
is running. With the federation's public keys a record counts only if the node its topic names signed
it; others are counted as refused, with the reason, and never shown as a node. With them too, the view
reads the federation's signed roster (published by the cloud): a member never heard from (enrolled, never
started) is listed as never seen, and every node it lists as revoked is shown revoked, whether the broker still
holds its status or not (a revoked cell's is never cleared and says online or idle; a revoked device's is cleared by
its cell): its key forgotten, its records no longer counted as refused, and it no longer counted among the nodes
expected online. The roster records the cell each revoked node was in, so its role and cell are shown; a roster
signed before it recorded them names a revoked node by its id only: then they are shown when the view learned them
(from a status, or an earlier roster), else left blank.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from protocols.failures import MAX_REASON
from protocols.numbers import finite_number
from protocols.status import IDLE, decode_status, idle_deadline, published_age
from protocols.wire import topics

if TYPE_CHECKING:
    from protocols.transport.base import Transport
    from protocols.wire.keys import PublicKeys

ROLE_ORDER = {"cloud": 0, "cell": 1, "device": 2}
UNSEEN = "never seen"  # a member of the roster without a status
REVOKED = "revoked"  # a node the signed roster revoked (its status retained or not)


@dataclass
class NodeView:
    """What the fleet knows of one node."""

    node: str
    role: str
    cell: str | None
    state: str
    record: dict[str, Any]
    first_heard: float
    last_heard: float
    updates: int = 1

    @property
    def caps(self) -> dict[str, Any]:
        caps = self.record.get("caps")
        return caps if isinstance(caps, dict) else {}

    @property
    def up(self) -> bool:
        """Its process runs: online in a job, or idle between jobs."""
        return self.state in ("online", IDLE)

    def stale(self, now: float) -> bool:
        """Idle, and the heartbeat its record declares missed ``IDLE_MISSED`` times: the node is gone (its will
        lost), so it is shown offline."""
        until = idle_deadline(self.last_heard, self.record.get("heartbeat")) if self.state == IDLE else None
        return until is not None and now > until

    def state_at(self, now: float) -> str:
        """Its state as shown at ``now``: the record's, or ``offline`` once :meth:`stale`."""
        return "offline" if self.stale(now) else self.state

    def unfit(self) -> dict[str, str] | None:
        """The job an idle device said it cannot serve, and why (``{"job", "reason"}``, each its word cut at
        ``MAX_REASON`` as its cell keeps it: a 64 KB reason was a table of thousands of lines), or None."""
        unfit = self.record.get("unfit")
        if self.state != IDLE or not isinstance(unfit, dict):
            return None
        job, reason = str(unfit.get("session", "")).split(".")[0], str(unfit.get("reason", ""))
        return {"job": job[:MAX_REASON], "reason": reason[:MAX_REASON]}

    def refused(self) -> str | None:
        """Why a cell online in a job refuses to work in it (its status's ``refused``, cut at ``MAX_REASON``), or
        None."""
        why = self.record.get("refused")
        return str(why)[:MAX_REASON] if self.state == "online" and why is not None else None

    def as_dict(self, now: float) -> dict[str, Any]:
        """A row for ``--json``: the node, its state, when last heard (seconds ago), versions, capabilities."""
        caps = self.caps
        return {
            "node": self.node,
            "role": self.role,
            "cell": self.cell,
            "state": self.state_at(now),
            "online": self.up and not self.stale(now),  # idle counts: the node is up, between jobs
            "idle_heartbeat_missed": self.stale(now),
            "heard_s_ago": round(now - self.last_heard, 3) if self.updates else None,  # None: never seen
            "heartbeats_seen": max(0, self.updates - 1),
            "fedtier": caps.get("fedtier"),
            "wire": caps.get("wire"),
            "capabilities": {k: v for k, v in caps.items() if k not in ("fedtier", "wire")},
            "samples": self.record.get("samples"),
            "session": self.record.get("session"),
            "cannot_serve": self.unfit(),
            "refused": self.refused(),
            "devices_online": self.record.get("devices_online"),
            "devices_total": self.record.get("devices_total"),
        }


@dataclass
class Fleet:
    """Nodes by id, fed by :meth:`on_status` (any thread); :attr:`refused` counts records that failed checks."""

    run: str
    keys: PublicKeys | None = None
    clock: Any = time.monotonic
    nodes: dict[str, NodeView] = field(default_factory=dict)
    received: int = 0
    members: dict[str, str | None] = field(default_factory=dict)  # node -> its cell, from the signed roster
    revoked: frozenset[str] = frozenset()  # the nodes the signed roster revoked
    roster_version: int | None = None  # of the newest roster taken: an older one (a replay) is refused
    _refusals: Counter[str] = field(default_factory=Counter)  # topic's node (or "" for a roster) -> refused records
    _unverified: set[str] = field(default_factory=set)  # the nodes whose held status was refused
    _known: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # any node seen -> (role, cell)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def refused(self) -> int:
        """Records refused (forged, unsigned, a roster not the cloud's), a revoked node's own excepted: it is shown
        revoked."""
        return sum(n for node, n in self._refusals.items() if node not in self.revoked)

    def start(self, transport: Transport) -> Fleet:
        """Subscribe to every status topic of the run on ``transport`` (retained records arrive at once), and
        with keys to the federation's signed roster."""
        transport.subscribe(topics.statuses(self.run), self.on_status)
        transport.subscribe(topics.device_statuses(self.run), self.on_status)
        if self.keys is not None:
            from protocols.roster import roster_topic

            transport.subscribe(roster_topic(self.run), self.on_roster)
        return self

    def on_roster(self, _topic: str, data: bytes) -> None:
        """The cloud's signed roster: its cells and devices are the members the view lists, heard from or not."""
        from protocols.roster import RosterError, newer_roster

        if not data or self.keys is None:
            return
        try:
            roster = newer_roster(data, self.keys.verify, self.run, self.roster_version)
        except RosterError:
            with self._lock:
                self._refusals[""] += 1
            return
        if roster is None:  # the one held, delivered again
            return
        with self._lock:
            self.members = {"cloud": None} | {c: c for c in roster.cells}
            self.members |= {d: c for c in roster.cells for d in roster.members(c)}
            self._known |= {n: (_role(n, c), c) for n, c in self.members.items()}
            self._known |= {n: (_role(n, c), c) for n, c in roster.revoked_in.items()}
            self.revoked, self.roster_version = roster.revoked, roster.version
            self.keys.forget(roster.revoked)  # what a stale keys file still trusts: a revoked node signs nothing

    def on_status(self, topic: str, data: bytes) -> None:
        with self._lock:
            self.received += 1
            node, role, cell = _node_of(topic)
            self._known[node] = (role, cell)
            if not data:  # a cleared retained status: the node was removed (revoked)
                self.nodes.pop(node, None)
                self._unverified.discard(node)
                return
            record = decode_status(data, topic, self.keys)
            if record is None:
                self._refusals[node] += 1
                self._unverified.add(node)
                return
            now = self.clock()
            view = self.nodes.get(node)
            if view is None:  # (retained, as a rule: an idle one is aged from its published time)
                heard = now - published_age(record) if record["state"] == IDLE else now
                self.nodes[node] = NodeView(node, role, cell, record["state"], record, now, heard)
            else:
                view.state, view.record, view.last_heard = record["state"], record, now
                view.updates += 1

    def rows(self) -> list[NodeView]:
        """The nodes heard from, the roster's members never heard from (:data:`UNSEEN`), and every node it revoked
        (:data:`REVOKED`): with the status the broker still holds (signed by it, refused now or accepted before the
        roster came), or none (cleared by its cell, or never published)."""
        with self._lock:
            now = self.clock()
            heard = [replace(v, state=REVOKED) if n in self.revoked else v for n, v in self.nodes.items()]
            gone = [  # heard "retained" if its status (refused) is held, else never
                NodeView(n, *self._known.get(n, ("", None)), REVOKED, {}, now, now, int(n in self._unverified))
                for n in sorted(self.revoked)
                if n not in self.nodes
            ]
            unseen = [
                NodeView(n, _role(n, cell), cell, UNSEEN, {}, now, now, 0)
                for n, cell in self.members.items()
                if n not in self.nodes
            ]
            views = [*heard, *gone, *unseen]
        return sorted(views, key=lambda v: (ROLE_ORDER.get(v.role, 3), v.cell or "", v.node))

    def current_job(self) -> str | None:
        """The cloud's current session (``{job}.{config hash}`` in a federation), from its status."""
        cloud = self.nodes.get("cloud")
        session = cloud.record.get("session") if cloud is not None and cloud.state == "online" else None
        return session if isinstance(session, str) else None


def _role(node: str, cell: str | None) -> str:
    """The role of a roster member: the cloud (no cell), a cell (its own), or a device."""
    return "cloud" if cell is None else "cell" if node == cell else "device"


def _node_of(topic: str) -> tuple[str, str, str | None]:
    """``(node id, role, cell)`` of a status topic."""
    parts = topic.split("/")
    name = parts[-1]
    if name == "cloud":
        return "cloud", "cloud", None
    if name.startswith("cell."):
        return name[len("cell.") :], "cell", name[len("cell.") :]
    device = name[len("device.") :] if name.startswith("device.") else name
    return device, "device", parts[-3] if len(parts) >= 4 and parts[-4] == "cell" else None


def _caps_text(caps: dict[str, Any]) -> str:
    """A node's announced capabilities in a few words: ``fedtier 0.1.0, 2 cores, 23.5 GiB, onnx,torch`` (its
    accelerator when it has one); only what it announced, each field its own word (checked, not trusted)."""
    mem = finite_number(caps.get("memory_mb")) if isinstance(caps.get("memory_mb"), int) else None  # its word
    accel = caps.get("gpu") or caps.get("accelerator", "")
    backends = caps.get("backends")
    words = [
        f"fedtier {caps['fedtier']}" if caps.get("fedtier") else "",
        f"{caps['cores']} cores" if caps.get("cores", "") != "" else "",
        f"{mem / 1024:.1f} GiB" if mem is not None else "",
        str(accel) if accel and accel != "none" else "",
        ",".join(map(str, backends)) if isinstance(backends, list) else "",
    ]
    return ", ".join(w for w in words if w)


def render(fleet: Fleet, now: float | None = None) -> Any:
    """The fleet as a rich table (every field escaped: node ids and records come from the network)."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    now = fleet.clock() if now is None else now
    rows = fleet.rows()
    up = sum(v.up and not v.stale(now) for v in rows)
    idle = sum(v.state_at(now) == IDLE for v in rows)
    expected = sum(v.state != REVOKED for v in rows)  # a revoked node is not expected online
    job = fleet.current_job()
    title = f"fleet {escape(fleet.run)}: {up}/{expected} nodes online" + (f" ({idle} idle)" if idle else "")
    title += f", job {escape(job)}" if job else ""
    revoked = sum(v.state == REVOKED for v in rows)
    title += f", {revoked} revoked" if revoked else ""
    if fleet.refused:
        title += f", {fleet.refused} status records refused"
    # at 80 columns (a narrow terminal) the node, its role, cell, state and when it was heard stay whole: only the
    # capabilities and the detail wrap onto more lines (no vertical rules, one space between columns)
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("node", "role", "cell", "state", "heard", "capabilities", "detail"):
        table.add_column(col, no_wrap=col not in ("capabilities", "detail"), overflow="fold")
    for v in rows:
        heard = f"{now - v.last_heard:.1f}s ago" if v.updates > 1 else "retained" if v.updates else "never"
        detail = ""
        if v.role == "cell" and "devices_total" in v.record:
            detail = f"{v.record.get('devices_online')}/{v.record.get('devices_total')} devices online"
            detail += f"; refuses to work: {v.refused()}" if v.refused() else ""
        elif v.role == "device":
            unfit = v.unfit()
            said = [f"{v.record['samples']} samples"] if "samples" in v.record else []
            detail = "; ".join(said + ([f"cannot serve {unfit['job']}: {unfit['reason']}"] if unfit else []))
        state = {IDLE: "online, idle", "offline": "offline"}.get(v.state_at(now), v.state)
        state += " (idle heartbeat missed)" if v.stale(now) else ""
        table.add_row(
            *(escape(str(x)) for x in (v.node, v.role, v.cell or "", state, heard, _caps_text(v.caps), detail))
        )
    return table
