"""Horovod's pattern: an optimizer whose gradients are summed while the backward pass runs.

    opt = aioreduce.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), 0.1), node)
    loss.backward()          # buckets start their allreduce as their gradients become ready
    opt.step()               # waits for them, writes the means into .grad, then steps

Gradients are grouped into buckets (``bucket_bytes``, in reverse registration order, the order
a backward pass produces them). A parameter's ``register_post_accumulate_grad_hook`` marks it
ready; a bucket whose parameters are all ready is handed to the node, in bucket order only, so
every rank issues the same collectives in the same order whatever order its hooks fire in.

* ``synchronize()`` waits for every bucket (parameters that got no gradient count as zeros);
  ``with opt.skip_synchronize(): opt.step()`` after an explicit ``synchronize()`` (gradient
  clipping in between).
* ``backward_passes_per_step=k``: gradients accumulate over k backward passes, then are summed.
* ``should_commit(results) -> bool``: the update is skipped when it returns False (a user
  policy on ``Result.exact``, ``error_bound``, ``received``...; see :func:`require_exact`);
  :attr:`committed` says what the last ``step`` did.
* Coded schemes (``CodedTree``, ``GradientCoding``): one ``aggregate`` of all gradients at
  ``synchronize`` (a coded step covers the whole gradient).
* ``node``: a blocking node, a process group of ours, or by default the one
  ``init_process_group(backend="aioreduce")`` made.
* Heal (a node with ``state=state_hooks(model, optimizer, ...)``, or ``configure(state=...)``
  before ``init_process_group``, and ``rejoin_wait``, as under ``aioreduce-launch
  --restart``): an iteration's buckets are one group of steps. If a
  rank dies during it, ``synchronize`` waits for its replacement, which heals the parameters
  and optimizer of the iteration's start from a live rank, and every bucket runs again with
  it from the gradients still in ``.grad`` (see :mod:`aioreduce.heal`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..inputs import ReduceOp
from ..schemes import Result
from ..sync import SyncNode
from ..tensors import to_numpy
from .grads import flatten_grads, write_grads
from .process_group import ProcessGroupAioreduce, group_of

CommitPolicy = Callable[[list[Result]], bool]


def require_exact(results: list[Result]) -> bool:
    """Commit only exact aggregates (every bucket's ``Result.exact``)."""
    return all(r.exact for r in results)


def min_received(fraction: float) -> CommitPolicy:
    """Commit when every bucket holds at least ``fraction`` of all contributions."""
    return lambda results: all(r.received >= fraction for r in results)


class DistributedOptimizer:
    """Wraps ``optimizer`` so that ``step`` applies the mean (or sum) of every rank's gradient."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 node: SyncNode | ProcessGroupAioreduce | None = None, *,
                 op: ReduceOp = "mean", backward_passes_per_step: int = 1,
                 should_commit: CommitPolicy | None = None,
                 bucket_bytes: int = 25 << 20) -> None:
        pg = group_of(node)
        node = pg.node
        if op not in ("sum", "mean"):
            raise ValueError(f"rank {node.rank}: op must be 'sum' or 'mean', not {op!r}")
        if backward_passes_per_step < 1:
            raise ValueError(f"rank {node.rank}: backward_passes_per_step must be >= 1")
        self.optimizer = optimizer
        self.node = node
        self.op = op
        self.passes = backward_passes_per_step
        self.should_commit = should_commit
        self.committed = True
        self.results: list[Result] = []  # of the last synchronize, one per bucket
        self._step_results: list[Result] = []  # filled as this step's buckets complete
        self.coded = bool(getattr(node.node.scheme, "coded", False))
        self._pg = pg
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self._buckets = _buckets(list(reversed(params)), bucket_bytes)
        self._bucket_of = {id(p): i for i, b in enumerate(self._buckets) for p in b}
        self._counts: dict[int, int] = {}
        self._ready: list[int] = [0] * len(self._buckets)
        # The buckets launched this step, in bucket order (their count is the next to launch).
        self._pending: list[tuple[list[torch.Tensor], torch.Tensor,
                                  torch.futures.Future[Any]]] = []
        self._skip = False
        if not self.coded:
            for p in params:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    # -- the optimizer's face ------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pending:
            raise RuntimeError(f"rank {self.node.rank}: zero_grad() while gradient reductions "
                               "are in flight; call step() or synchronize() first")
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Synchronize (unless inside :meth:`skip_synchronize`), then step the wrapped
        optimizer if ``should_commit`` allows it."""
        if not self._skip:
            self.synchronize()
        self.committed = self.should_commit is None or self.should_commit(self.results)
        if not self.committed:
            return None
        return self.optimizer.step(closure)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside does not synchronize (call :meth:`synchronize` before it)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    # -- reductions ----------------------------------------------------------------------------
    def _grad_ready(self, p: torch.Tensor) -> None:
        key = id(p)
        self._counts[key] = self._counts.get(key, 0) + 1
        if self._counts[key] == self.passes:
            self._ready[self._bucket_of[key]] += 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Start the buckets that are complete, in bucket order only."""
        while ((i := len(self._pending)) < len(self._buckets)
               and self._ready[i] == len(self._buckets[i])):
            self._launch(i)

    def _launch(self, i: int) -> None:
        params = self._buckets[i]
        flat = flatten_grads(params)
        # An iteration's buckets are one group: if a rank dies, they all run again with its
        # replacement (see synchronize).
        fut = self._pg.future_sum(flat, average=self.op == "mean",
                                  on_result=self._step_results.append, rerun=False,
                                  last=i == len(self._buckets) - 1)
        self._pending.append((params, flat, fut))

    def synchronize(self) -> None:
        """Wait for every bucket's sum and write it into the parameters' ``.grad``."""
        if self.coded:
            params = [p for b in self._buckets for p in b]
            res = self.node.aggregate(to_numpy(flatten_grads(params), self.node.rank),
                                      op=self.op)
            write_grads(params, res.value)
            self.results = [res]
            return
        for _attempt in range(self.node.world_size):
            for i in range(len(self._buckets)):  # parameters without a gradient: ready
                self._ready[i] = len(self._buckets[i])
            self._launch_ready()
            pending, self._pending = self._pending, []
            failure: BaseException | None = None
            for _params, _flat, fut in pending:
                try:
                    fut.wait()
                except Exception as exc:  # the others still complete before a rerun
                    failure = failure or exc
            if failure is None:
                break
            self._step_results = []
            # A rank died: with rejoin_wait, its replacement heals from us (the parameters
            # and optimizer of this iteration's start: nothing written yet) and every bucket
            # runs again with it, from the gradients still in .grad.
            if not self.node.replace_lost():
                self._reset()
                raise failure
        else:  # a replacement died too, as often as there are ranks
            self._reset()
            assert failure is not None
            raise failure
        for params, flat, _fut in pending:
            write_grads(params, flat)
        # Every bucket's result, in bucket order (the futures completed in issue order).
        self.results, self._step_results = self._step_results, []
        self._reset()

    def _reset(self) -> None:
        self._counts.clear()
        self._ready = [0] * len(self._buckets)


def _buckets(params: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive parameters of one dtype, up to ``limit`` bytes a bucket."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not out or size + nbytes > limit or out[-1][0].dtype != p.dtype:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out
