"""Algorithms: each module defines an :class:`Algorithm` with its cloud, cell and device roles."""

from __future__ import annotations

from ..rejections import Rejected
from .base import Algorithm, CellRole, CloudRole, DeviceContext, DeviceRole, ModelSpec, TrainParams
from .decomfl import DeComFL
from .fedalign import FedAlign
from .fedavg import FedAvg
from .fedmrn import FedMRN
from .hist import Hist

ALGORITHMS: dict[str, type[Algorithm]] = {
    FedAlign.name: FedAlign,
    DeComFL.name: DeComFL,
    FedAvg.name: FedAvg,
    FedMRN.name: FedMRN,
    Hist.name: Hist,
}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Add an algorithm to the registry (usable as a class decorator)."""
    ALGORITHMS[cls.name] = cls
    return cls


def get_algorithm(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r} (available: {', '.join(sorted(ALGORITHMS))})") from None


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "CellRole",
    "CloudRole",
    "DeviceContext",
    "DeviceRole",
    "ModelSpec",
    "Rejected",
    "TrainParams",
    "get_algorithm",
    "register",
]
