"""Randomised Hadamard rotation: spreads a lost part of a vector evenly over all of it.

The bounded-time transpose allreduce (``schemes/transpose``) loses the tail of a slow sender's
stream. Without a rotation that tail is a contiguous run of coordinates (perhaps one whole
layer); after ``y = H·D·x`` (``D`` a random ±1 diagonal from a seed every rank shares, ``H``
an orthonormal Hadamard matrix) every coordinate of ``y`` mixes many coordinates of ``x``, so
losing some of ``y`` becomes a small error spread over many coordinates of ``x``. The map is
linear and orthonormal: the sum of rotated vectors is the rotation of the sum, and
``inverse(forward(x)) == x`` up to rounding.

How it is computed, and why. ``H`` here is ``H_a ⊗ H_b`` (a Sylvester Hadamard matrix of size
``a·b``, the Walsh–Hadamard transform up to the order of rows), applied to the vector viewed as
an ``(a, L/a)`` matrix (mixing coordinates ``L/a`` apart) and then as rows of ``b`` (mixing
neighbours): two small matrix products, done one band of columns at a time so that each
band stays in cache (see :meth:`Rotation._mix`). On this project's 2-core machines a numpy
butterfly (log2 n passes over the vector) takes 170–200 ms for 16 MiB of float32 while the
banded products take about 7–9 ms; a contiguous lost run is spread ``L/a`` apart and then
over its neighbours. The products run on one BLAS thread: they are memory-bound (two threads
gain little), and several ranks per host each spinning BLAS threads made them 4× slower
here (4 ranks on 2 cores, 100k floats: 4.5–6.8 ms with threads, 1.2–1.4 ms without).

In parts. ``Rotation(L, seed, parts=N)`` cuts the vector into ``N`` equal parts and mixes each
on its own: the transpose scheme's shards, so the owner of shard ``k`` rotates just its
reduced shard back (:meth:`Rotation.inverse_part`, 1/N of the vector) before it sends it,
instead of every rank inverting the whole vector after phase 2. What a slow sender loses in
phase 1 is still spread over its shard. Each part is padded with zeros to a multiple of
``a·b`` (at most ``a·b - 1`` elements per part: never a doubling of a message longer than
``N·a·b``).
"""

from __future__ import annotations

from functools import cache

import numpy as np
from threadpoolctl import ThreadpoolController

DEFAULT_FACTORS = (32, 32)
_BAND = 1 << 17  # elements mixed at a time: 512 KiB of float32, well inside a 2 MiB L2
_BLAS = ThreadpoolController()


