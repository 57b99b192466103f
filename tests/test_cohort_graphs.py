"""CUDA graphs of the cohort engine's plain-SGD calls (issue #33, the standard workload's launches): a call shape is
captured the second time it is seen, checked against the eager call bit for bit, and replayed after that with each
call's own inputs. On a CPU a stand-in backend whose "graph" re-runs its body exercises the cache and the engine's
static tensors (a replay that kept the previous call's inputs would give the previous call's results); one that
changes its results, or fails to record, turns graphs off with a warning and the call's results stay the eager ones.
The real CUDA graphs are tested where CUDA is (skipped here)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from protocols import cohort_graphs
from protocols.cohort_graphs import Body, GraphBackend, GraphCache
from protocols.cohort_trainer import CohortEngine, Request
from tests.test_cohort_device import SPEC, requests

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


class Rerun(GraphBackend):
    """A stand-in for CUDA graphs on a CPU: the "recorded" call runs its body again on the static tensors; with
    ``skew`` each replay then changes a result (a graph that does not do what the eager call did), with ``fail``
    recording raises."""

    def __init__(self, skew: float = 0.0, fail: bool = False) -> None:
        self.skew, self.fail, self.captures = skew, fail, 0

    def warm(self, body: Body, static: list[torch.Tensor]) -> None:
        body(static)

    def capture(self, body: Body, static: list[torch.Tensor]):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1

        def replay() -> None:
            body(static)
            if self.skew:
                static[0].add_(self.skew)

        return replay


def rounds(engine: CohortEngine, n: int, devices: int = 5, device: str = "cpu") -> list[list]:
    """``n`` rounds of sgd calls, each starting from the previous round's first device's model (so every call has
    new inputs of the same shapes); each round's results copied out as they come."""
    out, reqs = [], requests(devices)
    for _ in range(n):
        engine.run(reqs)
        got = [({k: v.copy() for k, v in p.items()}, s) for p, s in (r.result for r in reqs)]
        out.append(got)
        start = got[0][0]
        reqs = [Request("sgd", SPEC, start, r.x, r.y, r.order, lr=r.lr) for r in reqs]
    return out


def same(a: list[list], b: list[list]) -> None:
    for ra, rb in zip(a, b, strict=True):
        for (p, s), (q, t) in zip(ra, rb, strict=True):
            assert (s.loss, s.steps, s.samples) == (t.loss, t.steps, t.samples)
            for k in p:
                np.testing.assert_array_equal(q[k], p[k])


def test_a_call_shape_is_captured_at_its_second_call_and_replayed_with_each_calls_inputs() -> None:
    eager = rounds(CohortEngine(), 4)
    engine = CohortEngine()
    engine.graphs = GraphCache(Rerun())
    graphed = rounds(engine, 4)
    same(eager, graphed)  # replays take each call's own parameters (a stale replay repeats round 3's model)
    assert engine.graphs.backend.captures == 1 and engine.graphs.replays == 2 and engine.graphs.enabled
    assert len({tuple(p["fc1.weight"].ravel()[:3]) for p, _ in (r[0] for r in eager)}) == 4  # the rounds differ


def test_momentum_and_other_update_rules_are_not_graphed() -> None:
    engine = CohortEngine()
    engine.graphs = GraphCache(Rerun())
    for _ in range(3):
        engine.run(requests(4, momentum=0.9))
    assert engine.graphs.backend.captures == 0 and not engine.graphs.seen


@pytest.mark.parametrize("backend", [Rerun(skew=1e-3), Rerun(fail=True)], ids=["differs", "fails"])
def test_a_graph_that_differs_or_fails_turns_graphs_off_and_the_results_stay_the_eager_ones(backend, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="fedtier.device")
    eager = rounds(CohortEngine(), 3)
    engine = CohortEngine()
    engine.graphs = GraphCache(backend)
    same(eager, rounds(engine, 3))
    assert not engine.graphs.enabled and not engine.graphs.graphs and engine.graphs.replays == 0
    why = "a replay differed from the eager call" if backend.skew else "capturing its training call failed"
    assert f"CUDA graphs off for this process: {why}" in caplog.text


def test_the_cache_keeps_its_bounded_number_of_graphs(monkeypatch) -> None:
    monkeypatch.setattr(cohort_graphs, "MAX_GRAPHS", 1)
    engine = CohortEngine()
    engine.graphs = GraphCache(Rerun())
    eager = CohortEngine()
    for n in (3, 3, 4, 4, 3):  # two call shapes (3 and 4 devices), each captured at its second call
        for r, s in zip(results(engine, requests(n)), results(eager, requests(n))):
            np.testing.assert_array_equal(r[0]["fc1.weight"], s[0]["fc1.weight"])
    assert engine.graphs.backend.captures == 3 and len(engine.graphs.graphs) == 1  # 3 x 2 recaptured after eviction


def results(engine: CohortEngine, reqs: list[Request]) -> list:
    engine.run(reqs)
    return [r.result for r in reqs]


@cuda
def test_cuda_graphs_replay_the_eager_cuda_calls_bit_for_bit() -> None:
    """On a GPU the engine graphs its plain-SGD calls by default: 4 rounds with graphs (captured at the second,
    replayed at the third and fourth) give the eager CUDA engine's results bit for bit."""
    eager_engine = CohortEngine("cuda")
    eager_engine.graphs = None
    eager = rounds(eager_engine, 4)
    engine = CohortEngine("cuda")
    assert engine.graphs is not None
    same(eager, rounds(engine, 4))
    assert engine.graphs.enabled and engine.graphs.replays == 2, "graphs were turned off (see the warning logged)"
