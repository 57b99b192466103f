"""Uplink codecs: how a device's model delta travels to its cell (dense, SignSGD, top-k, QSGD, FedMRN).

Any algorithm whose device sends a model delta can offer them. To adopt the layer (as FedAvg does):

1. derive the algorithm's ``Params`` from :class:`UplinkParams` instead of ``TrainParams`` (adds
   ``uplink`` and the codec parameters to its ``[algorithm]`` section);
2. ``codec = make_codec(params)`` in the device and cell roles;
3. device: ``payload = codec.encode(delta, uplink_seed(ctx))`` (a codec that draws nothing, ``seeded = False``,
   gets 0) then add its own metadata;
   cell: ``codec.check(result, reference, what)`` in ``check`` and ``codec.decode(result, reference)``
   before averaging, where ``reference`` is the tensors the delta applies to (for HIST, the submodel).

Every codec reports the exact size of its encoding (``data_bytes`` + ``framing_bytes`` + metadata)
and is deterministic given its seed; see each module for the wire layout.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ...seeding import derive_seed
from ..base import DeviceContext, TrainParams
from ..traits import Layer, Trait
from .base import DenseCodec, UplinkCodec, pack_bits, unpack_bits, wire_size
from .mrn import FedMRNCodec, NoiseKind
from .quantizers import QSGDCodec, SignSGDCodec, TopKCodec

UplinkName = Literal["dense", "signsgd", "topk", "qsgd", "fedmrn"]
CODECS: dict[str, type[UplinkCodec]] = {
    c.name: c for c in (DenseCodec, SignSGDCodec, TopKCodec, QSGDCodec, FedMRNCodec)
}


class UplinkParams(TrainParams):
    """``TrainParams`` plus the choice of device -> cell codec and its parameters."""

    uplink: UplinkName = Field(
        default="dense",
        description="device -> cell codec: dense (float32), signsgd (1 bit + a scale per tensor), topk, qsgd, "
        "fedmrn (post-hoc stochastic masking)",
    )
    signsgd_mode: Literal["stochastic", "scaled"] = Field(
        default="stochastic", description="signsgd: stochastic signs, or sign x mean magnitude (scaled)"
    )
    topk_fraction: float = Field(default=0.03, gt=0, le=1, description="topk: fraction of coordinates sent")
    qsgd_levels: int = Field(default=1, ge=1, le=1 << 15, description="qsgd: quantisation levels")
    mrn_noise: NoiseKind = Field(default="uniform", description="fedmrn uplink: the noise's distribution")
    mrn_alpha: float = Field(default=0.01, gt=0, description="fedmrn uplink: the noise's scale")
    mrn_signed: bool = Field(default=False, description="fedmrn uplink: signed masks {-1, +1} instead of {0, 1}")

    def layers(self) -> tuple[Layer, ...]:
        if self.uplink == "dense":
            return super().layers()
        codec = Layer(
            "algorithm.uplink",
            self.uplink,
            removes=frozenset({Trait.CELL_SUM, Trait.PLAIN_DELTA_UPLINK}),
            why="devices send encoded updates that the cell decodes one by one, not dense deltas",
        )
        return (*super().layers(), codec)

    def idle_keys(self) -> dict[str, str]:
        out = super().idle_keys()
        uses = {"signsgd_mode": "signsgd", "topk_fraction": "topk", "qsgd_levels": "qsgd", "mrn_noise": "fedmrn"}
        uses |= {"mrn_alpha": "fedmrn", "mrn_signed": "fedmrn"}
        out.update({key: f'uplink = "{codec}"' for key, codec in uses.items() if self.uplink != codec})
        return out


def make_codec(params: TrainParams) -> UplinkCodec:
    """The uplink codec ``params`` ask for (dense when the params have no ``uplink``)."""
    if not isinstance(params, UplinkParams):
        return DenseCodec()
    name = params.uplink
    if name == "dense":
        return DenseCodec()
    if name == "signsgd":
        return SignSGDCodec(params.signsgd_mode)
    if name == "topk":
        return TopKCodec(params.topk_fraction)
    if name == "qsgd":
        return QSGDCodec(params.qsgd_levels)
    if name == "fedmrn":
        return FedMRNCodec(params.mrn_noise, params.mrn_alpha, params.mrn_signed)
    raise ValueError(f"unknown uplink codec {name!r} (available: {', '.join(CODECS)})")


def uplink_seed(ctx: DeviceContext) -> int:
    """The seed of a device's uplink encoding in one edge round (fresh per device, round, edge round)."""
    return derive_seed(ctx.seed, ctx.round, ctx.edge_round, ctx.cell, ctx.device, "uplink")


__all__ = [
    "CODECS",
    "DenseCodec",
    "FedMRNCodec",
    "QSGDCodec",
    "SignSGDCodec",
    "TopKCodec",
    "UplinkCodec",
    "UplinkName",
    "UplinkParams",
    "make_codec",
    "pack_bits",
    "unpack_bits",
    "uplink_seed",
    "wire_size",
]
