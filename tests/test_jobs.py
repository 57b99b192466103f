"""Jobs on a federation, without a broker: the job's canonical config and hash, the records that carry
it, and the cloud's durable queue (``protocols/jobs.py``, ``cloud/jobs.py``)."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from cloud.jobs import Job, JobQueue, JobQueueError
from protocols.jobs import (
    OPERATOR,
    CurrentJob,
    JobError,
    canonical_job,
    config_hash,
    job_session,
    open_job_record,
    parse_current,
    read_job_file,
)
from protocols.privacy.ledger import PrivacyLedger
from protocols.session import CloudSession
from protocols.wire import topics
from protocols.wire.keys import PublicKeys, Trust, new_seed, public_of
from protocols.wire.signed import seal_record
from tests.conftest import small_config, with_keys

JOB = """
[job]
id = "a1"
[run]
seed = 3
rounds = 2
[algorithm]
name = "fedavg"
lr = 0.5
[model]
name = "mlp"
hidden = [8]
"""


def federation(tmp_path: Path):
    return small_config(tmp_path, run={"name": "fed"})


def test_a_job_is_validated_against_the_federation_and_hashed_canonically(tmp_path: Path) -> None:
    fed = federation(tmp_path)
    (tmp_path / "a.toml").write_text(JOB)
    request = read_job_file(tmp_path / "a.toml")
    assert request.job == "a1" and request.init_from is None
    cfg, text = canonical_job(request.config, fed)
    assert cfg.run.name == "fed" and cfg.topology == fed.topology and cfg.train.lr == 0.5
    assert "url =" not in text and "keys =" not in text  # nothing node-local in what every node hashes
    # the hash is over the canonical text: every node computes it alike, any change changes it
    again, text2 = canonical_job(request.config, fed)
    assert text2 == text and config_hash(text) == config_hash(text2)
    _, other = canonical_job(request.config.replace("lr = 0.5", "lr = 0.1"), fed)
    assert config_hash(other) != config_hash(text)
    # a node builds the same config from the published record, with its own broker and folder
    current = parse_current(CurrentJob("a1", text, config_hash(text)).record())
    local = current.run_config(fed)
    assert local.train == cfg.train and local.output_dir() == fed.output_dir() / "jobs" / "a1"
    assert current.session == job_session("a1", config_hash(text)) and current.session.startswith("a1.")


@pytest.mark.parametrize(
    "edit, reason",
    [
        ('[broker]\nurl = "mqtt://elsewhere:1883"\n', "may not set"),
        (
            "[topology]\ncells = 5\n",
            r"^topology.cells = 5, the federation's: 2\. A job runs on the federation's topology",
        ),
        (
            '[topology]\nmembers = {c0 = ["a"]}\n',
            r'members = \{ "c0" = \["a"\] \}, the federation\'s: none \(2 cells of 3',
        ),
        ("topology = 3\n", r"^topology = 3: \[topology\] is a section"),
        (
            '[run]\nname = "mine"\n',
            r"^run.name = \"mine\": a job runs on the federation's topics, named 'fed'",
        ),  # was a TypeError of {**fed, **3}
        ('[algorithm]\nname = "fedavg"\nlr = -1\n', "lr"),
        ('[algorithm]\nname = "nonesuch"\n', "nonesuch"),
        ("[requirements]\nwire = 2\n", "needs wire protocol 2"),
        ('[run]\ninit_model = "/etc/passwd"\n', "init_from"),
    ],
)
def test_a_bad_job_is_refused_with_the_reason(tmp_path: Path, edit: str, reason: str) -> None:
    """Each refusal a sentence naming the key, the job's value and the federation's (the topology's said Python
    dicts: "the job's [topology] {'cells': 5} is not the federation's {'cells': 2, ..., 'members': None}"; a job's
    other run.name was replaced without a word)."""
    with pytest.raises(JobError, match=reason):
        canonical_job(edit, federation(tmp_path))
    canonical_job('[run]\nname = "fed"\n[topology]\ncells = 2\n', federation(tmp_path))  # the federation's own: taken


def test_a_node_refuses_a_job_record_whose_config_does_not_match_its_hash(tmp_path: Path) -> None:
    _, text = canonical_job("[run]\nrounds = 2\n", federation(tmp_path))
    record = CurrentJob("a1", text, config_hash(text)).record()
    with pytest.raises(JobError, match="hash"):
        parse_current({**record, "config": text.replace("rounds = 2", "rounds = 3")})
    with pytest.raises(JobError, match="job id"):
        parse_current({**record, "job": "a/../b"})


def test_only_the_operators_signature_submits_a_job() -> None:
    operator, intruder = new_seed(), new_seed()
    keys = PublicKeys({OPERATOR: public_of(operator)})
    topic = topics.job_submit("fed")
    record = {"action": "submit", "job": "a1", "config": ""}
    signed = seal_record(record, topic, Trust(OPERATOR, operator, {}).sign)
    assert open_job_record(signed, topic, OPERATOR, keys.verify)["job"] == "a1"
    forged = seal_record(record, topic, Trust(OPERATOR, intruder, {}).sign)
    with pytest.raises(JobError, match="bad signature"):
        open_job_record(forged, topic, OPERATOR, keys.verify)
    with pytest.raises(JobError, match="unsigned"):
        open_job_record(seal_record(record, topic, None), topic, OPERATOR, keys.verify)
    with pytest.raises(JobError, match="bad signature"):  # a signed record moved to another topic
        open_job_record(signed, topics.job_submit("other"), OPERATOR, keys.verify)


def test_a_node_pinned_to_a_job_ignores_another_jobs_cloud_session() -> None:
    cloud = CloudSession(pinned="a1.0123456789abcdef")
    assert cloud.session == "a1.0123456789abcdef"  # current at once: the cloud signed it in the job record
    cloud.on_status({"state": "online", "session": "b2.fedcba9876543210", "started": 1.0})
    assert cloud.session == "a1.0123456789abcdef"
    cloud.on_status({"state": "online", "session": "a1.0123456789abcdef", "started": 2.0})
    assert cloud.session == "a1.0123456789abcdef"
    cloud.on_status({"state": "online", "session": "b2.fedcba9876543210", "started": 3.0})
    assert cloud.session == "a1.0123456789abcdef"


def job(name: str, **kw) -> Job:
    return Job(name, f"[run]\nname = {name!r}\n", config_hash(name), OPERATOR, **kw)


def test_the_queue_survives_a_restart_with_the_running_job_first(tmp_path: Path) -> None:
    q = JobQueue(tmp_path / "jobs.json")
    for name in ("a", "b", "c"):
        q.submit(job(name))
    q.start("a")
    q.cancel("c")
    # a cloud killed now: the file on disk is all the next one knows
    again = JobQueue(tmp_path / "jobs.json")
    assert [(j.job, j.state) for j in again.jobs.values()] == [("a", "running"), ("b", "queued"), ("c", "cancelled")]
    assert again.next().job == "a"
    again.end("a", "finished")
    assert again.next().job == "b"
    again.cancel("b")  # cancelling a queued job ends it at once
    assert again.next() is None and again.get("b").state == "cancelled"
    assert not list(tmp_path.glob("*.tmp"))


def test_the_queue_refuses_duplicates_unknown_bases_and_ended_jobs(tmp_path: Path) -> None:
    q = JobQueue(tmp_path / "jobs.json")
    q.submit(job("a"))
    with pytest.raises(JobError, match="exists already"):
        q.submit(job("a"))
    with pytest.raises(JobError, match="no job 'zz'"):
        q.submit(job("b", init_from="zz"))
    q.start("a")
    q.cancel("a")  # running: after its current round
    assert q.get("a").state == "running" and q.get("a").cancel_requested
    q.end("a", "cancelled", "cancelled by the operator")
    with pytest.raises(JobError, match="has ended"):
        q.cancel("a")
    with pytest.raises(JobError, match="ended cancelled"):
        q.submit(job("b", init_from="a"))


def test_a_queue_that_cannot_be_written_is_an_error_and_loses_nothing(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(JobQueueError, match="cannot write the job queue"):
        JobQueue(blocker / "jobs.json")  # its folder is a file: nothing can be written there
    q = JobQueue(tmp_path / "q" / "jobs.json")
    q.submit(job("a"))
    (tmp_path / "q" / "jobs.json.tmp").mkdir()  # the temporary file cannot be created now
    with pytest.raises(JobQueueError):
        q.submit(job("b"))
    assert list(q.jobs) == ["a"]  # not accepted: the queue in memory is the queue on disk
    assert [j["job"] for j in json.loads((tmp_path / "q" / "jobs.json").read_text())["jobs"]] == ["a"]
    (tmp_path / "q" / "jobs.json").write_text("{not json")
    with pytest.raises(JobQueueError, match="unreadable"):
        JobQueue(tmp_path / "q" / "jobs.json")


def test_a_run_starts_from_a_given_model_of_the_same_shapes_only(tmp_path: Path) -> None:
    from protocols.checkpoint import save_params
    from protocols.config import ConfigError

    cfg = small_config(tmp_path)
    spec = cfg.model_spec((64,), 10)
    seeded = cfg.build_algorithm(spec).initial_params()
    start = {k: v + 1.0 for k, v in seeded.items()}
    save_params(tmp_path / "start.ftw", start)
    given = cfg.model_copy(update={"run": cfg.run.model_copy(update={"init_model": str(tmp_path / "start.ftw")})})
    got = given.build_algorithm(spec).initial_params()
    assert all((got[k] == start[k]).all() for k in start) and got.keys() == start.keys()
    save_params(tmp_path / "other.ftw", cfg.build_algorithm(cfg.model_spec((32,), 10)).initial_params())
    other = cfg.model_copy(update={"run": cfg.run.model_copy(update={"init_model": str(tmp_path / "other.ftw")})})
    with pytest.raises(ConfigError, match=r"run.init_model: .* in .*other.ftw, the model's is"):
        other.build_algorithm(spec)
    # a long-lived node builds a job's algorithm, serves it, drops it: nothing keeps it (nor its model) alive
    import gc
    import weakref

    built = given.build_algorithm(spec)
    gone = weakref.ref(built)
    del built
    gc.collect()
    assert gone() is None, "a finished job's algorithm (and its initial model) is still held"


def test_fedtier_runs_job_binds_its_initial_model_and_a_node_refuses_another(tmp_path: Path) -> None:
    """`fedtier run` hands each node the path of ``run.init_model`` but submits its sha256: the digest is in
    the job's canonical text, so its config hash and session name the model; a node that builds the job
    (the cloud, a cell, an agent: ``with_init_model`` then ``build_algorithm``) from another file, or from
    none, refuses it, saying why."""
    import hashlib

    from protocols.checkpoint import save_params
    from protocols.config import ConfigError
    from sim.agent_workers import with_init_model
    from sim.local_federation import job_text

    cfg = federation(tmp_path)  # `fedtier run`: the federation is its config's run
    spec = cfg.model_spec((64,), 10)
    seeded = cfg.build_algorithm(spec).initial_params()
    save_params(tmp_path / "start.ftw", {k: v + 1.0 for k, v in seeded.items()})
    save_params(tmp_path / "other.ftw", {k: v - 1.0 for k, v in seeded.items()})  # same shapes, another model
    digest = hashlib.sha256((tmp_path / "start.ftw").read_bytes()).hexdigest()
    run = lambda path: cfg.model_copy(update={"run": cfg.run.model_copy(update={"init_model": str(path)})})  # noqa: E731
    job_cfg, text = canonical_job(job_text(run(tmp_path / "start.ftw")), federation(tmp_path))
    assert job_cfg.run.init_model is None and job_cfg.run.init_model_sha256 == digest
    _, other_text = canonical_job(job_text(run(tmp_path / "other.ftw")), federation(tmp_path))
    assert config_hash(text) != config_hash(other_text)  # another model: another job session
    got = with_init_model(job_cfg, str(tmp_path / "start.ftw")).build_algorithm(spec).initial_params()
    assert all((got[k] == seeded[k] + 1.0).all() for k in seeded)
    with pytest.raises(ConfigError, match=r"other.ftw: its sha256 is .*, not " + digest[:16]):
        with_init_model(job_cfg, str(tmp_path / "other.ftw")).build_algorithm(spec)
    with pytest.raises(ConfigError, match="this node has no run.init_model"):
        with_init_model(job_cfg, None).build_algorithm(spec)


def test_fedtier_run_refuses_an_initial_model_of_another_digest_than_the_configs(tmp_path: Path) -> None:
    """A config that names both ``run.init_model`` and its ``run.init_model_sha256`` (the operator's check of the
    file): `fedtier run` submits the job only if the file has that digest, as `fedtier sim` builds it only then;
    it never replaces the stated digest with the file's own."""
    import hashlib

    from protocols.checkpoint import save_params
    from protocols.config import ConfigError
    from sim.local_federation import job_text

    cfg = federation(tmp_path)  # `fedtier run`: the federation is its config's run
    seeded = cfg.build_algorithm(cfg.model_spec((64,), 10)).initial_params()
    save_params(tmp_path / "start.ftw", {k: v + 1.0 for k, v in seeded.items()})
    save_params(tmp_path / "other.ftw", {k: v - 1.0 for k, v in seeded.items()})
    digest = hashlib.sha256((tmp_path / "start.ftw").read_bytes()).hexdigest()

    def run(path: Path) -> Any:
        return cfg.model_copy(
            update={"run": cfg.run.model_copy(update={"init_model": str(path), "init_model_sha256": digest})}
        )

    job_cfg, _ = canonical_job(job_text(run(tmp_path / "start.ftw")), federation(tmp_path))
    assert job_cfg.run.init_model_sha256 == digest
    with pytest.raises(ConfigError, match=r"other.ftw: its sha256 is .*, not " + digest[:16]):
        job_text(run(tmp_path / "other.ftw"))


