"""Current-state records: what the cloud and each cell are doing now, retained on ``fedtier/{run}/state/{node}``.

Telemetry records say what happened; a stalled round produces none. So the cloud and the cells publish a
small retained record whenever their phase changes (a round opened, closed, the job ended): the round and
edge round, since when (wall clock), the deadline, and whom they wait for (the first :data:`MAX_WAITING`,
and how many). A monitor started at any time gets the latest one from the broker and can flag a round open
for longer than its deadline. Signed like status records in signed runs (the topic names the signer).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .numbers import finite_number
from .wire import topics
from .wire.envelope import WireError
from .wire.ratelog import RateLimitedLog
from .wire.signed import open_record, seal_record, signer_of

if TYPE_CHECKING:
    from .transport.base import Transport
    from .wire.keys import PublicKeys, Trust

log = logging.getLogger("fedtier.state")
_rejections = RateLimitedLog(log)

MAX_WAITING = 20  # parties named in a state record; the rest only counted
MAX_STATE_BYTES = 64 << 10
PHASES = ("starting", "waiting", "idle", "finished", "stopped", "failed")
"""``waiting``: a round (cloud) or edge round (cell) is open and waits for ``waiting``; ``idle``: between rounds."""


def publish_state(
    transport: Transport,
    run: str,
    node: str,
    phase: str,
    *,
    trust: Trust | None = None,
    waiting: Iterable[str] = (),
    since: float | None = None,
    **extra: Any,
) -> None:
    """Publish (retained, QoS 1) ``node``'s current state: ``phase`` (one of :data:`PHASES`), since when (wall
    clock; default now), whom it waits for, and ``extra`` (``round``, ``edge_round``, ``deadline_s``, ...)."""
    names = sorted(waiting)
    record = {
        "node": node,
        "phase": phase,
        "since": round(time.time() if since is None else since, 3),
        "waiting": names[:MAX_WAITING],
        **({"waiting_count": len(names)} if len(names) > MAX_WAITING else {}),
        **{k: v for k, v in extra.items() if v is not None},
    }
    topic = topics.state(run, node)
    transport.publish(topic, seal_record(record, topic, trust.sign if trust is not None else None), retain=True)


def decode_state(data: bytes, topic: str, keys: PublicKeys | None = None) -> dict[str, Any] | None:
    """A state record, or ``None`` (logged, rate-limited) if it is malformed or, with ``keys``, not signed by the
    node of ``topic``."""
    try:
        record = open_record(
            data, topic, signer_of(topic), keys.verify if keys is not None else None, max_bytes=MAX_STATE_BYTES
        )
    except WireError as exc:
        _rejections.warning("rejected a state record on %s: %s", topic, exc)
        return None
    node = topic.rsplit("/", 1)[-1]
    if record.get("node") != node or record.get("phase") not in PHASES:
        _rejections.warning("rejected a state record on %s: not a state of %s", topic, node)
        return None
    if not _readable(record):
        _rejections.warning("rejected a state record on %s: a field is not what readers take", topic)
        return None
    return record


def _readable(record: dict[str, Any]) -> bool:
    """Whether ``record``'s fields are what readers compute with (its node's word, signed or not: a time of 10**400
    or a ``waiting`` of numbers would make the monitor's frame raise): ``since`` (and ``deadline_s``, ``started``)
    finite numbers (and a job's end's ``accuracy``, ``loss``), ``waiting`` a list of names, ``waiting_count`` a
    count, ``round`` and ``edge_round`` integers."""
    waiting, count = record.get("waiting"), record.get("waiting_count", 0)
    if not isinstance(waiting, list) or not all(isinstance(name, str) for name in waiting):
        return False
    if finite_number(record.get("since")) is None:
        return False
    numbers = ("deadline_s", "started", "accuracy", "loss")  # (the last two: a job's end, its last figures)
    if any(record.get(k) is not None and finite_number(record[k]) is None for k in numbers):
        return False
    rounds = (record.get(k, 0) for k in ("round", "edge_round"))
    return type(count) is int and count >= 0 and all(type(n) is int for n in rounds)
