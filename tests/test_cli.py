"""The ``fedtier`` CLI as a user runs it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from fedtier.cli import main
from protocols import runfiles
from tests.conftest import wait_until

CONFIG = """
[run]
name = "cli"
rounds = 2
output = "{out}"
[topology]
cells = 2
devices_per_cell = 2
[algorithm]
name = "fedavg"
local_steps = 5
[model]
hidden = [16]
[data]
dataset = "digits"
"""


def test_sim_runs_and_writes_outputs(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(out=tmp_path / "out"))
    res = CliRunner().invoke(main, ["sim", str(cfg), "--set", "run.rounds=3", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "accuracy" in res.output
    summary = json.loads((tmp_path / "out" / runfiles.SUMMARY).read_text())
    assert summary["rounds"] == 3 and 0 < summary["accuracy"] <= 1


def test_resume_without_a_checkpoint_says_it_starts_from_round_0(tmp_path):
    """--resume into a folder without a checkpoint (a mistyped run.output) ran from round 0 silently."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(out=tmp_path / "out"))
    res = CliRunner().invoke(main, ["sim", str(cfg), "--resume", "--no-progress"])
    said = " ".join(res.output.split())
    assert res.exit_code == 0 and "no checkpoint in" in said and "--resume starts from round 1" in said
    again = CliRunner().invoke(main, ["sim", str(cfg), "--resume", "--no-progress"])  # now there is one
    assert again.exit_code == 0 and "no checkpoint" not in again.output
    done = CliRunner().invoke(main, ["sim", str(cfg), "--resume", "--set", "run.rounds=1"])  # walked: a bar at 0/1
    said = " ".join(done.output.split())
    assert done.exit_code == 0 and "ran 2 rounds already (run.rounds = 1): --resume has none left to run" in said
    assert json.loads((tmp_path / "out" / runfiles.SUMMARY).read_text())["rounds"] == 2  # the rounds it ran


def test_a_run_refused_once_it_took_its_folder_leaves_a_failed_summary_a_monitor_ends_on(tmp_path):
    """A data set it cannot read, found after the run took its folder: the folder held only run.lock, and
    `fedtier monitor RUN --exit-when-done` waited for ever for a run starting (walked)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(out=tmp_path / "out"))
    res = CliRunner().invoke(main, ["sim", str(cfg), "--set", f"data.dataset=npz:{tmp_path / 'none.npz'}"])
    assert res.exit_code == 2 and "cannot read it" in res.output
    summary = json.loads((tmp_path / "out" / runfiles.SUMMARY).read_text())
    assert summary["status"] == "failed" and "data.dataset: dataset npz:" in summary["failed"]
    watched = CliRunner().invoke(main, ["monitor", str(tmp_path / "out"), "--exit-when-done"])
    assert watched.exit_code == 3, watched.output
    (tmp_path / "out" / runfiles.SUMMARY).write_text('{"run": "t", "status": "finished"}')  # an earlier run's
    res = CliRunner().invoke(main, ["sim", str(cfg), "--set", f"data.dataset=npz:{tmp_path / 'none.npz'}"])
    assert res.exit_code == 2  # refused again: that summary is left as it was
    assert json.loads((tmp_path / "out" / runfiles.SUMMARY).read_text())["status"] == "finished"


def test_bad_config_exits_2_naming_the_key(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(out=tmp_path / "out"))
    res = CliRunner().invoke(main, ["sim", str(cfg), "--set", "run.rounds=-3"])
    assert res.exit_code == 2
    assert "run.rounds" in res.output
    res = CliRunner().invoke(main, ["sim", str(cfg), "--set", "topology.devices_per_cell=5000"])
    assert res.exit_code == 2 and "topology" in res.output


@pytest.mark.parametrize(
    "section, says",
    [
        ("[topology]\ncells = 0", "topology.cells = 0: must be greater than or equal to 1"),
        ("[topology]\ncels = 3", "topology.cels: unknown key (did you mean cells?)"),
        ("[topology]\nzz = 3", "topology.zz: unknown key ([topology] takes cells, devices_per_cell, members)"),
        ('[topology]\nmembers = {c0 = ["a", "a"]}', "topology.members: 'a' appears twice"),
        ('[topology]\nmembers = ["a"]', 'topology.members = ["a"]: must be a table'),
        ("[model]\nhidden = {a = 1}", 'model.hidden = { "a" = 1 }: must be an array'),  # was "a valid tuple"
        ("run = 3", "run = 3: must be a table ([run] and its keys)"),  # was "... or instance of RunSection"
        ('[run]\nname = "a/b"', "run.name = \"a/b\": run id 'a/b' must be 1-64 characters"),
        ('[algorithm]\nname = "fedavg"\nlr = "x"', 'algorithm.lr = "x": must be a valid number'),
    ],
)
def test_a_refused_config_names_its_file_key_value_and_what_is_allowed_never_a_repr(tmp_path, section, says):
    """Refusals said pydantic's raw text ("topology: Value error, members: ...", "Input should be ...") and not
    which file or value; now "FILE: invalid config: KEY = VALUE: must be ..." (exit 2, before any run)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'{section}\n[data]\ndataset = "digits"\n')
    res = CliRunner().invoke(main, ["sim", str(cfg)])
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and f"{cfg}: invalid config: {says}" in said, said
    assert not any(raw in said for raw in ("Value error", "Input should", "{'", "None", "instance of", "valid dict")), (
        said
    )


