"""docs/ARCHITECTURE.md (the codemap) stays true: every path, module, name, topic and test it names exists,
every room of the project is described, and the layering it states is the one import-linter checks."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import subprocess
import tomllib
from functools import cache
from pathlib import Path

import yaml

from protocols.plugins import GROUPS
from protocols.wire import topics
from protocols.wire.envelope import MessageKind

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PRODUCT = tuple(PYPROJECT["tool"]["importlinter"]["root_packages"])
MAX_LINES = 250  # a map, not an atlas
TOOLS = ("ruff", "lint-imports", "mypy", "mkdocs", "pytest")  # what .ci/run runs, by first word

PATH = re.compile(r"[\w.*-]+(/[\w.*-]+)*/?")
TEST = re.compile(r"(tests/[\w/]+\.py)::(\w+)")
MODULE = re.compile(rf"(?:{'|'.join(PRODUCT)})(?:\.\w+)+")
NAME = re.compile(r"([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?(?:\(\))?")
PLACEHOLDERS = {"run": "{run}", "cell": "{cell}", "device": "{device}", "node": "{node}", "federation": "{fed}"}


def spans(text: str) -> list[str]:
    """The inline code spans of a markdown text."""
    return re.findall(r"`([^`\n]+)`", text)


@cache
def definitions() -> tuple[frozenset[str], frozenset[tuple[str, str]]]:
    """Every name the product packages define (classes, functions, assigned names, at any depth), and every
    ``(class, member)`` pair."""
    names: set[str] = set()
    members: set[tuple[str, str]] = set()
    for room in PRODUCT:
        for path in sorted((ROOT / room).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names.update(_defined(node))
                if isinstance(node, ast.ClassDef):
                    members.update((node.name, m) for child in node.body for m in _defined(child))
    return frozenset(names), frozenset(members)


def _defined(node: ast.AST) -> list[str]:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def scheme_topics() -> set[str]:
    """Every topic of ``protocols.wire.topics``, with placeholders for its parts."""
    out = set()
    for name, fn in vars(topics).items():
        if not inspect.isfunction(fn) or fn.__module__ != topics.__name__ or name.startswith("_"):
            continue
        params = list(inspect.signature(fn).parameters)
        if params and all(p in PLACEHOLDERS or p == "job" for p in params):
            value = fn(*(p.upper() for p in params))
            if not isinstance(value, str):  # a set of the topics above (e.g. what a job subscribes to)
                continue
            for p in params:
                value = value.replace(p.upper(), PLACEHOLDERS.get(p, "{job}"))
            out.add(value)
    return out


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def problems(text: str) -> list[str]:
    """What in ``text`` (a codemap) names something that does not exist, each in words."""
    out = []
    names, members = definitions()
    known_topics = scheme_topics()
    kinds = set(MessageKind.__args__)  # type: ignore[attr-defined]
    for span in spans(text):
        if (test := TEST.fullmatch(span)) is not None:
            file = ROOT / test.group(1)
            if not file.is_file() or test.group(2) not in defined_tests(file):
                out.append(f"test {span} does not exist")
        elif span.startswith("fedtier/{"):
            if span not in known_topics:
                out.append(f"topic {span} is not in protocols/wire/topics.py")
        elif "/" in span and PATH.fullmatch(span):
            if not any(ROOT.glob(span.rstrip("/"))):
                out.append(f"path {span} does not exist")
        elif span in GROUPS or span in PRODUCT:
            continue
        elif MODULE.fullmatch(span):
            if importlib.util.find_spec(span) is None:
                out.append(f"module {span} does not exist")
        elif (name := NAME.fullmatch(span)) is not None and (
            name.group(2) or "_" in span or span[0].isupper() or span.endswith("()")
        ):
            owner, member = name.group(1), name.group(2)
            if member is not None and owner[0].isupper():
                if (owner, member) not in members:
                    out.append(f"{span}: class {owner} defines no {member}")
            elif member is None and name.group(1) not in names and name.group(1) not in kinds:
                out.append(f"{span} is defined nowhere in the product packages")
    return out


def tracked_rooms() -> set[str]:
    """The top-level folders of the repository that hold tracked files (hidden ones aside)."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return {line.split("/")[0] for line in listed.splitlines() if "/" in line and not line.startswith(".")}


