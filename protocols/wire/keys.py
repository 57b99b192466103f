"""Per-node Ed25519 identities: every node (``cloud``, each cell, each device) has a signing key; its
peers verify it with its public key, so no node can sign for another (a cell cannot forge its devices).

A keys file is TOML::

    format = "fedtier-ed25519/1"
    [private]            # secret: a node's own file holds only its own entry
    "c0-d0" = "64 hex digits (the 32-byte Ed25519 seed)"
    [public]
    "cloud" = "64 hex digits"
    "c0" = "..."

``fedtier keys CONFIG --out keys.toml`` writes every node's private and public key; ``--node ID``
extracts one node's share (:func:`node_subset`: its private key and its peers' public keys). With
``[security] keys = "path"`` every node signs what it sends and verifies what it acts on
(:func:`node_trust`). Keys come from the OS's CSPRNG: secrets are not model randomness and never touch
``protocols.seeding``. Files of the older HMAC format (a ``[keys]`` table) are refused with a message
that says how to replace them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import tomllib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from ..config import ConfigError
from ..limits import MAX_KEYED_NODES, read_file
from ..rejections import RejectKind
from .envelope import WireError

if TYPE_CHECKING:
    from ..config import RunConfig, TopologySection

FORMAT = "fedtier-ed25519/1"
KEY_BYTES = 32
SIG_BYTES = 64
KEYS_FILE = "keys.toml"
MAX_KEYS_BYTES = 1 << 30  # a file of MAX_KEYED_NODES nodes is ~150 MB
log = logging.getLogger("fedtier.wire")


class KeysError(ConfigError):
    """A missing, unreadable, outdated or incomplete keys file (the text says which key or line)."""


@dataclass(frozen=True)
class KeyRing:
    """Raw keys: ``private[node]`` (32-byte seeds, secret) and ``public[node]`` (32 bytes)."""

    private: dict[str, bytes] = field(default_factory=dict)
    public: dict[str, bytes] = field(default_factory=dict)


def node_ids(topology: TopologySection) -> list[str]:
    """Every node of a topology: ``cloud``, the cells, the devices."""
    return ["cloud", *topology.cell_ids(), *topology.all_devices()]


def public_of(seed: bytes) -> bytes:
    return Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def new_seed() -> bytes:
    return Ed25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def generate_keys(topology: TopologySection) -> KeyRing:
    """A fresh Ed25519 key pair for every node; :class:`KeysError` for more than :data:`MAX_KEYED_NODES`
    nodes, before any is made."""
    nodes = 1 + topology.cells + len(topology.devices())  # counted, not listed: cells may be 10**8
    if nodes > MAX_KEYED_NODES:
        raise KeysError(f"topology: {nodes:,} nodes; keys are generated for at most {MAX_KEYED_NODES:,}")
    private = {node: new_seed() for node in node_ids(topology)}
    return KeyRing(private, {node: public_of(seed) for node, seed in private.items()})


def peers_of(topology: TopologySection, node: str) -> list[str]:
    """The nodes whose signatures ``node`` verifies: cloud -> cells and devices; cell -> cloud and its
    devices; device -> cloud, its cell and the other devices of its cell (secure aggregation: it checks
    its neighbours' key advertisements and views, which its cell relays, against their identities)."""
    cells = topology.cell_ids()
    if node == "cloud":
        return [*cells, *topology.all_devices()]
    if node in cells:
        return ["cloud", *topology.device_ids(node)]
    cell = topology.cell_of(node)
    if cell is not None:
        return ["cloud", cell, *(d for d in topology.device_ids(cell) if d != node)]
    raise KeysError(f"node {node!r} is not in the topology (cloud, {cells[0]}, {cells[0]}-d0, ...)")


def node_subset(ring: KeyRing, topology: TopologySection, node: str, strict: bool = True) -> KeyRing:
    """What ``node`` needs: its own private key and the public keys of itself and its peers. Not ``strict``
    (a federation whose membership changed since the file was written): peers without a key are left out,
    and their messages refused until the cloud's signed roster brings their keys."""
    wanted = [node, *peers_of(topology, node)]
    if node not in ring.private:  # walked: `fedtier cell --serve --cell c1` run in c0's bundle said only this
        held = ", ".join(repr(n) for n in ring.private)
        why = f"it holds the private key of {held}: another node's file (its bundle)?" if held else "it holds none"
        raise KeysError(f"the private key of {node!r} is missing from the keys file ({why})")
    public = dict(ring.public)
    public.setdefault(node, public_of(ring.private[node]))
    missing = [n for n in wanted if n not in public]
    if not strict:
        wanted = [n for n in wanted if n in public]
    elif missing:
        raise KeysError(
            f"public keys of {', '.join(repr(m) for m in missing)} are missing (node {node!r} verifies its peers)"
        )
    return KeyRing({node: ring.private[node]}, {n: public[n] for n in wanted})


def dump_keys(ring: KeyRing, comment: str = "") -> str:
    lines = [f"# {line}" for line in comment.splitlines()] if comment else []
    lines += ["# fedtier node identities (Ed25519): keep [private] secret", f'format = "{FORMAT}"', "", "[private]"]
    lines += [f'"{node}" = "{key.hex()}"' for node, key in ring.private.items()]
    lines += ["", "[public]"]
    lines += [f'"{node}" = "{key.hex()}"' for node, key in ring.public.items()]
    return "\n".join(lines) + "\n"


def write_keys(path: str | Path, ring: KeyRing, comment: str = "", overwrite: bool = False) -> Path:
    """Write a keys file readable by its owner only (mode 600, also when it replaces one that was not), whole or
    not at all and durably (``protocols.checkpoint.write_durably``: a crash or a full disk while a key is rotated
    or a federation's keys are rewritten leaves the old file, never a truncated one); a file replaced keeps its
    owner (a node's service user). Refuses to replace one unless ``overwrite``."""
    from ..checkpoint import write_durably  # (protocols.checkpoint reads the wire format: imported when used)

    path = Path(path)
    if not overwrite and os.path.lexists(path):
        raise KeysError(f"{path} exists (use --force to replace it)")

    def keep_owner(tmp: Path) -> None:
        try:
            st = path.stat()
            os.chown(tmp, st.st_uid, st.st_gid)
        except (FileNotFoundError, PermissionError):
            pass  # new, or not root: the file is ours

    write_durably(path, dump_keys(ring, comment).encode(), before_rename=keep_owner)
    return path


def load_keys(path: str | Path, need_private: bool = True) -> KeyRing:
    """Read a keys file; raise :class:`KeysError` naming the bad entry (or, ``need_private``, when it
    holds no private key)."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError as exc:
        raise KeysError(f"security.keys: cannot read {path}: {exc.strerror}") from None
    private, public = _load_cached(str(path.resolve()), st.st_mtime_ns, st.st_size)
    if need_private and not private:
        raise KeysError(f"security.keys: {path} has no [private] key")
    return KeyRing(dict(private), dict(public))


@lru_cache(maxsize=16)
def _load_cached(path: str, _mtime: int, _size: int) -> tuple[tuple[tuple[str, bytes], ...], ...]:
    # every node of a sim reads the same file: parse it once (a changed file has a new mtime/size)
    try:
        data = tomllib.loads(read_file(path, MAX_KEYS_BYTES).decode("utf-8"))
    except (OSError, ValueError) as exc:  # unreadable, /dev/zero, not UTF-8, not TOML
        raise KeysError(f"security.keys: {path} is not a readable TOML keys file: {exc}") from None
    if "keys" in data and "format" not in data:
        raise KeysError(
            f"security.keys: {path} holds shared HMAC keys of an older fedtier; nodes now sign with "
            f"Ed25519 identities: write a new file with `fedtier keys CONFIG --out FILE` (or `fedtier "
            f"provision`) and give each node its share again"
        )
    if data.get("format") != FORMAT:
        raise KeysError(f"security.keys: {path}: format must be {FORMAT!r}, got {data.get('format')!r}")
    tables = []
    for name in ("private", "public"):
        table = data.get(name, {})
        if not isinstance(table, dict):
            raise KeysError(f"security.keys: {path}: [{name}] must be a table")
        entries = []
        for node, value in table.items():
            try:
                key = bytes.fromhex(value) if isinstance(value, str) else b""
            except ValueError:
                key = b""
            if len(key) != KEY_BYTES:
                raise KeysError(f"security.keys: {path}: [{name}] {node!r} must be {2 * KEY_BYTES} hex digits")
            entries.append((node, key))
        tables.append(tuple(entries))
    private = dict(tables[0])
    for node, key in tables[1]:
        if node in private and public_of(private[node]) != key:
            raise KeysError(f"security.keys: {path}: the public key of {node!r} does not match its private key")
    return tables[0], tables[1]


class VerifiedSignatures:
    """The last ``size`` signatures found valid, keyed by content: (public key, signature, sha256 of
    the signed bytes). A process whose many nodes receive the same record (every agent of a worker
    reads the cloud's manifest; a cell re-reads each device's unchanged heartbeat) checks it once.
    Only valid signatures are remembered, and a hit needs the same key, signature and bytes, so a
    forged or altered message always reaches the real check. Thread-safe."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._seen: OrderedDict[tuple[bytes, bytes, bytes], None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, public: bytes, key: Ed25519PublicKey, sig: bytes, data: bytes) -> None:
        """``key.verify(sig, data)`` unless this exact (key, signature, data) was valid before."""
        entry = (public, bytes(sig), hashlib.sha256(data).digest())
        with self._lock:
            if entry in self._seen:
                self._seen.move_to_end(entry)
                return
        key.verify(sig, data)  # raises InvalidSignature
        with self._lock:
            self._seen[entry] = None
            while len(self._seen) > self.size:
                self._seen.popitem(last=False)


VERIFIED = VerifiedSignatures()
"""This process's cache of valid signatures (shared by every :class:`Trust` in it)."""


class PublicKeys:
    """Verifies nodes' signatures with their public keys only: a reader such as ``fedtier monitor``."""

    def __init__(self, public: Mapping[str, bytes]) -> None:
        for n, k in public.items():
            if len(k) != KEY_BYTES:
                raise KeysError(f"the public key of {n!r} is not {KEY_BYTES} bytes")
        self._raw = {n: bytes(k) for n, k in public.items()}
        self._public: dict[str, Ed25519PublicKey] = {}  # parsed on first use (a device knows its whole cell)
        self.revoked: set[str] = set()  # forgotten nodes: what they sign is refused as revoked
        self.verified = VERIFIED

    @property
    def peers(self) -> list[str]:
        """Every node whose signatures this node can check (itself included)."""
        return list(self._raw)

    def learn(self, public: Mapping[str, bytes]) -> None:
        """Trust these nodes' keys too (members enrolled after this node's keys file was written: the
        cloud's signed roster names them)."""
        for node, key in public.items():
            if len(key) != KEY_BYTES:
                raise KeysError(f"the public key of {node!r} is not {KEY_BYTES} bytes")
            if self._raw.get(node) != bytes(key):
                self._raw[node] = bytes(key)
                self._public.pop(node, None)

    def forget(self, nodes: Iterable[str]) -> None:
        """Stop trusting these nodes (revoked): their signatures no longer verify (``RejectKind.REVOKED``)."""
        for node in nodes:
            self._raw.pop(node, None)
            self._public.pop(node, None)
            self.revoked.add(node)

    def require(self, node: str) -> None:
        """Raise :class:`WireError` unless ``node``'s key is known (``REVOKED`` for a forgotten one)."""
        if node not in self._raw:
            raise self._refusal(node)

    def _refusal(self, node: str) -> WireError:
        if node in self.revoked:
            return WireError(RejectKind.REVOKED, f"signer {node!r} was revoked")
        return WireError(RejectKind.UNKNOWN_SENDER, f"unknown signer {node!r}")

    def verify(self, signer: str, data: bytes, sig: bytes) -> None:
        """Raise :class:`WireError` unless ``sig`` is ``signer``'s signature of ``data``. Safe against a
        :meth:`forget` on another thread (the network thread checks chunks): the key is read once."""
        raw = self._raw.get(signer)
        if raw is None:
            raise self._refusal(signer)
        key = self._public.get(signer)
        if key is None:
            key = self._public[signer] = Ed25519PublicKey.from_public_bytes(raw)
        try:
            self.verified.check(raw, key, sig, data)
        except InvalidSignature:
            raise WireError(RejectKind.SIGNATURE, f"bad signature: not signed by {signer!r}") from None


class Trust(PublicKeys):
    """One node's identity: signs with its private key, verifies its peers with their public keys.

    Also the chunk authenticator of ``protocols.wire.chunking`` (``node``, ``sign``, ``verify``).
    """

    def __init__(self, node: str, seed: bytes, public: Mapping[str, bytes]) -> None:
        super().__init__(public)
        self.node = node
        self._private = Ed25519PrivateKey.from_private_bytes(seed)

    def sign(self, data: bytes) -> bytes:
        """A 64-byte Ed25519 signature of ``data``."""
        return self._private.sign(data)


def node_trust(cfg: RunConfig, node: str) -> Trust | None:
    """``node``'s identity and its peers' public keys from ``[security] keys``; ``None`` when not configured."""
    path = cfg.security.keys
    if not path:
        return None
    # a federation's membership changes while it runs: the roster brings the keys its members' files lack
    ring = node_subset(load_keys(path), cfg.topology, node, strict=cfg.security.membership == "static")
    return Trust(node, ring.private[node], ring.public)


def load_public_keys(path: str | Path) -> PublicKeys:
    """The public keys of a keys file (any node's share, or the run's whole file): a verifier for a
    reader that signs nothing. Raises :class:`KeysError` for a bad file or one without public keys."""
    ring = load_keys(path, need_private=False)
    public = {**{n: public_of(k) for n, k in ring.private.items()}, **ring.public}
    if not public:
        raise KeysError(f"{path} holds no public keys")
    return PublicKeys(public)


def with_run_keys(cfg: RunConfig, out: Path, resume: bool = False) -> RunConfig:
    """``cfg`` with usable keys for a one-machine run (``fedtier sim`` / ``run``): when the configured
    keys file does not exist, fresh keys for the whole topology go to ``out/keys.toml`` and the returned
    config points there (absolute path); a ``resume`` keeps the ones it generated there before (its nodes'
    identities do not change, and what the broker retained of them still verifies). Unchanged without
    ``[security] keys`` or when the file exists."""
    path = cfg.security.keys
    if not path or Path(path).exists():
        return cfg
    target = (out / KEYS_FILE).resolve()
    if resume and target.exists():
        return cfg.model_copy(update={"security": cfg.security.model_copy(update={"keys": str(target)})})
    write_keys(target, generate_keys(cfg.topology), comment=f"generated for run {cfg.run.name!r}", overwrite=True)
    log.warning(
        "security.keys: %s does not exist: this run's keys are generated in %s (fedtier monitor --keys)", path, target
    )
    return cfg.model_copy(update={"security": cfg.security.model_copy(update={"keys": str(target)})})