def test_a_refused_job_names_its_file_and_a_job_cannot_rename_the_federations_run(tmp_path):
    """``fedtier submit``: the job file's refusals name it (the topology's said Python dicts and no file), and a
    job's ``[run] name`` that is not the federation's (its topics' name) is refused saying so: it was replaced
    without a word. Checked before any broker is reached."""
    fed = tmp_path / "fed.toml"
    fed.write_text('[run]\nname = "fed"\n[topology]\ncells = 2\ndevices_per_cell = 2\n')
    job = tmp_path / ("a-folder-name-longer-than-a-terminal-line-" * 2) / "job.toml"  # the error is > 80 columns
    job.parent.mkdir()
    for body, says in [
        ('[run]\nname = "mine"', f"{job}: run.name = \"mine\": a job runs on the federation's topics, named 'fed'"),
        ("[topology]\ncells = 3", f"{job}: topology.cells = 3, the federation's as provisioned (this bundle's; the"),
        ("[run]\nrounds = 0", f"{job}: invalid config: run.rounds = 0: must be greater than or equal to 1"),
    ]:
        job.write_text(body + "\n")
        res = CliRunner().invoke(main, ["submit", str(job), "--config", str(fed)])
        said = " ".join(res.output.split())  # a refusal of several keys lists them on lines of their own
        assert res.exit_code == 2 and says in said and "{'" not in said, said
        assert f"error: {job}: " in res.output  # never a line break the console put inside the path ("job.tom l")


def test_a_second_run_into_a_folder_in_use_is_refused(tmp_path):
    """While a run writes its folder (here: this process holds it, as a `fedtier run` in another terminal
    would), a second `fedtier sim|run` into it is refused, exit 2, naming the holder, and deletes nothing (it
    deleted the first run's records and interleaved its own with the rest); once free, it runs."""
    import os

    from fedtier.console import run_folder_lock
    from protocols.config import load_config

    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(out=tmp_path / "out"))
    first = tmp_path / "out" / runfiles.METRICS
    with run_folder_lock(load_config(cfg)):
        first.write_text('{"round": 0}\n')
        for command in ("sim", "run"):
            res = CliRunner().invoke(main, [command, str(cfg), "--no-progress"])
            said = " ".join(res.output.split())
            assert res.exit_code == 2 and f"is in use by another run (pid {os.getpid()})" in said, res.output
        assert first.read_text() == '{"round": 0}\n'
    res = CliRunner().invoke(main, ["sim", str(cfg), "--no-progress"])
    assert res.exit_code == 0 and len(first.read_text().splitlines()) == 2, res.output


