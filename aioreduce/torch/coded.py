"""Coded mini-batches: gradient coding (``CodedTree``, ``GradientCoding``) with a DataLoader.

A coded scheme places weighted samples on ranks so that the sum any sufficient set of ranks
delivers decodes to the exact sum over the data set. For mini-batches the data set of a step
is the step's global batch: every rank derives the same permutation from ``seed + epoch`` (as
``DistributedSampler`` does after ``set_epoch``), takes the step's global batch from it, and
computes on its own positions of the code's placement of that batch, with their weights::

    sampler = CodedSampler(len(dataset), batch_size=128, node=node, seed=0)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for idx, w in sampler:                       # this rank's samples, their weights
            x, y = data[idx], target[idx]
            model.zero_grad()
            weighted_loss(F.cross_entropy, model(x), y, w).backward()
            res = node.aggregate(flat_grad(model))   # the exact mean gradient of the batch

Any data-set size works: a global batch whose size the code's placement does not fit is
placed as if it were padded up to the next size that fits (``scheme.min_samples``) and the
padding positions are dropped (their gradient would be zero), so the last partial batch is
handled and nothing asks the user for multiples of 15. The weights are divided by the batch's
size, so the decoded sum is the gradient of the batch's *mean* loss.

What breaks linearity (the decoded sum is then not the batch gradient): layers whose output
depends on the other samples of a batch (``BatchNorm`` in training mode: use ``GroupNorm`` or
``LayerNorm``) and randomness that differs between the ranks that compute one sample
(``Dropout``: seed it per sample, or leave it out).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

import numpy as np
import torch

from ..schemes import CodedScheme
from .grads import flatten_grads, write_grads


class CodedSampler:
    """Per step of an epoch: (this rank's sample indices, their weights as a float32 tensor).

    ``drop_last=True`` drops the last partial global batch; by default it is used. The global
    batch of the step just yielded is :attr:`batch` (the same on every rank).
    """

    def __init__(self, num_samples: int, batch_size: int, *, scheme: CodedScheme | None = None,
                 rank: int | None = None, node: Any = None, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False) -> None:
        if node is not None:  # a Node or a SyncNode
            inner = getattr(node, "node", node)
            scheme = scheme or inner.scheme
            rank = node.rank if rank is None else rank
        if scheme is None or rank is None or not getattr(scheme, "coded", False):
            raise ValueError("CodedSampler needs a coded scheme (CodedTree, GradientCoding) "
                             "and a rank, or a node that has one")
        if num_samples < 1 or batch_size < 1:
            raise ValueError(f"rank {rank}: num_samples and batch_size must be positive")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.scheme, self.rank = scheme, rank
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0
        self.batch = np.zeros(0, np.int64)
        self._placement = cache(self._place)

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration use epoch ``epoch``'s permutation (call on every rank)."""
        self.epoch = epoch

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _place(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's (positions, weights) in a global batch of ``size`` samples."""
        unit = self.scheme.min_samples
        padded = -(-size // unit) * unit
        ids, w = self.scheme.placement(self.rank, padded)
        keep = ids < size  # padding positions carry no sample: their gradient is zero
        return ids[keep], w[keep] / size

    def __iter__(self) -> Iterator[tuple[np.ndarray, torch.Tensor]]:
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            self.batch = order[start:start + self.batch_size]
            pos, w = self._placement(len(self.batch))
            yield self.batch[pos], torch.from_numpy(w.astype(np.float32))


def weighted_loss(loss_fn: Callable[..., torch.Tensor], output: torch.Tensor,
                  target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum(weights * loss_fn(output, target, reduction="none"))``: one backward of it gives
    this rank's coded gradient (``loss_fn`` must take ``reduction``, as torch's losses do)."""
    per_sample = loss_fn(output, target, reduction="none")
    return (per_sample * weights.to(per_sample.dtype)).sum()


def flat_grad(module: torch.nn.Module) -> torch.Tensor:
    """The module's gradients as one flat tensor (zeros where a parameter has none)."""
    return flatten_grads(module.parameters())


def apply_flat(module: torch.nn.Module, flat: torch.Tensor | np.ndarray) -> None:
    """Write a flat gradient (as :func:`flat_grad` lays it out) into the parameters' ``.grad``
    (a numpy result is read, not kept)."""
    write_grads(module.parameters(), flat)
