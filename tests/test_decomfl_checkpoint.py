"""DeComFL's checkpoint: its round log appended beside it (``cloud.round_log``), so a checkpoint writes the same bytes
at round 2,000 as at round 1; a resume after a crash in the middle of an append, from an older checkpoint (the log
inside), or from a log that is not the checkpoint's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cloud.checkpoint import CloudCheckpoint
from protocols import runfiles
from protocols.algorithms.decomfl import DeComFLCloud, DeComFLParams
from protocols.checkpoint import Journal, load_payload, save_payload
from protocols.config import ConfigError
from protocols.wire.payload import Payload
from sim.launcher import run_simulation

K, P = 1, 5


def written() -> int:
    """Bytes this process has passed to ``write`` so far (Linux)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


def close_round(cloud: DeComFLCloud, r: int) -> None:
    """Round ``r`` with two cells whose devices all answered (a small window; the log keeps every round)."""
    cloud.plan(r, ["c0", "c1"])
    g = np.full((K, P), float(r % 7), np.float64)
    cloud.aggregate(
        r, {c: Payload({"weight": 1, "answered": [f"{c}-d"], "need": r + 1}, {"g": g}) for c in ("c0", "c1")}
    )


def save(checkpoint: CloudCheckpoint, cloud: DeComFLCloud, r: int) -> int:
    """Checkpoint ``cloud`` after round ``r`` as the cloud server does; the bytes it wrote."""
    before = written()
    checkpoint.save(r, "s", {}, 0, cloud.state(), {"round": r}, cloud.log_tail)
    return written() - before


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts bytes with /proc/self/io")
def test_a_checkpoint_writes_the_same_bytes_at_round_2000_as_at_round_1000(tmp_path: Path) -> None:
    """Before, each checkpoint stacked the cloud's whole log (8 + 4KP bytes a round, and its window, up to as much):
    28 KB more at round 1,000, 56 KB more at round 2,000. Now a save appends the rounds since the last one."""
    params = DeComFLParams(name="decomfl", local_steps=K, perturbations=P, server_model=False)
    cloud = DeComFLCloud(params, 0, {"w": np.zeros(100, np.float32)})
    checkpoint = CloudCheckpoint(tmp_path / "checkpoint.ftw")
    save(checkpoint, cloud, -1)
    measured = {}
    for horizon in (1000, 2000):  # (the same digits in the checkpoint's meta at both)
        for r in range(cloud.base + len(cloud.g), horizon):
            close_round(cloud, r)
        save(checkpoint, cloud, horizon - 1)  # one append of the rounds since the last save
        each = []
        for r in range(horizon, horizon + 3):  # (the least of 3: a write of another thread would only add)
            close_round(cloud, r)
            each.append(save(checkpoint, cloud, r))
        measured[horizon] = min(each)
    assert measured[2000] == measured[1000] < 1000, measured  # the log alone: 8 + 4KP = 28 bytes a round
    saved = checkpoint.load()
    assert saved is not None
    again = DeComFLCloud(params, 0, {"w": np.zeros(100, np.float32)})
    again.load_state(saved.role)
    assert again.log_seeds == cloud.log_seeds and len(again.log_g) == 2003 and again.base == cloud.base
    assert all(np.array_equal(a, b) for a, b in zip(again.log_g, cloud.log_g, strict=True))


def test_a_cloud_killed_before_its_first_log_was_written_resumes(tmp_path: Path) -> None:
    """A fresh cloud's first checkpoint (before round 0) names a log of no rounds, whose file is written after the
    checkpoint's rename (a previous run's file, which the checkpoint being replaced names, stays until then): killed in
    between, the resume has no file to read, needs none, and its next checkpoint writes it whole."""
    params = DeComFLParams(name="decomfl", local_steps=K, perturbations=P, server_model=False)
    cloud = DeComFLCloud(params, 0, {"w": np.zeros(4, np.float32)})
    save(CloudCheckpoint(tmp_path / "checkpoint.ftw"), cloud, -1)
    (tmp_path / ("checkpoint.ftw" + ".rounds")).unlink()  # the kill came before the log's file was written
    resumed, checkpoint = (
        DeComFLCloud(params, 0, {"w": np.zeros(4, np.float32)}),
        CloudCheckpoint(tmp_path / "checkpoint.ftw"),
    )
    saved = checkpoint.load()
    assert saved is not None and saved.round == -1
    resumed.load_state(saved.role)
    close_round(resumed, 0)
    save(checkpoint, resumed, 0)
    again = CloudCheckpoint(tmp_path / "checkpoint.ftw").load()
    assert again is not None and again.role.tensors["log:s"].tolist() == resumed.log_seeds


def decomfl(make_config, tmp_path: Path, rounds: int, out: str):
    return make_config(
        run={"rounds": rounds, "output": str(tmp_path / out)},
        algorithm={"name": "decomfl", "edge_rounds": 1, "local_steps": 2, "perturbations": 2, "lr": 0.02},
    )


