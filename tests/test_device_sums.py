"""Cells' weighted sums on a torch device (``protocols/device_sums.py``, ``runtime.cell_sums``): the host's bits."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch

from protocols import device_sums
from protocols import params as P
from protocols.algorithms.robust import RobustParams, aggregate
from protocols.algorithms.staleness import StalenessBuffer
from protocols.device_sums import DeviceSums
from protocols.wire.payload import Payload
from sim.launcher import SimHierarchy

CUDA = torch.cuda.is_available()


def _items(n: int = 23, seed: int = 0) -> list[tuple[Any, dict[str, np.ndarray]]]:
    """``n`` float32 results of three tensors (one a non-contiguous view, one with values near float32's
    smallest and largest, signed zeros) with weights that are not powers of two (ints and fractions)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        big = rng.standard_normal((40, 9)).astype(np.float32)
        wide = (rng.standard_normal(17) * 10.0 ** rng.integers(-40, 35, 17)).astype(np.float32)
        wide[:2] = [-0.0, 0.0]
        weight = int(rng.integers(1, 500)) if i % 3 == 0 else float(rng.integers(1, 500)) / 7.0
        out.append((weight, OrderedDict(w=big, b=wide, t=big.T[::2])))
    return out


def _bits(a: dict[str, np.ndarray]) -> dict[str, bytes]:
    return {k: np.ascontiguousarray(v).tobytes() for k, v in a.items()}


def _same_sums(sums: DeviceSums, items: list) -> None:
    want_sum, (want_mean, want_total) = P.host_weighted_sum(items), P.weighted_mean(items)
    before = sums.sums
    with P.sums_on(sums):
        got_sum, (got_mean, got_total) = P.weighted_sum(items), P.weighted_mean(items)
    assert sums.sums == before + 2  # both computed on the device, not left to the host
    assert _bits(got_sum) == _bits(want_sum) and [v.dtype for v in got_sum.values()] == [np.float64] * 3
    assert _bits(got_mean) == _bits(want_mean) and got_total == want_total


def _rows_a_chunk(items: list, rows: int) -> int:
    """``device_sums.CHUNK_BYTES`` that makes a chunk ``rows`` of ``items``' results."""
    return 12 * sum(v.size for v in items[0][1].values()) * rows


def _definition(items: list) -> OrderedDict[str, Any]:
    """The weighted sum as written in ``host_weighted_sum``'s docstring: whole tensors, term by term."""
    acc: OrderedDict[str, Any] = OrderedDict()
    for w, p in items:
        for k, v in p.items():
            term = np.asarray(v, dtype=np.float64) * w
            acc[k] = acc[k] + term if k in acc else term
    return acc


@pytest.mark.parametrize("block", [7, 64, P.SUM_BLOCK])
def test_the_host_sum_by_blocks_is_the_definitions_bits(block, monkeypatch):
    """Summed a block of elements at a time (a cell's results), each element sees the definition's operations in its
    order: the same bits, dtypes and types (a 0-d tensor's sum a numpy scalar), and the mean divided in place is
    the definition's mean; items of other tensors are summed whole, as before."""
    monkeypatch.setattr(P, "SUM_BLOCK", block)
    items = [(w, OrderedDict(**p, s=np.array(i - 2.5, np.float32))) for i, (w, p) in enumerate(_items())]
    items[3][1]["b"] = items[3][1]["b"].astype(np.float64)  # a float64 tensor among float32 ones
    got, want = P.host_weighted_sum(items), _definition(items)
    assert list(got) == list(want) and [type(v) for v in got.values()] == [type(v) for v in want.values()]
    assert _bits(got) == _bits(want)
    total = float(sum(w for w, _ in items))
    assert _bits(P.weighted_mean(items)[0]) == _bits({k: (v / total).astype(np.float32) for k, v in want.items()})
    other = [*items[:4], (2.5, OrderedDict(w=items[0][1]["w"], x=items[0][1]["b"]))]  # another tensor's name
    assert _bits(P.host_weighted_sum(other)) == _bits(_definition(other))


