"""A device's local data, from the sources a device actually has.

A source is a path (and, for some kinds, a little more):

- ``npz``: arrays ``x`` [n, ...] and integer ``y`` [n] (optionally ``input_shape`` and ``num_classes``),
  loaded without pickle; what ``fedtier partition`` writes by default;
- ``csv``: a header row, one numeric column per feature and an integer label column (``label`` unless
  the source names another); read row by row, so a bad line is reported with its number;
- ``images``: a folder with one sub-folder per class, named by the class's integer label (``0/``,
  ``1/``, ...: a device may hold only some classes, so names must map to the same label on every
  device), of PNG/JPEG/BMP/GIF files; converted to grayscale or RGB and resized to the model's input
  (Pillow, loaded only for this kind);
- ``loader``: ``module:function``, a user's own reader called with the path, returning ``(x, y)``
  arrays (the hook for any other format; the module must be importable on the device).

Every kind is bounded (``max_samples``, Pillow's decompression-bomb limit, a maximum feature count) and
every defect is one :class:`DataSourceError` that names the file and what is wrong: an agent reports it
and never crashes on it.
"""

from __future__ import annotations

import csv
import importlib
import math
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from protocols.algorithms.base import ModelSpec
from protocols.config import ConfigError
from protocols.trainer import LocalData

SOURCE_KINDS = ("npz", "csv", "images", "loader")
MAX_SAMPLES = 1_000_000
"""Samples one source may hold (a bound against a hostile or mistaken file)."""
MAX_FEATURES = 1 << 20
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")
PIXEL_SCALE = np.float32(1.0 / 255.0)
"""8-bit pixels become ``pixel * float32(1/255)``, as the bundled Fashion-MNIST loader scales them."""


class DataSourceError(ConfigError):
    """A device's data source that cannot be used; the text names the file and the defect."""


@dataclass(frozen=True)
class DataSource:
    """Where a device's samples are: ``path``, its ``kind`` (inferred from the path when ``None``), the
    label column of a CSV and the ``module:function`` of a loader."""

    path: str
    kind: str | None = None
    label_column: str = "label"
    loader: str | None = None

    def resolved_kind(self) -> str:
        if self.loader:
            return "loader"
        if self.kind is not None:
            if self.kind not in SOURCE_KINDS:
                raise DataSourceError(f"{self.path}: unknown data source kind {self.kind!r} (one of {SOURCE_KINDS})")
            return self.kind
        p = Path(self.path)
        if p.is_dir():
            return "images"
        suffix = p.suffix.lower()
        if suffix == ".npz":
            return "npz"
        if suffix in (".csv", ".tsv"):
            return "csv"
        raise DataSourceError(
            f"{self.path}: cannot tell the kind of this data source from its name; expected a .npz or .csv file, "
            f"a folder of images by class, or a loader (module:function)"
        )


@dataclass(frozen=True)
class DeviceData:
    """Loaded samples, with the model input shape and class count when the source records them."""

    data: LocalData
    input_shape: tuple[int, ...] | None
    num_classes: int | None


def load_source(
    source: DataSource | str | Path,
    *,
    input_shape: tuple[int, ...] | None = None,
    max_samples: int = MAX_SAMPLES,
) -> DeviceData:
    """Load ``source`` (a :class:`DataSource` or a path); ``input_shape`` is the model's input (images are
    resized to it, and flat features must match its size). Raises :class:`DataSourceError`."""
    src = source if isinstance(source, DataSource) else DataSource(str(source))
    kind = src.resolved_kind()
    if kind != "loader" and not Path(src.path).exists():
        raise DataSourceError(f"{src.path}: no such file or folder")
    if kind in ("npz", "csv") and not Path(src.path).is_file():  # a link to /dev/zero would be read for ever
        raise DataSourceError(f"{src.path}: not a regular file")
    try:
        loaded = _LOADERS[kind](src, input_shape, max_samples)
    except DataSourceError as exc:
        if str(exc) == "no samples":
            raise DataSourceError(f"{src.path}: no samples") from None
        raise
    return _checked(src.path, loaded, input_shape, max_samples)


