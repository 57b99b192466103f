"""Transports: the pub/sub interface (``base``) and its implementations (``memory``, ``mqtt``)."""

from .base import EventLoop, Handler, TimerHandle, Transport, Will, topic_matches

__all__ = ["EventLoop", "Handler", "TimerHandle", "Transport", "Will", "topic_matches"]