def test_the_mean_of_one_item_is_the_definitions_bits_its_own_values_where_that_is_exact():
    """A mean of one item (a cloud of one cell, a cell of one answer) with an integer weight below 2**29 and finite
    float32 tensors is its own values (float64(v) * w is exact, so / w gives v back): the definition's bits, types and
    dtypes (a 0-d tensor's a numpy scalar); other weights and tensors take the definition's passes."""
    rng = np.random.default_rng(5)
    edges = np.array([1e-45, -1e-45, 1.2e-38, -0.0, 0.0, 3.4e38, -3.4e38, 1e-40], np.float32)
    values = OrderedDict(
        w=(rng.standard_normal((40, 9)) * 1e30).astype(np.float32), e=edges, s=np.array(-0.0, np.float32)
    )
    for weight in (1, 600, 600.0, np.int64(7), 2**29 - 1, 2**29, 1 / 3, 1.1, 123.456, 1e12):
        got, total = P.weighted_mean([(weight, values)])
        want = _definition([(weight, values)])
        want = {k: (v / float(weight)).astype(np.float32) for k, v in want.items()}
        assert total == float(weight) and [type(v) for v in got.values()] == [type(v) for v in want.values()]
        assert _bits(got) == _bits(want), weight
    assert not P._alone_exact(600, {"x": np.array([np.inf], np.float32)})  # not finite: the definition's passes


@pytest.mark.parametrize("rows", [0, 1, 2, 5])  # 0: one chunk of all 23; else chunks of this many results
def test_the_sum_on_the_cpu_device_is_the_host_sum_bit_for_bit(rows, monkeypatch):
    items = _items()
    if rows:
        monkeypatch.setattr(device_sums, "CHUNK_BYTES", _rows_a_chunk(items, rows))
    _same_sums(DeviceSums(lambda: torch.device("cpu"), on_cpu=True), items)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_the_sum_on_cuda_is_the_host_sum_bit_for_bit(monkeypatch):
    """The same IEEE operations on the GPU (no fused multiply-add, no reciprocal division): the host's bits, for
    a cell's worth of model-sized results too."""
    sums = DeviceSums(lambda: torch.device("cuda"))
    _same_sums(sums, _items())
    rng = np.random.default_rng(1)
    large = [(float(i + 1) / 3.0, {"w": rng.standard_normal(200_000).astype(np.float32)}) for i in range(100)]
    with P.sums_on(sums):
        got = P.weighted_mean(large)[0]
    assert _bits(got) == _bits(P.weighted_mean(large)[0])
    items = _items(50, seed=2)
    monkeypatch.setattr(device_sums, "CHUNK_BYTES", _rows_a_chunk(items, 7))  # chunks of 7 results
    _same_sums(sums, items)


def test_the_cpu_engine_leaves_sums_to_the_host_and_so_do_other_layouts():
    """``auto`` with an engine on the CPU sums with numpy; results of another layout (a float64 tensor, a shape
    that differs) are summed on the host too: the same result, nothing on the device."""
    auto = DeviceSums(lambda: torch.device("cpu"))
    items = _items(5)
    with P.sums_on(auto):
        assert _bits(P.weighted_mean(items)[0]) == _bits(P.weighted_mean(items)[0])
    assert auto.sums == 0 and auto.told is not None and "host" in auto.told
    forced = DeviceSums(lambda: torch.device("cpu"), on_cpu=True)
    odd = [items[0], (2.5, {**items[1][1], "b": items[1][1]["b"].astype(np.float64)})]
    short = [items[0], (2.5, {**items[1][1], "w": items[1][1]["w"][:-1]})]
    with P.sums_on(forced):
        assert _bits(P.weighted_sum(odd)) == _bits(P.host_weighted_sum(odd))
        with pytest.raises(ValueError):  # as on the host: shapes that do not add up
            P.weighted_sum(short)
    assert forced.sums == 0


