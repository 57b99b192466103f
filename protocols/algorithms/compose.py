"""One place that builds a run's algorithm stack and checks what its layers need.

:func:`compose` builds the base algorithm of ``algorithm.name`` from the registry with the layers its
parameters configure (uplink codec, robust aggregation, server optimizer, asynchronous mode: the roles
build them from ``TrainParams``), then applies the run's wrappers (its initial model, differential
privacy: ``RunConfig.build_algorithm``); secure aggregation is the cell runtime's layer over the cell
role's sum. Config validation (:func:`check_layers`, :func:`needs`), privacy
and attacks ask the stack's traits (``protocols.algorithms.traits``), never algorithm names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from . import ALGORITHMS, get_algorithm
from .base import Algorithm, ModelSpec, TrainParams
from .traits import Trait


def needs(params: TrainParams, trait: Trait) -> str | None:
    """Why the stack ``params`` configure lacks ``trait`` (the layer that took it away, or the base
    algorithm's own reason), or ``None`` when it has it."""
    return get_algorithm(params.name).lacks(params, trait)


def check_layers(params: TrainParams) -> str | None:
    """Why a layer ``params`` configure cannot apply to their algorithm (it needs a trait the algorithm
    lacks), or ``None``."""
    cls = get_algorithm(params.name)
    for layer in params.layers():
        for trait in sorted(layer.needs - cls.traits):
            have = ", ".join(name for name, c in sorted(ALGORITHMS.items()) if trait in c.traits) or "none"
            return (
                f"{layer.describe()} needs an algorithm that is {trait.value} ({have}); "
                f"{cls.name!r} is not: {cls.without.get(trait, 'it does not declare it')}"
            )
    return None


Wrapper = Callable[[Algorithm], Algorithm]
"""A layer around a built algorithm (its starting model, differential privacy): takes it, returns the stack."""


def compose(
    params: TrainParams,
    spec: ModelSpec,
    *,
    seed: int,
    init_seed: int,
    cells: Mapping[str, Sequence[str]],
    rounds: int | None = None,
    wrappers: Sequence[Wrapper] = (),
) -> Algorithm:
    """The algorithm stack of a run: the base algorithm ``params.name`` from the registry (the layers its
    ``params`` configure are built by its roles), bound to the topology ``cells`` and the run's ``rounds``
    (``ValueError`` naming the key when the parameters do not fit them), then each of ``wrappers`` in order
    (``RunConfig.build_algorithm`` passes the run's initial model and differential privacy)."""
    params.check_topology(cells)
    algorithm = get_algorithm(params.name)(params, spec, seed, init_seed=init_seed)
    algorithm.rounds = rounds
    algorithm.bind_topology(cells)
    for wrap in wrappers:
        algorithm = wrap(algorithm)
    return algorithm
