"""MkDocs hooks of the docs site (mkdocs.yml ``hooks``): the generated references go into their pages at build time.

A page line ``<!-- fedtier-reference: NAME -->`` is replaced by ``fedtier.docs_reference.REFERENCES[NAME]()``,
so the configuration, CLI, metrics and topic references are written from the code on every build.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MARKER = re.compile(r"^<!-- fedtier-reference: (\w+) -->$", re.M)


def expand(markdown: str) -> str:
    """``markdown`` with every reference marker replaced by its generated reference."""
    from fedtier.docs_reference import REFERENCES

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in REFERENCES:
            raise ValueError(f"unknown fedtier reference {name!r} (known: {', '.join(REFERENCES)})")
        return REFERENCES[name]()

    return MARKER.sub(one, markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return expand(markdown)


ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):(?=<code>)")


def on_page_content(html: str, **_: Any) -> str:
    """Docstrings use Sphinx roles (``:class:`Payload```), which mkdocstrings leaves in the text: drop them."""
    return ROLE.sub("", html)
