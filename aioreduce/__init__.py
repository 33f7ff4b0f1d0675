"""aioreduce: straggler-resilient gradient aggregation over asyncio TCP."""

from .env import NodeEnv, discover
from .errors import (
    AioreduceError,
    AuthError,
    ConfigError,
    GroupMismatch,
    PeerLost,
    ProtocolError,
    RecvTimeout,
    RendezvousError,
    VectorMismatch,
)
from .heal import StateHooks
from .node import Node
from .schemes import (
    CodedTree,
    FellBehind,
    GradientCoding,
    Result,
    Ring,
    Scheme,
    Star,
    StragglerError,
    Transpose,
    Tree,
)
from .straggle import StraggleModel, parse_straggle
from .sync import SyncNode, connect
from .transport import MeshOptions, run

__version__ = "0.1.0"

__all__ = [
    "AioreduceError",
    "AuthError",
    "CodedTree",
    "ConfigError",
    "FellBehind",
    "GradientCoding",
    "GroupMismatch",
    "MeshOptions",
    "Node",
    "NodeEnv",
    "PeerLost",
    "ProtocolError",
    "RecvTimeout",
    "RendezvousError",
    "Result",
    "Ring",
    "Scheme",
    "Star",
    "StateHooks",
    "StraggleModel",
    "StragglerError",
    "SyncNode",
    "Transpose",
    "Tree",
    "VectorMismatch",
    "connect",
    "discover",
    "parse_straggle",
    "run",
]
