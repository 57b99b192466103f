"""A long-lived agent (``fedtier agent --serve``: :class:`edge_agent.service.AgentService`) serving job after job on
a local federation (real Mosquitto; the cloud, the cell and the agents' service in this process)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from cell_server.node import build_cell
from cell_server.server import CellServer
from cloud.service import CloudService, JobParts
from edge_agent.runner import BrokerOptions
from protocols.config import RunConfig
from protocols.jobs import JobRequest, post_request, submit_record
from protocols.transport.base import Transport
from protocols.transport.broker import MosquittoBroker, find_mosquitto
from protocols.transport.reactor import Reactor
from protocols.transport.threadloop import ThreadLoop
from sim.agent_workers import worker_service
from sim.hierarchy import prepare
from sim.local_federation import LocalFederation, federation_bundle, job_text
from tests.conftest import small_config, wait_until

JOBS = 5
PRODUCT = ("cloud.", "cell_server.", "edge_agent.", "protocols.")  # the modules of the product's classes


@dataclass
class Served:
    """A local federation (cloud and cell in this process, not started) and a long-lived agent service for its
    devices, on a real Mosquitto; :meth:`start` starts both."""

    cfg: RunConfig
    opts: BrokerOptions
    fed: LocalFederation
    service: Any
    op_loop: ThreadLoop
    reactor: Reactor
    thread: threading.Thread

    def start(self) -> None:
        self.fed.start()
        self.thread.start()


@contextmanager
def _served_federation(tmp_path: Path) -> Iterator[Served]:
    """One cell of two devices serving every job (fedtier run's federation serves one); stopped on exit."""
    cfg = small_config(
        tmp_path,
        run={"rounds": 1},
        topology={"cells": 1, "devices_per_cell": 2},
        algorithm={"edge_rounds": 1, "local_steps": 2},
        runtime={"startup_wait": 30.0},
    )
    prep, out = prepare(cfg), cfg.output_dir()
    out.mkdir(parents=True)
    with MosquittoBroker() as broker:
        opts, reactor = BrokerOptions(broker.url), Reactor("test-io").start()

        def cell(job_cfg: RunConfig, c: str, transport: Transport) -> CellServer:
            return build_cell(job_cfg, c, transport, job_cfg.build_algorithm(prep.spec), heartbeats=True)

        fed = LocalFederation(
            cfg, out, opts, {"c0": opts}, reactor, lambda job_cfg: JobParts(job_cfg.build_algorithm(prep.spec)), cell
        )
        fed.cloud.on_end = None  # serve every job (fedtier run's federation serves one)
        agents = {"bundle": federation_bundle(cfg).to_toml(), "broker": {"url": broker.url}}
        data = {d: prep.device_data[d] for d in cfg.topology.devices()}
        service = worker_service(agents, data, (prep.spec.input_shape, prep.spec.num_classes), [], [])
        thread = threading.Thread(target=service.serve, name="agents", daemon=True)
        served = Served(cfg, opts, fed, service, ThreadLoop("operator").start(), reactor, thread)
        try:
            yield served
        finally:
            service.stop()
            if thread.ident is not None:  # started
                thread.join(10)
            fed.stop()
            served.op_loop.stop()
            reactor.close()


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_long_lived_agent_and_cell_serving_jobs_back_to_back_keep_open_files_flat_and_say_idle_between_jobs(
    tmp_path: Path, job_lines: list[str]
) -> None:
    """For each job the service builds a process of the job's parts; the long-lived one takes them (same
    connections) and the spare, never started, kept its reactor's wake-up socket pair and selector open until the
    garbage collector found it: 3 descriptors a job with the collector off (seen: 24, 27, 30, 33 after jobs 1-4).
    It is closed at the job's start now, so the process's open descriptors stay flat (24, 24, 24, 24).
    Between jobs every node says idle, never offline: the cell's job server said offline as it closed the job's
    connection, until the cell's next connection said idle (cell c0: idle, online, offline, idle, online, ...), so
    `fedtier fleet`, `fedtier monitor` showed a healthy cell offline after each job.
    Each node's journal says, at the default level, each job it took and how it ended for it (before: nothing without
    -v, which logs every round too): the cloud, the cell and the devices, a line each at each end, none per round."""
    from protocols.status import decode_status
    from protocols.wire import topics

    fds: list[int] = []
    states: dict[str, list[str]] = {}  # each node's statuses as heard, repeats collapsed
    beats: dict[str, set[float | None]] = {}  # each node's declared idle heartbeats

    def heard(topic: str, data: bytes) -> None:
        node, record = topic.rsplit("/", 1)[-1], decode_status(data, topic)
        said = states.setdefault(node, [])
        if record is not None and said[-1:] != [record["state"]]:
            said.append(record["state"])
        if record is not None and record["state"] == "idle":
            beats.setdefault(node, set()).add(record.get("heartbeat"))

    with _served_federation(tmp_path) as served:
        cfg, opts, fed = served.cfg, served.opts, served.fed
        served.service.on_job_end = lambda _job: fds.append(len(os.listdir("/proc/self/fd")))
        gc.disable()  # what the collector would close is not closed
        try:
            served.start()
            assert wait_until(lambda: fed.cloud.transport is not None and fed.cloud.transport.wait_subscribed(0.1))
            operator = opts.transport(
                "operator", cfg.run.name, served.op_loop, reactor=served.reactor, persistent=False
            ).connect()
            for pattern in (topics.statuses(cfg.run.name), topics.device_statuses(cfg.run.name)):
                operator.subscribe(pattern, heard)
            replies = []
            for j in range(JOBS):  # all queued at once, on one connection
                text = job_text(cfg.model_copy(update={"run": cfg.run.model_copy(update={"seed": j})}))
                replies.append(
                    post_request(operator, cfg.run.name, submit_record(JobRequest(f"j{j}", text)), f"j{j}", None, 5.0)
                )
            assert wait_until(lambda: all(replies), 30.0)
            assert wait_until(lambda: len(fds) == JOBS or bool(fed.errors), 120.0), f"served {len(fds)} jobs"
            fed.check()
            _each_job_taken_and_ended_once(job_lines, served.service.tasks)
            jobs = ["online", "idle"] * JOBS  # idle at once at each job's end; offline never (before: cell c0's
            # online, offline, idle at each). Idle before the first job: the cloud, the cell and both of the service's
            # devices, on its watch connection (the first device's), each signed by its own key (before: the second,
            # without a connection before it serves a job, said nothing: ["online", "idle", ...])
            said = {"cloud": ["idle", *jobs], "cell.c0": ["idle", *jobs], "device.c0-d0": ["idle", *jobs]}
            said["device.c0-d1"] = ["idle", *jobs]
            assert wait_until(lambda: states == said, 10.0), repr(states)
            # each idle record of the cloud and the cell, the one at a job's end too, declares its heartbeat: one that
            # dies before its next connection (whose beats would follow; the closed one's will never fires) is
            # deemed offline three heartbeats later, not idle for ever
            period = cfg.monitoring.idle_heartbeat
            assert (beats["cloud"], beats["cell.c0"]) == ({period}, {period}), beats
            _stop_mid_job(served, operator)
            operator.close()
        finally:
            gc.enable()
    assert len(fds) == JOBS
    # After the first job (its connections made): flat, where the spare's leak was 3 a job (jobs 4-5 would be 6 or
    # more above jobs 2-3). The lower of each pair: a job's end may find the previous job's 3 descriptors of the
    # cloud and cell in this process not closed yet (seen 2 runs in 42: [25, 25, 28, 25, 26]), at both of jobs 4-5
    # once (CI: [25, 28, 25, 28, 28]): so less than 6, what one such set can add and the leak cannot stay under
    assert min(fds[-2:]) - min(fds[1:3]) < 6, fds


def _each_job_taken_and_ended_once(lines: list[str], tasks: int) -> None:
    """The job lines (``protocols.joblog``) of the cloud, cell c0 and the service's two devices: each job taken, then
    ended, in order, once each: the cloud's finished, with its rounds; the cell's finished (also where it heard the next
    job before this one's finished record: the next job's record says how this one ended); the devices' tasks add up to
    ``tasks``."""
    wait_until(lambda: len(lines) >= 6 * JOBS, 10.0)  # the devices' end of the last job may come before the cloud's
    said, devices = list(lines), "devices c0-d0, c0-d1"
    for who in ("cloud", "cell c0", devices):
        mine = [line for line in said if line.startswith(f"{who}: ")]
        assert mine[::2] == [f"{who}: job j{j} taken (1 round)" for j in range(JOBS)], said
        for j, line in enumerate(mine[1::2]):
            end = {
                "cloud": ["finished (1 round)"],
                "cell c0": ["finished"],  # (one that missed its finished record reads it in the next job's)
                devices: ["ended ("],
            }[who]
            assert any(line.startswith(f"{who}: job j{j} {how}") for how in end), said
        assert len(mine) == 2 * JOBS, said
    answered = [
        int(line.split("(")[1].split()[0]) for line in said if line.startswith(f"{devices}: ") and "ended" in line
    ]
    assert sum(answered) == tasks > 0, said


def _stop_mid_job(served: Served, operator: Transport) -> None:
    """A long job's agents and cell server running, the agents' service and the cell are stopped (SIGTERM's handlers):
    each names the job it was stopped during, beside the jobs it served (before: "served 5 jobs" alone)."""
    from fedtier.serve import served_summary

    cfg, cell, service = served.cfg, served.fed.cells["c0"], served.service
    text = job_text(cfg.model_copy(update={"run": cfg.run.model_copy(update={"rounds": 10_000})}))
    post_request(operator, cfg.run.name, submit_record(JobRequest("long", text)), "long", None, 5.0)

    def in_the_long_job() -> bool:  # and its devices answered a task of it (not the last job's agents, swapped a
        agents = service.agents  # moment after the session: counted, they made the test stop before a task of long)
        running = agents is not None and (agents.job.session or "").startswith("long.") and not agents.done.is_set()
        answered = running and agents.tasks_answered(agents.job.session) > 0  # type: ignore[union-attr]
        return answered and cell.node is not None and len(cell.served) == JOBS

    assert wait_until(in_the_long_job, 30.0)
    # the jobs they served are their nodes' past jobs: a task of one a restored broker hands back is an old copy
    assert service.agents is not None and cell.node is not None
    past = service.agents.clouds["c0-d0"].past_jobs.sessions
    assert sorted(s.split(".")[0] for s in past) == [f"j{j}" for j in range(JOBS)], past
    assert cell.node.cloud.past_jobs.sessions == past
    cloud = served.fed.cloud.node  # the cloud's: its queue's ended jobs
    assert cloud is not None and cloud.past_jobs is not None and cloud.past_jobs.sessions == past
    served_tasks = service.tasks  # those of the jobs served: the long job's, answered before the stop, count too
    service.stop()
    cell.stop()
    served.thread.join(10)
    assert wait_until(lambda: cell.stopped_during is not None, 10.0)
    assert service.tasks > served_tasks, (service.tasks, served_tasks)
    jobs = ", ".join(f"j{j}" for j in range(JOBS))
    rest = "which goes on without this {} until it starts again and serves the rest of it (if the job still runs then)"
    said = served_summary("device c0-d0", service.served, service.stopped_during, service.tasks)
    assert said == f"device c0-d0: served {JOBS} jobs ({jobs}), {service.tasks} tasks; stopped during job long, " + (
        rest.format("device")
    )
    said = served_summary("cell c0", cell.served, cell.stopped_during)
    assert said == f"cell c0: served {JOBS} jobs ({jobs}); stopped during job long, " + rest.format("cell")
    assert served_summary("device c0-d1", [], None, 0) == "device c0-d1: served 0 jobs, 0 tasks"  # no '()'


def test_a_stop_as_the_next_job_starts_counts_none_of_the_last_jobs_tasks_again() -> None:
    """``AgentProcess.next_job`` takes the job's session at once and swaps its devices' agents on the loop a moment
    later: a service stopped between counted the last job's agents' tasks (already counted as it ended) as the new
    job's. Only agents of the job's session count: by their own view of the cloud, as the swap makes a device's new
    view (``AgentProcess.clouds``) before its new agent is in place (a count then took the last job's agent's tasks)."""
    from types import SimpleNamespace

    from edge_agent.runner import AgentProcess
    from protocols.session import CloudSession

    last_jobs = SimpleNamespace(agents={"c0-d0": SimpleNamespace(tasks_done=2, cloud=CloudSession("j4.0"))})
    for clouds in ({"c0-d0": CloudSession("j4.0")}, {"c0-d0": CloudSession("long.0")}):  # before the swap, mid-swap
        last_jobs.clouds = clouds
        assert AgentProcess.tasks_answered(last_jobs, "long.0") == 0  # type: ignore[arg-type]
        assert AgentProcess.tasks_answered(last_jobs, "j4.0") == 2  # type: ignore[arg-type]


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_cloud_and_cell_stopped_as_their_job_ends_are_left_offline_not_idle(tmp_path: Path) -> None:
    """SIGTERM as a job ends: the job's cloud and cell servers close the job's connection saying idle (a long-lived
    node waits for the next job), and the services stop before their next connection. They left that idle status
    retained (the final fleet check of test_federation saw cloud and c0 idle after SIGTERM, devices offline); each
    service opens one connection more to say offline, as `fedtier cloud|cell --serve` connect (connect_forever:
    once more, when stopped)."""
    from dataclasses import replace

    from fedtier.serve import connect_forever
    from protocols.status import decode_status
    from protocols.wire import topics

    def stopping_as_it_closes(node: Any, service: Any) -> Any:  # the service is stopped as the job's server stops
        stop = node.stop
        node.stop = lambda idle_heartbeat=None: (stop(idle_heartbeat), service.stop())
        return node

    with _served_federation(tmp_path) as served:
        cfg, opts, fed, run = served.cfg, served.opts, served.fed, served.cfg.run.name
        cell, parts = fed.cells["c0"], fed.cloud.parts
        for service, node in ((cell, "cell.c0"), (fed.cloud, "cloud")):
            make = partial(opts.transport, node, run, service.loop, reactor=served.reactor)
            service.connect = partial(connect_forever, make, service.stopping, node)
        build = cell.build
        cell.build = lambda job_cfg, transport: stopping_as_it_closes(build(job_cfg, transport), cell)
        fed.cloud.parts = lambda job_cfg: replace(
            parts(job_cfg), on_build=lambda node: stopping_as_it_closes(node, fed.cloud)
        )
        served.start()
        job = fed.submit(job_text(cfg))
        assert fed.wait(job, fed.check).state == "finished"
        assert wait_until(lambda: not any(t.is_alive() for t in fed.threads), 30.0)
        states: dict[str, str] = {}
        watch = opts.transport("watch", run, served.op_loop, persistent=False).connect()
        watch.subscribe(
            topics.statuses(run), lambda t, d: states.update({t.rsplit("/", 1)[-1]: decode_status(d, t)["state"]})
        )
        assert wait_until(lambda: len(states) == 2, 10.0), states
        watch.close()
    assert states == {"cloud": "offline", "cell.c0": "offline"}, states  # before: both idle


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_an_idle_cloud_and_cell_after_a_job_are_not_handed_the_jobs_statuses(tmp_path: Path) -> None:
    """Seen on a running federation: an idle `fedtier cloud --serve` warned every 30 s '1 held messages (first on
    fedtier/fed/status/cell.c0) found no handler within 120 s: dropped'. Its persistent session kept the finished
    job's subscriptions (reports, statuses, records), so its idle connection got every cell's heartbeat with no
    handler. The cloud drops them from its session at the job's end: the idle connection holds nothing."""
    from protocols.status import encode_status
    from protocols.wire import topics

    with _served_federation(tmp_path) as served:
        cfg, opts, fed, run = served.cfg, served.opts, served.fed, served.cfg.run.name
        cells: list[Any] = []  # the cell's connections, one a job and one between jobs
        connect = fed.cells["c0"].connect
        fed.cells["c0"].connect = lambda: cells.append(connect()) or cells[-1]
        served.start()
        job = fed.submit(job_text(cfg))
        assert fed.wait(job, fed.check).state == "finished"
        idle: Any = None

        def reconnected() -> bool:  # the idle connection open: the one its idle heartbeat beats on (the service
            nonlocal idle  # still holds the job's connection a moment after the queue says the job finished)
            idle, beat = fed.cloud.transport, fed.cloud._idle
            on_idle = beat is not None and beat.transport is idle and not beat._stopped
            return idle is not None and not idle.closed and on_idle and fed._cloud_subscribed()

        assert wait_until(reconnected, 30.0)
        operator = opts.transport("operator", run, served.op_loop, persistent=False).connect()

        def resubmit() -> None:  # refused (a taken id): the cloud took what the operator sent before
            again = post_request(operator, run, submit_record(JobRequest(job, job_text(cfg))), job, None, 5.0)
            assert wait_until(lambda: again.answer is not None, 10.0)
            assert again.answer is not None and not again.answer["accepted"]

        resubmit()
        topic = topics.status(run, "cell.c0")  # a cell's heartbeat, while the cloud is idle
        taken, heard = idle.stats.messages_in, idle.stats.by_topic.get(topic, [0, 0])[1]
        operator.publish(topic, encode_status("online", topic=topic, devices_online=2, devices_total=2))
        resubmit()
        assert idle.held == (0, 0), idle.held  # nothing held (a past job's statuses redelivered: dropped)
        # the submit, and maybe already the cloud's job list it published on it, come back (cloud.kept_records)
        assert idle.stats.messages_in - taken in (1, 2), idle.stats
        assert idle.stats.by_topic.get(topic, [0, 0])[1] == heard, idle.stats  # the heartbeat no longer reaches it

        assert wait_until(lambda: len(cells) == 2 and not cells[1].closed, 10.0)  # the cell, idle: the same
        control, device = topics.control(run), topics.device_status(run, "c0", "c0-d0")

        def heard(topic: str) -> int:
            return cells[1].stats.by_topic.get(topic, [0, 0])[1]

        operator.publish(control, b"sync")
        assert wait_until(lambda: heard(control) > 0, 10.0)
        before, synced = heard(device), heard(control)
        operator.publish(device, encode_status("online", topic=device, cell="c0", samples=10))
        operator.publish(control, b"sync")
        assert wait_until(lambda: heard(control) > synced, 10.0)  # what came before it came too
        assert heard(device) == before, (before, heard(device))
        assert cells[1].held == (0, 0), cells[1].held
        operator.close()


def _product_objects() -> list[weakref.ref[Any]]:
    """Weak references to the objects of the product's own classes (cloud, cells, agents, protocols) in the
    collector's lists: the live ones and the garbage yet to be collected (those that take one: most do; a few small
    ones with ``__slots__`` do not). Weak: they keep nothing alive, and the garbage stays garbage."""
    refs = []
    for obj in gc.get_objects():
        if _kind(obj).startswith(PRODUCT):
            try:
                refs.append(weakref.ref(obj))
            except TypeError:  # no weak reference to it (__slots__)
                pass
    return refs


def _kind(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _made_since(before: list[weakref.ref[Any]]) -> list[weakref.ref[Any]]:
    """The product's objects now that ``before`` did not hold (those of ``before`` still there are the same objects:
    their ids cannot be reused while they exist)."""
    kept = {id(obj) for obj in (ref() for ref in before) if obj is not None}
    return [ref for ref in _product_objects() if id(ref()) not in kept]


def _survivors(refs: list[weakref.ref[Any]]) -> dict[str, int]:
    """Those of ``refs`` still there (live, or garbage not collected), by class."""
    return dict(Counter(_kind(obj) for obj in (ref() for ref in refs) if obj is not None))


def _kept_over_jobs(tmp_path: Path) -> dict[str, int]:
    """The product's objects made during the 2nd job of a served federation (there after it, not after the 1st)
    that are still there, live or garbage, after the 5th, by class; the collector's automatic runs off (only the
    services' own collections run). Each object is followed itself (a weak reference), not counted at a moment: a
    count of every object after each job differed job to job with the services' timing, not with what they kept (a
    job's parts are garbage from the moment nothing holds them to the next collection, whichever service makes it:
    the cloud's at its job's end came before or after the cell let go of its closed connection, which holds the cell's
    server; a connection closed a moment ago is held by the I/O thread's turn). Three jobs later, only what a service
    holds, or what no collection freed, is left."""
    with _served_federation(tmp_path) as served:
        cfg, fed, service = served.cfg, served.fed, served.service
        made = Counter[str]()  # the cloud's and the cell's connections, counted once made, not kept
        for name, node in (("cloud", fed.cloud), ("cell", fed.cells["c0"])):
            node.connect = lambda connect=node.connect, name=name: made.update([name]) or connect()  # type: ignore[misc]
        served.start()
        refs: list[weakref.ref[Any]] = []
        gc.disable()
        try:
            for j in range(5):
                text = job_text(cfg.model_copy(update={"run": cfg.run.model_copy(update={"seed": j})}))
                job = fed.submit(text)
                assert fed.wait(job, fed.check).state == "finished"
                assert wait_until(lambda: job in service.served and job in fed.cells["c0"].served, 30.0)  # noqa: B023
                # the cloud and the cell connected for the next job: the job's end behind them, collections made
                assert wait_until(lambda: made["cloud"] == made["cell"] == j + 2 and fed.cloud.transport, 30.0)  # noqa: B023
                refs = _product_objects() if j == 0 else _made_since(refs) if j == 1 else refs
            kept = _survivors(refs)  # before the collector runs again
        finally:
            gc.enable()
        fed.check()
    return kept


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_long_lived_services_free_each_past_jobs_objects_without_waiting_for_the_collector(tmp_path: Path) -> None:
    """Long-lived cells and agents grew 0.15-0.25 MB of RSS a job (a walk-through; and `fedtier cell|agent
    --serve` processes here, 1-round jobs). A job's server, algorithm and trainer are garbage in reference cycles
    once the job ends (a cell) or the next one replaces them (an agent); their arrays are native memory, so the
    few objects a job allocates seldom trigger a collection: malloc's live bytes grew ~0.12 MB (cell) and ~0.22
    MB (agent) a job until a generation-1 collection every ~11 jobs freed them, and what a long job promotes to
    the oldest generation waits for a full one. The services now collect at each job's end (cell) and start
    (agent). With the collector's automatic runs off, of what the 2nd job made nothing is left three jobs later but
    the cloud's record of it (its durable history); without those collections all of it stays (the cell's, the
    cloud's and the agents' servers, connections, JobWatch ...). Run in a process of its own: in a suite, earlier
    tests' nodes still winding down allocate in between."""
    code = (
        "import json, pathlib; from tests.test_agent_service import _kept_over_jobs; "
        f"print('KEPT', json.dumps(_kept_over_jobs(pathlib.Path({str(tmp_path)!r}))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=240
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("KEPT ")), None)
    assert done.returncode == 0 and line is not None, done.stderr[-4000:]
    kept = json.loads(line[len("KEPT ") :])
    assert kept.pop("cloud.jobs.Job", 0) <= 1  # the job's record in the cloud's queue: its durable history, by design
    assert not kept, f"the 2nd job's objects still there after the 5th: {kept}"


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_the_long_lived_cloud_frees_each_past_jobs_connection_and_says_idle_not_offline_between_jobs(
    tmp_path: Path,
) -> None:
    """`fedtier cloud --serve` grew 18.5-20.3 kB of RSS a job (a provisioned fleet in processes of their own, 40
    jobs): a job's connection (closed at the job's end: the next job gets a new one) and what hangs off it are garbage
    in reference cycles that the process's few allocations seldom collect. The cloud service collects at each job's
    end now (7.0-7.6 kB a job). With the collector's automatic runs off, the cloud's closed connections of past jobs
    are gone by the time it opens the next (the last one's may linger a moment: a loop callback queued
    before it closed holds it); before, one more stayed a job. A job's server said the cloud offline as it closed
    its connection, until the next connection said idle: `fedtier jobs` then warned "the cloud is offline"; it says
    idle at once, and offline only when the service stops."""
    from cloud import job_requests
    from cloud.jobs import Job, JobQueue
    from edge_agent.broker import offline_will
    from protocols.jobs import OPERATOR, canonical_job, config_hash
    from protocols.status import decode_status
    from protocols.transport.mqtt import MqttTransport
    from protocols.wire import topics

    fed = small_config(tmp_path, run={"name": "fed"})
    queue = JobQueue(tmp_path / "jobs.json")

    def parts(cfg: RunConfig) -> JobParts:
        return JobParts(cfg.build_algorithm(prepare(cfg).spec), None)

    def connections() -> int:  # the cloud's, open or closed, live or garbage
        return sum(type(o) is MqttTransport and o.client_id == "cloud-svc" for o in gc.get_objects())

    with MosquittoBroker() as broker:
        loop, made = ThreadLoop("cloud"), Counter[str]()

        def connect() -> MqttTransport:  # counted once it exists (counted before, a count could miss it)
            will = offline_will(fed.run.name, "cloud", None, service.twin.instance)  # as `fedtier cloud --serve`'s
            transport = MqttTransport.from_url(broker.url, "cloud-svc", loop, persistent=True, will=will)
            made.update(["made"])
            return transport.connect(10.0)

        service = CloudService(
            fed, loop, connect, queue, parts, trust=None, operator=None, job_folder=lambda j: tmp_path / "jobs" / j
        )
        states: list[str] = []  # the cloud's status, as an operator's command reads it
        watch_loop = ThreadLoop("watch")
        watch_loop.start()
        watch = MqttTransport.from_url(broker.url, "watch", watch_loop).connect(10.0)
        watch.subscribe(
            topics.status(fed.run.name, "cloud"), lambda t, d: d and states.append(decode_status(d, t)["state"])
        )
        thread = threading.Thread(target=service.serve, name="cloud-service", daemon=True)
        thread.start()
        counts: list[int] = []
        gc.disable()
        try:
            for j in range(3):  # each ends at once: cancelled in its startup wait (no cell comes)
                _, text = canonical_job(f"[run]\nrounds = 1\nseed = {j}\n[runtime]\nstartup_wait = 1000.0\n", fed)
                job = Job(f"j{j}", text, config_hash(text), OPERATOR)
                # on the service's thread, as a submission over MQTT is taken (the queue is that thread's alone: one
                # from here raced the service's own writes of the queue file, whose rename then found no temporary)
                loop.post(lambda: (queue.submit(job), service.wake.set()))  # noqa: B023
                assert wait_until(lambda: service.node is not None, 30.0)
                loop.post(lambda: job_requests.cancel(service, f"j{j}"))  # noqa: B023
                assert wait_until(lambda: made["made"] == j + 2, 30.0)  # noqa: B023  # the job ended: the next connection
                counts.append(connections())
        finally:
            gc.enable()
            service.stop()
            thread.join(10)
        assert wait_until(lambda: states[-1:] == ["offline"], 10.0), states  # the service stopped
        watch.close()
        watch_loop.stop()
    assert [queue.get(f"j{j}").state for j in range(3)] == ["cancelled"] * 3  # type: ignore[union-attr]
    assert states.count("online") == 3 and states.index("offline") == len(states) - 1, states  # before: at each end
    # the new job's connection and at most the last job's (a loop callback queued before it closed may hold it a
    # moment: 1 or 2); before, one more a job ([2, 3, 4])
    assert max(counts) <= 2, counts


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_cloud_whose_broker_lost_its_state_publishes_its_job_list_and_job_again(tmp_path: Path) -> None:
    """Walk-through (a provisioned fleet whose broker restarted without its persistence file): the cloud reconnected,
    found no session and resubscribed, but its retained records were gone and it did not publish them again:
    `fedtier submit` refused every job ("no cloud has served federation 'fed' yet"), `fedtier jobs` found no list,
    and a node started then found no job in progress, until the cloud itself was restarted. It publishes them again
    when its reconnect finds no session: the job list, and the job in progress (here in its startup wait)."""
    from cloud.jobs import Job, JobQueue
    from protocols.jobs import OPERATOR, canonical_job, config_hash, open_job_record
    from protocols.transport.mqtt import MqttTransport
    from protocols.wire import topics

    fed = small_config(tmp_path, run={"name": "fed"})
    queue = JobQueue(tmp_path / "jobs.json")
    _, text = canonical_job("[run]\nrounds = 1\n[runtime]\nstartup_wait = 1000.0\n", fed)
    queue.submit(Job("j0", text, config_hash(text), OPERATOR))
    parts = lambda cfg: JobParts(cfg.build_algorithm(prepare(cfg).spec), None)  # noqa: E731
    loop, reader_loop = ThreadLoop("cloud"), ThreadLoop("reader").start()
    with MosquittoBroker() as broker:

        def connect() -> MqttTransport:
            return MqttTransport.from_url(broker.url, "cloud-svc", loop, persistent=True).connect(10.0)

        service = CloudService(
            fed, loop, connect, queue, parts, trust=None, operator=None, job_folder=lambda j: tmp_path / "jobs" / j
        )
        thread = threading.Thread(target=service.serve, name="cloud-service", daemon=True)
        thread.start()

        def retained() -> dict[str, dict]:
            """What a node or an operator's command connecting now is handed: the job list, the job in progress."""
            got: dict[str, dict] = {}
            reader = MqttTransport.from_url(broker.url, "reader", reader_loop).connect(10.0)
            for topic in (topics.job_list("fed"), topics.current_job("fed")):
                reader.subscribe(topic, lambda t, d: d and got.update({t: open_job_record(d, t, "cloud", None)}))
            assert wait_until(lambda: len(got) == 2, 10.0), got  # both retained records (free when met)
            reader.close()
            return got

        try:
            assert wait_until(lambda: service.node is not None, 30.0)  # j0 runs: it waits for its cells
            assert [j["job"] for j in retained()[topics.job_list("fed")]["jobs"]] == ["j0"]
            broker.stop()  # no persistence: sessions and retained records are gone
            broker.start()
            assert wait_until(lambda: service.node.transport.sessions_lost == 1, 10.0)  # reconnected, no session
            got = retained()
            assert got.get(topics.current_job("fed"), {}).get("job") == "j0", got
            assert [j["state"] for j in got[topics.job_list("fed")]["jobs"]] == ["running"], got
        finally:
            service.stop()
            thread.join(10)
            reader_loop.stop()


def test_every_device_of_a_multi_device_agent_process_says_idle_before_its_first_job_signed_by_its_own_key(
    tmp_path: Path,
) -> None:
    """`fedtier run`'s agent workers serve several devices on one watch connection (the first device's) until their
    first job: only that first device said idle, the others nothing (offline, or unknown, to the fleet view and their
    cells). Each says idle, signed by its own key (a cell verifies a device's status with that device's key), and
    offline if the process stops before a job, on one broker for devices of two cells."""
    from edge_agent.service import AgentService
    from protocols.status import decode_status
    from protocols.transport.memory import MemoryHub
    from protocols.wire import topics
    from protocols.wire.keys import load_public_keys, node_trust, with_run_keys
    from protocols.wire.signed import open_record
    from sim.agent_workers import signers

    base = small_config(tmp_path, topology={"cells": 2, "devices_per_cell": 2}, security={"keys": "keys.toml"})
    cfg, devices = with_run_keys(base, tmp_path), ["c0-d1", "c1-d0"]
    hub, heard = MemoryHub(), {}
    hub.connect("spy").subscribe(topics.device_statuses(cfg.run.name), lambda t, d: heard.setdefault(t, []).append(d))
    trust = node_trust(cfg, devices[0])
    service = AgentService(cfg, devices, hub.loop, lambda: None, None, trust, signers(cfg, devices))  # type: ignore[arg-type]
    hub.loop.call_later(1.0, service.stop)  # no job comes: SIGTERM
    assert service._first_job(hub.connect(topics.device_node(devices[0])), set()) is None
    hub.loop.run()
    verify = load_public_keys(cfg.security.keys or "").verify
    for device in devices:
        topic = topics.device_status(cfg.run.name, cfg.topology.cell_of(device) or "", device)
        records = [open_record(data, topic, device, verify) for data in heard.get(topic, [])]  # signed by the device
        assert [r["state"] for r in records] == ["idle", "offline"], (device, records)
        assert decode_status(heard[topic][0], topic)["cell"] == cfg.topology.cell_of(device)


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_job_rerun_by_a_cloud_that_lost_its_queue_is_served_by_the_long_lived_nodes_that_served_its_namesake(
    tmp_path: Path,
) -> None:
    """A job's session was its id and config hash alone: a cloud that lost its queue (a new disk) given job-a and its
    config again ran it in the first job-a's session, which the long-lived cell and agents that served the first skipped
    as a job they had served: the job waited for nodes that never came. The queue's nonce for each job is bound into
    its session now: the same cell and agents serve the second job-a (its queue says it finished)."""
    from cloud.jobs import JobQueue

    with _served_federation(tmp_path) as served:
        cfg, opts, fed = served.cfg, served.opts, served.fed
        cell = fed.cells["c0"]
        served.start()
        assert wait_until(lambda: fed.cloud.transport is not None and fed.cloud.transport.wait_subscribed(0.1))
        operator = opts.transport(
            "operator", cfg.run.name, served.op_loop, reactor=served.reactor, persistent=False
        ).connect()
        text = job_text(cfg)
        for n, disk in enumerate(("first", "replaced")):
            if n:  # the cloud's disk replaced, its jobs.json lost (it serves on, idle: no job in progress)
                fed.cloud.queue = JobQueue(tmp_path / disk / "jobs.json")
            pending = post_request(operator, cfg.run.name, submit_record(JobRequest("job-a", text)), "job-a", None, 5.0)
            assert wait_until(lambda: pending.answer is not None, 30.0) and pending.answer["accepted"], pending.answer  # noqa: B023
            both = lambda: served.service.served == cell.served == ["job-a"] * (n + 1)  # noqa: B023, E731
            assert wait_until(lambda: both() or bool(fed.errors), 60.0), (served.service.served, cell.served, n)  # noqa: B023
            fed.check()
            assert wait_until(lambda: fed.cloud.queue.jobs["job-a"].state == "finished", 10.0), fed.cloud.queue.jobs
        operator.close()