def test_auto_leaves_a_sum_of_few_results_to_the_host_and_says_why_once(monkeypatch, caplog):
    """``cell_sums = "auto"``: a sum of fewer than ``AUTO_MIN_BYTES`` of results (the standard workload's 10 results
    of 800 KB: 5 ms on an H200, ~2-4 on the host) stays on the host, said once with the sizes; a sum of as many
    bytes goes to the device (here the CPU device stands in for the GPU)."""
    items = _items(5)
    sums = DeviceSums(lambda: torch.device("cpu"), on_cpu=True, auto=True, what="cells sum")
    with caplog.at_level("INFO", logger="fedtier.device"), P.sums_on(sums):
        got = [P.weighted_sum(items), P.weighted_sum(items[:4])]
    assert sums.sums == 0 and [_bits(g) for g in got] == [_bits(P.host_weighted_sum(x)) for x in (items, items[:4])]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("cells sum on the host for sums of fewer than 16 MiB of results")
    assert "(here 5 results, 0.0 MiB)" in said[0]
    monkeypatch.setattr(device_sums, "AUTO_MIN_BYTES", sum(v.nbytes for _, p in items for v in p.values()))
    _same_sums(sums, items)  # as many bytes as the floor: on the device
    assert sums.told == "cells sum on cpu"


