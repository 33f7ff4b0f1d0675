"""Torch tensors in, torch tensors out: the conversions between tensors and numpy arrays.

Two uses:

* The process group moves tensors *on the wire in their own width*: :func:`wire_dtype` is the
  numpy dtype a tensor's bytes travel as (bfloat16, which numpy lacks, travels as its 16 bits
  in a ``uint16`` array), and :func:`widen` / :func:`narrow` give 16-bit floats a float32
  accumulator, rounded back once.
* The node's own calls (``node.allreduce(tensor)``): :func:`to_numpy` is the numpy view of a
  CPU tensor (no copy for the usual gradient) or, for a tensor numpy cannot view (on a GPU, or
  bfloat16), a CPU copy the scheme sums (bfloat16 as float32); :func:`tensor_result` gives the
  result back as a tensor on the input's device and in its dtype. The result is a copy because
  a step's value may still be in flight to slower ranks (it is read-only for that reason).

It imports torch, so the node imports it only when it is handed a tensor. It lives beside the
node rather than in :mod:`aioreduce.torch`: importing that package registers the backend and
imports the process group, which imports the node (an import cycle).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .schemes import Result

# dtypes numpy holds as they are; bfloat16 travels as its bits (float8 types are refused)
_NUMPY: dict[torch.dtype, np.dtype[Any]] = {
    torch.float64: np.dtype(np.float64), torch.float32: np.dtype(np.float32),
    torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(np.uint16),
    torch.int64: np.dtype(np.int64), torch.int32: np.dtype(np.int32),
    torch.int16: np.dtype(np.int16), torch.int8: np.dtype(np.int8),
    torch.uint8: np.dtype(np.uint8), torch.bool: np.dtype(np.bool_)}
SUPPORTED = tuple(_NUMPY)


@dataclass(frozen=True)
class TensorResult(Result):
    """A :class:`~aioreduce.Result` whose ``value`` is a torch tensor (a writable copy)."""

    value: torch.Tensor  # type: ignore[assignment]


def is_tensor(obj: object) -> bool:
    """Is ``obj`` a torch tensor (without importing torch where it is not one)."""
    return isinstance(obj, torch.Tensor)


def check_tensor(t: object, rank: int) -> torch.Tensor:
    """``t`` if it is a tensor of a dtype we carry; else a clear ``TypeError`` naming ``rank``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"rank {rank}: expected a torch tensor, not {type(t).__name__}")
    if t.dtype not in _NUMPY:
        raise TypeError(f"rank {rank}: tensors of {t.dtype} cannot be sent; convert to one "
                        f"of: {', '.join(str(d).removeprefix('torch.') for d in SUPPORTED)}")
    return t


def wire_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    """The numpy dtype a tensor of ``dtype`` travels as (its own bytes, its own width)."""
    return _NUMPY[dtype]


def wire_view(t: torch.Tensor) -> np.ndarray:
    """The numpy view of a contiguous CPU tensor's bytes, in its wire dtype (no copy)."""
    if t.dtype == torch.bfloat16:
        return t.detach().view(torch.int16).numpy().view(np.uint16)
    return t.detach().numpy()


def widen(wire: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """The values of ``wire`` (a tensor of ``dtype`` as its wire dtype) in the dtype they are
    reduced in: float32 for 16-bit floats (bfloat16's bits are the top half of a float32's,
    so that widening is exact), else themselves."""
    if dtype == torch.bfloat16:
        return (wire.astype(np.uint32) << 16).view(np.float32)
    if dtype == torch.float16:
        return wire.astype(np.float32)
    return wire


def narrow(acc: np.ndarray, dtype: torch.dtype, out: np.ndarray) -> None:
    """Write ``acc`` (reduced as :func:`widen` gave it) into ``out`` (wire dtype), rounding
    to nearest even once, as torch casts."""
    if dtype == torch.bfloat16:
        rounded = torch.from_numpy(np.ascontiguousarray(acc)).to(torch.bfloat16)
        np.copyto(out, rounded.view(torch.int16).numpy().view(np.uint16))
    else:
        np.copyto(out, acc, casting="unsafe")


def to_numpy(t: object, rank: int) -> np.ndarray:
    """For the node's own calls: the numpy view of a CPU tensor numpy can hold, or a CPU copy
    of any other (a GPU tensor; bfloat16 as float32, so the scheme sums it exactly)."""
    t = check_tensor(t, rank)
    if t.dtype == torch.bfloat16:
        return t.detach().to("cpu", torch.float32).numpy()
    if t.device.type != "cpu":
        return t.detach().cpu().numpy()
    return t.detach().contiguous().numpy()


def write_back(target: torch.Tensor, array: np.ndarray) -> None:
    """Put ``array`` (from :func:`to_numpy` of ``target``) into ``target`` unless it is
    ``target``'s own memory."""
    if target.device.type == "cpu" and target.dtype != torch.bfloat16 and \
            np.shares_memory(array, target.detach().numpy()):
        return
    with torch.no_grad():
        target.copy_(torch.from_numpy(array).view(target.shape))


def tensor_result(res: Result, value: torch.Tensor | None = None,
                  like: tuple[torch.device, torch.dtype] | None = None) -> TensorResult:
    """``res`` with ``value``, by default its value as a new tensor (a writable copy), on
    ``like``'s device and in its dtype when given."""
    fields = {f.name: getattr(res, f.name) for f in dataclasses.fields(res)}
    if value is None:
        value = torch.from_numpy(np.array(res.value, copy=True))
        if like is not None:
            value = value.to(device=like[0], dtype=like[1])
    fields["value"] = value
    return TensorResult(**fields)


def describe(t: Any) -> tuple[torch.device, torch.dtype]:
    """What :func:`tensor_result` needs to give a result back like ``t`` (a tensor)."""
    return t.device, t.dtype
