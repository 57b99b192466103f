"""The cloud's crash-consistent checkpoint: after each round it closes (and before round 0), atomically, the
round, the session, the byte totals, the stalled-round count, the role's state and the round's record. The part
of the role's state that only grows by rounds (``CloudRole.log_tail``) is appended to a file beside it instead
(``cloud.round_log``): a checkpoint writes what its round added, not the whole log.
A cloud killed at any point resumes from the last round it closed, in the same session, and re-sends the
round the cells may already be working on; its ``metrics.jsonl`` is repaired to end with that round."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocols import runfiles
from protocols.checkpoint import load_payload, save_payload, write_durably
from protocols.config import ConfigError
from protocols.jsonl import read_jsonl
from protocols.wire.payload import Payload

from .round_log import LogTail, RoundLog

if TYPE_CHECKING:
    from protocols.algorithms.base import CloudRole
    from protocols.failures import StallWatch


def repair_metrics(path: Path, next_round: int, record: dict[str, Any] | None) -> None:
    """Make ``metrics.jsonl`` end with the checkpointed round: drop records of rounds a resumed cloud
    runs again, and add the checkpoint's own record if the crash came before it was written."""
    if not path.exists():
        return
    kept = [r for r in read_jsonl(path) if isinstance(r.get("round"), int) and r["round"] < next_round]
    if record is not None and not any(r["round"] == record.get("round") for r in kept):
        kept.append(record)
    write_durably(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in kept).encode(), private=False)


def repair_cell_records(path: Path, next_round: int) -> None:
    """Drop from a cells' ``aggregation.jsonl`` the records of rounds a resumed cloud runs again: the cells
    that wrote them into the cloud's own folder (``fedtier run``: in the cloud's process) died with it and run
    those rounds again from their start, so the interrupted attempt's records would be counted twice."""
    if not path.exists():
        return

    def rerun(line: str) -> bool:
        try:
            rnd = json.loads(line).get("round")
        except (ValueError, AttributeError):
            return False  # kept as it is: the readers report it
        return isinstance(rnd, int) and not isinstance(rnd, bool) and rnd >= next_round

    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if not rerun(line)]
    if len(kept) == len(lines):
        return
    write_durably(path, "".join(kept).encode(), private=False)


def repair_records(metrics: Path, saved: Saved) -> None:
    """Before a cloud resumed from ``saved`` opens its records: ``metrics`` ends with the saved round, and the
    ``aggregation.jsonl`` beside it holds no record of a round the cloud runs again."""
    repair_metrics(metrics, saved.round + 1, saved.record)
    repair_cell_records(metrics.with_name(runfiles.AGGREGATION), saved.round + 1)


@dataclass(frozen=True)
class Saved:
    """What a checkpoint (at ``path``) holds: the last round closed (-1: none yet), the session, the byte
    totals, the rounds stalled in a row, the role's state and the last round's record."""

    path: Path
    round: int
    session: str | None
    cumulative: dict[str, Any]
    stalled: Any
    role: Payload
    record: dict[str, Any] | None


def restore(
    saved: Saved, role: CloudRole, stall: StallWatch, cumulative: dict[str, int], devices_recreated: bool
) -> int:
    """Put back what a cloud resumed from ``saved`` continues with: the role's state (its devices' forgotten when a
    launcher rebuilt them: ``devices_recreated``), the byte totals and the rounds stalled in a row. Returns the
    round it continues at (the one after the saved round)."""
    try:
        role.load_state(saved.role)
    except ValueError as exc:  # damaged, or of another run: the reason, not a traceback (fedtier sim: exit 2)
        raise ConfigError(f"--resume: {saved.path}: {exc}") from None
    except (KeyError, TypeError) as exc:  # a state without a key its role needs, or one of another type
        raise ConfigError(f"--resume: {saved.path}: damaged ({type(exc).__name__}: {exc})") from None
    if devices_recreated:  # a launcher that rebuilt its devices (fedtier sim / run --resume)
        role.forget_devices()
    cumulative.update(saved.cumulative)
    if isinstance(saved.stalled, int) and 0 < saved.stalled < stall.max_rounds:
        stall.stalled, stall.first = saved.stalled, saved.round + 1 - saved.stalled
    return saved.round + 1


class CloudCheckpoint:
    """The checkpoint file at ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.log = RoundLog(path)

    def load(self) -> Saved | None:
        """The saved state, if the file exists (the role's log, from the file beside it, among its tensors);
        ConfigError naming what is wrong with a file that cannot be resumed from."""
        if not self.path.exists():
            return None
        try:
            return self._load()
        except ConfigError:
            raise
        except ValueError as exc:  # damaged, or of another run: the reason, not a traceback (fedtier sim: exit 2)
            raise ConfigError(f"--resume: {exc}") from None
        except OSError as exc:  # unreadable (a folder, no permission, an I/O error): the reason, not a traceback
            raise ConfigError(f"--resume: cannot read {exc.filename or self.path}: {exc.strerror or exc}") from None

    def _load(self) -> Saved:
        state = load_payload(self.path)
        m = state.meta
        session = m["session"] if isinstance(m.get("session"), str) else None
        done = m.get("round")
        if not isinstance(done, int) or isinstance(done, bool) or done < -1:
            raise ValueError(f"{self.path} is damaged: its round is {str(done)[:40]!r}")
        log = self.log.load(m["log"], done) if "log" in m else {}  # (an older checkpoint: the log is inside)
        role = Payload(m.get("role", {}), {**state.tensors, **log})
        return Saved(self.path, done, session, m.get("cumulative", {}), m.get("stalled", 0), role, m.get("record"))

    def save_role(
        self, done: int, session: str, cumulative: dict[str, int], stalled: int, role: CloudRole, record: Any
    ) -> None:
        """:meth:`save` of ``role``'s state and log."""
        self.save(done, session, cumulative, stalled, role.state(), record, role.log_tail)

    def save(
        self,
        done: int,
        session: str,
        cumulative: dict[str, int],
        stalled: int,
        role: Payload,
        record: dict[str, Any] | None,
        log: LogTail | None = None,
    ) -> None:
        """Atomically save the state after round ``done`` (and its ``record``, unless before round 0); ``log``: the
        role's ``log_tail``, whose rounds since the last save are appended to the log file first."""
        logged = self.log.add(log) if log is not None else None
        meta = {
            "round": done,
            "session": session,
            "cumulative": cumulative,
            "role": role.meta,
            **({"stalled": stalled} if stalled else {}),
            **({"log": logged} if logged is not None else {}),
        }
        save_payload(self.path, Payload({**meta, "record": record} if record else meta, role.tensors))
        self.log.saved()
