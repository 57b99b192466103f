"""The folder of a provisioned Mosquitto broker: its TLS listener, logins, ACL, persistence and bridge.

:func:`write_broker` writes ``server.crt``/``.key``, ``ca.crt``, ``ca.crl``, ``acl``, ``listener.conf`` (the
listener's options alone) and ``mosquitto.conf``; a login is a client certificate (no password file: see
:func:`listener_options`);
:func:`relocate` points them at a moved folder; :func:`reload_brokers` makes running brokers reread them
(SIGHUP); :func:`broker_user_for_root` picks the user a broker started as root drops to.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

from protocols.config import ConfigError
from protocols.transport.broker import AUTOSAVE_INTERVAL

from .acl import Grants, acl_file
from .file_reads import watch_reads
from .pki import CertificateAuthority, write_file

PERSISTENCE = f"persistence true\npersistence_location {{data}}/\nautosave_interval {AUTOSAVE_INTERVAL}\n"
"""A provisioned broker keeps its sessions, subscriptions, queued and retained messages across a restart
(``data/mosquitto.db``, saved every minute and at a clean stop), as the broker of ``fedtier run`` does:
with the nodes' persistent sessions a broker crash loses nothing but what it acknowledged in its last
minute and had not yet delivered, and what it never acknowledged its publishers re-send. Each save rewrites
the whole database, changed or not (fsynced; an edge server's flash wears): every second, as before, that was
86 GB an hour with 48 MB queued for devices that are away (:data:`~protocols.transport.broker.AUTOSAVE_INTERVAL`).
An operator may change ``autosave_interval`` in ``mosquitto.conf`` (nothing of fedtier rewrites that line).
No ``persistent_client_expiration``: Mosquitto (2.0.11 checked, the code is the same
up to 2.0.18) reloaded (SIGHUP: ``provision add-device|revoke|renew``, a log rotation) disconnects each
session that is away once more and, with that option, lists it for expiry twice; when its node comes back
the session is freed but stays listed, and the broker later expires a live client or crashes (SIGSEGV).
A session of a device gone for good stays (its queue bounded by :data:`MAX_QUEUED_BYTES`)."""
MAX_QUEUED_BYTES = 512 * 1024 * 1024
"""What a broker queues at most for one client that is away (``max_queued_bytes``, besides
``max_queued_messages``): a node that floods an offline peer's topics costs the broker this much, not gigabytes."""


def listener_options(max_packet_size: int) -> str:
    """The options that follow the ``listener`` line (paths relative to the broker folder's files:
    the caller substitutes absolute paths).

    A login is tied to its node: the broker takes the user name from the client certificate's common name
    (the node id, ``use_identity_as_username``: the certificate's private key is the credential) and the
    client id from the user name (``use_username_as_clientid``), so a node's persistent session (client id
    ``fedtier-{run}-{node}`` on the wire) is keyed by the node's own identity at the broker: no other
    node's credentials can connect under it, kick it off or inherit or wipe its session. A certificate
    listed in the CA's revocation list (``ca.crl``, ``renewal.renew``) is refused.

    There are no broker passwords: under ``use_identity_as_username`` Mosquitto (2.0.11 checked) never checks
    one (a wrong or missing password logs in all the same), so provisioning writes no password file and hands
    out none; a login holds against anyone without a node's certificate key, and a node with valid
    credentials logs in only as itself."""
    return (
        "cafile {dir}/ca.crt\ncertfile {dir}/server.crt\nkeyfile {dir}/server.key\ncrlfile {dir}/ca.crl\n"
        "require_certificate true\nuse_identity_as_username true\nuse_username_as_clientid true\n"
        "acl_file {dir}/acl\n"
        f"max_packet_size {max_packet_size}\n"
    )


def write_broker(
    folder: Path,
    title: str,
    pki: CertificateAuthority,
    host: str,
    port: int,
    max_packet: int,
    rules: dict[str, Grants],
    extra: str = "",
    broker_user: str | None = None,
    bind: str = "",
) -> None:
    """One broker folder: server certificate, CA, revocation list, ACL, listener.conf, mosquitto.conf.
    With ``broker_user`` (as root), the broker's secrets are chowned to that user and the config says
    ``user NAME``: Mosquitto started as root drops to it and reads the bridge key after that."""
    pki.issue(folder, "server", host, hosts=tuple(dict.fromkeys((host, "127.0.0.1", "localhost"))))
    write_file(folder / "ca.crl", pki.crl([]))
    write_file(folder / "acl", acl_file(rules))
    options = listener_options(max_packet).replace("{dir}", str(folder.resolve()))
    write_file(folder / "listener.conf", options)
    data = folder / "data"  # mosquitto.db: sessions, queued and retained messages (model updates: private)
    data.mkdir(mode=0o700, exist_ok=True)
    write_file(
        folder / "mosquitto.conf",  # secret: a bridge section names the bridge's key
        f"# {title} (fedtier provision)\n"
        + (f"user {broker_user}\n" if broker_user else "")
        + "per_listener_settings false\nallow_anonymous false\nset_tcp_nodelay true\n"
        f"max_queued_messages 100000\nmax_queued_bytes {MAX_QUEUED_BYTES}\nmax_inflight_messages 64\n"
        + PERSISTENCE.format(data=data.resolve())
        + f"pid_file {data.resolve()}/mosquitto.pid\n"  # `fedtier provision add-device|revoke` reload it (SIGHUP)
        + f"listener {port}{' ' + bind if bind else ''}\n{options}"
        + (f"\n{extra}\n" if extra else ""),
        secret=True,
    )
    if broker_user:
        try:
            for f in folder.iterdir():
                shutil.chown(f, user=broker_user)
        except (PermissionError, LookupError) as exc:
            raise ConfigError(
                f"cannot give {folder} to broker user {broker_user!r} ({exc}): "
                "run provision as root, with an existing user"
            ) from None


def reload_brokers(folders: list[Path]) -> list[str]:
    """SIGHUP each running Mosquitto of ``folders`` (its ``data/mosquitto.pid``): it rereads its ACL and CRL
    files and its server certificate and key (Mosquitto 2.0.11 checked: ``tests/test_tls_reload.py``).
    Returns what was done, one line a broker (a stopped broker takes them when it starts). A pid file left by a
    broker that did not stop cleanly may name another process now: only a Mosquitto is signalled."""
    done = []
    for folder in folders:
        pid_file = folder / "data" / "mosquitto.pid"
        healed = _drop_session_expiry(folder / "mosquitto.conf")
        try:
            pid = int(pid_file.read_text().strip())
            if not _is_mosquitto(pid):
                done.append(
                    f"the broker in {folder} is not running (stale {pid_file}): it takes the change when it starts"
                )
                continue
            done.append(_reload(folder, pid) + healed)
        except (OSError, ValueError):
            done.append(f"the broker in {folder} is not running: it takes the change when it starts")
    return done


RELOAD_WAIT = 10.0
"""How long :func:`reload_brokers` waits for a broker it signalled to reread its revocation list and ACL."""


def _reload(folder: Path, pid: int) -> str:
    """SIGHUP broker ``pid`` and wait until it has reread ``folder``'s revocation list and ACL (it does so in its own
    loop, moments later: a revoked certificate logged in right after the signal); what happened, in a line."""
    with watch_reads([f for f in (folder / "ca.crl", folder / "acl") if f.exists()]) as reread:
        os.kill(pid, signal.SIGHUP)
        took = reread(RELOAD_WAIT)
    if took is False:
        return (
            f"signalled the broker in {folder} to reload (pid {pid}, SIGHUP) but it did not reread its files within "
            f"{RELOAD_WAIT:.0f} s: see its log"
        )
    return f"reloaded the broker in {folder} (pid {pid})" + ("" if took else ", SIGHUP: its rereading not watched")


def _drop_session_expiry(conf: Path) -> str:
    """Remove the ``persistent_client_expiration`` line that provisioning wrote before (a reload with it can crash
    Mosquitto: :data:`PERSISTENCE`) from ``conf``, in place (its owner, the broker's user, and mode kept), before
    the reload rereads it; what was done, to add to the reload's line ("" when nothing)."""
    try:
        lines = conf.read_text().splitlines(keepends=True)
        kept = [line for line in lines if not line.startswith("persistent_client_expiration")]
        if len(kept) == len(lines):
            return ""
        conf.write_text("".join(kept))
    except OSError as exc:
        return f"; could not remove persistent_client_expiration from {conf} ({exc}): remove it by hand"
    return f"; removed persistent_client_expiration from {conf} (a reload with it can crash Mosquitto)"


def _is_mosquitto(pid: int) -> bool:
    """Whether process ``pid`` runs Mosquitto (its command line, on Linux; where there is no ``/proc``, assumed)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    try:
        argv0 = (proc / str(pid) / "cmdline").read_bytes().split(b"\0", 1)[0]
    except OSError:  # no such process
        return False
    return Path(os.fsdecode(argv0)).name.startswith("mosquitto")


def cell_ports(cells: list[str], first: int) -> dict[str, int]:
    """Each cell broker's TLS port: ``first`` for the first cell, then +1 per cell (in topology order),
    so per-cell brokers provisioned on one host each listen on their own port."""
    ports = {cell: first + i for i, cell in enumerate(cells)}
    if ports and (first < 1 or max(ports.values()) > 65535):
        raise ConfigError(f"cell broker ports {first}..{first + len(cells) - 1} are outside 1..65535 (--cell-port)")
    return ports


def broker_folders(out: Path) -> list[Path]:
    """The broker folders of provisioning folder ``out``: ``broker`` (the cloud's, or the shared one) and each cell's
    ``cells/<cell>`` (per-cell brokers), those that hold a ``mosquitto.conf``."""
    return [d for d in (out / "broker", *sorted((out / "cells").glob("*"))) if (d / "mosquitto.conf").is_file()]


BROKER_CONFIGS = ("mosquitto.conf", "listener.conf")
"""The files of a broker folder that name its files by absolute path (see :func:`relocate`)."""


def relocate(out: str | Path) -> list[Path]:
    """Point the broker configs of a moved provisioning folder ``out`` at where their files are now.

    Mosquitto resolves a relative path in its config against its working directory, not the config's
    folder, so provision writes absolute paths (``acl_file /old/DIR/broker/acl``); after the
    folder moved, this rewrites every broker folder's (``broker``, ``cells/*``) configs from the folder
    they name (read off their ``acl_file`` line) to the broker folder's current absolute path,
    owner and mode kept. Returns the broker folders rewritten (none if nothing moved)."""
    out = Path(out)
    folders = broker_folders(out)
    if not folders:
        raise ConfigError(f"{out} holds no provisioned broker (no broker/mosquitto.conf)")
    moved = []
    for folder in folders:
        conf = (folder / "mosquitto.conf").read_text()
        named = [line.split(" ", 1)[1] for line in conf.splitlines() if line.startswith("acl_file ")]
        if len(named) != 1 or not named[0].endswith("/acl"):
            raise ConfigError(f"{folder / 'mosquitto.conf'} is not a fedtier broker config (one acl_file line)")
        old, new = named[0][: -len("/acl")], str(folder.resolve())
        if old == new:
            continue
        for name in BROKER_CONFIGS:
            path = folder / name
            if path.is_file():  # write_file truncates in place: the file keeps its owner (a broker user's)
                write_file(path, path.read_text().replace(f"{old}/", f"{new}/"), secret=name == "mosquitto.conf")
        moved.append(folder)
    return moved


MOSQUITTO_USER = "mosquitto"
"""The service user of Debian's (and most distributions') Mosquitto package."""


def broker_user_for_root(broker_user: str | None) -> tuple[str | None, str | None]:
    """The broker user to provision for, and a warning if any. Mosquitto started as root drops to its
    service user (``mosquitto``, unless its config says ``user``) before it reads its ACL, revocation
    list and keys: files written by root with mode 0600 are then unreadable. So as root without
    ``--broker-user``, default to the ``mosquitto`` user when it exists, else warn with the fix."""
    import pwd

    if broker_user is not None or os.geteuid() != 0:
        return broker_user, None
    try:
        pwd.getpwnam(MOSQUITTO_USER)
    except KeyError:
        return None, (
            f"provisioning as root without --broker-user and there is no {MOSQUITTO_USER!r} user: the broker "
            "files are root's (mode 0600), and Mosquitto started as root cannot read them once it drops its "
            "privileges; give --broker-user USER (the user the broker runs as)"
        )
    return MOSQUITTO_USER, (
        f"provisioning as root without --broker-user: the broker files go to user {MOSQUITTO_USER!r} and the "
        f"configs say 'user {MOSQUITTO_USER}' (Mosquitto drops to it); give --broker-user to choose another"
    )
