"""The topic scheme. The cell is in every cell-scoped topic, so broker ACLs and wildcards work.

=============================================  ==================================  ===========
topic                                          what                                retained
=============================================  ==================================  ===========
``fedtier/{run}/cell/{cell}/down/task``        cloud -> cell task for a round      no
``fedtier/{run}/cell/{cell}/down/{dev}/task``  cell -> device task                 no
``fedtier/{run}/cell/{cell}/up/{dev}/result``  device -> cell result               no
``fedtier/{run}/cloud/up/{cell}/report``       cell -> cloud report                no
``fedtier/{run}/cloud/control``                run control (finished)              yes
``fedtier/{run}/cloud/round``                  round manifest (session, round)     yes
``fedtier/{run}/status/{node}``                liveness of the cloud and cells     yes
``fedtier/{run}/cell/{cell}/status/{node}``    liveness of the cell's devices      yes
``fedtier/{run}/telemetry/cell/{cell}``        cell aggregation records            no
``fedtier/{run}/telemetry/cloud``              cloud round records                 no
``fedtier/{fed}/cloud/job``                    the job in progress (its config)    yes
``fedtier/{fed}/jobs/submit``                  operator -> cloud: submit, cancel   no
``fedtier/{fed}/jobs/reply/{job}``             cloud -> operator: accepted or not  no
``fedtier/{fed}/jobs/list``                    every job and its state             yes
=============================================  ==================================  ===========

In a federation (``protocols.jobs``) ``{run}`` is the federation's name: every job uses the same topics.
"""

from __future__ import annotations

import re

_SAFE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def check_name(kind: str, name: str) -> str:
    """Ids go into topics, so they may not contain ``/``, ``+``, ``#`` or spaces; and into file paths (a run's
    or a job's folder), so each is one plain path component: not ``.``, ``..`` or hidden (a leading ``.``)."""
    if not isinstance(name, str) or not _SAFE.match(name) or name.startswith("."):
        raise ValueError(
            f"{kind} id {name!r} must be 1-64 characters of letters, digits, '_', '.', '-', not starting with '.'"
        )
    return name


def root(run: str) -> str:
    """The root of every topic of run ``run``."""
    return f"fedtier/{run}"


def cell_task(run: str, cell: str) -> str:
    """Cloud -> cell: the cell's task of a cloud round (the cell subscribes)."""
    return f"{root(run)}/cell/{cell}/down/task"


def device_task(run: str, cell: str, device: str) -> str:
    """Cell -> device: the device's task of an edge round (only that device may read it)."""
    return f"{root(run)}/cell/{cell}/down/{device}/task"


def device_result(run: str, cell: str, device: str) -> str:
    """Device -> cell: the device's result (only that device may write it)."""
    return f"{root(run)}/cell/{cell}/up/{device}/result"


def device_results(run: str, cell: str) -> str:
    """A cell's subscription to all its devices' results."""
    return f"{root(run)}/cell/{cell}/up/+/result"


def cell_report(run: str, cell: str) -> str:
    """Cell -> cloud: the cell's report of a cloud round."""
    return f"{root(run)}/cloud/up/{cell}/report"


def cell_reports(run: str) -> str:
    """The cloud's subscription to every cell's report."""
    return f"{root(run)}/cloud/up/+/report"


def control(run: str) -> str:
    """Cloud -> everyone: run control (``finished``, with the cloud's session), retained."""
    return f"{root(run)}/cloud/control"


def round_manifest(run: str) -> str:
    """The cloud's retained round manifest (``protocols.session``): a (re)connecting node learns the round."""
    return f"{root(run)}/cloud/round"


def status(run: str, node: str) -> str:
    """Liveness of the cloud (``cloud``) and the cells (``cell.{cell}``): birth, heartbeats, last will; retained."""
    return f"{root(run)}/status/{node}"


