"""PyTorch integration (needs the ``torch`` extra).

* Tensors in, tensors out: ``node.allreduce(tensor)`` / ``node.aggregate(tensor)`` return a
  :class:`TensorResult` (``op="mean"`` divides by the contributions used).
* ``import aioreduce.torch`` registers the ``torch.distributed`` backend ``"aioreduce"``
  (:mod:`.process_group`): ``dist.init_process_group(backend="aioreduce")``.
"""

from __future__ import annotations

from .process_group import ProcessGroupAioreduce, configure, register
from .tensors import TensorResult, to_numpy

register()

__all__ = ["ProcessGroupAioreduce", "TensorResult", "configure", "register", "to_numpy"]
