"""What every launcher needs from a config: the data of each device, the model spec, the evaluator."""

from __future__ import annotations

import logging
import shutil
import tomllib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from protocols import runfiles
from protocols.algorithms.base import ModelSpec
from protocols.checkpoint import private_file
from protocols.config import ConfigError, RunConfig, TopologySection, UnusableFile, parse_config
from protocols.jsonl import rotated
from protocols.trainer import DatasetRows, LocalData

from .datasets import Dataset, load_dataset
from .participation import ParticipationModel, check_spec, make_participation
from .partition import partition, partition_hierarchy


@dataclass
class Prepared:
    """A config turned into data: the dataset, each device's samples and the model spec."""

    config: RunConfig
    dataset: Dataset
    device_data: DeviceData
    spec: ModelSpec


KEPT_DATA_BYTES = 256 << 20  # devices' copied samples kept for their agents' next builds (least recent dropped first)


class DeviceData(Mapping[str, LocalData]):
    """Each device's samples by id: rows of the data set (:class:`~protocols.trainer.DatasetRows`), copied out of
    it when a role or the per-device trainer first reads them (the cohort engine gathers from the data set itself,
    without a copy); the partition stays a set of index views. They are kept up to ``KEPT_DATA_BYTES`` (counted as
    copied; least recently asked for dropped first), so an agent that a lazy population drops when idle and builds
    again at its next task gets the same arrays back instead of a fresh copy every round. Nobody writes into a
    device's samples."""

    def __init__(self, ds: Dataset, topology: TopologySection, parts: Sequence[Sequence[np.ndarray]]) -> None:
        self.ds, self.topology, self.parts = ds, topology, parts
        self._kept: OrderedDict[str, DatasetRows] = OrderedDict()
        self._kept_bytes = 0
        self.keep_bytes = KEPT_DATA_BYTES  # the bound of the kept copies (a sim worker sets its own)
        self._where: dict[str, tuple[int, int]] | None = None
        if not topology.uniform():  # explicit members: a table (such topologies are small)
            self._where = {
                d: (i, j) for i, c in enumerate(topology.cell_ids()) for j, d in enumerate(topology.device_ids(c))
            }

    def indices(self, device: str) -> np.ndarray:
        """The device's sample indices in the training set."""
        if self._where is not None:
            if device not in self._where:
                raise KeyError(device)
            cell, j = self._where[device]
            return self.parts[cell][j]
        # devices() is a DeviceIds or MemberIds, both with position (protocols/config/topology.py annotates
        # it as the Sequence[str] they are)
        at = self.topology.devices().position(device)  # type: ignore[attr-defined]
        if at is None:
            raise KeyError(device)
        cell, j = divmod(at, self.topology.devices_per_cell)
        return self.parts[cell][j]

    def __getitem__(self, device: str) -> LocalData:
        kept = self._kept.get(device)
        if kept is not None:
            self._kept.move_to_end(device)
            return kept
        data = DatasetRows(self.ds.x_train, self.ds.y_train, self.indices(device))
        size = data.nbytes  # (counted as if copied: a role that reads them copies them)
        if size <= self.keep_bytes:
            self._kept[device] = data
            self._kept_bytes += size
            while self._kept_bytes > self.keep_bytes:
                _, old = self._kept.popitem(last=False)
                self._kept_bytes -= old.nbytes
        return data

    def __iter__(self) -> Iterator[str]:
        return iter(self.topology.devices())

    def __len__(self) -> int:
        return len(self.topology.devices())

    def __contains__(self, device: object) -> bool:
        return device in self.topology.devices()


class SampleCounts(Mapping[str, int]):
    """Each device's sample count (the length of its index view) read when asked for: what a cell bounds
    its devices' weights with, without a table of a large cell's devices."""

    def __init__(self, data: DeviceData, devices: Sequence[str]) -> None:
        """``devices``: the ids counted (a topology's :class:`~protocols.config.DeviceIds`: O(1) lookups)."""
        self.data, self.devices = data, devices

    def __getitem__(self, device: str) -> int:
        if device not in self.devices:
            raise KeyError(device)
        return len(self.data.indices(device))

    def __iter__(self) -> Iterator[str]:
        return iter(self.devices)

    def __len__(self) -> int:
        return len(self.devices)


