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

The modules: :mod:`.settings` (what both sides derive from the config and the round: degree, threshold, the
neighbour graph), :mod:`.crypto` (agreement, masks, commitments, signed bytes, identities), :mod:`.encoding`
(quantisation, layouts, checked message fields), :mod:`.device` and :mod:`.cell` (the two roles).
"""

from .cell import Phase, SecAggCell, SecAggFailure, Unmasked, masked_layout
from .crypto import Identity, RosterIdentity
from .device import CellLied, SecAggDevice
from .encoding import dequantize, flatten, quantize, unflatten
from .settings import RoundId, SecAggSettings, neighbour_graph, refusal

KINDS = (  # the message kinds secure aggregation adds, in the order of a round
    "secagg_keys",
    "secagg_roster",
    "secagg_shares",
    "secagg_routed",
    "secagg_unmask",
    "secagg_consent",
    "secagg_views",
    "secagg_reveal",
)

__all__ = [
    "KINDS",
    "CellLied",
    "Identity",
    "Phase",
    "RosterIdentity",
    "RoundId",
    "SecAggCell",
    "SecAggDevice",
    "SecAggFailure",
    "SecAggSettings",
    "Unmasked",
    "dequantize",
    "flatten",
    "masked_layout",
    "neighbour_graph",
    "quantize",
    "refusal",
    "unflatten",
]
