"""Uplink codecs: exact decode of each definition, exact sizes, unbiasedness, rejection of bad input."""

from __future__ import annotations

import json
import math
from collections import OrderedDict

import numpy as np
import pytest

from protocols.algorithms.base import Rejected
from protocols.algorithms.codecs import (
    DenseCodec,
    FedMRNCodec,
    QSGDCodec,
    SignSGDCodec,
    TopKCodec,
    make_codec,
    pack_bits,
    unpack_bits,
    wire_size,
)
from protocols.algorithms.codecs.base import pack_codes, unpack_codes
from protocols.algorithms.fedavg import FedAvgParams
from protocols.wire.payload import Payload, decode_payload, encode_payload


def delta(seed: int = 0) -> OrderedDict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    return OrderedDict(
        [
            ("fc1.weight", g.normal(size=(13, 7)).astype(np.float32)),
            ("fc1.bias", g.normal(size=13).astype(np.float32)),
            ("out.weight", (g.normal(size=(3, 13)) * 0.01).astype(np.float32)),
            ("out.bias", np.zeros(3, np.float32)),
        ]
    )


CODECS = [
    DenseCodec(),
    SignSGDCodec(),
    SignSGDCodec("scaled"),
    TopKCodec(0.1),
    QSGDCodec(1),
    QSGDCodec(5),
    FedMRNCodec(alpha=0.5),
    FedMRNCodec("gauss", 0.5, signed=True),
    FedMRNCodec("bernoulli", 0.5),
]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}")
def test_encoded_size_is_exact_and_survives_the_wire(codec) -> None:
    x = delta()
    payload = codec.encode(x, seed=7)
    meta = json.dumps(payload.meta, separators=(",", ":")).encode()
    assert wire_size(payload) == 4 + len(meta) + 2 + codec.framing_bytes(x) + codec.data_bytes(x)
    back = decode_payload(encode_payload(payload))
    codec.check(back, x, "test")
    for k, v in codec.decode(back, x).items():
        assert v.dtype == np.float32 and v.shape == x[k].shape
        np.testing.assert_array_equal(v, codec.decode(payload, x)[k])


def test_bit_packing_round_trips_and_rejects_padding() -> None:
    bits = np.random.default_rng(1).integers(0, 2, 1001).astype(np.uint8)
    packed = pack_bits(bits)
    assert packed.dtype == np.uint8 and packed.shape == (126,)
    np.testing.assert_array_equal(unpack_bits(packed, 1001, "m"), bits)
    bad = packed.copy()
    bad[-1] |= 0x80  # bit 1007 is padding
    with pytest.raises(Rejected, match="padding"):
        unpack_bits(bad, 1001, "m")
    with pytest.raises(Rejected):
        unpack_bits(packed[:-1], 1001, "m")
    codes = np.random.default_rng(2).integers(0, 11, 333).astype(np.uint32)
    np.testing.assert_array_equal(unpack_codes(pack_codes(codes, 4), 333, 4, "c"), codes)


def test_signsgd_definitions() -> None:
    x = delta()
    scaled = SignSGDCodec("scaled").decode(SignSGDCodec("scaled").encode(x, 0), x)
    for k, v in x.items():
        expect = np.float32(np.abs(v).mean(dtype=np.float64)) * np.where(v >= 0, 1, -1)
        np.testing.assert_array_equal(scaled[k], expect.astype(np.float32))
    codec = SignSGDCodec()
    out = codec.decode(codec.encode(x, 3), x)
    for k, v in x.items():
        r = np.abs(v).max()
        if r == 0:
            assert not out[k].any()
        else:
            assert set(np.unique(np.abs(out[k]))) == {np.float32(r)}
            assert (out[k][v == r] > 0).all() and (out[k][v == -r] < 0).all()  # the extremes are certain
    mean = np.mean([codec.decode(codec.encode(x, s), x)["fc1.weight"] for s in range(3000)], axis=0)
    r = np.abs(x["fc1.weight"]).max()
    assert np.abs(mean - x["fc1.weight"]).max() < 5.5 * r / math.sqrt(3000)  # unbiased


def test_topk_keeps_exactly_the_largest_entries() -> None:
    x = delta()
    codec = TopKCodec(0.1)
    out = codec.decode(codec.encode(x, 0), x)
    for k, v in x.items():
        kk = max(1, math.ceil(0.1 * v.size))
        keep = np.argsort(-np.abs(v.ravel()), kind="stable")[:kk]
        expect = np.zeros(v.size, np.float32)
        expect[keep] = v.ravel()[keep]
        np.testing.assert_array_equal(out[k].ravel(), expect)
    assert codec.data_bytes(x) == 8 * (10 + 2 + 4 + 1)


