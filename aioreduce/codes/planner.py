"""CodedReduce placement: which samples, with which weights, every rank computes on.

Reisizadeh et al.'s recursive allocation (reference: codedreduce_gc.md §3.3). Every rank below
the root processes the same number ``c`` of weighted samples; each parent applies its family's
gradient code to the data it is responsible for (its responsibility minus its own share), so a
parent can decode the exact sum of its subtree's responsibility from any ``n - s`` children.
A sample's weight at a rank is the product of code coefficients along the root-to-rank path.

    c = M / sum_{l=1..L} prod_{k=1..l} n_k / d_k        (d_k = parts per worker, s_k + 1 for
                                                         the classic codes)

The same planner serves flat gradient coding (``levels=1``) and uncoded placement (``s=0``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from .constructions import default_code
from .gradient import GradientCode, NotDecodable
from .topology import TreeTopology, _per_level

Placement = tuple[np.ndarray, np.ndarray]  # (sample ids: int64, weights: float64)


@dataclass(frozen=True)
class CodedTreePlan:
    """The allocation of one data set over one tree; see :func:`coded_tree_plan`."""

    topology: TreeTopology
    stragglers: tuple[int, ...]  # tolerance of the families below each level 0..L-1
    codes: tuple[GradientCode, ...]  # code of the families below each level 0..L-1
    num_samples: int
    load: int  # c: weighted samples per computing rank
    _placement: dict[int, Placement] = field(repr=False)

    def placement(self, rank: int) -> Placement:
        """(sample ids, weights) that ``rank`` computes its coded gradient on."""
        ids, w = self._placement[rank]
        return ids.copy(), w.copy()

    def code_for(self, parent_rank: int) -> GradientCode:
        """The code of ``parent_rank``'s family; worker ``i`` is its ``i``-th child."""
        if not self.topology.children(parent_rank):
            raise ValueError(f"rank {parent_rank} is a leaf and has no family")
        return self.codes[self.topology.level(parent_rank)]

    def reference_aggregate(self, values: np.ndarray, missing: Collection[int] = ()
                            ) -> np.ndarray:
        """What the root decodes, computed directly: ``values[x]`` is sample x's gradient.

        Ranks in ``missing`` never deliver; a family with too many of them raises
        :class:`NotDecodable`. With no stragglers (or tolerated ones) the result is
        ``values.sum(axis=0)``: this is the specification the runtime is tested against.
        """
        vals = np.asarray(values, dtype=np.float64)
        gone = set(missing)

        def message(rank: int) -> np.ndarray:
            ids, w = self._placement[rank]
            out = w @ vals[ids] if len(ids) else np.zeros(vals.shape[1:])
            kids = self.topology.children(rank)
            if kids:
                arrived = [i for i, child in enumerate(kids) if child not in gone]
                a = self.code_for(rank).decoder(arrived)
                for i in arrived:
                    if a[i]:
                        out = out + a[i] * message(kids[i])
            return np.asarray(out)

        return message(0)


def _support_size(code: GradientCode) -> int:
    sizes = {len(code.parts_of(i)) for i in range(code.n)}
    if len(sizes) != 1:
        raise ValueError(f"{code.name}: rows hold different numbers of parts {sorted(sizes)}; "
                         "the tree planner needs a balanced code")
    return sizes.pop()


def _codes(topology: TreeTopology, s: tuple[int, ...],
           code: GradientCode | Sequence[GradientCode] | None) -> tuple[GradientCode, ...]:
    L = topology.levels
    if code is None:
        chosen = [default_code(topology.fanout[lv], s[lv]) for lv in range(L)]
    elif isinstance(code, GradientCode):
        chosen = [code] * L
    else:
        chosen = list(code)
        if len(chosen) != L:
            raise ValueError(f"{len(chosen)} codes given for {L} levels")
    for lv, c in enumerate(chosen):
        if c.m != 1:
            raise ValueError(f"{c.name}: CodedReduce sends whole vectors; codes with message "
                             "reduction m > 1 are for the flat gradient-coding scheme")
        if c.n != topology.fanout[lv] or c.k != c.n:
            raise ValueError(f"{c.name} is for {c.n} workers and {c.k} parts, but level {lv} "
                             f"has families of {topology.fanout[lv]}")
        if c.s < s[lv]:
            raise ValueError(f"{c.name} tolerates {c.s} stragglers, level {lv} needs {s[lv]}")
    return tuple(chosen)


