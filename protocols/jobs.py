"""Jobs on a federation: what a job is, and the signed records that carry it.

A **federation** is what ``fedtier provision`` provisions: identities, brokers, ACLs and topics rooted at
``fedtier/{federation}/...`` (the provisioning config's ``run.name``). A **job** is one training config
run on it. Its canonical text (:func:`canonical_job`: the job's TOML with the federation's name and
topology, and nothing node-local) is what the cloud publishes; its **config hash** is the sha256 of that
text, and the job's **cloud session** is ``{job}.{h[:16]}`` (:func:`job_session`), ``h`` the sha256 of the config hash
and the nonce the queue drew from the OS for the job as it queued it (a job queued before there were nonces keeps
``{job}.{hash[:16]}``). Every signed envelope binds the session, so every task a node receives carries the job id and
its config hash, and a node pinned to a job (``CloudSession(pinned=...)``) takes nothing of another job or another
config, nor of an earlier job of the same id and config (a cloud that lost its queue, given the same job again).

Records (plain JSON with an Ed25519 signature, :mod:`protocols.wire.signed`):

========================================  ================================  ==========  ========
topic                                     what                              signed by   retained
========================================  ================================  ==========  ========
``fedtier/{fed}/jobs/submit``             submit / cancel a job, a nonce,   operator    no
                                          the time it was signed
``fedtier/{fed}/jobs/reply/{job}``        accepted or refused, with reason  cloud       no
                                          and the request's nonce
``fedtier/{fed}/jobs/list``               every job and its state           cloud       yes
``fedtier/{fed}/cloud/job``               the job in progress (its config)  cloud       yes
========================================  ================================  ==========  ========
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .capabilities import WIRE_VERSION
from .config import (
    ConfigError,
    RunConfig,
    RunSection,
    TopologySection,
    deployment_config,
    dump_toml,
    parse_config,
    parse_toml,
    shown,
)
from .failures import MAX_REASON
from .limits import MAX_TEXT_BYTES, read_file
from .roster import Roster
from .runfiles import JOB_FOLDERS
from .wire import topics
from .wire.envelope import WireError
from .wire.signed import open_record, seal_record

if TYPE_CHECKING:
    from .transport.mqtt import MqttTransport
    from .wire.envelope import Signer, Verifier

log = logging.getLogger("fedtier.jobs")

OPERATOR = "operator"
"""The operator identity's node id: the only one that may submit or cancel jobs."""
MAX_JOB_ID = 40
MAX_JOB_RECORD_BYTES = 256 * 1024
"""Bound on a job record (a job's config is a few KiB; the job list holds at most ``MAX_LISTED`` jobs)."""
MAX_LISTED = 200
STATES = ("queued", "running", "finished", "failed", "cancelled")
NODE_LOCAL = ("broker", "security", "monitoring")
"""Sections a job may not set: each node's bundle does (identities, broker, its own metrics port)."""


class JobError(ConfigError):
    """A job that cannot be accepted, or a job record that is malformed; the text says why."""


class NotAMember(JobError):
    """A node of the federation's current signed roster that is not in a job's membership (the roster when the job
    was submitted): enrolled since then, it takes part from the next job, as it should (not a fault:
    :func:`say_cannot_serve` warns, not errs). A node in neither is a plain :class:`JobError` (:func:`not_a_member`)."""


def not_a_member(job: str, missing: Sequence[str], roster: Roster | None) -> JobError:
    """Why ``missing`` (nodes absent from ``job``'s membership) cannot serve it: :class:`NotAMember` if every one is
    in ``roster`` (the node's current signed roster: enrolled since the job was submitted), else an error naming
    those that are not (a mistyped id, a node never enrolled or revoked; or no signed roster known to tell)."""
    unknown = [n for n in missing if roster is None or not roster.is_member(n)]
    if unknown:
        known = "no signed roster known" if roster is None else f"nor of the federation's roster v{roster.version}"
        return JobError(
            f"{_ids(unknown)} is not a member of job {job} ({known}): "
            "check the node id (a mistyped id, or a node never enrolled or revoked)"
        )
    return NotAMember(
        f"{_ids(missing)} is not a member of job {job} (the federation's roster when it was submitted): "
        "enrolled since, it takes part from the next job"
    )


