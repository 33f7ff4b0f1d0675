"""Classic gradient codes (message reduction m = 1): FRC, real cyclic MDS, random cyclic.

Which one to choose (see docs/codes.md for measured worst cases):

1. :func:`frc` when ``(s+1)`` divides ``n``: 0/1 coefficients, no solve, exact in any precision,
   and a family can decode as soon as every group has one responder.
2. :func:`cyclic_mds` when ``n - s`` is odd: deterministic, coefficients O(1..60).
3. :func:`random_cyclic` otherwise: Tandon et al.'s construction, with the best of several seeds
   by worst-case decoding coefficient (single draws reach 1e3..1e6 for n >= 12, s >= 2).
"""

from __future__ import annotations

import math

import numpy as np

from .gradient import FP32_BUDGET, GradientCode, straggler_patterns


def frc(n: int, s: int) -> GradientCode:
    """Fractional repetition (Tandon et al.): groups of ``s+1`` workers share ``s+1`` parts.

    Requires ``(s+1) | n``. ``B = I_{n/(s+1)} kron J_{s+1}``.
    """
    if n < 1 or s < 0:
        raise ValueError(f"need n >= 1 and s >= 0, got n={n}, s={s}")
    if n % (s + 1):
        valid = [t for t in range(n) if n % (t + 1) == 0]
        raise ValueError(f"frc needs (s+1) to divide n; for n={n} valid s are {valid} "
                         "(or use cyclic_mds / random_cyclic)")
    g = s + 1
    B = np.kron(np.eye(n // g), np.ones((g, g)))
    groups = tuple(tuple(range(t * g, t * g + g)) for t in range(n // g))
    return GradientCode(f"frc(n={n}, s={s})", n, s, B, groups=groups)


def cyclic_mds(n: int, s: int) -> GradientCode:
    """A deterministic real cyclic MDS code (in the spirit of Raviv et al.); ``n - s`` odd.

    Row ``i`` is the cyclic shift by ``i`` of the coefficients of
    ``c(x) = prod_j (x + w^j)``, ``w = exp(2 pi i / n)``, ``j`` in
    ``{-(s-1)/2, ..., (s-1)/2}``; the set is symmetric, so ``c`` is real. Every row lies in the
    cyclic code whose spectrum vanishes on ``s`` frequencies around ``n/2`` (never 0), so the
    all-ones vector is in it and any ``n - s`` rows span it.
    """
    if not 0 <= s < n:
        raise ValueError(f"need 0 <= s < n, got n={n}, s={s}")
    if (n - s) % 2 == 0:
        raise ValueError(f"cyclic_mds needs n - s odd (n={n}, s={s}); use frc if (s+1) | n, "
                         "else random_cyclic")
    js = np.arange(s) - (s - 1) / 2
    roots = -np.exp(2j * np.pi * js / n)
    coeffs = np.poly(roots)[::-1] if s else np.ones(1)  # ascending powers, c_0 .. c_s
    if np.max(np.abs(np.imag(coeffs))) > 1e-9:
        raise AssertionError("cyclic_mds coefficients are not real")
    c = np.real(coeffs)
    B = np.zeros((n, n))
    for i in range(n):
        for t in range(s + 1):
            B[i, (i + t) % n] = c[t]
    return GradientCode(f"cyclic_mds(n={n}, s={s})", n, s, B)


def _tandon_matrix(n: int, s: int, rng: np.random.Generator) -> np.ndarray:
    """Tandon et al.'s random cyclic B: every row in null(H), with H @ 1 = 0."""
    H = rng.standard_normal((s, n))
    H[:, -1] = -H[:, :-1].sum(axis=1)
    B = np.zeros((n, n))
    for i in range(n):
        B[i, i] = 1.0
        if s:
            others = [(i + t) % n for t in range(1, s + 1)]
            B[i, others] = np.linalg.solve(H[:, others], -H[:, i])
    return B


def random_cyclic(n: int, s: int, seed: int = 0, candidates: int = 16) -> GradientCode:
    """Tandon et al.'s cyclic repetition code, best of ``candidates`` draws.

    Each candidate is scored by its worst-case decoding coefficient ``max |a|`` over the
    straggler patterns (all of them when few enough, a fixed random sample otherwise); the
    lowest wins. Deterministic for a given ``seed``.
    """
    if not 0 <= s < n:
        raise ValueError(f"need 0 <= s < n, got n={n}, s={s}")
    patterns, _ = straggler_patterns(n, s, limit=500)
    best: tuple[float, int, np.ndarray] | None = None
    for c in range(max(1, candidates)):
        rng = np.random.default_rng([seed, c])
        B = _tandon_matrix(n, s, rng)
        worst = 0.0
        for missing in patterns:
            F = [i for i in range(n) if i not in missing]
            a, *_ = np.linalg.lstsq(B[F].T, np.ones(n), rcond=None)
            worst = max(worst, float(np.max(np.abs(a))))
        if not math.isfinite(worst):
            continue
        if best is None or worst < best[0]:
            best = (worst, c, B)
    assert best is not None
    return GradientCode(f"random_cyclic(n={n}, s={s}, seed={seed}, draw={best[1]})", n, s,
                        best[2])


def default_code(n: int, s: int) -> GradientCode:
    """The recommended code for a family of ``n`` children tolerating ``s``.

    FRC where the groups divide evenly, else cyclic MDS where it exists; otherwise a random
    cyclic code if one within the fp32 budget is found, else the better conditioned of that
    and cyclic MDS at the next feasible tolerance (more load per worker). Not for the hot
    path: it surveys the candidates' worst cases.
    """
    if n % (s + 1) == 0:
        return frc(n, s)
    if (n - s) % 2 == 1:
        return cyclic_mds(n, s)
    rand = random_cyclic(n, s, candidates=64)
    if rand.stability.amplification <= FP32_BUDGET:
        return rand
    wider = next((w for w in range(s + 1, n) if (n - w) % 2 == 1), None)
    if wider is None:
        return rand
    mds = cyclic_mds(n, wider)
    return min((rand, mds), key=lambda c: c.stability.amplification)
