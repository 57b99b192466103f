"""DeComFL's messages (``protocols.algorithms.decomfl``): the history a downlink carries, and the checks of what
arrives (and of the cloud's round log a checkpoint gives back)."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..numbers import finite_number
from ..rejections import Rejected, RejectKind
from ..round_text import nth
from ..wire.payload import Payload, all_finite, payload_size

log = logging.getLogger("fedtier.device")


def expect_shape(arr: Any, shape: tuple[int, ...], dtype: str, what: str) -> np.ndarray:
    """``arr``, if it is a ``dtype`` array of ``shape`` (finite, if floating); else :class:`Rejected`."""
    if not isinstance(arr, np.ndarray) or arr.shape != shape or arr.dtype != _dtype(dtype):
        got = (getattr(arr, "shape", None), getattr(arr, "dtype", None))
        raise Rejected(RejectKind.SHAPE, f"{what}: expected {dtype} {shape}, got {got}")
    if arr.dtype.kind == "f" and not all_finite(arr):  # (exact; a view the wire checked is not read again)
        raise Rejected(RejectKind.NON_FINITE, f"{what}: non-finite values")
    return arr


@functools.cache
def _dtype(name: str) -> np.dtype:
    return np.dtype(name)  # (a dtype from its name once, not at every message)


def meta_int(meta: Mapping[str, Any], key: str, what: str, lo: int = 0, hi: int | None = None) -> int:
    """``meta[key]``, if it is an integer in ``[lo, hi]``; else :class:`Rejected`."""
    v = meta.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        raise Rejected(RejectKind.BOUND, f"{what}: {key} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def check_report(report: Payload, what: str, shape: tuple[int, int], newest: int, weighting: str, clip: float) -> None:
    """The cloud's check of a cell's report (:class:`Rejected` naming what is wrong): its weight, ``need`` (a round
    up to ``newest``), the devices that answered and resynced, and its summed K x P scalars (``shape``), each at most
    ``clip`` x its weight where ``clip`` bounds them."""
    meta = report.meta
    w = meta.get("weight")
    if (number := finite_number(w)) is None or number < 0:
        raise Rejected(RejectKind.BOUND, f"{what}: weight must be a non-negative number, got {str(w)[:40]}")
    meta_int(meta, "need", what, 0, newest)  # at most this round
    answered = meta.get("answered")
    if (
        not isinstance(answered, list)
        or not all(isinstance(d, str) for d in answered)
        or len(set(answered)) != len(answered)
    ):
        raise Rejected(RejectKind.MALFORMED, f"{what}: answered must be a list of distinct device ids")
    resync = meta.get("resync", [])
    if (
        not isinstance(resync, list)
        or not all(isinstance(d, str) for d in resync)
        or len(set(resync)) != len(resync)
        or set(resync) & set(answered)
    ):
        raise Rejected(
            RejectKind.MALFORMED, f"{what}: resync must be a list of distinct device ids that did not answer"
        )
    if weighting == "uniform" and w != len(answered):
        raise Rejected(
            RejectKind.INCONSISTENT, f"{what}: weight {w} but {len(answered)} devices answered (uniform weighting)"
        )
    if w == 0:
        if report.tensors or answered:
            raise Rejected(RejectKind.INCONSISTENT, f"{what}: weight 0 with results")
        return
    if not answered:
        raise Rejected(RejectKind.INCONSISTENT, f"{what}: positive weight but no device answered")
    g = expect_shape(report.tensors.get("g"), shape, "float64", f"{what} scalars")
    if clip and (top := float(np.abs(g).max())) > clip * number * (1 + 1e-9):
        raise Rejected(RejectKind.BOUND, f"{what}: a scalar of {top:g} above scalar_clip x weight ({clip * number:g})")


def history_payload(meta: dict[str, Any], seeds: Sequence[int] | np.ndarray, g: np.ndarray) -> Payload:
    """A downlink: ``seeds`` (history rounds then the current round) as uint64, history scalars float32."""
    return Payload(meta, {"s": np.asarray(seeds, dtype=np.uint64), "g": np.asarray(g, dtype=np.float32)})


def resync_answer(device: str, round: int, start: int) -> Payload:
    """A device's answer when it holds x_0 (its replica lost: its process restarted) and its task's history starts
    later (``start``): it asks for the whole history and sits the round out; it says so in its log."""
    log.warning(
        "device %s: back at x_0 (its replica lost: a restarted process?) and round %s's history starts at round %s: "
        "asks for the whole history (resync) and sits this round out",
        device,
        nth(round),
        nth(start),
    )
    return Payload({"resync": True})


def read_history(task: Payload, round: int, K: int, Pn: int, what: str) -> tuple[int, np.ndarray, np.ndarray]:
    """(from, seeds [h+1], scalars [h, K, P]) of a downlink for ``round``; Rejected if inconsistent."""
    start = meta_int(task.meta, "from", what, 0, round)
    h = round - start
    seeds = expect_shape(task.tensors.get("s"), (h + 1,), "uint64", f"{what} seeds")
    g = expect_shape(task.tensors.get("g"), (h, K, Pn), "float32", f"{what} scalars")
    return start, seeds, g


def stack_rounds(g: list[np.ndarray], K: int, Pn: int) -> np.ndarray:
    """Rounds' ``(K, P)`` scalars as one ``(rounds, K, P)`` array (a copy)."""
    return np.stack(g) if g else np.zeros((0, K, Pn), np.float32)


