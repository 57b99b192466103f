"""The main process's side of ``runtime.cell_processes`` against a child's bug (the children are the run's own, not
an attacker): a frame it cannot read, or whose messages do not match its body, ends the run with a
:class:`CellProcessError` naming the child, as a dead or hung one does, and so does a child that never answers the
stop; nothing is left waiting. A fake child on a pipe: no process is spawned."""

from __future__ import annotations

import json
import multiprocessing as mp
import struct
from typing import Any

import pytest

from sim.cell_processes import CellProcessError, CellProcesses
from sim.cell_share import message_frame
from sim.worker_frames import frame


class Child:
    """What the main process knows of a cell process."""

    pid, exitcode = 4242, None

    def __init__(self) -> None:
        self.killed = False

    def kill(self) -> None:
        self.killed = True

    def join(self, timeout: float | None = None) -> None:
        pass


def main_side(stall_s: float = 1.0) -> tuple[CellProcesses, Any, Child]:
    """A :class:`CellProcesses` with one child on a pipe, and the child's end."""
    side = object.__new__(CellProcesses)
    mine, theirs = mp.Pipe()
    child = Child()
    side.conns, side.procs, side.groups, side.nexts = [mine], [child], [["c0", "c2"]], [None]
    side.stall_s, side.finished = stall_s, False
    return side, theirs, child


BAD = {
    "short": b"\x01\x00",
    "header past the end": struct.pack("<I", 99) + b"{}",
    "not json": struct.pack("<I", 3) + b"{x}",
    "a list header": frame({}).replace(b"{}", b"[]"),
    "a message past the body": frame({"next": None, "msgs": [["fedtier/t/up", 10, False, "c0"]]}, b"12345"),
    "bytes past its messages": message_frame({"next": None}, [("fedtier/t/up", b"12345", False, "c0")]) + b"!",
    "a bad next": message_frame({"next": "soon"}, []),
}


@pytest.mark.parametrize("bad", list(BAD.values()), ids=list(BAD))
def test_a_childs_bad_frame_ends_the_run_naming_it(bad: bytes) -> None:
    side, theirs, _ = main_side()
    side.hub = None  # type: ignore[assignment]  # (nothing may be delivered)
    theirs.send_bytes(bad)
    with pytest.raises(CellProcessError, match=r"cell process 0 \(pid 4242; cells c0, c2\) answered a bad frame"):
        side._take(0, 1.0)


def test_a_child_that_never_answers_the_stop_is_killed_and_named() -> None:
    """finish() waited without a bound for a child's records: one hung in its stop hung the run."""
    side, theirs, child = main_side(stall_s=0.2)
    with pytest.raises(CellProcessError, match=r"cell process 0 .* sent nothing.* for 0.2 s"):
        side.finish()
    assert child.killed and json.loads(theirs.recv_bytes()[4:]) == {"stop": True}
