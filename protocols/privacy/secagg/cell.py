"""A cell's side of one secure aggregation (:class:`SecAggCell`): it checks each device message, builds the next
phase's messages and unmasks the sum; its phases, its outcome, and :class:`SecAggFailure`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NoReturn

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from ...numbers import finite_number
from ...rejections import OffPlan, Rejected, RejectKind
from ...wire.payload import Payload
from .. import shamir
from .crypto import KEY_BYTES, SEALED_BYTES, SIG_BYTES, commitment, pair_mask, pair_sign, public_bytes, self_mask
from .encoding import Layout, as_u8, dequantize, fixed_bytes, layout_of, scale_for, unflatten
from .settings import RoundId, SecAggSettings, neighbour_graph


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
        c, s = fixed_bytes(payload, "c", KEY_BYTES, "keys"), fixed_bytes(payload, "s", KEY_BYTES, "keys")
        if not set(payload.tensors) <= {"c", "s", "g"}:
            raise Rejected(RejectKind.MALFORMED, "secure aggregation: keys with unknown parts")
        if "g" in payload.tensors:  # its signature of the keys: forwarded, each neighbour checks it
            self.signatures[device] = fixed_bytes(payload, "g", SIG_BYTES, "keys")
        w = payload.meta.get("weight")
        bound = self.weight_bound(device)
        number = finite_number(w)
        if number is None or number <= 0 or (bound is not None and number > bound):
            raise Rejected(RejectKind.BOUND, f"secure aggregation: weight {str(w)[:40]} refused (bound {bound})")
        self.keys[device] = (c, s, number)

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
                f"{p}/{j}": as_u8(key) for j in near for key, p in ((self.keys[j][0], "c"), (self.keys[j][1], "s"))
            }
            tensors.update({f"g/{j}": as_u8(self.signatures[j]) for j in near if j in self.signatures})
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
            fixed_bytes(payload, f"e/{j}", SEALED_BYTES, "shares")
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
        """Refuse a masked result that cannot be summed; its layout otherwise. What it holds is judged first, in
        any phase: a late answer (``protocols.answers``) is refused for its content whenever it comes."""
        layout = masked_layout(payload)
        self._expect(Phase.MASKED, device)
        if device not in self.sealed:
            raise Rejected(
                RejectKind.NOT_PLANNED, "secure aggregation: a result from a device whose shares did not arrive"
            )
        w = payload.meta.get("weight")
        if (number := finite_number(w)) is None or not 0 < number <= self.keys[device][2]:
            raise Rejected(
                RejectKind.BOUND,
                f"secure aggregation: weight {str(w)[:40]} above the {self.keys[device][2]:g} advertised",
            )
        for other in self.masked.values():
            if other.meta["layout"] != payload.meta["layout"]:
                raise OffPlan(RejectKind.INCONSISTENT, "secure aggregation: a layout unlike the other devices'")
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
            fixed_bytes(payload, "g", SIG_BYTES, "consent")
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
            fixed_bytes(payload, name, shamir.SHARE_BYTES, "reveal")
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
        layout = layout_of(self.masked[self.survivors[0]].meta["layout"])
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
                    "s",
                    j,
                    KEY_BYTES,
                    lambda s, s_pub=s_pub: public_bytes(X25519PrivateKey.from_private_bytes(s)) == s_pub,
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


def masked_layout(payload: Payload) -> Layout:
    """The layout of a masked result whose vector matches it (what it holds alone, in any phase of any round);
    :class:`Rejected` (malformed layout, shape) if it does not."""
    layout = layout_of(payload.meta.get("layout"))
    arr = payload.tensors.get("masked")
    size = sum(math.prod(s) for _, s in layout)
    if set(payload.tensors) != {"masked"} or arr is None or arr.dtype != np.uint32 or arr.shape != (size,):
        raise Rejected(RejectKind.SHAPE, "secure aggregation: the masked vector does not match its layout")
    return layout
