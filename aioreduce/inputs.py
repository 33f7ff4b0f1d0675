"""What a caller hands the node, as numpy arrays, and its result back in the caller's kind.

A numpy array, a CPU or GPU torch tensor, or a function returning either. Tensors are
recognised without importing torch (by the module of their type), so ``import aioreduce``
never imports it; their conversions live in :mod:`aioreduce.tensors`, imported only when a
tensor comes by.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, TypeAlias

import numpy as np

from .schemes import Result

ReduceOp = Literal["sum", "mean"]
# A numpy array, a CPU torch tensor, or a function returning either (typed loosely so that
# importing aioreduce never imports torch).
Reducible: TypeAlias = "np.ndarray | Callable[[], np.ndarray] | Any"


def is_tensor(obj: object) -> bool:
    """A torch tensor? Decided without importing torch unless the object comes from it."""
    if not type(obj).__module__.startswith("torch"):
        return False
    from .tensors import is_tensor as torch_is_tensor
    return torch_is_tensor(obj)


def describe(obj: object) -> str:
    """What a caller passed, for an error message."""
    if isinstance(obj, np.ndarray):
        flags = [] if obj.flags.writeable else ["read-only"]
        flags += [] if obj.flags.c_contiguous else ["non-contiguous"]
        return " ".join([*flags, f"{obj.dtype} array"])
    return type(obj).__name__


def nbytes(obj: Any) -> int:
    """Bytes of an array or tensor."""
    if is_tensor(obj):
        return int(obj.element_size() * obj.nelement())
    return int(np.asarray(obj).nbytes)


class Inputs:
    """One node's conversions; remembers whether its compute functions return tensors, so a
    step whose compute is skipped (known already) returns a tensor all the same."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._tensor_out: Any = None  # (device, dtype) of what the compute function returns

    def check_op(self, op: str) -> None:
        """A clear error for a reduction this runtime's steps do not do."""
        if op not in ("sum", "mean"):
            raise ValueError(f"rank {self.rank}: op must be 'sum' or 'mean', not {op!r} (min, "
                             "max and product: gather with Node.allgather)")

    def numpy(self, vector: Any) -> tuple[np.ndarray | Callable[[], np.ndarray], Any]:
        """``vector`` as an array or a function returning one, and, for a tensor, what a
        result like it needs (else None)."""
        if is_tensor(vector):
            from .tensors import describe as like_of
            from .tensors import to_numpy
            return to_numpy(vector, self.rank), like_of(vector)
        if callable(vector):
            return self._numpy_compute(vector), None
        return vector, None

    def result(self, res: Result, like: Any, was_callable: bool) -> Result:
        """``res`` as the caller's kind: a tensor result for a tensor argument, or for a
        compute function that returned tensors."""
        if like is None and was_callable:
            like = self._tensor_out
        if like is None:
            return res
        from .tensors import tensor_result
        return tensor_result(res, like=like)

    def in_place(self, array: Any) -> np.ndarray:
        """The array ``allreduce(in_place=True)`` sums into: ``array`` itself, or for a
        tensor its numpy view (a copy where numpy cannot view it: GPU, bfloat16)."""
        if is_tensor(array):
            from .tensors import to_numpy
            if not array.is_contiguous():
                raise ValueError(f"rank {self.rank}: in_place=True needs a contiguous tensor "
                                 "(call .contiguous() and reduce that)")
            array = to_numpy(array, self.rank)
        if not isinstance(array, np.ndarray) or array.dtype.kind not in "fc" or not (
                array.flags.c_contiguous and array.flags.writeable):
            raise TypeError(f"rank {self.rank}: in_place=True needs a writable C-contiguous "
                            "floating-point array or CPU tensor, not "
                            f"{describe(array)}")
        return array

    def in_place_result(self, target: Any, array: np.ndarray, res: Result) -> Result:
        """The result of an in-place step whose sum is in ``array``: written back to the
        tensor ``target`` (its value then), or ``array`` itself."""
        if target is not array:
            from .tensors import tensor_result, write_back
            write_back(target, array)
            return tensor_result(res, value=target)
        return dataclasses.replace(res, value=array)

    def _numpy_compute(self, compute: Callable[[], object]) -> Callable[[], np.ndarray]:
        def run() -> np.ndarray:
            out = compute()
            if is_tensor(out):
                from .tensors import describe as like_of
                from .tensors import to_numpy
                self._tensor_out = like_of(out)
                return to_numpy(out, self.rank)
            return out  # type: ignore[return-value]  # checked by the stepper
        return run