def _ids(nodes: Sequence[str], most: int = 5) -> str:
    """``nodes`` named, the first ``most`` of them (an agent may serve thousands)."""
    more = f" and {len(nodes) - most} more" if len(nodes) > most else ""
    return ", ".join(nodes[:most]) + more


def say_cannot_serve(who: str, job: str, exc: Exception) -> None:
    """Log why ``who`` (a cell, or an agent's devices) cannot serve ``job``: an error, but a warning for a node
    enrolled after the job was submitted (:class:`NotAMember`), which the tutorial says waits for the next job."""
    (log.warning if isinstance(exc, NotAMember) else log.error)("%s cannot serve job %s: %s", who, job, exc)


# ------------------------------------------------------------------------------------------------ jobs
def check_plugins(data: dict[str, Any], bundle: RunConfig, what: str) -> None:
    """A job's ``run.plugins`` are modules every node imports while it reads the job: a node imports only those
    its own bundle lists (``run.plugins`` in its config.toml), so whoever signs jobs cannot make it import
    any other installed module. Checked before the job's config is parsed (parsing imports them)."""
    run = data.get("run")
    wanted = run.get("plugins", []) if isinstance(run, dict) else []
    if not isinstance(wanted, list):
        raise JobError(f"{what}: run.plugins must be a list of module names")
    extra = [m for m in wanted if m not in bundle.run.plugins]
    if extra:
        raise JobError(
            f"{what} imports run.plugins {extra} this node does not allow: list them in run.plugins of its "
            f"config.toml (allowed now: {list(bundle.run.plugins) or 'none'})"
        )


def check_job_id(job: Any) -> str:
    """A job id goes into topics and folder names: 1-40 safe characters."""
    if not isinstance(job, str) or len(job) > MAX_JOB_ID:
        raise JobError(f"job id {job!r} must be a string of at most {MAX_JOB_ID} characters")
    try:
        return topics.check_name("job", job)
    except ValueError as exc:
        raise JobError(str(exc)) from None


def config_hash(text: str) -> str:
    """The job's config hash: sha256 (hex) of its canonical text."""
    return hashlib.sha256(text.encode()).hexdigest()


JOB_NONCE_HEX = 16
"""Length of a job's nonce (hex of 8 random bytes from the OS), drawn by the cloud's queue as it queues the job."""


