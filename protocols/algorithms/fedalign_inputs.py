"""How many inputs FedALIGN's phases give a robust aggregator, and the configuration check on them.

A FedALIGN round aggregates a subset of the devices: in the ``solo`` and ``priority`` phases a cell combines its
priority devices only, in the ``free`` phase its admitted free devices only (``all``: every device, as any
algorithm); the cloud combines, in ``solo``, the reports of the cells that have priority devices and, in ``free``,
those cells' held priority-phase reports with the free phase's. So ``cell_aggregator = "krum"`` over a topology
that passes the generic check (every cell large enough) may still get one or two priority devices of a cell in
every priority phase: it keeps the one, or the first of the two (their scores tie), and that device is the
cell's whole report. The
check refuses such a configuration (the rules are ``robust.too_few``'s), phase by phase over the phases the run's
``run.rounds`` reach (a 3-round run inside a 5-iteration warm-up has its solo phase only), in place of the generic
check over whole cells and all the cells (``FedAlignParams.check_topology``): at the defaults (no warm-up, a finite
epsilon) the cloud aggregates only in the free phase, up to two reports a cell. A round that gets fewer inputs than
it was configured for is aggregated as for any algorithm (``robust.aggregate`` says so in the record).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from .robust import RobustParams, check_tier


def check_phase_inputs(
    p: RobustParams, phases: Iterable[str], cells: Mapping[str, Sequence[str]], priority: frozenset[str]
) -> None:
    """Raise ``ValueError`` naming the phase, the tier (its cell), the number of inputs and the parameter when a
    robust aggregator can never get enough inputs in one of ``phases`` (the phases the run's schedule has)."""
    prio = {c: sum(d in priority for d in devices) for c, devices in sorted(cells.items())}
    free = {c: len(cells[c]) - n for c, n in prio.items()}
    every = {c: len(devices) for c, devices in sorted(cells.items())}
    with_prio, with_free = sum(1 for n in prio.values() if n), sum(1 for n in free.values() if n)
    for phase in [phase for phase in ("solo", "priority", "free", "all") if phase in set(phases)]:
        where = f" in FedALIGN's {phase} phase"
        kind, per_cell = {"free": ("free ", free), "all": ("", every)}.get(phase, ("priority ", prio))
        for cell, n in per_cell.items():
            if n:
                check_tier("cell", p.cell_aggregator, n, f"{kind}devices of cell {cell}", p, where)
        cloud_inputs = {"solo": with_prio, "free": with_prio + with_free, "all": sum(1 for n in every.values() if n)}
        reports = cloud_inputs.get(phase, 0)
        if reports:
            check_tier("cloud", p.cloud_aggregator, reports, "cell reports", p, where)