def test_a_device_out_of_memory_sums_on_the_host(monkeypatch, caplog):
    """No memory left on the device (the engine holds it): the sum is the host's, said once, never a crash."""

    def full(*args: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(device_sums, "device_weighted_sum", full)
    sums, items = DeviceSums(lambda: torch.device("cpu"), on_cpu=True), _items(5)
    with caplog.at_level("WARNING", logger="fedtier.device"), P.sums_on(sums):
        got = P.weighted_mean(items)[0]
    assert _bits(got) == _bits(P.weighted_mean(items)[0]) and sums.sums == 0
    assert "out of memory on cpu for 5 results; summed on the host" in caplog.text


@pytest.mark.parametrize("kind", ["mean", "median", "trimmed_mean", "krum", "multikrum", "majority"])
def test_robust_aggregators_give_the_same_bits_with_sums_on_the_device(kind):
    """Every cell aggregator over 7 results: the mean and Krum/Multi-Krum's kept mean on the device, the
    coordinate-wise rules on the host; the same bits and the same exclusions either way."""
    params = RobustParams(name="fedavg", trim_beta=0.2, krum_byzantine=0.15)
    items = [(f"d{i}", w, p) for i, (w, p) in enumerate(_items(7, seed=3))]
    sums = DeviceSums(lambda: torch.device("cpu"), on_cpu=True)
    with P.sums_on(sums):
        got = aggregate(kind, items, params)
    want = aggregate(kind, items, params)
    assert _bits(got.delta) == _bits(want.delta) and (got.weight, got.excluded) == (want.weight, want.excluded)
    assert sums.sums == (1 if kind in ("mean", "krum", "multikrum") else 0)


def test_an_async_cells_staleness_weighted_sum_on_the_device():
    def flushed(where: DeviceSums | None) -> dict[str, np.ndarray]:
        buffer = StalenessBuffer(4, 0.5, 10)
        for i, (w, p) in enumerate(_items(4, seed=4)):
            buffer.add(f"d{3 - i}", i % 3, w, p)
        with P.sums_on(where):
            return buffer.flush(5)[0]

    sums = DeviceSums(lambda: torch.device("cpu"), on_cpu=True)
    assert _bits(flushed(sums)) == _bits(flushed(None)) and sums.sums == 1


RUNS = {
    "fedavg": {},
    "fedavg-async": {"mode": "async"},
    "multikrum": {"cell_aggregator": "multikrum", "krum_byzantine": 0.0, "multikrum_keep": 2},
    "hist": {"name": "hist"},
    "fedmrn": {"name": "fedmrn", "edge_rounds": 1, "local_steps": 8},
    "fedalign": {"name": "fedalign", "edge_rounds": 1, "priority": ["c0-d0", "c1-d1"], "warmup_rounds": 0},
}


def _same_run_on_and_off(make_config, algorithm: dict[str, Any], runtime: dict[str, Any], on: str) -> SimHierarchy:
    """Run ``algorithm`` with the cells summing where ``cell_sums = on`` says, then on the host: the same run
    byte for byte (final model, round and cell records); the first sim (it summed on its device)."""

    def run(cell_sums: str) -> tuple[Any, SimHierarchy]:
        cfg = make_config(run={"rounds": 2}, algorithm=algorithm, runtime={**runtime, "cell_sums": cell_sums})
        sim = SimHierarchy(cfg, write_output=False)
        return sim.run(), sim

    (device, first), (host, second) = run(on), run("host")
    assert first.sums is not None and first.sums.sums > 0 and second.sums is None
    assert list(device.params) == list(host.params)
    assert all(device.params[k].tobytes() == host.params[k].tobytes() for k in host.params)
    wall = ("time", "duration_s")
    strip = lambda recs: [{k: v for k, v in r.items() if k not in wall} for r in recs]  # noqa: E731
    assert strip(device.history) == strip(host.history) and strip(device.cell_records) == strip(host.cell_records)
    return first


@pytest.mark.parametrize("name", list(RUNS))
def test_a_sim_summing_on_the_engine_device_is_byte_identical(make_config, name):
    """Each algorithm whose cells sum weighted results, with the cohort engine: the cells summing on its
    (torch CPU) device give the run of the cells summing on the host, byte for byte."""
    _same_run_on_and_off(make_config, RUNS[name], {"engine": "cohort"}, "engine")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_sim_on_cuda_sums_on_the_gpu_byte_identical(make_config, monkeypatch):
    """The cohort engine on CUDA: ``auto`` sums a test model's few results on the host, and on the GPU without the
    floor (``AUTO_MIN_BYTES``), the same run as the host's sums (sim workers take the same path with their device:
    ``gpu.py``'s ``cohort-cuda-w4`` side logs where its cells sum)."""
    runtime = {"engine": "cohort", "device": "cuda", "cell_sums": "auto"}
    small = SimHierarchy(make_config(run={"rounds": 1}, runtime=runtime), write_output=False)
    small.run()  # a test model's few results: under the floor
    assert small.sums is not None and small.sums.sums == 0 and "on the host for sums of fewer" in str(small.sums.told)
    monkeypatch.setattr(device_sums, "AUTO_MIN_BYTES", 0)
    sim = _same_run_on_and_off(make_config, RUNS["fedavg"], runtime, "auto")
    assert sim.sums is not None and sim.sums.told is not None and "cuda" in sim.sums.told


def test_a_non_finite_result_is_refused_before_the_device_sum(make_config):
    """A device sending NaN is rejected at its cell's check, as with host sums: the device sum never sees it,
    the cell records the rejection and the model stays finite."""
    cfg = make_config(
        run={"rounds": 1}, algorithm={"edge_rounds": 1}, runtime={"engine": "cohort", "cell_sums": "engine"}
    )
    sim = SimHierarchy(cfg, write_output=False)
    configure = sim.agents.configure

    def poisoning(agent: Any) -> None:
        configure(agent)
        if agent.device == "c0-d1":  # past its own divergence check: a device that lies
            send = agent._send_result

            def send_nan(result: Payload, round: int, edge_round: int) -> None:
                nan = {k: np.full_like(v, np.nan) for k, v in result.tensors.items()}
                send(Payload(result.meta, nan), round, edge_round)

            agent._send_result = send_nan

    sim.agents.configure = poisoning
    assert sim.sums is not None
    real, seen = sim.sums.weighted_sum, []

    def counted(items: Any) -> Any:
        seen.append(len(items))
        assert all(np.isfinite(v).all() for _, p in items for v in p.values())
        return real(items)

    sim.sums.weighted_sum = counted  # type: ignore[method-assign]
    result = sim.run()
    assert sorted(seen) == [2, 3] and all(np.isfinite(v).all() for v in result.params.values())
    record = next(r for r in result.cell_records if r.get("cell") == "c0")
    assert [(r["device"], r["kind"]) for r in record["rejected"]] == [("c0-d1", "non_finite")]
