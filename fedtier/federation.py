"""What ``fedtier provision`` records of a federation in ``OUT`` (``federation.json``: the deployment config
and the provisioning parameters; ``roster.json``: the signed roster), and reading it back. Shared by
provisioning (which records it) and ``fedtier.membership`` (which changes it)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocols.checkpoint import write_durably
from protocols.config import ConfigError, RunConfig, TopologySection, parse_config
from protocols.roster import Roster, RosterError, sign_roster, verify_roster
from protocols.wire.keys import KeyRing, PublicKeys, Trust, load_keys, write_keys

STATE_FILE = "federation.json"
ROSTER_FILE = "roster.json"
FORMAT = "fedtier-federation/1"


class MembershipError(ConfigError):
    """A membership change that cannot be made (the text says why); nothing was changed."""


@dataclass
class Federation:
    """What ``OUT`` holds of a provisioned federation."""

    out: Path
    cfg: RunConfig
    params: dict[str, Any]
    ring: KeyRing
    roster: Roster
    revoked_serials: list[int]

    @property
    def name(self) -> str:
        return self.cfg.run.name


# ------------------------------------------------------------------------------------------ records
def _write(path: Path, data: bytes | str, secret: bool = False) -> None:
    """Replace ``path`` atomically and durably (``protocols.checkpoint.write_durably``; ``secret``: mode 600), keeping
    its owner (a broker that dropped to its user must still read it)."""

    def keep_owner(tmp: Path) -> None:
        if path.exists():
            st = path.stat()
            try:
                os.chown(tmp, st.st_uid, st.st_gid)
            except PermissionError:
                pass  # not root: the file stays ours, as it was

    write_durably(path, data.encode() if isinstance(data, str) else data, private=secret, before_rename=keep_owner)


def _sign(ring: KeyRing, roster: Roster) -> bytes:
    return sign_roster(roster, Trust("cloud", ring.private["cloud"], {"cloud": ring.public["cloud"]}).sign)


def _members(topology: TopologySection) -> dict[str, list[str]]:
    return {c: list(topology.device_ids(c)) for c in topology.cell_ids()}


def first_roster(cfg: RunConfig, ring: KeyRing, max_device_weight: float | None) -> Roster:
    """Version 1 of the roster of ``cfg``'s topology, with ``ring``'s public keys."""
    bound = max_device_weight or cfg.security.max_device_weight or 1e12
    return Roster.from_topology(cfg.run.name, _members(cfg.topology), ring.public, float(bound))


def check_roster_fits(ring: KeyRing, roster: Roster, max_chunk: int) -> None:
    """Raise :class:`ConfigError` saying the ``--max-chunk`` it needs when ``roster``, signed, is larger than one
    chunk: it travels retained, and a retained record is one message (``MqttTransport.publish`` refuses more, and
    the broker's ``max_packet_size`` is a chunk and 4 KiB)."""
    size, devices = len(_sign(ring, roster)), sum(len(roster.members(c)) for c in roster.cells)
    if size > max_chunk:
        need = -(-size * 5 // 4 // 65536) * 65536  # a quarter more, for the devices enrolled later, in 64 KiB
        raise ConfigError(
            f"the federation's signed roster of {devices:,} devices is {size:,} bytes, more than one chunk "
            f"(--max-chunk {max_chunk:,}) can carry: it travels retained, as one message; the federation needs "
            f"--max-chunk {need} or more (fedtier provision --max-chunk)"
        )


def record_federation(out: Path, cfg: RunConfig, ring: KeyRing, params: dict[str, Any]) -> None:
    """Called by ``provision``: the state file and the first roster (version 1)."""
    roster = first_roster(cfg, ring, params.get("max_device_weight"))
    _save(Federation(Path(out), cfg, params, ring, roster, []), keys=False)


def _save(fed: Federation, keys: bool = True) -> None:
    state = {
        "format": FORMAT,
        "config": fed.cfg.to_toml(),
        "params": fed.params,
        "revoked_serials": fed.revoked_serials,
    }
    _write(fed.out / STATE_FILE, json.dumps(state, indent=2) + "\n", secret=True)
    data = _sign(fed.ring, fed.roster)
    _write(fed.out / ROSTER_FILE, data)
    if (fed.out / "nodes" / "cloud").is_dir():
        _write(fed.out / "nodes" / "cloud" / ROSTER_FILE, data)
    if keys:
        write_keys(
            fed.out / "keys.toml", fed.ring, comment=f"all identities of {fed.name!r} (keep offline)", overwrite=True
        )


def load_federation(out: str | Path) -> Federation:
    """The provisioned federation in ``out``; :class:`MembershipError` if it is not one."""
    import tomllib

    out = Path(out)
    try:
        state = json.loads((out / STATE_FILE).read_text())
        if state.get("format") != FORMAT:
            raise ValueError(f"format {state.get('format')!r}")
        cfg = parse_config(tomllib.loads(state["config"]))
        ring = load_keys(out / "keys.toml")
        roster = verify_roster(
            (out / ROSTER_FILE).read_bytes(), PublicKeys({"cloud": ring.public["cloud"]}).verify, federation=None
        )
    except (OSError, ValueError, KeyError, RosterError, tomllib.TOMLDecodeError) as exc:
        raise MembershipError(
            f"{out} is not a provisioned federation of this version ({type(exc).__name__}: {exc}); "
            f"provision it with `fedtier provision CONFIG --out {out}`"
        ) from None
    return Federation(out, cfg, dict(state["params"]), ring, roster, list(state.get("revoked_serials", [])))
