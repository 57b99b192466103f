"""A Mosquitto broker's own byte counters (``$SYS/broker/bytes/*``), read over MQTT."""

from __future__ import annotations

import os
import threading
import time

from .mqtt import MqttTransport


def sys_bytes(url: str, timeout: float = 5.0) -> dict[str, int]:
    """``{"received": ..., "sent": ...}``: the bytes a Mosquitto broker received and sent since it
    started, from its ``$SYS/broker/bytes/*`` counters (published every ``sys_interval`` seconds;
    this waits for a publication made after it subscribed, so nothing before the call is missed)."""
    from .threadloop import ThreadLoop

    loop = ThreadLoop("sys-bytes").start()
    seen: dict[str, list[int]] = {"received": [], "sent": []}
    done = threading.Event()

    def on(topic: str, data: bytes) -> None:
        seen[topic.rsplit("/", 1)[-1]].append(int(data))
        if all(len(v) >= 2 for v in seen.values()):  # the retained value, then a fresh one
            done.set()

    client = MqttTransport.from_url(url, f"fedtier-sys-{os.getpid()}-{time.monotonic_ns()}", loop)
    try:
        client.subscribe("$SYS/broker/bytes/+", on)
        client.connect(timeout)
        done.wait(timeout)
    finally:
        client.close(flush_timeout=0)
        loop.stop()
    if not all(seen.values()):
        raise TimeoutError(f"no $SYS/broker/bytes counters from {url} within {timeout} s (sys_interval set?)")
    return {k: v[-1] for k, v in seen.items()}