def test_everything_the_codemap_names_exists() -> None:
    text = DOC.read_text(encoding="utf-8")
    split = [n for n, line in enumerate(text.splitlines(), 1) if line.count("`") % 2 and not line.startswith("```")]
    assert split == [], f"lines {split}: a code span across lines is not checked; keep each on one line"
    assert problems(text) == []


def test_a_codemap_naming_what_does_not_exist_is_caught() -> None:
    made_up = (
        "`protocols/nowhere.py`, `protocols.nowhere`, `tests/test_wire.py::test_nothing`, `tests/nope.py::test_x`, "
        "`CellServer.no_such_method`, `NoSuchClass`, `fedtier/{run}/cell/{cell}/sideways`, `no_such_function()`, "
        "and what exists: `sim/launcher.py`, `protocols.wire.topics`, `CloudRole.plan`, `cell_task`, `make_executor`"
    )
    found = problems(made_up)
    assert [p.split()[0] for p in found] == [
        "path",
        "module",
        "test",
        "test",
        "CellServer.no_such_method:",
        "NoSuchClass",
        "topic",
        "no_such_function()",
    ], found


def test_every_room_of_the_project_is_described() -> None:
    text = DOC.read_text(encoding="utf-8")
    rooms = tracked_rooms()
    assert set(PRODUCT) <= rooms and {"tests", "docs"} <= rooms
    for room in sorted(rooms):
        assert f"| `{room}/` |" in text, f"docs/ARCHITECTURE.md does not describe {room}/ (a row of a rooms table)"


def test_the_layering_it_states_is_the_one_import_linter_checks() -> None:
    text = " ".join(DOC.read_text(encoding="utf-8").split())  # markdown wraps lines
    for contract in PYPROJECT["tool"]["importlinter"]["contracts"]:
        assert " ".join(contract["name"].split()) in text, f"contract {contract['name']!r} is not stated"
        if contract["type"] == "layers":
            assert " > ".join(f"`{layer}`" for layer in contract["layers"]) in text
        for room in contract.get("ancestors", []):
            assert f"`{room}`" in text
    mypy_row = next(line for line in DOC.read_text(encoding="utf-8").splitlines() if "| `mypy`" in line)
    for package in PYPROJECT["tool"]["mypy"]["files"]:
        assert f"`{package}`" in mypy_row, f"the mypy row does not name {package}"


def test_it_names_every_plugin_group_and_is_a_short_page_in_the_site_and_the_readme() -> None:
    text = DOC.read_text(encoding="utf-8")
    for group in GROUPS:
        assert f"`{group}`" in text
    assert len(text.splitlines()) <= MAX_LINES, "a codemap is a map, not an atlas: keep it short"
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    assert "ARCHITECTURE.md" in str(nav), "docs/ARCHITECTURE.md is in the site's nav"
    assert "](docs/ARCHITECTURE.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_ci_runs_every_tool_the_invariants_table_names() -> None:
    text = DOC.read_text(encoding="utf-8")
    table = text.split("## Invariants")[1].split("\n## ")[0]
    checkers = [c.split("|")[2] for c in table.splitlines() if c.startswith("| ") and c.count("|") >= 3]
    tools = {s for cell in checkers for s in spans(cell) if s.split()[0] in TOOLS or s.startswith("scripts/")}
    assert {"lint-imports", "mypy", "scripts/check_sizes.py"} <= tools, tools
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for tool in sorted(tools):
        assert tool in ci, f"docs/ARCHITECTURE.md says .ci/run runs {tool}; it does not"
