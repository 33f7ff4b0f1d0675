"""aioreduce: straggler-resilient gradient aggregation over asyncio TCP."""

from .env import NodeEnv, discover
from .errors import (
    AioreduceError,
    AuthError,
    ConfigError,
    PeerLost,
    ProtocolError,
    RecvTimeout,
    RendezvousError,
)
from .node import Node
from .transport import MeshOptions, run

__version__ = "0.1.0"

__all__ = [
    "AioreduceError",
    "AuthError",
    "ConfigError",
    "MeshOptions",
    "Node",
    "NodeEnv",
    "PeerLost",
    "ProtocolError",
    "RecvTimeout",
    "RendezvousError",
    "discover",
    "run",
]
