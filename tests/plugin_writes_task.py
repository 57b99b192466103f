"""A ``[run] plugins`` module for ``tests/test_shared_payload.py``: FedAvg whose devices first move the received model
by a step of their own, written in place into a torch tensor made with ``torch.from_numpy`` from the task
(``fedavg_writes_task``), or into a copy of it (``fedavg_copies_task``, the safe way), then train as FedAvg's from it.
Neither declares ``writes_task``: as any plugin's role, each is handed a task of its own.
``fedavg_subclass_writes_task`` does the same as ``fedavg_writes_task`` from a subclass of FedAvg's device role
(which declares ``writes_task = False`` for its own ``train``): its ``train`` is its own, so it is handed a task of its
own too."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from protocols.algorithms import register
from protocols.algorithms.base import DeviceContext, DeviceRole
from protocols.algorithms.fedavg import FedAvg, FedAvgDevice
from protocols.trainer import LocalData, Trainer
from protocols.wire.payload import Payload


class _Stepping(DeviceRole):
    copies = False

    def __init__(self, role: DeviceRole) -> None:
        self.role = role

    def train(self, task: Payload, data: LocalData, trainer: Trainer, ctx: DeviceContext) -> Payload:
        tensors = {k: np.array(v) for k, v in task.tensors.items()} if self.copies else task.tensors
        with warnings.catch_warnings():  # torch warns of a read-only array: this plugin writes into it anyway
            warnings.simplefilter("ignore", UserWarning)
            for name in sorted(tensors):
                if tensors[name].dtype == np.float32:
                    torch.from_numpy(tensors[name]).add_(0.25)  # in place
        return self.role.train(Payload(task.meta, tensors), data, trainer, ctx)


class _Copying(_Stepping):
    copies = True


class _SubclassStepping(FedAvgDevice):
    def train(self, task: Payload, data: LocalData, trainer: Trainer, ctx: DeviceContext) -> Payload:
        with warnings.catch_warnings():  # torch warns of a read-only array: this plugin writes into it anyway
            warnings.simplefilter("ignore", UserWarning)
            for name in sorted(task.tensors):
                if task.tensors[name].dtype == np.float32:
                    torch.from_numpy(task.tensors[name]).add_(0.25)  # in place
        return super().train(task, data, trainer, ctx)


class WritesTaskFedAvg(FedAvg):
    name = "fedavg_writes_task"

    def device(self, device: str) -> DeviceRole:
        return _Stepping(super().device(device))


class CopiesTaskFedAvg(FedAvg):
    name = "fedavg_copies_task"

    def device(self, device: str) -> DeviceRole:
        return _Copying(super().device(device))


class SubclassWritesTaskFedAvg(FedAvg):
    name = "fedavg_subclass_writes_task"

    def device(self, device: str) -> DeviceRole:
        return _SubclassStepping(self.params)


register(WritesTaskFedAvg)
register(SubclassWritesTaskFedAvg)
register(CopiesTaskFedAvg)
