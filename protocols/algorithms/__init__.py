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
from .traits import Trait

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
    if why := _malformed(cls):
        raise PluginError(f"register({cls.__qualname__}): {why}")
    old = ALGORITHMS.get(name, cls)
    if (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise PluginError(f"algorithm {name!r} is already registered by {old.__module__}.{old.__qualname__}")
    ALGORITHMS[name] = cls
    return cls


def _malformed(cls: type[Algorithm]) -> str | None:
    """What in ``cls``'s declarations would fail a run later with a bare traceback (or be silently ignored)."""
    if missing := sorted(getattr(cls, "__abstractmethods__", ())):
        return f"it does not define {', '.join(missing)} (each role: cloud(), cell(cell), device(device))"
    if not (isinstance(cls.Params, type) and issubclass(cls.Params, TrainParams)):
        return f"Params = {cls.Params!r} is not a TrainParams subclass (protocols.algorithms.base.TrainParams)"
    traits, without = cls.traits, cls.without
    if not isinstance(traits, (set, frozenset)) or not all(t in Trait.__members__.values() for t in traits):
        return f"traits = {traits!r} is not a set of protocols.algorithms.traits.Trait (frozenset() declares none)"
    if not isinstance(without, dict) or not all(t in Trait.__members__.values() for t in without):
        return f"without = {without!r} is not a dict of Trait -> why it lacks it, in words"
    if bad := [t for t, why in without.items() if not isinstance(why, str)]:
        return f"without[{bad[0]!r}] is not a reason in words (a str)"
    return None


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