def test_a_second_long_lived_cloud_or_cell_on_a_nodes_folder_is_refused(tmp_path, monkeypatch):
    """Walk-through (a provisioned fleet): a second `fedtier cloud --serve` started from the cloud's bundle while the
    first ran took the first's broker session from it and back each second, without end, and both wrote the same
    job queue and job folders: a job the second resumed and finished, the first failed later ('no cell answered'),
    and its summary and state said failed. A second `fedtier cell --serve --cell c0` alike (the same journal). The
    second is refused now, exit 2 (its systemd unit does not restart it), naming the first's pid; another cell on
    the same folder is not."""
    import os

    import fedtier.serve
    from fedtier.console import run_folder_lock
    from protocols.config import load_config

    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(out=tmp_path / "out"))
    served: list[str] = []
    monkeypatch.setattr(fedtier.serve, "serve_cloud", lambda *a: served.append("cloud"))
    monkeypatch.setattr(fedtier.serve, "serve_cell", lambda cfg, cell, *a: served.append(cell) or [])
    for node, args in (("cloud", ["cloud"]), ("cell c0", ["cell", "--cell", "c0"])):
        with run_folder_lock(load_config(cfg), node):  # the first, serving
            res = CliRunner().invoke(main, [*args, str(cfg), "--serve", "--insecure", "--broker", "mqtt://127.0.0.1:1"])
            said = " ".join(res.output.split())
            assert res.exit_code == 2 and f"another fedtier {node} (pid {os.getpid()})" in said, res.output
            assert served == []
    with run_folder_lock(load_config(cfg), "cell c0"):
        res = CliRunner().invoke(
            main, ["cell", str(cfg), "--serve", "--insecure", "--broker", "mqtt://127.0.0.1:1", "--cell", "c1"]
        )
    assert res.exit_code == 0 and served == ["c1"], res.output


def test_a_folder_in_use_is_named_as_it_is(tmp_path):
    """The refusal names the folder in use as it is: rich took a ``[part]`` of its path for markup and dropped it."""
    from fedtier.console import run_folder_lock
    from protocols.config import load_config

    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(out=tmp_path / "runs[b]"))
    with run_folder_lock(load_config(cfg)):
        res = CliRunner().invoke(main, ["sim", str(cfg), "--no-progress"])
    assert res.exit_code == 2 and "runs[b]isinuse" in "".join(res.output.split()), res.output  # (wrapped anywhere)


def test_a_run_starting_while_the_monitor_checks_its_folder_is_not_refused(tmp_path, monkeypatch):
    """`fedtier monitor` takes a run folder's lock shared for an instant (is the run that wrote it gone?): a run
    starting in that instant waits for it rather than being refused as if another run held the folder."""
    import fcntl
    import os
    import time

    from fedtier.console import run_folder_lock
    from protocols.config import load_config

    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(out=tmp_path / "out"))
    (tmp_path / "out").mkdir()
    probes = [os.open(tmp_path / "out" / runfiles.LOCK, os.O_RDONLY | os.O_CREAT)]
    fcntl.flock(probes[0], fcntl.LOCK_SH | fcntl.LOCK_NB)  # as monitor.sources.RunDirFollower._abandoned does
    sleep = time.sleep

    def probe_ends(seconds: float) -> None:  # the monitor's probe ends while the run waits
        while probes:
            os.close(probes.pop())
        sleep(seconds)

    monkeypatch.setattr(time, "sleep", probe_ends)
    with run_folder_lock(load_config(cfg)):
        assert (tmp_path / "out" / runfiles.LOCK).read_text() == str(os.getpid())


