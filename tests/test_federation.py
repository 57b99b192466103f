"""A federation that stays up, as an operator runs it: ``fedtier provision --federation``, the provisioned
Mosquitto (TLS, ACLs), every node its own long-lived process started from its bundle (``--serve``), and
jobs submitted with ``fedtier submit``, signed by the operator identity.

Two jobs (FedAvg on an MLP, DeComFL on a logistic regression) run back to back on the same cloud, cell
and agents, with no node restarted between them, and each ends with the model ``fedtier sim`` gives for
it; the cloud is killed (SIGKILL) with the first running and the second queued, restarted, and both
finish; a job signed with another key is refused; job C starts from A's model; a long job's cell is killed
(SIGKILL) and restarted mid-job and serves the rest of it, then the job is cancelled; the nodes stop cleanly on
SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from edge_agent.runner import save_device_data
from fedtier.cli import main
from fedtier.provisioning import provision
from monitor.fleet import Fleet
from protocols import runfiles
from protocols.jobs import canonical_job, read_job_file
from protocols.procs import popen
from protocols.roster import roster_topic, verify_roster
from protocols.trainer import LocalData
from protocols.transport.broker import find_mosquitto, free_port
from protocols.wire.keys import KeyRing, PublicKeys, load_keys, load_public_keys, new_seed, public_of, write_keys
from sim.hierarchy import prepare
from sim.launcher import run_simulation
from tests.conftest import small_config, wait_until
from tests.test_membership import _say_last_words
from tests.test_provision import WAIT, Inbox, broker_user, clients, mosquitto, reachable_tmp  # noqa: F401

FEDTIER = str(Path(sys.executable).parent / "fedtier")
# The commands of docs/tutorials/deploy-fleet.md, run here as the tutorial shows them, each in its bundle
# (tests/test_docs.py checks that the page shows these very lines).
CLOUD = "fedtier cloud config.toml --serve --test-data test.npz --no-progress"
CELL = "fedtier cell config.toml --serve --cell {cell}"
AGENT = "fedtier agent config.toml --serve --device {device} --data data.npz"
JOBS_WAIT = "fedtier jobs --config config.toml --wait 50"
SUBMIT = "fedtier submit {job} --config config.toml"
JOBS_LIST = "fedtier jobs --config config.toml --json"


def command(line: str, **names: str) -> list[str]:
    """A tutorial command line as this test runs it: the venv's fedtier, ``names`` filled in."""
    return [FEDTIER, *shlex.split(line.format(**names))[1:]]


pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")

COMMON = """
[run]
seed = 1
rounds = 4
[data]
dataset = "digits"
partition = "iid"
max_train = 400
[runtime]
device_deadline = 30.0
startup_wait = 30.0
heartbeat = 1.0
"""
JOB_A = """
[job]
id = "A"
[algorithm]
name = "fedavg"
edge_rounds = 1
local_steps = 5
batch_size = 16
lr = 0.1
[model]
name = "mlp"
hidden = [16]
""" + COMMON.replace("rounds = 4", "rounds = 20")  # the cell is stopped after its first round: 19 to go
JOB_B = (
    """
[job]
id = "B"
[algorithm]
name = "decomfl"
edge_rounds = 1
local_steps = 1
perturbations = 4
lr = 0.02
batch_size = 16
[model]
name = "logreg"
"""
    + COMMON
)

JOB_C = JOB_A.replace('id = "A"', 'id = "C"\ninit_from = "A"').replace("rounds = 20", "rounds = 1")


def _start(cmd: list[str], cwd: Path) -> subprocess.Popen:
    return popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run(cmd: list[str], cwd: Path, stderr: bool = True) -> subprocess.CompletedProcess:
    """An operator's ``fedtier`` command (``cmd``, as :func:`command` makes it) run in this process from ``cwd``, its
    bundle: the same command line, no Python process to start (it imports no torch). Its stdout, and its stderr
    interleaved (``stderr``)."""
    from click.testing import CliRunner

    with contextlib.chdir(cwd):
        res = CliRunner().invoke(main, cmd[1:])
    unexpected = "" if res.exception is None or isinstance(res.exception, SystemExit) else repr(res.exception)
    return subprocess.CompletedProcess(cmd, res.exit_code, (res.output if stderr else res.stdout) + unexpected)


