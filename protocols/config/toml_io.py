"""Config dicts to and from TOML text: ``key.path=value`` overrides, and a small writer."""

from __future__ import annotations

import tomllib
from typing import Any

from ..jsonl import nested_deeper
from .errors import ConfigError, toml_literal

MAX_TOML_DEPTH = 32
"""Arrays and tables nest at most this deep in a config or a job (fedtier's own nest 3: a section, ``topology.members``,
a device list)."""


def parse_toml(text: str) -> dict[str, Any]:
    """``tomllib.loads`` of a config or a job's text, which a file, the operator or the cloud gives: nesting deeper
    than :data:`MAX_TOML_DEPTH` is a :class:`tomllib.TOMLDecodeError` saying so, not a ``RecursionError`` of the parser
    (from ~1000 levels: a traceback, or a job request the cloud never answers) or of a later walk of the values."""
    try:
        data = tomllib.loads(text)
    except RecursionError:
        data = None
    if data is None or nested_deeper(data, MAX_TOML_DEPTH):
        raise tomllib.TOMLDecodeError(f"arrays or tables nested deeper than {MAX_TOML_DEPTH} levels")
    return data


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set ``a.b.c=value`` in a nested dict; the value is read as TOML, or else as a string."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r}: expected key.path=value")
    try:
        value = parse_toml(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
        node = nxt
    if isinstance(node.get(parts[-1]), dict) and not isinstance(value, dict):  # not the next override's fault
        raise ConfigError(f"override {item!r}: {key.strip()} is a section: set one of its keys ({key.strip()}.KEY=...)")
    node[parts[-1]] = value


def dump_toml(data: dict[str, Any]) -> str:
    """A small TOML writer for config dicts (sections of scalars and lists); :class:`ConfigError` for what a
    config cannot hold (a key outside a section, a date)."""

    def value(v: Any) -> str:
        try:
            return toml_literal(v)
        except TypeError as exc:
            raise ConfigError(str(exc)) from None

    out = []
    for section, body in data.items():
        if not isinstance(body, dict):
            raise ConfigError(f"{section}: a key outside the config's [sections]")
        out.append(f"[{section}]")
        for k, v in body.items():
            out.append(f"{k} = {value(v)}")
        out.append("")
    return "\n".join(out)
