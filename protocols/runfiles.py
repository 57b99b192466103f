"""Names of the files a run writes to its output folder (the same for sim, run and deployments)."""

CONFIG = "config.toml"  # the config the run used, overrides applied
METRICS = "metrics.jsonl"  # one cloud round record per line
AGGREGATION = "aggregation.jsonl"  # one cell aggregation record per line (all cells)
CELL_RECORDS = "cells.jsonl"  # a deployed cloud: every cell's aggregation records, from their signed telemetry
FINAL_MODEL = "final_model.ftw"  # the final global model (tensors/v1, see protocols.checkpoint)
CHECKPOINT = "checkpoint.ftw"  # the cloud's state after its last round, for --resume
SUMMARY = "summary.json"  # final accuracy, bytes, wall time
BROKER = "broker"  # fedtier run: the Mosquitto it started keeps mosquitto.db here
LOCK = "run.lock"  # fedtier run|sim: held while a run writes the folder (the holder's pid)
JOBS = "jobs.json"  # a federation's cloud (`fedtier cloud --serve`, `fedtier run`): its durable job queue
CELL_JOURNAL = "cell-{cell}.journal"  # a cell's current round (task, plans, results), for `fedtier cell --resume`
