"""Bounded-time Transpose AllReduce (OptiReduce over TCP); see :class:`Transpose`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..base import Comm
from .session import TransposeSession

Missing = Literal["zero", "rescale"]
OnExcessLoss = Literal["raise", "wait"]


SLICE_BYTES = 4 << 20
HOSTS_SLICE_BYTES = 1 << 20


@dataclass(frozen=True)
class Transpose:
    """All-to-all shards to their owners, reduce what arrived by a deadline, send the reduced
    shards to everyone (Warraich et al., OptiReduce, NSDI 2025), over TCP.

    Rank ``k`` owns shard ``k`` of the (Hadamard-rotated) vector. Phase 1: every rank sends
    each shard to its owner as slices interleaved across owners; the owner adds what arrived
    by the stage deadline. Phase 2: each owner sends its reduced shard to every rank. A stage
    ends on full receipt, on an early close, or at its deadline, so one slow rank costs the
    others at most two stage deadlines, never more; what it did not deliver is missing from
    the sum (and accounted for in the :class:`~aioreduce.Result`).

    Options:

    * ``hadamard``: rotate with a shared-seed random Hadamard transform first, so a lost tail
      becomes small noise spread over its shard (floating point only). ``"after_loss"`` (the
      default): the steps go in blocks of ``rotate_steps``; a block rotates if a loss (a
      slice, a contribution or a reduced shard missing) was seen or heard of in the block
      before, so calm steps, where the rotation only costs a pass over the vector, do not;
      the losses of a block that follows a calm one are not spread. Every rank tells its
      peers of the losses it knows in its phase-1 frames, so the ranks change together; a
      step's deadline includes the rotation's measured time when it rotates.
      ``True``: every step; ``False``: never.
    * ``missing``: ``"rescale"`` (the default; unbiased: each reduced slice is scaled by N /
      contributions received; a missing reduced slice is N × this rank's own contribution)
      or ``"zero"`` (OptiReduce: a missing contribution adds nothing; a reduced slice that did
      not arrive keeps this rank's own contribution). Under DDP with cut steps, ``"zero"``
      ended training well above the exact run's loss and ``"rescale"`` close to it
      (docs/transpose.md has the runs).
    * ``deadline``: a fixed bound for the whole step in seconds (half per stage); by default
      each stage's bound adapts: ``warmup`` steps wait for everything and set a ceiling of
      ``headroom`` × their P95 (raised to ``headroom`` × the longest recent complete stage
      where that is more: a network that slows down later); then each rank proposes its
      EWMA completion estimate plus ``slack`` × its EWMA deviation (as TCP's retransmission
      timeout) and the stage takes the median proposal over ranks (at least
      ``min_deadline``, at most that ceiling).
      A stage whose missing senders are all still delivering at its bound (bytes within
      ``idle_fraction`` of the estimate) waits on while they do, up to ``flowing_grace``
      (0.25) × the bound more; a sender that has not started or has stopped gets nothing.
      ``Result.deadline`` is the step's bound: both stages' together, grace included.
    * ``max_loss``, ``on_excess_loss``: the safety valve. A step whose missing fraction
      exceeds ``max_loss`` raises :class:`~aioreduce.StragglerError` (``"raise"``) or waits
      past the deadline for the data (``"wait"``); it never silently degrades further.
    * ``resync_every``: every K steps the result says ``resync=True``: re-synchronise the
      model then (``Node.broadcast``), so replicas that used stand-ins cannot drift apart.
    * ``behind_steps``: a rank whose peers are this many steps ahead raises
      :class:`~aioreduce.FellBehind` and jumps to their step (after a pause, or a straggle
      longer than several of their steps); to the one after it where they told it they went
      on without it there (they are past it by the time it has its vector). Peers tell a
      rank they cut while it had sent nothing, as over lanes it would learn their step only
      once it had read its way there.
    * ``inject_loss``: for experiments, drop this fraction of slices on arrival (seeded),
      as an unreliable network would; never during warm-up.
    * ``lanes``: move the slices over a blocking lane to and from every peer, off the event
      loop (on by default; see ``schemes/links/lanes.py``); without a mesh (the in-memory
      network) they go through the comm.

    A collection of Python's garbage inside a step makes its rank late, and late ranks are
    cut: ``Node(gc_every=N)`` moves the collections between steps (:mod:`aioreduce.stepgc`;
    measured here it bought nothing once nothing held a failed step's buffers,
    docs/transpose.md).
    """

    hadamard: bool | Literal["after_loss"] = "after_loss"
    rotate_steps: int = 50  # with hadamard="after_loss": the blocks that rotate or not
    seed: int = 0
    missing: Missing = "rescale"
    deadline: float | None = None
    warmup: int = 10  # steps
    slack: float = 4.0  # deviations above the estimate
    headroom: float = 2.0  # the ceiling: this many times the warm-up's P95 (or more)
    # A floor under the adaptive bound of each stage: below it, the OS's scheduling of ranks
    # that share cores cuts them (4 ranks x 160 KB on 2 cores: at 5 ms, 5 steps raised in
    # 1000 calm ones, each a slice of one rank cut once; at 10 ms none; the tail row kept
    # P99/P50 1.26 with 0.80-0.82 % lost against 1.21-1.26 and 0.80-0.90 % at 5 ms).
    min_deadline: float = 0.01
    idle_fraction: float = 0.1  # early close after this fraction of the estimate is quiet
    flowing_grace: float = 0.25  # past its bound, a stage whose senders deliver waits this x more
    max_loss: float = 0.05
    on_excess_loss: OnExcessLoss = "raise"
    # Bytes per message; None: SLICE_BYTES on one host (each message costs CPU), and
    # HOSTS_SLICE_BYTES when the job spans hosts (an owner forwards a reduced slice while the
    # next comes in); docs/transpose.md "Slice size".
    slice_bytes: int | None = None
    resync_every: int = 0
    behind_steps: int = 2
    backlog_steps: int = 8
    inject_loss: float = 0.0
    max_wait: float = 600.0  # a reliable (warm-up or "wait") stage gives up after this
    lanes: bool = True
    coded: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.hadamard not in (True, False, "after_loss"):
            raise ValueError("hadamard must be True, False or 'after_loss'")
        if self.rotate_steps < 0:
            raise ValueError("rotate_steps must be >= 0")
        if self.missing not in ("zero", "rescale"):
            raise ValueError("missing must be 'zero' or 'rescale'")
        if self.on_excess_loss not in ("raise", "wait"):
            raise ValueError("on_excess_loss must be 'raise' or 'wait'")
        if self.deadline is not None and self.deadline <= 0:
            raise ValueError("deadline must be positive (or None to adapt)")
        if not 0 <= self.flowing_grace <= 10:
            raise ValueError("flowing_grace must be in [0, 10]")
        if not 0 <= self.max_loss <= 1 or not 0 <= self.inject_loss < 1:
            raise ValueError("max_loss must be in [0, 1] and inject_loss in [0, 1)")
        if min(self.warmup, self.slack, self.headroom, self.behind_steps,
               1 if self.slice_bytes is None else self.slice_bytes) <= 0:
            raise ValueError("warmup, slack, headroom, slice_bytes and behind_steps must be "
                             "positive")
        if self.resync_every < 0 or self.backlog_steps < 1:
            raise ValueError("resync_every must be >= 0 and backlog_steps >= 1")

    def slices(self, spans_hosts: bool) -> int:
        """Bytes per slice for a job on one host or across hosts (every rank passes the same
        ``spans_hosts``, :attr:`BulkLinks.spans_hosts`: they cut the same slices)."""
        if self.slice_bytes is not None:
            return self.slice_bytes
        return HOSTS_SLICE_BYTES if spans_hosts else SLICE_BYTES

    def validate(self, world_size: int) -> None:
        pass

    def neighbours(self, rank: int, world_size: int) -> list[int]:
        return [r for r in range(world_size) if r != rank]

    def open(self, comm: Comm) -> TransposeSession:
        return TransposeSession(comm, self)


__all__ = ["Transpose", "TransposeSession"]
