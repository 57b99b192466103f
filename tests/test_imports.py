"""The layering holds and no module imports itself back, type-checking imports included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("protocols", "edge_agent", "cell_server", "cloud", "monitor", "sim", "fedtier")


def circles(graph: grimp.ImportGraph, skip: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), without the ``skip`` edges."""
    adj = {
        m: sorted(i for i in graph.find_modules_directly_imported_by(m) if (m, i) not in skip) for m in graph.modules
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in adj.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(adj):
        if m not in index:
            visit(m)
    return out


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*ROOMS, cache_dir=None)  # type-checking imports included


def test_no_module_imports_itself_back(graph: grimp.ImportGraph) -> None:
    assert circles(graph, set()) == []


def test_the_circle_finder_finds_a_circle() -> None:
    looped = grimp.build_graph(*ROOMS, cache_dir=None)
    looped.add_import(importer="protocols.params", imported="protocols.config")  # config imports params' users
    assert any("protocols.params" in c for c in circles(looped, set()))


def test_import_linter_contracts_are_kept() -> None:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in done.stdout


def test_setup_compiles_every_product_package_to_bytecode() -> None:
    """scripts/setup.sh compiles each product package (an editable install's source is not compiled by pip): where
    PYTHONDONTWRITEBYTECODE is set, a package it leaves out is compiled again by every process that imports it."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    line = next((x for x in setup.splitlines() if "-m compileall" in x and not x.startswith("#")), "")
    assert set(line.split("-q", 1)[-1].split(">", 1)[0].split()) == set(ROOMS), line
