"""The state parts of a cell server, each a small record with one meaning: its limits (deadline, quorum,
how many absent devices a record names), its presence timings, the open edge round, and the open cloud
round's tally (what its report adds to the role's). The server replaces a round's part with a fresh one
when the round starts."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from protocols.divergence import largest, update_norm
from protocols.failures import count_reasons
from protocols.numbers import finite_number
from protocols.wire.payload import Payload


@dataclass(frozen=True)
class CellLimits:
    """How long a cell waits for results, and how many make a quorum (``CellNode`` documents each)."""

    device_deadline: float  # seconds an edge round waits for its planned devices' results
    quorum: float = 1.0  # the share of the planned devices whose results close an edge round early
    absent_ids: int = 100  # a record names the absent devices of a reason up to this many

    def __post_init__(self) -> None:
        if not 0 < self.quorum <= 1:
            raise ValueError("quorum must be in (0, 1]")


@dataclass(frozen=True)
class PresenceTimes:
    """How a cell follows its devices' presence, in seconds (``CellNode`` documents each; 0: off)."""

    heartbeat: float = 0.0  # between re-announcements of the cell's own status
    heartbeat_timeout: float = 0.0  # a device whose last status is older is deemed offline
    rejoin_wait: float = 0.0  # an edge round waits this long for offline devices that take part
    status_wait: float = 0.0  # after start, a device not heard of yet counts as unknown this long

    @property
    def beat_period(self) -> float:
        """Seconds between the cell's heartbeat checks."""
        return self.heartbeat if self.heartbeat > 0 else self.heartbeat_timeout / 2


SHARED_TASK_BYTES = 64 << 10
"""A task's tensors from this many bytes on go as a shared payload even to one device (:meth:`EdgeRound.shared`)."""


@dataclass
class EdgeRound:
    """The open edge round (or, in async mode, the window of the next aggregation record)."""

    planned: list[str] = field(default_factory=list)
    tasks: Mapping[str, Payload] = field(default_factory=dict)  # each planned device's task
    absent: dict[str, str] = field(default_factory=dict)  # device -> why it has no result
    losses: dict[str, float] = field(default_factory=dict)  # device -> the loss its result reported
    diverged: dict[str, str] = field(default_factory=dict)  # device -> why its training diverged (not aggregated)
    failed: dict[str, str] = field(default_factory=dict)  # device -> why its task failed (not aggregated)
    not_participating: int = 0  # counted, not named in ``absent`` (more than ``absent_ids``)
    opened: bool = False  # planned, and its tasks sent
    allowed: set[str] | None = None  # the devices the availability hook lets in (None: all)
    needed: int = 0  # results that close it (the quorum of the planned devices)
    bytes_in: int = 0
    bytes_out: int = 0  # the first send of each task (the same in every run of the job)
    bytes_resent: int = 0  # tasks sent again (a device back while its result was pending): apart, run-dependent
    resent: dict[str, int] = field(default_factory=dict)  # device -> times its task was sent again (bounded)
    t0: float = 0.0  # loop time it started
    wall0: float = 0.0  # perf_counter when it started
    since: float = 0.0  # wall time its tasks left
    waiting_posted: bool = False  # its waiting record is posted to the loop (edge_liveness.waiting_soon)
    _many: tuple[Mapping[str, Payload], set[int]] | None = field(default=None, repr=False)  # (tasks, shared ids)

    def shared(self, task: Payload) -> bool:
        """Whether ``task`` goes as a shared payload (``Messenger.send``'s ``shared``): planned for several devices
        (its receivers read one decoding of its bytes), or of :data:`SHARED_TASK_BYTES` or more (its values aligned
        for their reads). Else as plain bytes: a device's own small task (DeComFL's history, a few hundred bytes,
        paid ~25 us a device for the shared path's copy, alignment and each receiver's copies)."""
        if self._many is None or self._many[0] is not self.tasks:
            counts = Counter(map(id, self.tasks.values()))
            self._many = (self.tasks, {i for i, n in counts.items() if n > 1})
        return id(task) in self._many[1] or sum(v.nbytes for v in task.tensors.values()) >= SHARED_TASK_BYTES

    def sit_out(self, devices: Sequence[str], taking_part: Sequence[str], absent_ids: int) -> None:
        """Note the ``devices`` not ``taking_part``: named as "not participating" up to ``absent_ids`` of them,
        beyond only counted (large cells)."""
        sitting_out = len(devices) - len(taking_part)
        if 0 < sitting_out <= absent_ids:
            part = set(taking_part)
            self.absent.update((d, "not participating") for d in devices if d not in part)
        elif sitting_out:
            self.not_participating = sitting_out

    def take(self, device: str, result: Payload, nbytes: int, diverged: str | None, failed: str | None) -> None:
        """Count an answer taken: its bytes, and why it diverged or failed (never aggregated), else its loss."""
        self.bytes_in += nbytes
        if diverged is not None:
            self.diverged[device] = diverged
        elif failed is not None:
            self.failed[device] = failed
        else:
            self.note_loss(device, result)

    def note_loss(self, device: str, result: Payload) -> None:
        """Keep the training loss ``result`` reports, if it is a finite number (a device's word: an int beyond
        the float range, e.g. ``10**400`` from JSON, is none)."""
        value = finite_number(result.meta.get("loss"))
        if value is not None:
            self.losses[device] = value

    def loss_stats(self) -> tuple[float | None, float | None]:
        """Mean and standard deviation of the reported losses (``None`` without any, or where the losses, each a
        device's word, are too far apart for a float: e.g. 1e308 beside 2.3)."""
        losses = list(self.losses.values())
        if not losses:
            return None, None
        mean = sum(losses) / len(losses)
        try:
            spread = (sum((x - mean) ** 2 for x in losses) / len(losses)) ** 0.5
        except OverflowError:
            spread = math.inf
        return (mean if math.isfinite(mean) else None), (spread if math.isfinite(spread) else None)


