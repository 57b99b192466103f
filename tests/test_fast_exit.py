"""protocols/fast_exit.py: a process that imported torch exits without collecting its whole heap again."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LAST_HANDLERS = textwrap.dedent(
    """
    import atexit, gc, sys
    from protocols.fast_exit import skip_exit_collection
    atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))  # runs after it
    before = atexit._ncallbacks()
    if sys.argv[1] == "skip":
        skip_exit_collection()
        skip_exit_collection()  # idempotent
    print("handlers added:", atexit._ncallbacks() - before, flush=True)
    atexit.register(lambda: print("a later handler still runs", flush=True))
    """
)


def exit_lines(mode: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", LAST_HANDLERS, mode], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_the_heap_is_frozen_after_every_other_exit_handler() -> None:
    assert exit_lines("skip") == ["handlers added: 1", "a later handler still runs", "frozen at exit: True"]
    assert exit_lines("plain") == ["handlers added: 0", "a later handler still runs", "frozen at exit: False"]


def test_every_fedtier_command_skips_the_exit_collection(monkeypatch) -> None:
    from click.testing import CliRunner

    import fedtier.cli

    calls: list[bool] = []
    monkeypatch.setattr(fedtier.cli, "skip_exit_collection", lambda: calls.append(True))
    assert CliRunner().invoke(fedtier.cli.main, ["logs", "--help"]).exit_code == 0
    assert calls == [True]
