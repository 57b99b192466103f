"""CUDA graphs of the cohort engine's local training: a cohort's whole plain-SGD call replayed as one graph.

On a GPU a cohort's SGD step is ~35 small kernels, each launched from Python: for the standard workload (10 devices
x 19 steps of an MLP 784-200-200-10) the launches, not the GPU, were the round (benchmarks/README.md, GPU figures,
session 20). A CUDA graph records a call's kernels once and replays them with one launch. What the call reads and
writes lives in the graph's own tensors (``static``): each replay copies the call's inputs (stacked parameters,
gathered batches, masks) into them, replays, and the results are read back from them.

A call shape (:class:`GraphCache` key) is captured the second time it is seen (one-off shapes stay eager), and the
capture checks itself: the call runs eagerly first (its results are the call's), then the graph is captured and
replayed on the same inputs, and its results must equal the eager ones bit for bit, or graphs are switched off for
the engine (logged with the difference). A capture that raises also switches them off (logged). At most
:data:`MAX_GRAPHS` graphs and :data:`MAX_STATIC_BYTES` of their tensors are kept, the least recently used going first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger("fedtier.device")

MAX_GRAPHS = 8  # call shapes kept captured per engine
MAX_STATIC_BYTES = 1 << 30  # their static tensors, in all (each graph's memory pool comes on top)
MAX_SEEN = 256  # call shapes remembered as seen once
ENABLED = True  # engines made from now on graph their calls on a GPU (benchmarks/gpu.py's -eager sides: False)

Body = Callable[[list[torch.Tensor]], None]  # runs a call on its tensors, writing its results into them in place


class GraphBackend:
    """Records a body's kernels and replays them: CUDA graphs. Tests substitute one that re-runs the body."""

    def capture(self, body: Body, static: list[torch.Tensor]) -> Callable[[], None]:
        """The replay of ``body(static)``, recorded (not run)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # (recorded on a side stream of its own)
            body(static)
        return graph.replay

    def warm(self, body: Body, static: list[torch.Tensor]) -> None:
        """Run ``body(static)`` eagerly the way a capture needs first (on a side stream: the libraries' lazy set-up
        must not happen while recording)."""
        device = static[0].device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            body(static)
        torch.cuda.current_stream(device).wait_stream(side)


@dataclass
class _Graph:
    static: list[torch.Tensor]
    replay: Callable[[], None]
    nbytes: int


class GraphCache:
    """An engine's captured calls, by call shape (the key must determine every tensor's shape and everything the
    body does besides its tensors' values)."""

    def __init__(self, backend: GraphBackend | None = None) -> None:
        self.backend = backend or GraphBackend()
        self.enabled = ENABLED
        self.graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self.seen: OrderedDict[Hashable, None] = OrderedDict()
        self.replays = 0  # calls answered by a replay (captures not counted)

    def run(self, key: Hashable, tensors: Sequence[torch.Tensor], body: Body) -> list[torch.Tensor] | None:
        """The call ``body`` on ``tensors`` (not modified) through a graph: the graph's tensors holding its results,
        valid until the next call of the same key; or None when the call is not graphed (graphs off, a shape seen
        for the first time, or a capture that failed its check): the caller then runs it eagerly."""
        if not self.enabled:
            return None
        graph = self.graphs.get(key)
        if graph is None:
            if key not in self.seen:
                self.seen[key] = None
                while len(self.seen) > MAX_SEEN:
                    self.seen.popitem(last=False)
                return None
            return self._capture(key, tensors, body)
        for st, t in zip(graph.static, tensors):
            st.copy_(t)
        graph.replay()
        self.graphs.move_to_end(key)
        self.replays += 1
        return graph.static

    def _capture(self, key: Hashable, tensors: Sequence[torch.Tensor], body: Body) -> list[torch.Tensor] | None:
        nbytes = sum(t.nbytes for t in tensors)
        if nbytes > MAX_STATIC_BYTES:
            return None
        static = [t.clone() for t in tensors]
        try:
            self.backend.warm(body, static)  # the call itself, eagerly: its results are the reference
            expected = [t.clone() for t in static]
            for st, t in zip(static, tensors):
                st.copy_(t)
            replay = self.backend.capture(body, static)
            replay()
        except Exception as exc:  # noqa: BLE001  (any failure to record: the engine goes on without graphs)
            self._off(f"capturing its training call failed ({type(exc).__name__}: {exc})")
            return None
        differ = [i for i, (a, b) in enumerate(zip(static, expected)) if not torch.equal(a, b)]
        if differ:
            i = differ[0]
            gap = (static[i].double() - expected[i].double()).abs().max().item()
            self._off(f"a replay differed from the eager call (tensor {i}, largest difference {gap:.3g})")
            return None
        self.graphs[key] = _Graph(static, replay, nbytes)
        while len(self.graphs) > MAX_GRAPHS or sum(g.nbytes for g in self.graphs.values()) > MAX_STATIC_BYTES:
            self.graphs.popitem(last=False)
        return static

    def _off(self, why: str) -> None:
        self.enabled = False
        self.graphs.clear()
        log.warning("cohort engine: CUDA graphs off for this process: %s; training goes on without them", why)
