"""PyTorch integration (needs the ``torch`` extra).

* Tensors in, tensors out: ``node.allreduce(tensor)`` / ``node.aggregate(tensor)`` return a
  :class:`TensorResult` (``op="mean"`` divides by the contributions used).
* ``import aioreduce.torch`` registers the ``torch.distributed`` backend ``"aioreduce"``
  (:mod:`.process_group`): ``dist.init_process_group(backend="aioreduce")``.
* :func:`DistributedDataParallel` (:mod:`.ddp`): torch's DDP with every gradient bucket summed
  by a node of ours (``register_hook`` for a DDP model built over our process group).
* :class:`CodedSampler` and :func:`weighted_loss` (:mod:`.coded`): coded mini-batches for
  ``CodedTree`` and ``GradientCoding``.
"""

from __future__ import annotations

from .coded import CodedSampler, apply_flat, flat_grad, weighted_loss
from .ddp import DistributedDataParallel, aioreduce_hook, check_same_model
from .ddp import register as register_hook
from .process_group import ProcessGroupAioreduce, configure, register
from .tensors import TensorResult, to_numpy

register()

__all__ = [
           "CodedSampler",
           "DistributedDataParallel",
           "ProcessGroupAioreduce",
           "TensorResult",
           "aioreduce_hook",
           "apply_flat",
           "check_same_model",
           "configure",
           "flat_grad",
           "register",
           "register_hook",
           "to_numpy",
           "weighted_loss",
]