def _checked(path: str, d: DeviceData, input_shape: tuple[int, ...] | None, max_samples: int) -> DeviceData:
    x, y = d.data.x, d.data.y
    if len(y) == 0:
        raise DataSourceError(f"{path}: no samples")
    if len(y) > max_samples:
        raise DataSourceError(f"{path}: {len(y)} samples exceeds the bound of {max_samples}")
    if not np.all(np.isfinite(x)):
        raise DataSourceError(f"{path}: features hold NaN or infinite values")
    if y.min() < 0:
        raise DataSourceError(f"{path}: negative label {int(y.min())}")
    shape = d.input_shape or input_shape
    if shape is not None and math.prod(shape) != x.shape[1]:
        raise DataSourceError(
            f"{path}: {x.shape[1]} features per sample, but the model takes {'x'.join(map(str, shape))} "
            f"= {math.prod(shape)}"
        )
    if d.num_classes is not None and y.max() >= d.num_classes:
        raise DataSourceError(f"{path}: label {int(y.max())} but the data has {d.num_classes} classes")
    return d


def _flat(x: np.ndarray, y: np.ndarray) -> LocalData:
    if len(x) == 0:
        raise DataSourceError("no samples")
    return LocalData(np.ascontiguousarray(x.reshape(len(x), -1), dtype=np.float32), np.ascontiguousarray(y, np.int64))


# ------------------------------------------------------------------------------------------------ npz
def _load_npz(src: DataSource, input_shape: tuple[int, ...] | None, max_samples: int) -> DeviceData:
    path = src.path
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = {"x", "y"} - set(f.files)
            if missing:
                raise DataSourceError(f"{path}: missing array(s) {sorted(missing)} (expected x and y)")
            x, y = f["x"], f["y"]
            shape = tuple(int(v) for v in f["input_shape"]) if "input_shape" in f.files else None
            classes = int(f["num_classes"]) if "num_classes" in f.files else None
    except DataSourceError:
        raise
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        raise DataSourceError(f"{path}: not a readable .npz data file: {exc}") from None
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y) or not np.issubdtype(y.dtype, np.integer):
        raise DataSourceError(f"{path}: expected x [n, ...] and integer y [n], got {x.shape} and {y.dtype}{y.shape}")
    if not np.issubdtype(x.dtype, np.number):
        raise DataSourceError(f"{path}: x must be numeric, not {x.dtype}")
    return DeviceData(_flat(x, y), shape, classes)


# ------------------------------------------------------------------------------------------------ csv
def _load_csv(src: DataSource, input_shape: tuple[int, ...] | None, max_samples: int) -> DeviceData:
    path = src.path
    delimiter = "\t" if path.lower().endswith(".tsv") else ","
    rows: list[list[float]] = []
    labels: list[int] = []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f, delimiter=delimiter)
            header = next(reader, None)
            if not header:
                raise DataSourceError(f"{path}: empty file (expected a header row naming the columns)")
            if len(header) > MAX_FEATURES + 1:
                raise DataSourceError(f"{path}: {len(header)} columns exceeds the bound of {MAX_FEATURES + 1}")
            names = [h.strip() for h in header]
            if src.label_column not in names:
                raise DataSourceError(
                    f"{path}: no label column {src.label_column!r} in the header (columns: {', '.join(names[:8])}"
                    f"{', ...' if len(names) > 8 else ''}); name the label's column with fedtier agent --label-column"
                )
            li = names.index(src.label_column)
            for line, row in enumerate(reader, start=2):
                if not row:
                    continue
                if len(row) != len(names):
                    raise DataSourceError(f"{path}:{line}: {len(row)} fields, the header has {len(names)}")
                if len(labels) >= max_samples:
                    raise DataSourceError(f"{path}: more than the bound of {max_samples} samples")
                try:
                    label = float(row[li])
                    if label != int(label) or abs(label) >= 2**31:  # int(inf): OverflowError; 1e20: no int64
                        raise ValueError
                    labels.append(int(label))
                except (ValueError, OverflowError):
                    raise DataSourceError(f"{path}:{line}: label {row[li]!r} is not an integer class id") from None
                try:
                    rows.append([float(v) for i, v in enumerate(row) if i != li])
                except ValueError as exc:
                    raise DataSourceError(f"{path}:{line}: a feature is not a number ({exc})") from None
    except DataSourceError:
        raise
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataSourceError(f"{path}: not a readable CSV file: {exc}") from None
    x = np.asarray(rows, dtype=np.float32).reshape(len(rows), len(names) - 1)
    return DeviceData(_flat(x, np.asarray(labels, np.int64)), None, None)


