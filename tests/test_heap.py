"""protocols/heap.py: a message-heavy process keeps its freed memory instead of faulting it in every round."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

ROUNDS = textwrap.dedent(
    """
    import resource, sys
    from protocols.heap import keep_freed_memory
    if sys.argv[1] == "keep":
        assert keep_freed_memory() and keep_freed_memory()  # idempotent
    def round_of_tasks():  # a cell's 100 tasks of 800 KB, framed, all alive, then freed
        tasks = [bytes(800_000) + b"x" for _ in range(100)]
        return sum(len(t) for t in tasks)
    round_of_tasks()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        round_of_tasks()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_rounds_of_large_messages_reuse_the_memory_instead_of_faulting_it_in():
    """Three rounds of 100 messages of 800 KB after a first: ~60,000 page faults with glibc's defaults (the
    freed heap top is given back every round), almost none once the process keeps its freed memory."""
    kept, default = faults("keep"), faults("default")
    assert kept < 2_000 < 20_000 < default, (kept, default)
