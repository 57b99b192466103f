"""A ``[run] plugins`` module for ``tests/test_sim_stall.py``: FedAvg whose device ``c1-d0`` deadlocks in round 1
(its training thread waits for a lock it holds), while the rest of its worker process, its beat thread included,
stays alive."""

from __future__ import annotations

import threading

from protocols.algorithms import register
from protocols.algorithms.base import DeviceContext, DeviceRole
from protocols.algorithms.fedavg import FedAvg
from protocols.trainer import LocalData, Trainer
from protocols.wire.payload import Payload


class DeadlockingDevice(DeviceRole):
    def __init__(self, role: DeviceRole) -> None:
        self.role = role

    def train(self, task: Payload, data: LocalData, trainer: Trainer, ctx: DeviceContext) -> Payload:
        if (ctx.device, ctx.round) == ("c1-d0", 1):
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()  # never returns
        return self.role.train(task, data, trainer, ctx)


class DeadlockingFedAvg(FedAvg):
    name = "fedavg_deadlock"

    def device(self, device: str) -> DeviceRole:
        return DeadlockingDevice(super().device(device))


register(DeadlockingFedAvg)