def new_job_nonce() -> str:
    """A job's nonce: an identity (like a node's instance nonce), from the OS, never a seeded draw."""
    return secrets.token_hex(JOB_NONCE_HEX // 2)


def job_session(job: str, digest: str, nonce: str = "") -> str:
    """The cloud session of a job: binds the job id, its config hash and its queue ``nonce`` into every signed
    envelope, so that a job re-run under the same id and config by a cloud that lost its queue is another session
    (long-lived nodes that served the first serve it; a message of the first is refused in it). No ``nonce`` (a job
    queued before there were nonces): ``{job}.{digest[:16]}``, as then. At most 57 characters (an envelope's 64)."""
    if not nonce:
        return f"{job}.{digest[:16]}"
    return f"{job}.{hashlib.sha256(f'{digest}.{nonce}'.encode()).hexdigest()[:16]}"


def hex_digits(value: Any, n: int) -> bool:
    """Whether ``value`` is ``n`` lowercase hex digits (a nonce as ``secrets.token_hex`` draws it)."""
    return isinstance(value, str) and len(value) == n and all(c in "0123456789abcdef" for c in value)


def check_job_nonce(nonce: Any) -> str:
    """A job record's ``nonce`` (absent: ``""``, a job queued before nonces); :class:`JobError` if malformed."""
    if nonce is None or nonce == "":
        return ""
    if not hex_digits(nonce, JOB_NONCE_HEX):
        raise JobError(f"job record: nonce {shown(nonce)} is not {JOB_NONCE_HEX} hex digits")
    return nonce


@dataclass(frozen=True)
class JobRequest:
    """What the operator asks for: a job id, the job's TOML text (``[job]`` section removed) and the
    finished job whose final model it starts from (``init_from``)."""

    job: str
    config: str
    init_from: str | None = None


def read_job_file(path: str | Path, job: str | None = None) -> JobRequest:
    """Read JOB.toml: a run config (sections as in ``fedtier sim``) plus an optional ``[job]`` section
    (``id``, ``init_from``). ``job`` overrides ``[job] id``; without either the file's stem is the id."""
    path = Path(path)
    try:
        data = parse_toml(read_file(path, MAX_TEXT_BYTES).decode("utf-8"))
    except FileNotFoundError:
        raise JobError(f"job file {path} does not exist") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise JobError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:  # a folder, no permission
        raise JobError(f"job file {path}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:  # /dev/zero, a FIFO, 1 GB
        raise JobError(f"job file {path}: cannot read it: {exc}") from None
    section = data.pop("job", {})
    if not isinstance(section, dict) or set(section) - {"id", "init_from"}:
        raise JobError(f"{path}: [job] may hold only id and init_from")
    init_from = section.get("init_from")
    if init_from is not None:
        check_job_id(init_from)
    try:
        text = dump_toml(data)
    except ConfigError as exc:  # a top-level key, a date
        raise JobError(f"{path}: {exc}") from None
    return JobRequest(check_job_id(job or section.get("id") or path.stem), text, init_from)


def canonical_job(config: str, federation: RunConfig, whose: str = "the federation's") -> tuple[RunConfig, str]:
    """Validate a job's TOML text against the federation; return its config and its canonical text.

    The job may not set the node-local sections (``broker``, ``security``, ``monitoring``) nor another
    topology nor another run name (the federation's names its topics). Raises :class:`JobError` with today's
    config errors. ``whose``: the topology's name in a refusal (``fedtier submit``'s: its bundle's, as provisioned)."""
    try:
        data = parse_toml(config)
    except tomllib.TOMLDecodeError as exc:
        raise JobError(f"job config is not valid TOML: {exc}") from None
    local = [s for s in NODE_LOCAL if s in data]
    if local:
        raise JobError(f"a job may not set [{'], ['.join(local)}]: each node's bundle does")
    check_topology(data.pop("topology", None), federation.topology, whose)
    run = data.setdefault("run", {})
    if not isinstance(run, dict):
        raise JobError("[run] must be a section")
    if run.get("name", federation.run.name) != federation.run.name:  # was replaced without a word
        raise JobError(
            f"run.name = {shown(run['name'])}: a job runs on the federation's topics, named {federation.run.name!r} "
            "(its run.name), which a job cannot change; a job is named by its [job] id (or fedtier submit --id): "
            "leave run.name out"
        )
    if run.get("init_model") is not None:
        raise JobError(
            "a job may not set run.init_model (a path on the cloud): [job] init_from = JOB starts it "
            "from a finished job's model"
        )
    run.pop("output", None)
    run["name"] = federation.run.name
    check_plugins(data, federation, "the job")
    data["topology"] = federation.topology.model_dump(mode="json")
    try:
        cfg = parse_config(data)
    except ConfigError as exc:
        raise JobError(str(exc)) from None
    check_wire(cfg)
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"output": RunSection().output})})
    return cfg, cfg.to_toml(exclude=NODE_LOCAL)


def check_topology(topo: Any, federation: TopologySection, whose: str = "the federation's") -> None:
    """A job's ``[topology]`` (None: none) may only repeat the federation's keys: :class:`JobError` naming each key
    it sets otherwise, its value and the federation's."""
    if topo is None:
        return
    if not isinstance(topo, dict):
        raise JobError(
            f"topology = {shown(topo)}: [topology] is a section; a job runs on the federation's: leave it out"
        )
    fed = federation.model_dump(mode="json")
    differ = [key for key, value in topo.items() if key not in fed or fed[key] != value]
    if differ:
        sizes = f"{federation.cells} cells of {federation.devices_per_cell} devices"
        theirs = lambda key: "none (" + sizes + ")" if fed.get(key) is None else shown(fed[key])  # noqa: E731
        said = "; ".join(
            f"topology.{key} = {shown(topo[key])}, {whose}: {theirs(key)}"
            if key in fed
            else f"topology.{key}: unknown key"
            for key in differ
        )
        raise JobError(
            f"{said}. A job runs on the federation's topology (its roster once devices or cells were enrolled or "
            "revoked: fedtier provision add-device|add-cell|revoke change it): leave [topology] out of the job"
        )


