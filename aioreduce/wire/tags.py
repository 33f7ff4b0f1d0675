"""Every frame tag the runtime uses, in one registry.

A receive matches a frame by (source, step, tag), so two uses of one tag in one step would
mix their frames; each use below has a tag or a range of its own (``tests/unit/test_wire.py``
checks that none overlaps another). The order matters too: a scheme with stages inside a step
drops a stage's late frames by moving the step floor to (step, first tag of the next stage),
and the control tags sit above every data tag so that such a floor never drops them.
"""

from __future__ import annotations

DATA = 0
"""A step's data: segment, chunk or slice ``i`` on tag ``DATA + i`` (fewer than ``SECOND``)."""

SECOND = 1 << 20
"""The second stream of a step: a bidirectional ring's reversed half, the transpose's phase 2
(``SECOND + i``)."""

NOTICE = 1 << 21
"""The transpose, over the mesh, to a peer whose lane is full: the step this rank is at."""

RESULT = 1 << 24
"""A tree's result chunks on their way down: chunk ``c`` on ``RESULT + c``."""

ABORT = 1 << 30
"""The ring's abort: the step failed, and why (meta), sent to every rank."""

VERDICT = ABORT + 1
"""A tree's step without a result (meta says why: missing ranks, a mismatch, behind)."""

REQUEST = ABORT + 2
"""A tree rank asks a parent or grandparent for the outcomes from this frame's step on."""

EXCHANGE = ABORT + 5
"""A collective exchange step (allgather, broadcast, all-to-all, the owners' reductions)."""

LANE_OFFER = ABORT + 8
"""Where to open a lane and the nonce to prove (meta), from its receiver to its sender."""

REOPEN = ABORT + 9
"""A replacement process and a tree, star or transpose peer agree on the step from which the chunks
between them travel on lanes again (meta: :class:`~aioreduce.wire.control.LaneReopen`)."""

P2P = 1 << 40
"""Point-to-point messages (torch's ``send``/``recv``): from here up (user tags below 2^32);
their ``step`` is a per-pair sequence number, so no step floor makes them stale."""

HEAL = P2P + (1 << 32)
"""The job's step and a program's state, from a live peer to a rank that asked (see
:mod:`aioreduce.heal`): the step and size on ``HEAL`` (meta), piece ``i`` on ``HEAL + 1 + i``,
the asker's ticket as the frame's step. Above :data:`P2P`, so no step floor drops them."""

GROUP = HEAL + (1 << 24)
"""After a group of steps failed because ranks died (see ``Healer.replace_lost``): a live
rank's next step, to every other live rank (meta), keyed by the deaths (the frame's step), so
the ranks check that they all run the group again from the same step."""

MEMBERS = GROUP + 1
"""A ring whose lost rank was not replaced in time (see :mod:`aioreduce.heal`): each live
member's proposal to the lowest one on ``MEMBERS``, its decision on ``MEMBERS + 1`` (meta),
the frame's step the one the ring runs again at; a member's ack of a :class:`~aioreduce.wire.
control.Reform` on ``MEMBERS + 2``, the frame's step the one the change starts at."""

ROLL = MEMBERS + 3
"""A group's last step that failed here because a rank died, but that a live peer finished
before the death (see ``Healer.step``, ``last``): its answer to a
:class:`~aioreduce.wire.control.ResultAsk` on ``ROLL`` (meta: whether it holds that step's
result), the result on ``ROLL + 1``, the frame's step the step asked about."""

# (first tag, end) of every use above, for the overlap check and for readers.
RANGES: dict[str, tuple[int, int]] = {
    "DATA": (DATA, SECOND),
    "SECOND": (SECOND, NOTICE),
    "NOTICE": (NOTICE, NOTICE + 1),
    "RESULT": (RESULT, ABORT),
    "ABORT": (ABORT, ABORT + 1),
    "VERDICT": (VERDICT, VERDICT + 1),
    "REQUEST": (REQUEST, REQUEST + 1),
    "EXCHANGE": (EXCHANGE, EXCHANGE + 1),
    "LANE_OFFER": (LANE_OFFER, LANE_OFFER + 1),
    "REOPEN": (REOPEN, REOPEN + 1),
    "P2P": (P2P, HEAL),
    "HEAL": (HEAL, HEAL + (1 << 24)),
    "GROUP": (GROUP, GROUP + 1),
    "MEMBERS": (MEMBERS, MEMBERS + 3),
    "ROLL": (ROLL, ROLL + 2),
}
