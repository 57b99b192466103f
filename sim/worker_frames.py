"""The frames a ``fedtier sim`` worker and the main process exchange over a pipe: a small JSON header (task
ids, device contexts, errors) and the encoded payloads as they are (``protocols/wire/payload.py``); nothing is
pickled."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any


def frame(header: dict[str, Any], body: bytes = b"") -> bytes:
    """A JSON header (its length first, 4 bytes little-endian), then ``body`` as it is."""
    h = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<I", len(h)) + h + body


def unframe(data: bytes) -> tuple[dict[str, Any], memoryview]:
    """The header and a view of the body of a :func:`frame`."""
    (n,) = struct.unpack_from("<I", data)
    view = memoryview(data)
    return json.loads(bytes(view[4 : 4 + n])), view[4 + n :]


def batch_frame(items: Sequence[tuple[int, dict[str, Any], bytes]]) -> bytes:
    """One frame for a worker's batch of tasks. A task byte-identical to an earlier one of the batch (a cell
    sends every device of an edge round the same model) is sent once: its item says ``"same": j``."""
    head: list[dict[str, Any]] = []
    bodies: list[bytes] = []
    for task_id, ctx, task in items:
        same = next(
            (
                j
                for j, (_, _, earlier) in enumerate(items[: len(head)])
                if "n" in head[j] and len(earlier) == len(task) and earlier == task
            ),
            None,
        )
        if same is None:
            head.append({"id": task_id, "ctx": ctx, "n": len(task)})
            bodies.append(task)
        else:
            head.append({"id": task_id, "ctx": ctx, "same": same})
    return frame({"batch": head}, b"".join(bodies))


def batch_items(header: dict[str, Any], body: memoryview) -> list[tuple[dict[str, Any], memoryview]]:
    """``(ctx, task bytes)`` of each item of a :func:`batch_frame`; a bad reference raises ``ValueError``."""
    items: list[tuple[dict[str, Any], memoryview]] = []
    at = 0
    for item in header["batch"]:
        if "same" in item:
            j = item["same"]
            if not (isinstance(j, int) and 0 <= j < len(items)):
                raise ValueError(f"batch item refers to task {j!r}")
            items.append((item["ctx"], items[j][1]))
        else:
            items.append((item["ctx"], body[at : at + item["n"]]))
            at += item["n"]
    return items
