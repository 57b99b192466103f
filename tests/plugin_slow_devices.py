"""A ``[run] plugins`` module for ``tests/test_sim_stall.py``: FedAvg whose device roles take :data:`BUILD_S` seconds
each to build in a sim worker (as a device whose role loads something of its own does), so a worker's first batch
spends ``BUILD_S`` x its devices preparing them before any trains."""

from __future__ import annotations

import multiprocessing
import time

from protocols.algorithms import register
from protocols.algorithms.base import DeviceRole
from protocols.algorithms.fedavg import FedAvg

BUILD_S = 0.05


class SlowDevicesFedAvg(FedAvg):
    name = "fedavg_slow_devices"

    def device(self, device: str) -> DeviceRole:
        if multiprocessing.current_process().name.startswith("fedtier-sim-worker"):
            time.sleep(BUILD_S)  # (the fault: a slow build, in the worker only)
        return super().device(device)


register(SlowDevicesFedAvg)
