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

Layout = list[tuple[str, tuple[int, ...], int]]


class DeviceSums:
    """Weighted sums on the torch device ``device()`` (asked at each sum: ``auto`` engines choose theirs at their
    first cohort). On the CPU only with ``on_cpu`` (tests; numpy is faster there): else the host sums. ``what``:
    who sums here (for the one log line saying where the sums run)."""

    def __init__(self, device: Callable[[], torch.device], *, on_cpu: bool = False, what: str = "sums") -> None:
        self.device, self.on_cpu, self.what = device, on_cpu, what
        self.told: str | None = None
        self.sums = 0  # sums computed on the device (tests and benchmarks read it)

    def weighted_sum(self, items: Items) -> dict[str, np.ndarray] | None:
        device = self.device()
        here = device.type != "cpu" or self.on_cpu
        self._tell(f"{self.what} on {device}" if here else f"{self.what} on the host (numpy: the engine is on the CPU)")
        layout = _layout(items[0][1]) if here else None
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

    def _tell(self, where: str, warn: bool = False) -> None:
        """Log where the sums run when that changes (once a run, as a rule)."""
        if where != self.told:
            self.told = where
            log.log(logging.WARNING if warn else logging.INFO, "%s", where)


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