def check_participation(cfg: RunConfig) -> None:
    """``ConfigError`` for a participation parameter its model never reads (``prob`` with ``always``): the model is
    built where it is used, and ``always`` never, so :func:`prepare` and :func:`prepare_given` check it first."""
    try:
        check_spec(cfg.participation.spec())
    except ValueError as exc:
        raise ConfigError(f"participation: {exc}") from None


def run_dataset(cfg: RunConfig) -> Dataset:
    """The run's dataset (``[data]``: its source, subsample and loader parameters); ConfigError when it cannot load."""
    d = cfg.data
    try:
        return load_dataset(
            d.dataset,
            max_train=d.max_train or None,
            max_test=d.max_test or None,
            subsample_seed=cfg.run.seed,
            **d.loader_params(),
        )
    except UnusableFile:  # (names its setting already)
        raise
    except (ValueError, FileNotFoundError, ImportError) as exc:
        raise ConfigError(f"data.dataset: {exc}") from None


def prepare(cfg: RunConfig, dataset: Dataset | None = None) -> Prepared:
    """Load the dataset (or take ``dataset``, :func:`run_dataset`'s as another process loaded it) and partition
    it over the topology; raise ConfigError on impossible setups."""
    check_participation(cfg)
    d = cfg.data
    ds = dataset if dataset is not None else run_dataset(cfg)
    topo = cfg.topology
    total = len(topo.devices())
    if total > ds.num_train:
        raise ConfigError(
            f"topology: {topo.cells} cells, {total} devices, "
            f"but data.dataset {d.dataset!r} has only {ds.num_train} training samples"
            + (f" (data.max_train = {d.max_train})" if d.max_train else "")
        )
    by_scheme: dict[str, dict[str, Any]] = {
        "iid": {},
        "dirichlet": {"alpha": d.alpha},
        "shards": {"shards_per_device": d.shards_per_device},
        "cell_shards": {"shards_per_device": d.shards_per_device},
        "hierarchical": {"alpha_cells": d.alpha_cells, "alpha_devices": d.alpha_devices},
    }
    params = by_scheme[d.partition]
    try:
        parts: Sequence[Sequence[np.ndarray]]
        if topo.uniform():
            parts = partition_hierarchy(
                ds.y_train, topo.cells, topo.devices_per_cell, d.partition, cfg.run.seed, **params
            )
        else:
            parts = _partition_members(ds.y_train, topo, d.partition, cfg.run.seed, params)
    except ValueError as exc:
        raise ConfigError(f"data.partition: {exc}") from None
    return _prepared(cfg, ds, parts)


def _prepared(cfg: RunConfig, ds: Dataset, parts: Sequence[Sequence[np.ndarray]]) -> Prepared:
    """The run's data: each device's sample indices ``parts`` (by cell) into ``ds``; ConfigError when a cohort's
    minibatches would not fit memory (``local_epochs``: the steps a device runs depend on its samples)."""
    if (why := cfg.cohort_refusal(samples=max((len(p) for cell in parts for p in cell), default=0))) is not None:
        raise ConfigError(why)
    return Prepared(cfg, ds, DeviceData(ds, cfg.topology, parts), cfg.model_spec(ds.input_shape, ds.num_classes))


def _partition_members(
    labels: np.ndarray, topo: TopologySection, scheme: str, seed: int, params: Mapping[str, object]
) -> list[list[np.ndarray]]:
    """A flat partition over every device of an explicit membership, cut into cells of their own sizes."""
    if scheme in ("hierarchical", "cell_shards"):
        raise ValueError(f"{scheme!r} needs cells of equal size; topology.members gives each cell its own")
    flat = partition(labels, len(topo.devices()), scheme, seed, **params)
    out, at = [], 0
    for cell in topo.cell_ids():
        n = len(topo.device_ids(cell))
        out.append(list(flat[at : at + n]))
        at += n
    return out


