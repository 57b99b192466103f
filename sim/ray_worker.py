"""The Ray side of ``fedtier sim``'s workers (``sim/ray_executor.py``): an actor that trains its share of the devices
with a :class:`DeviceWorker` built from the run's config text and the dataset the main process shipped through
Ray's object store (its arrays as numpy buffers), so a node needs fedtier installed, not the data.

A task comes and its result goes as one bytes frame (``sim/worker_frames.py``): Ray pickles what crosses, so
nothing but bytes and a few strings does. A worker that cannot start answers every task with its traceback
(``fatal``), as a worker process does, instead of raising it through Ray."""

from __future__ import annotations

import json
import os
import traceback
from typing import Any

import numpy as np

from .datasets import Dataset
from .device_worker import DeviceWorker
from .worker_frames import batch_items, frame, unframe


def geometry(ds: Dataset) -> str:
    """What a worker needs of ``ds`` besides its training arrays (:class:`RayWorker`'s ``shape``)."""
    return json.dumps({"input_shape": list(ds.input_shape), "num_classes": ds.num_classes, "name": ds.name})


class RayWorker:
    """One Ray actor: the devices ``devices`` of the run ``config_text``, on the shipped training arrays."""

    def __init__(self, config_text: str, devices: list[str], shape: str, x_train: Any, y_train: Any) -> None:
        self.fatal = ""
        try:
            g = json.loads(shape)
            x, y = np.asarray(x_train), np.asarray(y_train)
            ds = Dataset(x, y, x[:0], y[:0], tuple(g["input_shape"]), int(g["num_classes"]), str(g["name"]))
            self.worker = DeviceWorker(config_text, devices, ds)
        except BaseException:  # told with each answer (the main process names the actor and its devices)
            self.fatal = traceback.format_exc()

    def where(self) -> str:
        """This actor's node (address and id) and process id (JSON): the main process logs where its workers run."""
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        return json.dumps({"node": ray.util.get_node_ip_address(), "node_id": node_id, "pid": os.getpid()})

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
