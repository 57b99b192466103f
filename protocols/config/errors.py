"""The error a bad configuration raises (:class:`UnusableFile`: a file it names that this node cannot use), and
pydantic's validation errors as one message naming each key."""

from __future__ import annotations

from pydantic import ValidationError


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


def format_errors(exc: ValidationError, prefix: str = "") -> str:
    """``exc`` as one message, a line per bad key (``prefix`` names the section the model validated)."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in ((prefix,) if prefix else ()) + tuple(err["loc"]))
        msg = err["msg"].replace("Extra inputs are not permitted", "unknown key")
        lines.append(f"{loc or '(config)'}: {msg}")
    return "invalid config:\n  " + "\n  ".join(lines)
