"""Gradient coding on a star (``GradientCoding``) and the uncoded gather (``Star``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ..codes import GradientCode
from .base import Comm, OnInsufficient, StepOptions
from .reduce import Family, ReduceSession


@dataclass(frozen=True)
class GradientCoding:
    """Gradient coding with rank 0 as the master and ranks 1..n as the code's workers.

    The master decodes from the first sufficient set of workers (any ``n - s``; for
    fractional repetition, one per group). With a communication-efficient code (``code.m >
    1``, e.g. ``gaussian_mds``) workers send messages ``m`` times shorter: pass the *sum* of
    your parts' gradients to ``node.aggregate`` and the runtime encodes it.
    """

    code: GradientCode
    deadline: float = 30.0
    on_insufficient: OnInsufficient = "raise"
    # Pipelining chunks, and a message's chunks at most (None: by whether the job spans
    # hosts, see StepOptions.chunking).
    chunk_bytes: int | None = None
    max_chunks: int | None = None
    history_bytes: int = 256 << 20  # results the master keeps for workers that fell behind
    # Chunks over lanes to and from the parent and children (off the event loop; the comm
    # must offer bulk links, else the event loop's frames): see ReduceSession. None: for a
    # first vector of at least 1 MiB.
    lanes: bool | None = None
    coded: bool = field(default=True, init=False)

    @cached_property
    def options(self) -> StepOptions:
        return StepOptions(self.deadline, self.on_insufficient, self.chunk_bytes,
                           self.history_bytes, lanes=self.lanes, max_chunks=self.max_chunks)

    def validate(self, world_size: int) -> None:
        if world_size != self.code.n + 1:
            raise ValueError(f"{self.code.name} has {self.code.n} workers: the job needs "
                             f"{self.code.n + 1} ranks (rank 0 is the master), it has "
                             f"{world_size}")
        if self.code.m > 1 and self.code.groups is None and not _grouped(self.code):
            raise ValueError(f"{self.code.name}: the runtime encodes messages only for codes "
                             "where a worker uses one coefficient set for all its parts "
                             "(group_code, gaussian_mds)")

    @property
    def min_samples(self) -> int:
        """The smallest data-set size the placement fits (multiples fit too): one per part."""
        return self.code.k

    def placement(self, rank: int, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
        """Worker ``rank``'s samples and weights (the master computes nothing)."""
        if rank == 0:
            return np.zeros(0, np.int64), np.zeros(0)
        k = self.code.k
        if num_samples % k:
            raise ValueError(f"num_samples={num_samples} must be a multiple of the {k} parts")
        size = num_samples // k
        row = self.code.B[rank - 1].reshape(k, self.code.m)
        ids, weights = [], []
        for j in self.code.parts_of(rank - 1):
            ids.append(np.arange(j * size, (j + 1) * size))
            w = row[j, 0] if self.code.m == 1 else 1.0  # m > 1: coefficients applied later
            weights.append(np.full(size, w))
        return np.concatenate(ids), np.concatenate(weights)

    def encode(self, rank: int, vector: np.ndarray) -> np.ndarray:
        """The message a worker sends for its summed gradient (identity when m == 1)."""
        if self.code.m == 1 or rank == 0:
            return vector
        j = self.code.parts_of(rank - 1)[0]
        coef = self.code.B[rank - 1].reshape(self.code.k, self.code.m)[j]
        return self.code.encode_group(coef, vector)

    def neighbours(self, rank: int, world_size: int) -> list[int]:
        return list(range(1, world_size)) if rank == 0 else [0]

    def family(self, rank: int) -> Family:
        if rank == 0:
            return Family(None, list(range(1, self.code.n + 1)), self.code)
        return Family(0, [], None, parent_m=self.code.m, depth=1)

    def open(self, comm: Comm) -> ReduceSession:
        """A session; workers' vectors are encoded (``m > 1``) inside it."""
        encode = None
        if self.code.m > 1 and comm.rank != 0:
            encode = functools.partial(self.encode, comm.rank)
        return ReduceSession(comm, self.family(comm.rank), self.options, encode)


def _grouped(code: GradientCode) -> bool:
    """Does every worker apply one coefficient vector to all its parts?"""
    for i in range(code.n):
        row = code.B[i].reshape(code.k, code.m)
        held = row[code.parts_of(i)]
        if not np.allclose(held, held[0]):
            return False
    return True


@dataclass(frozen=True)
class Star:
    """Uncoded gather to rank 0 and broadcast back: the simplest baseline."""

    # Pipelining chunks, and a message's chunks at most (None: by whether the job spans
    # hosts, see StepOptions.chunking).
    chunk_bytes: int | None = None
    max_chunks: int | None = None
    deadline: float = 300.0
    history_bytes: int = 256 << 20
    # Chunks over lanes to and from the parent and children (off the event loop; the comm
    # must offer bulk links, else the event loop's frames): see ReduceSession. None: for a
    # first vector of at least 1 MiB.
    lanes: bool | None = None
    coded: bool = field(default=False, init=False)

    def validate(self, world_size: int) -> None:
        pass

    def neighbours(self, rank: int, world_size: int) -> list[int]:
        return list(range(1, world_size)) if rank == 0 else [0]

    def open(self, comm: Comm) -> ReduceSession:
        rank, world = comm.rank, comm.world_size
        fam = Family(None, list(range(1, world)), None) if rank == 0 else Family(0, [], None,
                                                                              depth=1)
        opts = StepOptions(self.deadline, "raise", self.chunk_bytes, self.history_bytes,
                           lanes=self.lanes, max_chunks=self.max_chunks)
        return ReduceSession(comm, fam, opts)
