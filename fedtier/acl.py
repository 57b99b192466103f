"""Who may read and write which topic at a provisioned broker: the Mosquitto ACL of a deployment.

The ACL follows the topic map (docs/reference/topics.md): a device reads only its own task and the run's control
records (``cloud/control``, ``cloud/round``, ``status/cloud``) and writes only its own result and
status (under its cell); a cell reads its cell task, its devices' results and statuses and the cloud's
status, and writes its devices' tasks, its report, its status and telemetry; the cloud what it orchestrates.
The operator submits jobs; the monitor only reads. A bridge of a per-cell broker may carry exactly its cell's
bridged topics (``protocols/transport/bridge.py``).
"""

from __future__ import annotations

from protocols.config import RunConfig
from protocols.jobs import OPERATOR
from protocols.roster import roster_topic
from protocols.transport.bridge import bridge_topics
from protocols.wire import topics

MONITOR = "monitor"

Grants = list[tuple[str, str]]
"""``[(access, topic pattern)]``, ``access`` in read, write, readwrite."""


def _cloud(run: str) -> Grants:
    return [
        ("write", f"{topics.root(run)}/cell/+/down/task"),
        ("read", topics.cell_reports(run)),
        ("readwrite", topics.control(run)),
        ("readwrite", topics.round_manifest(run)),
        ("read", topics.statuses(run)),
        ("write", topics.status(run, "cloud")),
        ("write", topics.telemetry_cloud(run)),
        ("read", topics.telemetry_cell(run, "+")),  # every cell's records, into the cloud's run folder
        ("write", topics.state(run, "cloud")),
        ("read", topics.job_submit(run)),
        ("write", topics.job_replies(run)),
        ("readwrite", topics.job_list(run)),  # read: what the broker holds there is its own (cloud.kept_records)
        ("readwrite", topics.current_job(run)),
        ("readwrite", roster_topic(run)),
    ]


def _operator(run: str) -> Grants:
    return [
        ("write", topics.job_submit(run)),
        ("readwrite", roster_topic(run)),
        ("read", topics.job_replies(run)),
        ("read", topics.job_list(run)),
        ("read", topics.current_job(run)),
        ("read", roster_topic(run)),
        ("read", topics.status(run, "cloud")),  # fedtier jobs: is the list it reads the live cloud's?
    ]


def _monitor(run: str) -> Grants:
    return [
        ("read", f"{topics.root(run)}/telemetry/#"),
        ("read", topics.states(run)),
        ("read", topics.statuses(run)),
        ("read", topics.device_statuses(run)),
        ("read", topics.round_manifest(run)),
        ("read", topics.control(run)),
        ("read", topics.current_job(run)),
        ("read", topics.job_list(run)),
        ("read", roster_topic(run)),
    ]


def _cell(run: str, cell: str) -> Grants:
    return [
        ("read", topics.cell_task(run, cell)),
        ("write", f"{topics.root(run)}/cell/{cell}/down/+/task"),
        ("read", topics.device_results(run, cell)),
        ("write", topics.cell_report(run, cell)),
        ("read", topics.control(run)),
        ("read", topics.round_manifest(run)),
        ("readwrite", topics.device_statuses(run, cell)),  # write: clears a revoked device's status
        ("read", topics.status(run, "cloud")),
        ("readwrite", topics.status(run, topics.cell_node(cell))),  # read: another process of it (protocols.twin)
        ("write", topics.telemetry_cell(run, cell)),
        ("write", topics.state(run, topics.cell_node(cell))),
        ("read", topics.current_job(run)),
        ("read", roster_topic(run)),
    ]


def _device(run: str, cell: str, device: str) -> Grants:
    return [
        ("read", topics.device_task(run, cell, device)),
        ("write", topics.device_result(run, cell, device)),
        ("read", topics.control(run)),
        ("read", topics.round_manifest(run)),
        ("read", topics.status(run, "cloud")),
        ("readwrite", topics.device_status(run, cell, device)),  # read: another agent under its id (protocols.twin)
        ("read", topics.current_job(run)),
        ("read", roster_topic(run)),
    ]


def acl_rules(cfg: RunConfig) -> dict[str, Grants]:
    """Per broker user (node id): ``[(access, topic pattern)]``, ``access`` in read, write, readwrite."""
    run = cfg.run.name
    rules = {"cloud": _cloud(run), OPERATOR: _operator(run), MONITOR: _monitor(run)}
    for cell in cfg.topology.cell_ids():
        rules[cell] = _cell(run, cell)
        for device in cfg.topology.device_ids(cell):
            rules[device] = _device(run, cell, device)
    return rules


def acl_file(rules: dict[str, Grants]) -> str:
    """Mosquitto ``acl_file`` text: anything not granted is denied."""
    lines = ["# fedtier ACL (fedtier provision): anything not listed is denied"]
    for user, grants in rules.items():
        lines += ["", f"user {user}", *(f"topic {access} {pattern}" for access, pattern in grants)]
    return "\n".join(lines) + "\n"


def bridge_user(cell: str) -> str:
    """The user name the bridge of ``cell``'s broker logs in with at the cloud broker."""
    return f"bridge.{cell}"


def bridge_rules(run: str, cell: str) -> Grants:
    """The cloud broker's ACL for ``cell``'s bridge: exactly the bridged topics (``in``: the bridge
    subscribes, ``out``: it publishes)."""
    return [("read" if t.direction == "in" else "write", t.pattern) for t in bridge_topics(run, cell)]
