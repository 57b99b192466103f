"""SecAgg+ (Bell et al. 2020) inside one cell: the cell learns the *sum* of its devices' updates, never one,
even when it lies (the actively secure variant: signed key advertisements and a consistency round).

One edge round, as the cell and device runtimes drive it (``U1 ⊇ U2 ⊇ U3``)::

    cell -> device   device_task       (the model, as without secure aggregation)
    device -> cell   secagg_keys       two fresh X25519 public keys (c: shares, s: masks), its weight bound,
                                       and (signed runs) its Ed25519 signature of the two keys for this round
    cell -> device   secagg_roster     U1 = the devices that advertised, their weight total, the
                                       device's neighbours' public keys and signatures (a sparse graph
                                       seeded from (run seed, round, edge round, cell): degree ~ 10 log2 |U1|)
    device -> cell   secagg_shares     per neighbour: AES-GCM(Shamir share of its self-mask seed b and of
                                       its mask key s_sk), sealed with the pair's c key; a commitment to b
    cell -> device   secagg_routed     U2 = devices whose shares arrived, the ciphertexts addressed to it
    device -> cell   device_result     its update, clipped to ±bound, weighted, quantised to Z_2^32, plus
                                       PRG(b) and ±PRG(s_ij) for every neighbour j in U2
    cell -> device   secagg_unmask     U3 = the survivors (masked results accepted), D = U2 - U3 (dropped)
    device -> cell   secagg_consent    the digest of its view (U1, U3, D), signed (the consistency round)
    cell -> device   secagg_views      its neighbours' signed digests
    device -> cell   secagg_reveal     shares of b_j for its neighbours in U3, of s_sk_j for those in D

The cell adds the masked vectors; pairwise masks between survivors cancel; it removes the survivors'
self-masks (b_j from t shares, checked against the commitment) and the dropped devices' pairwise masks
(s_sk_j from t shares, checked against the advertised public key). What is left is
``sum_{i in U3} round(w_i * clip(x_i) * scale) mod 2^32``, exactly the plain sum of the quantised updates.
Fewer than ``t`` shares for any secret -> :class:`SecAggFailure` (the round is lost).

Against a cell that lies (it holds valid credentials, but no device's): a device verifies every
neighbour's key advertisement against that neighbour's Ed25519 identity (the keys provisioned by the
cloud), so a cell cannot substitute its own keys and open the shares; a device reveals only after at
least ``t`` of its neighbours signed the very view it got, and refuses (logged, counted) when a neighbour
signed another one: a cell that tells some devices "j survived" and others "j dropped" gets nothing; and
``t`` exceeds half the neighbourhood by default, so two disjoint halves can never both reach ``t``. A
device reveals once per edge round, for disjoint U3 / D. Unsigned runs (no ``[security] keys``) skip the
signatures: secure against a cell that follows the protocol only (the views are still compared).

Secrets (keys, self-mask seeds, Shamir coefficients, nonces) come from the OS's cryptographic source,
never from the run seed; the graph and the quantisation are public and deterministic, so the unmasked
sum (and the model) is the same in ``fedtier sim`` and ``fedtier run``.

Pure code: no sockets, no clocks. The roles here are driven by ``cell_server`` and ``edge_agent``.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NoReturn, Protocol

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..algorithms.base import TrainParams
from ..algorithms.compose import needs
from ..algorithms.traits import Trait
from ..rejections import Rejected, RejectKind
from ..seeding import rng
from ..wire.payload import Payload
from . import shamir

KEY_BYTES = 32
NONCE_BYTES = 12
SEALED_BYTES = NONCE_BYTES + 2 * shamir.SHARE_BYTES + 16  # nonce | share of b | share of s_sk | GCM tag
QUANT_MAX = 2**31 - 1  # |sum of quantised values| stays below this: no wrap-around in Z_2^32
SIG_BYTES = 64  # Ed25519
KINDS = (
    "secagg_keys",
    "secagg_roster",
    "secagg_shares",
    "secagg_routed",
    "secagg_unmask",
    "secagg_consent",
    "secagg_views",
    "secagg_reveal",
)


class Identity(Protocol):
    """A node's signing identity and its peers' public keys (``protocols.wire.keys.Trust``)."""

    node: str

    def sign(self, data: bytes) -> bytes: ...

    def verify(self, signer: str, data: bytes, sig: bytes) -> None:
        """Raise (any exception) unless ``sig`` is ``signer``'s signature of ``data``."""


class SecAggFailure(RuntimeError):
    """The round cannot be unmasked (too few devices or shares); the cell reports nothing for it."""


class Phase(StrEnum):
    """The steps of one secure aggregation at the cell, in order (``failed``: given up, nothing unmasked)."""

    KEYS = "keys"
    SHARES = "shares"
    MASKED = "masked"
    CONSENT = "consent"
    REVEAL = "reveal"
    DONE = "done"
    FAILED = "failed"


class CellLied(Rejected):
    """A device caught its cell lying (a substituted key, views that disagree): it sits the round out.
    Its kind is always ``inconsistent``."""

    def __init__(self, reason: str) -> None:
        super().__init__(RejectKind.INCONSISTENT, reason)

    def __reduce__(self) -> tuple[type[CellLied], tuple[str]]:  # type: ignore[override]  # one argument, no kind
        return type(self), (str(self),)


