"""A CPU-burning child for tests that count a live child's CPU time. Its own module, importing nothing heavy: a
spawned child imports the module of its target, and a test module's imports (torch among them) would cost the
child seconds of start-up."""

from __future__ import annotations

import time
from typing import Any


def spin(seconds: float) -> None:
    """Burn ``seconds`` of this process's CPU time."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def spin_then_wait(seconds: float, ready: Any) -> None:
    """Burn ``seconds`` of CPU, set ``ready``, then stay alive (a minute) until terminated."""
    spin(seconds)
    ready.set()
    time.sleep(60)