@pytest.mark.timeout(120)
def test_sim_stopped_by_sigterm_says_so_and_resumes(tmp_path):
    """SIGTERM (or Ctrl-C) stops ``fedtier sim`` as it stops ``fedtier run``: exit 130 and how to continue, not
    a kill by the signal (143) or click's bare 'Aborted!' (1); ``--resume`` then goes on from its checkpoint."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(out=tmp_path / "out").replace("rounds = 2", "rounds = 100000"))
    metrics = tmp_path / "out" / runfiles.METRICS
    cmd = [sys.executable, "-c", "from fedtier.cli import main; main()", "sim", str(cfg), "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_until(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, timeout=60)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)  # the round in progress ends first; CI is loaded
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    assert "interrupted:" in out and "--resume" in out and "Traceback" not in out, out
    done = len(metrics.read_text().splitlines())
    res = CliRunner().invoke(main, ["sim", str(cfg), "--resume", "--set", f"run.rounds={done + 1}", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "out" / runfiles.SUMMARY).read_text())["rounds"] == done + 1


def test_resuming_a_finished_run_keeps_its_summary(tmp_path):
    """``--resume`` of a run that had finished runs no round; its summary.json said rounds 0, accuracy None,
    no bytes (the earlier attempt's figures lost). It now keeps the run's figures from the checkpoint."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(out=tmp_path / "out"))
    summary = tmp_path / "out" / runfiles.SUMMARY
    assert CliRunner().invoke(main, ["sim", str(cfg), "--no-progress"]).exit_code == 0
    before = json.loads(summary.read_text())
    res = CliRunner().invoke(main, ["sim", str(cfg), "--resume", "--no-progress"])
    assert res.exit_code == 0, res.output
    after = json.loads(summary.read_text())
    keep = ("status", "rounds", "accuracy", "loss", "cumulative_bytes")
    assert {k: after[k] for k in keep} == {k: before[k] for k in keep} and before["rounds"] == 2
    assert after["resumed_after_round"] == 1 and "resumed_after_round" not in before  # wall_s: this attempt's


def test_resuming_with_other_settings_is_refused_naming_them(tmp_path):
    """``--resume`` with another learning rate ran the rest of the run with it, told nothing, and rewrote
    config.toml to claim it for every round; another model failed with a traceback. Both are refused (exit 2),
    naming what differs; more rounds are taken."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(out=tmp_path / "out"))
    assert CliRunner().invoke(main, ["sim", str(cfg), "--no-progress"]).exit_code == 0
    recorded = (tmp_path / "out" / runfiles.CONFIG).read_text()
    for change, named in (("algorithm.lr=0.5", "algorithm.lr 0.05 -> 0.5"), ("model.hidden=[32]", "model.hidden")):
        res = CliRunner().invoke(main, ["sim", str(cfg), "--resume", "--set", change, "--no-progress"])
        assert res.exit_code == 2 and named in " ".join(res.output.split()), res.output
        assert (tmp_path / "out" / runfiles.CONFIG).read_text() == recorded
    res = CliRunner().invoke(main, ["sim", str(cfg), "--resume", "--set", "run.rounds=3", "--no-progress"])
    assert res.exit_code == 0 and json.loads((tmp_path / "out" / runfiles.SUMMARY).read_text())["rounds"] == 3


def test_resuming_with_a_setting_config_toml_leaves_unset_is_refused(tmp_path):
    """config.toml writes no key for a setting left unset (None): a resume that sets it, or unsets one the run set,
    changes the run's settings all the same (here noise_multiplier 1.0 -> target_epsilon 3.0: another privacy
    calibration), and is refused as any other change; the same settings resume."""
    from protocols.config import ConfigError, load_config
    from sim.hierarchy import check_resumed_config

    out = tmp_path / "out"
    out.mkdir()
    (out / runfiles.CHECKPOINT).write_bytes(b"")
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(out=out))
    dp = ('privacy.dp="local"', "privacy.clip=1.0")
    made = load_config(cfg, (*dp, "privacy.noise_multiplier=1.0"))
    (out / runfiles.CONFIG).write_text(made.to_toml())
    check_resumed_config(out, made)
    other = load_config(cfg, (*dp, "privacy.target_epsilon=3.0"))
    with pytest.raises(ConfigError, match="privacy.noise_multiplier 1.0 -> None; privacy.target_epsilon None -> 3.0"):
        check_resumed_config(out, other)


def test_help_lists_commands():
    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0 and "sim" in res.output


def test_a_bundles_config_read_from_another_folder_says_where_to_run_the_command(tmp_path, monkeypatch):
    """A node's bundle names its files relative to its folder; ``fedtier submit|jobs|cloud ... --config
    fed/nodes/operator/config.toml`` run from elsewhere said "security.keys: cannot read keys.toml: No such file or
    directory" (or the broker certificate's), which does not say the fix: run it from the bundle's folder."""
    bundle = tmp_path / "fed" / "nodes" / "operator"
    bundle.mkdir(parents=True)
    (bundle / "config.toml").write_text(
        '[run]\nname = "fed"\n[broker]\nurl = "mqtt://127.0.0.1:1"\n[security]\nkeys = "keys.toml"\n'
    )
    (bundle / "keys.toml").write_text("")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["jobs", "--config", "fed/nodes/operator/config.toml", "--wait", "0.1"])
    said = " ".join(res.output.split())
    assert (
        res.exit_code == 2
        and (
            'fed/nodes/operator/config.toml names its files relative to its own folder (security.keys = "keys.toml"), '
            "and this command opens them from the current one: run it from fed/nodes/operator (cd fed/nodes/operator)"
        )
        in said
    ), said
    monkeypatch.chdir(bundle)  # from there it reads its keys (here: a file without any, refused as such)
    res = CliRunner().invoke(main, ["jobs", "--config", "config.toml", "--wait", "0.1"])
    said = " ".join(res.output.split())
    assert res.exit_code != 0 and "relative to its own folder" not in said and "keys.toml" in said, said