def check_wire(cfg: RunConfig) -> None:
    """A job needing a wire protocol this node does not speak cannot be served here (the node is absent
    from it, with this reason)."""
    if cfg.requirements.wire != WIRE_VERSION:
        raise JobError(f"the job needs wire protocol {cfg.requirements.wire}, this node speaks {WIRE_VERSION}")


def localize(job_cfg: RunConfig, bundle: RunConfig, job: str) -> RunConfig:
    """The job's config as one node runs it: its bundle's broker, keys and monitoring, the job's own
    folder under the bundle's output folder (``{output}/jobs/{job}``), DP noise as deployments draw it."""
    out = bundle.output_dir() / JOB_FOLDERS / check_job_id(job)
    job_cfg, _ = deployment_config(job_cfg)  # DP noise from the OS unless the job sets an integer noise_seed
    return job_cfg.model_copy(
        update={
            "broker": bundle.broker,
            "security": bundle.security,
            "monitoring": bundle.monitoring,
            "run": job_cfg.run.model_copy(update={"output": str(out)}),
        }
    )


# --------------------------------------------------------------------------------------------- records
def open_job_record(data: bytes, topic: str, signer: str, verify: Verifier | None) -> dict[str, Any]:
    """A job record on ``topic`` that ``signer`` must have signed (when ``verify``); :class:`JobError` if not."""
    try:
        return open_record(data, topic, signer, verify, max_bytes=MAX_JOB_RECORD_BYTES)
    except WireError as exc:
        raise JobError(f"job record on {topic}: {exc}") from None


NONCE_HEX = 32
"""Length of a request's nonce (hex of 16 random bytes from the OS), which the cloud's reply echoes."""


def request_nonce(record: dict[str, Any]) -> str | None:
    """The nonce of a request ``record`` (signed or not) to echo in its reply; None if absent or malformed."""
    nonce = record.get("nonce")
    return nonce if hex_digits(nonce, NONCE_HEX) else None


