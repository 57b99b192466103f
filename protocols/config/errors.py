"""The error a bad configuration raises (:class:`UnusableFile`: a file it names that this node cannot use), and
pydantic's validation errors as one message naming each key."""

from __future__ import annotations

import difflib
import json
from typing import Any

from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    """A bad configuration; the message names the offending key(s)."""


class UnusableFile(ConfigError):
    """A file a setting names (``participation.path``, ``data.dataset = "npz:PATH"``, ``runtime.onnx_model``) that
    this node cannot use: missing, unreadable, or not what the setting takes. The message says why, for the node's
    own log; :attr:`public` names only the setting, the same whatever the cause. A job's signer is not the owner of
    the devices that read the files it names: a reason that leaves a device (its idle status, :func:`public_reason`)
    must not say whether a path exists there or what the file holds."""

    def __init__(self, setting: str, why: str) -> None:
        super().__init__(f"{setting}: {why}")
        self.setting = setting
        self.public = f"{setting}: the file it names is not usable on this device (its log says why)"


def public_reason(exc: BaseException) -> str:
    """What may be said of ``exc`` beyond this node: its message, but only the setting of an :class:`UnusableFile`."""
    return exc.public if isinstance(exc, UnusableFile) else str(exc)


def toml_literal(value: Any) -> str:
    """``value`` as a TOML file writes it (``"text"``, ``[1, 2]``, ``{ "c0" = ["a"] }``); :class:`TypeError` for what
    TOML holds not (a date, an object)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_literal(x) for x in value) + "]"
    if isinstance(value, dict):  # an inline table (topology.members)
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {toml_literal(x)}" for k, x in value.items()) + " }"
    raise TypeError(f"a config holds no {type(value).__name__} values, got {value!r:.40}")


def shown(value: Any, limit: int = 60) -> str:
    """``value`` for a message: as a config file writes it, at most ``limit`` characters (a member list can be a
    million devices)."""
    try:
        text = toml_literal(value)
    except TypeError:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


TOML_TYPES = {"a valid dictionary": "a table", "a valid list": "an array", "a valid tuple": "an array"}
"""pydantic's names of the types a config's values take, and a TOML file's."""


def format_errors(exc: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> str:
    """``exc`` as one message, a sentence per bad key: its value and what it must be; for an unknown key, the
    keys ``model`` (the model validated) takes there (``prefix`` names the section it validated)."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in ((prefix,) if prefix else ()) + tuple(err["loc"])) or "(config)"
        msg = err["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
        for python, toml in TOML_TYPES.items():  # what the file calls them
            msg = msg.replace(python, toml)
        if err["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown key{_known(model, err['loc'][:-1], str(err['loc'][-1]))}")
        elif err["type"] == "missing":
            lines.append(f"{loc}: required")
        elif err["type"] == "model_type":  # "a valid dictionary or instance of RunSection": a class name
            lines.append(f"{loc} = {shown(err.get('input'))}: must be a table ([{loc}] and its keys)")
        elif isinstance(err.get("input"), dict) and err["type"] == "value_error":  # a check across a section's keys
            lines.append(f"{loc}: {msg}")
        else:
            lines.append(f"{loc} = {shown(err.get('input'))}: {msg}")
    return "invalid config:\n  " + "\n  ".join(lines)


def _known(model: type[BaseModel] | None, path: tuple[Any, ...], key: str) -> str:
    """What ``model`` takes at ``path`` instead of ``key``: the key meant, if one is close, else all of them."""
    for part in path:
        field = model.model_fields.get(part) if model is not None and isinstance(part, str) else None
        inner = field.annotation if field is not None else None
        model = inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None
    if model is None:
        return ""
    keys = sorted(model.model_fields)
    close = difflib.get_close_matches(key, keys, n=1)
    where = f"[{'.'.join(map(str, path))}]" if path else "a config"
    return f" (did you mean {close[0]}?)" if close else f" ({where} takes {', '.join(keys)})"