def _sizes(M: int, c: int, fan: tuple[int, ...], d: tuple[int, ...]) -> str | None:
    """Check that every split is integral; the first problem found, or None."""
    if M % fan[0]:
        return f"{M} samples do not split into {fan[0]} parts at the root"
    w = M // fan[0] * d[0]  # responsibility of a level-1 rank
    for lv in range(1, len(fan)):
        rest = w - c
        if rest < 0 or rest % fan[lv]:
            return f"a level-{lv} rank's remaining {rest} samples do not split into {fan[lv]}"
        w = rest // fan[lv] * d[lv]
    return None if w == c else f"leaves would hold {w} samples, not the load {c}"


def coded_tree_unit(fanout: int | Sequence[int], levels: int, stragglers: int | Sequence[int],
                    code: GradientCode | Sequence[GradientCode] | None = None) -> int:
    """The smallest data-set size that fits this tree; every multiple of it fits too."""
    topo = TreeTopology(fanout, levels)
    codes = _codes(topo, _per_level(stragglers, levels, "stragglers"), code)
    return _unit_size(topo.fanout, tuple(_support_size(c) for c in codes))


def coded_tree_plan(num_samples: int, fanout: int | Sequence[int], levels: int,
                    stragglers: int | Sequence[int],
                    code: GradientCode | Sequence[GradientCode] | None = None) -> CodedTreePlan:
    """Plan CodedReduce over a tree of ``levels`` levels with ``fanout`` children per node.

    ``stragglers`` is the tolerance per family (an int, or one per level); ``code`` the family
    code (default: :func:`~aioreduce.codes.constructions.default_code`), one for all levels or
    one per level. Raises ``ValueError`` naming the nearest valid data-set sizes when
    ``num_samples`` does not split evenly.
    """
    topo = TreeTopology(fanout, levels)
    s = _per_level(stragglers, levels, "stragglers")
    codes = _codes(topo, s, code)
    d = tuple(_support_size(c) for c in codes)
    fan = topo.fanout
    denom = sum((math.prod(Fraction(fan[k], d[k]) for k in range(lv + 1))
                 for lv in range(levels)), Fraction(0))
    unit = _unit_size(fan, d)
    c_exact = Fraction(num_samples) / denom
    problem = None if c_exact.denominator == 1 else f"the load M/({denom}) is not whole"
    if problem is None:
        problem = _sizes(num_samples, int(c_exact), fan, d)
    if problem is not None:
        lo, hi = (num_samples // unit) * unit, (num_samples // unit + 1) * unit
        near = f"{lo} or {hi}" if lo else str(hi)
        raise ValueError(f"num_samples={num_samples} does not fit this tree (fanout {list(fan)},"
                         f" stragglers {list(s)}): {problem}; multiples of {unit} fit, "
                         f"nearest {near}")
    c = int(c_exact)
    placement: dict[int, Placement] = {0: (np.zeros(0, np.int64), np.zeros(0))}

    def assign(rank: int, ids: np.ndarray, w: np.ndarray) -> None:
        lv = topo.level(rank)
        if lv:
            placement[rank] = (ids[:c], w[:c])
            ids, w = ids[c:], w[c:]
        kids = topo.children(rank)
        if not kids:
            return
        B = codes[lv].B
        q_ids, q_w = np.split(ids, len(kids)), np.split(w, len(kids))
        for j, child in enumerate(kids):
            parts = [k for k in range(len(kids)) if B[j, k] != 0]
            assign(child, np.concatenate([q_ids[k] for k in parts]),
                   np.concatenate([q_w[k] * B[j, k] for k in parts]))

    assign(0, np.arange(num_samples, dtype=np.int64), np.ones(num_samples))
    return CodedTreePlan(topo, s, codes, num_samples, c, placement)


def _unit_size(fan: tuple[int, ...], d: tuple[int, ...]) -> int:
    """Smallest data-set size of the family c = k * prod(d): every split is then whole."""
    c = math.prod(d)
    w = c
    for lv in range(len(fan) - 1, 0, -1):
        w = c + fan[lv] * w // d[lv]
    return fan[0] * w // d[0]


__all__ = ["CodedTreePlan", "NotDecodable", "coded_tree_plan", "coded_tree_unit"]