def _torch_loaded(pid: int) -> bool | None:
    """Whether process ``pid`` has torch's library mapped (it imported torch); None where /proc cannot tell."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None


def _jobs(cloud_out: Path) -> dict[str, str]:
    path = cloud_out / "jobs.json"
    try:
        return {j["job"]: j["state"] for j in json.loads(path.read_text())["jobs"]}
    except (OSError, ValueError):
        return {}


def _fleet(bundle: Path, wait: float = 1.0) -> dict[str, dict]:
    """``fedtier fleet --json`` from ``bundle`` (the monitor's: its keys check every status): node -> row."""
    res = _run([FEDTIER, "fleet", "--config", "config.toml", "--json", "--wait", str(wait)], bundle, stderr=False)
    return {r["node"]: r for r in map(json.loads, res.stdout.splitlines())} if res.returncode == 0 else {}


def _every_node(bundle: Path, port: int, state: str, seen: list[dict], timeout: float = 30.0) -> bool:
    """Every node of the federation in ``state`` in the fleet view, within ``timeout``: ``idle``: up (online) with
    its fedtier version and no job session, as between jobs (and before the first); ``offline``: as after SIGTERM.
    The view is the one ``fedtier fleet --json`` builds from ``bundle`` (the monitor's: its keys check every
    status), followed on one connection until it holds (a retained status comes at once) instead of a process
    and a fixed listening time for each look (``_fleet``, the command itself, is run below too). The monitor's
    identity is its client id at the broker: the connection is closed before the next one of the monitor's."""
    cfg = tomllib.loads((bundle / "config.toml").read_text())
    view = Fleet(cfg["run"]["name"], load_public_keys(bundle / cfg["security"]["keys"]))
    up = state == "idle"

    def holds() -> bool:
        now = view.clock()
        rows = {r.node: r.as_dict(now) for r in view.rows()}
        seen[:] = [rows]
        return set(rows) == {"cloud", "c0", "c0-d0", "c0-d1"} and all(
            r["state"] == state and r["online"] == up and bool(r["fedtier"]) == up and (r["session"] is None or not up)
            for r in rows.values()
        )

    with clients() as make:
        transport = make(bundle, port, client_id="monitor")
        view.start(transport)
        transport.connect(WAIT)
        return wait_until(holds, timeout)


def test_two_jobs_on_long_lived_nodes_survive_a_killed_cloud(reachable_tmp: Path) -> None:  # noqa: F811
    tmp = reachable_tmp / "fed"
    fed_cfg = small_config(tmp, run={"name": "fed"}, topology={"cells": 1, "devices_per_cell": 2})
    port = free_port()
    user = broker_user()
    done = provision(
        fed_cfg,
        tmp / "prov",
        port=port,
        bind="127.0.0.1",
        broker_user=user[1] if user else None,
        federation=True,
        fedtier_bin=FEDTIER,
        max_device_weight=500,
    )
    nodes = done.out / "nodes"
    assert "algorithm" not in tomllib.loads((nodes / "c0-d0" / "config.toml").read_text())  # no training config
    for name, text in (("A", JOB_A), ("B", JOB_B)):
        (tmp / f"{name}.toml").write_text(text)
    # what the operator ships to each device (its data) and to the cloud (a test set), once
    cfg_a, _ = canonical_job(read_job_file(tmp / "A.toml").config, fed_cfg)
    prep = prepare(cfg_a)
    for device, data in prep.device_data.items():
        save_device_data(nodes / device / "data.npz", data, prep.spec)
    save_device_data(nodes / "cloud" / "test.npz", LocalData(prep.dataset.x_test, prep.dataset.y_test), prep.spec)

    cloud_cmd = command(CLOUD)
    cloud_out = nodes / "cloud" / "runs" / "fed"
    with mosquitto(done.broker / "mosquitto.conf", port):
        procs = {  # started first: they start up while the operator's early submission below is refused
            "cell": _start(command(CELL, cell="c0"), nodes / "c0"),
            **{d: _start(command(AGENT, device=d), nodes / d) for d in ("c0-d0", "c0-d1")},
        }
        cloud, terminated = None, False
        try:
            # before any cloud ever connected, a submission would reach nobody: refused at once, saying so
            early = _run([*command(SUBMIT, job=str(tmp / "A.toml")), "--wait", "1"], nodes / "operator")
            assert early.returncode == 1 and "no cloud has served" in early.stdout, early.stdout
            cloud = _start(cloud_cmd, nodes / "cloud")
            operator = nodes / "operator"
            res = _run(command(JOBS_WAIT), operator)  # the cloud is up
            assert res.returncode == 0, res.stdout
            fleet: list[dict] = []  # before the first job, every node is up and idle (it was shown offline)
            assert _every_node(nodes / "monitor", port, "idle", fleet), fleet
            # kill -9 the cloud with A running (a round done) and B queued; restart it from its bundle. The cell
            # is stopped (SIGSTOP) once A has a round done, so A cannot end while B is submitted (the cloud
            # waits a cell deadline, 55 s, for the stopped cell); it goes on (SIGCONT) before the cloud restarts
            res = _run(command(SUBMIT, job=str(tmp / "A.toml")), operator)
            assert res.returncode == 0 and "queued" in res.stdout, res.stdout
            metrics_a = cloud_out / "jobs" / "A" / runfiles.METRICS
            assert wait_until(lambda: metrics_a.exists() and metrics_a.read_text().count("\n") >= 1, 90)
            procs["cell"].send_signal(signal.SIGSTOP)
            try:
                assert _jobs(cloud_out) == {"A": "running"}
                res = _run(command(SUBMIT, job=str(tmp / "B.toml")), operator)
                assert res.returncode == 0 and "queued" in res.stdout, res.stdout
                cloud.send_signal(signal.SIGKILL)
                cloud.communicate(timeout=10)
                assert _jobs(cloud_out) == {"A": "running", "B": "queued"}
            finally:
                procs["cell"].send_signal(signal.SIGCONT)
            cloud = _start(cloud_cmd, nodes / "cloud")
            # an identity that is not the operator's: same broker login, another signing key -> refused
            forged = tmp / "forged"
            forged.mkdir()
            for f in ("config.toml", "ca.crt", "client.crt", "client.key"):
                (forged / f).write_bytes((operator / f).read_bytes())
            seed, cloud_public = new_seed(), (tomllib.loads((operator / "keys.toml").read_text()))["public"]["cloud"]
            write_keys(
                forged / "keys.toml",
                KeyRing({"operator": seed}, {"operator": public_of(seed), "cloud": bytes.fromhex(cloud_public)}),
            )
            res = _run([FEDTIER, "submit", str(tmp / "A.toml"), "--config", "config.toml", "--id", "evil"], forged)
            assert res.returncode == 1 and "refused" in res.stdout and "signature" in res.stdout, res.stdout

            assert wait_until(lambda: _jobs(cloud_out) == {"A": "finished", "B": "finished"}, 120), _jobs(cloud_out)
            # job C starts from A's final model (DeComFL could not: tests/test_jobs.py)
            (tmp / "C.toml").write_text(JOB_C)
            res = _run(command(SUBMIT, job=str(tmp / "C.toml")), operator)
            assert "queued" in res.stdout, res.stdout
            assert wait_until(lambda: _jobs(cloud_out).get("C") == "finished", 60), _jobs(cloud_out)
            assert _every_node(nodes / "monitor", port, "idle", fleet), fleet  # between jobs: idle again
            # the agents' devices, connected between jobs, repeat their idle status every runtime.heartbeat (1 s)
            rows = _fleet(nodes / "monitor", wait=2.5)
            assert all(rows[d]["state"] == "idle" and rows[d]["heartbeats_seen"] >= 1 for d in ("c0-d0", "c0-d1")), rows
            # job E (500 rounds): its cell is killed (SIGKILL) mid-job and restarted from its bundle: it
            # resumes its round and serves the rest of the job; then E is cancelled: it stops after its round
            (tmp / "E.toml").write_text(JOB_A.replace('id = "A"', 'id = "E"').replace("rounds = 20", "rounds = 500"))
            res = _run([FEDTIER, "submit", str(tmp / "E.toml"), "--config", "config.toml"], operator)
            metrics_e = cloud_out / "jobs" / "E" / runfiles.METRICS
            rounds_e = lambda: metrics_e.read_text().count("\n") if metrics_e.exists() else 0  # noqa: E731
            assert wait_until(lambda: rounds_e() >= 1, 60)
            # a cell aggregates without torch (jobs A, B and C served, E begun), an agent trains with it
            assert _torch_loaded(procs["cell"].pid) is not True and _torch_loaded(procs["c0-d0"].pid) is not False
            procs["cell"].send_signal(signal.SIGKILL)
            procs["cell"].communicate(timeout=10)
            killed_at = rounds_e()
            procs["cell"] = _start(command(CELL, cell="c0"), nodes / "c0")
            assert wait_until(lambda: rounds_e() >= killed_at + 3, 90), rounds_e()
            records = [json.loads(line) for line in metrics_e.read_text().splitlines()]
            assert all(r["cells_reported"] == ["c0"] for r in records[killed_at + 1 :]), records[killed_at:]
            res = _run([FEDTIER, "cancel", "E", "--config", "config.toml"], operator)
            assert res.returncode == 0 and "cancelling" in res.stdout, res.stdout
            assert wait_until(lambda: _jobs(cloud_out).get("E") == "cancelled", 60), _jobs(cloud_out)
            assert rounds_e() < 500
            # at once after the job's end, in this process: the cloud says idle as a job ends, never offline between
            # jobs, so no warning that it is offline (stderr, merged: the JSON would not parse) precedes the list
            res = _run(command(JOBS_LIST), operator)
            listed = {j["job"]: j for j in json.loads(res.stdout)}
            states = [j["state"] for j in listed.values()]
            assert res.returncode == 0 and states == ["finished"] * 3 + ["cancelled"], states
            for name, p in procs.items():
                assert p.poll() is None, f"{name} exited: {p.communicate()[0]}"  # nobody restarted between jobs
            for p in (*procs.values(), cloud):  # `systemctl reload`: each takes its TLS files again, stays up
                p.send_signal(signal.SIGHUP)
            assert _every_node(nodes / "monitor", port, "idle", fleet), fleet
            # the cloud publishes the federation's roster, signed, retained: what provisioning knows
            with clients() as make:
                inbox = Inbox()
                monitor = make(nodes / "monitor", port, client_id="monitor").connect(WAIT)
                monitor.subscribe(roster_topic("fed"), inbox)
                (_, data), *_ = inbox.wait_for(roster_topic("fed"))
            ring = load_keys(nodes / "monitor" / "keys.toml", need_private=False)
            roster = verify_roster(data, PublicKeys(ring.public).verify, federation="fed")
            assert roster.members("c0") == ["c0-d0", "c0-d1"] and roster.device_key("c0-d1") == ring.public["c0-d1"]
            assert roster.cell_bound("c0") == 1000
            # SIGTERM between jobs: each node says offline before it disconnects (idle nodes are not left idle)
            for p in (*procs.values(), cloud):
                p.send_signal(signal.SIGTERM)
            terminated = True  # once: a second SIGTERM while a node stops would kill it (no clean exit)
            assert _every_node(nodes / "monitor", port, "offline", fleet), [
                (n, r["state"], r["online"], r["fedtier"], r["session"]) for n, r in fleet[0].items()
            ]
        finally:
            outputs = {}
            running = {**procs, **({"cloud": cloud} if cloud else {})}
            for p in running.values():
                if p.poll() is None and not terminated:
                    p.send_signal(signal.SIGTERM)
            for name, p in running.items():
                try:
                    outputs[name] = p.communicate(timeout=20)[0]
                except subprocess.TimeoutExpired:
                    p.kill()
                    outputs[name] = p.communicate()[0]
            _say_last_words(outputs, done.broker / "mosquitto.log", cloud_out / "jobs.json")  # shown if it failed
    for name in procs:
        assert procs[name].returncode == 0, f"{name}: {outputs[name]}"  # SIGTERM: a clean stop
        assert "TLS reload:" in outputs[name] and "now present client.crt" in outputs[name], outputs[name]
    assert "served 4 jobs (A, B, C, E)" in outputs["c0-d0"], outputs["c0-d0"]
    # each node's line as it takes a job and as the job ends for it, at the default level (the cell: restarted before E)
    for job in ("A", "B", "C", "E"):
        said = outputs["c0-d0"]
        assert f"device c0-d0: job {job} taken (" in said and f"device c0-d0: job {job} ended (" in said, said
    said = outputs["cell"]
    assert (
        "cell c0: job E taken (500 rounds, resumed from its journal)" in said
        and "cell c0: job E stopped: cancelled by the operator" in said
    ), said
    said = outputs["cloud"]
    assert re.search("cloud: job A taken \\(\\d+ rounds, resumed from its checkpoint\\)", said), said
    for job in ("B", "C"):
        assert re.search(f"cloud: job {job} finished \\(\\d+ rounds?, accuracy 0\\.\\d+, loss", said), said
    assert "cloud: job E cancelled" in said, said
    assert cloud.returncode == 0 and "cloud: served 4 jobs (A, B, C, E)" in outputs["cloud"], outputs[
        "cloud"
    ]  # (A: resumed)
    jobs_json = {j["job"]: j for j in json.loads((cloud_out / "jobs.json").read_text())["jobs"]}
    for name in ("A", "B", "C"):
        cfg, _ = canonical_job(read_job_file(tmp / f"{name}.toml").config, fed_cfg)
        if name == "C":  # fedtier sim from the model job A ended with
            init = str(cloud_out / "jobs" / "A" / runfiles.FINAL_MODEL)
            cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"init_model": init})})
        sim = run_simulation(
            cfg.model_copy(update={"run": cfg.run.model_copy(update={"output": str(tmp / f"sim{name}")})})
        )
        deployed = cloud_out / "jobs" / name / runfiles.FINAL_MODEL
        assert deployed.read_bytes() == (sim.output_dir / runfiles.FINAL_MODEL).read_bytes(), name
        summary = json.loads((cloud_out / "jobs" / name / runfiles.SUMMARY).read_text())
        assert (summary["job"], summary["config_hash"]) == (name, jobs_json[name]["digest"]), summary  # not the fed's
        figures = ("rounds", "accuracy", "loss")  # how well it did, as `fedtier jobs` lists it (A: with its resume)
        assert [listed[name][k] for k in figures] == [summary[k] for k in figures], (listed[name], summary)


