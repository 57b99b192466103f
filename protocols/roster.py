"""The federation's signed roster: who belongs to which cell, with which identity key and which weight bound.

One roster per federation, produced and signed by the cloud's Ed25519 identity (the only node every other
node already trusts), published retained on ``fedtier/{federation}/roster`` and handed to whoever asks.
It is the one source for:

- **membership**: the devices of each cell (cells may differ in size) and the nodes revoked, each with the cell
  it was in (``revoked_in``; absent from rosters signed before it was recorded);
- **identity**: each device's and cell's public key, so a device can check a neighbour's signed key
  advertisement in secure aggregation without trusting its cell to relay keys honestly;
- **bounds**: each device's weight bound (the most samples it may claim); a cell's bound at the cloud is
  the sum of its devices' bounds.

A roster carries a version that only grows: :func:`verify_roster` refuses one older than the version the
reader already holds (``min_version``), so an old roster that still lists a revoked device cannot be
replayed. Everything a reader acts on is checked here: the signature over the canonical JSON (domain
separated from every other signed object), the size before parsing, key lengths, finite positive bounds.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from .config import ConfigError
from .jsonl import loads

FORMAT = "fedtier-roster/1"
ROSTER_DOMAIN = b"fedtier/roster/1\0"
MAX_ROSTER_BYTES = 16 * 1024 * 1024  # ~10^5 devices; checked before parsing
KEY_BYTES = 32
SIG_BYTES = 64
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")

Signer = Callable[[bytes], bytes]
"""Signs bytes with the cloud's private key (e.g. ``protocols.wire.keys.Trust.sign``)."""
Verifier = Callable[[str, bytes, bytes], None]
"""``verify(signer, data, sig)`` raising on a bad signature (e.g. ``protocols.wire.keys.PublicKeys.verify``)."""


class RosterError(ConfigError):
    """A roster that is malformed, unsigned, signed by the wrong key, too large or older than the one held."""


class NodeRevoked(ConfigError):
    """A long-lived node's own federation revoked it (a signed roster says so): its bundle is no longer valid, and it
    exits as for a wrong config (2: a service unit does not restart it)."""


def roster_topic(federation: str) -> str:
    """The retained topic the cloud publishes the roster on."""
    return f"fedtier/{federation}/roster"


@dataclass(frozen=True)
class DeviceEntry:
    """One device: its Ed25519 public key (32 bytes) and its weight bound (max samples it may claim)."""

    key: bytes
    max_weight: float

    def __post_init__(self) -> None:
        if len(self.key) != KEY_BYTES:
            raise RosterError(f"a device key has {len(self.key)} bytes, not {KEY_BYTES}")
        if not (math.isfinite(self.max_weight) and self.max_weight > 0):
            raise RosterError(f"a device's weight bound must be finite and positive, not {self.max_weight!r}")


def _check_node(node: str) -> str:
    if not isinstance(node, str) or not _NODE.match(node):
        raise RosterError(f"bad node id {node!r} (letters, digits, '_', '.', '-'; at most 128)")
    return node


