"""Randomised Hadamard rotation: spreads a lost part of a vector evenly over all of it.

The bounded-time transpose allreduce (``schemes/transpose``) loses the tail of a slow sender's
stream. Without a rotation that tail is a contiguous run of coordinates (perhaps one whole
layer); after ``y = H·D·x`` (``D`` a random ±1 diagonal from a seed every rank shares, ``H``
an orthonormal Hadamard matrix) every coordinate of ``y`` mixes many coordinates of ``x``, so
losing some of ``y`` becomes a small error spread over many coordinates of ``x``. The map is
linear and orthonormal: the sum of rotated vectors is the rotation of the sum, and
``inverse(forward(x)) == x`` up to rounding.

How it is computed, and why. ``H`` is the Sylvester Hadamard matrix of size ``a`` (32),
applied to each part viewed as an ``(a, L/a)`` matrix: it mixes coordinates ``L/a`` apart, so
a contiguous run of rows lost in transit (what a slow sender loses is a run of whole slices)
costs every column the same small share of its entries. It is a butterfly (``log2 a`` passes
of sums and differences, O(L log a)), one band of columns at a time so the band stays in
cache (see :meth:`Rotation._mix`). Why one factor: until 2026-11-25 a second factor also mixed
groups of 32 neighbours (``H_32 ⊗ H_32``), but a lost run of whole groups cancels that factor
exactly (``(M ⊗ I)`` commutes with ``I ⊗ H_b``), so it cost a second matrix product for no
change in what a loss does (same error to rounding, checked on a lost slice and a lost 1 %
tail). Why a butterfly and not a matrix product: for 16 MiB of float32 on this project's
2-core machines the banded butterfly takes about 5 ms, ``H_32`` as a BLAS product 7.5–10 ms
and the two products 10–11 ms; a butterfly over the whole vector (no bands) went through
memory once per pass and took 170–200 ms.

In parts. ``Rotation(L, seed, parts=N)`` cuts the vector into ``N`` equal parts and mixes each
on its own: the transpose scheme's shards, so the owner of shard ``k`` rotates just its
reduced shard back (:meth:`Rotation.inverse_part`, 1/N of the vector) before it sends it,
instead of every rank inverting the whole vector after phase 2. What a slow sender loses in
phase 1 is still spread over its shard. Each part is padded with zeros to a multiple of
``a·b`` (at most ``a - 1`` elements per part: never a doubling of a message longer than
``N·a``).
"""

from __future__ import annotations

import numpy as np

MIX = 32  # coordinates each butterfly mixes: a power of two
# Elements mixed at a time: 1 MiB of float32, so the band's two buffers stay in a 2 MiB L2.
# Smaller bands cost more numpy calls than they save (16 MiB: 4096 columns, 6.5-8.5 ms;
# 8192, 5.5-6.6; 16384, 5.0-5.3; the whole part, 14-16).
_BAND = 1 << 18