def prepare_given(cfg: RunConfig, ds: Dataset, parts: Mapping[str, np.ndarray]) -> Prepared:
    """Like :func:`prepare`, for a caller's own data: ``ds`` and each device's sample indices into
    ``ds.x_train`` (every device of the topology, no other), instead of ``data.dataset`` and ``data.partition``
    (benchmarks with data the config cannot name, e.g. a paper's synthetic recipe)."""
    check_participation(cfg)
    devices = list(cfg.topology.devices())
    if set(parts) != set(devices):
        missing, extra = sorted(set(devices) - set(parts)), sorted(set(parts) - set(devices))
        raise ConfigError(
            f"given data: the devices must be the topology's (missing {missing[:3]}, unknown {extra[:3]})"
        )
    for d, idx in parts.items():
        idx = np.asarray(idx)
        if idx.ndim != 1 or len(idx) == 0 or idx.min() < 0 or idx.max() >= ds.num_train:
            raise ConfigError(
                f"given data: device {d!r} needs a non-empty index vector into the {ds.num_train} training samples"
            )
    per = cfg.topology.devices_per_cell
    rows = [[np.asarray(parts[devices[c * per + j]]) for j in range(per)] for c in range(cfg.topology.cells)]
    return _prepared(cfg, ds, rows)


def participation(cfg: RunConfig) -> ParticipationModel:
    """The participation model over the devices, or over the cells with ``participation.level = "cell"``."""
    units = cfg.topology.cell_ids() if cfg.participation.level == "cell" else cfg.topology.devices()
    try:
        return make_participation(cfg.participation.spec(), units, cfg.run.seed)
    except UnusableFile:  # (names its setting already; what it may say beyond this node is its own)
        raise
    except ValueError as exc:
        raise ConfigError(f"participation: {exc}") from None


def device_availability(cfg: RunConfig) -> Callable[[int], frozenset[str]] | None:
    """``round -> devices that take part`` for device-level partial participation, else ``None``: the
    cells' plan (sim and run) and the agents' churn (run, deployment) use this one function."""
    if cfg.participation.model == "always" or cfg.participation.level == "cell":
        return None
    return per_round(participation(cfg).participants)


def cell_availability(cfg: RunConfig) -> Callable[[int], frozenset[str]] | None:
    """``round -> cells that take part`` for cell-level participation (the cloud's hook), else ``None``."""
    if cfg.participation.model == "always" or cfg.participation.level != "cell":
        return None
    return per_round(participation(cfg).participants)


def per_round(participants: Callable[[int], frozenset[str]]) -> Callable[[int], frozenset[str]]:
    """``participants`` computed once per round: every cell of a process asks for the same round in
    turn, and a draw over the whole population costs what the population does."""
    last: list = [None, None]  # [round, its participants]

    def cached(round: int) -> frozenset[str]:
        if last[0] != round:
            last[:] = [round, participants(round)]
        return last[1]

    return cached


def edge_availability(cfg: RunConfig) -> Callable[[int, int], frozenset[str]] | None:
    """:func:`device_availability` in the form a cell server takes: ``(round, edge round) -> devices``."""
    takes_part = device_availability(cfg)
    return (lambda r, e: takes_part(r)) if takes_part is not None else None


