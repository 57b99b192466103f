"""FedALIGN's schedule (``protocols.algorithms.fedalign``): the iteration, phase and epsilon of every cloud round, a
pure function of the parameters (so a resumed cloud agrees), computed in closed form: its parameters' iterations
(``warmup_rounds``, ``epsilon_drop_round``) and the run's rounds size nothing (the schedule was a list of every
round's phase: ``warmup_rounds = 1e7`` took 6.7 s to check, 1e9 would fill memory)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Protocol


class ScheduleParams(Protocol):
    """What the schedule reads of ``FedAlignParams``."""

    epsilon: float
    epsilon_later: float
    epsilon_drop_round: int
    warmup_rounds: int


class Schedule:
    """Iteration, phase and epsilon of every cloud round. An iteration is one cloud round, or two (the ``priority``
    then the ``free`` phase) while epsilon is finite and positive; epsilon changes at ``warmup_rounds`` and
    ``epsilon_drop_round`` only, so the rounds are a few regimes of iterations alike."""

    def __init__(self, p: ScheduleParams) -> None:
        self.p = p

    def epsilon(self, iteration: int) -> float:
        p = self.p
        if iteration < p.warmup_rounds:
            return 0.0
        if p.epsilon_drop_round and iteration >= p.epsilon_drop_round:
            return p.epsilon_later
        return p.epsilon

    def phases(self, iteration: int) -> tuple[str, ...]:
        eps = self.epsilon(iteration)
        if eps == 0:
            return ("solo",)
        if math.isinf(eps):
            return ("all",)
        return ("priority", "free")

    def _regimes(self) -> Iterator[tuple[int, int, int, tuple[str, ...]]]:
        """(first round, first iteration, iterations or -1 for all the rest, phases of each) of each regime."""
        starts = sorted({0, self.p.warmup_rounds, self.p.epsilon_drop_round})
        first_round = 0
        for i, start in enumerate(starts):
            phases = self.phases(start)
            if i + 1 == len(starts):
                yield first_round, start, -1, phases
                return
            yield first_round, start, starts[i + 1] - start, phases
            first_round += (starts[i + 1] - start) * len(phases)

    def reachable_phases(self, rounds: int | None = None) -> set[str]:
        """Every phase of the first ``rounds`` cloud rounds (``None``: of any round)."""
        out: set[str] = set()
        for first_round, _, _, phases in self._regimes():
            if rounds is not None and first_round >= rounds:
                break
            out.update(phases if rounds is None else phases[: rounds - first_round])
        return out

    def at(self, round: int) -> tuple[int, str]:
        """(iteration, phase) of cloud round ``round``."""
        for first_round, start, iterations, phases in self._regimes():
            if iterations < 0 or round < first_round + iterations * len(phases):
                k, phase = divmod(round - first_round, len(phases))
                return start + k, phases[phase]
        raise AssertionError("the last regime has every round after it")
