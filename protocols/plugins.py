"""The extension API: what users add (algorithms, models, datasets) and how every process finds it.

A plugin is an installed package that declares entry points in one of three groups::

    [project.entry-points."fedtier.algorithms"]
    scaffold = "my_plugin.scaffold:Scaffold"        # an Algorithm subclass whose name is "scaffold" (or a module
                                                    # that registers its own)
    [project.entry-points."fedtier.models"]
    resnet8 = "my_plugin.models:resnet8"            # factory(input_shape, num_classes) -> torch.nn.Module
    [project.entry-points."fedtier.datasets"]
    sensors = "my_plugin.data:load_sensors"         # loader(**params) -> x_train, y_train, x_test, y_test, ...

or a module named in the config's ``[run] plugins`` list that calls :func:`register_model`,
:func:`register_dataset` or ``protocols.algorithms.register`` when imported. ``load_plugins`` loads both;
``parse_config`` calls it (``protocols.plugin_loading``) before it validates any name, so the CLI,
spawned simulation workers and agents (which all parse the config they are given) see the same registry.
This module holds the registries and needs no torch.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch.nn as nn

GROUPS = ("fedtier.algorithms", "fedtier.models", "fedtier.datasets")
BUILTIN_MODELS = ("mlp", "cnn", "cnn4", "logreg")
BUILTIN_DATASETS = ("mnist", "fmnist", "fashion-mnist", "digits", "synthetic")
NPZ_PREFIX = "npz:"

ModelFactory = Callable[[tuple[int, ...], int], "nn.Module"]
"""``factory(input_shape, num_classes)``: a fresh model for data of that geometry (parameters in any state:
every tier re-initialises them from the run seed)."""

DatasetLoader = Callable[..., Any]
"""``loader(**params)``: an object or mapping with ``x_train, y_train, x_test, y_test`` (features of any shape,
integer labels) and optionally ``input_shape`` and ``num_classes`` (default: the features' shape, max label + 1)."""

MODELS: dict[str, ModelFactory] = {}
DATASETS: dict[str, DatasetLoader] = {}

_F = TypeVar("_F", bound=Callable[..., Any])

_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")


class PluginError(ValueError):
    """A plugin that cannot be loaded or registered; the message names it."""


def check_plugin_name(kind: str, name: str, builtin: Iterable[str]) -> None:
    """:class:`PluginError` unless ``name`` is a well-formed name for a ``kind`` that none of ``builtin`` has."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise PluginError(f"{kind} name {name!r}: 1-64 lowercase letters, digits, '_', '.' or '-'")
    if name in builtin:
        raise PluginError(f"{kind} name {name!r} is built in; choose another")


def register_model(name: str, factory: ModelFactory) -> ModelFactory:
    """Make ``model.name = name`` build ``factory(input_shape, num_classes)`` on every tier.

    Its parameter count (and so the default message bound) is taken from a built model, never guessed.
    Registering the same factory twice is a no-op; another factory under a taken name is an error.
    """
    check_plugin_name("model", name, BUILTIN_MODELS)
    return _register("model", "factory", name, factory, MODELS)


def register_dataset(name: str, loader: DatasetLoader) -> DatasetLoader:
    """Make ``data.dataset = name`` load ``loader(**params)`` (see :data:`DatasetLoader`)."""
    check_plugin_name("dataset", name, BUILTIN_DATASETS)
    if name.startswith("npz"):
        raise PluginError(f"dataset name {name!r}: 'npz' names are reserved for npz:PATH")
    return _register("dataset", "loader", name, loader, DATASETS)


def _register(kind: str, role: str, name: str, fn: _F, registry: dict[str, _F]) -> _F:
    """Put ``fn`` (a callable: the ``kind``'s ``role``) in ``registry`` under ``name`` (checked by the caller):
    the same one again is a no-op, another under a taken name an error."""
    if not callable(fn):
        raise PluginError(f"{kind} {name!r}: the {role} must be callable, got {type(fn).__name__}")
    if registry.get(name, fn) is not fn:
        raise PluginError(f"{kind} {name!r} is already registered by {registry[name]!r}")
    registry[name] = fn
    return fn


def model_names() -> tuple[str, ...]:
    """Every model name ``model.name`` accepts now (built in, then registered)."""
    return (*BUILTIN_MODELS, *sorted(MODELS))


def check_model_name(name: str) -> str:
    """``name`` when it names a built-in or registered model; ``ValueError`` listing them otherwise."""
    if name in BUILTIN_MODELS or name in MODELS:
        return name
    raise ValueError(
        f"unknown model {name!r} (available: {', '.join(model_names())}; a plugin's model needs its package "
        "installed or its module in run.plugins)"
    )


def check_dataset_name(name: str) -> str:
    """``name`` when it names a built-in or registered dataset or ``npz:PATH``; ``ValueError`` otherwise."""
    if name in BUILTIN_DATASETS or name in DATASETS:
        return name
    if name.startswith(NPZ_PREFIX):
        if not name[len(NPZ_PREFIX) :].strip():
            raise ValueError("npz:PATH needs a path (e.g. npz:data/sensors.npz)")
        return name
    raise ValueError(
        f"unknown dataset {name!r} (available: {', '.join((*BUILTIN_DATASETS, *sorted(DATASETS)))}, or npz:PATH; "
        "a plugin's dataset needs its package installed or its module in run.plugins)"
    )


@functools.cache
def registered_num_params(name: str, input_shape: tuple[int, ...], num_classes: int) -> int:
    """Trainable parameters of the registered model ``name`` built for this geometry (counted, not guessed)."""
    model = build_registered(name, input_shape, num_classes)
    return sum(int(p.numel()) for p in model.parameters() if p.requires_grad)


def build_registered(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A fresh registered model; ``PluginError`` when the factory does not return a ``torch.nn.Module``."""
    import torch.nn as nn

    model = MODELS[name](tuple(int(s) for s in input_shape), int(num_classes))
    if not isinstance(model, nn.Module):
        raise PluginError(f"model {name!r}: the factory returned {type(model).__name__}, not a torch.nn.Module")
    if not any(True for _ in model.parameters()):
        raise PluginError(f"model {name!r}: the model has no parameters to train")
    return model


def check_module_names(modules: Any) -> list[str]:
    """``run.plugins`` as a list of dotted module names; ``PluginError`` otherwise."""
    if not isinstance(modules, (list, tuple)) or not all(isinstance(m, str) for m in modules):
        raise PluginError(f"run.plugins: a list of module names, got {modules!r}")
    for m in modules:
        if not _MODULE.fullmatch(m):
            raise PluginError(f"run.plugins: {m!r} is not a module name (dotted identifiers)")
    return list(modules)
