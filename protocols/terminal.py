"""Printing on an operator's terminal what other nodes wrote: their reasons, names and status fields are their
word, and a terminal control sequence in one (``ESC ]0;...``, ``ESC [2J``, a C1 ``CSI``) would drive the
operator's terminal. :class:`SafeConsole` shows such characters as escapes (``\\x1b``); every console of the CLI
and the monitor is one."""

from __future__ import annotations

import re
from collections.abc import Iterable

from rich.console import Console, ConsoleOptions, RenderableType
from rich.segment import Segment

UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""C0 controls but tab and newline, DEL, C1 controls, and the bidirectional overrides that reorder a line."""


def printable(text: str) -> str:
    """``text`` with each :data:`UNSAFE` character written as its escape (``\\x1b``, ``\\u202e``)."""
    return UNSAFE.sub(lambda m: ascii(m.group())[1:-1], text)


class SafeConsole(Console):
    """A rich console whose text is :func:`printable`: rich passes ESC and C1 controls through as they are. Only
    rich's own control segments (cursor moves of a live display) keep their codes; styles are rendered after."""

    def render(self, renderable: RenderableType, options: ConsoleOptions | None = None) -> Iterable[Segment]:
        for segment in super().render(renderable, options):
            if segment.control or not UNSAFE.search(segment.text):
                yield segment
            else:
                yield Segment(printable(segment.text), segment.style, segment.control)
