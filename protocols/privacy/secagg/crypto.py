"""The cryptography of secure aggregation: X25519 agreement and HKDF, the ChaCha20 PRG that expands masks,
commitments, the bytes each device signs (key advertisements, views), and the identities that sign and verify."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .. import shamir
from .settings import RoundId

KEY_BYTES = 32
NONCE_BYTES = 12
SEALED_BYTES = NONCE_BYTES + 2 * shamir.SHARE_BYTES + 16  # nonce | share of b | share of s_sk | GCM tag
SIG_BYTES = 64  # Ed25519


class Identity(Protocol):
    """A node's signing identity and its peers' public keys (``protocols.wire.keys.Trust``)."""

    node: str

    def sign(self, data: bytes) -> bytes: ...

    def verify(self, signer: str, data: bytes, sig: bytes) -> None:
        """Raise (any exception) unless ``sig`` is ``signer``'s signature of ``data``."""


def kdf(secret: bytes, info: bytes) -> bytes:
    """A 32-byte key from ``secret`` for the purpose ``info`` (HKDF-SHA256)."""
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(secret)


def public_bytes(key: X25519PrivateKey) -> bytes:
    """The raw 32-byte public key of ``key``."""
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def private_bytes(key: X25519PrivateKey) -> bytes:
    """The raw 32-byte private key of ``key`` (what a device Shamir-shares of its mask key)."""
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def agree(private: bytes | X25519PrivateKey, public: bytes, info: bytes) -> bytes:
    """The pair's shared key for ``info``: X25519 of ``private`` and ``public``, through :func:`kdf`."""
    key = private if isinstance(private, X25519PrivateKey) else X25519PrivateKey.from_private_bytes(private)
    return kdf(key.exchange(X25519PublicKey.from_public_bytes(public)), info)


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
    """The pairwise mask of two devices (each side computes it from its private and the other's public key)."""
    return prg(agree(private, public, rid.label("pair mask")), n)


def self_mask(b: bytes, rid: RoundId, n: int) -> np.ndarray:
    """A device's self-mask from its seed ``b``."""
    return prg(kdf(b, rid.label("self mask")), n)


def commitment(b: bytes, device: str, rid: RoundId) -> str:
    """A device's commitment to its self-mask seed ``b``, checked when ``b`` is recovered."""
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


def signed_by(identity: Identity, signer: str, data: bytes, sig: bytes) -> bool:
    """``sig`` is ``signer``'s signature of ``data`` as ``identity`` knows ``signer``."""
    try:
        identity.verify(signer, data, sig)
    except Exception:  # a wire error, an unknown signer, a malformed key: not signed by ``signer``
        return False
    return True