def _size_for(per_part: int, size: int) -> int:
    """The butterfly's size for parts of ``per_part`` elements: ``size``, or the power of two
    at or above a shorter part (so a short vector is not padded up to ``size``)."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"the mixing size must be a power of two, not {size}")
    return min(size, 1 << max(0, (per_part - 1).bit_length()))


class Rotation:
    """``y = H·D·x`` for vectors of one length; every rank builds it from the same seed.

    ``parts`` cuts the padded vector into that many equal parts, each mixed on its own (the
    transpose scheme's shards), so the owner of a part can rotate just that part back
    (:meth:`inverse_part`). ``signs`` overrides the seeded ±1 diagonal (tests); ``size`` is
    the Hadamard matrix's (a power of two: the coordinates each one mixes). One rotation
    keeps one scratch buffer per dtype: use it from one thread.
    """

    def __init__(self, length: int, seed: int = 0, *, parts: int = 1,
                 size: int = MIX, signs: np.ndarray | None = None) -> None:
        if length < 0 or parts < 1:
            raise ValueError("length must be non-negative and parts positive")
        self.length, self.parts = length, parts
        per_part = -(-length // parts)
        self.a = _size_for(per_part, size)
        self.part = max(self.a, -(-per_part // self.a) * self.a)  # elements in one part
        self.padded = self.part * parts
        if signs is None:
            rng = np.random.default_rng([seed, 0x4AD])
            signs = rng.integers(0, 2, self.padded) * 2 - 1
        if signs.shape != (self.padded,):
            raise ValueError(f"signs must have {self.padded} entries")
        self._signs = {np.dtype(np.float64): signs.astype(np.float64)}
        # The same diagonal divided by sqrt(a): H's normalisation, folded into the one pass
        # over the signs that each direction makes anyway.
        self._scaled: dict[np.dtype, np.ndarray] = {}
        self._scratch: dict[np.dtype, np.ndarray] = {}

    def signs(self, dtype: np.dtype) -> np.ndarray:
        """The ±1 diagonal ``D`` in ``dtype``."""
        s = self._signs.get(dtype)
        if s is None:
            s = self._signs[dtype] = self._signs[np.dtype(np.float64)].astype(dtype)
        return s

    def _scaled_signs(self, dtype: np.dtype) -> np.ndarray:
        s = self._scaled.get(dtype)
        if s is None:
            s = self._scaled[dtype] = (self._signs[np.dtype(np.float64)]
                                       / np.sqrt(self.a)).astype(dtype)
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
        signs, seg = self._scaled_signs(x.dtype), out[lo:hi]
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
        self._mix(y.reshape(-1), z, after=self._scaled_signs(y.dtype))
        return z[: self.length]

    def inverse_part(self, k: int, y: np.ndarray) -> None:
        """Rotate part ``k`` (``part`` entries of a rotated vector) back, in place. Entries
        past ``length`` (the padding) come back as about zero."""
        if y.shape != (self.part,) or not 0 <= k < self.parts:
            raise ValueError(f"part {k} of {self.parts} must have {self.part} entries")
        self._mix(y, y, after=self._scaled_signs(y.dtype)[k * self.part:(k + 1) * self.part])

    def prepare(self, dtype: np.dtype) -> None:
        """Make what the first rotation in ``dtype`` would make (the scaled diagonal in that
        dtype: a pass over the vector), so that the first rotated step is not the slow one."""
        self._scaled_signs(np.dtype(dtype))

    def forward_part_inplace(self, k: int, y: np.ndarray) -> None:
        """Rotate part ``k`` given on its own (``part`` entries, not rotated) in place: what
        :meth:`forward_part` writes for that part. :meth:`inverse_part` undoes it."""
        if y.shape != (self.part,) or not 0 <= k < self.parts:
            raise ValueError(f"part {k} of {self.parts} must have {self.part} entries")
        self._mix(y, y, before=self._scaled_signs(y.dtype)[k * self.part:(k + 1) * self.part])

    def _mix(self, z: np.ndarray, out: np.ndarray, *, before: np.ndarray | None = None,
             after: np.ndarray | None = None) -> None:
        """``out = after · H · before · z`` on every part of ``z`` (whole parts), with ``H``
        the Sylvester matrix *not* normalised: the caller's diagonal ``before`` or ``after``
        (vectors) carries the ``1/sqrt(a)``. ``out`` may be ``z``.

        Each part is an ``(a, part/a)`` matrix whose rows ``H`` mixes: a band of columns is
        done start to end on its own, in two scratch buffers (``_BAND`` elements, in cache)
        that each of the ``log2 a`` passes of the butterfly reads one and writes the
        other, so the vector is read once and written once."""
        a = self.a
        cols = self.part // a
        width = min(cols, max(1, _BAND // a))
        bufs = self._scratch.get(z.dtype)
        if bufs is None or bufs.shape[1] < a * width:
            bufs = self._scratch[z.dtype] = np.empty((2, a * width), z.dtype)
        src = z.reshape(-1, a, cols)
        dst = out.reshape(-1, a, cols)
        pre = None if before is None else before.reshape(-1, a, cols)
        post = None if after is None else after.reshape(-1, a, cols)
        for p in range(src.shape[0]):
            for c0 in range(0, cols, width):
                c1 = min(cols, c0 + width)
                k = c1 - c0
                cur = bufs[0, :a * k].reshape(a, k)
                nxt = bufs[1, :a * k].reshape(a, k)
                if pre is None:  # read before anything is written: out may be z
                    np.copyto(cur, src[p, :, c0:c1])
                else:
                    np.multiply(src[p, :, c0:c1], pre[p, :, c0:c1], out=cur)
                half = a // 2
                while half:  # rows r and r + half of every block of 2·half: sum, difference
                    last = half == 1 and post is None
                    to = dst[p, :, c0:c1] if last else nxt
                    pairs, into = cur.reshape(-1, 2, half, k), to.reshape(-1, 2, half, k)
                    np.add(pairs[:, 0], pairs[:, 1], out=into[:, 0])
                    np.subtract(pairs[:, 0], pairs[:, 1], out=into[:, 1])
                    cur, nxt = nxt, cur
                    half //= 2
                if post is not None:
                    np.multiply(cur, post[p, :, c0:c1], out=dst[p, :, c0:c1])
                elif a == 1:  # no pass at all
                    np.copyto(dst[p, :, c0:c1], cur)
