"""Weighted sums on a torch device (:class:`DeviceSums`, a :class:`protocols.params.Sums`): ``fedtier sim``'s cells
sum their devices' results on the cohort engine's GPU (``runtime.cell_sums``), bit for bit the host's sum.

Bit identity with :func:`protocols.params.host_weighted_sum` comes from doing the same IEEE float64 operations in
the same order: each result's float32 tensors are copied once on the host (from the payload's views into a row of
a page-locked buffer), a chunk of rows is uploaded in one copy, converted to float64 and multiplied by the rows'
weights (one kernel), then the rows are added to the sum one after another in the items' order (one ``add`` each:
never a fused multiply-add, never a reduction whose order the library chooses). The float64 sum comes back in one
download; the division by the total weight and the float32 rounding stay on the host (CUDA divides by a host
scalar as a multiplication by its reciprocal).
Items of other layouts (tensor names, shapes, dtypes other than native float32) are left to the host.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping

import numpy as np
import torch

from .params import Items

log = logging.getLogger("fedtier.device")

CHUNK_BYTES = 256 << 20
"""Device memory a sum's rows take at once (float32 staging and float64 terms): results beyond it are summed in
chunks, one after another, so memory stays bounded whatever the number of results."""

AUTO_MIN_BYTES = 16 << 20
"""``runtime.cell_sums = "auto"``: a sum of fewer bytes of results than this stays on the host, where it is faster.
A GPU sum has a fixed cost, ~3-3.5 ms on an H200 (session 20: 10 results of 800 KB took 5 ms there, 100 took 22 ms;
the page-locked buffer, the upload's and the download's synchronisations) that a few results do not earn back: the
host sums ~0.2-0.4 ms a result of 800 KB (0.2 on the 2-core CI-like machine, ~0.4 on the GPU machine's busy cores),
so the GPU pays from ~15-20 such results (the standard workload's 10 sum on the host, the large one's 100 on the
GPU)."""

Layout = list[tuple[str, tuple[int, ...], int]]


class DeviceSums:
    """Weighted sums on the torch device ``device()`` (asked at each sum: ``auto`` engines choose theirs at their
    first cohort). On the CPU only with ``on_cpu`` (tests; numpy is faster there): else the host sums. ``auto``: a
    sum of fewer than :data:`AUTO_MIN_BYTES` of results stays on the host too. ``what``: who sums here (for the log
    lines saying where the sums run, each once)."""

    def __init__(
        self, device: Callable[[], torch.device], *, on_cpu: bool = False, auto: bool = False, what: str = "sums"
    ) -> None:
        self.device, self.on_cpu, self.auto, self.what = device, on_cpu, auto, what
        self.told: str | None = None  # the last place said
        self._said: set[str] = set()
        self.sums = 0  # sums computed on the device (tests and benchmarks read it)

    def weighted_sum(self, items: Items) -> dict[str, np.ndarray] | None:
        device = self.device()
        here = device.type != "cpu" or self.on_cpu
        if not here:
            self._tell(f"{self.what} on the host (numpy: the engine is on the CPU)")
            return None
        if self.auto and (size := _nbytes(items)) < AUTO_MIN_BYTES:
            self._tell(
                f"{self.what} on the host for sums of fewer than {AUTO_MIN_BYTES >> 20} MiB of results (here "
                f"{len(items)} results, {size / 2**20:.1f} MiB): a sum on {device} costs a fixed ~3 ms more",
                once="small sums on the host",  # (said for the first such sum, not for each size)
            )
            return None
        self._tell(f"{self.what} on {device}")
        layout = _layout(items[0][1])
        if layout is None or not all(_fits(p, layout) for _, p in items[1:]):
            return None
        try:
            out = device_weighted_sum(items, layout, device)
        except torch.OutOfMemoryError:  # the engine holds the GPU's memory: the host gives the same bits
            self._tell(
                f"{self.what}: out of memory on {device} for {len(items)} results; summed on the host", warn=True
            )
            return None
        self.sums += 1
        return out

    def _tell(self, where: str, warn: bool = False, once: str | None = None) -> None:
        """Log where the sums run, each line once a run (``once``: what counts as the same line, else ``where``)."""
        self.told = where
        said = where if once is None else once
        if said not in self._said:
            self._said.add(said)
            log.log(logging.WARNING if warn else logging.INFO, "%s", where)


def _nbytes(items: Items) -> int:
    """The bytes of the tensors of ``items``."""
    return sum(getattr(v, "nbytes", 0) for _, p in items for v in p.values())


def _layout(params: Mapping[str, np.ndarray]) -> Layout | None:
    """Names, shapes and sizes of ``params`` when every tensor is a native float32 array, else ``None``."""
    if not all(isinstance(v, np.ndarray) and v.dtype == np.float32 for v in params.values()):
        return None
    return [(k, v.shape, v.size) for k, v in params.items()]


def _fits(params: Mapping[str, np.ndarray], layout: Layout) -> bool:
    return len(params) == len(layout) and all(
        isinstance(v := params.get(k), np.ndarray) and v.dtype == np.float32 and v.shape == shape
        for k, shape, _ in layout
    )


def device_weighted_sum(items: Items, layout: Layout, device: torch.device) -> dict[str, np.ndarray]:
    """:func:`protocols.params.host_weighted_sum` of ``items`` (each of ``layout``) computed on ``device``.

    A chunk of results is packed row by row into one host buffer (page-locked for a GPU: one copy of each
    result's bytes on the host) and uploaded in one asynchronous copy; on the CPU the buffer is the rows."""
    width = sum(size for *_, size in layout)
    rows = max(1, min(len(items), CHUNK_BYTES // max(1, 12 * width)))
    on_gpu = device.type != "cpu"
    packed = torch.empty((rows, width), dtype=torch.float32, pin_memory=on_gpu)
    staging = torch.empty((rows, width), dtype=torch.float32, device=device) if on_gpu else packed
    acc: torch.Tensor | None = None
    for start in range(0, len(items), rows):
        chunk = items[start : start + rows]
        weights = torch.tensor([float(w) for w, _ in chunk], dtype=torch.float64).to(device)
        if on_gpu and start:
            torch.cuda.current_stream(device).synchronize()  # the last chunk's upload has read ``packed``
        rows_np = packed.numpy()
        for row, (_, params) in zip(rows_np, chunk):
            _pack(row, params, layout)
        batch = staging[: len(chunk)]
        if on_gpu:
            batch.copy_(packed[: len(chunk)], non_blocking=True)
        terms = batch.to(torch.float64).mul_(weights[:, None])
        for term in terms:
            if acc is None:
                acc = term.clone()
            else:
                acc.add_(term)
    assert acc is not None
    host = acc.cpu().numpy()
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    offset = 0
    for k, shape, size in layout:
        out[k] = host[offset : offset + size].reshape(shape)
        offset += size
    return out


def _pack(row: np.ndarray, params: Mapping[str, np.ndarray], layout: Layout) -> None:
    """Copy ``params``' tensors (in ``layout``'s order) into ``row``, any strides."""
    offset = 0
    for k, shape, size in layout:
        np.copyto(row[offset : offset + size].reshape(shape), params[k])
        offset += size
