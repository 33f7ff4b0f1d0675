"""Communication-efficient gradient codes: messages ``m`` times shorter, load ``d >= s + m``.

What follows the literature and what is ours (the reference notes could read only the
abstracts of the papers, see ``shared/reference/kadhe_optireduce.md`` §1):

* The trade-off ``d >= s + m`` (Ye & Abbe, ICML 2018) and the claim that any linear code gives a
  gradient code whose block length, dimension and distance set load, message reduction and
  tolerance (Kadhe, Koyluoglu & Ramchandran, ISIT 2020) are from the papers' abstracts.
* :func:`group_code` is **our reconstruction** of the Kadhe et al. scheme: fractional-repetition
  groups of ``d`` workers, each group's summed gradient encoded with a ``[d, m]`` generator ``G``.
  It matches every property the abstract states but was not checked against the paper body.
* :func:`gaussian_mds` (random Gaussian ``G``, MDS with probability 1, so ``s = d - m``) is the
  abstract's "optimal and numerically stable" instance; the best-of-K draw selection is ours.
* :func:`polynomial_code` is **our** Ye–Abbe-style construction for cyclic placement (Vandermonde
  evaluation points, Chebyshev by default); the paper's recursive construction may differ.

All of them produce a :class:`GradientCode` with ``m > 1`` and the generic decoder.
"""

from __future__ import annotations

import itertools

import numpy as np

from .gradient import GradientCode


def _tolerance_of(G: np.ndarray) -> int:
    """Largest e such that removing any e columns of G keeps rank m (minimum distance - 1)."""
    m, d = int(G.shape[0]), int(G.shape[1])
    for e in range(1, d - m + 2):
        for gone in itertools.combinations(range(d), e):
            keep = [c for c in range(d) if c not in gone]
            if np.linalg.matrix_rank(G[:, keep]) < m:
                return e - 1
    return d - m


def group_code(n: int, G: np.ndarray, *, name: str | None = None) -> GradientCode:
    """Any linear ``[d, m]`` code with generator ``G`` (m x d) as a gradient code (our
    reconstruction of Kadhe et al.).

    Workers form ``n/d`` groups of ``d``; group ``t`` holds parts ``t*d .. t*d+d-1`` and the
    worker at position ``p`` sends ``sum_u G[u, p] * h_t^(u)``, chunk ``u`` of the group's summed
    gradient. The tolerance is the code's minimum distance minus one.
    """
    G = np.atleast_2d(np.asarray(G, dtype=np.float64))
    m, d = G.shape
    if n % d:
        raise ValueError(f"group_code needs the block length d={d} to divide n={n}")
    if np.linalg.matrix_rank(G) < m:
        raise ValueError(f"generator of shape {G.shape} has rank below m={m}")
    s = _tolerance_of(G)
    B = np.zeros((n, n * m))
    for i in range(n):
        t, p = divmod(i, d)
        for j in range(t * d, t * d + d):
            B[i, j * m:(j + 1) * m] = G[:, p]
    groups = None
    if m == 1 and np.all(G == 1):  # the repetition code is fractional repetition
        groups = tuple(tuple(range(t * d, t * d + d)) for t in range(n // d))
    label = name or f"group_code(n={n}, d={d}, m={m}, s={s})"
    return GradientCode(label, n, s, B, m, groups=groups)


def _worst_subset_condition(G: np.ndarray) -> float:
    m, d = G.shape
    return max(float(np.linalg.cond(G[:, list(c)])) for c in itertools.combinations(range(d), m))


def gaussian_mds(n: int, s: int, m: int, *, seed: int = 0, candidates: int = 16) -> GradientCode:
    """Random Gaussian MDS generator, ``d = s + m`` (Kadhe et al.'s optimal instance).

    Needs ``(s + m) | n``. Of ``candidates`` seeded draws, the one whose worst ``m x m``
    submatrix is best conditioned is kept.
    """
    if s < 0 or m < 1:
        raise ValueError(f"need s >= 0 and m >= 1, got s={s}, m={m}")
    d = s + m
    if n % d:
        raise ValueError(f"gaussian_mds needs d = s + m = {d} to divide n = {n}; use "
                         f"polynomial_code(n, s, m) for a cyclic placement, or pick n as a "
                         f"multiple of {d}")
    best: tuple[float, np.ndarray] | None = None
    for c in range(max(1, candidates)):
        G = np.random.default_rng([seed, c]).standard_normal((m, d))
        score = _worst_subset_condition(G)
        if best is None or score < best[0]:
            best = (score, G)
    assert best is not None
    code = group_code(n, best[1], name=f"gaussian_mds(n={n}, s={s}, m={m}, seed={seed})")
    if code.s != s:  # probability zero, but never hand out a code weaker than asked for
        raise ValueError(f"draw for gaussian_mds(n={n}, s={s}, m={m}) is not MDS")
    return code


def polynomial_code(n: int, s: int, m: int, points: np.ndarray | None = None) -> GradientCode:
    """Cyclic placement, ``d = s + m`` parts per worker, polynomial encoding (our Ye–Abbe-style
    construction).

    Worker ``i`` holds parts ``i .. i+d-1 (mod n)`` and evaluates at ``points[i]`` (Chebyshev
    nodes by default). For each part ``j`` and chunk ``u`` the encoding polynomial vanishes at
    the ``n - d`` workers that do not hold ``j`` and its top ``m`` coefficients are ``e_u``, so
    any ``n - s`` evaluations determine the top coefficients, which are the chunk sums.
    """
    d = s + m
    if not (s >= 0 and m >= 1 and d <= n):
        raise ValueError(f"need s >= 0, m >= 1 and s + m <= n, got n={n}, s={s}, m={m}")
    if points is None:
        points = np.cos((2 * np.arange(n) + 1) * np.pi / (2 * n))
    alpha = np.asarray(points, dtype=np.float64)
    if alpha.shape != (n,) or len(set(alpha.tolist())) != n:
        raise ValueError("polynomial_code needs n distinct evaluation points")
    deg = n - s  # number of coefficients of the message polynomial
    V = np.vander(alpha, deg)  # columns alpha^(deg-1) .. alpha^0
    top = np.eye(m, deg)  # picks the top m coefficients
    B = np.zeros((n, n * m))
    for j in range(n):
        holders = {(j - t) % n for t in range(d)}
        others = [i for i in range(n) if i not in holders]
        system = np.vstack([V[others], top])  # (n - d) + m = n - s rows
        for u in range(m):
            rhs = np.zeros(deg)
            rhs[len(others) + u] = 1.0
            t = np.linalg.solve(system, rhs)
            B[:, j * m + u] = V @ t
            # The polynomial vanishes at these workers in exact arithmetic; round-off leaves
            # non-zeros that grow with the points' scale, so zero them from the placement.
            B[others, j * m + u] = 0.0
    return GradientCode(f"polynomial_code(n={n}, s={s}, m={m})", n, s, B, m)