def _cloud_that_cannot_build(tmp_path: Path) -> tuple[Any, JobQueue, str]:
    """A long-lived cloud whose every job fails to build ("model.name: no such model here"), its queue (empty), and
    a job's canonical text: ``(service, queue, text)``."""
    from cloud.service import CloudService
    from protocols.config import ConfigError
    from protocols.transport.threadloop import ThreadLoop

    fed = federation(tmp_path)
    _, text = canonical_job("[run]\nrounds = 2\n", fed)
    queue = JobQueue(tmp_path / "jobs.json")

    def parts(cfg):
        raise ConfigError("model.name: no such model here")

    return CloudService(fed, ThreadLoop("t"), lambda: None, queue, parts, trust=None, operator=None), queue, text


def test_a_job_the_cloud_cannot_build_fails_with_its_reason_and_the_queue_goes_on(tmp_path: Path) -> None:
    """No crash (a restarted cloud would meet the same error again): the job ends ``failed`` with why."""
    service, queue, text = _cloud_that_cannot_build(tmp_path)
    for name in ("a", "b", "c"):
        queue.submit(Job(name, text, config_hash(text), OPERATOR, init_from="a" if name == "c" else None))
    assert service._run(queue.next(), transport=None) is False  # type: ignore[arg-type]
    assert (queue.get("a").state, queue.get("a").reason) == ("failed", "model.name: no such model here")
    assert queue.next().job == "b"
    queue.end("b", "cancelled")
    assert service._run(queue.next(), transport=None) is False  # type: ignore[arg-type]
    assert (
        queue.get("c").state == "failed" and "init_from: job 'a' has no final model (failed)" in queue.get("c").reason
    )
    assert queue.next() is None


def test_a_node_takes_only_the_job_the_cloud_signed_and_leaves_on_its_finished() -> None:
    """A cell or an agent builds a job from the retained ``cloud/job`` record only when the cloud signed
    it: a record signed by a lying cell (valid credentials, its own key) or unsigned is ignored."""
    from protocols.job_watch import JobWatch
    from protocols.transport.memory import MemoryHub
    from protocols.wire.messenger import Messenger
    from protocols.wire.payload import Payload

    seeds = {n: new_seed() for n in ("cloud", "c0", "c0-d0")}
    public = {n: public_of(s) for n, s in seeds.items()}
    trust = {n: Trust(n, s, public) for n, s in seeds.items()}
    hub = MemoryHub()
    watch = JobWatch(hub.connect("device.c0-d0"), "fed", trust["c0-d0"])
    topic = topics.current_job("fed")
    text = "[run]\nname = 'fed'\n"
    real = CurrentJob("a1", text, config_hash(text))
    forged = CurrentJob("evil", text + "# other\n", config_hash(text + "# other\n"))
    lying_cell = hub.connect("cell.c0")
    lying_cell.publish(topic, seal_record(forged.record(), topic, trust["c0"].sign), retain=True)
    lying_cell.publish(topic, seal_record(forged.record(), topic, None), retain=True)
    hub.loop.run()
    assert watch.current is None and watch.pending(set()) is None
    cloud = hub.connect("cloud")
    cloud.publish(topic, seal_record(real.record(), topic, trust["cloud"].sign), retain=True)
    hub.loop.run()
    assert watch.pending(set()) == real and watch.pending({real.session}) is None
    # the job's end: the cloud's signed finished for that session (a cell's forgery does not count)
    for sender in ("c0", "cloud"):
        Messenger(hub.connect(f"m-{sender}"), "fed", sender, trust=trust[sender]).send(
            topics.control("fed"), "control", Payload({"event": "finished", "session": real.session}), round=0
        )
        hub.loop.run()
        assert (real.session in watch.finished) == (sender == "cloud")
    # a cell (`fedtier cell --serve`) started after the job ended, here before the cloud cleared its job record: its
    # retained finished says so, and the cell stays idle for the next job
    Messenger(hub.connect("m-end"), "fed", "cloud", trust=trust["cloud"]).send(
        topics.control("fed"), "control", Payload({"event": "finished", "session": real.session}), round=0, retain=True
    )
    late = JobWatch(hub.connect("late-cell"), "fed", trust["c0"])
    hub.loop.run()
    assert late.current == real and late.pending(set()) is None


def test_init_from_is_refused_for_devices_that_keep_a_replica_of_the_initial_model(tmp_path: Path) -> None:
    """DeComFL's devices replay from x0: only the cloud would have the base job's model."""
    from cloud import job_requests
    from cloud.service import CloudService

    fed = federation(tmp_path)
    queue = JobQueue(tmp_path / "jobs.json")
    service = CloudService(fed, None, lambda: None, queue, None, trust=None, operator=None)  # type: ignore[arg-type]
    fedavg = '[algorithm]\nname = "fedavg"\n'
    job_requests.submit(service, "a", {"config": fedavg})
    queue.start("a")
    queue.end("a", "finished")
    job_requests.submit(service, "b", {"config": fedavg, "init_from": "a"})
    with pytest.raises(JobError, match="keep a model replica"):
        job_requests.submit(service, "c", {"config": '[algorithm]\nname = "decomfl"\n', "init_from": "a"})
    assert [j.job for j in queue.jobs.values()] == ["a", "b"]


def test_a_job_imports_only_the_plugins_its_nodes_allow(tmp_path: Path) -> None:
    """``run.plugins`` are modules a node imports while it reads the job: whoever signs jobs must not make a
    node import any installed module. The cloud refuses such a job at submit, and a node refuses a published
    one, before importing anything; a module the node's bundle lists is taken."""
    import sys

    job = JOB.replace("rounds = 2", 'rounds = 2\nplugins = ["this"]')  # the stdlib's Zen: prints on import
    sys.modules.pop("this", None)
    with pytest.raises(JobError, match=r"run.plugins \['this'\] this node does not allow"):
        canonical_job(read_job_text(tmp_path, job), federation(tmp_path))
    allowing = small_config(tmp_path, run={"name": "fed", "plugins": ["json"]})
    with pytest.raises(JobError, match=r"allowed now: \['json'\]"):
        canonical_job(read_job_text(tmp_path, job), allowing)
    # a node handed such a job (a lying or compromised signer) refuses it the same way
    cfg, _ = canonical_job(
        read_job_text(tmp_path, JOB.replace("rounds = 2", 'rounds = 2\nplugins = ["json"]')), allowing
    )
    text = cfg.to_toml(exclude=("broker", "security", "monitoring")).replace('"json"', '"this"')
    current = CurrentJob("a1", text, config_hash(text))
    with pytest.raises(JobError, match=r"job a1 imports run.plugins \['this'\]"):
        current.run_config(allowing)
    assert "this" not in sys.modules
    ok = cfg.to_toml(exclude=("broker", "security", "monitoring"))
    assert CurrentJob("a1", ok, config_hash(ok)).run_config(allowing).run.plugins == ["json"]


def read_job_text(tmp_path: Path, text: str) -> str:
    (tmp_path / "job.toml").write_text(text)
    return read_job_file(tmp_path / "job.toml").config


def test_a_job_that_ends_without_finishing_leaves_a_summary_saying_how_in_its_run_folder(tmp_path: Path) -> None:
    """A job the cloud cannot build left its run folder with a config and no summary, a cancelled one with its
    records and no summary: `fedtier monitor RUN_DIR --exit-when-done` (and any script reading summary.json)
    waited for ever on a job long over. Each now writes its summary.json: failed with the reason, stopped with
    "cancelled by the operator"; the monitor's run-folder source reads that end."""
    from cloud.service import CloudService, JobParts
    from fedtier.serve import write_job_final
    from monitor.sources import RunDirFollower
    from protocols.config import ConfigError
    from protocols.transport.memory import MemoryHub
    from protocols.transport.threadloop import ThreadLoop
    from sim.hierarchy import prepare

    fed = federation(tmp_path)
    _, text = canonical_job("[run]\nrounds = 2\n[runtime]\nstartup_wait = 1000.0\n", fed)
    queue = JobQueue(tmp_path / "jobs.json")
    ended: list[str] = []

    def parts(cfg):
        if cfg.run.seed == 0 and not ended:
            ended.append("built")
            raise ConfigError("model.name: no such model here")
        return JobParts(cfg.build_algorithm(prepare(cfg).spec), None)

    loop = ThreadLoop("t")
    folder = lambda job: tmp_path / "jobs" / job  # noqa: E731
    service = CloudService(fed, loop, lambda: None, queue, parts, trust=None, operator=None, job_folder=folder)

    def on_end(job: Job, cfg: Any, node: Any, out: Path) -> None:  # as `fedtier cloud --serve` does
        ended.append(f"{job.job} {node.job_status}")
        write_job_final(job, cfg, node, out)

    service.on_end = on_end
    for name in ("a", "b"):
        queue.submit(Job(name, text, config_hash(text), OPERATOR))
    assert service._run(queue.next(), transport=None) is False  # type: ignore[arg-type]
    states = RunDirFollower(folder("a")).poll_states()
    assert [(s["phase"], s["reason"]) for s in states] == [("failed", "model.name: no such model here")], states
    job = queue.start("b")
    queue.cancel("b")  # in its startup wait: no cell ever comes
    hub = MemoryHub(loop=loop)  # type: ignore[arg-type]
    assert service._run(queue.get("b") or job, transport=hub.connect("cloud")) is True
    assert queue.get("b").state == "cancelled" and ended[-1] == "b stopped", ended
    states = RunDirFollower(folder("b")).poll_states()
    assert [(s["phase"], s["reason"]) for s in states] == [("stopped", "cancelled by the operator")], states


