"""Wire format: envelope, payload codec, topic scheme and duplicate suppression."""

from .envelope import Header, WireError, decode_message, encode_message, new_msg_id
from .payload import Payload, decode_payload, encode_payload

__all__ = [
    "Header",
    "Payload",
    "WireError",
    "decode_message",
    "decode_payload",
    "encode_message",
    "encode_payload",
    "new_msg_id",
]