def statuses(run: str) -> str:
    """The cloud's and the cells' statuses (devices have theirs under their cell)."""
    return f"{root(run)}/status/+"


def device_status(run: str, cell: str, device: str) -> str:
    """A device's liveness, under its cell: only that cell (and its broker) carries it, so a cell
    receives its own devices' heartbeats, not the whole fleet's."""
    return f"{root(run)}/cell/{cell}/status/{device_node(device)}"


def device_statuses(run: str, cell: str | None = None) -> str:
    """The statuses of ``cell``'s devices (of every cell's when ``cell`` is None: monitors)."""
    return f"{root(run)}/cell/{cell or '+'}/status/+"


def state(run: str, node: str) -> str:
    """A node's retained current state (``protocols.state``): ``cloud`` or ``cell.{cell}``."""
    return f"{root(run)}/state/{node}"


def states(run: str) -> str:
    return f"{root(run)}/state/+"


def telemetry_cell(run: str, cell: str) -> str:
    """A cell's aggregation records (JSON, signed by the cell in signed runs)."""
    return f"{root(run)}/telemetry/cell/{cell}"


def cell_job_patterns(run: str, cell: str) -> tuple[str, ...]:
    """What a job's cell server subscribes to (``cell_server.cell_node``): the cell drops them from its persistent
    session when the job ends, or its next (idle) connection gets its devices' heartbeats with no handler."""
    return (
        cell_task(run, cell),
        device_results(run, cell),
        device_statuses(run, cell),
        status(run, "cloud"),
        round_manifest(run),
    )


def cloud_job_patterns(run: str) -> tuple[str, ...]:
    """What a job's cloud server subscribes to (its cells' reports, the statuses, the cells' records): the cloud
    drops them from its persistent session when the job ends, or its next connection gets them with no handler."""
    return cell_reports(run), statuses(run), telemetry_cell(run, "+")


def telemetry_cloud(run: str) -> str:
    """The cloud's round records (JSON, signed by the cloud in signed runs)."""
    return f"{root(run)}/telemetry/cloud"


def telemetry_all(run: str) -> str:
    """A monitor's subscription to all of a run's telemetry."""
    return f"{root(run)}/telemetry/#"


def current_job(federation: str) -> str:
    """The cloud's retained, signed record of the job in progress (its config, hash and session)."""
    return f"{root(federation)}/cloud/job"


def job_submit(federation: str) -> str:
    """Where the operator publishes signed job submissions and cancellations (each with a fresh nonce)."""
    return f"{root(federation)}/jobs/submit"


def job_reply(federation: str, job: str) -> str:
    """The cloud's signed answer to a request about ``job``, echoing the request's nonce."""
    return f"{root(federation)}/jobs/reply/{job}"


def job_replies(federation: str) -> str:
    """Every reply of the cloud to the operator (its ACL pattern)."""
    return f"{root(federation)}/jobs/reply/+"


def job_list(federation: str) -> str:
    """The cloud's retained, signed list of jobs and their states."""
    return f"{root(federation)}/jobs/list"


def device_node(device: str) -> str:
    """Node name of a device in status topics."""
    return f"device.{device}"


def cell_node(cell: str) -> str:
    return f"cell.{cell}"


def tier_of(topic: str) -> str | None:
    """The tier a data message travels: ``cloud_to_cell``, ``cell_to_cloud``, ``cell_to_device`` or
    ``device_to_cell``; ``None`` for status, control, manifests and telemetry."""
    parts = topic.split("/")
    if len(parts) >= 5 and parts[2] == "cell":
        if parts[4] == "down" and parts[-1] == "task":
            return "cloud_to_cell" if len(parts) == 6 else "cell_to_device"
        if parts[4] == "up" and parts[-1] == "result":
            return "device_to_cell"
    if len(parts) == 6 and parts[2:4] == ["cloud", "up"] and parts[-1] == "report":
        return "cell_to_cloud"
    return None