def make_evaluator(spec: ModelSpec, x: np.ndarray, y: np.ndarray, device: str = "cpu", threads: int = 1):
    """``params -> {"accuracy", "loss"}`` on a held-out set (the cloud's central evaluation); ``threads`` > 1
    (the cohort engine's ``cohort_threads``): the set is cut into that many parts evaluated side by side."""
    from concurrent.futures import ThreadPoolExecutor

    from protocols.torch_trainer import TorchTrainer

    trainer = TorchTrainer.from_spec(spec.name, spec.input_shape, spec.num_classes, device, **spec.build_kwargs())
    # writable copies, made once: a shared read-only (cached) test set would be copied at every evaluation
    x, y = np.array(x, dtype=np.float32), np.array(y, dtype=np.int64)
    parts = max(1, min(threads, len(y))) if trainer.device.type == "cpu" else 1
    bounds = [len(y) * i // parts for i in range(parts + 1)]
    pool = ThreadPoolExecutor(parts - 1, thread_name_prefix="evaluate") if parts > 1 else None

    def evaluate(params: Mapping[str, np.ndarray]) -> dict[str, float]:
        trainer.set_params(params)
        if pool is None:
            loss, acc = trainer.evaluate(x, y)
            return {"accuracy": acc, "loss": loss}
        part = lambda a, b: trainer.evaluate(x[a:b], y[a:b])  # noqa: E731  no_grad forward: shareable
        futures = [pool.submit(part, a, b) for a, b in zip(bounds[1:-1], bounds[2:])]
        results = [part(bounds[0], bounds[1])] + [f.result() for f in futures]
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        n = max(1, len(y))
        loss = sum(value * k for (value, _), k in zip(results, sizes)) / n
        correct = sum(round(a * k) for (_, a), k in zip(results, sizes))
        return {"accuracy": correct / n, "loss": loss}

    return evaluate


log = logging.getLogger("fedtier.sim")

RESUME_FIXED = ("topology", "algorithm", "model", "data", "participation", "privacy", "attack", "clock")
"""The config sections a resumed run must keep as its folder's config.toml recorded them (with ``run.seed``)."""


def _fixed(cfg: RunConfig) -> dict[str, Any]:
    """``run.seed`` and the :data:`RESUME_FIXED` sections of ``cfg``, every key (one left unset: ``None``)."""
    data = cfg.model_dump(mode="json") | {"algorithm": cfg.train.model_dump(mode="json")}
    return {"run": {"seed": cfg.run.seed}, **{section: data[section] for section in RESUME_FIXED}}


def check_resumed_config(out: Path, cfg: RunConfig) -> None:
    """``ConfigError`` naming each setting of :data:`RESUME_FIXED` (and ``run.seed``) that differs from what the
    run folder's ``config.toml`` recorded, when there is a checkpoint to resume: the resumed rounds would run
    another experiment than the earlier ones, and config.toml would then claim it for all of them. ``run.rounds``
    and the runtime settings may change. The record is read as this version reads a config (a key it leaves out is
    an unset setting); one it cannot read (another fedtier version's keys) is compared on the keys both name."""
    path = out / runfiles.CONFIG
    if not (out / runfiles.CHECKPOINT).exists() or not path.exists():
        return
    try:
        old = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"--resume: cannot read {path}: {exc}") from None
    try:
        before, after, read = _fixed(parse_config(old)), _fixed(cfg), True
    except ConfigError:
        before, after, read = old, tomllib.loads(cfg.to_toml()), False
    pairs = [("run.seed", before.get("run", {}), after.get("run", {}), "seed")]
    for section in RESUME_FIXED:
        a, b = before.get(section) or {}, after.get(section) or {}
        pairs += [(f"{section}.{key}", a, b, key) for key in sorted(set(a) | set(b) if read else set(a) & set(b))]
    changed = [f"{name} {a[key]!r} -> {b[key]!r}" for name, a, b, key in pairs if a.get(key) != b.get(key)]
    if changed:
        raise ConfigError(
            f"--resume: the run in {out} was made with other settings ({'; '.join(changed)}): resuming would mix two "
            "experiments in one run; resume with its settings (run.rounds and [runtime] may change), or start this "
            "one in another run.output"
        )


def fresh_output(cfg: RunConfig, resume: bool = False) -> Path:
    """Create the output folder and write the config; without ``resume``, old run files are removed."""
    out = cfg.output_dir()
    out.mkdir(parents=True, exist_ok=True)
    if resume:
        check_resumed_config(out, cfg)
    else:
        if (out / runfiles.METRICS).exists() and (out / runfiles.METRICS).stat().st_size:
            log.warning("%s held a run: its records, checkpoint and model are replaced (--resume continues it)", out)
        for name in (
            runfiles.METRICS,
            runfiles.CHECKPOINT,
            runfiles.CHECKPOINT_LOG,
            runfiles.CLOUD_JOURNAL,
            runfiles.FINAL_MODEL,
            runfiles.SUMMARY,
            runfiles.JOBS,  # fedtier run's job queue
        ):
            (out / name).unlink(missing_ok=True)
        for log_file in (runfiles.CELL_RECORDS, runfiles.AGGREGATION):  # and the older files each rotated to
            for path in rotated(out / log_file):
                if path.name != runfiles.AGGREGATION:
                    path.unlink(missing_ok=True)
        _empty_in_place(out / runfiles.AGGREGATION)
        shutil.rmtree(out / "devices", ignore_errors=True)
    with private_file(out / runfiles.CONFIG) as f:  # a deployment's config holds its broker password
        f.write(cfg.to_toml().encode())
    return out


def _empty_in_place(path: Path) -> None:
    """Empty the cells' log of an earlier run, keeping the file: a deployed cell sharing the folder (``fedtier cell``,
    started before its cloud) has it open already and appends to it; unlinked, its records went to a deleted file
    (walked: the cell's log vanished under it)."""
    try:
        with path.open("r+b") as f:
            f.truncate(0)
    except FileNotFoundError:
        pass
