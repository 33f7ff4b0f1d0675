"""PyTorch integration (needs the ``torch`` extra).

* :func:`connect`: a blocking node that meets its peers through torch's store (torchrun and
  aioreduce-launch set ``MASTER_ADDR``/``MASTER_PORT``; no job secret to distribute).
* Tensors in, tensors out: ``node.allreduce(tensor)`` / ``node.aggregate(tensor)`` return a
  :class:`TensorResult` (``op="mean"`` divides by the contributions used).
* ``import aioreduce.torch`` registers the ``torch.distributed`` backend ``"aioreduce"``
  (:mod:`.process_group`): ``dist.init_process_group(backend="aioreduce")``.
* :func:`DistributedDataParallel` (:mod:`.ddp`): torch's DDP with every gradient bucket summed
  by a node of ours (``register_hook`` for a DDP model built over our process group).
* :class:`DistributedOptimizer` (:mod:`.optimizer`): Horovod's pattern, reductions start as
  gradients become ready; ``should_commit`` skips an update that is not exact enough.
* :class:`CodedSampler` and :func:`weighted_loss` (:mod:`.coded`): coded mini-batches for
  ``CodedTree`` and ``GradientCoding``.
* :func:`state_hooks` (:mod:`.heal`): model and optimizer state for a replacement of a dead
  rank to heal from (``connect(..., state=...)``, or ``configure(state=...)`` before
  ``init_process_group``).
"""

from __future__ import annotations

from ..tensors import TensorResult, to_numpy
from .coded import CodedSampler, apply_flat, flat_grad, weighted_loss
from .ddp import DistributedDataParallel, aioreduce_hook, check_same_model
from .ddp import register as register_hook
from .heal import state_hooks
from .optimizer import DistributedOptimizer, min_received, require_exact
from .process_group import ProcessGroupAioreduce, configure, connect, register

register()

__all__ = [
    "CodedSampler",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "ProcessGroupAioreduce",
    "TensorResult",
    "aioreduce_hook",
    "apply_flat",
    "check_same_model",
    "configure",
    "connect",
    "flat_grad",
    "min_received",
    "register",
    "register_hook",
    "require_exact",
    "state_hooks",
    "to_numpy",
    "weighted_loss",
]
