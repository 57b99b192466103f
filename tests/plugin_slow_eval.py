"""A ``[run] plugins`` module for ``tests/test_sim_stall.py``: FedAvg whose devices first evaluate the received model
on their data, repeated to last :data:`EVAL_S` seconds (as FedALIGN's devices evaluate ``F_k`` on a large data set,
forward only: no training step meanwhile), then train as FedAvg's."""

from __future__ import annotations

import time

import numpy as np

from protocols.algorithms import register
from protocols.algorithms.base import DeviceContext, DeviceRole
from protocols.algorithms.fedavg import FedAvg
from protocols.trainer import LocalData, Trainer
from protocols.wire.payload import Payload

EVAL_S = 2.0


class SlowEvalDevice(DeviceRole):
    def __init__(self, role: DeviceRole) -> None:
        self.role = role

    def train(self, task: Payload, data: LocalData, trainer: Trainer, ctx: DeviceContext) -> Payload:
        trainer.set_params(task.tensors)
        x, y = np.concatenate([data.x] * 8), np.concatenate([data.y] * 8)  # several evaluation batches
        until = time.monotonic() + EVAL_S
        while time.monotonic() < until:
            trainer.evaluate(x, y, batch_size=256)
        return self.role.train(task, data, trainer, ctx)


class SlowEvalFedAvg(FedAvg):
    name = "fedavg_slow_eval"

    def device(self, device: str) -> DeviceRole:
        return SlowEvalDevice(super().device(device))


register(SlowEvalFedAvg)
