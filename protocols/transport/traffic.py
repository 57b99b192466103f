"""What an MQTT connection puts on the wire, counted: the size of a PUBLISH packet, and each transport's
traffic (:class:`TransportStats`, read by the runners' reports and the Prometheus exporter)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


def publish_packet_bytes(topic_len: int, payload_len: int, qos: int = 1) -> int:
    """Size of an MQTT 3.1.1 PUBLISH packet: fixed header, topic, packet id (QoS > 0), payload."""
    remaining = 2 + topic_len + (2 if qos else 0) + payload_len
    varint = 1 if remaining < 128 else 2 if remaining < 16384 else 3 if remaining < 2097152 else 4
    return 1 + varint + remaining


@dataclass
class TransportStats:
    """Traffic of one transport. ``bytes_*`` include the PUBLISH framing; ``messages_*`` count whole
    messages, ``packets_*`` MQTT PUBLISH packets (chunks). ``by_topic[topic] = [bytes_out, bytes_in]``.
    Outgoing bytes are counted when handed to the client; ``acked`` counts PUBACKs."""

    bytes_out: int = 0
    bytes_in: int = 0
    payload_bytes_out: int = 0
    payload_bytes_in: int = 0
    messages_out: int = 0
    messages_in: int = 0
    packets_out: int = 0
    packets_in: int = 0
    acked: int = 0
    by_topic: dict[str, list[int]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def _count(self, topic: str, wire: int, payload: int, out: bool) -> None:
        with self._lock:
            per = self.by_topic.setdefault(topic, [0, 0])
            if out:
                self.bytes_out += wire
                self.payload_bytes_out += payload
                self.packets_out += 1
                per[0] += wire
            else:
                self.bytes_in += wire
                self.payload_bytes_in += payload
                self.packets_in += 1
                per[1] += wire

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            d = {k: v for k, v in self.__dict__.items() if not k.startswith("_") and k != "by_topic"}
            d["by_topic"] = {t: list(v) for t, v in self.by_topic.items()}
        return d
