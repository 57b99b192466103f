"""Joining the Ray cluster of ``fedtier sim``'s Ray workers (``runtime.sim_backend = "ray"``, ``RayExecutor`` in
``sim/executors.py``): ``runtime.ray_address``, else Ray's own rule (``RAY_ADDRESS``, else the cluster ``ray start``
began on this machine, else a new local instance). The address is checked to accept a connection within
``CONNECT_S`` before Ray is asked to join it (Ray itself retries an unreachable one for ~13 minutes); every failure
is a ConfigError naming the address and where it came from."""

from __future__ import annotations

import logging
import os
import re
import socket
from typing import Any

from protocols.config import ConfigError

log = logging.getLogger("fedtier.sim")

CONNECT_S = 10.0  # the cluster's address must accept a connection within this
INSTALL = "pip install 'fedtier[ray]'"
STALE = (  # ray start's record (/tmp/ray/ray_current_cluster) outlives a cluster that died without `ray stop`
    '; if that cluster is gone, `ray stop` forgets it, or runtime.ray_address = "local" starts a local Ray'
)


def import_ray() -> Any:
    """The ``ray`` module, or a ConfigError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f'runtime.sim_backend = "ray" needs Ray: {INSTALL}') from None
    return ray


def _source(configured: str | None) -> str:
    """Where the address to join comes from, as a user set it."""
    if configured:
        return f"runtime.ray_address = {configured!r}"
    if os.environ.get("RAY_ADDRESS"):
        return f"RAY_ADDRESS = {os.environ['RAY_ADDRESS']!r}"
    return "the Ray cluster started on this machine (ray start)"


def cluster_address(configured: str | None) -> str | None:
    """The ``host:port`` Ray joins for ``configured`` (``None``: it starts a new local instance), checked to accept a
    TCP connection within ``CONNECT_S``; ConfigError naming the address and where it came from otherwise."""
    target: str | None
    if configured and configured.startswith("ray://"):
        target = configured.removeprefix("ray://")
    else:
        try:  # Ray's own reading of None / "auto" / RAY_ADDRESS / the address file of `ray start`
            from ray._private.services import canonicalize_bootstrap_address
        except ImportError:  # (a Ray that moved it: only an address given outright is checked)
            target = configured if configured not in (None, "auto", "local") else None
        else:
            try:
                # Ray types the address as str (None means "auto" to it); Any keeps mypy quiet with and without Ray
                target = canonicalize_bootstrap_address(_any(configured))
            except (ConnectionError, ValueError) as exc:
                raise ConfigError(f"{_source(configured)}: {exc}") from None
    if target is None:
        return None
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_S).close()
    except (OSError, ValueError) as exc:
        stale = "" if configured or os.environ.get("RAY_ADDRESS") else STALE
        raise ConfigError(
            f"{_source(configured)}: no Ray cluster answers at {target} within {CONNECT_S:g} s ({exc}); "
            f"start its head with `ray start --head` (or set runtime.ray_address to its address){stale}"
        ) from None
    return target


def connect(ray: Any, configured: str | None) -> None:
    """Join the cluster of ``configured`` (:func:`cluster_address`), or start a local Ray; ConfigError if it fails."""
    target = cluster_address(configured)
    log.info("sim: %s", f"joining the Ray cluster at {target} ({_source(configured)})" if target else "a local Ray")
    try:
        ray.init(address=configured or None, include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING)
    except Exception as exc:
        if target is None:
            raise ConfigError(f'runtime.sim_backend = "ray": cannot start a local Ray: {plain(exc)}') from None
        raise ConfigError(
            f"{_source(configured)}: cannot join the Ray cluster at {target}: {plain(exc)} (if the cluster uses token "
            "authentication, this machine needs its token: RAY_AUTH_MODE=token and RAY_AUTH_TOKEN or "
            "~/.ray/auth_token)"
        ) from None


def plain(exc: BaseException, limit: int = 400) -> str:
    """An exception of Ray's as one line for an error message: no colour codes, not its indented details (ids, pids),
    at most ``limit`` characters."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", f"{type(exc).__name__}: {exc}")
    text = " ".join(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("\t"))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _any(value: Any) -> Any:
    """``value`` typed ``Any`` (an argument to Ray, whose stubs CI does not have)."""
    return value
