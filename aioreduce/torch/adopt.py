"""torch's own DDP, built by the program over a group of ours that heals, healing as
:func:`aioreduce.torch.DistributedDataParallel` does (:mod:`.ddp_heal`).

A program that builds ``torch.nn.parallel.DistributedDataParallel(model)`` itself over our
group, in a job whose ranks may come back (``rejoin_wait`` > 0: ``aioreduce-launch --restart``
or ``--tolerate``), needs no changed line for DDP:

* the group spots the DDP in the making: the collectives of its construction (torch's check of
  the parameters' shapes and its broadcast from rank 0) come from ``DistributedDataParallel
  .__init__``, which the calling frames name; the group hooks that DDP's forward;
* at its first forward the DDP is adopted: the healing comm hook of :mod:`.ddp_heal` (an
  iteration's buckets one group of steps, run again as a whole with a replacement) and, before
  every forward, rank 0's buffers as a step of that group;
* the collectives DDP runs on its own that a replacement must not join complete on each rank
  (:func:`stays_here`): a replacement's construction (it healed its parameters from a live rank
  while ``init_process_group`` ran), and on every rank those of an adopted DDP's forward (the
  bucket order broadcast after the first iteration: each rank orders its buckets, as our
  wrapper's do; the buffers' broadcast, which the group's own step replaced).

Why frames: DDP has no hook at construction, and which collective a replacement must not join
is told only by who calls it (torchft answers the same question with a DDP of its own). The
program still gives the state a replacement heals (``aioreduce.torch.configure(state=...)``
before ``init_process_group``), its loop's position included. Not adopted, so not healed (it
runs as before): a DDP built with ``init_sync=False`` (no collective at construction), and,
said on every rank, one with ``find_unused_parameters=True`` or a comm hook of the
program's.
"""

from __future__ import annotations

import logging
import sys
from types import FrameType
from typing import TYPE_CHECKING

from torch.nn.parallel import DistributedDataParallel as TorchDDP

from . import ddp_heal

if TYPE_CHECKING:
    from .process_group import ProcessGroupAioreduce

_INIT = TorchDDP.__init__.__code__
_PRE_FORWARD = TorchDDP._pre_forward.__code__
_DEPTH = 12  # frames from our collective up to DDP's (torch's helpers between: 3 or 4)
_ADOPTED = "_aioreduce_iterations"  # on a DDP seen forward: its Iterations, None if declined
_WATCHED = "_aioreduce_watched"
log = logging.getLogger("aioreduce.torch")


def _calling_ddp(frame: FrameType | None) -> tuple[TorchDDP, bool] | None:
    """The DDP whose construction (True) or forward's preparation (False) made the collective
    running in ``frame``'s callee, or None."""
    for _ in range(_DEPTH):
        if frame is None:
            return None
        if frame.f_code is _INIT or frame.f_code is _PRE_FORWARD:
            ddp = frame.f_locals.get("self")
            return (ddp, frame.f_code is _INIT) if isinstance(ddp, TorchDDP) else None
        frame = frame.f_back
    return None


def stays_here(pg: ProcessGroupAioreduce) -> bool:
    """Whether the collective that ``pg`` is running for its caller is DDP's own and completes
    on this rank (see the module docstring). A DDP under construction is hooked for adoption
    at its first forward."""
    found = _calling_ddp(sys._getframe(1))
    if found is None:
        return False
    ddp, constructing = found
    if constructing:
        if not getattr(ddp, _WATCHED, False):
            setattr(ddp, _WATCHED, True)
            ddp.register_forward_pre_hook(lambda m, _inputs: _before_forward(m, pg))
        return bool(pg.node.node.mesh.incarnations.rejoined)
    return getattr(ddp, _ADOPTED, None) is not None


def _before_forward(ddp: TorchDDP, pg: ProcessGroupAioreduce) -> None:
    """Every forward of a DDP built over ``pg``: adopt it the first time, then sync its
    buffers as :func:`aioreduce.torch.DistributedDataParallel` does."""
    if not hasattr(ddp, _ADOPTED):
        setattr(ddp, _ADOPTED, _adopt(ddp, pg))
    iterations = getattr(ddp, _ADOPTED)
    if iterations is not None:
        ddp_heal.sync_buffers(ddp, iterations)


def _adopt(ddp: TorchDDP, pg: ProcessGroupAioreduce) -> ddp_heal.Iterations | None:
    """The healing state registered on ``ddp``, or None where it cannot heal: then it runs as
    it is (under ``--tolerate`` it goes on without a dead rank, each failed sum run again over
    the live ranks), and a replacement cannot rejoin it (said once, on every rank)."""
    why = ("find_unused_parameters=True (the ranks would have to agree on the parameters "
           "used)" if ddp.find_unused_parameters else
           "a comm hook of the program's (one that heals sums an iteration's buckets as one "
           "group)" if getattr(ddp, "_comm_hooks", None) else "")
    if why:
        log.warning("rank %d: DistributedDataParallel with %s does not heal: a replacement of "
                    "a dead rank cannot rejoin it", pg.node.rank, why)
        return None
    iterations = ddp_heal.Iterations(ddp.module, pg)
    ddp.register_comm_hook(iterations, ddp_heal.healing_hook)
    return iterations