@dataclass(frozen=True)
class Roster:
    """Members, keys and bounds of a federation at one version (immutable; changes make a new version)."""

    federation: str
    version: int
    cells: Mapping[str, Mapping[str, DeviceEntry]]
    """cell -> device -> entry."""
    cell_keys: Mapping[str, bytes]
    """cell -> its Ed25519 public key."""
    revoked: frozenset[str] = frozenset()
    issued_at: float = 0.0
    revoked_in: Mapping[str, str] = field(default_factory=dict)
    """revoked id -> the cell it was in when revoked (a cell: itself), so a view can show its role and cell; a
    roster signed before this was recorded has none (its revoked ids have no cell)."""
    _cell_of: Mapping[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_node(self.federation)
        if not isinstance(self.version, int) or self.version < 0:
            raise RosterError(f"bad roster version {self.version!r}")
        cells = {_check_node(c): MappingProxyType(dict(devs)) for c, devs in self.cells.items()}
        cell_of: dict[str, str] = {}
        for cell, devs in cells.items():
            if cell not in self.cell_keys:
                raise RosterError(f"cell {cell!r} has no key in the roster")
            for device in devs:
                _check_node(device)
                if device in cell_of or device in cells:
                    raise RosterError(f"node {device!r} appears twice in the roster")
                cell_of[device] = cell
        for cell, key in self.cell_keys.items():
            if cell not in cells:
                raise RosterError(f"a key for {cell!r}, which is not a cell of the roster")
            if len(key) != KEY_BYTES:
                raise RosterError(f"the key of cell {cell!r} has {len(key)} bytes, not {KEY_BYTES}")
        listed = set(cell_of) | set(cells)
        if listed & self.revoked:
            raise RosterError(f"revoked nodes still listed: {sorted(listed & self.revoked)}")
        for node, cell in self.revoked_in.items():
            if node not in self.revoked:
                raise RosterError(f"a cell recorded for {node!r}, which is not revoked")
            _check_node(cell)
        object.__setattr__(self, "cells", MappingProxyType(cells))
        object.__setattr__(self, "cell_keys", MappingProxyType(dict(self.cell_keys)))
        object.__setattr__(self, "revoked", frozenset(self.revoked))
        object.__setattr__(self, "revoked_in", MappingProxyType(dict(self.revoked_in)))
        object.__setattr__(self, "_cell_of", MappingProxyType(cell_of))

    # ------------------------------------------------------------------ queries
    def members(self, cell: str) -> list[str]:
        """The devices of ``cell`` (sorted); empty for an unknown cell."""
        return sorted(self.cells.get(cell, {}))

    def cell_of(self, device: str) -> str | None:
        return self._cell_of.get(device)

    def revoked_cell(self, node: str) -> str | None:
        """The cell a revoked ``node`` was in (a revoked cell: itself); ``None`` if the roster does not record it."""
        return self.revoked_in.get(node)

    def is_member(self, node: str) -> bool:
        """A listed, unrevoked cell or device."""
        return node in self._cell_of or node in self.cells

    def device_key(self, node: str) -> bytes | None:
        """The public key of a device or a cell; ``None`` if it is not (or no longer) a member."""
        cell = self._cell_of.get(node)
        if cell is not None:
            return self.cells[cell][node].key
        return self.cell_keys.get(node)

    def device_bound(self, cell: str, device: str) -> float | None:
        """The most samples ``device`` of ``cell`` may claim; ``None`` if it is not a member of that cell."""
        entry = self.cells.get(cell, {}).get(device)
        return None if entry is None else entry.max_weight

    def cell_bound(self, cell: str) -> float:
        """The most weight ``cell`` may report: the sum of its devices' bounds (0 for an unknown cell)."""
        return float(sum(e.max_weight for e in self.cells.get(cell, {}).values()))

    def public_keys(self) -> dict[str, bytes]:
        """Every member's public key (cells and devices), e.g. for ``protocols.wire.keys.PublicKeys``."""
        keys = dict(self.cell_keys)
        for devs in self.cells.values():
            keys.update({d: e.key for d, e in devs.items()})
        return keys

    # ------------------------------------------------------------------ changes (each a new version)
    def _next(self, **changes: Any) -> Roster:
        return replace(self, version=self.version + 1, issued_at=time.time(), **changes)

    def with_cell(self, cell: str, key: bytes) -> Roster:
        if cell in self.cells:
            raise RosterError(f"cell {cell!r} is already in the roster")
        if cell in self.revoked:
            raise RosterError(f"{cell!r} was revoked; a revoked id is never reused")
        return self._next(cells={**self.cells, cell: {}}, cell_keys={**self.cell_keys, cell: key})

    def with_device(self, cell: str, device: str, key: bytes, max_weight: float) -> Roster:
        """Add (or re-key) ``device`` in ``cell``."""
        if cell not in self.cells:
            raise RosterError(f"no cell {cell!r} in the roster (cells: {', '.join(sorted(self.cells))})")
        if device in self.revoked:
            raise RosterError(f"{device!r} was revoked; a revoked id is never reused")
        other = self._cell_of.get(device)
        if other is not None and other != cell:
            raise RosterError(f"{device!r} is a member of cell {other!r}")
        devs = {**self.cells[cell], device: DeviceEntry(key, float(max_weight))}
        return self._next(cells={**self.cells, cell: devs})

    def with_key(self, node: str, key: bytes | None = None) -> Roster:
        """The next version with ``node``'s rotated identity: its new public key ``key`` (a cell or a device), or, for a
        node whose key the roster does not hold (the cloud, its signer), the same members (``key`` unused): a new
        version is what every holder of the roster takes."""
        if node in self.cells and key is not None:
            return self._next(cell_keys={**self.cell_keys, node: key})
        cell = self._cell_of.get(node)
        if cell is not None and key is not None:
            return self.with_device(cell, node, key, self.cells[cell][node].max_weight)
        return self._next()

    def without(self, node: str) -> Roster:
        """Revoke ``node`` (a device, or a cell with all its devices): removed and listed as revoked."""
        if node in self.cells:
            gone = {node, *self.cells[node]}
            cells = {c: d for c, d in self.cells.items() if c != node}
            keys = {c: k for c, k in self.cell_keys.items() if c != node}
            where = {**self.revoked_in, **dict.fromkeys(gone, node)}
            return self._next(cells=cells, cell_keys=keys, revoked=self.revoked | gone, revoked_in=where)
        cell = self._cell_of.get(node)
        if cell is None:
            raise RosterError(f"{node!r} is not a member of the roster")
        devs = {d: e for d, e in self.cells[cell].items() if d != node}
        where = {**self.revoked_in, node: cell}
        return self._next(cells={**self.cells, cell: devs}, revoked=self.revoked | {node}, revoked_in=where)

    @classmethod
    def from_topology(
        cls,
        federation: str,
        cells: Mapping[str, Iterable[str]],
        public: Mapping[str, bytes],
        max_weight: float | Mapping[str, float],
    ) -> Roster:
        """Version 1 of a roster: ``cells`` maps each cell to its devices, ``public`` holds every node's key,
        ``max_weight`` is one bound for all devices or a bound per device."""
        missing = [n for c, devs in cells.items() for n in (c, *devs) if n not in public]
        if missing:
            raise RosterError(f"no public key for {', '.join(sorted(missing)[:5])}")

        def bound(device: str) -> float:
            return float(max_weight[device] if isinstance(max_weight, Mapping) else max_weight)

        return cls(
            federation,
            1,
            {c: {d: DeviceEntry(public[d], bound(d)) for d in devs} for c, devs in cells.items()},
            {c: public[c] for c in cells},
            issued_at=time.time(),
        )

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "format": FORMAT,
            "federation": self.federation,
            "version": self.version,
            "issued_at": self.issued_at,
            "cells": {
                c: {
                    "key": self.cell_keys[c].hex(),
                    "devices": {d: [e.key.hex(), e.max_weight] for d, e in devs.items()},
                }
                for c, devs in sorted(self.cells.items())
            },
            "revoked": sorted(self.revoked),
        }
        if self.revoked_in:  # absent when empty: a roster with none signs the same bytes as before it was recorded
            body["revoked_in"] = dict(sorted(self.revoked_in.items()))
        return body

    @classmethod
    def from_dict(cls, data: Any) -> Roster:
        """Parse :meth:`to_dict`'s output; :class:`RosterError` saying what is wrong."""
        try:
            if data.get("format") != FORMAT:
                raise RosterError(f"not a roster of format {FORMAT!r}")
            cells: dict[str, dict[str, DeviceEntry]] = {}
            keys: dict[str, bytes] = {}
            for cell, body in data["cells"].items():
                keys[cell] = bytes.fromhex(body["key"])
                cells[cell] = {d: DeviceEntry(bytes.fromhex(k), float(w)) for d, (k, w) in body["devices"].items()}
            revoked = data.get("revoked", [])
            if not all(isinstance(r, str) for r in revoked):
                raise RosterError("revoked ids must be strings")
            revoked_in = data.get("revoked_in", {})  # absent in a roster signed before it was recorded
            if not isinstance(revoked_in, dict) or not all(isinstance(c, str) for c in revoked_in.values()):
                raise RosterError("revoked_in must map revoked ids to their cells")
            return cls(
                str(data["federation"]),
                data["version"],
                cells,
                keys,
                revoked=frozenset(revoked),
                issued_at=float(data.get("issued_at", 0.0)),
                revoked_in=revoked_in,
            )
        except RosterError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise RosterError(f"malformed roster: {type(exc).__name__}: {exc}") from None


