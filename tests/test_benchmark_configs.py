"""The hostile-input bounds (``protocols.limits``, the config's ``le=``) refuse no configuration the benchmarks run at
their documented sizes: the 10^6-device simulation, the 2,000-agent fleet, the paper presets at their horizons.
Parsed only, nothing runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import protocols.config
from benchmarks import decomfl, fedmrn, fleet, hist, population
from protocols.config import parse_config


class _Parsed(Exception):
    """Raised once a benchmark's config parsed: the benchmark goes no further."""


def test_the_million_device_simulation_and_the_2000_agent_fleet_parse(tmp_path: Path, monkeypatch) -> None:
    parsed: list[Any] = []

    def parse_then_stop(data: dict[str, Any]) -> Any:
        parsed.append(parse_config(data))
        raise _Parsed

    monkeypatch.setattr(protocols.config, "parse_config", parse_then_stop)
    with pytest.raises(_Parsed):
        population.one(10**6, 3, str(tmp_path / "population"))
    assert len(parsed[0].topology.devices()) == 10**6
    cfg = fleet.fleet_config(tmp_path / "fleet", 2000, 20, 3, signed=True, engine="cohort")
    assert len(cfg.topology.devices()) == 2000


def test_the_paper_presets_parse_at_their_horizons() -> None:
    """Every preset and method of the DeComFL (and its ~10,000-round paper horizon), FedMRN and HIST benchmarks."""
    configs = [decomfl.config("DeComFL", 0.01, 0, {**s, "zo_rounds": 10_000}) for s in decomfl.PRESETS.values()]
    configs += [decomfl.config(m, 0.01, 0, decomfl.PRESETS[p]) for p in decomfl.PRESETS for m in decomfl.GRIDS[p]]
    configs += [fedmrn.config(m, 0.01, 0, s) for s in fedmrn.PRESETS.values() for m in fedmrn.METHODS]
    configs += [
        hist.config(p, m, split, cells, 0.01, 0, 1000)
        for p in hist.PRESETS.values()
        for m in hist.METHODS
        for split in hist.SPLITS
        for cells in p["cells"]
    ]
    assert max(parse_config(c).run.rounds for c in configs) == 10_000 and len(configs) > 30
