"""The error a bad configuration raises, and pydantic's validation errors as one message naming each key."""

from __future__ import annotations

from pydantic import ValidationError


class ConfigError(ValueError):
    """A bad configuration; the message names the offending key(s)."""


def format_errors(exc: ValidationError, prefix: str = "") -> str:
    """``exc`` as one message, a line per bad key (``prefix`` names the section the model validated)."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in ((prefix,) if prefix else ()) + tuple(err["loc"]))
        msg = err["msg"].replace("Extra inputs are not permitted", "unknown key")
        lines.append(f"{loc or '(config)'}: {msg}")
    return "invalid config:\n  " + "\n  ".join(lines)
