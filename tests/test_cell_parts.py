"""The cell server keeps its whole state in attributes its constructor sets (the parts that drive it,
recovery and secure aggregation, see it through their declared ``Host`` interfaces)."""

from __future__ import annotations

import ast
import inspect

from cell_server.server import CellServer
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
    assigned = _assigned(CellServer)
    assert len(assigned) > 50
    assert assigned <= set(vars(cell)), f"first set outside __init__: {sorted(assigned - set(vars(cell)))}"
