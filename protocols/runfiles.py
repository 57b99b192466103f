"""Names of the files a run writes to its output folder (the same for sim, run and deployments)."""

import json
import math
import time
from pathlib import Path
from typing import Any

from .checkpoint import write_durably

CONFIG = "config.toml"  # the config the run used, overrides applied
METRICS = "metrics.jsonl"  # one cloud round record per line
AGGREGATION = "aggregation.jsonl"  # one cell aggregation record per line (all cells)
CELL_RECORDS = "cells.jsonl"  # a deployed cloud: every cell's aggregation records, from their signed telemetry
FINAL_MODEL = "final_model.ftw"  # the final global model (tensors/v1, see protocols.checkpoint)
CHECKPOINT = "checkpoint.ftw"  # the cloud's state after its last round, for --resume
CHECKPOINT_LOG = CHECKPOINT + ".rounds"  # its role's round log (DeComFL's), appended to: cloud.round_log
CLOUD_JOURNAL = "cloud-pushes.journal"  # an async cloud's pushes taken since its last version, for --resume
SUMMARY = "summary.json"  # final accuracy, bytes, wall time
DEVICE_TRAFFIC = (
    "device_traffic.jsonl"  # a run of more devices than summary.json lists: each one's traffic, a line each
)
BROKER = "broker"  # fedtier run: the Mosquitto it started keeps mosquitto.db here
LOCK = "run.lock"  # fedtier run|sim: held while a run writes the folder (the holder's pid)
JOBS = "jobs.json"  # a federation's cloud (`fedtier cloud --serve`, `fedtier run`): its durable job queue
JOB_FOLDERS = "jobs"  # a federation's node: a run folder per job in jobs/{job} (its output folder holds no records)
CELL_JOURNAL = "cell-{cell}.journal"  # a cell's current round (task, plans, results), for `fedtier cell --resume`
CELL_JOB = "cell-{cell}.job.json"  # a federation cell's job folder: its job, and how it ended for it (the monitor's)
CELL_JOB_PHASES = ("running", "finished", "stopped", "failed")


def job_folders(path: Path) -> list[str]:
    """The jobs whose run folders ``path`` holds when it is a federation node's output folder (``{output}/jobs/{job}``,
    no records of its own); [] for a run folder, or a folder that is neither."""
    folders = path / JOB_FOLDERS
    if (path / METRICS).exists() or (path / AGGREGATION).exists() or not folders.is_dir():
        return []
    return sorted(p.name for p in folders.iterdir() if p.is_dir())


def write_cell_job(folder: Path, cell: str, job: str, phase: str, reason: str | None = None) -> None:
    """Say in ``folder`` (a ``fedtier cell --serve`` job folder, which holds the cell's own records only) which cell
    and job it is, and the job's ``phase`` for the cell: ``running``, or how the cloud said it ended (``finished``,
    ``stopped``, ``failed``, with ``reason``). Replaced atomically and durably (``checkpoint.write_durably``): a
    reader, or a restart after a crash, sees the old record or the new one, whole; a failed write leaves no
    temporary file."""
    if phase not in CELL_JOB_PHASES:
        raise ValueError(f"phase {phase!r} is not one of {CELL_JOB_PHASES}")
    doc: dict[str, Any] = {"cell": cell, "job": job, "phase": phase, "since": time.time()}
    if reason:
        doc["reason"] = reason
    write_durably(folder / CELL_JOB.format(cell=cell), json.dumps(doc).encode(), private=False)


def cell_jobs(folder: Path) -> list[dict[str, Any]]:
    """The cells' job records ``folder`` holds (:func:`write_cell_job`), by cell; a malformed one is left out."""
    out = []
    for path in sorted(folder.glob(CELL_JOB.format(cell="*"))):
        try:
            doc = json.loads(path.read_bytes()[:65536])
        except (OSError, ValueError):
            continue
        if (
            isinstance(doc, dict)
            and all(isinstance(doc.get(k), str) for k in ("cell", "job", "phase"))
            and doc["phase"] in CELL_JOB_PHASES
            and isinstance(doc.get("since"), (int, float))
            and math.isfinite(doc["since"])
            and isinstance(doc.get("reason", ""), str)
        ):
            out.append(doc)
    return out
