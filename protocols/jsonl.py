"""Append-only JSON-lines files: one record per line, flushed at once so a crash loses nothing."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def loads(data: str | bytes, *, finite: bool = False) -> Any:
    """``json.loads`` for untrusted input: every defect is a ``ValueError`` (deep nesting too, which
    ``json`` reports as ``RecursionError``); with ``finite``, ``NaN``, ``Infinity`` and numbers that
    overflow a float (``1e999``) are refused."""
    try:
        if finite:
            return json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float)
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is out of the float range")
    return value


class JsonlWriter:
    """Appends records to ``path`` (created with its folder); each write is flushed."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path is not None else None
        self._fh = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a JSON-lines file; a torn last line (crash mid-write) is skipped."""
    with Path(path).open(encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                yield loads(line)
            except ValueError:
                continue
