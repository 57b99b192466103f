"""Shamir secret sharing over the prime field GF(2^521 - 1), for secrets of up to 64 bytes.

A secret is the constant term of a random polynomial of degree ``t - 1``; share ``x`` is the
polynomial at ``x`` (``x`` = 1, 2, ...). Any ``t`` shares give the secret back (Lagrange at 0), fewer
reveal nothing about it. Coefficients come from :mod:`secrets` (a cryptographic source: a secret's
shares must not be reproducible from the run seed).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

PRIME = 2**521 - 1  # a Mersenne prime: any 64-byte secret is an element
SHARE_BYTES = 66  # a field element, big-endian
MAX_SECRET_BYTES = 64

Share = tuple[int, bytes]
"""``(x, y)``: the evaluation point (1-based) and the value as :data:`SHARE_BYTES` big-endian bytes."""


class ShareError(ValueError):
    """A share or a set of shares that cannot be used (malformed, duplicated, too few)."""


def split(secret: bytes, points: Sequence[int], t: int) -> list[Share]:
    """Shares of ``secret`` at ``points`` (distinct, in 1..p-1), any ``t`` of which reconstruct it."""
    if not 1 <= t <= len(points):
        raise ValueError(f"threshold {t} must be in 1..{len(points)}")
    if len(set(points)) != len(points) or not all(0 < x < PRIME for x in points):
        raise ValueError("share points must be distinct and in 1..p-1")
    if len(secret) > MAX_SECRET_BYTES:
        raise ValueError(f"a secret of {len(secret)} bytes is longer than {MAX_SECRET_BYTES}")
    coeffs = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(t - 1)]
    out = []
    for x in points:
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % PRIME
        out.append((x, y.to_bytes(SHARE_BYTES, "big")))
    return out


def parse(x: int, y: bytes) -> tuple[int, int]:
    """Check one share; ``(x, y as an integer)``. Raises :class:`ShareError`."""
    if not isinstance(x, int) or not 0 < x < PRIME:
        raise ShareError(f"share point {x!r} is not in 1..p-1")
    if len(y) != SHARE_BYTES:
        raise ShareError(f"share value of {len(y)} bytes, expected {SHARE_BYTES}")
    value = int.from_bytes(y, "big")
    if value >= PRIME:
        raise ShareError("share value is not a field element")
    return x, value


def combine(shares: Sequence[Share], length: int) -> bytes:
    """The secret (``length`` bytes) from shares at distinct points. With fewer than the threshold, or
    with a wrong share, the result is some other value: callers verify it (a commitment, a public key)."""
    if not shares:
        raise ShareError("no shares")
    points = [parse(x, y) for x, y in shares]
    xs = [x for x, _ in points]
    if len(set(xs)) != len(xs):
        raise ShareError("two shares at the same point")
    top, bottom = 0, 1  # the Lagrange sum at 0 as one fraction: a single modular inversion
    for i, (xi, yi) in enumerate(points):
        num = den = 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * -xj % PRIME
                den = den * (xi - xj) % PRIME
        top, bottom = (top * den + yi * num * bottom) % PRIME, bottom * den % PRIME
    secret = top * pow(bottom, -1, PRIME) % PRIME
    if secret >= 1 << (8 * length):
        raise ShareError("the shares do not combine to a secret of the expected size")
    return secret.to_bytes(length, "big")