# --------------------------------------------------------------------------------------------- images
def _load_images(src: DataSource, input_shape: tuple[int, ...] | None, max_samples: int) -> DeviceData:
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise DataSourceError(f"{src.path}: a folder of images needs Pillow (pip install pillow)") from None
    root = Path(src.path)
    class_dirs = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.name)
    if not class_dirs:
        raise DataSourceError(f"{root}: no class folders (expected {root}/0/, {root}/1/, ... holding images)")
    bad = [p.name for p in class_dirs if not p.name.isdigit()]
    if bad:
        raise DataSourceError(
            f"{root}: class folders must be named by their integer label (0, 1, ...), not {', '.join(bad[:5])}: "
            f"a device may hold only some classes, so a name must mean the same label on every device"
        )
    channels, size = (None, None) if input_shape is None else _image_geometry(root, input_shape)
    files = sorted(
        ((f.name, int(d.name), f) for d in class_dirs for f in d.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES),
        key=lambda t: (t[0], t[1]),
    )  # samples in file-name order across classes (``fedtier partition`` names them by position)
    if len(files) > max_samples:
        raise DataSourceError(f"{root}: {len(files)} images exceeds the bound of {max_samples}")
    xs: list[np.ndarray] = []
    ys: list[int] = []
    for _, label, file in files:
        try:
            with Image.open(file) as opened:
                if channels is None or size is None:  # no model shape given: the first image decides
                    channels = 1 if opened.mode in ("1", "L", "I", "I;16", "F") else 3
                    size = opened.size
                im = opened.convert("L" if channels == 1 else "RGB")
                if im.size != size:
                    im = im.resize(size, Image.Resampling.BILINEAR)
                a = np.asarray(im, dtype=np.float32) * PIXEL_SCALE
        except (OSError, UnidentifiedImageError, Image.DecompressionBombError, ValueError) as exc:
            raise DataSourceError(f"{file}: not a readable image: {exc}") from None
        xs.append(a[None] if channels == 1 else a.transpose(2, 0, 1))
        ys.append(label)
    if not ys:
        raise DataSourceError(f"{root}: no images ({', '.join(IMAGE_SUFFIXES)}) in its class folders")
    assert channels is not None and size is not None
    shape = (channels, size[1], size[0])
    return DeviceData(_flat(np.stack(xs), np.asarray(ys, np.int64)), shape, None)


def _image_geometry(root: Path, input_shape: tuple[int, ...]) -> tuple[int, tuple[int, int]]:
    if len(input_shape) != 3 or input_shape[0] not in (1, 3):
        raise DataSourceError(
            f"{root}: images need a model input of 1 or 3 channels x height x width, "
            f"not {'x'.join(map(str, input_shape))}"
        )
    return input_shape[0], (input_shape[2], input_shape[1])


# --------------------------------------------------------------------------------------------- loader
def _load_with_hook(src: DataSource, input_shape: tuple[int, ...] | None, max_samples: int) -> DeviceData:
    fn = resolve_loader(src.loader or "")
    try:
        out = fn(src.path)
    except Exception as exc:  # the user's code: any failure is reported as the source's defect
        raise DataSourceError(f"{src.path}: loader {src.loader} failed: {type(exc).__name__}: {exc}") from None
    if not (isinstance(out, tuple) and len(out) == 2):
        raise DataSourceError(f"loader {src.loader} must return (x, y) arrays, not {type(out).__name__}")
    x, y = np.asarray(out[0]), np.asarray(out[1])
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y) or not np.issubdtype(y.dtype, np.integer):
        raise DataSourceError(
            f"loader {src.loader}: expected x [n, ...] and integer y [n], got {x.shape} and {y.dtype}{y.shape}"
        )
    return DeviceData(_flat(x, y), tuple(x.shape[1:]) if x.ndim > 2 else None, None)


