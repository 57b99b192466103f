"""Idempotent receipt: remember recent message ids so a redelivered message is handled once."""

from __future__ import annotations

from collections import OrderedDict


class SeenIds:
    """A bounded set of recently seen message ids (oldest forgotten first)."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def first_time(self, msg_id: str) -> bool:
        """True the first time ``msg_id`` is seen, False for a duplicate."""
        if msg_id in self._ids:
            return False
        self._ids[msg_id] = None
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
        return True

    def forget(self, msg_id: str) -> None:
        """Take ``msg_id`` as new when it comes again."""
        self._ids.pop(msg_id, None)
