"""The gradient-code type and its decoder (pure numpy, float64).

A code for ``n`` workers and ``k`` data parts, with message reduction ``m`` (1 for classic
gradient coding), is an encoding matrix ``B`` of shape ``(n, k*m)``: worker ``i`` sends

    f_i = sum_{j,u} B[i, j*m + u] * g_j^(u)        (a vector of length ceil(l/m))

where ``g_j^(u)`` is chunk ``u`` of part ``j``'s gradient (``l`` entries split into ``m``
contiguous chunks). With ``m == 1`` this is Tandon et al.'s ``f_i = sum_j B[i, j] g_j``.

Decoding from responders ``F`` finds ``A`` (``m x n``, zero outside ``F``) with
``A @ B = J``, where ``J = [I_m I_m ... I_m]`` (``k`` blocks); chunk ``v`` of the full gradient
is then ``sum_i A[v, i] f_i``. For ``m == 1`` that is the familiar ``a^T B = 1``. The decoder:

* solves in float64 by least squares, which returns the *minimum-norm* coefficients when more
  responders than necessary have arrived (lower error amplification);
* checks the residual ``max |A B_F - J|`` and raises :class:`NotDecodable` above ``tol``: it is
  never silently wrong;
* caches per responder set (patterns repeat step after step);
* takes a fast path for fractional repetition: one responder per group, coefficients 0/1, no
  solve, often before ``n - s`` have arrived;
* offers :meth:`GradientCode.approximate`: the least-squares optimal coefficients for an
  insufficient set and the residual that bounds their error.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

DECODE_TOL = 1e-8
FP32_BUDGET = 1e3
"""Largest worst-case error amplification (max ||a||_1 * max_i ||B_i||_1) we accept for fp32
gradients: fp32 carries about 7 significant digits, so this keeps about 4."""

_CACHE_SIZE = 4096
_EXHAUSTIVE_LIMIT = 3000  # straggler patterns checked one by one below this count


class NotDecodable(Exception):
    """The responders do not determine the full gradient (too many stragglers in a family)."""

    def __init__(self, responders: Iterable[int], n: int, residual: float) -> None:
        self.responders = sorted(set(responders))
        self.missing = [i for i in range(n) if i not in set(self.responders)]
        self.residual = residual
        super().__init__(f"workers {self.responders} cannot decode (missing {self.missing}, "
                         f"residual {residual:.2e})")


class StabilityWarning(UserWarning):
    """A code's worst-case error amplification exceeds the fp32 budget."""


@dataclass(frozen=True)
class Approximation:
    """Least-squares coefficients for a responder set, and how far they are from exact.

    ``coefficients`` has the decoder's shape; ``residual`` is ``A B - J`` (``m x k*m``). The
    decoded vector differs from the true sum by ``sum_c residual[v, c] * g_c`` per chunk ``v``,
    so its error is at most ``error_factor * sqrt(sum_j ||g_j||^2)``.
    """

    coefficients: np.ndarray
    residual: np.ndarray
    exact: bool

    @property
    def error_factor(self) -> float:
        """Frobenius norm of the residual: the relative error bound for equal-norm parts."""
        return float(np.linalg.norm(self.residual))

    def bound(self, part_norms: np.ndarray) -> float:
        """Upper bound on ||decoded - true||_2 given each part's gradient norm (length k)."""
        norms = np.asarray(part_norms, dtype=np.float64)
        m = self.residual.shape[0]
        per_col = np.repeat(norms, m)  # a chunk's norm is at most its part's norm
        cauchy = self.error_factor * float(np.linalg.norm(norms))
        triangle = float(np.sum(np.abs(self.residual) * per_col))
        return min(cauchy, triangle)


@dataclass(frozen=True)
class Stability:
    """Worst case over straggler patterns of exactly ``s`` missing workers."""

    max_coefficient: float  # max |a_i|
    max_abs_sum: float  # max ||a||_1
    max_condition: float  # max effective cond(B_F): ratio of extreme non-zero singular values
    amplification: float  # max ||a||_1 * max_i ||B_i||_1
    patterns: int
    exhaustive: bool