def resolve_loader(spec: str) -> Callable[[str], Any]:
    """The function named ``module:function`` (a user's reader for another format)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise DataSourceError(f"a loader is named module:function, not {spec!r}")
    try:
        fn = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name != module.partition(".")[0]:  # a module the loader imports: its own error says which
            raise DataSourceError(f"cannot load the data loader {spec!r}: {exc}") from None
        raise DataSourceError(  # (walked: myloader.py beside the bundle's config.toml, 'No module named ...')
            f"cannot load the data loader {spec!r}: no module {module!r} on this Python's path (a loader's module is "
            "imported, not looked for in the current folder: install it, or set PYTHONPATH to its folder)"
        ) from None
    except (ImportError, AttributeError) as exc:
        raise DataSourceError(f"cannot load the data loader {spec!r}: {exc}") from None
    if not callable(fn):
        raise DataSourceError(f"data loader {spec!r} is not callable")
    return fn


_LOADERS: dict[str, Callable[[DataSource, tuple[int, ...] | None, int], DeviceData]] = {
    "npz": _load_npz,
    "csv": _load_csv,
    "images": _load_images,
    "loader": _load_with_hook,
}


# ---------------------------------------------------------------------------------------------- writing
def write_source(path: str | Path, data: LocalData, input_shape: tuple[int, ...], num_classes: int, kind: str) -> Path:
    """Write ``data`` as a source of ``kind`` (``npz``, ``csv`` or ``images``) at ``path``; the inverse of
    :func:`load_source` (exact for npz and csv; images are 8-bit, so exact only for data that already is)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "npz":
        np.savez(
            path,
            x=data.x,
            y=data.y,
            input_shape=np.asarray(input_shape, np.int64),
            num_classes=np.asarray(num_classes, np.int64),
        )
    elif kind == "csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow([*(f"f{i}" for i in range(data.x.shape[1])), "label"])
            for xi, yi in zip(data.x, data.y):
                w.writerow([*(format(float(v), ".9g") for v in xi), int(yi)])  # 9 digits: float32 round-trips
    elif kind == "images":
        _write_images(path, data, input_shape)
    else:
        raise DataSourceError(f"cannot write a data source of kind {kind!r} (npz, csv or images)")
    return path


def _write_images(root: Path, data: LocalData, input_shape: tuple[int, ...]) -> None:
    from PIL import Image

    if len(input_shape) != 3 or input_shape[0] not in (1, 3):
        raise DataSourceError(f"images need data of 1 or 3 channels x height x width, not {input_shape}")
    if data.x.size and (data.x.min() < 0 or data.x.max() > 1):
        raise DataSourceError("images hold pixels in [0, 1]; this data is outside that range")
    pixels = np.rint(data.x.reshape(len(data.x), *input_shape) * 255).astype(np.uint8)
    for k, (img, label) in enumerate(zip(pixels, data.y)):
        folder = root / str(int(label))
        folder.mkdir(parents=True, exist_ok=True)
        arr = img[0] if input_shape[0] == 1 else img.transpose(1, 2, 0)
        Image.fromarray(arr).save(folder / f"{k:06d}.png")  # uint8 HxW -> L, HxWx3 -> RGB; named by position


# ----------------------------------------------------------------------- a device's data, as the runtimes use it
def save_device_data(path: str | Path, data: LocalData, spec: ModelSpec) -> None:
    """A device's samples as ``.npz``: ``x``, ``y``, plus the model's ``input_shape`` and ``num_classes``."""
    write_source(path, data, spec.input_shape, spec.num_classes, "npz")


def load_device_data(
    source: str | Path | DataSource, input_shape: tuple[int, ...] | None = None
) -> tuple[LocalData, tuple[int, ...] | None, int | None]:
    """``(data, input_shape, num_classes)`` of a device's data source (``.npz``, CSV, a folder of images
    by class, or a loader); the last two are ``None`` when the source does not record them. Raises
    ``DataSourceError`` (a ``ConfigError``) naming the defect."""
    d = load_source(source, input_shape=input_shape)
    return d.data, d.input_shape, d.num_classes