def test_qsgd_definition_and_unbiasedness() -> None:
    x = delta()
    codec = QSGDCodec(3)
    assert codec.width == 3
    out = codec.decode(codec.encode(x, 5), x)
    for k, v in x.items():
        norm = np.float32(np.sqrt(np.dot(v.astype(np.float64).ravel(), v.astype(np.float64).ravel())))
        if norm == 0:
            assert not out[k].any()
            continue
        levels = out[k] / norm * 3
        np.testing.assert_allclose(levels, np.round(levels), atol=1e-4)  # on the grid norm * l / s
        assert (np.abs(out[k] - v) <= norm / 3 * (1 + 1e-5)).all()  # a neighbouring level
        assert (out[k] * v >= 0).all()  # never flips a sign
    mean = np.mean([codec.decode(codec.encode(x, s), x)["fc1.weight"] for s in range(3000)], axis=0)
    norm = np.linalg.norm(x["fc1.weight"])
    assert np.abs(mean - x["fc1.weight"]).max() < 5.5 * (norm / 3 / 2) / math.sqrt(3000)


def test_posthoc_fedmrn_is_masked_noise() -> None:
    x = delta()
    codec = FedMRNCodec(alpha=0.5)
    payload = codec.encode(x, 11)
    out = codec.decode(payload, x)
    noise = codec.noise_for(11, x)
    assert list(noise) == ["fc1.weight", "out.weight"]
    for k in noise:
        assert np.isin(out[k] / noise[k], [0, 1]).all()
    np.testing.assert_array_equal(out["fc1.bias"], x["fc1.bias"])  # vectors travel in float32
    assert payload.tensors["mask"].shape == (math.ceil((91 + 39) / 8),)


@pytest.mark.parametrize("codec", CODECS[1:], ids=lambda c: f"{c.name}")
def test_bad_payloads_are_rejected(codec) -> None:
    x = delta()
    good = codec.encode(x, 1)
    with pytest.raises(Rejected):
        codec.check(Payload({**good.meta, "codec": "other"}, good.tensors), x, "t")
    first = next(iter(good.tensors))
    with pytest.raises(Rejected):
        codec.check(Payload(good.meta, {**good.tensors, first: good.tensors[first][:-1]}), x, "t")
    with pytest.raises(Rejected):
        codec.check(Payload(good.meta, dict(list(good.tensors.items())[1:])), x, "t")
    for name, arr in good.tensors.items():
        if arr.dtype == np.float32 and arr.size:
            bad = arr.copy()
            bad[0] = np.nan
            with pytest.raises(Rejected):
                codec.check(Payload(good.meta, {**good.tensors, name: bad}), x, "t")


def test_specific_rejections() -> None:
    x = delta()
    topk = TopKCodec(0.1).encode(x, 0)
    idx = topk.tensors["idx"].copy()
    idx[[0, 1]] = idx[[1, 0]]
    with pytest.raises(Rejected, match="increasing"):
        TopKCodec(0.1).check(Payload(topk.meta, {**topk.tensors, "idx": idx}), x, "t")
    q = QSGDCodec(2)
    codes = np.full(sum(v.size for v in x.values()), 7, np.uint32)  # 7 > 2s
    with pytest.raises(Rejected, match="code"):
        q.check(
            Payload({"codec": "qsgd"}, {"codes": pack_codes(codes, q.width), "scale": np.ones(4, np.float32)}), x, "t"
        )
    mrn = FedMRNCodec().encode(x, 0)
    with pytest.raises(Rejected, match="seed"):
        FedMRNCodec().check(Payload({**mrn.meta, "seed": 12}, mrn.tensors), x, "t")


def test_make_codec_from_fedavg_params() -> None:
    p = FedAvgParams(name="fedavg", uplink="qsgd", qsgd_levels=7)
    assert isinstance(make_codec(p), QSGDCodec) and make_codec(p).width == 4
    assert isinstance(make_codec(FedAvgParams(name="fedavg")), DenseCodec)
    with pytest.raises(ValueError):
        FedAvgParams(name="fedavg", uplink="zip")


@pytest.mark.parametrize("codec", [c for c in CODECS if not c.seeded], ids=lambda c: f"{c.name}")
def test_a_codec_declared_unseeded_encodes_the_same_under_any_seed(codec) -> None:
    """A device derives no uplink seed for a codec with ``seeded = False`` (it gets 0): such a codec's encoding
    must not depend on its seed (dense and top-k draw nothing)."""
    x = delta()
    assert (
        encode_payload(codec.encode(x, 0))
        == encode_payload(codec.encode(x, 7))
        == encode_payload(codec.encode(x, 2**62))
    )


def test_dense_and_topk_are_declared_unseeded_and_the_stochastic_codecs_seeded() -> None:
    assert [c.seeded for c in (DenseCodec(), TopKCodec(0.1))] == [False, False]
    assert all(c.seeded for c in (SignSGDCodec(), QSGDCodec(1), FedMRNCodec(alpha=0.5)))
