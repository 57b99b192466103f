"""Rejection logging that a flood cannot turn into a denial of service.

A node logs every rejected message with its reason, but a log line costs far more than the rejection
itself (~4 ms against ~0.6 ms with a rich handler on a busy 2-core machine), so a sender of garbage
at 1,000 messages/s would otherwise keep a node busy logging. :class:`RateLimitedLog` logs up to
``burst`` lines per ``window`` seconds and counts the rest; the next line after the window says how
many were left out. The rejections themselves are unaffected (their counts and records).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

DEFAULT_BURST = 100
DEFAULT_WINDOW = 10.0


class RateLimitedLog:
    """``warning(...)`` as ``logger.warning``, at most ``burst`` lines per ``window`` seconds."""

    def __init__(
        self,
        logger: logging.Logger,
        burst: int = DEFAULT_BURST,
        window: float = DEFAULT_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger, self.burst, self.window, self.clock = logger, burst, window, clock
        self._start = clock()
        self._logged = self.suppressed = 0
        self._lock = threading.Lock()

    def warning(self, msg: str, *args: Any) -> None:
        with self._lock:
            now = self.clock()
            left_out = 0
            if now - self._start >= self.window:
                left_out, self.suppressed = self.suppressed, 0
                self._start, self._logged = now, 0
            if self._logged >= self.burst:
                self.suppressed += 1
                return
            self._logged += 1
        if left_out:
            self.logger.warning(
                "%d more rejections were not logged (at most %d lines per %g s)", left_out, self.burst, self.window
            )
        self.logger.warning(msg, *args)
