"""Mosquitto bridge configuration: one broker per cell, bridged to the cloud broker.

At fleet scale each cell runs its own broker next to its cell server; its devices talk only to it.
The cell broker opens a bridge connection to the cloud broker that carries exactly the cell <-> cloud
topics of ``protocols.wire.topics`` (and nothing of its devices):

=========================================  =====  ==========================================
topic                                      dir.   what
=========================================  =====  ==========================================
``fedtier/{run}/cell/{cell}/down/task``    in     the cloud's task for this cell
``fedtier/{run}/cloud/round``              in     the cloud's round manifest (retained)
``fedtier/{run}/cloud/control``            in     run control, e.g. ``finished`` (retained)
``fedtier/{run}/status/cloud``             in     the cloud's liveness (retained)
``fedtier/{run}/cloud/job``                in     the job in progress (retained)
``fedtier/{run}/roster``                   in     the federation's signed roster (retained)
``fedtier/{run}/cloud/up/{cell}/report``   out    the cell's report to the cloud
``fedtier/{run}/status/cell.{cell}``       out    the cell's liveness (retained)
``fedtier/{run}/telemetry/cell/{cell}``    out    the cell's aggregation records
``fedtier/{run}/state/cell.{cell}``        out    the cell's current state (retained)
=========================================  =====  ==========================================

``in`` = from the cloud broker into the cell broker. The bridge session is persistent
(``cleansession false``), so what is published while the bridge is down waits on the other side
and crosses when it is back; the bridge reconnects with backoff (``restart_timeout``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..roster import roster_topic
from ..wire import topics
from .broker import parse_broker_url


@dataclass(frozen=True)
class BridgeTopic:
    pattern: str
    direction: str  # "in" (cloud -> cell broker) or "out" (cell -> cloud broker)
    qos: int = 1


def bridge_topics(run: str, cell: str) -> list[BridgeTopic]:
    """The topics that cross the bridge of ``cell``'s broker (see the table above)."""
    return [
        BridgeTopic(topics.cell_task(run, cell), "in"),
        BridgeTopic(topics.round_manifest(run), "in"),
        BridgeTopic(topics.control(run), "in"),
        BridgeTopic(topics.status(run, "cloud"), "in"),
        BridgeTopic(topics.current_job(run), "in"),
        BridgeTopic(roster_topic(run), "in"),
        BridgeTopic(topics.cell_report(run, cell), "out"),
        BridgeTopic(topics.status(run, topics.cell_node(cell)), "out"),
        BridgeTopic(topics.telemetry_cell(run, cell), "out"),
        BridgeTopic(topics.state(run, topics.cell_node(cell)), "out"),
    ]


def bridge_config(
    run: str,
    cell: str,
    cloud_url: str,
    *,
    username: str | None = None,
    password: str | None = None,
    cafile: str | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
    restart: tuple[float, float] = (1.0, 30.0),
) -> str:
    """The Mosquitto config lines of ``cell``'s broker that bridge it to the cloud broker at
    ``cloud_url`` (``mqtt://`` or ``mqtts://host:port``), to append to the cell broker's
    ``mosquitto.conf``. Credentials and TLS files are those the bridge presents to the cloud broker."""
    topics.check_name("cell", cell)
    host, port = parse_broker_url(cloud_url)
    lines = [
        f"# fedtier: bridge of cell {cell} (run {run}) to the cloud broker; only cell <-> cloud topics cross",
        f"connection fedtier-{run}-bridge-{cell}",
        f"address {host}:{port}",
        f"remote_clientid fedtier-{run}-bridge.{cell}",
        "bridge_protocol_version mqttv311",
        "try_private true",
        "cleansession false",  # a dropped bridge loses nothing: both sides queue for it
        "notifications false",
        "start_type automatic",
        f"restart_timeout {restart[0]:g} {restart[1]:g}",
        "keepalive_interval 30",
    ]
    if username is not None:
        lines.append(f"remote_username {username}")
    if password is not None:
        lines.append(f"remote_password {password}")
    if cafile is not None:
        lines.append(f"bridge_cafile {cafile}")
    if certfile is not None:
        lines.append(f"bridge_certfile {certfile}")
    if keyfile is not None:
        lines.append(f"bridge_keyfile {keyfile}")
    lines += [f"topic {t.pattern} {t.direction} {t.qos}" for t in bridge_topics(run, cell)]
    return "\n".join(lines) + "\n"
