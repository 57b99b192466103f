#!/usr/bin/env python3
"""Keep the product packages in shape: no file over 500 lines, no function over 60 lines (issue #34).

    .venv/bin/python scripts/check_sizes.py [ROOT]

Walks the product packages under ROOT (default: the repository this script is in) and prints every
offender as ``path:line: name is N lines (limit L)``; exits 1 if there is any, else prints a one-line
summary and exits 0. A function is measured from its ``def`` (decorators excluded) to its last line;
nested functions and methods are measured on their own too. tests/, benchmarks/, docs/ and scripts/ are
not product code and are not checked.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("fedtier", "protocols", "sim", "cloud", "cell_server", "edge_agent", "monitor")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


@dataclass(frozen=True)
class Offence:
    """One file or function over its limit."""

    path: str
    line: int
    name: str
    lines: int
    limit: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.name} is {self.lines} lines (limit {self.limit})"


def _qualified_functions(tree: ast.AST) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function in ``tree`` with its dotted name (``Class.method``, ``outer.inner``)."""
    found: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append((prefix + child.name, child))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def check_file(path: Path, shown: str) -> list[Offence]:
    """The offences of one Python file; ``shown`` is the path printed for it."""
    text = path.read_text(encoding="utf-8")
    offences: list[Offence] = []
    n_lines = len(text.splitlines())
    if n_lines > MAX_FILE_LINES:
        offences.append(Offence(shown, 1, "file", n_lines, MAX_FILE_LINES))
    for name, node in _qualified_functions(ast.parse(text, filename=str(path))):
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        if length > MAX_FUNCTION_LINES:
            offences.append(Offence(shown, node.lineno, name, length, MAX_FUNCTION_LINES))
    return offences


def check_tree(root: Path) -> tuple[list[Offence], int]:
    """All offences under the product packages of ``root`` (by path and line), and how many files were checked."""
    offences: list[Offence] = []
    n_files = 0
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            n_files += 1
            offences += check_file(path, path.relative_to(root).as_posix())
    return sorted(offences, key=lambda o: (o.path, o.line)), n_files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args(argv)
    offences, n_files = check_tree(args.root)
    for offence in offences:
        print(offence)
    if offences:
        print(f"{len(offences)} over the size limits in {n_files} files", file=sys.stderr)
        return 1
    print(
        f"sizes ok: {n_files} files in {len(PACKAGES)} packages, none over {MAX_FILE_LINES} lines, "
        f"no function over {MAX_FUNCTION_LINES} lines"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
