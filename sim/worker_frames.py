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
    """The header and a view of the body of a :func:`frame`; ``ValueError`` for what is not one."""
    if len(data) < 4 or (n := struct.unpack_from("<I", data)[0]) > len(data) - 4:
        raise ValueError(f"a frame of {len(data)} bytes, too short for its header")
    view = memoryview(data)
    header = json.loads(bytes(view[4 : 4 + n]))
    if not isinstance(header, dict):
        raise ValueError(f"a frame whose header is a {type(header).__name__}, not an object")
    return header, view[4 + n :]


class Batch:
    """A worker's batch of tasks as it is gathered: a task byte-identical to an earlier one of the batch (a cell
    sends every device of an edge round the same model) is sent once, its item saying ``"same": j``. Each task is
    compared as it is added, while its bytes are fresh in the cache from their decoding (at the batch's end it
    read them from memory again: 65-90 us for 800 KB)."""

    def __init__(self) -> None:
        self.head: list[dict[str, Any]] = []
        self.bodies: list[memoryview] = []
        self.sent: list[tuple[int, Received]] = []  # (item, its bytes) of the items whose bytes travel

    def __len__(self) -> int:
        return len(self.head)

    def add(self, task_id: int, ctx: dict[str, Any], task: bytes | Received) -> None:
        """Add a task: its payload's bytes, or where they arrived."""
        task = task if isinstance(task, Received) else Received(task, 0)
        same = next((j for j, earlier in self.sent if earlier.same(task)), None)
        if same is None:
            self.sent.append((len(self.head), task))
            self.head.append({"id": task_id, "ctx": ctx, "n": task.nbytes})
            self.bodies.append(task.view())
        else:
            self.head.append({"id": task_id, "ctx": ctx, "same": same})

    def frame(self) -> bytes:
        """The batch as one frame (:func:`batch_items` reads it)."""
        return frame({"batch": self.head}, b"".join(self.bodies))


def batch_frame(items: Sequence[tuple[int, dict[str, Any], bytes | Received]]) -> bytes:
    """One frame for a worker's batch of tasks ``(id, ctx, bytes)`` (:class:`Batch`)."""
    batch = Batch()
    for item in items:
        batch.add(*item)
    return batch.frame()


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
