"""The exceptions aioreduce raises. Every one that concerns a peer names its rank."""

from __future__ import annotations

from .wire.frame import ProtocolError


class AioreduceError(Exception):
    """Base class of aioreduce's own errors."""


class PeerLost(AioreduceError, ConnectionError):
    """The connection to a peer closed or broke (killed process, reset, dead host)."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"rank {rank}: {reason}")
        self.rank = rank
        self.reason = reason


class RecvTimeout(AioreduceError, TimeoutError):
    """A receive was not satisfied within its deadline."""

    def __init__(self, rank: int, step: int, tag: int, timeout: float) -> None:
        super().__init__(f"no frame from rank {rank} for step {step} tag {tag} "
                         f"within {timeout:.3g} s")
        self.rank, self.step, self.tag, self.timeout = rank, step, tag, timeout


class AuthError(AioreduceError):
    """A connection failed the shared-secret handshake."""


class RendezvousError(AioreduceError):
    """The job could not assemble: ranks missing, inconsistent world sizes, unreachable master."""

    def __init__(self, message: str, missing: list[int] | None = None) -> None:
        super().__init__(message)
        self.missing = missing or []


class VectorMismatch(AioreduceError, ValueError):
    """Ranks passed vectors of different shapes or dtypes to the same step.

    ``ranks`` are the two ranks whose vectors were compared; every rank of the job raises
    the same error for that step (a caller's mistake, not a straggler).
    """

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = ranks or []


class ConfigError(AioreduceError, ValueError):
    """The environment or arguments do not describe a valid job."""


class LaneClosed(PeerLost):
    """A lane (one direction of bulk data, see :mod:`aioreduce.transport.lane`) ended: its
    peer closed it, or is gone. Whether the peer is gone is the mesh's word."""


class LaneMismatch(AioreduceError):
    """A lane message is not the one expected: ``got`` and ``want`` are (step, index, bytes)."""

    def __init__(self, peer: int, got: tuple[int, int, int], want: tuple[int, int, int]) -> None:
        super().__init__(f"rank {peer} sent (step, segment, bytes) {got}, expected {want}")
        self.peer, self.got, self.want = peer, got, want


class GroupMismatch(AioreduceError):
    """After ranks died in a group of steps (``Node.replace_lost``), the live ranks would run
    it again from different steps: a death came while some ranks had finished a step of the
    group (its last segments on their way) and others had not, and the ones that finished
    went on. ``at`` maps each live rank to its next step. Every live rank raises it, named."""

    def __init__(self, rank: int, lost: list[int], at: dict[int, int]) -> None:
        where = ", ".join(f"rank {r} at step {s}" for r, s in sorted(at.items()))
        super().__init__(
            f"rank {rank}: ranks {lost} died while some ranks had finished a step of the group "
            f"that others had not ({where}); the group cannot run again alike on every rank: "
            "restart the job from its last checkpoint")
        self.rank, self.lost, self.at = rank, lost, at


__all__ = [
    "AioreduceError",
    "AuthError",
    "ConfigError",
    "GroupMismatch",
    "LaneClosed",
    "LaneMismatch",
    "PeerLost",
    "ProtocolError",
    "RecvTimeout",
    "RendezvousError",
    "VectorMismatch",
]