def _canonical(body: dict[str, Any]) -> bytes:
    return ROSTER_DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign_roster(roster: Roster, sign: Signer) -> bytes:
    """The roster as JSON bytes with ``sig``: the cloud's Ed25519 signature over its canonical form."""
    body = roster.to_dict()
    sig = sign(_canonical(body))
    return json.dumps({**body, "sig": sig.hex()}, separators=(",", ":")).encode()


def verify_roster(
    data: bytes,
    verify: Verifier,
    *,
    federation: str | None = None,
    min_version: int = 0,
    signer: str = "cloud",
    max_bytes: int = MAX_ROSTER_BYTES,
) -> Roster:
    """Parse and check a signed roster: size first, then ``signer``'s signature (``verify`` as
    ``PublicKeys.verify``), then the body; with ``federation`` it must be that federation's, and its
    version must be at least ``min_version`` (no rollback to an older membership)."""
    if len(data) > max_bytes:
        raise RosterError(f"roster of {len(data)} bytes exceeds {max_bytes}")
    try:
        doc = loads(data, finite=True)
    except ValueError:
        raise RosterError("roster is not JSON") from None
    if not isinstance(doc, dict):
        raise RosterError("roster is not a JSON object")
    sig = doc.pop("sig", None)
    if not isinstance(sig, str):
        raise RosterError(f"unsigned roster (the signature of {signer!r} is required)")
    try:
        raw_sig = bytes.fromhex(sig)
    except ValueError:
        raise RosterError("roster signature is not hex") from None
    if len(raw_sig) != SIG_BYTES:
        raise RosterError(f"roster signature has {len(raw_sig)} bytes, not {SIG_BYTES}")
    try:
        verify(signer, _canonical(doc), raw_sig)
    except Exception as exc:  # the verifier's own error type (WireError) says why
        raise RosterError(f"roster refused: {exc}") from None
    roster = Roster.from_dict(doc)
    if federation is not None and roster.federation != federation:
        raise RosterError(f"roster of federation {roster.federation!r}, not {federation!r}")
    if roster.version < min_version:
        raise RosterError(f"roster version {roster.version} is older than the version {min_version} already held")
    return roster


def newer_roster(data: bytes, verify: Verifier, federation: str, held: int | None) -> Roster | None:
    """The roster in ``data`` if it verifies (:func:`verify_roster`, ``federation``'s) and is newer than the version
    ``held`` (``None``: none yet); ``None`` for the held version again (a retained roster delivered anew). Raises
    :class:`RosterError` for any other: unsigned, not the cloud's, another federation's, or older (a replay, which
    may still list a revoked node). The one rule of every node and view that follows the signed roster."""
    roster = verify_roster(data, verify, federation=federation, min_version=held or 0)
    return None if roster.version == held else roster
