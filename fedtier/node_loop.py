"""A deployed server node's loop (``fedtier cloud``, ``fedtier cell``): run in the calling thread until its job
ends, watching the cloud's records for a cell."""

from __future__ import annotations

from protocols.rejections import RejectKind

from .console import console


def watch_cloud(node):
    """A :class:`CloudSession` fed by ``node``'s transport: the cloud's status and ``finished`` records
    (a cell leaves on the ``finished`` of the cloud's current session only, never on a stale one)."""
    from protocols.session import CloudSession
    from protocols.status import decode_status
    from protocols.wire import topics
    from protocols.wire.messenger import Messenger

    trust = getattr(node, "trust", None)
    own = getattr(node, "cloud", None)  # a cell's own view, fed by its status handler: share it (a second
    cloud = own if isinstance(own, CloudSession) else CloudSession()  # handler could miss the retained status)
    control = Messenger(node.transport, node.run, "watcher", trust=trust)

    def on_control(topic: str, data: bytes) -> None:
        msg = control.receive(topic, data, kinds=("control",)) if data else None
        if msg is not None and trust is not None and msg.header.sender != "cloud":
            control.reject(
                topic, RejectKind.WRONG_SENDER, f"control record signed by {msg.header.sender!r}, not the cloud", None
            )
            return
        if msg is not None and msg.payload.meta.get("event") == "finished":
            cloud.on_finished(msg.payload.meta.get("session"))

    node.transport.subscribe(topics.control(node.run), on_control)
    if cloud is not own:
        node.transport.subscribe(
            topics.status(node.run, "cloud"),
            lambda t, data: cloud.on_status(decode_status(data, t, trust) if data else None),
        )
    return cloud


def serve_node(node, loop, cloud=None, ended_wait: float | None = None) -> str | None:
    """Run a server node's loop in this thread until the run is finished, the node refused to work (an async cell
    restarted without its journal) or Ctrl-C; then stop it.
    A cell watches the cloud (``cloud``: a :func:`watch_cloud` of it, made here if not given). With
    ``ended_wait``, a cell that ``ended_wait`` seconds after its start has seen no cloud online, the cloud
    offline and a ``finished`` record (:attr:`CloudSession.ended`) leaves too: its job ended before it started
    (no new run's cloud came); returns that ended session (else ``None``)."""
    late: list[str] = []
    try:
        if not hasattr(node, "finished") and cloud is None:  # a cell: leaves when the run is finished
            cloud = watch_cloud(node)
        loop.post(node.start)
        if cloud is not None and ended_wait is not None:
            waited = loop.now() + ended_wait
            # ended once the wait is over, whenever the records come (with no wait, before them: checked on each)
            loop.call_later(ended_wait, lambda: None)

            def over() -> bool:
                if not late and cloud.ended and loop.now() >= waited:
                    late.append(cloud.ended)
                return bool(late)

        else:

            def over() -> bool:
                return False

        loop.run(until=lambda: over() or (cloud is not None and cloud.finished) or _ended(node))
    except KeyboardInterrupt:
        console.print("interrupted")
    finally:
        loop.stop()
        node.stop()
    return late[0] if late else None


def _ended(node) -> bool:
    """A cloud finished, or a cell that refused to work (``AsyncCellServer.refused``)."""
    return getattr(node, "finished", False) or getattr(node, "refused", None) is not None