@dataclass(frozen=True)
class SecAggSettings:
    """What both sides derive from the run's config (``[privacy]``): nothing here comes over the wire."""

    seed: int
    threshold: float = 0.5  # t = floor(threshold * degree) + 1 shares reconstruct a secret (> half: see module)
    neighbours: int = 0  # degree of the graph; 0: default_degree (survives 30% dropping; capped at n - 1)
    bound: float = 1.0  # every update value is clipped to [-bound, bound] before quantisation
    min_survivors: int = 0  # no sum of fewer survivors is unmasked (cell DP: each adds 1/min_survivors of the noise)

    def degree(self, n: int) -> int:
        """Neighbours per device among ``n`` devices: ``neighbours``, or by default the smallest even degree
        from 4 log2 n up at which a round with 30% of the devices dropping after sharing fails with
        probability at most 1% (:func:`default_degree`)."""
        if n <= 1:
            return 0
        k = self.neighbours or default_degree(n, self.threshold)
        return min(k + k % 2, n - 1)  # even below n - 1: the ring graph is then symmetric

    def t(self, n: int) -> int:
        """Shares needed to reconstruct a secret of a device among ``n``: more than half its neighbours by
        default (``t > degree / 2``: no two disjoint groups of neighbours both reach it)."""
        k = self.degree(n)
        return min(k, max(2, math.floor(self.threshold * k) + 1)) if k > 1 else 1  # never one share alone

    def survivors_needed(self, n: int) -> int:
        """The fewest survivors whose sum may be unmasked among ``n``: the threshold, or ``min_survivors``."""
        return max(self.t(n), self.min_survivors)


DESIGN_DROPOUT = 0.3  # the default degree survives this fraction of a cell dropping after sharing ...
DESIGN_FAILURE = 0.01  # ... but with this probability (a union bound over the devices)


@functools.lru_cache(maxsize=256)
def default_degree(n: int, threshold: float) -> int:
    """The smallest even k >= 4 log2 n (at most n - 1) such that ``n`` times the chance that a device keeps
    fewer than t = floor(threshold k) + 1 of its k neighbours, each dropping with probability
    ``DESIGN_DROPOUT``, is at most ``DESIGN_FAILURE``: a secret of one of them would then be lost. With
    t > k/2 (the default, against a lying cell) this needs k of about 9-12 log2 n, against 4 log2 n at
    t = k/3."""
    k = 2 * math.ceil(2 * math.log2(n))
    while k < n - 1:
        t = max(2, math.floor(threshold * k) + 1)
        keep = 1 - DESIGN_DROPOUT
        lost = sum(math.comb(k, i) * keep**i * DESIGN_DROPOUT ** (k - i) for i in range(min(t, k + 1)))
        if n * lost <= DESIGN_FAILURE:
            break
        k += 2
    return min(k, n - 1)


@dataclass(frozen=True)
class RoundId:
    """Which aggregation: every key, ciphertext and commitment is bound to it (no replay across rounds)."""

    run: str
    cell: str
    round: int
    edge_round: int

    def label(self, *parts: str) -> bytes:
        return "/".join(["fedtier-secagg", self.run, self.cell, str(self.round), str(self.edge_round), *parts]).encode()


def refusal(params: TrainParams) -> str | None:
    """Why secure aggregation cannot run with these algorithm parameters (``None``: it can). The cell
    only ever sees the sum, so the stack must aggregate a cell's devices by a (weighted) sum of dense
    updates (``Trait.CELL_SUM``)."""
    why = needs(params, Trait.CELL_SUM)
    return None if why is None else f"the cell would see only the sum of its devices' updates; {why}"


# ---------------------------------------------------------------------------------------------- graph
def neighbour_graph(devices: Sequence[str], settings: SecAggSettings, rid: RoundId) -> dict[str, list[str]]:
    """A Harary-style graph over ``devices``: in a seeded ring order, each device is joined to its
    ``degree / 2`` successors and predecessors (all others when the degree is n - 1). Public and
    deterministic: every device checks the cell's roster against it."""
    ring = sorted(devices)
    n, k = len(ring), settings.degree(len(ring))
    if k >= n - 1:
        return {d: [e for e in ring if e != d] for d in ring}
    order = [ring[i] for i in rng(settings.seed, rid.round, rid.edge_round, rid.cell, "secagg graph").permutation(n)]
    at = {d: i for i, d in enumerate(order)}
    half = k // 2
    out = {}
    for d in ring:
        i = at[d]
        near = {order[(i + s) % n] for s in range(1, half + 1)} | {order[(i - s) % n] for s in range(1, half + 1)}
        out[d] = sorted(near)
    return out


# ---------------------------------------------------------------------------------------------- crypto
def _kdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(secret)


