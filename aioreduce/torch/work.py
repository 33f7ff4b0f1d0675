"""The ``Work`` our process groups hand torch: one that completes with a torch future and
raises its error from ``wait()``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class FutureWork(dist.Work):
    """A ``Work`` that completes with ``fut`` (what ``async_op=True`` hands the caller, and
    what a blocking call waits on).

    Not torch's ``_create_work_from_future``: its ``wait()`` returns True when the future
    failed, so a blocking ``dist.all_reduce`` whose step failed (a lost peer, a vector of
    another size) returned as if it had summed. Here ``wait()`` raises the step's error, as
    Gloo's does; on a device future it also orders the caller's current stream after it."""

    def __init__(self, fut: torch.futures.Future[Any], source: list[int] | None = None) -> None:
        super().__init__()
        self._fut = fut
        self._source = source  # a receive from any source: the rank it came from, once done

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._fut.wait()  # raises the step's error
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._fut

    def result(self) -> list[torch.Tensor]:
        """The tensors the call completed with (raises its error, as :meth:`wait`)."""
        value = self._fut.wait()
        if isinstance(value, torch.Tensor):
            return [value]
        if isinstance(value, list | tuple):
            return [v for v in value if isinstance(v, torch.Tensor)]
        return []

    def is_completed(self) -> bool:
        return self._fut.done()

    def _source_rank(self) -> int:
        """The rank a receive from any source came from (torch's ``recv`` returns it)."""
        self._fut.wait()
        if not self._source:
            raise RuntimeError("not a receive from any source")
        return self._source[0]

    source_rank = _source_rank

    def is_success(self) -> bool:
        return self._fut.done() and self.exception() is None

    def exception(self) -> BaseException | None:
        if not self._fut.done():
            return None
        try:
            self._fut.value()
        except Exception as exc:
            return exc
        return None


def as_work(fut: torch.futures.Future[Any]) -> dist.Work:
    """A ``Work`` that completes with ``fut`` (see :class:`FutureWork`)."""
    return FutureWork(fut)


def completed(value: Any) -> dist.Work:
    """A ``Work`` already complete with ``value`` (a collective that stays on this rank)."""
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(value)
    return as_work(fut)
