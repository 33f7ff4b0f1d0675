"""The asyncio layer: event loop, framed connections, the authenticated mesh, rendezvous."""

from .inbox import PeerBudget
from .loop import is_uvloop, loop_factory, run
from .mesh import Mesh, MeshOptions
from .rendezvous import barrier, rendezvous

__all__ = ["Mesh", "MeshOptions", "PeerBudget", "barrier", "is_uvloop", "loop_factory",
           "rendezvous", "run"]
