"""What a composed algorithm can be combined with: declared traits, never algorithm names.

A run's stack is a base algorithm (``Algorithm.traits``: what its roles do) under layers its parameters
configure (``TrainParams.layers``: the uplink codec, robust aggregation, the server optimizer, the
asynchronous mode) and the layers of ``[privacy]`` (differential privacy, secure aggregation; see
:func:`protocols.algorithms.compose.compose`). A layer may take traits away (a robust cell aggregator needs
each device's update, so a cell no longer aggregates by a sum) or need traits of the base (the asynchronous
mode needs an algorithm that runs by model versions). Config validation, privacy and attacks ask
:func:`lacks` for the trait they need and get back, in words, who took it away or never had it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum


class Trait(StrEnum):
    """A capability of an algorithm stack."""

    CELL_SUM = "cell_sum"
    """a cell aggregates its devices by a weighted sum of their dense model deltas (it could see the sum only)"""
    CLOUD_SUM = "cloud_sum"
    """the cloud aggregates its cells by a weighted mean of their dense deltas"""
    PLAIN_DELTA_UPLINK = "plain_delta_uplink"
    """a device's result is its dense model delta and its weight, nothing else"""
    VERSIONED = "versioned"
    """the roles can run by model versions instead of synchronous rounds (buffered asynchronous aggregation)"""
    ASYNC = "async"
    """runs by model versions (buffered asynchronous aggregation, FedBuff) instead of rounds"""
    DEVICE_STATE = "device_state"
    """devices keep state across rounds that the cloud's checkpoint does not hold (DeComFL's model replicas): a
    launcher that recreates its devices resumes such a run through ``CloudRole.forget_devices``, and a job
    cannot start it from a given model (only the cloud would have it)"""
    FORWARD_ONLY = "forward_only"
    """devices only ever run forward passes (no gradients): any inference runtime can serve them"""


@dataclass(frozen=True)
class Layer:
    """One configured layer of a stack, e.g. ``algorithm.uplink = "qsgd"`` (a codec)."""

    key: str
    """the config key that chose it (``algorithm.uplink``)"""
    value: str
    """its value there"""
    removes: frozenset[Trait] = frozenset()
    """traits the stack loses with this layer"""
    adds: frozenset[Trait] = frozenset()
    """traits the stack gains"""
    needs: frozenset[Trait] = frozenset()
    """traits the base algorithm must have for this layer to apply"""
    why: str = ""
    """what the layer does to them, in words (for refusals)"""

    def describe(self) -> str:
        return f"{self.key} = {self.value!r}"


def compose_traits(base: Iterable[Trait], layers: Iterable[Layer]) -> frozenset[Trait]:
    """The traits of ``base`` under ``layers`` (in order)."""
    traits = frozenset(base)
    for layer in layers:
        traits = (traits - layer.removes) | layer.adds
    return traits


def lacks(
    name: str, base: Iterable[Trait], without: dict[Trait, str], layers: Iterable[Layer], trait: Trait
) -> str | None:
    """Why the stack of algorithm ``name`` (its ``base`` traits, the reasons ``without`` it declares for
    those it lacks, its ``layers``) does not have ``trait``; ``None`` when it does."""
    layers = list(layers)
    if trait in compose_traits(base, layers):
        return None
    last = next((layer for layer in reversed(layers) if trait in layer.removes), None)
    if last is not None:
        return f"{last.describe()}: {last.why}"
    return f"algorithm {name!r}: {without.get(trait, f'it does not declare {trait.value}')}"
