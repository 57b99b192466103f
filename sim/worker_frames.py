"""The frames a ``fedtier sim`` worker and the main process exchange over a pipe: a small JSON header (task
ids, device contexts, errors) and the encoded payloads as they are (``protocols/wire/payload.py``); nothing is
pickled."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

from protocols.wire.messenger import Received
from protocols.wire.payload import Parts


def frame(header: dict[str, Any], body: bytes | memoryview | Parts = b"") -> bytes:
    """A JSON header (its length first, 4 bytes little-endian), then ``body`` as it is (or its buffers joined)."""
    h = json.dumps(header, separators=(",", ":")).encode()
    return b"".join((struct.pack("<I", len(h)), h, *(body if isinstance(body, list) else (body,))))


def unframe(data: bytes) -> tuple[dict[str, Any], memoryview]:
    """The header and a view of the body of a :func:`frame`."""
    (n,) = struct.unpack_from("<I", data)
    view = memoryview(data)
    return json.loads(bytes(view[4 : 4 + n])), view[4 + n :]


def batch_frame(items: Sequence[tuple[int, dict[str, Any], bytes | Received]]) -> bytes:
    """One frame for a worker's batch of tasks (each its payload's bytes, or where they arrived). A task
    byte-identical to an earlier one of the batch (a cell sends every device of an edge round the same model)
    is sent once: its item says ``"same": j``."""
    head: list[dict[str, Any]] = []
    bodies: list[memoryview] = []
    sent: list[tuple[int, Received]] = []  # (item, its bytes) of the items whose bytes travel
    for task_id, ctx, task in items:
        task = task if isinstance(task, Received) else Received(task, 0)
        same = next((j for j, earlier in sent if earlier.same(task)), None)
        if same is None:
            sent.append((len(head), task))
            head.append({"id": task_id, "ctx": ctx, "n": task.nbytes})
            bodies.append(task.view())
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
