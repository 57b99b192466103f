"""One place that builds a run's algorithm stack and checks what its layers need.

:func:`compose` builds the base algorithm of ``algorithm.name`` from the registry with the layers its
parameters configure (uplink codec, robust aggregation, server optimizer, asynchronous mode: the roles
build them from ``TrainParams``), then wraps it for differential privacy; secure aggregation is the cell
runtime's layer over the cell role's sum. Config validation (:func:`check_layers`, :func:`needs`), privacy
and attacks ask the stack's traits (``protocols.algorithms.traits``), never algorithm names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import ALGORITHMS, get_algorithm
from .base import Algorithm, ModelSpec, TrainParams
from .traits import Trait

if TYPE_CHECKING:
    from ..config import RunConfig


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


def compose(cfg: RunConfig, spec: ModelSpec) -> Algorithm:
    """The algorithm stack of run ``cfg`` for model ``spec``, ready to build its roles."""
    from ..config import ConfigError, _initial_model

    seed = cfg.model.init_seed if cfg.model.init_seed is not None else cfg.run.seed
    algorithm = get_algorithm(cfg.train.name)(cfg.train, spec, cfg.run.seed, init_seed=seed)
    topo = cfg.topology
    try:
        algorithm.bind_topology({c: topo.devices(c) for c in topo.cell_ids()})
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.run.init_model:
        algorithm.initial_params = _initial_model(cfg.run.init_model, algorithm.initial_params)  # type: ignore[method-assign]  # the run's starting model instead
    pv = cfg.privacy
    if pv.dp != "off":
        from ..privacy.dp import DpSettings, PrivateAlgorithm

        accountant = cfg.dp_accountant()
        dp = DpSettings(
            pv.dp,
            pv.clip,
            accountant.noise_multiplier,  # type: ignore[arg-type]  # calibrated: set by dp_accountant
            cfg.run.seed if pv.noise_seed is None else pv.noise_seed,
            cfg.dp_noise_shares(),
        )
        algorithm = PrivateAlgorithm(algorithm, dp, accountant, pv.epsilon_budget)
    return algorithm