def test_a_node_started_from_a_federations_bundle_without_serve_is_told_to_serve(tmp_path):
    """Walked: `fedtier agent config.toml --device c0-d0 --data data.npz` in a device's federation bundle, --serve
    forgotten, said "error: data.npz: samples of 1x8x8, but the job's model takes mnist: 1x28x28" (exit 2): the bundle
    holds no training config, so the one-job agent took the defaults' (and a cloud or cell so started would run that
    job, taking the serving node's broker session). A federation's bundle (security.membership = 'roster') now
    starts its cloud, cells and agents only with --serve, exit 2 saying so before anything connects."""
    config = tmp_path / "config.toml"
    config.write_text('[run]\nname = "fed"\n[broker]\nurl = "mqtt://127.0.0.1:1"\n[security]\nmembership = "roster"\n')
    data = tmp_path / "data.npz"
    data.write_bytes(b"")
    for command in (["cloud"], ["cell", "--cell", "c0"], ["agent", "--device", "c0-d0", "--data", str(data)]):
        res = CliRunner().invoke(main, [command[0], str(config), *command[1:], "--insecure"])
        said = " ".join(res.output.split())
        assert res.exit_code == 2 and "this config is a federation's bundle (security.membership = 'roster')" in said
        assert f"start it with --serve (`fedtier {command[0]} config.toml --serve ...`)" in said, said


def test_a_serving_node_under_an_id_its_bundle_does_not_hold_is_refused_before_it_says_it_connects(tmp_path):
    """Walked: `fedtier agent config.toml --serve --device c1-d9 ...` (a mistyped id) and `fedtier cell --serve --cell
    c1` in c0's bundle said 'device c1-d9 of federation 'fed' (...): connecting to mqtts://..., then serving the
    federation's jobs ...' and then the error (exit 2): it never connected. The keys are checked before that line."""
    import numpy as np

    from protocols.config import TopologySection
    from protocols.wire.keys import generate_keys, node_subset, write_keys

    topo = TopologySection(cells=1, devices_per_cell=2)
    write_keys(tmp_path / "keys.toml", node_subset(generate_keys(topo), topo, "c0-d0"))
    config = tmp_path / "config.toml"
    config.write_text(
        '[run]\nname = "fed"\n[topology]\ncells = 1\ndevices_per_cell = 2\n[broker]\nurl = "mqtt://127.0.0.1:1"\n'
        f'[security]\nkeys = "{tmp_path / "keys.toml"}"\nmembership = "roster"\n'
    )
    data = tmp_path / "data.npz"
    np.savez(data, x=np.zeros((4, 64), np.float32), y=np.arange(4) % 2)
    for node in (["agent", "--device", "c0-d1", "--data", str(data)], ["cell", "--cell", "c0"]):
        res = CliRunner().invoke(main, [node[0], str(config), "--serve", *node[1:]])
        said = " ".join(res.output.split())
        assert res.exit_code == 2 and f"the private key of '{node[2]}' is missing from the keys file" in said, said
        assert "connecting to" not in said, said


def test_the_record_commands_on_a_provisioning_folder_say_where_the_records_are(tmp_path):
    """``fedtier monitor OUT`` on what ``fedtier provision --out OUT`` wrote drew an empty frame ("fedtier monitor:
    ?  (0 cells)", and waited for ever without --once) and ``fedtier logs OUT`` said it "has no records": now the
    three record commands say what the folder is and where a job's records and the live view are."""
    out = tmp_path / "fed"
    out.mkdir()
    (out / "federation.json").write_text("{}")
    for command in (["monitor", str(out), "--once"], ["logs", str(out)], ["report", str(out)]):
        res = CliRunner().invoke(main, command)
        said = " ".join(res.output.split())
        assert res.exit_code == 2 and f"{out} is a provisioning folder" in said, (command, said)
        assert f"run fedtier monitor --config config.toml in {out / 'nodes' / 'monitor'}" in said, said