def _public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _private(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def _agree(private: bytes | X25519PrivateKey, public: bytes, info: bytes) -> bytes:
    key = private if isinstance(private, X25519PrivateKey) else X25519PrivateKey.from_private_bytes(private)
    return _kdf(key.exchange(X25519PublicKey.from_public_bytes(public)), info)


@functools.lru_cache(maxsize=2)
def _zeros(nbytes: int) -> bytes:
    return bytes(nbytes)


def prg(key: bytes, n: int) -> np.ndarray:
    """``n`` pseudo-random uint32 (ChaCha20 keystream of ``key``, little-endian)."""
    stream = Cipher(algorithms.ChaCha20(key, b"\0" * 16), mode=None).encryptor().update(_zeros(4 * n))
    return np.frombuffer(stream, dtype="<u4")  # read-only; little-endian as on every supported host


def pair_sign(me: str, other: str) -> int:
    """The lower id of a pair adds the pairwise mask, the higher subtracts it."""
    return 1 if me < other else -1


def pair_mask(private: bytes | X25519PrivateKey, public: bytes, rid: RoundId, n: int) -> np.ndarray:
    return prg(_agree(private, public, rid.label("pair mask")), n)


def self_mask(b: bytes, rid: RoundId, n: int) -> np.ndarray:
    return prg(_kdf(b, rid.label("self mask")), n)


def commitment(b: bytes, device: str, rid: RoundId) -> str:
    return hashlib.sha256(rid.label("commit", device) + b).hexdigest()


def advert_bytes(device: str, c_pk: bytes, s_pk: bytes, rid: RoundId) -> bytes:
    """What a device signs when it advertises its keys: both keys, bound to itself and the round."""
    return rid.label("keys", device) + c_pk + s_pk


def view_digest(roster: Sequence[str], survivors: Sequence[str], dropped: Sequence[str], rid: RoundId) -> bytes:
    """The digest of what a cell told a device about one round (U1, U3, D): equal views, equal digests."""
    h = hashlib.sha256(rid.label("view"))
    for part in (roster, survivors, dropped):
        h.update(b"\x1e" + "\x1f".join(sorted(part)).encode())
    return h.digest()


def view_bytes(device: str, digest: bytes, rid: RoundId) -> bytes:
    """What a device signs in the consistency round: the digest of its view, bound to itself and the round."""
    return rid.label("consent", device) + digest


@dataclass(frozen=True)
class RosterIdentity:
    """A device's :class:`Identity` whose neighbours' keys come from the federation's roster, signed by the
    cloud (``protocols.roster``): a neighbour must be a current member of the same cell. ``signer``: the
    device's own identity (``protocols.wire.keys.Trust``)."""

    signer: Any
    roster: Any  # protocols.roster.Roster, verified (verify_roster)

    @property
    def node(self) -> str:
        return str(self.signer.node)

    def sign(self, data: bytes) -> bytes:
        return bytes(self.signer.sign(data))

    def verify(self, signer: str, data: bytes, sig: bytes) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        key = self.roster.device_key(signer)
        if key is None or self.roster.cell_of(signer) != self.roster.cell_of(self.node):
            raise ValueError(f"{signer!r} is not a member of this device's cell in roster v{self.roster.version}")
        Ed25519PublicKey.from_public_bytes(key).verify(sig, data)  # InvalidSignature if not


def _signed_by(identity: Identity, signer: str, data: bytes, sig: bytes) -> bool:
    try:
        identity.verify(signer, data, sig)
    except Exception:  # a wire error, an unknown signer, a malformed key: not signed by ``signer``
        return False
    return True


# ---------------------------------------------------------------------------------------------- quantisation
def scale_for(settings: SecAggSettings, total_weight: float) -> float:
    """Fixed-point scale: the weighted sum of ``total_weight`` samples' clipped values fits in ±QUANT_MAX."""
    return QUANT_MAX / (settings.bound * total_weight)


def quantize(values: np.ndarray, weight: float, settings: SecAggSettings, total_weight: float) -> np.ndarray:
    """``round(weight * clip(values) * scale) mod 2^32`` as uint32."""
    v = np.clip(values.astype(np.float64), -settings.bound, settings.bound) * (
        weight * scale_for(settings, total_weight)
    )
    return (np.rint(v).astype(np.int64) & 0xFFFFFFFF).astype(np.uint32)


def dequantize(total: np.ndarray, settings: SecAggSettings, total_weight: float) -> np.ndarray:
    """The weighted sum (float64) from a sum of :func:`quantize` outputs mod 2^32."""
    return total.astype(np.uint32).view(np.int32).astype(np.float64) / scale_for(settings, total_weight)


Layout = list[tuple[str, tuple[int, ...]]]


def flatten(tensors: Mapping[str, np.ndarray]) -> tuple[np.ndarray, Layout]:
    """One float64 vector of the tensors, in their order, and the layout that undoes it."""
    names = list(tensors)
    layout = [(n, tuple(int(s) for s in np.shape(tensors[n]))) for n in names]
    flat = np.concatenate([np.ravel(tensors[n]).astype(np.float64) for n in names]) if names else np.zeros(0)
    return flat, layout


def unflatten(flat: np.ndarray, layout: Layout, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    out, at = {}, 0
    for name, shape in layout:
        size = math.prod(shape)
        out[name] = flat[at : at + size].reshape(shape).astype(dtype)
        at += size
    return out


def _layout_of(meta: Any) -> Layout:
    """A layout from JSON (``[[name, [dims]], ...]``), validated."""
    if not isinstance(meta, list) or not meta or len(meta) > 4096:
        raise Rejected(RejectKind.MALFORMED, "secure aggregation: missing or bad layout")
    out = []
    for item in meta:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], list)
            or len(item[1]) > 8
            or not all(isinstance(s, int) and 0 <= s < 2**31 for s in item[1])
        ):
            raise Rejected(RejectKind.MALFORMED, "secure aggregation: bad layout entry")
        out.append((item[0], tuple(item[1])))
    return out


