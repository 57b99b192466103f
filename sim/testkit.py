"""A public test kit for plugin authors: check that an algorithm (or model) gives the same results in every engine.

    from sim.testkit import assert_engines_agree

    def test_my_algorithm_runs_batched():
        assert_engines_agree(parse_config({...}))

The per-device engine trains each device alone; the cohort engine (``runtime.engine = "cohort"``) trains the
queued devices as one batched program. A role written against the ``Trainer`` interface (``sgd`` with its
``grad_transform`` hook, ``loss``, ``losses``, ``evaluate``, ``loss_and_grad``) gives the same results in both,
up to float rounding; this runs the config both ways and compares every device's result and the final model.
"""

from __future__ import annotations

import numpy as np

from protocols.config import RunConfig
from protocols.round_text import nth_edge
from protocols.wire.payload import Payload

from .launcher import RunResult, SimHierarchy


def run_capturing(cfg: RunConfig) -> tuple[RunResult, dict[tuple[str, int, int], Payload]]:
    """Run ``cfg`` without writing output; also return every device's result by (device, round, edge round)."""
    sim = SimHierarchy(cfg, write_output=False)
    results: dict[tuple[str, int, int], Payload] = {}
    for agent in sim.agents.values():
        send = agent._send_result

        def record(result: Payload, round: int, edge_round: int, agent=agent, send=send) -> None:
            results[(agent.device, round, edge_round)] = result
            send(result, round, edge_round)

        agent._send_result = record  # type: ignore[method-assign]
    return sim.run(), results


def assert_engines_agree(cfg: RunConfig, rtol: float = 1e-4, atol: float = 1e-6, cohort_size: int = 64) -> None:
    """Run ``cfg`` with the per-device and the cohort engine; ``AssertionError`` naming the first device result,
    metadata entry or final parameter that differs beyond ``rtol``/``atol`` (integer tensors must be equal)."""
    runtime = cfg.runtime
    device = cfg.model_copy(update={"runtime": runtime.model_copy(update={"engine": "device"})})
    cohort = cfg.model_copy(
        update={"runtime": runtime.model_copy(update={"engine": "cohort", "cohort_size": cohort_size})}
    )
    (ra, pa), (rb, pb) = run_capturing(device), run_capturing(cohort)
    assert ra.status == rb.status == "finished", (ra.failed, rb.failed)
    assert pa.keys() == pb.keys(), f"devices reported differently: {sorted(set(pa) ^ set(pb))[:5]}"
    assert pa, "no device reported a result"
    for key in sorted(pa):
        _close(pa[key].tensors, pb[key].tensors, f"device {key[0]} round {nth_edge(key[1], key[2])}", rtol, atol)
        for k, v in pa[key].meta.items():
            w = pb[key].meta.get(k)
            if isinstance(v, float):
                assert isinstance(w, float) and np.isclose(v, w, rtol=rtol, atol=atol), (key, k, v, w)
            else:
                assert v == w, (key, k, v, w)
    _close(ra.params, rb.params, "final model", rtol, atol)


def _close(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str, rtol: float, atol: float) -> None:
    assert list(a) == list(b), f"{what}: tensors {list(a)} vs {list(b)}"
    for k in a:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: {k} is {x.dtype}{x.shape} vs {y.dtype}{y.shape}"
        if x.dtype.kind == "f":
            worst = float(np.abs(x - y).max()) if x.size else 0.0
            assert np.allclose(x, y, rtol=rtol, atol=atol), f"{what}: {k} differs by up to {worst}"
        else:
            assert np.array_equal(x, y), f"{what}: {k} differs"
