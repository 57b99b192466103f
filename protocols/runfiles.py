"""Names of the files a run writes to its output folder (the same for sim, run and deployments)."""

from pathlib import Path

CONFIG = "config.toml"  # the config the run used, overrides applied
METRICS = "metrics.jsonl"  # one cloud round record per line
AGGREGATION = "aggregation.jsonl"  # one cell aggregation record per line (all cells)
CELL_RECORDS = "cells.jsonl"  # a deployed cloud: every cell's aggregation records, from their signed telemetry
FINAL_MODEL = "final_model.ftw"  # the final global model (tensors/v1, see protocols.checkpoint)
CHECKPOINT = "checkpoint.ftw"  # the cloud's state after its last round, for --resume
CLOUD_JOURNAL = "cloud-pushes.journal"  # an async cloud's pushes taken since its last version, for --resume
SUMMARY = "summary.json"  # final accuracy, bytes, wall time
BROKER = "broker"  # fedtier run: the Mosquitto it started keeps mosquitto.db here
LOCK = "run.lock"  # fedtier run|sim: held while a run writes the folder (the holder's pid)
JOBS = "jobs.json"  # a federation's cloud (`fedtier cloud --serve`, `fedtier run`): its durable job queue
JOB_FOLDERS = "jobs"  # a federation's node: a run folder per job in jobs/{job} (its output folder holds no records)
CELL_JOURNAL = "cell-{cell}.journal"  # a cell's current round (task, plans, results), for `fedtier cell --resume`


def job_folders(path: Path) -> list[str]:
    """The jobs whose run folders ``path`` holds when it is a federation node's output folder (``{output}/jobs/{job}``,
    no records of its own); [] for a run folder, or a folder that is neither."""
    folders = path / JOB_FOLDERS
    if (path / METRICS).exists() or (path / AGGREGATION).exists() or not folders.is_dir():
        return []
    return sorted(p.name for p in folders.iterdir() if p.is_dir())