def _device_list(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(d, str) for d in value) or len(set(value)) != len(value):
        raise Rejected(RejectKind.MALFORMED, f"secure aggregation: {what} is not a list of distinct device ids")
    return sorted(value)


def _bytes(payload: Payload, name: str, size: int, what: str) -> bytes:
    arr = payload.tensors.get(name)
    if arr is None or arr.dtype != np.uint8 or arr.shape != (size,):
        raise Rejected(RejectKind.MALFORMED, f"secure aggregation: {what} needs {name!r} as {size} bytes")
    return arr.tobytes()


def _u8(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).copy()


# ---------------------------------------------------------------------------------------------- device
@dataclass
class SecAggDevice:
    """One device's side of one aggregation. Each method answers one cell message; a message it cannot
    use raises :class:`Rejected` (the runtime logs it and the device sits the round out). ``identity``
    (signed runs): signs this device's advertisement and view, verifies its neighbours' (a lying cell
    is refused with :class:`CellLied`)."""

    settings: SecAggSettings
    rid: RoundId
    device: str
    weight_bound: float
    identity: Identity | None = None
    _c: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate, repr=False)
    _s: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate, repr=False)
    _b: bytes = field(default_factory=lambda: os.urandom(KEY_BYTES), repr=False)
    roster: list[str] = field(default_factory=list)
    neighbours: list[str] = field(default_factory=list)
    total_weight: float = 0.0
    _peer_c: dict[str, bytes] = field(default_factory=dict, repr=False)
    _peer_s: dict[str, bytes] = field(default_factory=dict, repr=False)
    _held: dict[str, tuple[bytes, bytes]] = field(default_factory=dict, repr=False)  # from j: (b share, s_sk share)
    shared: list[str] = field(default_factory=list)  # U2 as the cell announced it
    view: tuple[list[str], list[str], bytes] | None = None  # (U3, D, digest) as the cell announced them
    revealed: bool = False

    def advertise(self) -> Payload:
        """``secagg_keys``: the two public keys, the largest weight this device's update will carry and,
        with an identity, its signature of the keys."""
        c, s = _public(self._c), _public(self._s)
        tensors = {"c": _u8(c), "s": _u8(s)}
        if self.identity is not None:
            tensors["g"] = _u8(self.identity.sign(advert_bytes(self.device, c, s, self.rid)))
        return Payload({"weight": self.weight_bound}, tensors)

    def share(self, roster: Payload) -> Payload:
        """``secagg_shares`` from ``secagg_roster``: Shamir shares of b and s_sk, sealed per neighbour."""
        if self.roster:
            raise Rejected(RejectKind.REPLAY, "secure aggregation: a second roster for this round")
        devices = _device_list(roster.meta.get("devices"), "roster")
        total = roster.meta.get("total_weight")
        if self.device not in devices:
            raise Rejected(RejectKind.UNKNOWN_SENDER, "secure aggregation: this device is not in the roster")
        if not isinstance(total, (int, float)) or not math.isfinite(total) or total < self.weight_bound:
            raise Rejected(RejectKind.BOUND, f"secure aggregation: total weight {total!r} below this device's")
        graph = neighbour_graph(devices, self.settings, self.rid)
        near = graph[self.device]
        expected = {f"{p}/{j}" for j in near for p in ("c", "s")}
        signatures = {f"g/{j}" for j in near}
        if not expected <= set(roster.tensors) <= expected | signatures:
            raise Rejected(
                RejectKind.INCONSISTENT,
                "secure aggregation: the roster's keys are not those of this device's neighbours",
            )
        for j in near:
            self._peer_c[j] = _bytes(roster, f"c/{j}", KEY_BYTES, "roster")
            self._peer_s[j] = _bytes(roster, f"s/{j}", KEY_BYTES, "roster")
        if self.identity is not None:
            for j in near:
                sig = roster.tensors.get(f"g/{j}")
                data = advert_bytes(j, self._peer_c[j], self._peer_s[j], self.rid)
                if sig is None or sig.dtype != np.uint8 or not _signed_by(self.identity, j, data, sig.tobytes()):
                    self._peer_c.clear()
                    self._peer_s.clear()
                    raise CellLied(
                        f"the keys the cell gave for neighbour {j} are not signed by {j} (substituted, or {j} is "
                        "not a member of this cell)"
                    )
        self.roster, self.neighbours, self.total_weight = devices, near, float(total)
        t = self.settings.t(len(devices))
        points = [devices.index(j) + 1 for j in near]  # x of j's share: its position in U1, + 1
        b_shares = shamir.split(self._b, points, t) if near else []
        s_shares = shamir.split(_private(self._s), points, t) if near else []
        sealed = {}
        for j, x, (_, bs), (_, ss) in zip(near, points, b_shares, s_shares, strict=True):
            key = _agree(self._c, self._peer_c[j], self.rid.label("seal"))
            nonce = os.urandom(NONCE_BYTES)
            sealed[f"e/{j}"] = _u8(nonce + AESGCM(key).encrypt(nonce, bs + ss, self.rid.label(self.device, j, str(x))))
        return Payload({"commit": commitment(self._b, self.device, self.rid)}, sealed)

    def receive(self, routed: Payload) -> int:
        """``secagg_routed``: U2 and the shares neighbours sealed for this device; returns how many opened.
        A share that does not open (tampered, replayed from another round) is dropped: this device
        then cannot help recover that neighbour, which costs at most that neighbour's recovery."""
        if not self.roster:
            raise Rejected(RejectKind.OUT_OF_ORDER, "secure aggregation: shares routed before the roster")
        if self.shared:
            raise Rejected(RejectKind.REPLAY, "secure aggregation: shares routed twice this round")
        shared = _device_list(routed.meta.get("shared"), "shared")
        if self.device not in shared or not set(shared) <= set(self.roster):
            raise Rejected(RejectKind.INCONSISTENT, "secure aggregation: the routed set does not fit the roster")
        x = self.roster.index(self.device) + 1
        for j in self.neighbours:
            arr = routed.tensors.get(f"e/{j}")
            if j not in shared or arr is None or arr.dtype != np.uint8 or arr.shape != (SEALED_BYTES,):
                continue
            blob = arr.tobytes()
            key = _agree(self._c, self._peer_c[j], self.rid.label("seal"))
            try:
                plain = AESGCM(key).decrypt(
                    blob[:NONCE_BYTES], blob[NONCE_BYTES:], self.rid.label(j, self.device, str(x))
                )
            except InvalidTag:
                continue
            self._held[j] = (plain[: shamir.SHARE_BYTES], plain[shamir.SHARE_BYTES :])
        self.shared = shared
        return len(self._held)

    def mask(self, result: Payload) -> Payload:
        """The masked ``device_result`` for a dense result (tensors, ``weight``): one uint32 vector."""
        if not self.shared:
            raise Rejected(RejectKind.OUT_OF_ORDER, "secure aggregation: masking before the shares were routed")
        weight = result.meta.get("weight")
        if not isinstance(weight, (int, float)) or not 0 < weight <= self.weight_bound:
            raise Rejected(
                RejectKind.BOUND, f"secure aggregation: weight {weight!r} outside (0, {self.weight_bound:g}]"
            )
        flat, layout = flatten(result.tensors)
        if not np.isfinite(flat).all():
            raise Rejected(RejectKind.NON_FINITE, "secure aggregation: the update has non-finite values (not sent)")
        masked = quantize(flat, float(weight), self.settings, self.total_weight)
        n = masked.size
        masked += self_mask(self._b, self.rid, n)
        for j in self.neighbours:
            if j in self.shared:
                pm = pair_mask(self._s, self._peer_s[j], self.rid, n)
                masked += pm if pair_sign(self.device, j) > 0 else -pm  # uint32: wraps mod 2^32
        meta = {k: v for k, v in result.meta.items() if k in ("weight", "loss", "steps")}
        meta["layout"] = [[name, list(shape)] for name, shape in layout]
        return Payload(meta, {"masked": masked})

    def consent(self, request: Payload) -> Payload:
        """``secagg_consent`` for ``secagg_unmask``: the digest of this device's view of the round (U1, U3,
        D), signed with its identity; nothing is revealed before its neighbours confirmed the same view."""
        if self.view is not None:
            raise Rejected(RejectKind.REPLAY, "secure aggregation: a second unmask request this round (refused)")
        survivors = _device_list(request.meta.get("survivors"), "survivors")
        dropped = _device_list(request.meta.get("dropped"), "dropped")
        if set(survivors) & set(dropped) or not set(survivors) | set(dropped) <= set(self.shared):
            raise CellLied("secure aggregation: survivors and dropped overlap or leave the shared set")
        if self.device not in survivors:
            raise Rejected(RejectKind.NOT_PLANNED, "secure aggregation: unmask request that does not count this device")
        if len(survivors) < self.settings.survivors_needed(len(self.roster)):
            raise Rejected(RejectKind.INCONSISTENT, "secure aggregation: fewer survivors than the threshold")
        digest = view_digest(self.roster, survivors, dropped, self.rid)
        self.view = (survivors, dropped, digest)
        tensors = (
            {} if self.identity is None else {"g": _u8(self.identity.sign(view_bytes(self.device, digest, self.rid)))}
        )
        return Payload({"view": digest.hex()}, tensors)

    def reveal(self, views: Payload) -> Payload:
        """``secagg_reveal`` for ``secagg_views``: once at least ``t`` neighbours signed this device's very view,
        the b shares of its surviving neighbours and the s_sk shares of its dropped ones. A neighbour's view
        that differs, or a signature that is not its own, means the cell told devices different things: the
        device refuses (:class:`CellLied`) and reveals nothing this round."""
        if self.view is None:
            raise Rejected(RejectKind.OUT_OF_ORDER, "secure aggregation: views before the unmask request")
        if self.revealed:
            raise Rejected(RejectKind.REPLAY, "secure aggregation: a second views message this round (refused)")
        self.revealed = True  # one answer per round, whatever it is
        survivors, dropped, digest = self.view
        seen = views.meta.get("views")
        near = set(self.neighbours) & set(survivors)
        if not isinstance(seen, dict) or not all(isinstance(j, str) and isinstance(v, str) for j, v in seen.items()):
            raise Rejected(RejectKind.MALFORMED, "secure aggregation: views is not a map of device ids to digests")
        if not set(seen) <= near or not set(views.tensors) <= {f"g/{j}" for j in seen}:
            raise CellLied(
                "secure aggregation: views of devices that are not surviving neighbours in this device's view "
                "(the cell reported devices inconsistently); no shares revealed"
            )
        for j, other in sorted(seen.items()):
            if other != digest.hex():
                raise CellLied(
                    f"secure aggregation: neighbour {j} was told another view of this round (survivors, dropped "
                    "or roster): the cell reported devices inconsistently; no shares revealed"
                )
            if self.identity is not None:
                sig = views.tensors.get(f"g/{j}")
                data = view_bytes(j, digest, self.rid)
                if sig is None or sig.dtype != np.uint8 or not _signed_by(self.identity, j, data, sig.tobytes()):
                    raise CellLied(f"secure aggregation: the view of neighbour {j} is not signed by {j}")
        t = self.settings.t(len(self.roster))
        if len(seen) < t:
            raise Rejected(
                RejectKind.INCONSISTENT,
                f"secure aggregation: {len(seen)} neighbours confirmed this view, fewer than the threshold {t}",
            )
        out: dict[str, np.ndarray] = {}
        for j, (bs, ss) in self._held.items():
            if j in survivors:
                out[f"b/{j}"] = _u8(bs)
            elif j in dropped:
                out[f"s/{j}"] = _u8(ss)
        return Payload({}, out)


