"""A torch program's state for healing a replacement process (see :mod:`aioreduce.heal`).

:func:`state_hooks` gives a node the ``state()`` / ``load_state(blob)`` pair for a model, its
optimizer and whatever else the program keeps (its position in the data, random generators):
``torch.save`` of their ``state_dict``\\ s into bytes on a live rank, ``torch.load`` (tensors
and plain values only) and ``load_state_dict`` on the replacement. Use it where the steps are
the program's iterations, one sum each (coded mini-batches, ``node.allreduce`` of a flat
gradient), or with :class:`~aioreduce.torch.DistributedOptimizer`, whose iteration of bucket
sums runs again as a whole with the replacement.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch

from ..heal import StateHooks


def state_hooks(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                extra: tuple[Callable[[], Any], Callable[[Any], None]] | None = None
                ) -> StateHooks:
    """Hooks that carry ``model``'s and ``optimizer``'s state dicts, and ``extra``: a pair
    (get, set) for anything else the program keeps between steps (plain values and tensors)."""

    def state() -> bytes:
        out = io.BytesIO()
        torch.save({"model": model.state_dict(),
                    "optimizer": optimizer.state_dict() if optimizer is not None else None,
                    "extra": extra[0]() if extra is not None else None}, out)
        return out.getvalue()

    def load_state(blob: memoryview) -> None:
        saved = torch.load(io.BytesIO(blob), weights_only=True)
        model.load_state_dict(saved["model"])
        if optimizer is not None:
            optimizer.load_state_dict(saved["optimizer"])
        if extra is not None:
            extra[1](saved["extra"])

    return StateHooks(state, load_state)