def test_every_generated_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    import shutil

    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    done = provision(
        small_config(tmp_path, run={"name": "fed"}), tmp_path / "prov", federation=True, fedtier_bin=FEDTIER
    )
    units = sorted(done.out.glob("nodes/*/fedtier-*.service"))
    assert [u.parent.name for u in units] == sorted(
        ["cloud", "c0", "c1", *(f"c{c}-d{d}" for c in range(2) for d in range(3))]
    )
    for unit in units:
        text = unit.read_text()
        assert "Restart=on-failure" in text and "User=fedtier" in text and "NoNewPrivileges=yes" in text
        assert "RestartPreventExitStatus=2\n" in text  # a wrong config, certificate or data: no restart loop
        assert (
            f"WorkingDirectory=/etc/fedtier/{unit.parent.name}\n" in text
            and "ExecReload=/bin/kill -HUP $MAINPID" in text
        )
        argv = shlex.split(text.split("ExecStart=", 1)[1].splitlines()[0])
        assert argv[0] == FEDTIER and argv[2:4] == ["config.toml", "--serve"], argv
        command = main.commands[argv[1]]  # every flag the unit passes is one of that command's
        flags = {opt for param in command.params for opt in param.opts}
        assert {a for a in argv[2:] if a.startswith("--")} <= flags, argv
        res = subprocess.run(
            ["systemd-analyze", "verify", str(unit)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"},
        )
        assert res.returncode == 0 and unit.name not in res.stderr, res.stderr
