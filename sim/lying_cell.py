"""A cell that lies to read one device's update under secure aggregation (``tests/test_secagg_attacks.py``,
``benchmarks/attacks.py``).

The cell holds its own valid credentials and none of its devices'. It runs the real protocol
(``protocols.privacy.secagg.SecAggCell``) and deviates where an attack says, against one target device:

* ``keys``: in the target's roster it substitutes its own X25519 keys for the target's neighbours'; a
  target that accepts them seals every share of its secrets to the cell and masks with keys the cell
  holds, so the cell opens the shares, rebuilds both secrets and unmasks the target's update alone.
* ``dropout``: the target's result arrives, and the cell tells half of the target's neighbours that it
  survived (they reveal shares of its self-mask seed) and the other half that it dropped (shares of its
  mask key): with both secrets the cell unmasks the target's update. ``hide`` forwards each device only
  the consistency-round views equal to its own, so no device sees a disagreement.

:attr:`LyingCell.recovered` holds what the cell rebuilt: ``(round, edge round) -> the target's quantised
update`` (``quantize(update, weight)``, uint32) when an attack succeeded. :meth:`LyingCell.install` makes
the cell runtime of one cell in this process use the lying protocol (``fedtier run`` keeps its cells in
the launching process).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from protocols.privacy import shamir
from protocols.privacy.secagg import RoundId, SecAggCell, SecAggSettings
from protocols.privacy.secagg.cell import Phase
from protocols.privacy.secagg.crypto import (
    KEY_BYTES,
    NONCE_BYTES,
    agree,
    commitment,
    pair_mask,
    pair_sign,
    public_bytes,
    self_mask,
    view_digest,
)
from protocols.privacy.secagg.encoding import as_u8
from protocols.wire.payload import Payload

Attack = Literal["keys", "dropout"]


@dataclass
class LyingCell:
    """The attack, its target and what it got. ``hide``: forward only the views that agree (dropout)."""

    attack: Attack
    target: str
    cell: str = "c0"
    hide: bool = False
    recovered: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    attempts: int = 0  # aggregations the attack was tried in

    def protocol(self, settings: SecAggSettings, rid: RoundId, planned: Sequence[str], **kw: Any) -> SecAggCell:
        """The cell's protocol for one aggregation: lying in this cell, honest elsewhere."""
        if rid.cell != self.cell or self.target not in planned:
            return SecAggCell(settings, rid, planned, **kw)
        return _Lying(settings, rid, planned, liar=self, **kw)

    @contextmanager
    def install(self) -> Iterator[LyingCell]:
        """Cell runtimes of this process built meanwhile use :meth:`protocol`."""
        from cell_server import secagg as runtime

        saved = runtime.SecAggCell
        runtime.SecAggCell = self.protocol  # type: ignore[assignment,misc]
        try:
            yield self
        finally:
            runtime.SecAggCell = saved  # type: ignore[misc]


