"""Torch tensors in, torch tensors out: the conversions the node applies to tensor arguments.

A CPU tensor becomes a numpy array that shares its memory (``Tensor.numpy()`` on a detached,
contiguous tensor: no copy for the usual gradient), and a result comes back as a new tensor.
The result is a copy because a step's value may still be in flight to slower ranks (it is
read-only for that reason); a tensor the trainer can write into must not alias it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from ..schemes import Result

# dtypes numpy can hold without a conversion (bfloat16 and the float8 types have no numpy twin)
SUPPORTED = (torch.float64, torch.float32, torch.float16, torch.int64, torch.int32,
             torch.int16, torch.int8, torch.uint8)


@dataclass(frozen=True)
class TensorResult(Result):
    """A :class:`~aioreduce.Result` whose ``value`` is a torch tensor (a writable copy)."""

    value: torch.Tensor  # type: ignore[assignment]


def is_tensor(obj: object) -> bool:
    """Is ``obj`` a torch tensor (without importing torch where it is not one)."""
    return isinstance(obj, torch.Tensor)


def to_numpy(t: object, rank: int) -> np.ndarray:
    """The numpy view of a CPU tensor; a clear ``TypeError`` naming ``rank`` otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"rank {rank}: expected a torch tensor, not {type(t).__name__}")
    if t.device.type != "cpu":
        raise TypeError(f"rank {rank}: aioreduce moves CPU tensors; this one is on {t.device} "
                        "(call .cpu() first)")
    if t.dtype not in SUPPORTED:
        raise TypeError(f"rank {rank}: tensors of {t.dtype} have no numpy equivalent; convert "
                        "to float32 (or another of: "
                        f"{', '.join(str(d).removeprefix('torch.') for d in SUPPORTED)})")
    return t.detach().contiguous().numpy()


def tensor_result(res: Result, value: torch.Tensor | None = None) -> TensorResult:
    """``res`` with ``value``, by default its value as a new tensor (a writable copy)."""
    fields = {f.name: getattr(res, f.name) for f in dataclasses.fields(res)}
    fields["value"] = (torch.from_numpy(np.array(res.value, copy=True)) if value is None
                       else value)
    return TensorResult(**fields)
