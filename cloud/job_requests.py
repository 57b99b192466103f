"""What the long-lived cloud does with the operator's requests on the federation's submit topic (on its loop thread):
a submission is verified (:mod:`cloud.requests`: signed, dated, taken once), validated against the federation and its
privacy budget, and queued (:mod:`cloud.jobs`); a cancellation ends a queued job at once and stops a running one after
its round. Each request is answered with a signed reply that echoes its nonce, and the job list published again.
:class:`cloud.service.CloudService` is their :class:`Host`."""

from __future__ import annotations

import logging
import math
import threading
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from protocols.algorithms import get_algorithm
from protocols.algorithms.traits import Trait
from protocols.jobs import OPERATOR, JobError, canonical_job, check_job_id, config_hash, open_job_record, request_nonce
from protocols.wire import topics

from .jobs import Job, JobQueue, JobQueueError

if TYPE_CHECKING:
    from protocols.config import RunConfig
    from protocols.privacy.ledger import PrivacyLedger
    from protocols.transport.base import Transport

    from .requests import OperatorRequests
    from .server import CloudServer

log = logging.getLogger("fedtier.cloud.service")


class Host(Protocol):
    """What the request handlers need of the serving cloud: the federation (its bundle, as its roster made it), the
    queue, the privacy ledger, the request guard, the running job's server, and where a queue that cannot be written
    stops it (``error``, ``wake``), the jobs cancelled while queued (``cancelled_queued``); its live connection,
    its job list, its signature."""

    fed: str
    bundle: RunConfig
    queue: JobQueue
    ledger: PrivacyLedger
    requests: OperatorRequests
    node: CloudServer | None
    cancelled_queued: list[str]
    error: BaseException | None
    wake: threading.Event

    def _live(self) -> Transport | None: ...

    def _publish_list(self, transport: Transport) -> None: ...

    def _seal(self, record: dict[str, Any], topic: str) -> bytes: ...


def on_request(host: Host, topic: str, data: bytes) -> None:
    """A request on the submit topic: taken or refused, and answered."""
    if not data:
        return
    try:  # the job id and nonce first (to answer on its topic, to its request), then the operator's signature
        unverified = open_job_record(data, topic, OPERATOR, None)
        job = check_job_id(unverified.get("job"))
    except JobError as exc:
        log.warning("refused a job request: %s", exc)  # no job id to answer on
        return
    reply = partial(_reply, host, job, nonce=request_nonce(unverified))
    try:
        record = host.requests.open(data, topic)  # the operator's signature, its time, a nonce not taken before
    except JobError as exc:
        log.warning("refused job %s: %s", job, exc)
        reply(False, str(exc))
        return
    try:
        if record.get("action") == "cancel":
            cancel(host, job)
            answer = (True, "cancelled" if host.queue.jobs[job].state == "cancelled" else "cancelling")
        elif record.get("action") == "submit":
            submit(host, job, record)
            answer = (True, "queued")
        else:
            raise JobError(f"unknown action {record.get('action')!r}")
    except JobError as exc:
        log.warning("refused %s %s: %s", "to cancel job" if record.get("action") == "cancel" else "job", job, exc)
        answer = (False, str(exc))
    except JobQueueError as exc:  # not done, so not taken
        reply(False, str(exc))
        host.error = exc  # the queue cannot be written: stop rather than lose a job
        return
    host.requests.take(record)  # done or refused (its replay is refused as one, not judged again), and not before
    reply(*answer)
    if (transport := host._live()) is not None:
        host._publish_list(transport)
    host.wake.set()


def submit(host: Host, job: str, record: dict[str, Any]) -> None:
    """Queue ``job`` with the ``record``'s config; :class:`JobError` saying why not."""
    config = record.get("config")
    init_from = record.get("init_from")
    if not isinstance(config, str):
        raise JobError("the job has no config")
    cfg, text = canonical_job(config, host.bundle)
    if init_from is not None and Trait.DEVICE_STATE in get_algorithm(cfg.train.name).traits_with(cfg.train):
        raise JobError(
            f"init_from: {cfg.train.name}'s devices keep a model replica from the initial model, which only "
            "the cloud would have"
        )
    epsilon = cfg.dp_accountant().epsilon(cfg.run.rounds) if cfg.privacy.dp != "off" else math.inf
    devices = cfg.topology.all_devices()
    reason = host.ledger.refusal(job, devices, epsilon, host.bundle.privacy.federation_epsilon_budget)
    if reason is not None:
        raise JobError(reason)
    host.queue.submit(Job(job, text, config_hash(text), OPERATOR, init_from))
    if math.isfinite(epsilon):
        host.ledger.reserve(job, devices, epsilon, cfg.privacy.delta)
    log.info("job %s queued (hash %s)", job, config_hash(text)[:12])


def cancel(host: Host, job: str) -> None:
    """Cancel ``job``: a queued one now (its privacy reservation released), a running one after its round."""
    cancelled = host.queue.cancel(job)
    if cancelled.state == "cancelled":  # never ran: it spent nothing
        host.ledger.settle(job, 0.0)
        host.cancelled_queued.append(job)  # said as the cloud stops, beside the jobs it served
    if host.node is not None and cancelled.state == "running":
        host.node.request_stop("cancelled by the operator")


def _reply(host: Host, job: str, accepted: bool, reason: str, nonce: str | None) -> None:
    """Answer a request about ``job``, echoing its ``nonce``: the operator takes no other answer as its own."""
    if (transport := host._live()) is None:
        return
    topic = topics.job_reply(host.fed, job)
    record = {"job": job, "accepted": accepted, "reason": reason, **({"nonce": nonce} if nonce else {})}
    transport.publish(topic, host._seal(record, topic))
