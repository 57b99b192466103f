"""The cohort trainer: the :class:`~protocols.trainer.Trainer` primitives of many devices at once.

An algorithm's local update is written once, in its module, against the ``Trainer`` interface
(``sgd``, ``loss``, ``losses``, ``perturbed_losses``, ``evaluate``, ``loss_and_grad``, parameter access). The per-device
backend (``torch_trainer.py``) runs those primitives for one device; :class:`CohortEngine` runs the
same primitive for a cohort of devices as one array program: their parameters stacked along a
leading device axis, the zoo's layers as batched kernels
(:func:`~protocols.cohort_kernels.batched_forward`; other layers
through ``torch.func.vmap``), gradients by autograd of the sum of the devices' losses (each device's
parameters get their own). Devices whose batches differ in size (the last batch of an epoch) or
whose step counts differ train together with per-sample and per-step masks; each device's minibatch
order is drawn by :func:`~protocols.trainer.batches` from its own seeded generator, as on the
per-device path, so results agree with it to float rounding.

:class:`~protocols.cohort_device.CohortDeviceTrainer` is the ``Trainer`` a device role sees in a cohort:
parameter access is local, and every compute primitive becomes a :class:`~protocols.cohort_device.Request`
that a runner (``edge_agent/cohort.py``) answers for all devices of the cohort at once, through
:meth:`CohortEngine.run`. The batched kernels are in :mod:`protocols.cohort_kernels`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F

from .algorithms.base import ModelSpec
from .cohort_batches import minibatches as _minibatches  # (the engine's batch assembly)
from .cohort_batches import read_only_tensor, stacked
from .cohort_device import Request, one_point
from .cohort_graphs import GraphCache
from .cohort_kernels import (
    batched_forward,
    check_vectorizable,
    device_losses,
    mlp_chain,
    one_point_probes,
    perturbed_stack,
    probe_inputs,
    probe_losses,
    probe_operands,
)
from .cohort_steps import run_steps, step_terms
from .models import build_model
from .torch_trainer import pick_device, say, transform_state
from .trainer import PROGRESS, TrainStats

GATHER_BYTES = 64 << 20  # input samples gathered at once per cohort sgd call (bounds memory)
EVAL_CHUNK = 2048  # samples per device per forward pass in evaluate
# device = "auto" with a GPU: a cohort whose step costs fewer multiply-adds than this (devices x batch x
# parameters) trains on the CPU, where its small kernels run faster than the GPU's launches and
# synchronisations (benchmarks/gpu.py: the small workload, 5 x 16 x 51k = 4M, ran 3.3x slower on an H200
# than on one CPU core; the standard one, 10 x 32 x 199k = 64M, 4.5x faster)
AUTO_GPU_MIN_MACS = 16e6
DEVICE_DATA_BYTES = 4 << 30  # a GPU engine keeps devices' data sets on the GPU across cohorts, up to this
MEMORY_SHARE = 0.8  # of the GPU memory free for it, what a cohort part may plan to use
# on a CPU a cohort's sgd runs in parts of devices whose parameters and gradients fit about this much
# (a shared cache): 64 devices of MLP 784-200-200-10 at once ran 0.66 ms a device-step, 4 to 8 at once
# 0.31 to 0.36 (one core; benchmarks/README.md, the GPU-resident cohort engine)
CPU_PART_BYTES = 16 << 20


def _device_bytes(op: str, model: torch.nn.Module, r: Request) -> int:
    """An estimate (an upper bound in practice) of the engine-device bytes one device's request needs:
    its parameters stacked, their gradients and optimizer state, its data set, and a step's inputs and
    activations (taken as 8 times the inputs' width)."""
    params = sum(int(np.prod(v.shape)) for v in r.params.values())
    samples = len(r.y) if r.rows is None else len(r.rows)  # (a shared data set's upload: :meth:`CohortEngine.tensors`)
    feat = int(np.prod(r.x.shape[1:])) if r.x.ndim > 1 else 1
    if op == "sgd":
        state = 2 + (r.momentum != 0) + (r.prox_mu != 0)  # parameters, gradients, momentum, FedProx's w_0
        batch = max((len(i) for i in r.order), default=1)
        steps = min(len(r.order), max(1, GATHER_BYTES // max(1, batch * feat * 4)))
        work = batch * feat * 4 * (steps + 8) + 16 * len(r.order) * batch  # gathered inputs, activations, indices
    else:
        state, work = 2, min(samples, EVAL_CHUNK) * feat * 4 * 9
    models = len(r.directions) + 1 if op == "probe" else 1  # a probe request runs P + 1 models
    return models * (4 * params * (state + 1) + work) + samples * (feat * 4 + 8)  # (+1: the stack's upload)


def auto_on_gpu(models: int, batch: int, count: int) -> tuple[bool, str]:
    """``device = "auto"`` with a GPU: whether a cohort step of ``models`` models x ``batch`` samples x ``count``
    parameters goes to the GPU (:data:`AUTO_GPU_MIN_MACS`), and why, in words. The one rule of the engine's
    own choice and of ``fedtier sim``'s parent choosing for its workers (``sim.executors``)."""
    macs = models * max(1, batch) * count
    gpu = macs >= AUTO_GPU_MIN_MACS
    why = (
        f">= {AUTO_GPU_MIN_MACS:.0f}: the GPU"
        if gpu
        else f"< {AUTO_GPU_MIN_MACS:.0f}: the CPU's small kernels are faster than the GPU's launches"
    )
    return gpu, f"{models} models x batch {batch} x {count} parameters = {macs:.0f} multiply-adds a step {why}"


# ------------------------------------------------------------------------------ the engine
class CohortEngine:
    """Runs batches of :class:`Request` (one per device) as vectorized torch programs on one device."""

    def __init__(self, device: str = "cpu", threads: int = 1) -> None:
        """``threads`` (CPU): a cohort's devices are split into up to this many parts, computed at once in
        as many threads (each with the process's own torch threads; the devices are independent, so
        each part's results are those of the whole cohort's program).

        ``device = "auto"`` with a GPU: the engine starts on the CPU and chooses at its first cohort, by
        the work of a step (:data:`AUTO_GPU_MIN_MACS`), logging its choice and why."""
        self.auto = device == "auto" and torch.cuda.is_available()
        self.device, self.threads = (torch.device("cpu") if self.auto else pick_device(device)), threads
        self._pool: ThreadPoolExecutor | None = None
        self._models: dict[ModelSpec, torch.nn.Module] = {}
        self._data: dict[int, tuple[np.ndarray, torch.Tensor, torch.Tensor]] = {}
        self._data_bytes = 0
        # bytes a cohort part may plan to use (None: the CPU, unbounded; on a GPU, read before each call)
        self.memory_limit: int | None = None
        # keep devices' data sets across cohorts (on a GPU: an upload saved; on the CPU they share the arrays)
        self.keep_data = self.device.type != "cpu"
        self.part_devices = 0  # most devices computed at once (0: no bound but memory's)
        # plain SGD calls replayed as CUDA graphs (protocols.cohort_graphs), on a GPU
        self.graphs: GraphCache | None = GraphCache() if self.device.type == "cuda" else None

    def model(self, spec: ModelSpec) -> torch.nn.Module:
        """The zoo model of ``spec`` (its parameters are only a template: calls pass their own)."""
        if spec not in self._models:
            model = build_model(spec.name, spec.input_shape, spec.num_classes, **spec.build_kwargs())
            check_vectorizable(model)
            self._models[spec] = model.to(self.device)
        return self._models[spec]

    def tensors(self, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """A device's data set as tensors on the engine's device, converted once: within a cohort (a
        device probes and trains on the same arrays) and, on a GPU, across cohorts while the device keeps
        its arrays (its agent lives), up to :data:`DEVICE_DATA_BYTES` (see :meth:`forget_data`)."""
        hit = self._data.get(id(x))
        if hit is not None and hit[0] is x and hit[1].shape[0] == len(x):
            if self.keep_data:  # most recently used last: the oldest go first
                self._data[id(x)] = self._data.pop(id(x))
            return hit[1], hit[2]
        xt, yt = read_only_tensor(x, np.float32, self.device), read_only_tensor(y, np.int64, self.device)
        self._data[id(x)] = (x, xt, yt)  # keeps x alive: its id cannot be reused while cached
        self._data_bytes += xt.nbytes + yt.nbytes
        return xt, yt

    def forget_data(self) -> None:
        """After a cohort: drop the converted data sets, so memory stays bounded by a cohort's data. On a
        GPU only the least recently used beyond :data:`DEVICE_DATA_BYTES` go (each device's data is
        uploaded once, not every round); on the CPU the tensors share the arrays' memory anyway."""
        if not self.keep_data:
            self._data.clear()
            self._data_bytes = 0
            return
        while self._data and self._data_bytes > DEVICE_DATA_BYTES:
            _, xt, yt = self._data.pop(next(iter(self._data)))
            self._data_bytes -= xt.nbytes + yt.nbytes

    def _stack(self, reqs: Sequence[Request]) -> dict[str, torch.Tensor]:
        return {k: stacked([r.params[k] for r in reqs], self.device) for k in reqs[0].params}

    def _padded(self, reqs: Sequence[Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs [D, n, ...], labels [D, n] and sample masks [D, n], padded to the largest request."""
        n = max(1, max(len(r.y) for r in reqs))
        if all(len(r.y) == n for r in reqs):  # none to pad (DeComFL's probes: a batch each): stacked, no zeros first
            x = np.stack([r.x for r in reqs]).astype(np.float32, copy=False)
            y = np.stack([r.y for r in reqs]).astype(np.int64, copy=False)
            return tuple(torch.from_numpy(a).to(self.device) for a in (x, y, np.ones(y.shape, np.float32)))  # type: ignore[return-value]
        feat = reqs[0].x.shape[1:]
        x = np.zeros((len(reqs), n, *feat), np.float32)
        y = np.zeros((len(reqs), n), np.int64)
        m = np.zeros((len(reqs), n), np.float32)
        for i, r in enumerate(reqs):
            x[i, : len(r.y)], y[i, : len(r.y)], m[i, : len(r.y)] = r.x, r.y, 1.0
        xt, yt, mt = (torch.from_numpy(a).to(self.device) for a in (x, y, m))
        return xt, yt, mt

    def _choose(self, reqs: Sequence[Request]) -> None:
        """``auto``: the CPU or the GPU for this engine, from its first cohort's step (once, logged)."""
        self.auto = False
        r = reqs[0]
        batch = max((len(i) for i in r.order), default=0) if r.op == "sgd" else len(r.y)
        count = sum(int(np.prod(v.shape)) for v in r.params.values())
        models = len(reqs) * (len(r.directions) + 1)  # a probe request runs P + 1 models
        gpu, why = auto_on_gpu(models, batch, count)
        if gpu:
            self.device = pick_device("auto")
        say(f"cohort engine, runtime.device = auto: chose {self.device.type} ({why})")
        self._models.clear()
        self._data.clear()
        self._data_bytes = 0
        self.keep_data = self.device.type != "cpu"
        self.graphs = GraphCache() if self.device.type == "cuda" else None

    def part_size(self, op: str, model: torch.nn.Module, reqs: Sequence[Request]) -> int:
        """The most devices of ``reqs`` computed at once: :attr:`part_devices` (on a CPU by default those
        whose sgd state fits :data:`CPU_PART_BYTES`), and on a GPU what fits the
        memory free for it (:attr:`memory_limit`, else :data:`MEMORY_SHARE` of what is free). A cohort
        larger than that is computed in parts, one after another (devices are independent: the same
        results); one whose single device does not fit is refused (``MemoryError`` with the sizes)."""
        size = self.part_devices or len(reqs)
        if self.device.type == "cpu" and not self.part_devices and op == "sgd":
            count = sum(int(np.prod(v.shape)) for v in reqs[0].params.values())
            size = max(1, min(size, CPU_PART_BYTES // max(1, 8 * count)))
        limit = self.memory_limit
        if limit is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            limit = int(
                MEMORY_SHARE
                * (free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device))
            )
        if limit is None:
            return size
        per = max(_device_bytes(op, model, r) for r in reqs)
        if per > limit:
            raise MemoryError(
                f"one device's {op} needs about {per / 2**20:.1f} MiB on {self.device}, but {limit / 2**20:.1f} MiB "
                "is free for it: use a smaller model or batch, or the CPU"
            )
        return max(1, min(size, limit // per))

    def run(self, reqs: Sequence[Request]) -> None:
        """Answer every request (sets ``request.result``), those with equal :meth:`Request.key` together."""
        if self.auto and reqs:
            self._choose(reqs)
        groups: dict[tuple, list[Request]] = {}
        for r in reqs:
            groups.setdefault(r.key(), []).append(r)
        for (op, spec, _, _), group in groups.items():
            compute = getattr(self, f"_{op}")
            model = self.model(spec)
            size = self.part_size(op, model, group)

            def work(devices: Sequence[Request], compute=compute, model=model, size=size) -> None:
                for i in range(0, len(devices), size):  # parts that fit, one after another
                    compute(model, devices[i : i + size])
                    PROGRESS.tick()

            parts = min(self.threads, len(group)) if self.device.type == "cpu" else 1
            if parts <= 1:
                work(group)
                continue
            # devices split into parts trained side by side (torch releases the GIL in its kernels); no
            # per-operation hand-off between threads, so a busy machine only delays a part
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="cohort")
            bounds = [len(group) * i // parts for i in range(parts + 1)]
            chunks = [group[a:b] for a, b in zip(bounds, bounds[1:])]
            futures = [self._pool.submit(work, chunk) for chunk in chunks[1:]]
            try:
                work(chunks[0])
            finally:
                for f in futures:
                    f.result()  # a part that raised fails the whole call (then retried one by one)

    # ---------------------------------------------------------------- the primitives, vectorized
    def _loss(self, model: torch.nn.Module, reqs: Sequence[Request]) -> None:
        params = self._stack(reqs)
        x, y, m = self._padded(reqs)
        with torch.no_grad():
            losses = device_losses(batched_forward(model, params, x), y, m)
        for r, v in zip(reqs, losses.tolist()):
            r.result = float(v)

    def _probe(self, model: torch.nn.Module, reqs: Sequence[Request]) -> None:
        """``f(x)``, ``f(x + mu z_p)`` of each device (the group's directions): probes built on the engine's device."""
        one, (x, y, m), k = one_point(reqs), self._padded(reqs), len(reqs[0].directions) + 1
        flat = getattr(reqs[0].params, "flat", None) if one else None  # (directions.Packed: its one vector)
        if flat is not None:  # at one point: the probes of one device, built over its vector
            z, mu = probe_operands(reqs[0].directions, [reqs[0].mu], flat.size, self.device)
            shapes = {name: v.shape for name, v in reqs[0].params.items()}
            probes = one_point_probes(read_only_tensor(flat, np.float32, self.device), z, mu, shapes)
        else:
            base = self._stack(reqs[:1] if one else reqs)
            n = sum(v[0].numel() for v in base.values())
            z, mu = probe_operands(reqs[0].directions, [r.mu for r in reqs], n, self.device)
            probes = perturbed_stack(base, z, mu)
        with torch.no_grad():  # the batches for the probes (probe_inputs)
            out = batched_forward(model, probes, *probe_inputs(x, k, one))
            losses = probe_losses(out, y, m, one)
        for r, row in zip(reqs, losses.tolist()):
            r.result = row

    def _loss_and_grad(self, model: torch.nn.Module, reqs: Sequence[Request]) -> None:
        params = {k: v.requires_grad_() for k, v in self._stack(reqs).items()}
        x, y, m = self._padded(reqs)
        losses = device_losses(batched_forward(model, params, x), y, m)
        grads = torch.autograd.grad(losses.sum(), list(params.values()))  # devices are independent
        arrays = {k: g.cpu().numpy() for k, g in zip(params, grads)}
        for i, (r, v) in enumerate(zip(reqs, losses.tolist())):
            r.result = (float(v), OrderedDict((k, arrays[k][i].copy()) for k in params))

    def _evaluate(self, model: torch.nn.Module, reqs: Sequence[Request]) -> None:
        params = self._stack(reqs)
        data = [self.tensors(r.x, r.y) for r in reqs]
        n = max(len(r.y) for r in reqs)
        total = torch.zeros(len(reqs), dtype=torch.float64, device=self.device)
        correct = torch.zeros(len(reqs), dtype=torch.int64, device=self.device)
        with torch.no_grad():
            for start in range(0, n, EVAL_CHUNK):
                PROGRESS.tick()  # (an evaluation chunk is progress: sim/worker_watch.py)
                xb, yb, mb = self._slices(data, start, min(n, start + EVAL_CHUNK))
                out = batched_forward(model, params, xb)
                ce = F.cross_entropy(out.reshape(-1, out.shape[-1]), yb.reshape(-1), reduction="none").view_as(mb)
                total += (ce * mb).sum(1).double()
                correct += ((out.argmax(-1) == yb) & (mb > 0)).sum(1)
        for r, t, c in zip(reqs, total.tolist(), correct.tolist()):
            k = max(1, len(r.y))
            r.result = (t / k, c / k)

    def _slices(self, data: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int, stop: int):
        """Samples ``start:stop`` of every device's data, zero-padded, with masks."""
        xs, ys, ms = [], [], []
        for xt, yt in data:
            xb, yb = xt[start:stop], yt[start:stop]
            pad = (stop - start) - len(yb)
            ms.append(torch.cat([torch.ones(len(yb), device=self.device), torch.zeros(pad, device=self.device)]))
            if pad:
                xb = torch.cat([xb, xb.new_zeros((pad, *xb.shape[1:]))])
                yb = torch.cat([yb, yb.new_zeros(pad)])
            xs.append(xb)
            ys.append(yb)
        return torch.stack(xs), torch.stack(ys), torch.stack(ms)

    def _transform_states(self, model: torch.nn.Module, reqs: Sequence[Request]) -> list[torch.Tensor]:
        """The requests' gradient-transform states stacked per parameter (``[D, *shape]``), checked as the
        per-device trainer checks them."""
        named = list(model.named_parameters())
        per_device = [transform_state(r.grad_transform, named, self.device) for r in reqs]
        return [torch.stack(ts) for ts in zip(*per_device)]

    def _sgd(self, model: torch.nn.Module, reqs: Sequence[Request]) -> None:
        """Minibatch SGD for every device at once: step ``s`` of all devices is one batched step. Devices
        are ordered by step count (most first), so the devices that still have a step ``s`` are a prefix:
        step ``s`` computes only those (a device past its last step costs nothing and stays put)."""
        reqs = sorted(reqs, key=lambda r: -len(r.order))  # stable: results go to each request
        dev, d, steps = self.device, len(reqs), len(reqs[0].order)
        active = [sum(len(r.order) > s for r in reqs) for s in range(steps)]  # [S], non-increasing
        chain = mlp_chain(model)  # the gradient written out (mlp, logreg), else autograd
        params = {k: v if chain else v.requires_grad_() for k, v in self._stack(reqs).items()}
        data = [self.tensors(r.x, r.y) for r in reqs]
        joined, x_all, y_all, idx, mask = _minibatches(reqs, data)
        b = idx.shape[2]
        mask_t, idx_t = torch.from_numpy(mask).to(dev), torch.from_numpy(idx).to(dev)
        counts = mask_t.sum(2)  # [D, S] samples per step
        terms = step_terms(reqs, params, counts, mask, active)
        terms.state = self._transform_states(model, reqs) if terms.transform is not None else []
        # plain SGD (the usual case): the written-out gradient's chain, else None
        plain = not terms.decay and terms.start is None and terms.bufs is None and terms.transform is None
        fused = chain if plain else None
        feat = int(np.prod(reqs[0].x.shape[1:]))
        per_gather = max(1, GATHER_BYTES // max(1, d * b * feat * 4))  # steps of inputs gathered at once
        losses = torch.zeros(d, steps, device=dev)
        names = list(params)
        graphs = self.graphs if fused is not None and all(terms.same_rate) and steps <= per_gather else None
        for s0 in range(0, steps, per_gather):
            s1, a0 = min(steps, s0 + per_gather), active[s0]
            # index_select: a fraction of the cost of fancy indexing (x_all[chunk]) for small batches
            if joined or d == 1:
                chunk = idx_t[:a0, s0:s1].reshape(-1)
                xs = x_all.index_select(0, chunk).reshape(a0, s1 - s0, b, *x_all.shape[1:])
                ys = y_all.index_select(0, chunk).reshape(a0, s1 - s0, b)
            else:
                chunk = idx_t[:a0, s0:s1].reshape(a0, -1)
                xs = torch.stack([xt.index_select(0, chunk[i]) for i, (xt, _) in enumerate(data[:a0])])
                xs = xs.reshape(a0, s1 - s0, b, *xs.shape[2:])
                ys = torch.stack([yt.index_select(0, chunk[i]) for i, (_, yt) in enumerate(data[:a0])])
                ys = ys.reshape(a0, s1 - s0, b)
            span = range(s0, s1)

            def call(t: list[torch.Tensor], span: range = span) -> None:  # params..., xs, ys, masks, losses
                run_steps(model, chain, fused, dict(zip(names, t)), (t[-4], t[-3], t[-2]), span, active, terms, t[-1])

            tensors = [*params.values(), xs, ys, mask_t, losses]
            out = None
            if graphs is not None:  # plain SGD: a CUDA graph of the call, by its shape
                key = (tuple(fused or ()), terms.same_lr, tuple(active), *((t.shape, t.dtype) for t in tensors))
                out = graphs.run(key, tensors, call)
            if out is None:
                call(tensors)
            else:  # the graph's own tensors hold the results until its next replay (copied off a GPU below)
                out = out if dev.type == "cuda" else [t.clone() for t in out]
                params, losses = dict(zip(names, out)), out[-1]
        _answer_sgd(reqs, params, losses, counts)


def _answer_sgd(
    reqs: Sequence[Request], params: Mapping[str, torch.Tensor], losses: torch.Tensor, counts: torch.Tensor
) -> None:
    """Each request's result: its device's trained parameters (views of this call's own arrays) and stats."""
    sample_loss = (losses * counts).sum(1).tolist()  # one transfer from the device, not one per device
    arrays = {k: v.detach().cpu().numpy() for k, v in params.items()}
    for i, r in enumerate(reqs):
        samples = int(sum(len(batch) for batch in r.order))
        stats = TrainStats(sample_loss[i] / max(1, samples), len(r.order), samples)
        r.result = (OrderedDict((k, arrays[k][i]) for k in arrays), stats)
