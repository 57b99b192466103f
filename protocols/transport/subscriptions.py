"""Which MQTT filters a transport subscribes at the broker: one per group of overlapping patterns."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def pattern_covers(wide: str, narrow: str) -> bool:
    """True when every topic matching filter ``narrow`` also matches filter ``wide``."""
    w, n = wide.split("/"), narrow.split("/")
    for i, level in enumerate(w):
        if level == "#":
            return True
        if i >= len(n) or n[i] == "#" or (level != "+" and level != n[i]):
            return False
    return len(w) == len(n)


def broker_filters(subs: Mapping[str, tuple[int, Any]]) -> dict[str, int]:
    """The broker-level subscriptions of ``subs`` (pattern -> (qos, handlers)): the patterns no other one
    covers, each at the highest QoS of the patterns it covers.

    Brokers send one copy per matching subscription, so overlapping filters would double the
    traffic; locally, every matching handler still gets each message.
    """
    wanted: dict[str, int] = {}
    for p, (q, _) in subs.items():
        if not any(o != p and pattern_covers(o, p) for o in subs):
            covered = [cq for c, (cq, _) in subs.items() if pattern_covers(p, c)]
            wanted[p] = max(covered, default=q)
    return wanted
