"""Explicit membership: cells of their own sizes and device ids (topology.members), the same in every
engine; impossible memberships refused with the reason."""

from __future__ import annotations

import pytest

from protocols import runfiles
from protocols.config import ConfigError, TopologySection, load_config
from sim.emulation import Emulation
from sim.launcher import run_simulation

CONFIG = """
[run]
name = "members"
rounds = 2
output = "{out}"
[topology]
members = {{ c0 = ["alpha", "beta", "gamma"], edge1 = ["delta"] }}
[algorithm]
name = "fedavg"
local_steps = 3
[model]
name = "mlp"
hidden = [8]
[data]
dataset = "digits"
partition = "{partition}"
"""


def _cfg(tmp_path, name: str, partition: str = "iid"):
    path = tmp_path / f"{name}.toml"
    path.write_text(CONFIG.format(out=tmp_path / name, partition=partition))
    return load_config(path)


def test_cells_of_their_own_sizes_train_byte_identically_in_sim_and_emulation(tmp_path):
    sim = run_simulation(_cfg(tmp_path, "sim"))
    emu = Emulation(_cfg(tmp_path, "emu")).run()
    assert (sim.output_dir / runfiles.FINAL_MODEL).read_bytes() == (emu.output_dir / runfiles.FINAL_MODEL).read_bytes()
    planned = {(r["cell"], tuple(r["answered"])) for r in sim.cell_records}
    assert planned == {("c0", ("alpha", "beta", "gamma")), ("edge1", ("delta",))}
    assert load_config(sim.output_dir / runfiles.CONFIG).topology.members == {
        "c0": ["alpha", "beta", "gamma"],
        "edge1": ["delta"],
    }  # the run's config.toml keeps the membership


def test_membership_queries():
    t = TopologySection(members={"c0": ["a", "b"], "c1": ["x"]})
    assert t.cell_ids() == ["c0", "c1"] and t.device_ids("c1") == ["x"] and t.cell_of("b") == "c0"
    assert t.cell_of("c0-d0") is None and t.devices().position("x") == 2 and (t.cells, t.devices_per_cell) == (2, 2)


@pytest.mark.parametrize(
    "members, why",
    [
        ({"c0": ["a"], "c1": ["a"]}, "'a' appears twice"),
        ({"c0": ["c0"]}, "'c0' appears twice"),
        ({"c0": ["a/b"]}, "device id 'a/b' must be"),
        ({}, "at least one cell"),
    ],
)
def test_impossible_memberships_are_refused(members, why):
    with pytest.raises(ValueError, match=why):
        TopologySection(members=members)


def test_a_partition_that_needs_equal_cells_is_refused_for_unequal_ones(tmp_path):
    with pytest.raises(ConfigError, match="'hierarchical' needs cells of equal size"):
        run_simulation(_cfg(tmp_path, "h", partition="hierarchical"))
