"""Weight bounds: how many samples a device, and so a cell, may claim.

A result's or report's ``weight`` decides its share of the mean it joins. A node that lies about it, with
valid credentials, takes the model over (one device claiming 1e12 samples, one cell claiming 1e15), so every
tier bounds what it accepts by what the federation knows: a device by its provisioned bound (or its known
sample count in ``fedtier sim|run``), a cell by the sum of its devices' bounds (:func:`cell_weight_bound`), times
the edge rounds only where its role says a report adds every edge round's answers (``CloudRole.weight_keys``): a
FedAvg cell that claimed E times its devices' samples took E times its share of the mean.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from .algorithms.base import TrainParams
from .algorithms.staleness import AsyncParams
from .algorithms.traits import Trait, compose_traits

if TYPE_CHECKING:
    from .roster import Roster


def weight_over(weight: object, bound: float | None, what: str) -> str | None:
    """Why a claimed ``weight`` is refused against ``bound`` (``what`` names the bound), or ``None``
    when there is no bound, the weight is no number (the role's checks refuse it), or it is within."""
    if bound is None or not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight <= bound:
        return None
    try:
        shown = f"{float(weight):g}"
    except OverflowError:  # an int beyond float range, e.g. 10**400 from JSON
        shown = f"{str(weight)[:12]}..."
    return f"weight {shown} exceeds {what}"


def cell_weight_bound(train: TrainParams, device_bounds: Iterable[float]) -> float:
    """The largest weight an honest report of a cell whose devices have ``device_bounds`` can carry.

    Rounds (``algorithm.mode = "sync"``): a report counts each device at most once per cloud round, so the sum
    of the bounds; a role whose report adds every edge round's answers (DeComFL) declares ``E`` times it in
    ``CloudRole.weight_keys``. FedBuff (``"async"``): a push adds ``async_push_every`` (M) cell updates of
    ``async_buffer`` (K) results each, so ``K x M`` times the largest bound."""
    bounds = list(device_bounds)
    if not bounds:
        return 0.0
    if isinstance(train, AsyncParams) and Trait.ASYNC in compose_traits((), train.layers()):
        return float(train.async_buffer * train.async_push_every * max(bounds))
    return float(sum(bounds))


class CellBounds(Mapping[str, float]):
    """``cell -> cell_weight_bound`` computed on first access (a cell of a million devices costs nothing
    until its first report), from ``device_bounds(cell)``; ``cell_of(device)`` (the topology's or the roster's)
    says which cell a device belongs to, for reports that name their devices (``CloudRole.member_keys``), and
    ``device_bound(cell, device)`` the most samples one of them may claim (``None``: not of that cell, or unknown),
    for reports that give each a weight (``CloudRole.member_weight_keys``). ``device_bounds=None``: no weight bound
    is known (the mapping is empty), only who belongs where."""

    def __init__(
        self,
        cells: Iterable[str],
        train: TrainParams,
        device_bounds: Callable[[str], Iterable[float]] | None,
        cell_of: Callable[[str], str | None] | None = None,
        device_bound: Callable[[str, str], float | None] | None = None,
    ) -> None:
        self._cells = list(cells) if device_bounds is not None else []
        self._train, self._device_bounds = train, device_bounds
        self._members = set(self._cells)
        self._known: dict[str, float] = {}
        self.cell_of = cell_of
        self._device_bound = device_bound

    def device_bound(self, cell: str, device: str) -> float | None:
        """The most samples ``device`` of ``cell`` may claim; ``None`` when unknown (not of that cell, or no
        per-device bounds were given)."""
        return None if self._device_bound is None else self._device_bound(cell, device)

    def __getitem__(self, cell: str) -> float:
        if cell not in self._known:
            if cell not in self._members or self._device_bounds is None:
                raise KeyError(cell)
            self._known[cell] = cell_weight_bound(self._train, self._device_bounds(cell))
        return self._known[cell]

    def __iter__(self) -> Iterator[str]:
        return iter(self._cells)

    def __len__(self) -> int:
        return len(self._cells)


def roster_cell_bounds(
    roster: Roster, train: TrainParams, job_cell_of: Callable[[str], str | None] | None = None
) -> CellBounds:
    """Each cell's weight bound from a signed roster (``protocols.roster.Roster``): its devices' bounds there. With
    ``job_cell_of`` (a job's topology's ``cell_of``), only the job's devices count: one enrolled since the job was
    submitted takes no part in it, and one revoked since (the roster no longer lists it) is out."""

    def in_job(cell: str, device: str) -> bool:
        return job_cell_of is None or job_cell_of(device) == cell

    def cell_of(device: str) -> str | None:
        cell = roster.cell_of(device)
        return cell if cell is not None and in_job(cell, device) else None

    def device_bound(cell: str, device: str) -> float | None:
        return roster.device_bound(cell, device) if in_job(cell, device) else None

    return CellBounds(
        roster.cells,
        train,
        lambda cell: [entry.max_weight for d, entry in roster.cells[cell].items() if in_job(cell, d)],
        cell_of,
        device_bound,
    )