def _waiting_cloud(tmp_path: Path, **kwargs: Any) -> tuple[Any, JobQueue, Any, str]:
    """A serving cloud (``kwargs``: more of its arguments), its queue and loop, and a job's text (2 rounds) whose
    start waits 1000 s for its cells: a test ends it by cancelling it or stopping the cloud."""
    from cloud.service import CloudService, JobParts
    from protocols.transport.threadloop import ThreadLoop
    from sim.hierarchy import prepare

    fed = federation(tmp_path)
    _, text = canonical_job("[run]\nrounds = 2\n[runtime]\nstartup_wait = 1000.0\n", fed)
    queue = JobQueue(tmp_path / "jobs.json")
    parts = lambda cfg: JobParts(cfg.build_algorithm(prepare(cfg).spec), None)  # noqa: E731
    loop = ThreadLoop("t")
    folder = lambda job: tmp_path / "jobs" / job  # noqa: E731
    service = CloudService(
        fed, loop, lambda: None, queue, parts, trust=None, operator=None, job_folder=folder, **kwargs
    )
    return service, queue, loop, text


def test_a_job_whose_final_model_cannot_be_written_ends_with_that_reason_and_the_queue_goes_on(tmp_path: Path) -> None:
    """Walk-through (a fleet's cloud whose job folder became unwritable mid-job): the job failed at its next
    checkpoint, then writing its final model raised out of the service: a traceback, exit 1, the job left ``running``
    in the queue until a restart (systemd's, 5 s on) failed it as it resumed, with another reason (its records'
    write), before the jobs queued behind it. Now the job ends with the reason (here a cancelled one: its state kept,
    the write's error added) and the service goes on to the next job."""
    from fedtier.serve import write_job_final
    from protocols.transport.memory import MemoryHub

    service, queue, loop, text = _waiting_cloud(tmp_path, on_end=write_job_final)
    folder = lambda job: tmp_path / "jobs" / job  # noqa: E731
    for name in ("a", "b"):
        queue.submit(Job(name, text, config_hash(text), OPERATOR))
    (folder("a") / "final_model.ftw").mkdir(parents=True)  # a folder where the final model goes: it cannot be written
    queue.start("a")
    queue.cancel("a")  # in its startup wait: it ends at once
    assert service._run(queue.get("a"), transport=MemoryHub(loop=loop).connect("cloud")) is True  # type: ignore[arg-type]
    ended = queue.get("a")
    assert ended.state == "cancelled" and ended.reason.startswith("cancelled by the operator; cannot write"), ended
    assert "final_model.ftw" in ended.reason
    assert queue.next().job == "b"


def test_a_job_that_cannot_be_built_is_said_failed_only_once_the_queue_holds_it(tmp_path: Path, caplog) -> None:
    """A build error and a queue that cannot be written both: the cloud stops saying so, not "job a failed" of a job
    its queue still holds queued (started again, it meets the error again and fails it then)."""
    service, queue, text = _cloud_that_cannot_build(tmp_path)
    queue.submit(Job("a", text, config_hash(text), OPERATOR))
    queue._save = lambda: (_ for _ in ()).throw(JobQueueError("cannot write the job queue: No space left on device"))
    with caplog.at_level(logging.ERROR), pytest.raises(JobQueueError, match="No space left"):
        service._run(queue.get("a"), transport=None)  # type: ignore[arg-type]
    said = [r.getMessage() for r in caplog.records]
    assert not any("job a failed" in line for line in said), said
    assert any("which the job queue cannot record: the cloud stops" in line for line in said), said
    assert JobQueue(queue.path).next().job == "a" and service.failed_at_start == []


def test_a_jobs_end_is_said_to_its_nodes_once_the_queue_holds_it_and_not_if_it_cannot(tmp_path: Path) -> None:
    """Walk-through (a fleet's cloud whose run folder, a 2 MB tmpfs, filled mid-job): the job failed on its checkpoint,
    the cloud told its cells the job had ended, then could not write that in its queue and stopped (exit 1). Started
    again once there was space, it resumed the job from its checkpoint, which its cells had left: it waited for them
    without end (no round in 2 min). Now the nodes are told once the queue holds the end: a queue that cannot be
    written stops the cloud with nothing said (its nodes go on with the job it resumes), and one that can is written
    before the ``finished`` record leaves. So is the cloud's retained end state (a monitor's): it said the job failed
    while the stopped cloud's queue said it running, resumed and finished."""
    from protocols.state import decode_state
    from protocols.transport.memory import MemoryHub

    service, queue, loop, text = _waiting_cloud(tmp_path)
    hub, said = MemoryHub(loop=loop), []  # the queue file's state of the job as each "finished" record leaves
    control, state = topics.control(service.fed), topics.state(service.fed, "cloud")

    def tap(topic: str, data: Any, *_: Any) -> None:
        phase = (decode_state(data, topic) or {}).get("phase") if topic == state else None
        if (topic == control and data) or phase in ("finished", "stopped", "failed"):
            said.append((phase or "finished record", _states(queue.path)))

    hub.tap = tap
    for name in ("a", "b"):
        queue.submit(Job(name, text, config_hash(text), OPERATOR))
    service.ledger.reserve("a", ["c0-d0"], 8.0, 1e-5)  # (as a DP job's submission does)
    save = queue._save
    queue._save = lambda: (_ for _ in ()).throw(JobQueueError("cannot write the job queue: No space left on device"))
    queue.jobs["a"] = replace(queue.jobs["a"], state="running", cancel_requested=True)  # ends in its startup wait
    with pytest.raises(JobQueueError, match="No space left"):
        service._run(queue.get("a"), transport=hub.connect("cloud"))  # type: ignore[arg-type]
    assert said == [] and JobQueue(queue.path).next().job == "a"  # nothing said; started again, it resumes a
    # ... and spends on: its reservation stays whole (settled at what it had spent, its later rounds went uncounted)
    assert PrivacyLedger(service.ledger.path).jobs["a"] == {
        "epsilon": 8.0,
        "delta": 1e-5,
        "devices": ["c0-d0"],
        "ended": False,
    }
    queue._save = save
    queue.jobs["a"] = replace(queue.jobs["a"], state="queued")
    queue.start("a")
    assert service._run(queue.get("a"), transport=hub.connect("cloud")) is True  # type: ignore[arg-type]
    ended = {"a": "cancelled", "b": "queued"}
    assert said == [("stopped", ended), ("finished record", ended)], said
    assert PrivacyLedger(service.ledger.path).jobs["a"]["ended"]  # settled once the queue holds its end


def test_a_cloud_whose_disk_is_full_as_a_job_resumes_stops_and_leaves_the_job_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Walk-through (a fleet's cloud stopped by a full disk mid-job, restarted by systemd while still full): each
    restart logged "job J failed: [Errno 28] No space left on device" (no file named) of a job the queue could not fail
    either, and resumed once there was room; where the queue could be written (a config copy that did not fit beside
    it), the job failed for the disk, its progress lost. Its config copy was left empty. Now the cloud stops saying
    which file and that the job resumes, the queue and the copy as they were."""

    from cloud.jobs import JobFolderFull
    from protocols.transport.memory import MemoryHub
    from tests.conftest import FullDisk

    service, queue, loop, text = _waiting_cloud(tmp_path)
    queue.submit(Job("a", text, config_hash(text), OPERATOR))
    queue.start("a")  # (running as the cloud stopped)
    kept = tmp_path / "jobs" / "a" / "config.toml"
    kept.parent.mkdir(parents=True)
    kept.write_text("# its copy\n")
    fdopen = os.fdopen  # the queue's file fits, the job's config copy does not

    def opened(fd: int, *args: Any) -> Any:
        return (FullDisk if kept.name in os.readlink(f"/proc/self/fd/{fd}") else lambda f: f)(fdopen(fd, *args))

    monkeypatch.setattr(os, "fdopen", opened)
    with caplog.at_level(logging.ERROR), pytest.raises(JobFolderFull) as stopped:
        service._run(queue.next(), transport=MemoryHub(loop=loop).connect("cloud"))  # type: ignore[arg-type]
    assert str(stopped.value) == (
        f"job a cannot resume: cannot write {kept}: No space left on device; it resumes from its checkpoint once the "
        "cloud can write there (the cloud stops)"
    )
    assert JobQueue(queue.path).get("a").state == "running" and kept.read_text() == "# its copy\n"
    assert [r.getMessage() for r in caplog.records] == []


def _states(path: Path) -> dict[str, str]:
    return {j["job"]: j["state"] for j in json.loads(path.read_text())["jobs"]}


def test_a_cloud_stopped_with_a_job_running_says_the_job_resumes_at_its_next_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Walk-through: `systemctl stop` (SIGTERM) of a fleet's cloud with a job running exited 0 and logged nothing at
    all (the journal's default level), the job left `running` in `fedtier jobs`. It was right to leave it so (the
    restarted cloud resumed it from its checkpoint and finished it); the journal now says so."""
    import logging

    from protocols.transport.memory import MemoryHub

    service, queue, loop, text = _waiting_cloud(tmp_path)
    queue.submit(Job("a", text, config_hash(text), OPERATOR))
    loop.call_later(0.05, service.stop)  # SIGTERM while it waits for its cells
    with caplog.at_level(logging.WARNING, logger="fedtier.cloud.service"):
        assert service._run(queue.next(), transport=MemoryHub(loop=loop).connect("cloud")) is True  # type: ignore[arg-type]
    assert queue.get("a").state == "running" and queue.next().job == "a"  # the next start resumes it
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "stopped with job a running (0 rounds done): it resumes from its checkpoint when the cloud starts again"
    ], said


def test_a_serving_cloud_says_as_it_stops_the_jobs_it_served_and_the_one_it_was_stopped_during(
    tmp_path: Path, job_lines: list[str]
) -> None:
    """Walk-through: `fedtier cloud --serve` stopped with SIGTERM printed nothing (between jobs) or a log line alone,
    where a cell and an agent say "served N jobs (...)" and which job the stop interrupted. The cloud keeps the same
    account: the jobs it ran to their end (a cancelled one too), the one it was stopped during, which resumes.
    Its journal also says, job by job, each job it took and how it ended (before: nothing at the default level).
    Walk-through: "served 3 jobs" after 5 submitted left out a job that failed before it started and one cancelled
    while queued; the summary now names them too."""
    from cloud.job_requests import cancel
    from fedtier.serve import cloud_served, served_summary
    from protocols.transport.memory import MemoryHub

    service, queue, loop, text = _waiting_cloud(tmp_path)
    for name, base in (("a", None), ("c", "a"), ("b", None), ("d", None)):
        queue.submit(Job(name, text, config_hash(text), OPERATOR, init_from=base))
    queue.start("a")
    queue.cancel("a")  # in its startup wait: it ends at once
    hub = MemoryHub(loop=loop)  # type: ignore[arg-type]
    assert service._run(queue.next(), transport=hub.connect("cloud")) is True
    cancel(service, "d")  # the operator's, while d is queued
    assert service._run(queue.next(), transport=None) is False  # c: from a's final model, which a never made
    loop.call_later(0.05, service.stop)  # SIGTERM while job b waits for its cells
    assert service._run(queue.next(), transport=hub.connect("cloud")) is True
    assert (service.served, service.stopped_during) == (["a"], "b")
    assert [queue.get(j).state for j in "abcd"] == ["cancelled", "running", "failed", "cancelled"]
    assert cloud_served(service) == (
        "cloud: served 1 job (a); 1 failed at start (c); 1 cancelled while queued (d); stopped during job b, which "
        "resumes from its checkpoint when the cloud starts again"
    )
    assert job_lines == [
        "cloud: job a taken (2 rounds, resumed from its checkpoint)",  # started before it was run: a restart's
        "cloud: job a cancelled",  # no round closed: no figures
        "cloud: job b taken (2 rounds)",  # stopped during it: the service's warning says so, and the summary
    ], job_lines
    assert served_summary("cloud", service.served, service.stopped_during) == (
        "cloud: served 1 job (a); stopped during job b, which resumes from its checkpoint when the cloud starts again"
    )
    assert served_summary("cloud", [], None) == "cloud: served 0 jobs"


