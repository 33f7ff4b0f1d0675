"""PyTorch integration (needs the ``torch`` extra).

* Tensors in, tensors out: ``node.allreduce(tensor)`` / ``node.aggregate(tensor)`` return a
  :class:`TensorResult` (``op="mean"`` divides by the contributions used).
* ``import aioreduce.torch`` registers the ``torch.distributed`` backend ``"aioreduce"``
  (:mod:`.process_group`): ``dist.init_process_group(backend="aioreduce")``.
* :func:`DistributedDataParallel` (:mod:`.ddp`): torch's DDP with every gradient bucket summed
  by a node of ours (``register_hook`` for a DDP model built over our process group).
"""

from __future__ import annotations

from .ddp import DistributedDataParallel, aioreduce_hook, check_same_model
from .ddp import register as register_hook
from .process_group import ProcessGroupAioreduce, configure, register
from .tensors import TensorResult, to_numpy

register()

__all__ = ["DistributedDataParallel", "ProcessGroupAioreduce", "TensorResult", "aioreduce_hook",
           "check_same_model", "configure", "register", "register_hook", "to_numpy"]
