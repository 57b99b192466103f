"""Peer text made safe to show: a node's reason, name or status field, or an exception quoting one, may carry
terminal control sequences (``ESC ]0;...``, ``ESC [2J``, a C1 ``CSI``) or bidirectional overrides. :func:`printable`
writes them as escapes (``\\x1b``); it is the one rule for the CLI's consoles (``protocols.terminal``) and for every
log handler fedtier sets up (:class:`SafeFormatter`), so a terminal or a log file read later with ``cat`` or
``less -R`` carries none raw. No rich here: worker processes import it."""

from __future__ import annotations

import logging
import re

UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""C0 controls but tab and newline, DEL, C1 controls, and the bidirectional overrides that reorder a line."""


def printable(text: str) -> str:
    """``text`` with each :data:`UNSAFE` character written as its escape (``\\x1b``, ``\\u202e``)."""
    return UNSAFE.sub(lambda m: ascii(m.group())[1:-1], text)


CONTINUATION = "\n    | "
"""What a line break inside a log message becomes: a peer's text cannot start a line that reads as a record."""


class SafeFormatter(logging.Formatter):
    """A logging formatter whose whole line (message, exception and stack text included) is :func:`printable`,
    and whose message's own line breaks (a peer's reason may carry ``\\n`` and a forged record after it) go on
    indented (:data:`CONTINUATION`): every line that starts at the margin is one this formatter began."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        message = record.message
        if "\n" in message:  # a lone \r is :data:`UNSAFE`: written as its escape by format
            record.message = message.replace("\n", CONTINUATION)
        try:
            return super().formatMessage(record)
        finally:
            record.message = message

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))


def log_to_stderr(level: int | str, fmt: str = "%(message)s") -> None:
    """Log at ``level`` and above to stderr through one :class:`SafeFormatter` handler, replacing the root
    logger's handlers: the logging of a process without the CLI's console (a ``fedtier run|sim`` worker)."""
    handler = logging.StreamHandler()
    handler.setFormatter(SafeFormatter(fmt))
    logging.basicConfig(level=level, handlers=[handler], force=True)
