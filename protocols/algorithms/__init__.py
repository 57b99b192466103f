"""Algorithms: each module defines an :class:`Algorithm` with its cloud, cell and device roles."""

from __future__ import annotations

from ..plugins import PluginError, check_plugin_name
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
BUILTIN_ALGORITHMS = tuple(ALGORITHMS)


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Add an algorithm to the registry (usable as a class decorator). :class:`PluginError` naming the class for
    what would otherwise fail later or silently: not an ``Algorithm`` subclass, no ``name``, a built-in algorithm's
    name (it would replace that algorithm in every run that names it), or a name another class registered
    (the same class again, or the same class imported anew, e.g. by a reloaded module, is taken)."""
    if not isinstance(cls, type) or not issubclass(cls, Algorithm):
        raise PluginError(f"register({cls!r}): not an Algorithm subclass (protocols.algorithms.base.Algorithm)")
    name = getattr(cls, "name", None)
    if not isinstance(name, str):
        raise PluginError(f'register({cls.__qualname__}): the class declares no name (name = "...": algorithm.name)')
    check_plugin_name("algorithm", name, BUILTIN_ALGORITHMS)
    old = ALGORITHMS.get(name, cls)
    if (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise PluginError(f"algorithm {name!r} is already registered by {old.__module__}.{old.__qualname__}")
    ALGORITHMS[name] = cls
    return cls


def get_algorithm(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r} (available: {', '.join(sorted(ALGORITHMS))}; a plugin's algorithm needs "
            "its package installed or its module in run.plugins)"
        ) from None


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
