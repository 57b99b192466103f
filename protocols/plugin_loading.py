"""Loading plugins: the installed entry points of ``protocols.plugins.GROUPS`` and the ``run.plugins`` modules.

Kept apart from the registries (``protocols.plugins``), which the model spec and the zoo import: loading
registers algorithms, so it sits above ``protocols.algorithms``.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Iterable
from importlib.metadata import entry_points
from typing import Any

from .algorithms import register
from .algorithms.base import Algorithm
from .plugins import GROUPS, PluginError, check_module_names, register_dataset, register_model

log = logging.getLogger("fedtier.plugins")


def _load_entry(group: str, ep: Any) -> None:
    obj = ep.load()
    if group == "fedtier.models":
        register_model(ep.name, obj)
    elif group == "fedtier.datasets":
        register_dataset(ep.name, obj)
    elif isinstance(obj, type):  # fedtier.algorithms: a class to register (a module registers its own)
        if not issubclass(obj, Algorithm):
            raise PluginError(f"{ep.value}: not an Algorithm subclass")
        if getattr(obj, "name", None) != ep.name:  # algorithm.name = the entry point's name would be unknown
            raise PluginError(
                f"{ep.name} = {ep.value!r}: the class's name is {getattr(obj, 'name', None)!r}; an algorithm's entry "
                "point is named as its algorithm.name"
            )
        register(obj)


@functools.cache
def load_entry_points() -> tuple[str, ...]:
    """Load every installed plugin of :data:`GROUPS` once per process; the names loaded. A plugin that
    fails to load raises :class:`PluginError` naming it (a half-registered plugin would fail later, less clearly)."""
    loaded = []
    for group in GROUPS:
        for ep in sorted(entry_points(group=group), key=lambda e: e.name):
            try:
                _load_entry(group, ep)
            except PluginError:
                raise
            except Exception as exc:  # an import error in the user's code: say which plugin
                raise PluginError(f"plugin {ep.name} ({group} = {ep.value!r}) failed to load: {exc!r}") from exc
            loaded.append(f"{group}:{ep.name}")
    if loaded:
        log.debug("plugins loaded: %s", ", ".join(loaded))
    return tuple(loaded)


def load_plugins(modules: Iterable[str] = ()) -> None:
    """Load the installed entry-point plugins (once) and import each of ``modules`` (``run.plugins``), whose
    import registers what it adds. ``PluginError`` naming the module that cannot be imported."""
    load_entry_points()
    for module in check_module_names(list(modules)):
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise PluginError(f"run.plugins: cannot import {module!r}: {exc!r}") from exc
