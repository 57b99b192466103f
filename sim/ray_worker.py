"""The Ray side of ``fedtier sim``'s workers (``sim/ray_actors.py``): an actor that trains its share of the devices
with a :class:`DeviceWorker` built from the run's config text and the dataset the main process shipped through
Ray's object store (its arrays as numpy buffers), so a node needs fedtier installed, not the data; the same fedtier
code, Python, numpy and torch as the main process (:func:`software`), or it refuses to start.

A task comes and its result goes as one bytes frame (``sim/worker_frames.py``): Ray pickles what crosses, so
nothing but bytes and a few strings does. A worker that cannot start answers every task with its traceback
(``fatal``), as a worker process does, instead of raising it through Ray."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import os
import sys
import tempfile
import tomllib
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from protocols.trainer import PROGRESS

from .datasets import Dataset
from .device_worker import DeviceWorker
from .worker_frames import batch_items, frame, unframe


def geometry(ds: Dataset) -> str:
    """What a worker needs of ``ds`` besides its training arrays (:class:`RayWorker`'s ``shape``)."""
    return json.dumps({"input_shape": list(ds.input_shape), "num_classes": ds.num_classes, "name": ds.name})


CODE = ("protocols", "sim", "edge_agent")  # the packages a worker runs


@functools.cache
def software() -> dict[str, str]:
    """What decides a worker's bytes besides the config: a digest of fedtier's code (the ``.py`` files of ``CODE``)
    and the versions of Python, numpy and torch. A node's must be the main process's for the run to be the
    one-process run, bit for bit."""
    import torch

    digest = hashlib.sha256()
    for name in CODE:
        root = Path(importlib.import_module(name).__file__ or "").parent
        for path in sorted(root.rglob("*.py")):
            digest.update(path.relative_to(root.parent).as_posix().encode() + b"\0" + path.read_bytes())
    python = ".".join(map(str, sys.version_info[:3]))
    return {
        "fedtier code": digest.hexdigest()[:16],
        "python": python,
        "numpy": np.__version__,
        "torch": torch.__version__,
    }


def check_software(expected: str) -> None:
    """RuntimeError naming what differs when this node's :func:`software` is not the main process's ``expected``."""
    here, there = software(), json.loads(expected)
    differ = [f"{k}: {there.get(k)} in the main process, {v} here" for k, v in here.items() if there.get(k) != v]
    if differ:
        raise RuntimeError(
            f"this node's software differs from the main process's ({'; '.join(differ)}): install the same fedtier, "
            "Python, numpy and torch on every node"
        )


@contextlib.contextmanager
def with_init_model(config_text: str, data: bytes | None) -> Iterator[str]:
    """``config_text`` with ``run.init_model`` naming a private copy of ``data`` on this node, for building the
    algorithm (which reads the file at once; its ``init_model_sha256``, if set, still checks it); removed after."""
    if data is None:
        yield config_text
        return
    from protocols.config import parse_config

    fd, path = tempfile.mkstemp(prefix="fedtier-init-", suffix=".ftw")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        cfg = parse_config(tomllib.loads(config_text))
        yield cfg.model_copy(update={"run": cfg.run.model_copy(update={"init_model": path})}).to_toml()
    finally:
        os.unlink(path)


class RayWorker:
    """One Ray actor: the devices ``devices`` of the run ``config_text``, on the shipped training arrays; ``expected``:
    the main process's :func:`software` (JSON)."""

    def __init__(
        self,
        config_text: str,
        devices: list[str],
        shape: str,
        x_train: Any,
        y_train: Any,
        expected: str,
        init_model: bytes | None = None,
    ) -> None:
        """``init_model``: the bytes of the file ``run.init_model`` names on the main process's machine."""
        self.fatal = ""
        try:
            check_software(expected)
            g = json.loads(shape)
            x, y = np.asarray(x_train), np.asarray(y_train)
            ds = Dataset(x, y, x[:0], y[:0], tuple(g["input_shape"]), int(g["num_classes"]), str(g["name"]))
            with with_init_model(config_text, init_model) as text:
                self.worker = DeviceWorker(text, devices, ds)
        except BaseException:  # told with each answer (the main process names the actor and its devices)
            self.fatal = traceback.format_exc()

    def where(self) -> str:
        """This actor's node (address and id) and process id (JSON): the main process logs where its workers run."""
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        return json.dumps({"node": ray.util.get_node_ip_address(), "node_id": node_id, "pid": os.getpid()})

    def progress(self) -> int:
        """This actor's training steps so far (``protocols.trainer.PROGRESS``): the main process polls it, on a
        concurrency group of its own, while the actor owes results, to tell a slow actor from a hung one."""
        return PROGRESS.steps

    def train(self, task: bytes) -> bytes:
        """A task frame (``{"ctx": ...}`` + its payload) -> its result frame (``{"error", "checked"}`` + payload)."""
        if self.fatal:
            return frame({"fatal": self.fatal})
        header, body = unframe(task)
        parts, error = self.worker.train_parts(header["ctx"], body)
        return frame({"error": error, "checked": not error}, parts)

    def train_batch(self, batch: bytes) -> bytes:
        """A batch frame (``worker_frames.Batch``) -> one frame of its results in order: ``{"results": [{"error",
        "checked", "n"}...]}`` and their payloads, ``n`` bytes each (engine = cohort: trained as cohorts)."""
        if self.fatal:
            return frame({"fatal": self.fatal})
        header, body = unframe(batch)
        answers = self.worker.train_many(batch_items(header, body))
        head = [
            {
                "error": error,
                "checked": not error,
                "n": sum(p.nbytes if isinstance(p, np.ndarray) else len(p) for p in parts),
            }
            for parts, error in answers
        ]
        return frame({"results": head}, [p for parts, _ in answers for p in parts])
