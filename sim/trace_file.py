"""A participation trace file (``participation.path``): CSV rows ``device,start,end`` (``sim.participation.Trace``).

A job names the trace each device reads, and a device that cannot serve a job says why beyond its own log. So a
file that cannot be used raises :class:`~protocols.config.UnusableFile`: its message (the device's log) names the
file and line, never what the line holds; what the device publishes names only the setting, the same for a missing
path, a directory, a file that is no trace and one it may not read.
"""

from __future__ import annotations

import csv
from collections.abc import Collection
from pathlib import Path

from protocols.config import UnusableFile

SETTING = "participation.path"


def read_trace(path: Path, devices: Collection[str], strict: bool) -> dict[str, list[tuple[int, int]]]:
    """Each of ``devices``' ``[start, end)`` rows of the trace at ``path``, as listed (a row naming another device
    is refused, or ignored when not ``strict``); :class:`UnusableFile` if the file cannot be used."""
    intervals: dict[str, list[tuple[int, int]]] = {d: [] for d in devices}
    try:
        if not path.is_file():
            raise ValueError(f"trace file {str(path)!r} not found")
        with path.open(newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None or [h.strip().lower() for h in header] != ["device", "start", "end"]:
                raise ValueError(f"{path}:1: the first line must be the header 'device,start,end'")
            for line_no, row in enumerate(reader, start=2):
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) != 3:
                    raise ValueError(f"{path}:{line_no}: expected 3 fields device,start,end, got {len(row)}")
                dev, s_txt, e_txt = (c.strip() for c in row)
                if not dev:
                    raise ValueError(f"{path}:{line_no}: empty device id")
                try:
                    start, end = int(s_txt), int(e_txt)
                except ValueError:
                    raise ValueError(f"{path}:{line_no}: start and end must be integers") from None
                if start < 0 or end <= start:
                    raise ValueError(f"{path}:{line_no}: need 0 <= start < end")
                if dev not in intervals:
                    if strict:
                        raise ValueError(f"{path}:{line_no}: a device not in the run's devices")
                    continue
                intervals[dev].append((start, end))
    except (UnicodeDecodeError, csv.Error) as exc:  # (csv's messages quote none of the file)
        why = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else f"line {reader.line_num}: {exc}"
        raise UnusableFile(SETTING, f"{path}: not a readable CSV trace: {why}") from None
    except OSError as exc:  # unreadable (its permissions), or gone since the check
        raise UnusableFile(SETTING, f"{path}: cannot read it: {exc.strerror}") from None
    except ValueError as exc:
        raise UnusableFile(SETTING, str(exc)) from None
    return intervals
