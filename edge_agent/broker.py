"""How a node reaches the MQTT broker: its connection options (URL, credentials, TLS files), its client id,
and its last will (a retained "offline" status, signed when the run has keys)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocols.config import ConfigError, RunConfig
from protocols.status import encode_status, order_stamp
from protocols.transport.base import Will
from protocols.wire import chunking, topics
from protocols.wire.keys import node_trust
from protocols.wire.signed import signer_of


@dataclass(frozen=True)
class BrokerOptions:
    """How a node reaches the broker (paho gets the credentials and TLS files as they are)."""

    url: str
    username: str | None = None
    password: str | None = None
    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    max_chunk: int = chunking.DEFAULT_MAX_CHUNK

    @classmethod
    def from_config(cls, cfg: RunConfig, url: str | None = None, **overrides: Any) -> BrokerOptions:
        """The config's ``[broker]`` section; ``url`` and non-None ``overrides`` (CLI flags) win."""
        b = cfg.broker
        fields: dict[str, Any] = {
            "username": b.username,
            "password": b.password,
            "ca_certs": b.ca_certs,
            "certfile": b.certfile,
            "keyfile": b.keyfile,
        }
        fields.update({k: v for k, v in overrides.items() if v is not None})
        url = url or b.url
        if not url:
            raise ConfigError("broker.url: required (mqtt://host:port), or pass --broker")
        return cls(url, **fields)

    def transport(self, node: str, run: str, loop: Any, will: Will | None = None, **kwargs: Any) -> Any:
        """A (not yet connected) :class:`MqttTransport` for ``node`` with client id ``fedtier-{run}-{node}``
        and a persistent session (a node restarted under the same id gets what the broker queued for
        it meanwhile); ``kwargs`` go to the transport (``reactor``, ``backoff_seed``, ``retry_refused``,
        ``persistent``)."""
        from protocols.transport.mqtt import MqttTransport

        kwargs.setdefault("persistent", True)

        return MqttTransport.from_url(
            self.url,
            client_id(run, node),
            loop,
            username=self.username,
            password=self.password,
            ca_certs=self.ca_certs,
            certfile=self.certfile,
            keyfile=self.keyfile,
            will=will,
            max_chunk=self.max_chunk,
            **kwargs,
        )


def client_id(run: str, node: str) -> str:
    """MQTT client id of a node (``cloud``, ``cell.c0``, ``device.c0-d1``) in a run."""
    return f"fedtier-{run}-{node}"


def offline_will(run: str, node: str, cfg: RunConfig | None = None, instance: str | None = None) -> Will:
    """The last will of a node: its retained status says offline (signed by the node when ``cfg`` has
    ``[security] keys``), naming its process's ``instance`` if given (``protocols.twin``: the broker publishes
    it at a takeover of its session by a clean connection, so a second process of the node sees who holds it)."""
    return _will(topics.status(run, node), cfg, **({"instance": instance} if instance is not None else {}))


def device_will(
    run: str, cell: str, device: str, cfg: RunConfig | None = None, instance: str | None = None, ordered: bool = False
) -> Will:
    """The last will of a device: its retained status (under its cell) says offline (signed as above), naming the
    agent process's ``instance`` (``protocols.twin``: the broker publishes it at a takeover by a clean connection).
    ``ordered``: the will of an agent's watch connection, which its devices' own connections take over as its job
    starts (the broker may say it after their online): ordered as of now (``protocols.status.order_stamp``), so a
    reader takes it only if that process said nothing newer."""
    extra: dict[str, Any] = {"instance": instance} if instance else {}
    return _will(topics.device_status(run, cell, device), cfg, **extra, **(order_stamp() if ordered else {}))


def _will(topic: str, cfg: RunConfig | None, **extra: Any) -> Will:
    signer = signer_of(topic)
    trust = node_trust(cfg, signer) if cfg is not None and signer is not None else None
    return Will(topic, encode_status("offline", topic=topic, trust=trust, **extra), retain=True)
