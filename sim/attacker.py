"""An adversary for emulated runs: an MQTT client that attacks a signed ``fedtier run`` (``tests/test_attacks.py``,
``benchmarks/attacks.py``).

It holds no key except where an attack says so (a compromised device, a compromised cell), reads what
the broker lets it read, and fires each attack once, as the first task of device ``c0-d0`` arrives
(round 0, edge round 0), so every node is up and a round is in flight. Cross-run replays use the
genuine messages an earlier run with the same keys and run name published, recorded by
:meth:`Attacker.capture`. Each attack names what must refuse it and the log text that says so.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from protocols.session import encode_manifest
from protocols.status import encode_status
from protocols.transport.mqtt import MqttTransport
from protocols.transport.threadloop import ThreadLoop
from protocols.wire import chunking, topics
from protocols.wire.envelope import decode_message
from protocols.wire.keys import KeyRing, Trust, new_seed
from protocols.wire.messenger import Messenger
from protocols.wire.payload import Payload, decode_payload


@dataclass(frozen=True)
class Attack:
    name: str
    refused_by: str  # "signature", "replay window", "size bound", "weight bound" (the broker: tests/test_provision.py)
    log: str  # text of the rejection in the nodes' logs


ATTACKS = [
    Attack("cross-run replay of a cell task", "replay window", "task of cloud session"),
    Attack("cross-run replay of a device task", "replay window", "task of cloud session"),
    Attack("cross-run replay of a device's signed result", "replay window", "result of session"),
    Attack("forged finished", "signature", "cloud/control (signature): unsigned message"),
    Attack("forged cloud status with a fake session", "signature", "status/cloud: unsigned record"),
    Attack("forged round manifest", "signature", "rejected a round manifest"),
    Attack("forged device status (offline)", "signature", "status/device.c0-d1: unsigned record"),
    Attack("far-future round task (cell's own key)", "replay window", "the cloud's manifest says round"),
    Attack("a cell forging its device's result", "signature", "bad signature: not signed by 'c0-d0'"),
    Attack("a device claiming 10^12 samples (its own key)", "weight bound", "weight 1e+12 exceeds"),
    Attack("a cell claiming 10^15 samples (its own key)", "weight bound", "weight 1e+15 exceeds the bound of cell c0"),
    Attack("bogus chunks injected into a genuine set", "signature", "from 'c0-d1': bad signature"),
    Attack("43-byte chunk header announcing 500 MB", "size bound", "524288000 bytes exceeds the bound"),
]
FIRST_DEVICE, CHUNKED_DEVICE, REPLAY_DEVICE, REPLAY_CELL = "c0-d0", "c0-d1", "c0-d2", "c1"


class Attacker:
    """Connects to ``broker_url`` as client ``intruder``; :meth:`start` before the run, :meth:`stop` after."""

    def __init__(
        self,
        run: str,
        broker_url: str,
        ring: KeyRing,
        *,
        captured: dict[str, list[bytes]] | None = None,
        attacks: list[str] | None = None,
    ) -> None:
        self.run, self.ring = run, ring
        self.captured = captured or {}
        self.wanted = set(attacks) if attacks is not None else {a.name for a in ATTACKS}
        self.loop = ThreadLoop("intruder")
        self.client = MqttTransport.from_url(broker_url, f"fedtier-{run}-intruder", self.loop)
        self.sniffer = MqttTransport.from_url(broker_url, f"fedtier-{run}-sniffer", self.loop)
        self.sniffer._reasm = _Unassembled()  # its handlers see each chunk as it travels
        self.fired: list[str] = []
        self.session: str | None = None
        self._lock = threading.Lock()
        self._chunked: set[bytes] = set()

    # ------------------------------------------------------------------------------ capture mode
    @classmethod
    def capture(cls, run: str, broker_url: str, ring: KeyRing) -> Attacker:
        """An eavesdropper that records the first genuine cell task of ``c1`` and device task and result of
        ``c0-d2`` as they travelled (the MQTT payloads: one message, or its signed chunks) into
        ``captured``."""
        spy = cls(run, broker_url, ring, attacks=[])
        for key, topic in (
            ("cell_task", topics.cell_task(run, REPLAY_CELL)),
            ("device_task", topics.device_task(run, "c0", REPLAY_DEVICE)),
            ("device_result", topics.device_result(run, "c0", REPLAY_DEVICE)),
        ):
            spy.sniffer.subscribe(topic, spy._recorder(key))
        return spy

    def _recorder(self, key: str) -> Callable[[str, bytes], None]:
        """A handler that records what it sees under ``captured[key]``."""
        return lambda _topic, data: self._record(key, data)

    def _record(self, key: str, data: bytes) -> None:
        packets = self.captured.setdefault(key, [])
        if not packets or (
            chunking.is_chunk(packets[0])
            and chunking.is_chunk(data)
            and data[4:20] == packets[0][4:20]
            and len(packets) < chunking._HEAD.unpack_from(packets[0])[3]
        ):
            packets.append(data)

    # ------------------------------------------------------------------------------ attack mode
    def start(self) -> Attacker:
        run = self.run
        self.loop.start()
        if self.wanted:
            self.client.subscribe(topics.status(run, "cloud"), self._on_cloud_status)
            self.client.subscribe(topics.device_task(run, "c0", FIRST_DEVICE), self._on_first_task)
            self.sniffer.subscribe(topics.device_result(run, "c0", CHUNKED_DEVICE), self._on_chunk)
        for client in (self.client, self.sniffer):
            client.connect()
            client.wait_subscribed()
        return self

    def stop(self) -> None:
        self.sniffer.close(flush_timeout=0)
        self.client.close(flush_timeout=2)
        self.loop.stop()

    def _fire(self, name: str, action: Callable[[], object]) -> None:
        if name in self.wanted and name not in self.fired:
            action()
            self.fired.append(name)

    def _on_cloud_status(self, topic: str, data: bytes) -> None:
        import json

        try:
            record = json.loads(data)
        except ValueError:
            return
        if isinstance(record, dict) and record.get("state") == "online" and "fake" not in str(record.get("session")):
            self.session = record.get("session")

    def _send_as(
        self,
        claims: str,
        key_of: str,
        session: str | None,
        topic: str,
        kind: str,
        payload: Payload,
        **header: int | str,
    ) -> None:
        """Send as ``claims``, the message and its chunks signed with ``key_of``'s genuine private key
        (a compromised node), stamped with ``session``."""
        trust = Trust(claims, self.ring.private[key_of], self.ring.public)
        m = Messenger(self.client, self.run, claims)  # no trust at construction: the client stays unkeyed
        m.trust, m.session = trust, session
        frame = m.frame(kind, payload, topic=topic, **header)  # type: ignore[arg-type]
        for part in chunking.split(frame, chunking.DEFAULT_MAX_CHUNK, topic=topic, auth=trust):
            self._raw(topic, part)

    def _replay(self, topic: str, packets: list[bytes]) -> None:
        for p in packets:
            self._raw(topic, p)

    def _on_first_task(self, topic: str, data: bytes) -> None:
        """The first device's first task: every wanted attack fires once, in this order."""
        try:
            header, raw = decode_message(data)
        except ValueError:
            return
        if (header.round, header.edge_round) != (0, 0):
            return
        self._replays_and_forgeries()
        self._compromised_nodes(header.session, decode_payload(raw))
        self._fire("43-byte chunk header announcing 500 MB", self._huge_header)

    def _replays_and_forgeries(self) -> None:
        """An outsider's attacks: another run's captured tasks replayed, and records forged without a key."""
        run, c = self.run, self.client
        self._fire(
            "cross-run replay of a cell task",
            lambda: self._replay(topics.cell_task(run, REPLAY_CELL), self.captured["cell_task"]),
        )
        self._fire(
            "cross-run replay of a device task",
            lambda: self._replay(topics.device_task(run, "c0", REPLAY_DEVICE), self.captured["device_task"]),
        )
        self._fire(
            "cross-run replay of a device's signed result",
            lambda: self._replay(topics.device_result(run, "c0", REPLAY_DEVICE), self.captured["device_result"]),
        )
        self._fire(
            "forged finished",
            lambda: Messenger(c, run, "cloud").send(
                topics.control(run),
                "control",
                Payload({"event": "finished", "round": 0, "session": self.session}),
                round=0,
                retain=True,
            ),
        )
        self._fire(
            "forged cloud status with a fake session",
            lambda: c.publish(
                topics.status(run, "cloud"), encode_status("online", session="fake-session", started=1e12), retain=True
            ),
        )
        self._fire(
            "forged round manifest",
            lambda: c.publish(topics.round_manifest(run), encode_manifest(str(self.session), 0), retain=True),
        )
        self._fire(
            "forged device status (offline)",
            lambda: c.publish(
                topics.device_status(run, "c0", CHUNKED_DEVICE), encode_status("offline", cell="c0"), retain=True
            ),
        )

    def _compromised_nodes(self, session: str | None, task: Payload) -> None:
        """Attacks with genuine keys (a compromised cell or device) in the current ``session``; ``task``: the
        first device's genuine first task."""
        run = self.run
        result_topic = topics.device_result(run, "c0", FIRST_DEVICE)

        def poisoned(weight: float) -> Payload:
            return Payload({"weight": weight, "loss": 0.0}, {k: np.full_like(v, 3.0) for k, v in task.tensors.items()})

        def result_as(key_of: str, weight: float) -> None:
            self._send_as(
                FIRST_DEVICE, key_of, session, result_topic, "device_result", poisoned(weight), round=0, cell="c0"
            )

        far_topic = topics.device_task(run, "c0", FIRST_DEVICE)
        self._fire(
            "far-future round task (cell's own key)",
            lambda: self._send_as("c0", "c0", session, far_topic, "device_task", task, round=1000, cell="c0"),
        )
        self._fire("a cell forging its device's result", lambda: result_as("c0", 10.0))
        self._fire("a device claiming 10^12 samples (its own key)", lambda: result_as(FIRST_DEVICE, 1e12))
        self._fire(
            "a cell claiming 10^15 samples (its own key)",
            lambda: self._send_as(
                "c0",
                "c0",
                self.session,
                topics.cell_report(run, "c0"),
                "cell_report",
                poisoned(1e15),
                round=0,
                cell="c0",
            ),
        )

    def _huge_header(self) -> None:
        """A 43-byte chunk header that announces 500 MB, to the cell and to a device."""
        total = 500 * 1024 * 1024
        head = chunking._HEAD.pack(chunking.MAGIC, os.urandom(16), 0, total, 1, total, 0, 0) + b"x"
        self._raw(topics.device_result(self.run, "c0", CHUNKED_DEVICE), head)  # to the cell
        self._raw(topics.device_task(self.run, "c0", CHUNKED_DEVICE), head)  # to a device

    def _raw(self, topic: str, data: bytes) -> None:
        """Publish bytes as one MQTT message, as they are (the transport would frame a chunk-like
        payload as a one-chunk set of its own)."""
        self.client._client.publish(topic, data, qos=1)

    def _on_chunk(self, topic: str, data: bytes) -> None:
        """Seeing a genuine chunk set start, inject a bogus copy of each of its other chunks (same
        content id, claimed sender, a key of the attacker's own)."""
        name = "bogus chunks injected into a genuine set"
        if name not in self.wanted or not chunking.is_chunk(data):
            return
        magic, cid, index, count, size, total, slen, glen = chunking._HEAD.unpack_from(data)
        sender = bytes(data[chunking.HEADER_BYTES : chunking.HEADER_BYTES + slen])
        with self._lock:
            if self._chunked or not 2 <= count <= 64 or sender != CHUNKED_DEVICE.encode():
                return  # the first genuine chunked set only (not our own 500 MB announcement)
            self._chunked.add(cid)
        liar = Trust(sender.decode(), new_seed(), {})
        for i in range(count):
            if i == index:
                continue
            body = os.urandom(min(size, total - i * size))
            head = chunking._HEAD.pack(magic, cid, i, count, size, total, slen, 0)
            sig = liar.sign(chunking._signed(topic, head, sender, body))
            self._raw(
                topic, chunking._HEAD.pack(magic, cid, i, count, size, total, slen, len(sig)) + sender + sig + body
            )
        if name not in self.fired:
            self.fired.append(name)


class _Unassembled(chunking.Reassembler):
    """The transport's reassembler, made to hand every MQTT payload on as it is (nothing held, no limit)."""

    def feed(self, key: str, data: bytes) -> bytes:
        return data

    def expire(self, now: float | None = None) -> int:
        return 0

    def limit(self, max_message: int | None = None, auth: chunking.ChunkAuth | None = None) -> None:
        pass
