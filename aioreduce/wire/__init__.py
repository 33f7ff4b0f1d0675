"""Sans-IO wire format: frame encoding, the receive state machine and the auth handshake."""

from .decoder import DEFER, Frame, FrameDecoder
from .frame import (
    DEFAULT_MAX_PAYLOAD,
    MAX_HEADER,
    PREFIX_SIZE,
    Header,
    Kind,
    ProtocolError,
    as_payload,
    byte_view,
    encode_data,
    encode_frame,
)

__all__ = [
    "DEFAULT_MAX_PAYLOAD",
    "DEFER",
    "MAX_HEADER",
    "PREFIX_SIZE",
    "Frame",
    "FrameDecoder",
    "Header",
    "Kind",
    "ProtocolError",
    "as_payload",
    "byte_view",
    "encode_data",
    "encode_frame",
]