class PendingRequest:
    """An operator's request awaiting the cloud's answer. Its fresh ``nonce`` goes in the request, and only a
    reply the cloud signed (when ``verify``) that echoes it is the answer: anyone else's request for the same
    job id is answered too, on the same topic (the cloud answers a request it cannot verify, its signature
    refused), and that answer is not this one's. The others are ``ignored``, with why."""

    def __init__(self, verify: Verifier | None) -> None:
        self.nonce = secrets.token_hex(NONCE_HEX // 2)
        self.verify = verify
        self.answer: dict[str, Any] | None = None
        self.ignored: list[str] = []

    def take(self, topic: str, data: bytes) -> None:
        """A message on the job's reply topic (the transport's handler)."""
        if self.answer is not None or not data:
            return
        try:
            reply = open_job_record(data, topic, "cloud", self.verify)
        except JobError as exc:
            self.ignored.append(str(exc))
            return
        if reply.get("nonce") != self.nonce:
            self.ignored.append(f"the cloud's answer to another request about job {reply.get('job')!r}")
            return
        self.answer = reply


def post_request(
    transport: MqttTransport,
    federation: str,
    record: dict[str, Any],
    job: str,
    sign: Signer | None,
    wait: float,
    verify: Verifier | None = None,
) -> PendingRequest:
    """The operator's side of a request about ``job`` (:func:`submit_record`, :func:`cancel_record`):
    subscribe to the job's reply topic (waiting up to ``wait`` for the broker's acknowledgement), then
    publish the request, with a fresh nonce and the time (``at``: the serving cloud takes a request only while it is
    fresh, and each nonce once, ``cloud.requests``), sealed with ``sign``. Its ``answer`` is the cloud's reply to it
    once it comes (the cloud's signature checked with ``verify``)."""
    pending = PendingRequest(verify)
    transport.subscribe(topics.job_reply(federation, job), pending.take)
    transport.wait_subscribed(wait)
    submit = topics.job_submit(federation)
    transport.publish(submit, seal_record({**record, "nonce": pending.nonce, "at": time.time()}, submit, sign))
    return pending


def submit_record(request: JobRequest) -> dict[str, Any]:
    return {"action": "submit", "job": request.job, "config": request.config, "init_from": request.init_from}


def cancel_record(job: str) -> dict[str, Any]:
    return {"action": "cancel", "job": check_job_id(job)}


@dataclass(frozen=True)
class CurrentJob:
    """The job the cloud published as in progress: id, canonical config text, hash, the queue's nonce for it and its
    session; ``previous``: how the job that ended before it ended (:func:`ended_outcome`), for a node that missed that
    job's ``finished`` record."""

    job: str
    config: str
    digest: str
    previous: dict[str, str] | None = None
    nonce: str = ""

    @property
    def session(self) -> str:
        return job_session(self.job, self.digest, self.nonce)

    def record(self) -> dict[str, Any]:
        record = {"job": self.job, "config": self.config, "hash": self.digest, "session": self.session}
        return (
            record
            | ({"nonce": self.nonce} if self.nonce else {})
            | ({"previous": self.previous} if self.previous else {})
        )

    def run_config(
        self, bundle: RunConfig, node: str | Sequence[str] | None = None, roster: Roster | None = None
    ) -> RunConfig:
        """The job's config for ``node`` of ``bundle`` (validated; the hash checked again). The job's
        membership is the cloud's (its roster when the job was submitted), not the bundle's: a node takes
        part only if it is a member (a device enrolled later serves the next job; a revoked one none).
        ``roster``: the node's current signed roster, which tells one enrolled since from a wrong id
        (:func:`not_a_member`)."""
        if config_hash(self.config) != self.digest:
            raise JobError(f"job {self.job}: the config does not match its hash")
        try:
            data = parse_toml(self.config)
            check_plugins(data, bundle, f"job {self.job}")
            cfg = parse_config(data)
        except JobError:
            raise
        except (ConfigError, tomllib.TOMLDecodeError) as exc:
            raise JobError(f"job {self.job}: {exc}") from None
        if cfg.run.name != bundle.run.name:
            raise JobError(f"job {self.job} is not for federation {bundle.run.name!r}")
        topo = cfg.topology
        nodes = [node] if isinstance(node, str) else (node or [])
        missing = [n for n in nodes if n not in topo.cell_ids() and topo.cell_of(n) is None]
        if missing:
            raise not_a_member(self.job, missing, roster)
        check_wire(cfg)
        return localize(cfg, bundle, self.job)


def ended_outcome(session: str, state: str, reason: str) -> dict[str, str]:
    """How a job ended, as the cloud's ``finished`` record says it (its session; ``failed`` or ``stopped`` with why,
    neither when it finished): a queue ``state`` finished, failed or cancelled (said stopped)."""
    why = (reason or state)[:MAX_REASON]
    return {
        "session": session,
        **({"failed": why} if state == "failed" else {"stopped": why} if state == "cancelled" else {}),
    }


def _previous(value: Any) -> dict[str, str] | None:
    """A record's ``previous`` (:func:`ended_outcome`), or ``None`` where it is absent or not one."""
    if not isinstance(value, dict) or not isinstance(value.get("session"), str) or len(value["session"]) > 200:
        return None
    return {k: str(value[k])[:MAX_REASON] for k in ("session", "failed", "stopped") if isinstance(value.get(k), str)}


def parse_current(record: dict[str, Any]) -> CurrentJob:
    """The in-progress job of a (verified) ``cloud/job`` record; :class:`JobError` if malformed."""
    job, config, digest = record.get("job"), record.get("config"), record.get("hash")
    if not isinstance(config, str) or not isinstance(digest, str) or config_hash(config) != digest:
        raise JobError("job record: config missing or not matching its hash")
    nonce = check_job_nonce(record.get("nonce"))
    return CurrentJob(check_job_id(job), config, digest, _previous(record.get("previous")), nonce)
