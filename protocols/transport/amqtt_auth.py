"""An amqtt authentication plugin that lets every client in, without marking it anonymous.

amqtt (0.12) keeps no session for an anonymous client: it queues nothing for a disconnected
``clean_session=False`` client that logged in through its ``AnonymousAuthPlugin``. The embedded
broker (loopback only, for emulation and tests) uses this plugin instead, so persistent sessions work.
"""

from __future__ import annotations

from dataclasses import dataclass

from amqtt.plugins.base import BaseAuthPlugin
from amqtt.session import Session


class OpenAuth(BaseAuthPlugin):
    """Accept every client; its session may persist (see the module doc)."""

    @dataclass
    class Config:
        """No options."""

    async def authenticate(self, *, session: Session) -> bool:
        return True
