"""Validation, privacy and attacks ask an algorithm stack's traits, never algorithm names."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocols.algorithms import ALGORITHMS, register
from protocols.algorithms.compose import check_layers, needs
from protocols.algorithms.fedavg import FedAvg
from protocols.algorithms.traits import Trait
from protocols.config import ConfigError, parse_config
from protocols.privacy.secagg import refusal
from sim.attack import byzantine_devices
from tests.conftest import product_trees


def _product_trees() -> Iterator[tuple[str, ast.AST]]:
    yield from product_trees()  # parsed once for the tests that read the product's code


def _strings(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for elt in node.elts for s in _strings(elt)]
    return []


def test_no_algorithm_name_is_compared_outside_the_registry() -> None:
    names = set(ALGORITHMS)
    found = []
    for where, tree in _product_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):  # e.g. train.name in ("fedavg", "hist"), params.name != "fedavg"
                sides = (node.left, *node.comparators)
                by_name = any(isinstance(side, ast.Attribute) and side.attr == "name" for side in sides)
                if by_name and any(names & set(_strings(side)) for side in sides):
                    found.append(f"{where}:{node.lineno}")
            elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(names & set(_strings(node))) >= 2:
                found.append(f"{where}:{node.lineno}")  # a list of algorithm names
    assert not found, f"algorithm names compared or listed outside the registry: {found}"


def test_no_getattr_probe_of_algorithm_params() -> None:
    probes = []
    for where, tree in _product_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and node.args:
                target = ast.unparse(node.args[0])
                if target in ("params", "self.p", "self.params", "train", "cfg.train", "self.train"):
                    probes.append(f"{where}:{node.lineno}: getattr({target}, ...)")
    assert not probes, probes


@pytest.mark.parametrize(
    "algorithm, trait, has",
    [
        ({"name": "fedavg"}, Trait.CELL_SUM, True),
        ({"name": "hist"}, Trait.CELL_SUM, True),
        ({"name": "fedavg", "uplink": "topk"}, Trait.CELL_SUM, False),
        ({"name": "fedavg", "uplink": "topk"}, Trait.PLAIN_DELTA_UPLINK, False),
        ({"name": "fedavg", "cell_aggregator": "median"}, Trait.PLAIN_DELTA_UPLINK, True),
        ({"name": "fedavg", "cloud_aggregator": "krum"}, Trait.CELL_SUM, True),
        ({"name": "fedavg", "cloud_aggregator": "krum"}, Trait.CLOUD_SUM, False),
        ({"name": "fedavg", "mode": "async"}, Trait.ASYNC, True),
        ({"name": "fedavg"}, Trait.ASYNC, False),
        ({"name": "decomfl"}, Trait.FORWARD_ONLY, True),
        ({"name": "fedmrn"}, Trait.CLOUD_SUM, True),
    ],
)
def test_layers_take_traits_away_and_add_them(algorithm: dict, trait: Trait, has: bool) -> None:
    train = parse_config({"algorithm": algorithm}).train
    assert (trait in ALGORITHMS[train.name].traits_with(train)) is has
    assert (needs(train, trait) is None) is has


def test_a_plugin_is_judged_by_the_traits_it_declares() -> None:
    class Summing(FedAvg):
        name = "test-summing"
        traits = frozenset({Trait.CELL_SUM, Trait.CLOUD_SUM})
        without = {Trait.PLAIN_DELTA_UPLINK: "its devices add a control variate to their result"}

    register(Summing)
    try:
        train = parse_config({"algorithm": {"name": "test-summing"}}).train
        assert refusal(train) is None  # secure aggregation: its cells sum dense deltas
        parse_config({"algorithm": {"name": "test-summing"}, "privacy": {"secure_aggregation": True}})
        attacked = parse_config({"algorithm": {"name": "test-summing"}, "attack": {"kind": "scale", "fraction": 0.2}})
        with pytest.raises(ConfigError, match="control variate"):  # attacks need plain deltas: its own reason
            byzantine_devices(attacked)
        with pytest.raises(ConfigError, match=r"versioned \(fedavg\)"):  # async: only what declares VERSIONED
            parse_config({"algorithm": {"name": "test-summing", "mode": "async"}})
        krum = parse_config({"algorithm": {"name": "test-summing", "cell_aggregator": "krum"}}).train
        assert "cell_aggregator = 'krum'" in (refusal(krum) or "")
        assert check_layers(train) is None
    finally:
        del ALGORITHMS["test-summing"]


def test_forward_only_devices_are_refused_under_an_algorithm_whose_devices_take_gradients(tmp_path: Path) -> None:
    """``runtime.onnx_devices`` and ``fedtier agent --backend onnx`` ask the FORWARD_ONLY trait: under fedavg the
    config (exit 2) and the agent refuse at the start, naming the algorithms that have it (the devices failed every
    task, "OnnxTrainer cannot run SGD", and the run went on)."""
    from click.testing import CliRunner

    from fedtier.cli import main

    with pytest.raises(ConfigError, match=r"runtime.onnx_devices: forward-only .* \(decomfl\), not 'fedavg'"):
        parse_config({"algorithm": {"name": "fedavg"}, "runtime": {"onnx_devices": ["c0-d0"]}})
    parse_config({"algorithm": {"name": "decomfl"}, "runtime": {"onnx_devices": ["c0-d0"]}})
    config = tmp_path / "c.toml"
    config.write_text('[algorithm]\nname = "fedavg"\n')
    for name in ("data.npz", "m.onnx"):
        (tmp_path / name).write_bytes(b"")  # refused before either is read
    agent = ["agent", str(config), "--device", "c0-d0", "--data", str(tmp_path / "data.npz")]
    onnx = [
        "--broker",
        "mqtt://127.0.0.1:1",
        "--insecure",
        "--backend",
        "onnx",
        "--onnx-model",
        str(tmp_path / "m.onnx"),
    ]
    done = CliRunner().invoke(main, [*agent, *onnx])  # in this process: a refusal needs no Python process of its own
    said = " ".join(done.output.split())  # (the console wraps it)
    assert done.exit_code == 2 and "--backend onnx: forward-only" in said, done.output[-2000:]