def same_model(a, b) -> bool:
    return a.params.keys() == b.params.keys() and all(a.params[k].tobytes() == b.params[k].tobytes() for k in a.params)


def test_a_resume_after_a_torn_append_cuts_it_and_ends_with_the_uninterrupted_model(make_config, tmp_path) -> None:
    """The cloud died while checkpointing round 3: its append of round 3 reached the log (fsynced), the checkpoint's
    rename did not, and a second append was torn mid-entry. The resume reads the 3 rounds the checkpoint names (every
    device, recreated at x_0, replays them), cuts the rest before its own appends, and a second resume reads the log
    the first one appended to: the model of the uninterrupted run, bit for bit."""
    straight = run_simulation(decomfl(make_config, tmp_path, 6, "straight"))
    run_simulation(decomfl(make_config, tmp_path, 3, "resumed"))
    log = tmp_path / "resumed" / runfiles.CHECKPOINT_LOG
    stray = Journal.frame(Payload({"from": 3}, {"log:s": np.array([7], np.uint64), "log:g": np.ones((1, 2, 2), "f4")}))
    log.write_bytes(log.read_bytes() + stray + stray[: len(stray) // 2])
    first = run_simulation(decomfl(make_config, tmp_path, 5, "resumed"), resume=True)
    assert [r["round"] for r in first.history] == [3, 4]
    assert stray not in log.read_bytes()
    second = run_simulation(decomfl(make_config, tmp_path, 6, "resumed"), resume=True)
    assert [r["round"] for r in second.history] == [5] and same_model(second, straight)


def test_an_older_checkpoint_with_its_log_inside_resumes_and_then_writes_the_log_beside_it(make_config, tmp_path):
    """A checkpoint of the earlier format (window and log among its tensors, no log file) resumes exactly; the first
    checkpoint after it writes the whole log to the file, which the next resume reads."""
    straight = run_simulation(decomfl(make_config, tmp_path, 6, "straight"))
    run_simulation(decomfl(make_config, tmp_path, 3, "old"))
    path = tmp_path / "old" / runfiles.CHECKPOINT
    saved = CloudCheckpoint(path).load()
    assert saved is not None
    state = load_payload(path)
    base, log_s, log_g = saved.role.meta["base"], saved.role.tensors["log:s"], saved.role.tensors["log:g"]
    assert len(log_s) == 3 and base > 0
    old = {**state.tensors, "log:s": log_s, "log:g": log_g, "history:s": log_s[base:], "history:g": log_g[base:]}
    save_payload(path, Payload({k: v for k, v in state.meta.items() if k != "log"}, old))
    (tmp_path / "old" / runfiles.CHECKPOINT_LOG).unlink()
    run_simulation(decomfl(make_config, tmp_path, 4, "old"), resume=True)
    assert (tmp_path / "old" / runfiles.CHECKPOINT_LOG).exists()
    assert same_model(run_simulation(decomfl(make_config, tmp_path, 6, "old"), resume=True), straight)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda log, meta: log.write_bytes(log.read_bytes()[:-3]), "holds .* bytes: lost or cut short"),
        (lambda log, meta: log.unlink(), "holds 0 bytes: lost or cut short"),
        (lambda log, meta: log.write_bytes(log.read_bytes()[:-1] + b"\0"), "not the file the checkpoint wrote"),
        (lambda log, meta: meta["log"].update(rounds=10**12, bytes=10**15), "at most 3 rounds"),
        (lambda log, meta: meta["log"].update(bytes=10**15), "holds .* bytes: lost or cut short"),
        (lambda log, meta: meta["log"].update(sha256="x"), "record of its round log is malformed"),
        (lambda log, meta: (log.unlink(), log.mkdir()), "cannot read .*rounds: Is a directory"),
        (lambda log, meta: meta.pop("round"), "is damaged: its round is 'None'"),
        (lambda log, meta: meta["role"].pop("base"), r"damaged \(KeyError: 'base'\)"),
    ],
    ids=[
        "cut short",
        "lost",
        "changed",
        "hostile rounds",
        "hostile bytes",
        "malformed",
        "unreadable",
        "no round",
        "no base",
    ],
)
def test_a_log_that_is_not_the_checkpoints_is_refused_with_its_reason(make_config, tmp_path, damage, match) -> None:
    run_simulation(decomfl(make_config, tmp_path, 3, "run"))
    path = tmp_path / "run" / runfiles.CHECKPOINT
    state = load_payload(path)
    damage(tmp_path / "run" / runfiles.CHECKPOINT_LOG, state.meta)
    save_payload(path, state)
    with pytest.raises(ConfigError, match=match):
        run_simulation(decomfl(make_config, tmp_path, 5, "run"), resume=True)
