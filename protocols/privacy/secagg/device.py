"""A device's side of one secure aggregation (:class:`SecAggDevice`), and :class:`CellLied`, what it raises when
it catches its cell lying."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ...numbers import finite_number
from ...rejections import Rejected, RejectKind
from ...wire.payload import Payload
from .. import shamir
from .crypto import (
    KEY_BYTES,
    NONCE_BYTES,
    SEALED_BYTES,
    Identity,
    advert_bytes,
    agree,
    commitment,
    pair_mask,
    pair_sign,
    private_bytes,
    public_bytes,
    self_mask,
    signed_by,
    view_bytes,
    view_digest,
)
from .encoding import as_u8, device_list, fixed_bytes, flatten, quantize
from .settings import RoundId, SecAggSettings, neighbour_graph


class CellLied(Rejected):
    """A device caught its cell lying (a substituted key, views that disagree): it sits the round out.
    Its kind is always ``inconsistent``."""

    def __init__(self, reason: str) -> None:
        super().__init__(RejectKind.INCONSISTENT, reason)

    def __reduce__(self) -> tuple[type[CellLied], tuple[str]]:  # type: ignore[override]  # one argument, no kind
        return type(self), (str(self),)


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
        c, s = public_bytes(self._c), public_bytes(self._s)
        tensors = {"c": as_u8(c), "s": as_u8(s)}
        if self.identity is not None:
            tensors["g"] = as_u8(self.identity.sign(advert_bytes(self.device, c, s, self.rid)))
        return Payload({"weight": self.weight_bound}, tensors)

    def share(self, roster: Payload) -> Payload:
        """``secagg_shares`` from ``secagg_roster``: Shamir shares of b and s_sk, sealed per neighbour."""
        if self.roster:
            raise Rejected(RejectKind.REPLAY, "secure aggregation: a second roster for this round")
        devices = device_list(roster.meta.get("devices"), "roster")
        total = roster.meta.get("total_weight")
        if self.device not in devices:
            raise Rejected(RejectKind.UNKNOWN_SENDER, "secure aggregation: this device is not in the roster")
        if (number := finite_number(total)) is None or number < self.weight_bound:
            raise Rejected(RejectKind.BOUND, f"secure aggregation: total weight {str(total)[:40]} below this device's")
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
            self._peer_c[j] = fixed_bytes(roster, f"c/{j}", KEY_BYTES, "roster")
            self._peer_s[j] = fixed_bytes(roster, f"s/{j}", KEY_BYTES, "roster")
        if self.identity is not None:
            for j in near:
                sig = roster.tensors.get(f"g/{j}")
                data = advert_bytes(j, self._peer_c[j], self._peer_s[j], self.rid)
                if sig is None or sig.dtype != np.uint8 or not signed_by(self.identity, j, data, sig.tobytes()):
                    self._peer_c.clear()
                    self._peer_s.clear()
                    raise CellLied(
                        f"the keys the cell gave for neighbour {j} are not signed by {j} (substituted, or {j} is "
                        "not a member of this cell)"
                    )
        self.roster, self.neighbours, self.total_weight = devices, near, number
        t = self.settings.t(len(devices))
        points = [devices.index(j) + 1 for j in near]  # x of j's share: its position in U1, + 1
        b_shares = shamir.split(self._b, points, t) if near else []
        s_shares = shamir.split(private_bytes(self._s), points, t) if near else []
        sealed = {}
        for j, x, (_, bs), (_, ss) in zip(near, points, b_shares, s_shares, strict=True):
            key = agree(self._c, self._peer_c[j], self.rid.label("seal"))
            nonce = os.urandom(NONCE_BYTES)
            sealed[f"e/{j}"] = as_u8(
                nonce + AESGCM(key).encrypt(nonce, bs + ss, self.rid.label(self.device, j, str(x)))
            )
        return Payload({"commit": commitment(self._b, self.device, self.rid)}, sealed)

    def receive(self, routed: Payload) -> int:
        """``secagg_routed``: U2 and the shares neighbours sealed for this device; returns how many opened.
        A share that does not open (tampered, replayed from another round) is dropped: this device
        then cannot help recover that neighbour, which costs at most that neighbour's recovery."""
        if not self.roster:
            raise Rejected(RejectKind.OUT_OF_ORDER, "secure aggregation: shares routed before the roster")
        if self.shared:
            raise Rejected(RejectKind.REPLAY, "secure aggregation: shares routed twice this round")
        shared = device_list(routed.meta.get("shared"), "shared")
        if self.device not in shared or not set(shared) <= set(self.roster):
            raise Rejected(RejectKind.INCONSISTENT, "secure aggregation: the routed set does not fit the roster")
        x = self.roster.index(self.device) + 1
        for j in self.neighbours:
            arr = routed.tensors.get(f"e/{j}")
            if j not in shared or arr is None or arr.dtype != np.uint8 or arr.shape != (SEALED_BYTES,):
                continue
            blob = arr.tobytes()
            key = agree(self._c, self._peer_c[j], self.rid.label("seal"))
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
        survivors = device_list(request.meta.get("survivors"), "survivors")
        dropped = device_list(request.meta.get("dropped"), "dropped")
        if set(survivors) & set(dropped) or not set(survivors) | set(dropped) <= set(self.shared):
            raise CellLied("secure aggregation: survivors and dropped overlap or leave the shared set")
        if self.device not in survivors:
            raise Rejected(RejectKind.NOT_PLANNED, "secure aggregation: unmask request that does not count this device")
        if len(survivors) < self.settings.survivors_needed(len(self.roster)):
            raise Rejected(RejectKind.INCONSISTENT, "secure aggregation: fewer survivors than the threshold")
        digest = view_digest(self.roster, survivors, dropped, self.rid)
        self.view = (survivors, dropped, digest)
        tensors = (
            {} if self.identity is None else {"g": as_u8(self.identity.sign(view_bytes(self.device, digest, self.rid)))}
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
                if sig is None or sig.dtype != np.uint8 or not signed_by(self.identity, j, data, sig.tobytes()):
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
                out[f"b/{j}"] = as_u8(bs)
            elif j in dropped:
                out[f"s/{j}"] = as_u8(ss)
        return Payload({}, out)