@dataclass
class RoundTally:
    """The open cloud round over its edge rounds: traffic, and which devices were aggregated, diverged,
    failed or were left out for the job's requirements (its report says so beside the role's)."""

    traffic: dict[str, int] = field(default_factory=lambda: {"cell_to_device": 0, "device_to_cell": 0})
    devices: set[str] = field(default_factory=set)  # whose result some edge round aggregated
    diverged: set[str] = field(default_factory=set)  # whose training diverged in some edge round
    failed: dict[str, str] = field(default_factory=dict)  # whose task failed in some edge round, why
    unmet: dict[str, str] = field(default_factory=dict)  # left out for the job's requirements, why
    late: set[str] = field(default_factory=set)  # tasked, and silent past the device deadline of an edge round
    rejected: dict[str, str] = field(default_factory=dict)  # late whose answer was refused, why (its last refusal)
    offline: set[str] = field(default_factory=set)  # taking part, and offline when an edge round was planned
    norms: dict[str, float] = field(default_factory=dict)  # device -> the largest norm of its results aggregated

    def weigh(self, device: str, result: Payload) -> None:
        """Keep the update norm of ``device``'s ``result`` taken for the aggregate (one BLAS pass of it): the report
        names the devices of the largest (``largest_updates``), which a diverged global model's failure names."""
        norm = update_norm(result.tensors)
        if math.isfinite(norm):
            self.norms[device] = max(self.norms.get(device, 0.0), norm)

    def name_largest(self, meta: dict[str, Any]) -> None:
        """Add the devices of the largest update norms to a report's ``meta`` (``largest_updates``: device -> the
        decimal exponent of its norm; an order of magnitude, the same bytes whatever the BLAS kernel's rounding)."""
        if named := {d: math.floor(math.log10(n)) for d, n in largest(self.norms) if n > 0}:
            meta["largest_updates"] = named

    def add(
        self,
        bytes_out: int,
        bytes_in: int,
        aggregated: Iterable[str],
        diverged: Iterable[str],
        failed: Mapping[str, str],
    ) -> None:
        """Count a closed edge round."""
        self.traffic["cell_to_device"] += bytes_out
        self.traffic["device_to_cell"] += bytes_in
        self.devices |= set(aggregated)
        self.diverged |= set(diverged)
        self.failed.update(failed)

    def annotate(self, meta: dict[str, Any], online: int = 0) -> None:
        """Add the round's figures to its report's ``meta``: traffic, devices aggregated, and per reason
        those that diverged, failed or could not serve in every edge round they had, the devices of the largest
        update norms (:meth:`weigh`); where none was aggregated,
        the cell's ``online`` devices (drawn or not: the fleet is alive, a round its draw left offline is no
        stall)."""
        meta["traffic"] = dict(self.traffic)
        meta["devices"] = len(self.devices)
        if diverged := len(self.diverged - self.devices):
            meta["diverged"] = diverged
        failed = {d: why for d, why in self.failed.items() if d not in self.devices}
        if failed:
            meta["failed_devices"] = len(failed)
            meta["failures"] = count_reasons(failed)
        unmet = {d: why for d, why in self.unmet.items() if d not in self.devices}
        if unmet:  # a job no device can serve fails with why
            meta["unmet"] = count_reasons(unmet)
        refused = {d: why for d, why in self.rejected.items() if d in self.late and d not in self.devices}
        if refused:  # they answered, and every answer was refused: a job of such rounds fails saying why
            meta["rejected"] = count_reasons(refused)
        if late := len(self.late - self.devices - refused.keys()):  # a job whose devices never make the deadline
            meta["late"] = late  # fails with why
        if offline := len(self.offline - self.devices):  # a job whose every device is down fails with why
            meta["offline"] = offline
        self.name_largest(meta)
        if online and not self.devices:
            meta["online"] = online