def test_a_run_refused_before_its_first_round_says_the_reason_alone_not_a_progress_bar_at_zero(tmp_path):
    """A refusal only building the run finds (here FedALIGN's priority device not in the topology) came under a
    progress bar drawn at 0 ("x (fedalign) ━━━━ 0/10 0:00:00 -:--:--", left on the screen, and in a log); the bar
    goes now when no round closed, on a terminal erased."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[run]\nname = "x"\n[algorithm]\nname = "fedalign"\npriority = ["zz"]\n[data]\ndataset = "digits"\n')
    res = CliRunner().invoke(main, ["sim", str(cfg)])
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and said.startswith("error: algorithm.priority: 'zz' not in the topology"), said
    assert "x (fedalign)" not in said and "0/10" not in said, said


def test_the_operators_commands_given_a_config_without_a_broker_name_the_bundle_they_take(tmp_path):
    """``fedtier jobs|cancel|submit --config`` of a run config (no [broker] url) said "broker.url: required
    (mqtt://host:port), or pass --broker", an option these commands do not have; now which config they take. And
    ``fedtier fleet --config`` said "give --broker URL --run NAME, or --config with both in it" of a config that
    names the run: now what it lacks, as ``fedtier monitor --config`` says it."""
    cfg = tmp_path / "fed.toml"
    cfg.write_text('[run]\nname = "fed"\n')
    job = tmp_path / "job.toml"
    job.write_text("[run]\nrounds = 2\n")
    for command in (["jobs"], ["cancel", "j1"], ["submit", str(job)]):
        res = CliRunner().invoke(main, [*command, "--config", str(cfg), "--wait", "0.1"])
        said = " ".join(res.output.split())
        assert res.exit_code == 2 and "--broker" not in said, (command, said)
        assert f"{cfg} names no broker ([broker] url): --config takes the operator bundle's config.toml" in said, said
    for command in (["fleet"], ["monitor", "--once"]):  # the watchers' --config: the monitor bundle's
        res = CliRunner().invoke(main, [*command, "--config", str(cfg), "--wait", "0.1"])
        said = " ".join(res.output.split())
        assert res.exit_code == 2 and f"{cfg} names no broker ([broker] url): give --broker URL" in said, said


def test_a_deployed_nodes_keys_option_says_what_the_file_holds_not_that_it_is_made():
    """``fedtier cloud|cell|agent --help`` said of --keys "fedtier sim/run generate it in the run folder when the file
    does not exist": a deployed node makes none (a missing file is refused), it reads its bundle's. And the cloud's
    --serve said "each job's config comes from the cloud"."""
    for command in ("cloud", "cell", "agent"):
        said = " ".join(CliRunner().invoke(main, [command, "--help"]).output.split())
        assert "generate it" not in said and "this node's private key and its peers' public keys" in said, said
    assert "generate it in the run folder" in " ".join(CliRunner().invoke(main, ["run", "--help"]).output.split())
    cloud = " ".join(CliRunner().invoke(main, ["cloud", "--help"]).output.split())  # its --serve: not "from the cloud"
    assert "comes from the cloud" not in cloud and "queue the jobs the operator submits (fedtier submit" in cloud, cloud


def test_every_numeric_flag_names_its_unit_in_the_help():
    """``--wait FINITE NUMBER`` (fedtier jobs|submit|cancel|fleet|monitor), ``--refresh``, ``--deadline``, ``--drop``
    and ``--max-samples`` showed the type's name where the help names what the number is: SECONDS, FRACTION, N."""
    import click

    def commands(group: click.Group, prefix: list[str]):
        for name, command in group.commands.items():
            yield [*prefix, name]
            if isinstance(command, click.Group):
                yield from commands(command, [*prefix, name])

    for path in commands(main, []):
        said = CliRunner().invoke(main, [*path, "--help"]).output
        assert "FINITE NUMBER" not in said, (path, said)


def test_an_algorithm_key_set_on_a_config_without_algorithm_says_its_name_is_needed(tmp_path):
    """``fedtier sim c.toml --set algorithm.lr=0.05`` on a config without [algorithm] (which runs fedavg) said
    'algorithm.name: required (e.g. "fedavg")' of a name the operator never touched; ``name = 3`` said "required"."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[data]\ndataset = "digits"\n')
    res = CliRunner().invoke(main, ["sim", str(cfg), "--set", "algorithm.lr=0.05"])
    said = " ".join(res.output.split())
    assert (
        res.exit_code == 2 and "algorithm.name: required once [algorithm] (or --set algorithm.KEY) sets a key" in said
    )
    res = CliRunner().invoke(main, ["sim", str(cfg), "--set", "algorithm.name=3"])
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and "algorithm.name = 3: must be an algorithm's name" in said, said


def test_a_serving_nodes_start_line_and_stop_summary_are_one_line_each_in_a_log(
    capsys: pytest.CaptureFixture, job_lines: list[str]
) -> None:
    """Walk-through (deploy-fleet.md step 3, `fedtier cloud --serve ... > cloud.log`, as a journal takes it): the
    cloud's start line came out broken at 80 columns, three lines (three journal entries), as did a long stop
    summary. Each is one line now, however long its folder or its list of jobs; the job lines between them too
    (``job_lines``: what say_serving sets up is undone after the test)."""
    from types import SimpleNamespace

    from fedtier.cmd_deploy import say_served, say_serving
    from fedtier.serve import served_summary
    from protocols.joblog import say_ended, say_taken

    folder = "/srv/" + "/".join(["federation"] * 40) + "/runs/fed"  # past any terminal's width
    cfg = SimpleNamespace(run=SimpleNamespace(name="fed"), security=SimpleNamespace(keys=None))  # unsigned: no check
    opts = SimpleNamespace(url="mqtts://broker.example:8883")
    say_serving("cloud", cfg, opts, f"its job queue and job folders in {folder}")  # type: ignore[arg-type]
    say_taken("cloud", "job-40", 20)  # its job lines too (and the console's markup is not read in them)
    say_ended("cloud", "job-39", "failed", f"[bold]{folder}[/bold] is full")
    say_served(served_summary("cloud", [f"job-{i}" for i in range(40)], "job-40"))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4 and folder in lines[0], lines
    assert lines[0].endswith("(a line as each job is taken and ends; -v: each round's)"), lines
    assert lines[1:3] == [
        "cloud: job job-40 taken (20 rounds)",
        f"cloud: job job-39 failed: [bold]{folder}[/bold] is full",
    ]
    lines = [lines[0], lines[3]]
    assert lines[1].startswith("cloud: served 40 jobs (job-0, ") and lines[1].endswith("when the cloud starts again")


def test_a_commands_line_off_a_terminal_is_one_line_its_paths_whole(tmp_path):
    """Walked: `fedtier provision` said 'broker config in fed/broker (mosquitto -c' and 'fed/broker/mosquitto.conf)' on
    two lines in a log (rich's hard wrap at 80 columns off a terminal), `fedtier partition` 'start each agent' and
    'with --data fed-data/<device>.npz'. The CLI's console never breaks a line off a terminal."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(out=tmp_path / "out"))
    out = tmp_path / ("a-folder-whose-name-is-long-enough-to-pass-80-columns" * 2)
    res = CliRunner().invoke(main, ["partition", str(cfg), "--out", str(out)])
    assert res.exit_code == 0, res.output
    line = f"wrote 4 npz sources (1,438 samples) and test.npz to {out}; start each agent with --data {out}/<device>.npz"
    assert line in res.output.splitlines(), res.output


def test_a_log_record_off_a_terminal_is_one_line_however_long(monkeypatch):
    """A serving node's journal (stderr no terminal): rich's log handler wrapped a warning at 80 columns (two or three
    journal entries, a path in it broken where a word ended); wider, it padded every line with spaces. Now a record
    is one plain line, peer text still escaped."""
    import io
    import logging

    from fedtier.console import setup_logging

    path = "/var/lib/fedtier/" + "a-folder-name-longer-than-a-terminal-line/" * 2 + "data.npz"
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    try:
        setup_logging(0)
        logging.getLogger("fedtier.test").warning("cannot read %s: \x1b]0;forged", path)
        logging.getLogger("fedtier.test").info("not at the default level")
    finally:
        logging.basicConfig(handlers=[logging.NullHandler()], force=True)
    lines = stderr.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].endswith(f"WARNING  cannot read {path}: \\x1b]0;forged"), lines


def test_the_plain_log_handler_writes_where_stderr_is_now_not_where_it_was_set_up(monkeypatch):
    """The plain handler took the stderr of when logging was set up (a CliRunner's, closed by the next test of the
    process: a record there raised 'I/O operation on closed file'); rich's handler follows the console's stderr of
    the moment, and so does the plain one now."""
    import io
    import logging

    from fedtier.console import setup_logging

    then, now = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", then)
    try:
        setup_logging(0)
        monkeypatch.setattr(sys, "stderr", now)
        then.close()  # as a CliRunner's stream is once its command returned
        logging.getLogger("fedtier.test").warning("said after stderr changed")
    finally:
        logging.basicConfig(handlers=[logging.NullHandler()], force=True)
    assert now.getvalue().endswith("WARNING  said after stderr changed\n"), now.getvalue()
