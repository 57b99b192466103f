"""The checks of a user's dataset arrays (an ``npz:PATH`` file or a registered loader's result) before
``sim/datasets.py`` makes them a ``Dataset``: every refusal a ``ValueError`` that names the dataset."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

MAX_USER_CLASSES = 100_000
"""The most classes a user's dataset may declare (its model's output layer is that wide)."""


def user_geometry(
    name: str, xtr: np.ndarray, ytr: np.ndarray, xte: np.ndarray, yte: np.ndarray, optional: Callable[[str], Any]
) -> tuple[tuple[int, ...], int]:
    """``(input_shape, num_classes)`` of a user's train and test arrays, ``optional(key)`` giving the declared
    ``input_shape`` or ``num_classes`` (``None``: from the arrays); a ``ValueError`` naming ``name`` for empty
    parts, mismatched lengths or rows, non-numeric features, NaN or infinite ones, non-integer or out-of-range
    labels, and a shape or class count that is no positive integer or does not fit the arrays."""
    for x, y, part in ((xtr, ytr, "train"), (xte, yte, "test")):
        if x.ndim < 2 or y.ndim != 1 or len(x) != len(y) or len(x) == 0:
            raise ValueError(
                f"dataset {name}: x_{part} must be [N, ...] and y_{part} [N] with N > 0, got {x.shape} and {y.shape}"
            )
        if not np.issubdtype(y.dtype, np.integer) or not np.issubdtype(x.dtype, np.number):
            raise ValueError(f"dataset {name}: y_{part} must hold integers and x_{part} numbers")
    if xtr.shape[1:] != xte.shape[1:]:
        raise ValueError(f"dataset {name}: x_train rows are {xtr.shape[1:]}, x_test rows {xte.shape[1:]}")
    if not (np.isfinite(xtr).all() and np.isfinite(xte).all()):
        raise ValueError(f"dataset {name}: the features hold NaN or infinite values")
    low, high = min(int(ytr.min()), int(yte.min())), max(int(ytr.max()), int(yte.max()))
    declared_shape, declared_classes = optional("input_shape"), optional("num_classes")
    try:
        shape = tuple(int(s) for s in np.atleast_1d(np.asarray(declared_shape))) if declared_shape is not None else ()
        classes = int(np.asarray(declared_classes)) if declared_classes is not None else high + 1
    except (TypeError, ValueError) as exc:
        raise ValueError(f"dataset {name}: input_shape and num_classes must be integers ({exc})") from None
    shape = shape if declared_shape is not None else tuple(int(s) for s in xtr.shape[1:])
    if not shape or min(shape) < 1 or math.prod(shape) != math.prod(xtr.shape[1:]):
        raise ValueError(f"dataset {name}: input_shape {shape} does not hold rows of {xtr.shape[1:]}")
    if low < 0 or high >= classes or not 2 <= classes <= MAX_USER_CLASSES:
        raise ValueError(f"dataset {name}: labels span {low}..{high}; they must lie in 0..num_classes-1 ({classes})")
    return shape, classes