@cache
def _sylvester(n: int) -> np.ndarray:
    """The ``n × n`` Sylvester Hadamard matrix divided by sqrt(n) (orthonormal, symmetric)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard factors must be powers of two, not {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    scaled: np.ndarray = h / np.sqrt(n)
    scaled.setflags(write=False)
    return scaled


def _factors_for(length: int, factors: tuple[int, int]) -> tuple[int, int]:
    """Smaller factors for a vector shorter than one block (so it is not padded up to it)."""
    a, b = factors
    if length >= a * b:
        return a, b
    block = 1 << max(0, (length - 1).bit_length())
    small_a = 1 << (block.bit_length() - 1) // 2
    return small_a, block // small_a


class Rotation:
    """``y = H·D·x`` for vectors of one length; every rank builds it from the same seed.

    ``parts`` cuts the padded vector into that many equal parts, each mixed on its own (the
    transpose scheme's shards), so the owner of a part can rotate just that part back
    (:meth:`inverse_part`). ``signs`` overrides the seeded ±1 diagonal (tests); ``factors``
    are the two Hadamard sizes (powers of two) whose Kronecker product is the mixing block.
    One rotation keeps one scratch buffer per dtype: use it from one thread.
    """

    def __init__(self, length: int, seed: int = 0, *, parts: int = 1,
                 factors: tuple[int, int] = DEFAULT_FACTORS,
                 signs: np.ndarray | None = None) -> None:
        if length < 0 or parts < 1:
            raise ValueError("length must be non-negative and parts positive")
        self.length, self.parts = length, parts
        per_part = -(-length // parts)
        self.a, self.b = _factors_for(per_part, factors)
        block = self.a * self.b
        self.part = max(block, -(-per_part // block) * block)  # elements in one part
        self.padded = self.part * parts
        if signs is None:
            rng = np.random.default_rng([seed, 0x4AD])
            signs = rng.integers(0, 2, self.padded) * 2 - 1
        if signs.shape != (self.padded,):
            raise ValueError(f"signs must have {self.padded} entries")
        self._signs = {np.dtype(np.float64): signs.astype(np.float64)}
        self._scratch: dict[np.dtype, np.ndarray] = {}

    def signs(self, dtype: np.dtype) -> np.ndarray:
        s = self._signs.get(dtype)
        if s is None:
            s = self._signs[dtype] = self._signs[np.dtype(np.float64)].astype(dtype)
        return s

    def forward(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The rotated vector (``padded`` entries, x's dtype; x must be floating point),
        written into ``out`` if given (``padded`` entries of x's dtype, not overlapping x),
        else into a new array."""
        x = x.reshape(-1)
        self._check(x, out)
        z = np.empty(self.padded, x.dtype) if out is None else out
        for k in range(self.parts):
            self._forward_part(k, x, z)
        return z

    def forward_part(self, k: int, x: np.ndarray, out: np.ndarray) -> None:
        """Part ``k`` of the rotation of ``x`` (the whole vector, ``length`` entries of
        floating point), written into the same part of ``out`` (``padded`` entries, x's
        dtype, not overlapping x): a caller can send one part while the next is rotated.
        Doing every part gives :meth:`forward`."""
        if x.shape != (self.length,):
            raise ValueError(f"x must have {self.length} entries, not shape {x.shape}")
        self._check(x, out)
        if not 0 <= k < self.parts:
            raise ValueError(f"there is no part {k} of {self.parts}")
        self._forward_part(k, x, out)

    def _check(self, x: np.ndarray, out: np.ndarray | None) -> None:
        if x.size != self.length:
            raise ValueError(f"expected {self.length} entries, got {x.size}")
        if x.dtype.kind != "f":
            raise TypeError(f"the Hadamard rotation needs a floating-point vector, not "
                            f"{x.dtype} (pass hadamard=False for integer vectors)")
        if out is not None and (out.shape != (self.padded,) or out.dtype != x.dtype):
            raise ValueError(f"out must be {self.padded} entries of {x.dtype}")

    def _forward_part(self, k: int, x: np.ndarray, out: np.ndarray) -> None:
        lo, hi = k * self.part, (k + 1) * self.part
        end = min(hi, self.length)
        signs, seg = self.signs(x.dtype), out[lo:hi]
        if end == hi:  # no padding in this part: the signs are applied as each block is read
            self._mix(x[lo:hi], seg, before=signs[lo:hi])
            return
        if lo < end:
            np.multiply(x[lo:end], signs[lo:end], out=seg[:end - lo])
        seg[max(0, end - lo):] = 0  # the padding
        self._mix(seg, seg)

    def inverse(self, y: np.ndarray) -> np.ndarray:
        """The vector whose rotation is ``y`` (``length`` entries; y is left as it is)."""
        z = np.empty(self.padded, y.dtype)
        self._mix(y.reshape(-1), z, after=self.signs(y.dtype))
        return z[: self.length]

    def inverse_part(self, k: int, y: np.ndarray) -> None:
        """Rotate part ``k`` (``part`` entries of a rotated vector) back, in place. Entries
        past ``length`` (the padding) come back as about zero."""
        if y.shape != (self.part,) or not 0 <= k < self.parts:
            raise ValueError(f"part {k} of {self.parts} must have {self.part} entries")
        self._mix(y, y, after=self.signs(y.dtype)[k * self.part:(k + 1) * self.part])

    def _mix(self, z: np.ndarray, out: np.ndarray, *, before: np.ndarray | None = None,
             after: np.ndarray | None = None) -> None:
        """``out = after · (H_a ⊗ H_b) · before · z`` on every part of ``z`` (whole parts;
        ``before`` and ``after`` are optional ±1 diagonals as vectors; ``out`` may be z).
        Without the signs the map is self-inverse: both factors are symmetric and
        orthonormal.

        Each part is an ``(a, part/a)`` matrix; ``H_a`` mixes its rows and ``H_b`` groups of
        ``b`` neighbours within a row, so a band of columns can be done start to end on its
        own. Done band by band (``_BAND`` elements, in cache), the vector is read once and
        written once; done as two whole-vector products (and a whole-vector sign pass), it
        went through memory three times: 7.3 ms against 12.7 for 16 MiB float32 on an idle
        core, 16.6 against 24.0 with 4 ranks on 2 cores."""
        a, b = self.a, self.b
        cols = self.part // a
        width = min(cols, max(b, _BAND // a // b * b))  # a multiple of b, as cols is
        ha = _sylvester(a).astype(z.dtype, copy=False)
        hb = _sylvester(b).astype(z.dtype, copy=False)
        bufs = self._scratch.get(z.dtype)
        if bufs is None or bufs.shape[1] < a * width:
            bufs = self._scratch[z.dtype] = np.empty((2, a * width), z.dtype)
        src = z.reshape(-1, a, cols)
        dst = out.reshape(-1, a, cols)
        pre = None if before is None else before.reshape(-1, a, cols)
        post = None if after is None else after.reshape(-1, a, cols)
        with _BLAS.limit(limits=1, user_api="blas"):
            for p in range(src.shape[0]):
                for c0 in range(0, cols, width):
                    c1 = min(cols, c0 + width)
                    n = a * (c1 - c0)
                    one = bufs[0, :n].reshape(a, c1 - c0)
                    two = bufs[1, :n].reshape(a, c1 - c0)
                    band = src[p, :, c0:c1]
                    if pre is not None:
                        band = np.multiply(band, pre[p, :, c0:c1], out=one)
                    np.matmul(ha, band, out=two)
                    grouped = two.reshape(a, -1, b)
                    if post is None:
                        np.matmul(grouped, hb, out=dst[p, :, c0:c1].reshape(a, -1, b))
                    else:
                        np.matmul(grouped, hb, out=one.reshape(a, -1, b))
                        np.multiply(one, post[p, :, c0:c1], out=dst[p, :, c0:c1])