class _Lying(SecAggCell):
    def __init__(self, *args: Any, liar: LyingCell, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.liar = liar
        self.fake: dict[str, tuple[X25519PrivateKey, X25519PrivateKey]] = {}  # neighbour -> (c, s) the cell holds
        self.secrets: dict[str, bytes] = {}  # "b" / "s" -> the target's secret, once rebuilt
        self.views_sent: dict[str, bytes] = {}  # device -> the digest of the view the cell told it

    # ------------------------------------------------------------------ keys: substitute, then open
    def rosters(self) -> dict[str, Payload]:
        out = super().rosters()
        target = self.liar.target
        if self.liar.attack != "keys" or target not in out:
            return out
        self.liar.attempts += 1
        tensors = dict(out[target].tensors)
        for j in self.graph[target]:
            c, s = X25519PrivateKey.generate(), X25519PrivateKey.generate()
            self.fake[j] = (c, s)
            tensors[f"c/{j}"], tensors[f"s/{j}"] = as_u8(public_bytes(c)), as_u8(public_bytes(s))
        out[target] = Payload(out[target].meta, tensors)
        return out

    def add_shares(self, device: str, payload: Payload) -> None:
        super().add_shares(device, payload)
        if device != self.liar.target or not self.fake:
            return
        b_shares, s_shares = [], []
        c_pub = self.keys[device][0]
        for j, (c, _) in self.fake.items():
            x = self.roster.index(j) + 1
            blob = payload.tensors[f"e/{j}"].tobytes()
            try:
                plain = AESGCM(agree(c, c_pub, self.rid.label("seal"))).decrypt(
                    blob[:NONCE_BYTES], blob[NONCE_BYTES:], self.rid.label(device, j, str(x))
                )
            except InvalidTag:
                continue
            b_shares.append((x, plain[: shamir.SHARE_BYTES]))
            s_shares.append((x, plain[shamir.SHARE_BYTES :]))
        self._rebuild(b_shares, s_shares)

    # ------------------------------------------------------------------ dropout: both answers at once
    def unmask_requests(self) -> dict[str, Payload]:
        if self.fake:  # the keys attack: the target's result is in, its secrets opened already
            self._rebuild([], [])
        out = super().unmask_requests()
        target = self.liar.target
        if self.liar.attack == "dropout" and target in self.masked:
            self.liar.attempts += 1
            near = sorted(j for j in self.graph[target] if j in self.masked)
            told_dropped = set(near[: len(near) // 2 + len(near) % 2])
            for j in told_dropped:
                survivors = [d for d in self.survivors if d != target]
                out[j] = Payload({"survivors": survivors, "dropped": sorted([*self.dropped, target])}, {})
        for d, p in out.items():
            self.views_sent[d] = view_digest(self.roster, p.meta["survivors"], p.meta["dropped"], self.rid)
        return out

    def views(self) -> dict[str, Payload]:
        out = super().views()
        if not self.liar.hide:
            return out
        for d, p in out.items():  # forward only what agrees with what d was told: nobody sees a conflict
            mine = self.views_sent[d].hex()
            keep = {j: v for j, v in p.meta["views"].items() if v == mine}
            out[d] = Payload({"views": keep}, {k: v for k, v in p.tensors.items() if k[2:] in keep})
        return out

    def add_reveal(self, device: str, payload: Payload) -> None:
        target = self.liar.target
        if self.liar.attack != "dropout":
            super().add_reveal(device, payload)
            return
        self._expect(Phase.REVEAL, device)
        self.reveals[device] = payload  # whatever it holds: the cell asked for both secrets of the target
        x = {d: i + 1 for i, d in enumerate(self.roster)}
        b_shares, s_shares = [], []
        for d, p in self.reveals.items():
            if f"b/{target}" in p.tensors:
                b_shares.append((x[d], p.tensors[f"b/{target}"].tobytes()))
            if f"s/{target}" in p.tensors:
                s_shares.append((x[d], p.tensors[f"s/{target}"].tobytes()))
        self._rebuild(b_shares, s_shares)

    # ------------------------------------------------------------------ the target's update, alone
    def _rebuild(self, b_shares: list[shamir.Share], s_shares: list[shamir.Share]) -> None:
        target, t = self.liar.target, self.settings.t(len(self.roster))
        for name, shares in (("b", b_shares), ("s", s_shares)):
            if name in self.secrets or len(shares) < t:
                continue
            try:
                secret = shamir.combine(sorted(shares)[:t], KEY_BYTES)
            except shamir.ShareError:
                continue
            ok = (
                commitment(secret, target, self.rid) == self.commits.get(target)
                if name == "b"
                else public_bytes(X25519PrivateKey.from_private_bytes(secret)) == self.keys[target][1]
            )
            if ok:
                self.secrets[name] = secret
        masked = self.masked.get(target)
        if masked is None or "b" not in self.secrets or ("s" not in self.secrets and not self.fake):
            return
        vector = masked.tensors["masked"].copy()
        n = vector.size
        vector -= self_mask(self.secrets["b"], self.rid, n)
        for j in self.graph[target]:
            if j not in self.sealed:
                continue  # the target masked with the neighbours the cell announced as sharing
            if self.fake:
                pm = pair_mask(self.fake[j][1], self.keys[target][1], self.rid, n)
            else:
                pm = pair_mask(self.secrets["s"], self.keys[j][1], self.rid, n)
            vector -= pm if pair_sign(target, j) > 0 else -pm
        self.liar.recovered[(self.rid.round, self.rid.edge_round)] = vector
