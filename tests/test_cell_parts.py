"""The cell server keeps its whole state in attributes its constructors set (its node's and its rounds'),
grouped in parts that set theirs in theirs (the parts that drive it, recovery and secure aggregation, see
it through their declared ``Host`` interfaces)."""

from __future__ import annotations

import ast
import dataclasses
import inspect

from cell_server.cell_node import CellNode, NodeOptions
from cell_server.liveness import Liveness
from cell_server.parts import CellLimits, EdgeRound, PresenceTimes, RoundTally
from cell_server.server import CellServer
from cell_server.telemetry import CellTelemetry
from protocols.algorithms import get_algorithm
from protocols.algorithms.base import ModelSpec
from protocols.config import parse_config
from protocols.transport.memory import MemoryHub


def _assigned(cls: type) -> set[str]:
    """Every ``self.x`` the class body assigns, in any method."""
    tree = ast.parse(inspect.getsource(inspect.getmodule(cls)))  # the module: its classes' methods too
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
    tree = node
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


def test_every_attribute_of_the_cell_server_is_set_by_its_constructor() -> None:
    train = parse_config({"algorithm": {"name": "fedavg"}}).train
    role = get_algorithm("fedavg")(train, ModelSpec(name="logreg", input_shape=(4,), num_classes=2), 0).cell("c0")
    cell = CellServer(
        MemoryHub().connect("c0"),
        run="r",
        cell="c0",
        devices=["c0-d0"],
        role=role,
        algorithm="fedavg",
        device_deadline=1.0,
    )
    for cls in (CellNode, CellServer):  # the node, and the rounds it runs
        assigned = _assigned(cls)
        assert assigned <= set(vars(cell)), f"first set outside __init__: {sorted(assigned - set(vars(cell)))}"
    for name, part in (("liveness", Liveness), ("telemetry", CellTelemetry)):
        assigned = _assigned(part)
        assert assigned <= set(vars(getattr(cell, name))), (
            f"{name}: {sorted(assigned - set(vars(getattr(cell, name))))}"
        )
    records = (CellLimits, PresenceTimes, EdgeRound, RoundTally)  # dataclasses: every field set by construction
    assert all(dataclasses.is_dataclass(r) for r in records)
    state = [*_assigned(CellNode), *_assigned(CellServer), *_assigned(Liveness), *_assigned(CellTelemetry)]
    assert len(state) + sum(len(dataclasses.fields(r)) for r in records) > 50  # the walk is not vacuous


def test_a_cell_server_passes_on_exactly_the_node_s_keyword_arguments() -> None:
    """``NodeOptions`` (what :class:`CellServer` takes for its node) names the keyword arguments of
    :class:`CellNode`, no more and no fewer."""
    node = inspect.signature(CellNode.__init__).parameters
    assert set(NodeOptions.__annotations__) == {n for n, p in node.items() if p.kind is p.KEYWORD_ONLY}
