"""Sans-IO wire format: frame encoding, the receive state machine and the auth handshake."""

from .decoder import DEFER, Frame, FrameDecoder
from .frame import (
    DEFAULT_MAX_PAYLOAD,
    MAX_HEADER,
    P2P_TAG,
    PREFIX_SIZE,
    Header,
    Kind,
    ProtocolError,
    as_payload,
    byte_view,
    encode_data,
    encode_frame,
    is_p2p,
)

__all__ = [
    "DEFAULT_MAX_PAYLOAD",
    "DEFER",
    "MAX_HEADER",
    "P2P_TAG",
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
    "is_p2p",
]
