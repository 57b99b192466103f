"""Printing on an operator's terminal what other nodes wrote: their reasons, names and status fields are their
word, and a terminal control sequence in one (``ESC ]0;...``, ``ESC [2J``, a C1 ``CSI``) would drive the
operator's terminal. :class:`SafeConsole` shows such characters as escapes (``\\x1b``, by
:func:`protocols.safe_text.printable`, the rule log lines follow too); every console of the CLI and the monitor
is one."""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console, ConsoleOptions, RenderableType
from rich.segment import Segment

from protocols.safe_text import UNSAFE, printable


class SafeConsole(Console):
    """A rich console whose text is :func:`printable`: rich passes ESC and C1 controls through as they are. Only
    rich's own control segments (cursor moves of a live display) keep their codes; styles are rendered after."""

    def render(self, renderable: RenderableType, options: ConsoleOptions | None = None) -> Iterable[Segment]:
        for segment in super().render(renderable, options):
            if segment.control or not UNSAFE.search(segment.text):
                yield segment
            else:
                yield Segment(printable(segment.text), segment.style, segment.control)