class LogRows:
    """A cloud's round log of ``(K, P)`` scalars as one ``(rounds, K, P)`` array, grown a row a round, of which a
    task's window is a slice: :func:`stack_rounds` of the window (~90 rounds in the paper preset) copied it every
    round. A row once written never changes (an array handed out keeps its rounds); a log it did not follow (read
    back from a checkpoint) is stacked anew."""

    def __init__(self, K: int, Pn: int) -> None:
        self.rows, self.n = np.zeros((0, K, Pn), np.float32), 0
        self.last: np.ndarray | None = None  # the log's last array, as it was followed

    def of(self, log: list[np.ndarray]) -> np.ndarray:
        """``stack_rounds(log)``, the same values, as a read-only view of the rows (no copy a round)."""
        n = len(log)
        if n == self.n and (n == 0 or log[-1] is self.last):
            return self.rows[:n]
        if n == self.n + 1 and (self.n == 0 or log[-2] is self.last):  # the round the log took since
            if n > len(self.rows):
                grown = np.empty((max(64, 2 * n), *self.rows.shape[1:]), np.float32)
                grown[: self.n] = self.rows[: self.n]
                self.rows = grown
            self.rows[n - 1] = log[-1]
        else:
            self.rows = stack_rounds(log, *self.rows.shape[1:]).astype(np.float32)
        self.n, self.last = n, (log[-1] if n else None)
        view = self.rows[:n]
        view.flags.writeable = False
        return view


def read_checkpoint_log(
    t: dict[str, np.ndarray], base: int, K: int, Pn: int
) -> tuple[list[int], list[np.ndarray] | None, list[int], list[np.ndarray]]:
    """(log seeds, log scalars, window seeds, window scalars) of a cloud checkpoint's tensors ``t`` (popped from it),
    the window starting at round ``base``. This fedtier's: the log (``log:s``, ``log:g``; none: no round yet) and the
    window its tail. An older one's: the window inside (``history:s``, ``history:g``), and the log if it has one
    that fits (else None: no replica can be rebuilt, unless the window starts at round 0). ValueError: they do not
    fit."""
    seeds, hist = t.pop("history:s", None), t.pop("history:g", None)
    log_s, log_g = t.pop("log:s", None), t.pop("log:g", None)
    if seeds is None or hist is None:
        log_s = np.zeros(0, np.uint64) if log_s is None else log_s
        n = log_s.shape[0] if isinstance(log_s, np.ndarray) and log_s.ndim == 1 else 0
        expect_shape(log_s, (n,), "uint64", "the checkpoint's round log seeds")
        log_g = np.zeros((0, K, Pn), np.float32) if log_g is None else log_g
        expect_shape(log_g, (n, K, Pn), "float32", "the checkpoint's round log scalars")
        if not 0 <= base <= n:
            raise ValueError(f"the checkpoint's window starts at round {base}, its round log holds {n} rounds")
        log = [int(s) for s in log_s], list(log_g)  # (views of the one array the log was read into)
        return *log, log[0][base:], log[1][base:]
    window = [int(s) for s in seeds], [np.array(x, np.float32) for x in hist]
    if log_s is not None and log_g is not None and len(log_s) == len(log_g) == base + len(window[1]):
        log = [int(s) for s in log_s], [np.array(x, np.float32) for x in log_g]
        return *log, window[0], log[1][base:]  # the window shares the log's arrays
    return *((list(window[0]), list(window[1])) if base == 0 else ([], None)), *window


def largest_task(rounds: int, K: int, Pn: int, rosters: Mapping[str, Sequence[str]]) -> tuple[int, int, str]:
    """(bytes, metadata bytes, what) of the largest message of a DeComFL run of ``rounds``: a cell's task in the last
    round carrying the whole log (a device of it never seen, or recreated by a resume: h = rounds - 1 rounds of
    8 + 4KP bytes, h + 1 seeds) and the synced round of each of its devices (the largest cell's). Every other message
    is smaller: a device's task is such a history without the table, a report K x P scalars and the cell's ids."""
    h, kp = max(rounds - 1, 0), K * Pn
    cell, devices = max(rosters.items(), key=lambda item: len(item[1]), default=("", []))
    empty = history_payload({"from": 0, "synced": {}}, [0], np.zeros((0, K, Pn), np.float32))  # (h = 0)
    table = sum(len(d) + 4 + len(str(h)) for d in devices) - (1 if devices else 0)  # "id":h, (ids: topic-safe)
    meta = len(json.dumps(empty.meta, separators=(",", ":"))) + table
    what = (
        f"decomfl's largest task: cell {cell}'s in round {h + 1:,} (the last), with the whole log ({h:,} rounds x "
        f"{8 + 4 * kp:,} bytes, which a device never seen or recreated by a resume replays) and its {len(devices):,} "
        "devices' synced rounds"
    )
    return payload_size(empty) + table + h * (8 + 4 * kp), meta, what
