"""Per-node signing keys: one HMAC-SHA256 key per node of a run (``cloud``, each cell, each device).

A keys file is TOML::

    [keys]
    "cloud" = "64 hex digits"
    "c0" = "..."
    "c0-d0" = "..."

With ``[security] keys = "path"`` every node signs what it sends with its own key and requires valid
signatures from the peers it listens to: a device from its cell, a cell from its devices and the cloud,
the cloud from its cells (:func:`node_trust`). :func:`node_subset` is what a node's own file needs to
hold, so a device never holds another device's key. Keys come from ``os.urandom``: secrets are not
model randomness and never touch ``protocols.seeding``.
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from ..config import ConfigError

if TYPE_CHECKING:
    from ..config import RunConfig, TopologySection

KEY_BYTES = 32
MIN_KEY_BYTES = 16
KEYS_FILE = "keys.toml"


class KeysError(ConfigError):
    """A missing, unreadable or incomplete keys file (the text says which key or line)."""


def node_ids(topology: "TopologySection") -> list[str]:
    """Every node of a topology: ``cloud``, the cells, the devices."""
    return ["cloud", *topology.cell_ids(), *topology.all_devices()]


def generate_keys(topology: "TopologySection") -> dict[str, bytes]:
    """A fresh random key for every node."""
    return {node: os.urandom(KEY_BYTES) for node in node_ids(topology)}


def peers_of(topology: "TopologySection", node: str) -> list[str]:
    """The nodes whose messages ``node`` verifies: cloud -> cells; cell -> cloud and its devices;
    device -> its cell."""
    cells = topology.cell_ids()
    if node == "cloud":
        return cells
    if node in cells:
        return ["cloud", *topology.device_ids(node)]
    cell = topology.cell_of(node)
    if cell is not None:
        return [cell]
    raise KeysError(f"node {node!r} is not in the topology (cloud, {cells[0]}, {cells[0]}-d0, ...)")


def node_subset(keys: Mapping[str, bytes], topology: "TopologySection", node: str) -> dict[str, bytes]:
    """The keys ``node`` needs: its own and its peers'."""
    wanted = [node, *peers_of(topology, node)]
    missing = [n for n in wanted if n not in keys]
    if missing:
        raise KeysError(f"keys for {', '.join(repr(m) for m in missing)} are missing (node {node!r} needs "
                        f"its own and its peers' keys)")
    return {n: keys[n] for n in wanted}


def dump_keys(keys: Mapping[str, bytes], comment: str = "") -> str:
    lines = [f"# {line}" for line in comment.splitlines()] if comment else []
    lines.append("# fedtier signing keys (HMAC-SHA256): keep this file secret")
    lines.append("[keys]")
    lines.extend(f'"{node}" = "{key.hex()}"' for node, key in keys.items())
    return "\n".join(lines) + "\n"


def write_keys(path: str | Path, keys: Mapping[str, bytes], comment: str = "", overwrite: bool = False) -> Path:
    """Write a keys file readable by its owner only; refuses to replace one unless ``overwrite``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise KeysError(f"{path} exists (use --force to replace it)") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(dump_keys(keys, comment))
    return path


def load_keys(path: str | Path) -> dict[str, bytes]:
    """Read a keys file; raise :class:`KeysError` naming the bad entry."""
    path = Path(path)
    st = _stat(path)
    return dict(_load_cached(str(path.resolve()), st.st_mtime_ns, st.st_size))


def _stat(path: Path) -> os.stat_result:
    try:
        return path.stat()
    except OSError as exc:
        raise KeysError(f"security.keys: cannot read {path}: {exc.strerror}") from None


@lru_cache(maxsize=16)
def _load_cached(path: str, _mtime: int, _size: int) -> tuple[tuple[str, bytes], ...]:
    # every node of a sim reads the same file: parse it once (a changed file has a new mtime/size)
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise KeysError(f"security.keys: {path} is not a readable TOML keys file: {exc}") from None
    table = data.get("keys")
    if not isinstance(table, dict) or not table:
        raise KeysError(f"security.keys: {path} has no [keys] table")
    keys = []
    for node, value in table.items():
        try:
            key = bytes.fromhex(value) if isinstance(value, str) else b""
        except ValueError:
            key = b""
        if len(key) < MIN_KEY_BYTES:
            raise KeysError(f"security.keys: {path}: key of {node!r} must be at least {MIN_KEY_BYTES} bytes "
                            f"as hex digits ({2 * KEY_BYTES} for the {KEY_BYTES} bytes `fedtier keys` writes)")
        keys.append((node, key))
    return tuple(keys)


@dataclass(frozen=True)
class Trust:
    """What one node signs with and whose signatures it requires."""

    sign_key: bytes
    peers: dict[str, bytes]


def node_trust(cfg: "RunConfig", node: str) -> Trust | None:
    """``node``'s signing key and its peers' keys from ``[security] keys``; ``None`` when not configured."""
    path = cfg.security.keys
    if not path:
        return None
    keys = node_subset(load_keys(path), cfg.topology, node)
    return Trust(keys.pop(node), keys)


def with_run_keys(cfg: "RunConfig", out: Path) -> "RunConfig":
    """``cfg`` with usable keys for a one-machine run (``fedtier sim`` / ``run``): when the configured
    keys file does not exist, fresh keys for the whole topology go to ``out/keys.toml`` and the returned
    config points there (absolute path). Unchanged without ``[security] keys`` or when the file exists."""
    path = cfg.security.keys
    if not path or Path(path).exists():
        return cfg
    target = (out / KEYS_FILE).resolve()
    write_keys(target, generate_keys(cfg.topology), comment=f"generated for run {cfg.run.name!r}", overwrite=True)
    return cfg.model_copy(update={"security": cfg.security.model_copy(update={"keys": str(target)})})
