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


def test_setup_frozen_spares_the_setup_from_full_collections_and_leaks_nothing() -> None:
    """Inside ``setup_frozen`` the objects alive on entry are out of the collector's scans; cyclic garbage made
    inside is still collected, and a frozen cycle dropped inside is collected after the exit."""
    import gc
    import weakref

    from protocols.heap import setup_frozen

    class Node:
        def __init__(self) -> None:
            self.me = self  # a reference cycle: only the cycle collector frees it

    old = Node()
    old_ref = weakref.ref(old)
    with setup_frozen():
        assert gc.get_freeze_count() > 0
        new = Node()
        new_ref = weakref.ref(new)
        del new, old
        gc.collect()
        assert new_ref() is None  # garbage of the run: collected as ever
        assert old_ref() is not None  # the setup's: not scanned while frozen
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old_ref() is None  # unfrozen on exit: nothing leaks