# ---------------------------------------------------------------------------------------------- cell
@dataclass
class Unmasked:
    """The outcome of an aggregation: the weighted sum of the survivors' clipped updates."""

    weighted_sum: dict[str, np.ndarray]  # sum_i w_i * clip(x_i), float32, by tensor
    quantised_sum: np.ndarray  # the unmasked uint32 vector: sum_i quantize(x_i) mod 2^32
    weights: dict[str, float]  # survivor -> weight
    dropped: list[str]  # shared their secrets, then no (valid) masked result: their masks were removed
    stats: dict[str, int]


class SecAggCell:
    """A cell's side of one aggregation: checks each device message, builds the next phase's messages,
    unmasks the sum. ``planned``: the devices sent a task; ``weight_bound(d)``: the largest weight the
    cell accepts from ``d`` (None: any). Raises :class:`Rejected` for a message it refuses and
    :class:`SecAggFailure` when the round cannot be completed."""

    def __init__(
        self, settings: SecAggSettings, rid: RoundId, planned: Sequence[str], weight_bound: Any = None
    ) -> None:
        self.settings, self.rid, self.planned = settings, rid, set(planned)
        self.weight_bound = weight_bound or (lambda d: None)
        self.phase: Phase = Phase.KEYS
        self.keys: dict[str, tuple[bytes, bytes, float]] = {}  # U1: c_pk, s_pk, weight bound
        self.signatures: dict[str, bytes] = {}  # device -> its signature of its keys (signed runs)
        self.roster: list[str] = []
        self.graph: dict[str, list[str]] = {}
        self.sealed: dict[str, Payload] = {}  # U2: device -> its sealed shares
        self.commits: dict[str, str] = {}
        self.masked: dict[str, Payload] = {}
        self.shared: list[str] = []
        self.survivors: list[str] = []
        self.dropped: list[str] = []
        self.consents: dict[str, Payload] = {}  # survivor -> its (signed) view digest
        self.reveals: dict[str, Payload] = {}
        self.total_weight = 0.0

    def _expect(self, phase: Phase, device: str) -> None:
        if device not in self.planned:
            raise Rejected(RejectKind.NOT_PLANNED, f"secure aggregation: {device} was not planned for this round")
        if self.phase != phase:
            raise Rejected(
                RejectKind.OUT_OF_ORDER, f"secure aggregation: a {phase} message during the {self.phase} phase"
            )

    def add_keys(self, device: str, payload: Payload) -> None:
        self._expect(Phase.KEYS, device)
        if device in self.keys:
            raise Rejected(RejectKind.REPLAY, "secure aggregation: keys sent twice")
        c, s = _bytes(payload, "c", KEY_BYTES, "keys"), _bytes(payload, "s", KEY_BYTES, "keys")
        if not set(payload.tensors) <= {"c", "s", "g"}:
            raise Rejected(RejectKind.MALFORMED, "secure aggregation: keys with unknown parts")
        if "g" in payload.tensors:  # its signature of the keys: forwarded, each neighbour checks it
            self.signatures[device] = _bytes(payload, "g", SIG_BYTES, "keys")
        w = payload.meta.get("weight")
        bound = self.weight_bound(device)
        if not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0 or (bound is not None and w > bound):
            raise Rejected(RejectKind.BOUND, f"secure aggregation: weight {w!r} refused (bound {bound})")
        self.keys[device] = (c, s, float(w))

    @property
    def keys_complete(self) -> bool:
        return self.phase == Phase.KEYS and set(self.keys) == self.planned

    def rosters(self) -> dict[str, Payload]:
        """Close the key phase: each advertising device's ``secagg_roster``."""
        self.phase = Phase.SHARES
        self.roster = sorted(self.keys)
        if len(self.roster) < max(2, self.settings.t(len(self.roster))):
            self._fail(f"{len(self.roster)} devices sent keys, too few to hide one update")
        self.graph = neighbour_graph(self.roster, self.settings, self.rid)
        self.total_weight = sum(w for _, _, w in self.keys.values())
        meta = {"devices": self.roster, "total_weight": self.total_weight}
        out = {}
        for d, near in self.graph.items():
            tensors = {
                f"{p}/{j}": _u8(key) for j in near for key, p in ((self.keys[j][0], "c"), (self.keys[j][1], "s"))
            }
            tensors.update({f"g/{j}": _u8(self.signatures[j]) for j in near if j in self.signatures})
            out[d] = Payload(meta, tensors)
        return out

    def add_shares(self, device: str, payload: Payload) -> None:
        self._expect(Phase.SHARES, device)
        if device not in self.graph:
            raise Rejected(RejectKind.UNKNOWN_SENDER, "secure aggregation: shares from a device not in the roster")
        if device in self.sealed:
            raise Rejected(RejectKind.REPLAY, "secure aggregation: shares sent twice")
        if set(payload.tensors) != {f"e/{j}" for j in self.graph[device]}:
            raise Rejected(RejectKind.INCONSISTENT, "secure aggregation: shares are not one per neighbour")
        for j in self.graph[device]:
            _bytes(payload, f"e/{j}", SEALED_BYTES, "shares")
        commit = payload.meta.get("commit")
        if not isinstance(commit, str) or len(commit) != 64:
            raise Rejected(RejectKind.MALFORMED, "secure aggregation: missing commitment")
        self.sealed[device], self.commits[device] = payload, commit

    @property
    def shares_complete(self) -> bool:
        return self.phase == Phase.SHARES and set(self.sealed) == set(self.roster)

    def routes(self) -> dict[str, Payload]:
        """Close the share phase: each sharing device's ``secagg_routed`` (the ciphertexts sealed for it)."""
        self.phase = Phase.MASKED
        self.shared = sorted(self.sealed)
        if len(self.shared) < max(2, self.settings.t(len(self.roster))):
            self._fail(
                f"{len(self.shared)} devices shared their secrets, fewer than the threshold "
                f"{self.settings.t(len(self.roster))}"
            )
        meta = {"shared": self.shared}
        return {
            d: Payload(meta, {f"e/{j}": self.sealed[j].tensors[f"e/{d}"] for j in self.graph[d] if j in self.sealed})
            for d in self.shared
        }

    def check_masked(self, device: str, payload: Payload) -> Layout:
        """Refuse a masked result that cannot be summed; its layout otherwise."""
        self._expect(Phase.MASKED, device)
        if device not in self.sealed:
            raise Rejected(
                RejectKind.NOT_PLANNED, "secure aggregation: a result from a device whose shares did not arrive"
            )
        layout = _layout_of(payload.meta.get("layout"))
        arr = payload.tensors.get("masked")
        size = sum(math.prod(s) for _, s in layout)
        if set(payload.tensors) != {"masked"} or arr is None or arr.dtype != np.uint32 or arr.shape != (size,):
            raise Rejected(RejectKind.SHAPE, "secure aggregation: the masked vector does not match its layout")
        w = payload.meta.get("weight")
        if not isinstance(w, (int, float)) or not 0 < w <= self.keys[device][2]:
            raise Rejected(
                RejectKind.BOUND, f"secure aggregation: weight {w!r} above the {self.keys[device][2]:g} advertised"
            )
        for other in self.masked.values():
            if other.meta["layout"] != payload.meta["layout"]:
                raise Rejected(RejectKind.INCONSISTENT, "secure aggregation: a layout unlike the other devices'")
        return layout

    def add_masked(self, device: str, payload: Payload) -> None:
        self.check_masked(device, payload)
        self.masked[device] = payload

    def unmask_requests(self) -> dict[str, Payload]:
        """Close the result phase: each survivor's ``secagg_unmask``."""
        self.phase = Phase.CONSENT
        self.survivors = sorted(self.masked)
        self.dropped = sorted(set(self.shared) - set(self.masked))
        t = self.settings.survivors_needed(len(self.roster))
        if len(self.survivors) < t or not self.survivors:
            self._fail(f"{len(self.survivors)} survivors, fewer than the threshold {t}")
        meta = {"survivors": self.survivors, "dropped": self.dropped}
        return {d: Payload(meta, {}) for d in self.survivors}

    def add_consent(self, device: str, payload: Payload) -> None:
        """A survivor's ``secagg_consent``: the (signed) digest of the view it was sent."""
        self._expect(Phase.CONSENT, device)
        if device not in self.masked:
            raise Rejected(RejectKind.NOT_PLANNED, "secure aggregation: a consent from a device that is not a survivor")
        if device in self.consents:
            raise Rejected(RejectKind.REPLAY, "secure aggregation: consent sent twice")
        view = payload.meta.get("view")
        if not isinstance(view, str) or len(view) != 64 or not set(payload.tensors) <= {"g"}:
            raise Rejected(RejectKind.MALFORMED, "secure aggregation: a consent without its view digest")
        if "g" in payload.tensors:
            _bytes(payload, "g", SIG_BYTES, "consent")
        self.consents[device] = payload

    @property
    def consents_complete(self) -> bool:
        return self.phase == Phase.CONSENT and set(self.consents) == set(self.survivors)

    def views(self) -> dict[str, Payload]:
        """Close the consistency round: each consenting survivor's ``secagg_views`` (its surviving
        neighbours' signed digests, as they sent them)."""
        self.phase = Phase.REVEAL
        out = {}
        for d in sorted(self.consents):
            near = [j for j in self.graph[d] if j in self.consents]
            sigs = {f"g/{j}": self.consents[j].tensors["g"] for j in near if "g" in self.consents[j].tensors}
            out[d] = Payload({"views": {j: self.consents[j].meta["view"] for j in near}}, sigs)
        return out

    def add_reveal(self, device: str, payload: Payload) -> None:
        self._expect(Phase.REVEAL, device)
        if device not in self.consents:
            raise Rejected(
                RejectKind.OUT_OF_ORDER, "secure aggregation: a reveal from a device that was not sent the views"
            )
        if device in self.reveals:
            raise Rejected(RejectKind.REPLAY, "secure aggregation: reveal sent twice")
        near = set(self.graph[device])
        allowed = {f"b/{j}" for j in self.survivors if j in near} | {f"s/{j}" for j in self.dropped if j in near}
        if not set(payload.tensors) <= allowed:
            raise Rejected(RejectKind.INCONSISTENT, "secure aggregation: a reveal with shares it should not hold")
        for name in payload.tensors:
            _bytes(payload, name, shamir.SHARE_BYTES, "reveal")
        self.reveals[device] = payload

    @property
    def reveals_complete(self) -> bool:
        return self.phase == Phase.REVEAL and set(self.reveals) == set(self.consents)

    def _shares_of(self, prefix: str, j: str) -> list[shamir.Share]:
        name = f"{prefix}/{j}"
        return [(self._x[r], p.tensors[name].tobytes()) for r, p in self.reveals.items() if name in p.tensors]

    def _recover(self, prefix: str, j: str, length: int, valid: Any) -> bytes:
        """A secret of ``j`` from t of the revealed shares, checked by ``valid``; another t of them
        when a share is wrong (tolerates one bad share among t + 1)."""
        shares, t = sorted(self._shares_of(prefix, j)), self.settings.t(len(self.roster))
        if len(shares) < t:
            self._fail(f"{len(shares)} shares to recover {j}, fewer than the threshold {t}")
        for subset in [shares[:t]] + [(shares[:i] + shares[i + 1 :])[:t] for i in range(min(t, len(shares) - t))]:
            try:
                secret = shamir.combine(subset, length)
            except shamir.ShareError:
                continue
            if valid(secret):
                return secret
        self._fail(f"the shares revealed for {j} do not reconstruct its secret")
        raise AssertionError  # unreachable

    def finish(self) -> Unmasked:
        """Unmask the sum of the survivors' quantised updates."""
        self.phase = Phase.DONE
        self._x = {d: i + 1 for i, d in enumerate(self.roster)}  # a device's share point
        layout = _layout_of(self.masked[self.survivors[0]].meta["layout"])
        n = sum(math.prod(s) for _, s in layout)
        total = np.zeros(n, dtype=np.uint32)
        for d in self.survivors:
            total += self.masked[d].tensors["masked"]
        for d in self.survivors:
            b = self._recover("b", d, KEY_BYTES, lambda s, d=d: commitment(s, d, self.rid) == self.commits[d])
            total -= self_mask(b, self.rid, n)
        added = np.zeros(n, dtype=np.uint32)  # the dropped devices' pairwise masks the survivors added ...
        taken = np.zeros(n, dtype=np.uint32)  # ... and subtracted
        for j in self.dropped:
            s_pub = self.keys[j][1]
            sk = X25519PrivateKey.from_private_bytes(
                self._recover(
                    "s", j, KEY_BYTES, lambda s, s_pub=s_pub: _public(X25519PrivateKey.from_private_bytes(s)) == s_pub
                )
            )
            for i in self.graph[j]:
                if i in self.masked:  # i added sign(i, j) * mask(i, j): take it out
                    (added if pair_sign(i, j) > 0 else taken).__iadd__(pair_mask(sk, self.keys[i][1], self.rid, n))
        total += taken
        total -= added
        values = dequantize(total, self.settings, self.total_weight)
        weight = sum(float(self.masked[d].meta["weight"]) for d in self.survivors)
        slack = len(self.survivors) / scale_for(self.settings, self.total_weight)  # rounding, half a step each
        if values.size and float(np.max(np.abs(values))) > self.settings.bound * weight + slack:
            # honest inputs are clipped to the bound: a larger sum means a device masked something else
            self._fail("the unmasked sum exceeds what clipped updates can add up to (a device sent a bad vector)")
        summed = unflatten(values, layout)
        stats = {
            "planned": len(self.planned),
            "keys": len(self.roster),
            "shared": len(self.shared),
            "survivors": len(self.survivors),
            "dropped": len(self.dropped),
            "recovered": len(self.dropped),
            "consents": len(self.consents),
            "degree": self.settings.degree(len(self.roster)),
            "threshold": self.settings.t(len(self.roster)),
        }
        return Unmasked(
            summed, total, {d: float(self.masked[d].meta["weight"]) for d in self.survivors}, list(self.dropped), stats
        )

    def _fail(self, why: str) -> NoReturn:
        self.phase = Phase.FAILED
        raise SecAggFailure(why)
