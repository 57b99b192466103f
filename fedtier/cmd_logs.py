"""``fedtier logs``: filter and print a run's cell aggregation and cloud round records."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from fedtier.cli import main
from fedtier.console import console, fail, output_console, refuse_federation_folder
from protocols.records import CellRecord, Record, RoundRecord, read_run
from protocols.round_text import nth, nth_edge

EVENTS = ("aggregation", "round")


def parse_round_range(text: str) -> tuple[int | None, int | None]:
    """``"A:B"`` (both ends included), ``"A:"``, ``":B"`` or ``"A"``, rounds counted from 1 as the table shows them,
    -> (low, high) as the records count them (from 0); ValueError if bad."""
    lo, sep, hi = text.partition(":")
    try:
        low = int(lo) if lo.strip() else None
        high = (int(hi) if hi.strip() else None) if sep else low
    except ValueError:
        raise ValueError(f"--round {text!r}: expected A:B, A:, :B or A (cloud rounds, both ends included)") from None
    if any(end is not None and end < 1 for end in (low, high)):  # "-1" matched nothing, said nothing
        raise ValueError(
            f"--round {text!r}: rounds count from 1, as the table, the monitor and the report show them (the records' "
            "round field counts from 0): the first round is 1 (A: from round A on)"
        )
    if low is not None and high is not None and low > high:
        raise ValueError(f"--round {text!r}: {low} > {high}")
    return (None if low is None else low - 1), (None if high is None else high - 1)


def filter_records(
    records: Iterable[Record],
    *,
    cells: Iterable[str] = (),
    rounds: tuple[int | None, int | None] = (None, None),
    events: Iterable[str] = (),
) -> list[Record]:
    """Records matching every filter, ordered by (round, edge round, cell; cloud after its cells).

    ``cells`` keeps aggregation records of those cells and round records that involve one of them.
    """
    cells, events = set(cells), set(events)
    low, high = rounds
    out = []
    for r in records:
        if events and r.event not in events:
            continue
        if (low is not None and r.round < low) or (high is not None and r.round > high):
            continue
        if cells:
            mine = {r.cell} if isinstance(r, CellRecord) else set(r.cells_planned) | set(r.cells_reported)
            if not cells & mine:
                continue
        out.append(r)
    return sorted(out, key=_order)


def _order(r: Record) -> tuple:
    if isinstance(r, CellRecord):
        return r.round, 0, r.edge_round, r.cell
    return r.round, 1, 0, ""


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def _plain(*cells: str) -> list[Text]:
    return [Text(c) for c in cells]


COLUMNS = (
    "event",
    "round",
    "cell",
    "answered",
    "absent / rejected",
    "bytes in",
    "bytes out",
    "loss",
    "accuracy",
    "closed by",
    "duration s",
)
LEFT = ("event", "cell", "absent / rejected", "closed by")


def _cell_row(r: CellRecord) -> list[Text]:
    """A cell's aggregation record as a row of :data:`COLUMNS`."""
    listed = set(r.absent.values())
    absent = ", ".join(
        [
            *(f"{d}: {why}" for d, why in r.absent.items()),
            *(f"{n:,} {why}" for why, n in r.absent_by_reason().items() if why not in listed),
        ]
    )
    rejected = ", ".join(f"{x.device}: {x.reason}" for x in r.rejected)
    return _plain(
        "aggregation",
        nth_edge(r.round, r.edge_round),
        r.cell,
        f"{len(r.answered)}/{len(r.planned)}",
        "; ".join(filter(None, (absent, rejected and f"rejected {rejected}"))) or "-",
        f"{r.bytes_in:,}",
        f"{r.bytes_out:,}",
        _fmt(r.loss_mean) + ("" if r.loss_std is None else f" ± {r.loss_std:.3f}"),
        "-",
        r.closed_by,
        f"{r.duration_s:.3f}",
    )


def _round_row(r: RoundRecord) -> list[Text]:
    """A cloud round record as a row of :data:`COLUMNS`."""
    up = r.bytes.get("cell_to_cloud", 0) + r.bytes.get("device_to_cell", 0)
    down = r.bytes.get("cloud_to_cell", 0) + r.bytes.get("cell_to_device", 0)
    revoked = r.cells_revoked or {}
    absent = ", ".join(c for c in r.cells_absent if c not in revoked)
    rejected = ", ".join(f"{x.get('from')}: {x.get('reason')}" for x in r.rejected)
    gone = ", ".join(revoked)  # the federation revoked them: out of the job since
    notes = (absent and f"absent {absent}", gone and f"revoked {gone}", rejected and f"rejected {rejected}")
    return _plain(
        "round",
        nth(r.round),
        "cloud",
        f"{len(r.cells_reported)}/{len(r.cells_planned)} cells",
        "; ".join(filter(None, notes)) or "-",
        f"{up:,}",
        f"{down:,}",
        _fmt(r.loss),
        _fmt(r.accuracy),
        r.closed_by,
        f"{r.duration_s:.3f}",
    )


def records_table(records: list[Record]) -> Table:
    """One row per record, cells' aggregations and cloud rounds alike; record text is shown as it is (rich
    ``Text``), never read as markup."""
    table = Table(header_style="bold")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in LEFT else "right")
    for r in records:
        table.add_row(*(_cell_row(r) if isinstance(r, CellRecord) else _round_row(r)))
    return table


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--cell", "cells", multiple=True, metavar="CELL", help="Only this cell (repeatable).")
@click.option(
    "--round",
    "round_range",
    metavar="A:B",
    help="Cloud rounds A to B, both included (A:, :B, A), counted from 1 as the table, the monitor and the report "
    "show them (--json prints the records as they are: their round field counts from 0).",
)
@click.option(
    "--event",
    "events",
    multiple=True,
    type=click.Choice(EVENTS),
    help="Only cell aggregations or cloud rounds (repeatable).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON record per line (for jq and friends).")
def logs(run_dir: str, cells: tuple[str, ...], round_range: str | None, events: tuple[str, ...], as_json: bool) -> None:
    """Print RUN_DIR's cell aggregation and cloud round records, filtered.

    Invalid lines are reported on stderr and skipped. Bytes in a cloud row: up = device->cell +
    cell->cloud, down = cloud->cell + cell->device.
    """
    try:
        rounds = parse_round_range(round_range) if round_range else (None, None)
    except ValueError as exc:
        fail(str(exc), 2)
    refuse_federation_folder(run_dir)
    records, bad = read_run(Path(run_dir))
    for line in bad:
        console.print(f"[yellow]warning:[/] invalid record {escape(str(line))}", highlight=False)
    if not records and not bad:
        fail(f"{run_dir} has no records (aggregation.jsonl, metrics.jsonl)", 1)
    chosen = filter_records(records, cells=cells, rounds=rounds, events=events)
    if as_json:
        for r in chosen:
            sys.stdout.write(r.to_json() + "\n")
        return
    output_console().print(records_table(chosen))
    said = f"{len(chosen)} of {len(records)} records"
    if records and not chosen and round_range:  # (`--round 9` of a 5-round job: an empty table, and no word why)
        said += f" (the records' rounds: {nth(min(r.round for r in records))}-{nth(max(r.round for r in records))})"
    if records and not chosen and cells:  # (`--cell c9` of cells c0, c1: the same empty table)
        known = sorted({r.cell for r in records if isinstance(r, CellRecord)})
        if unknown := sorted(set(cells) - set(known)):
            said += f" (no records of {', '.join(unknown)}; the records' cells: {', '.join(known)})"
    console.print(said, highlight=False)
