"""Model files and checkpoints in the ``tensors/v1`` payload format (never pickle).

The bytes depend only on the tensors and metadata, so two runs that end in the same model write
byte-identical files. Writes go to a temporary file that is then renamed: a crash leaves the
previous file intact.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .wire.payload import Payload, decode_payload, encode_payload

MAGIC = b"FTCK1\n"


def save_payload(path: str | Path, payload: Payload) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("wb") as fh:
        fh.write(MAGIC + encode_payload(payload))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load_payload(path: str | Path) -> Payload:
    data = Path(path).read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError(f"{path} is not a fedtier model/checkpoint file")
    return decode_payload(data[len(MAGIC):])


def save_params(path: str | Path, params: Mapping[str, np.ndarray], **meta: Any) -> None:
    """Write a model (``name -> array``) with optional JSON metadata."""
    save_payload(path, Payload(dict(meta), dict(params)))


def load_params(path: str | Path) -> dict[str, np.ndarray]:
    """Read a model written by :func:`save_params`."""
    return load_payload(path).tensors