@dataclass(frozen=True, eq=False)
class GradientCode:
    """A linear gradient code: ``n`` workers, tolerance ``s``, message reduction ``m``.

    Build one with :func:`frc`, :func:`cyclic_mds`, :func:`random_cyclic`,
    :func:`gaussian_mds`, :func:`polynomial_code`, :func:`group_code` or :meth:`from_matrix`.
    """

    name: str
    n: int
    s: int
    B: np.ndarray
    m: int = 1
    groups: tuple[tuple[int, ...], ...] | None = None  # fractional repetition: 0/1 fast path
    tol: float = DECODE_TOL
    _cache: dict[frozenset[int], tuple[np.ndarray, float]] = field(
        default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        B = np.asarray(self.B, dtype=np.float64)
        object.__setattr__(self, "B", B)
        B.setflags(write=False)
        if B.ndim != 2 or B.shape[0] != self.n or B.shape[1] % self.m:
            raise ValueError(f"B must be n x (k*m) = {self.n} x (k*{self.m}), got {B.shape}")
        if not 0 <= self.s < self.n:
            raise ValueError(f"tolerance s={self.s} must be in 0..n-1 (n={self.n})")

    def __repr__(self) -> str:
        return f"<GradientCode {self.name}>"

    # -- shape --------------------------------------------------------------------------------
    @property
    def k(self) -> int:
        """Number of data parts."""
        return int(self.B.shape[1]) // self.m

    def parts_of(self, worker: int) -> list[int]:
        """The data parts worker ``worker`` must compute on (its computation load)."""
        row = self.B[worker].reshape(self.k, self.m)
        return [int(j) for j in np.flatnonzero(np.any(row != 0, axis=1))]

    def message_length(self, length: int) -> int:
        """Entries in one worker's message for a gradient of ``length`` entries."""
        return math.ceil(length / self.m)

    # -- encoding and decoding of actual vectors (tests, flat GC, reference runs) -------------
    def encode(self, worker: int, parts: np.ndarray) -> np.ndarray:
        """Worker ``worker``'s message from all part gradients ``parts`` (k x l)."""
        chunks = self._chunks(np.asarray(parts, dtype=np.float64))  # (k, m, L)
        coef = self.B[worker].reshape(self.k, self.m)
        out: np.ndarray = np.einsum("ju,jul->l", coef, chunks)
        return out

    def decode(self, messages: Mapping[int, np.ndarray], length: int) -> np.ndarray:
        """The full gradient (length ``length``) from the messages of some responders."""
        A = np.atleast_2d(self.decoder(list(messages)))
        L = self.message_length(length)
        out = np.zeros((self.m, L))
        for i, f in messages.items():
            out += np.outer(A[:, i], f)
        return out.reshape(-1)[:length]

    def encode_group(self, coef: np.ndarray, vector: np.ndarray) -> np.ndarray:
        """``sum_u coef[u] * chunk_u(vector)``: the message of a worker whose parts all share
        the chunk coefficients ``coef`` (group codes), from the sum of its parts' gradients."""
        length = vector.shape[0]
        L = self.message_length(length)
        padded = np.zeros(self.m * L, dtype=vector.dtype)
        padded[:length] = vector
        out: np.ndarray = np.asarray(coef, dtype=vector.dtype) @ padded.reshape(self.m, L)
        return out

    def _chunks(self, parts: np.ndarray) -> np.ndarray:
        k, length = parts.shape
        L = self.message_length(length)
        padded = np.zeros((k, self.m * L))
        padded[:, :length] = parts
        return padded.reshape(k, self.m, L)

    # -- coefficients ---------------------------------------------------------------------------
    def decoder(self, responders: Iterable[int]) -> np.ndarray:
        """Decoding coefficients for ``responders`` (in arrival order).

        Returns shape ``(n,)`` when ``m == 1``, else ``(m, n)``; zero outside ``responders``.
        Raises :class:`NotDecodable` if they do not determine the sum.
        """
        order = [int(i) for i in responders]
        self._check_workers(order)
        if self.groups is not None:
            return self._frc_decoder(order)
        pattern = frozenset(order)
        A, residual = self._solve(pattern)
        if residual > self.tol:
            raise NotDecodable(order, self.n, residual)
        if pattern not in self._amplification_checked:  # (once a pattern: every step asks)
            self._check_amplification(A, order)
            self._amplification_checked.add(pattern)
        return A[0].copy() if self.m == 1 else A.copy()

    def is_sufficient(self, responders: Iterable[int]) -> bool:
        """Can ``responders`` decode? The runtime asks this after each arrival."""
        order = [int(i) for i in responders]
        if self.groups is not None:
            have = set(order)
            return all(have.intersection(g) for g in self.groups)
        if len(set(order)) < self._min_responders:
            return False
        return self._solve(frozenset(order))[1] <= self.tol

    def approximate(self, responders: Iterable[int]) -> Approximation:
        """Least-squares optimal coefficients for any responder set, exact or not."""
        F = frozenset(int(i) for i in responders)
        self._check_workers(F)
        A, residual = self._solve(F)
        R = A @ self.B - self._target
        coef = A[0].copy() if self.m == 1 else A.copy()
        return Approximation(coef, R, residual <= self.tol)

    @functools.cached_property
    def _target(self) -> np.ndarray:
        return np.tile(np.eye(self.m), (1, self.k))

    @functools.cached_property
    def _min_responders(self) -> int:
        # Fewer rows than the target's rank can never reach it.
        return int(np.linalg.matrix_rank(self._target))

    def _solve(self, F: frozenset[int]) -> tuple[np.ndarray, float]:
        hit = self._cache.get(F)
        if hit is not None:
            return hit
        idx = sorted(F)
        A = np.zeros((self.m, self.n))
        if idx:
            BF = self.B[idx]
            X, *_ = np.linalg.lstsq(BF.T, self._target.T, rcond=None)  # min-norm LS
            A[:, idx] = X.T
        residual = float(np.max(np.abs(A @ self.B - self._target)))
        if len(self._cache) >= _CACHE_SIZE:
            self._cache.pop(next(iter(self._cache)))
        self._cache[F] = (A, residual)
        return A, residual

    def _frc_decoder(self, order: list[int]) -> np.ndarray:
        assert self.groups is not None
        a = np.zeros(self.n)
        seen = set(order)
        for group in self.groups:
            first = next((i for i in order if i in group), None)
            if first is None:
                raise NotDecodable(seen, self.n, 1.0)
            a[first] = 1.0
        return a

    def _check_workers(self, workers: Iterable[int]) -> None:
        bad = [i for i in workers if not 0 <= i < self.n]
        if bad:
            raise ValueError(f"worker indices {bad} outside 0..{self.n - 1}")

    # -- stability ------------------------------------------------------------------------------
    @functools.cached_property
    def stability(self) -> Stability:
        """Worst case over every pattern of ``s`` stragglers (sampled if there are too many)."""
        patterns, exhaustive = straggler_patterns(self.n, self.s)
        row_l1 = float(np.max(np.sum(np.abs(self.B), axis=1)))
        max_coef = max_sum = max_cond = 0.0
        for missing in patterns:
            F = [i for i in range(self.n) if i not in missing]
            A, _ = self._solve(frozenset(F))
            max_coef = max(max_coef, float(np.max(np.abs(A))))
            max_sum = max(max_sum, float(np.max(np.sum(np.abs(A), axis=1))))
            max_cond = max(max_cond, _effective_condition(self.B[F]))
        return Stability(max_coef, max_sum, max_cond, max_sum * row_l1, len(patterns),
                         exhaustive)

    @functools.cached_property
    def _amplification_checked(self) -> set[frozenset[int]]:
        """The responder patterns :meth:`decoder` has checked for fp32 amplification."""
        return set()

    @functools.cached_property
    def _row_l1(self) -> float:
        return float(np.max(np.sum(np.abs(self.B), axis=1)))

    def _check_amplification(self, A: np.ndarray, order: list[int]) -> None:
        """Warn (once per code) when *this* decode amplifies fp32 error past the budget.

        O(n) on the pattern in hand: the worst case over every pattern (:attr:`stability`)
        is a survey that can take seconds, and must never run inside a step.
        """
        if "_warned" in self.__dict__:
            return
        amp = float(np.max(np.sum(np.abs(A), axis=1))) * self._row_l1
        if amp > FP32_BUDGET:
            object.__setattr__(self, "_warned", True)
            missing = sorted(set(range(self.n)) - set(order))
            warnings.warn(f"{self.name}: decoding without workers {missing} amplifies error "
                          f"by {amp:.3g}, over the fp32 budget {FP32_BUDGET:g}; decode fp32 "
                          "gradients with care or pick a better-conditioned code (see "
                          "docs/codes.md)", StabilityWarning, stacklevel=3)

    # -- construction from a matrix ---------------------------------------------------------------
    @classmethod
    def from_matrix(cls, B: np.ndarray, s: int, *, m: int = 1, name: str = "custom",
                    verify: bool = True) -> GradientCode:
        """Wrap a given encoding matrix; ``verify`` checks every pattern of ``s`` stragglers."""
        B = np.asarray(B, dtype=np.float64)
        code = cls(name, B.shape[0], s, B, m)
        if verify:
            patterns, _ = straggler_patterns(code.n, s)
            for missing in patterns:
                F = [i for i in range(code.n) if i not in missing]
                if not code.is_sufficient(F):
                    raise ValueError(f"{name}: stragglers {sorted(missing)} are not tolerated, "
                                     f"so this B does not have tolerance s={s}")
        return code


def _effective_condition(M: np.ndarray) -> float:
    """Largest over smallest *non-zero* singular value. Repetition codes have duplicate rows
    by design; their plain condition number is infinite but says nothing about decoding."""
    sv = np.linalg.svd(M, compute_uv=False)
    nonzero = sv[sv > sv[0] * 1e-10] if sv.size and sv[0] > 0 else sv[:0]
    return float(nonzero[0] / nonzero[-1]) if nonzero.size else float("inf")


def straggler_patterns(n: int, s: int, *, limit: int = _EXHAUSTIVE_LIMIT,
                       seed: int = 0) -> tuple[list[frozenset[int]], bool]:
    """Every set of ``s`` of ``n`` workers, or ``limit`` random ones if there are more."""
    from itertools import combinations

    if math.comb(n, s) <= limit:
        return [frozenset(c) for c in combinations(range(n), s)], True
    rng = np.random.default_rng(seed)
    return [frozenset(int(x) for x in rng.choice(n, s, replace=False)) for _ in range(limit)], False