def test_a_cancel_taken_as_the_cloud_starts_the_job_ends_it_in_its_startup_wait(tmp_path: Path) -> None:
    """Walk-through (deploy-fleet.md, the cloud offline): `fedtier submit job-c` then `fedtier cancel job-c` waited in
    the cloud's session; the restarted cloud took the submit, started job-c, then took the cancel before the job's
    server was in place, and ran all 20 rounds before saying `cancelled`. The cancel marked the queue's job; the
    server's start read the job as it was before. Now a cancel taken between the two stops the job at once."""
    from cloud.job_requests import cancel
    from protocols.transport.memory import MemoryHub

    service, queue, loop, text = _waiting_cloud(tmp_path)
    queue.submit(Job("a", text, config_hash(text), OPERATOR))
    loop.post(lambda: cancel(service, "a"))  # on the loop before the job's server starts (held requests)
    loop.call_later(10.0, service.stop)  # without the cancel, it waits 1000 s for its cells: a bound, not a wait
    assert service._run(queue.next(), transport=MemoryHub(loop=loop).connect("cloud")) is True  # type: ignore[arg-type]
    assert (queue.get("a").state, service.stopped_during) == ("cancelled", None), queue.get("a")


def test_the_serving_nodes_job_lines_show_at_the_default_level_and_their_rounds_detail_does_not(
    job_lines: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """`fedtier cloud|cell|agent --serve` log at WARNING unless -v: their journal said nothing of the jobs they took
    and ended. Their job lines (``protocols.joblog``) are printed at that level, once each (not again as a log record
    under -v), escaped; the rest of INFO (each round) still needs -v."""
    import logging

    from protocols.joblog import say_ended, say_taken

    caplog.set_level(logging.WARNING)  # setup_logging(0): the CLI's default
    say_taken("cell c0", "j1", 20)
    say_ended("cloud", "j1", "failed", "cell c1 sent\x1b[2J [bold]junk[/bold]", {"rounds": 3, "accuracy": 0.91234})
    assert job_lines == [
        "cell c0: job j1 taken (20 rounds)",
        "cloud: job j1 failed (3 rounds, accuracy 0.9123): cell c1 sent\\x1b[2J [bold]junk[/bold]",
    ], job_lines
    assert not logging.getLogger("fedtier.cloud.service").isEnabledFor(logging.INFO)  # a round's line
    caplog.set_level(logging.INFO)  # -v: the CLI's handler is the root's
    logged: list[str] = []
    cli = logging.Handler()
    cli.emit = lambda record: logged.append(record.name)  # type: ignore[method-assign]
    logging.getLogger().addHandler(cli)
    try:
        say_taken("cloud", "j2", 1, resumed="its checkpoint")
    finally:
        logging.getLogger().removeHandler(cli)
    assert job_lines[-1] == "cloud: job j2 taken (1 round, resumed from its checkpoint)"
    assert "fedtier.jobs" not in logged  # printed once, not logged again


def test_the_job_lines_show_whatever_the_root_level_becomes_after_they_were_set_up(
    job_lines: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """The job lines' logger kept no level of its own where the root was at INFO as they were set up: a root set to
    WARNING later hid them (test_jobs' job-lines test failed after a test of test_credentialed_attacks had left the
    root at INFO in the same process)."""
    import logging

    from protocols.joblog import job_log, say_taken, show_job_lines

    job_log.setLevel(logging.NOTSET)  # as before the CLI set it up (the fixture did, the root at WARNING)
    caplog.set_level(logging.INFO)  # e.g. -v, or a test before this one that left the root at INFO
    show_job_lines(job_lines.append)
    caplog.set_level(logging.WARNING)
    say_taken("cell c0", "j1", 20)
    assert job_lines == ["cell c0: job j1 taken (20 rounds)"]


def test_a_job_line_that_cannot_be_said_never_stops_the_node_saying_it(job_lines: list[str]) -> None:
    """A job line is said by the service taking or ending the job (a cell's, an agent's): an exception of the console
    it is printed on (a closed stream) escaped into that service; a line that cannot be said is a logging error now,
    reported as any handler's, and the node goes on."""
    import logging

    from protocols.joblog import say_taken, show_job_lines

    def closed(line: str) -> None:
        raise ValueError("I/O operation on closed file")

    show_job_lines(closed)
    before, logging.raiseExceptions = logging.raiseExceptions, False  # handleError's traceback: not this test's point
    try:
        say_taken("cell c0", "j1", 20)  # does not raise
    finally:
        logging.raiseExceptions = before
    show_job_lines(job_lines.append)
    say_taken("cell c0", "j2", 20)
    assert job_lines == ["cell c0: job j2 taken (20 rounds)"]


def test_a_node_enrolled_after_a_job_was_submitted_is_warned_it_serves_the_next_not_errored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Walk-through: c1-d2 enrolled while job-long2 ran logged ERROR "cannot serve job job-long2: c1-d2 is not a
    member", though the tutorial says an enrolled device takes part from the next job. It is a warning that says
    so, for a node in the current signed roster only: a mistyped id (or one never enrolled, or no roster known to
    tell) is an error naming it, not "enrolled since" (478e043 said that of any id); a job a node really cannot
    serve (a config it refuses) is still an error."""
    import logging

    from protocols.jobs import NotAMember, say_cannot_serve
    from protocols.roster import Roster

    fed = federation(tmp_path)
    _, text = canonical_job("[run]\nrounds = 2\n", fed)
    current = CurrentJob("a1", text, config_hash(text))
    cells = {c: list(fed.topology.device_ids(c)) for c in fed.topology.cell_ids()}
    cells["c0"].append("c0-d9")  # enrolled since the job's roster
    roster = Roster.from_topology("fed", cells, dict.fromkeys([*cells, *sum(cells.values(), [])], bytes(32)), 100.0)
    with pytest.raises(NotAMember) as late:
        current.run_config(fed, "c0-d9", roster)
    for wrong, known in (("c0-dd9", roster), ("c0-d9", None)):  # a mistyped id; no roster known to tell
        with pytest.raises(JobError, match="check the node id") as typo:
            current.run_config(fed, ["c0-d0", wrong], known)
        assert not isinstance(typo.value, NotAMember) and wrong in str(typo.value) and "c0-d0" not in str(typo.value)
        assert "enrolled since" not in str(typo.value)
    with pytest.raises(JobError) as bad:
        CurrentJob("a1", text, "0" * 64).run_config(fed, "c0-d0")
    with caplog.at_level(logging.INFO, logger="fedtier.jobs"):
        say_cannot_serve("devices c0-d9", "a1", late.value)
        say_cannot_serve("devices c0-dd9", "a1", typo.value)
        say_cannot_serve("devices c0-d0", "a1", bad.value)
    (enrolled, mistyped, refused) = caplog.records
    assert enrolled.levelno == logging.WARNING and "takes part from the next job" in enrolled.getMessage()
    assert mistyped.levelno == logging.ERROR and "c0-d9 is not a member" in mistyped.getMessage()
    assert refused.levelno == logging.ERROR and "does not match its hash" in refused.getMessage()


def test_a_signed_job_nested_past_the_toml_parsers_limit_is_answered_refused_and_the_next_job_queued(
    tmp_path: Path,
) -> None:
    """A job's config nested 2,000 arrays deep (well within the 256 KiB a job record may hold) raised RecursionError in
    the cloud's parser: its request handler died (a traceback in its log), no reply came and `fedtier submit` waited
    its 30 s for one; the same text in a job file or a config was a RecursionError traceback of `fedtier submit` or
    `fedtier sim`. It is refused, answered with the reason, and the next job is queued."""
    from functools import partial

    from cloud import job_requests
    from cloud.service import CloudService
    from protocols.transport.memory import MemoryHub

    seeds = {n: new_seed() for n in ("cloud", OPERATOR)}
    public = {n: public_of(s) for n, s in seeds.items()}
    hub, fed = MemoryHub(), federation(tmp_path)
    queue = JobQueue(tmp_path / "jobs.json")
    service = CloudService(
        fed, None, lambda: None, queue, None, trust=Trust("cloud", seeds["cloud"], public), operator=public[OPERATOR]
    )  # type: ignore[arg-type]
    service.transport = hub.connect("cloud")
    service.transport.subscribe(topics.job_submit("fed"), partial(job_requests.on_request, service))
    replies: list[dict[str, Any]] = []
    watcher = hub.connect("operator-replies")
    watcher.subscribe(topics.job_replies("fed"), lambda t, d: replies.append(open_job_record(d, t, "cloud", None)))
    operator, topic = hub.connect("operator"), topics.job_submit("fed")
    deep = "[algorithm]\nx = " + "[" * 2000 + "]" * 2000 + "\n"
    for job, config in (("deep", deep), ("plain", "[run]\nrounds = 2\n")):
        record = {
            "action": "submit",
            "job": job,
            "config": config,
            "nonce": job.encode().hex().ljust(32, "0"),
            "at": time.time(),
        }
        operator.publish(topic, seal_record(record, topic, Trust(OPERATOR, seeds[OPERATOR], public).sign))
        hub.loop.run()
    assert [(r["job"], r["accepted"]) for r in replies] == [("deep", False), ("plain", True)], replies
    assert "nested deeper than 32 levels" in replies[0]["reason"]
    assert [j.job for j in queue.jobs.values()] == ["plain"]


def test_submit_takes_the_clouds_answer_to_its_own_request_not_to_a_bogus_one_for_the_same_job(tmp_path: Path) -> None:
    """The cloud answers every request on the job's reply topic, also one whose signature it refuses, and
    `fedtier submit` took the first reply there as its answer: a broker user that sent a bogus request for the
    same job id just before made a genuine submission look refused ("job j1 refused: ... signature"), though it
    was queued. The request carries a fresh nonce that the cloud's signed reply echoes: another request's answer
    and a reply not signed by the cloud are ignored, and a request of the operator's own that the cloud refuses
    is still answered (its nonce echoed)."""
    from functools import partial

    from cloud import job_requests
    from cloud.service import CloudService
    from protocols.jobs import PendingRequest, post_request
    from protocols.transport.memory import MemoryHub

    seeds = {n: new_seed() for n in ("cloud", OPERATOR, "intruder")}
    public = {n: public_of(s) for n, s in seeds.items()}
    hub, fed, queue = MemoryHub(), federation(tmp_path), JobQueue(tmp_path / "jobs.json")
    service = CloudService(
        fed, None, lambda: None, queue, None, trust=Trust("cloud", seeds["cloud"], public), operator=public[OPERATOR]
    )  # type: ignore[arg-type]
    service.transport = hub.connect("cloud")
    service.transport.subscribe(topics.job_submit("fed"), partial(job_requests.on_request, service))
    intruder, submit = hub.connect("intruder"), topics.job_submit("fed")
    operator: Any = hub.connect("operator")
    operator.wait_subscribed = lambda wait: True  # (the memory hub subscribes at once)
    verify = Trust(OPERATOR, seeds[OPERATOR], public).verify

    def request(job: str, seed: bytes) -> PendingRequest:
        record = {"action": "submit", "job": job, "config": "[run]\nrounds = 2\n"}
        return post_request(operator, "fed", record, job, Trust(OPERATOR, seed, public).sign, 5.0, verify)

    bogus = {"action": "submit", "job": "j1", "config": "[run]\nrounds = 2\n", "nonce": "0" * 32}
    intruder.publish(submit, seal_record(bogus, submit, Trust("intruder", seeds["intruder"], public).sign))
    genuine = request("j1", seeds[OPERATOR])
    reply = topics.job_reply("fed", "j1")
    forged = {"job": "j1", "accepted": False, "reason": "forged", "nonce": genuine.nonce}
    intruder.publish(reply, seal_record(forged, reply, Trust("cloud", seeds["intruder"], public).sign))
    hub.loop.run()
    assert genuine.answer is not None and (genuine.answer["accepted"], genuine.answer["reason"]) == (True, "queued")
    forged_why, bogus_why = sorted(genuine.ignored)  # the forged reply; the cloud's refusal of the bogus request
    assert "not signed by 'cloud'" in forged_why and "another request" in bogus_why, genuine.ignored
    assert [j.job for j in queue.jobs.values()] == ["j1"]
    wrong_key = request("j2", seeds["intruder"])  # the operator's own request, signed with a wrong key
    hub.loop.run()
    assert wrong_key.answer is not None and not wrong_key.answer["accepted"]
    assert "signature" in wrong_key.answer["reason"], wrong_key.answer


def test_the_job_list_stays_one_its_readers_take_however_many_cells_its_jobs_began_without(tmp_path: Path) -> None:
    """200 failed jobs of a federation that began each without 20 of its cells made a job list of ~400 KB (1.1 MB here,
    where each lost 300 cells): every reader ignores a job record past 256 KiB, so `fedtier jobs` said "no job list from
    the cloud within 30 s (is `fedtier cloud --serve` running?)", the monitor counted a bad record, and `fedtier submit`
    (which reads the list first) sent no job ("no cloud has served federation ... yet"). The list names each job's first
    10 absent cells (and how many more), its reason's first 1,000 characters, and its newest jobs that fit: the running
    one and those queued after it first."""
    from cloud.service import CloudService
    from protocols.jobs import MAX_JOB_RECORD_BYTES
    from protocols.transport.memory import MemoryHub

    seed = new_seed()
    trust = Trust("cloud", seed, {"cloud": public_of(seed)})
    queue = JobQueue(tmp_path / "jobs.json")
    why = "offline at start: not online within the startup wait (120 s)"
    absent = {f"cell-{c:03d}": why for c in range(20)}
    lost = ", ".join(f"cell-{c:03d}" for c in range(300)) + " revoked by the federation: no cell of the job remains"
    for i in range(200):
        name = f"nightly-{i:03d}"
        queue.jobs[name] = job(name, state="failed", reason=lost, cells_absent_at_start=absent)
    queue.submit(job("running"))
    queue.start("running")
    queue.submit(job("queued"))
    hub = MemoryHub()
    service = CloudService(federation(tmp_path), None, lambda: None, queue, None, trust=trust, operator=None)  # type: ignore[arg-type]
    got: list[bytes] = []
    hub.connect("fedtier-jobs").subscribe(topics.job_list("fed"), lambda t, d: got.append(d))
    service._publish_list(hub.connect("cloud"))
    hub.loop.run()
    assert len(got[0]) <= MAX_JOB_RECORD_BYTES
    listed = open_job_record(got[0], topics.job_list("fed"), "cloud", trust.verify)["jobs"]
    assert [j["job"] for j in listed[-3:]] == ["nightly-199", "running", "queued"] and 100 < len(listed) < 200
    assert len(listed[-3]["cells_absent_at_start"]) == 10 and listed[-3]["cells_absent_at_start_more"] == 10
    assert listed[-3]["reason"] == lost[:1000]
    kept = queue.get("nightly-199")
    assert kept is not None and len(kept.cells_absent_at_start) == 20 and kept.reason == lost  # the queue keeps all


def test_an_ended_jobs_listed_figures_are_its_rounds_and_last_evaluation_in_a_few_bytes_whatever_its_records_hold(
    tmp_path: Path,
) -> None:
    """Walk-through: `fedtier submit --wait-end` said "job job-b: finished" and `fedtier jobs` listed it finished, but
    neither said how well (the accuracy was in the cloud's metrics.jsonl alone). The queue keeps an ended job's rounds
    and its last evaluation's accuracy and loss, and the job list carries them: finite numbers only, so no value a
    record holds (a huge string, a NaN, an infinity, another key) reaches the retained list; a restart keeps them."""
    from cloud.jobs import final_figures

    record = lambda rnd, **evaluation: {"round": rnd, "metrics": {"cells": 2}, **evaluation}  # noqa: E731
    history = [record(18, accuracy=0.91, loss=0.4), record(19, accuracy=0.922, loss=0.367)]
    assert final_figures(history) == {"rounds": 20, "accuracy": 0.922, "loss": 0.367}
    # resumed after round 4 (its checkpoint's record), evaluated every 5th round, cancelled after round 7
    assert final_figures([record(6), record(7)], record(4, accuracy=0.8, loss=0.5)) == {
        "rounds": 8,
        "accuracy": 0.8,
        "loss": 0.5,
    }
    hostile = record(2, accuracy="9" * 1_000_000, loss=float("nan"), extra="x" * 1_000_000)
    assert final_figures([hostile]) == {"rounds": 3}
    assert final_figures([record(0, accuracy=float("inf"), loss=1e308)]) == {"rounds": 1, "loss": 1e308}
    assert final_figures([]) == {} and final_figures([{"round": "19"}]) == {}
    queue = JobQueue(tmp_path / "jobs.json")
    for name in ("a", "b"):
        queue.submit(job(name))
        queue.start(name)
    queue.end("a", "finished", figures=final_figures(history))
    queue.end("b", "cancelled", "cancelled by the operator", figures={"rounds": 3, "accuracy": "9" * 1_000})
    listed = {j["job"]: j for j in JobQueue(tmp_path / "jobs.json").listing()}  # (restarted)
    assert {k: listed["a"][k] for k in ("rounds", "accuracy", "loss")} == {
        "rounds": 20,
        "accuracy": 0.922,
        "loss": 0.367,
    }
    assert listed["b"]["rounds"] == 3 and "accuracy" not in listed["b"]
    assert all(len(json.dumps(j)) < 400 for j in listed.values()), listed


def test_a_stale_signed_job_list_on_the_broker_is_replaced_by_the_clouds_current_one(tmp_path: Path) -> None:
    """A broker restored from an older database hands back a genuine job list, signed by the cloud, but old (and the
    record of a job in progress that has ended since): the cloud published its records again only when a reconnect
    found no session, so `fedtier jobs` and `fedtier submit` read the stale list until the next job ended. The cloud
    reads its own retained topics (``cloud.kept_records``, the rule its roster already followed): a record there that is
    not byte-equal to its last one is replaced by that one, once; with no job in progress, a job record is cleared."""
    from cloud.service import CloudService
    from protocols.transport.memory import MemoryHub

    seed = new_seed()
    trust = Trust("cloud", seed, {"cloud": public_of(seed)})
    queue = JobQueue(tmp_path / "jobs.json")
    queue.submit(job("j0"))
    hub, listed = MemoryHub(), topics.job_list("fed")
    connect = lambda: hub.connect("cloud")  # noqa: E731
    bundle = small_config(tmp_path, run={"name": "fed"}, monitoring={"idle_heartbeat": 0.0})  # its idle status: once
    service = CloudService(bundle, hub.loop, connect, queue, None, trust=trust, operator=None)  # type: ignore[arg-type]
    published: list[Any] = []  # the cloud's publications of its list, as the broker sees them

    def tap(topic: str, data: Any, retain: bool, sender: str) -> None:
        if topic == listed and sender == "cloud":
            published.append(data)

    hub.tap = tap
    ended, current = CurrentJob("old", "[run]\n", "0" * 64), topics.current_job("fed")
    hub.inject(current, seal_record(ended.record(), current, trust.sign), retain=True)  # an ended job's record
    service.transport = service._connect()  # as `fedtier cloud --serve` connects: it publishes its list
    hub.loop.run()
    assert current not in hub._retained  # no job in progress: its record is cleared
    stale = published[0]  # signed, genuine: [j0]
    queue.submit(job("j1"))
    service._publish_list(service.transport)  # as on a submission
    hub.loop.run()
    assert len(published) == 2  # its own records, come back, are not published again

    def names(data: bytes) -> list[str]:
        return [j["job"] for j in open_job_record(data, listed, "cloud", trust.verify)["jobs"]]

    # what the restored broker holds, handed to the cloud (here live; on a reconnect, as it subscribes again)
    hub.inject(listed, stale, retain=True)
    hub.loop.run()
    assert [names(d) for d in published] == [["j0"], ["j0", "j1"], ["j0", "j1"]]  # restored once
    assert published[2] == published[1] and hub._retained[listed] == published[1]  # the current list, byte for byte


def test_the_clouds_own_records_coming_back_late_are_not_published_again(tmp_path: Path, caplog) -> None:
    """Walk-through (`fedtier cloud -v`, three 20-round jobs on the fleet tutorial's federation): the cloud logged "the
    broker held another record than this cloud's last: published it again" 10 times, about 3 a job: its own job list
    came back after it had published a newer one (a submission's list, then the job start's, in flight together; the
    retained list handed back as it subscribed again after a job, before its newer one). Its own records coming back,
    and what comes before one of its own still on its way, are not published again; a stale record handed back once
    its own have come back still is, once (and the broker's copy of the roster or job record likewise)."""
    import logging

    from cloud.kept_records import MAX_COMING, KeptRecords
    from cloud.service import CloudService
    from protocols.transport.memory import MemoryHub

    seed = new_seed()
    trust = Trust("cloud", seed, {"cloud": public_of(seed)})
    queue = JobQueue(tmp_path / "jobs.json")
    hub, listed = MemoryHub(), topics.job_list("fed")
    bundle = small_config(tmp_path, run={"name": "fed"}, monitoring={"idle_heartbeat": 0.0})
    service = CloudService(bundle, hub.loop, lambda: hub.connect("cloud"), queue, None, trust=trust, operator=None)  # type: ignore[arg-type]
    published: list[Any] = []
    hub.tap = lambda topic, data, retain, sender: published.append(data) if topic == listed else None
    service.transport = service._connect()
    hub.loop.run()
    for name in ("a", "b"):  # a submission's list, then another, before either comes back
        queue.submit(job(name))
        service._publish_list(service.transport)
    with caplog.at_level(logging.INFO, logger="fedtier.cloud.service"):
        hub.loop.run()
    assert len(published) == 3 and "published it again" not in caplog.text, caplog.text

    class Broker:  # what this cloud publishes
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        def publish(self, topic: str, data: bytes, retain: bool = False) -> None:
            self.sent.append(data)

    kept, broker, topic = KeptRecords(), Broker(), "fedtier/fed/jobs/list"
    kept.publish(broker, topic, b"x")  # (a job's end), come back before its connection closed
    kept.on_record(broker, topic, b"x")
    kept.forget_coming()  # the next connection: the retained x handed back after its newer y was published
    kept.publish(broker, topic, b"y")
    for data in (b"x", b"junk", b"y"):  # (junk of another publisher, before y at the broker: y replaces it)
        kept.on_record(broker, topic, data)
    assert broker.sent == [b"x", b"y"]
    kept.on_record(broker, topic, b"x")  # y came back: a record handed back now is the broker's, stale
    assert broker.sent == [b"x", b"y", b"y"]
    kept.on_record(broker, topic, b"y")
    kept.publish(broker, topic, b"v1")  # (its roster) and, before it came back, the operator's newer one adopted
    kept.last[topic] = b"v2"
    kept.on_record(broker, topic, b"v1")  # which it overwrote at the broker: put back
    assert broker.sent[-2:] == [b"v1", b"v2"]
    for i in range(3 * MAX_COMING):  # never coming back: it awaits a bounded few
        kept.publish(broker, topic, b"%d" % i)
    assert len(kept.coming[topic]) == MAX_COMING


# ------------------------------------------------------------------ dated requests (cloud/requests.py)
class _Federation:
    """A signed federation's serving cloud in memory (its folder ``where``), its operator and what the cloud replied;
    :meth:`restart` starts another cloud process on a folder, whose clock is ``time.time() + skew``."""

    def __init__(self, tmp_path: Path) -> None:
        from protocols.transport.memory import MemoryHub

        self.tmp_path, self.hub = tmp_path, MemoryHub()
        self.seeds = {n: new_seed() for n in ("cloud", OPERATOR)}
        self.public = {n: public_of(s) for n, s in self.seeds.items()}
        self.replies: list[dict[str, Any]] = []
        self.captured: list[bytes] = []
        spy = self.hub.connect("spy")
        spy.subscribe(topics.job_replies("fed"), lambda t, d: self.replies.append(open_job_record(d, t, "cloud", None)))
        spy.subscribe(topics.job_submit("fed"), lambda t, d: self.captured.append(d))
        self.operator: Any = self.hub.connect("operator")
        self.operator.wait_subscribed = lambda wait: True  # (the memory hub subscribes at once)
        self.cloud: Any = None

    def restart(self, where: Path, skew: float = 0.0) -> Any:
        from cloud.service import CloudService

        self.stop()
        where.mkdir(exist_ok=True)
        trust = Trust("cloud", self.seeds["cloud"], self.public)
        queue = JobQueue(where / "jobs.json")
        bundle = small_config(self.tmp_path, run={"name": "fed"}, monitoring={"idle_heartbeat": 0.0})
        connect = lambda: self.hub.connect(f"cloud-{where.name}")  # noqa: E731
        self.cloud = CloudService(
            bundle, self.hub.loop, connect, queue, None, trust=trust, operator=self.public[OPERATOR]
        )  # type: ignore[arg-type]
        self.cloud.requests.clock = lambda: time.time() + skew
        self.cloud.transport = self.cloud._connect()  # as `fedtier cloud --serve` connects
        self.hub.loop.run()
        return self.cloud

    def stop(self) -> None:
        if self.cloud is not None:
            self.cloud.transport.close()
            self.cloud = None

    def sign(self, record: dict[str, Any]) -> bytes:
        """``record`` as `fedtier submit` sends it now, signed by the operator (captured, say)."""
        request = {**record, "nonce": os.urandom(16).hex(), "at": time.time()}
        topic = topics.job_submit("fed")
        return seal_record(request, topic, Trust(OPERATOR, self.seeds[OPERATOR], self.public).sign)

    def request(self, record: dict[str, Any]) -> dict[str, Any]:
        """The cloud's answer to the operator's request ``record`` (about ``record["job"]``)."""
        from protocols.jobs import post_request

        sign = Trust(OPERATOR, self.seeds[OPERATOR], self.public).sign
        pending = post_request(self.operator, "fed", record, record["job"], sign, 5.0)
        self.hub.loop.run()
        assert pending.answer is not None
        return pending.answer

    def replay(self, data: bytes) -> dict[str, Any]:
        self.replies.clear()
        self.hub.connect("replayer").publish(topics.job_submit("fed"), data)
        self.hub.loop.run()
        [reply] = self.replies
        return reply


SUBMIT = {"action": "submit", "job": "j1", "config": "[run]\nrounds = 2\n"}


def test_a_captured_submit_replayed_after_the_window_to_a_cloud_on_an_empty_folder_is_refused_as_stale(
    tmp_path: Path,
) -> None:
    """Job requests carried no time: a submit captured on the broker and replayed to a cloud started on an empty output
    folder (its queue lost) was queued again. A request now carries the time it was signed: 601 s later (the cloud's
    clock, injected) it is refused, naming how old it is, and nothing is queued; a cancel likewise."""
    fed = _Federation(tmp_path)
    fed.restart(tmp_path / "first")
    assert fed.request(SUBMIT)["accepted"]
    assert fed.request({"action": "cancel", "job": "j1"})["accepted"]
    submit, cancel = fed.captured
    cloud = fed.restart(tmp_path / "empty", skew=601.0)
    for data in (submit, cancel):
        reply = fed.replay(data)
        assert not reply["accepted"] and "s older than the cloud's clock allows (600 s)" in reply["reason"], reply
    assert cloud.queue.jobs == {}


def test_a_captured_request_replayed_within_the_window_after_the_cloud_lost_its_queue_is_refused_as_a_replay(
    tmp_path: Path,
) -> None:
    """Within the window the time alone does not tell a replay: the cloud remembers each request's nonce beside its
    queue (requests.json), so a restarted cloud whose jobs.json is gone refuses the captured submit as a replay; a
    request of an older fedtier (no time) is refused saying to upgrade."""
    fed = _Federation(tmp_path)
    fed.restart(tmp_path / "cloud")
    assert fed.request(SUBMIT)["accepted"]
    [submit] = fed.captured
    (tmp_path / "cloud" / "jobs.json").unlink()
    cloud = fed.restart(tmp_path / "cloud")
    reply = fed.replay(submit)
    assert not reply["accepted"] and "a replay" in reply["reason"], reply
    assert cloud.queue.jobs == {}
    topic = topics.job_submit("fed")
    old = seal_record({**SUBMIT, "job": "old"}, topic, Trust(OPERATOR, fed.seeds[OPERATOR], fed.public).sign)
    reply = fed.replay(old)
    assert not reply["accepted"] and "upgrade fedtier" in reply["reason"], reply
    assert fed.request({**SUBMIT, "job": "j2"})["accepted"]  # a fresh request is taken


def test_a_request_is_taken_once_acted_on_and_a_cloud_that_lost_its_folder_takes_none_signed_before_it_started(
    tmp_path: Path,
) -> None:
    """requests.json kept a request's nonce before the cloud acted on it: a cloud that could not queue the job (killed
    in between; here, its queue unwritable) refused the request as a replay when its session handed it again. And a
    cloud that lost its folder (jobs.json and requests.json) took a captured request replayed within its 10 minutes.
    Now a nonce is kept once the request is done (or refused), and a cloud that finds no requests.json takes no request
    signed before it started, while one restarted on its folder (requests.json written as it first connected, before
    any request) takes what the operator sent while it was down."""
    from cloud.jobs import JobQueueError

    fed = _Federation(tmp_path)
    folder = tmp_path / "cloud"
    cloud = fed.restart(folder)
    assert (folder / "requests.json").exists() and not cloud.requests.taken  # its first connection wrote it
    fed.stop()
    sent_while_down = fed.sign(SUBMIT)  # the broker keeps it in the cloud's session: handed over at its next start
    cloud = fed.restart(folder)
    save = cloud.queue._save
    cloud.queue._save = lambda: (_ for _ in ()).throw(JobQueueError("cannot write the job queue: disk full"))
    reply = fed.replay(sent_while_down)
    assert not reply["accepted"] and "disk full" in reply["reason"] and cloud.error is not None, reply
    cloud.queue._save = save
    fed.restart(folder)  # (the service stopped on its queue's error; the request is the session's again)
    assert fed.replay(sent_while_down) == {**reply, "accepted": True, "reason": "queued"}
    assert fed.replay(sent_while_down)["reason"] == "the cloud took this request before (its nonce): a replay, refused"
    captured = fed.sign({**SUBMIT, "job": "j2"})
    assert fed.replay(captured)["accepted"]
    fed.stop()
    for lost in ("jobs.json", "requests.json"):
        (folder / lost).unlink()
    cloud = fed.restart(folder)
    reply = fed.replay(captured)
    assert not reply["accepted"] and "older than those the cloud still remembers" in reply["reason"], reply
    assert cloud.queue.jobs == {} and fed.request({**SUBMIT, "job": "j3"})["accepted"]  # one signed now is taken


@pytest.mark.parametrize(("skew", "says"), [(3605.0, "3,605 s older than"), (-3605.0, "dated 3,605 s ahead of")])
def test_an_operator_whose_clock_is_an_hour_off_is_told_so(tmp_path: Path, skew: float, says: str) -> None:
    fed = _Federation(tmp_path)
    fed.restart(tmp_path / "cloud", skew=skew)
    reply = fed.request(SUBMIT)
    assert not reply["accepted"] and says in reply["reason"] and "check the operator's clock" in reply["reason"]


def test_the_clouds_memory_of_requests_is_bounded_and_never_takes_a_forgotten_one(tmp_path: Path) -> None:
    """At most ``most`` nonces are kept (in memory and in requests.json); a request no newer than a dropped one is
    refused, so dropping never lets a replay through."""
    from cloud.requests import OperatorRequests
    from protocols.jobs import NONCE_HEX

    seed = new_seed()
    topic, now = topics.job_submit("fed"), 1_000_000.0
    requests = OperatorRequests(tmp_path / "requests.json", public_of(seed), clock=lambda: now, most=2)
    sent = [
        seal_record({**SUBMIT, "nonce": f"{i:0{NONCE_HEX}x}", "at": now + 1 + i}, topic, Trust(OPERATOR, seed, {}).sign)
        for i in range(3)  # (signed after the cloud started: one started on an empty folder takes none before)
    ]
    for data in sent:
        requests.take(requests.open(data, topic))
    assert len(json.loads((tmp_path / "requests.json").read_text())["taken"]) == 2
    again = OperatorRequests(tmp_path / "requests.json", public_of(seed), clock=lambda: now, most=2)
    for data, says in ((sent[0], "older than those the cloud still remembers"), (sent[2], "a replay")):
        with pytest.raises(JobError, match=says):
            again.open(data, topic)


def test_a_cell_that_missed_a_jobs_finished_record_reads_how_it_ended_in_the_next_jobs_record(tmp_path: Path) -> None:
    """Session 19: a cell serving jobs back to back said job j "stopped: the cloud moved on to job j+1" although j had
    finished (its connection missed j's finished record, sent on the job's own connection). The cloud's record of the
    next job now says how the one before it ended (``previous``), and a cell's watch takes that as its end."""
    from cell_server.service import _ended_how
    from protocols.job_watch import JobWatch
    from protocols.jobs import ended_outcome

    _, text = canonical_job("[run]\nrounds = 2\n", federation(tmp_path))
    a, b, c = (CurrentJob(j, text, config_hash(text)) for j in ("a1", "b1", "c1"))
    watch = JobWatch(None, "fed", None)
    topic = topics.current_job("fed")
    watch.on_job(topic, seal_record(a.record(), topic, None))
    watch.on_job(topic, seal_record(b.record(), topic, None))
    assert _ended_how(watch, a)[0] == "stopped" and "moved on to job b1" in (_ended_how(watch, a)[1] or "")  # as before
    cancelled = ended_outcome(b.session, "cancelled", "cancelled by the operator")
    watch.on_job(topic, seal_record(CurrentJob("c1", text, config_hash(text), cancelled).record(), topic, None))
    assert _ended_how(watch, b) == ("stopped", "cancelled by the operator")
    finished = ended_outcome(c.session, "finished", "")
    watch.on_job(topic, seal_record(CurrentJob("d1", text, config_hash(text), finished).record(), topic, None))
    assert _ended_how(watch, c) == ("finished", None)
    assert parse_current({**c.record(), "previous": "x"}).previous is None  # not one: ignored, the job taken


def test_an_ended_jobs_record_a_restored_broker_hands_back_moves_no_node_off_the_running_job(tmp_path: Path) -> None:
    """Walk (session 25): a broker killed -9 mid-job g and restarted from its last save (made during job f) handed every
    node f's record again: cell c0 said "job g stopped: the cloud moved on to job f" and left g for good (the round
    waited out the 55 s cell deadline, its other 505 rounds ran without c0), devices said g ended. A record of a job
    the node knows ended (g's record says f ended; a cell's watch is also told the jobs it served) is ignored."""
    from cell_server.service import _ended_how
    from protocols.job_watch import JobWatch
    from protocols.jobs import ended_outcome

    _, text = canonical_job("[run]\nrounds = 2\n", federation(tmp_path))
    e, f = (CurrentJob(j, text, config_hash(text)) for j in ("e1", "f1"))
    g = CurrentJob("g1", text, config_hash(text), ended_outcome(f.session, "finished", ""))
    topic = topics.current_job("fed")
    watch = JobWatch(None, "fed", None, e.session)  # a cell that served e, on its connection for g
    watch.on_job(topic, seal_record(g.record(), topic, None))
    for stale in (f, e):
        watch.on_job(topic, seal_record(stale.record(), topic, None))
        assert watch.current == g and watch.pending(set()) == g  # still g: the cell serves on, the devices too
    assert _ended_how(watch, f) == ("finished", None)
    watch.on_job(topic, seal_record(CurrentJob("h1", text, config_hash(text)).record(), topic, None))
    assert watch.current is not None and watch.current.job == "h1"  # a job not known ended is taken, as before


def test_a_node_that_took_an_ended_jobs_record_leaves_it_when_the_cloud_clears_it(tmp_path: Path) -> None:
    """A cell restarted after job h ended, before the broker's next save, knows nothing of h; the broker, killed and
    restored from that save, hands it h's record as running, and it took h, waiting in it (its tasks never come) until
    the next job's record. The cloud clears what the broker holds there (cloud.kept_records: no job in progress): the
    node now takes that for h's end, which it missed. A job whose end it heard keeps how it ended."""
    from cell_server.service import _ended_how
    from protocols.job_watch import CLEAR_STANDS, CLEARED, JobWatch
    from protocols.jobs import ended_outcome

    _, text = canonical_job("[run]\nrounds = 2\n", federation(tmp_path))
    h, i = (CurrentJob(j, text, config_hash(text)) for j in ("h1", "i1"))
    topic = topics.current_job("fed")
    watch = JobWatch(None, "fed", None)  # the restarted cell's: it served nothing
    now = [0.0]
    watch.clock = lambda: now[0]
    watch.on_job(topic, seal_record(h.record(), topic, None))  # the restored broker's
    assert watch.pending(set()) == h and not watch.left(h)
    watch.on_job(topic, b"")  # the cloud's clear: h's end once no record of h came back for CLEAR_STANDS seconds
    assert watch.pending(set()) is None and not watch.left(h)
    now[0] = CLEAR_STANDS
    assert watch.left(h) and watch.pending(set()) is None
    assert _ended_how(watch, h) == ("stopped", CLEARED)
    watch.on_job(topic, seal_record(i.record(), topic, None))  # the next job is taken
    watch._ended(i.session, ended_outcome(i.session, "failed", "a stall"))  # its finished record, then the clear
    watch.on_job(topic, b"")
    assert watch.pending(set()) is None and _ended_how(watch, i) == ("failed", "a stall")


def test_a_job_record_cleared_by_a_login_while_the_cloud_runs_the_job_moves_no_node_off_it(tmp_path: Path) -> None:
    """On a broker without per-node ACLs any login may clear the cloud's retained job record (an empty retained
    publish: nothing to sign or verify); the serving cloud puts its record back at once (cloud.kept_records). A node
    must not take that clear for the end of the job it serves: before, every long-lived cell and agent that heard it
    marked the job ended ('stopped: ... its job record cleared') and left it, then ignored the cloud's record put back
    (a job that has ended), absent from the rest of the job. A clear is the job's end only once it stood, no record of
    that job back, for CLEAR_STANDS seconds."""
    from protocols.job_watch import CLEAR_STANDS, JobWatch

    seeds = {n: new_seed() for n in ("cloud", "c0")}
    public = {n: public_of(s) for n, s in seeds.items()}
    _, text = canonical_job("[run]\nrounds = 2\n", federation(tmp_path))
    i = CurrentJob("i1", text, config_hash(text))
    topic = topics.current_job("fed")
    watch = JobWatch(None, "fed", Trust("c0", seeds["c0"], public))
    now = [0.0]
    watch.clock = lambda: now[0]
    record = seal_record(i.record(), topic, Trust("cloud", seeds["cloud"], public).sign)
    watch.on_job(topic, record)  # the job in progress, signed by the cloud
    assert watch.pending(set()) == i
    for _ in range(3):  # the login clears it (again and again), the cloud puts its record back each time
        watch.on_job(topic, b"")
        now[0] += CLEAR_STANDS / 2
        assert not watch.left(i)
        watch.on_job(topic, record)
        now[0] += CLEAR_STANDS
        assert not watch.left(i) and watch.current == i and i.session not in watch.finished


def test_an_earlier_jobs_signed_record_put_back_by_a_login_moves_no_node_off_the_running_job(tmp_path: Path) -> None:
    """On a broker without per-node ACLs any login may also put back a signed record of an earlier job (retained: every
    subscriber got a copy), as a broker restored from an older save does by itself. A node that did not know that job
    ended (restarted since it ran) took it for the cloud moving on: it left the job it served and, the cloud's record
    put back at once, found that job among those it was done with: absent from the rest of it. Another job's record
    moves a node off its job only once it stood CLEAR_STANDS seconds, that job's record not back; a record saying the
    node's job ended (its ``previous``), at once."""
    from protocols.job_watch import CLEAR_STANDS, JobWatch
    from protocols.jobs import ended_outcome

    seeds = {n: new_seed() for n in ("cloud", "c0")}
    public = {n: public_of(s) for n, s in seeds.items()}
    _, text = canonical_job("[run]\nrounds = 2\n", federation(tmp_path))
    h, i = (CurrentJob(j, text, config_hash(text)) for j in ("h1", "i1"))
    j = CurrentJob("j1", text, config_hash(text), ended_outcome(i.session, "finished", ""))
    topic, sign = topics.current_job("fed"), Trust("cloud", seeds["cloud"], public).sign
    watch = JobWatch(None, "fed", Trust("c0", seeds["c0"], public))  # restarted since h ran: knows nothing of h
    now = [0.0]
    watch.clock = lambda: now[0]
    watch.on_job(topic, seal_record(i.record(), topic, sign))
    for _ in range(3):  # the login puts h's record there (again and again), the cloud puts its own back each time
        watch.on_job(topic, seal_record(h.record(), topic, sign))
        now[0] += CLEAR_STANDS / 2
        assert not watch.left(i)
        watch.on_job(topic, seal_record(i.record(), topic, sign))
        now[0] += CLEAR_STANDS
        assert not watch.left(i) and watch.current == i
    watch.on_job(topic, seal_record(h.record(), topic, sign))  # a record that stands: the cloud runs h (moved on)
    now[0] += CLEAR_STANDS
    assert watch.left(i) and watch.current == h
    watch = JobWatch(None, "fed", Trust("c0", seeds["c0"], public))
    watch.on_job(topic, seal_record(i.record(), topic, sign))
    watch.on_job(topic, seal_record(j.record(), topic, sign))  # the next job's, saying i ended: left at once
    assert watch.left(i) and watch.pending(set()) == j


def test_an_ended_jobs_task_a_restored_broker_hands_back_is_said_an_old_copy_and_a_foreign_session_still_refused(
    tmp_path: Path, caplog
) -> None:
    """Walk (session 25): a broker killed -9 in job i and restarted from its last save (made in job h) handed each
    cell and device h's queued task again; each said 'rejected a message (signature): task of cloud session
    job-h...; the cloud's current session is job-i... (replayed or forged)' at warning, as of an attack. A signed task
    of a job the node's service is done with is an old copy: dropped, said once a session at info; a session it does
    not know is still refused as replayed or forged. Neither is taken."""
    import numpy as np

    from cell_server.node import build_cell
    from edge_agent.node import build_agent
    from protocols.session import EndedJobs
    from protocols.trainer import LocalData
    from protocols.transport.memory import MemoryHub
    from protocols.wire.messenger import Messenger
    from sim.hierarchy import prepare

    cfg = small_config(tmp_path, topology={"cells": 1, "devices_per_cell": 1})
    cfg, ring = with_keys(cfg, tmp_path)
    algorithm = cfg.build_algorithm(prepare(cfg).spec)
    run, hub = cfg.run.name, MemoryHub()
    cell = build_cell(cfg, "c0", hub.connect("cell.c0"), algorithm, assume_online=True)
    cell.cloud.pin("job-i.0")
    cell.cloud.past_jobs = EndedJobs({"job-h.0"})  # (each node's service its own)
    data = LocalData(np.zeros((1, 64), np.float32), np.zeros(1, np.int64))
    pinned = CloudSession("job-i.0", EndedJobs({"job-h.0"}))
    agent = build_agent(cfg, "c0-d0", hub.connect("agent"), algorithm, data, None, pinned)
    tasks: list[str] = []
    peer = hub.connect("peer")
    peer.subscribe(topics.device_task(run, "c0", "c0-d0"), lambda t, d: tasks.append(t))
    peer.subscribe(topics.device_result(run, "c0", "c0-d0"), lambda t, d: tasks.append(t))
    cell.start()
    agent.start()
    hub.loop.run(until=lambda: hub.loop.now() > 0.5)
    cloud, c0 = (Messenger(peer, run, n, trust=Trust(n, ring.private[n], ring.public)) for n in ("cloud", "c0"))
    task = algorithm.cloud().plan(0, ["c0"])["c0"]
    with caplog.at_level(logging.INFO):
        for session in ("job-h.0", "job-h.0", "job-x.0"):  # h's task twice (said once), then a session never served
            cloud.session = c0.session = session
            cloud.send(topics.cell_task(run, "c0"), "cell_task", task, round=4, cell="c0")
            c0.send(topics.device_task(run, "c0", "c0-d0"), "device_task", task, round=4, edge_round=0, cell="c0")
        hub.loop.run(until=lambda: hub.loop.now() > 2.0)  # (a virtual clock: every delivery made)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "job-" in r.getMessage()]
    assert len(tasks) == 3 and all(t.endswith("/task") for t in tasks), (
        tasks
    )  # the test's own: none sent, none answered
    old = [m for level, m in said if level == logging.INFO and "old copy" in m]
    assert old == [
        "cell c0: ignored an old copy of round 5's task of cloud session job-h.0, a job this node is done with "
        "(delivered again by the broker, restored from an older save or holding it queued)",
        "device c0-d0: ignored an old copy of task 5.1 of cloud session job-h.0, a job this node is done with "
        "(delivered again by the broker, restored from an older save or holding it queued)",
    ], said
    refused = [m for level, m in said if level == logging.WARNING]
    assert len(refused) == 2 and all("session 'job-x.0'" in m and "(replayed or forged)" in m for m in refused), said
    assert not [m for m in refused if "job-h" in m], said


def test_a_report_of_an_ended_job_a_restored_broker_hands_the_cloud_is_said_an_old_copy(tmp_path: Path, caplog) -> None:
    """Walk (session 25): a broker restored from an older save handed the cloud, in job g, cell c0's report of job f:
    'cloud rejected a message on .../c0/report (signature): report of session 'job-f...', this cloud's is 'job-g...''
    at warning. A report its cell signed in a job the cloud's queue holds ended is an old copy, said once at info; one
    of a session it does not know is still refused."""
    from cloud.node import build_cloud
    from protocols.session import EndedJobs
    from protocols.transport.memory import MemoryHub
    from protocols.wire.messenger import Messenger
    from protocols.wire.payload import Payload
    from sim.hierarchy import prepare

    cfg, ring = with_keys(small_config(tmp_path, topology={"cells": 1, "devices_per_cell": 1}), tmp_path)
    run, hub = cfg.run.name, MemoryHub()
    cloud = build_cloud(cfg, hub.connect("cloud"), cfg.build_algorithm(prepare(cfg).spec), startup_wait=30.0)
    cloud.session = cloud.messenger.session = "job-i.0"
    cloud.past_jobs = EndedJobs({"job-h.0"})  # (its service's: the queue's ended jobs)
    cloud.start()
    c0 = Messenger(hub.connect("c0"), run, "c0", trust=Trust("c0", ring.private["c0"], ring.public))
    with caplog.at_level(logging.INFO):
        for session in ("job-h.0", "job-h.0", "job-x.0"):
            c0.session = session
            c0.send(topics.cell_report(run, "c0"), "cell_report", Payload({"weight": 1.0}, {}), round=4, cell="c0")
        hub.loop.run(until=lambda: hub.loop.now() > 1.0)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "job-" in r.getMessage()]
    assert said == [
        (
            logging.INFO,
            "cloud: ignored an old copy of cell c0's report of round 5 of cloud session job-h.0, a job this node is "
            "done with (delivered again by the broker, restored from an older save or holding it queued)",
        ),
        (
            logging.WARNING,
            "cloud rejected a message on fedtier/t/cloud/up/c0/report (signature): report of session 'job-x.0', "
            "this cloud's is 'job-i.0'",
        ),
    ], said


# ------------------------------------------------------------------ a job id re-run by a cloud that lost its queue
def _queued_again(tmp_path: Path, text: str) -> tuple[Job, Job]:
    """Job "job-a" of config ``text`` as a cloud's queue queued it, then as a cloud that lost that queue (its disk
    replaced: another folder) queued the same id and config again."""
    queued = []
    for disk in ("first", "replaced"):
        queue = JobQueue(tmp_path / disk / "jobs.json")
        queue.submit(Job("job-a", text, config_hash(text), OPERATOR))
        queued.append(queue.jobs["job-a"])
    return queued[0], queued[1]


def test_a_job_rerun_by_a_cloud_that_lost_its_queue_is_a_new_session_the_nodes_that_served_its_namesake_take(
    tmp_path: Path,
) -> None:
    """A job's session was {job}.{hash[:16]}: a cloud that lost its queue, given "job-a" and its config again, ran it
    in the session of the first job-a, which every long-lived cell and agent that served that one skipped as a job it
    had served (and knew ended): the job waited for nodes that never came. The queue draws each job a nonce from the
    OS as it queues it, kept in its file (a resumed job keeps its session) and in the cloud's signed job record, and
    bound into the session. A job of a queue file from before nonces keeps its old session (it resumes as it ran)."""
    from protocols.job_watch import JobWatch

    _, text = canonical_job("[run]\nrounds = 2\n", federation(tmp_path))
    first, again = _queued_again(tmp_path, text)
    assert first.session != again.session and first.nonce != again.nonce
    assert first.session.startswith("job-a.") and len(job_session("x" * 40, first.digest, first.nonce)) <= 64
    assert JobQueue(tmp_path / "first" / "jobs.json").jobs["job-a"].session == first.session  # resumed: the same
    a, b = (CurrentJob(j.job, j.config, j.digest, nonce=j.nonce) for j in (first, again))
    topic = topics.current_job("fed")
    watch = JobWatch(None, "fed", None, a.session)  # a long-lived node that served the first job-a to its end
    watch.on_job(topic, seal_record(a.record(), topic, None))  # (a restored broker's copy of its record)
    assert watch.pending({a.session}) is None
    watch.on_job(topic, seal_record(b.record(), topic, None))  # the cloud on its new disk runs job-a again
    assert watch.pending({a.session}) == b and parse_current(b.record()).session == again.session
    with pytest.raises(JobError, match='nonce "zz" is not 16 hex digits'):
        parse_current({**b.record(), "nonce": "zz"})
    old = tmp_path / "old" / "jobs.json"  # a queue file of a fedtier before nonces, its job running
    old.parent.mkdir()
    item = {k: v for k, v in asdict(first).items() if k != "nonce"} | {"state": "running"}
    old.write_text(json.dumps({"format": 1, "jobs": [item]}))
    assert JobQueue(old).jobs["job-a"].session == f"job-a.{first.digest[:16]}"


def test_a_message_of_a_jobs_namesake_before_the_cloud_lost_its_queue_is_not_taken_in_the_job_run_again(
    tmp_path: Path, caplog
) -> None:
    """Both job-a runs had one session, so a task the cloud signed in the first was a valid task of the second: a
    replay across jobs. A cell serving the second job-a takes the second's task and not the first's."""
    from cell_server.node import build_cell
    from protocols.transport.memory import MemoryHub
    from protocols.wire.messenger import Messenger
    from sim.hierarchy import prepare

    cfg, ring = with_keys(small_config(tmp_path, topology={"cells": 1, "devices_per_cell": 1}), tmp_path)
    first, again = _queued_again(tmp_path, "[run]\nrounds = 2\n")
    algorithm = cfg.build_algorithm(prepare(cfg).spec)
    run, hub = cfg.run.name, MemoryHub()
    cell = build_cell(cfg, "c0", hub.connect("cell.c0"), algorithm, assume_online=True)
    cell.cloud.pin(again.session)
    sent: list[int] = []
    peer = hub.connect("peer")
    peer.subscribe(topics.device_task(run, "c0", "c0-d0"), lambda t, d: sent.append(1))
    cell.start()
    hub.loop.run(until=lambda: hub.loop.now() > 0.5)
    cloud = Messenger(peer, run, "cloud", trust=Trust("cloud", ring.private["cloud"], ring.public))
    task = algorithm.cloud().plan(0, ["c0"])["c0"]
    with caplog.at_level(logging.WARNING):
        cloud.session = first.session  # captured in the first job-a, replayed now
        cloud.send(topics.cell_task(run, "c0"), "cell_task", task, round=0, cell="c0")
        hub.loop.run(until=lambda: hub.loop.now() > 1.5)
        assert not sent and f"session {first.session!r}" in caplog.text, caplog.text
        cloud.session = again.session
        cloud.send(topics.cell_task(run, "c0"), "cell_task", task, round=0, cell="c0")
        hub.loop.run(until=lambda: hub.loop.now() > 2.5)
    assert sent, "the second job-a's own task is taken"


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_a_cell_serving_a_jobs_rerun_resumes_no_journal_its_namesake_left_in_the_jobs_folder(
    tmp_path: Path, signed: bool
) -> None:
    """A long-lived cell's job folder is named by the job id, and ``fedtier cell --serve`` resumes a journal it finds
    there: serving the second job-a (a cloud that lost its queue), the cell took up the round the first job-a left in
    its journal (its devices sent that job's task, its cell DP noise seed reused); unsigned (no session in a header)
    it then refused the second job-a's first task as stale, never serving it. A journal of another job is not
    resumed: the cell waits for its job's task, and takes it."""
    from cell_server.node import build_cell
    from protocols.transport.memory import MemoryHub
    from protocols.wire.envelope import decode_message
    from protocols.wire.messenger import Messenger
    from sim.hierarchy import prepare

    cfg = small_config(tmp_path, topology={"cells": 1, "devices_per_cell": 1})
    cfg, ring = with_keys(cfg, tmp_path) if signed else (cfg, None)
    first, again = _queued_again(tmp_path, "[run]\nrounds = 3\n")
    algorithm = cfg.build_algorithm(prepare(cfg).spec)
    run, hub, folder = cfg.run.name, MemoryHub(), tmp_path / "jobs" / "job-a"
    folder.mkdir(parents=True)
    rounds: list[int] = []
    peer = hub.connect("peer")
    peer.subscribe(topics.device_task(run, "c0", "c0-d0"), lambda t, d: rounds.append(decode_message(d)[0].round))
    cloud = Messenger(peer, run, "cloud", trust=Trust("cloud", ring.private["cloud"], ring.public) if ring else None)
    for job, resume in ((first, False), (again, True)):
        cell = build_cell(
            cfg,
            "c0",
            hub.connect("cell.c0"),
            algorithm,
            output_dir=folder,
            journal=True,
            resume=resume,
            assume_online=True,
        )
        cell.cloud.pin(job.session)  # (as its service pins each job's cell)
        assert not cell.resumes, "the second job-a resumes nothing of the first's"
        cell.start()
        t0, sent = hub.loop.now(), len(rounds)
        hub.loop.run(until=lambda: hub.loop.now() > t0 + 0.2)  # noqa: B023
        assert rounds[sent:] == [], "nothing of the first job-a's round 1 goes to the device again"
        cloud.session = job.session
        rnd = 1 if not resume else 0  # the first job-a's cell took its round 1 (and stopped)
        cloud.send(
            topics.cell_task(run, "c0"), "cell_task", algorithm.cloud().plan(rnd, ["c0"])["c0"], round=rnd, cell="c0"
        )
        t0 = hub.loop.now()
        hub.loop.run(until=lambda: hub.loop.now() > t0 + 0.2)  # noqa: B023
        cell.stop()
        hub.loop.run(max_steps=1000)  # what it sent before it stopped, delivered
        assert set(rounds[sent:]) == {rnd}, f"the job's own round {rnd} went to the device: {rounds}"


def test_an_async_cell_serving_a_jobs_rerun_resumes_no_journal_its_namesake_left_in_the_jobs_folder(
    tmp_path: Path,
) -> None:
    """The same for an asynchronous cell: it adopted the cloud model the first job-a left in its journal, and sent that
    job's devices' tasks on it. Its journal now names the job it was of; one of another job is removed (its versions
    still numbered past it), one of the job it serves resumed as before."""
    from cell_server.async_recovery import AsyncJournal
    from cell_server.node import build_cell
    from protocols.runfiles import CELL_JOURNAL
    from protocols.transport.memory import MemoryHub
    from sim.hierarchy import prepare

    topology, train = {"cells": 1, "devices_per_cell": 1}, {"mode": "async", "async_buffer": 1, "edge_rounds": 1}
    cfg = small_config(tmp_path, topology=topology, algorithm=train)
    first, again = _queued_again(tmp_path, "[run]\nrounds = 3\n")
    algorithm, folder = cfg.build_algorithm(prepare(cfg).spec), tmp_path / "jobs" / "job-a"
    folder.mkdir(parents=True)
    for job, resumes in ((first, True), (again, False)):
        journal = AsyncJournal(folder / CELL_JOURNAL.format(cell="c0"))  # the first job-a's cell's (unsigned)
        journal.adopted(3, None, algorithm.initial_params(), 5, first.session)
        cell = build_cell(
            cfg, "c0", MemoryHub().connect("cell.c0"), algorithm, output_dir=folder, journal=True, resume=True
        )
        cell.cloud.pin(job.session)
        assert cell.resumes is resumes
        cell.start()
        assert (cell.fb.global_version == 3) is resumes and journal.model_path.exists() is resumes
        assert cell.push_journal.used == (None if resumes else 5)
        cell.stop()
