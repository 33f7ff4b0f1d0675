"""CodedReduce topology and placement: the reference's examples, every straggler pattern."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioreduce.codes import (
    GradientCode,
    NotDecodable,
    TreeTopology,
    coded_tree_plan,
    coded_tree_unit,
)
from aioreduce.codes.model import ComputeModel, LinkModel, predict_ring, predict_star, predict_tree

TANDON = GradientCode.from_matrix(np.array([[0.5, 1, 0], [0, 1, -1], [0.5, 0, 1]]), 1)


def test_topology_heap_indexing() -> None:
    t = TreeTopology(3, 2)
    assert t.size == 13 and t.workers == 12
    assert t.children(0) == [1, 2, 3] and t.children(1) == [4, 5, 6]
    assert t.children(3) == [10, 11, 12] and t.children(4) == []
    assert [t.parent(r) for r in (1, 3, 4, 12)] == [0, 0, 1, 3] and t.parent(0) is None
    assert [t.level(r) for r in (0, 3, 4, 12)] == [0, 1, 2, 2]
    assert list(t.leaves) == list(range(4, 13))
    for n, L, N in ((4, 2, 20), (9, 2, 90), (12, 2, 156), (4, 3, 84), (3, 3, 39)):
        assert TreeTopology(n, L).workers == N
    mixed = TreeTopology([2, 3], 2)
    assert mixed.size == 1 + 2 + 6 and mixed.children(2) == [6, 7, 8]
    for r in range(1, mixed.size):
        assert r in mixed.children(mixed.parent(r) or 0)
    with pytest.raises(ValueError):
        TreeTopology(3, 2).level(13)


def _row(plan, rank: int) -> list[tuple[int, float]]:
    ids, w = plan.placement(rank)
    return [(int(i) + 1, float(x)) for i, x in zip(ids, w, strict=True)]  # 1-based like the text


def test_example_a_weighted_samples_and_all_81_patterns() -> None:
    plan = coded_tree_plan(15, 3, 2, 1, code=TANDON)
    assert plan.load == 4
    assert _row(plan, 1) == [(1, .5), (2, .5), (3, .5), (4, .5)]
    assert _row(plan, 2) == [(6, 1), (7, 1), (8, 1), (9, 1)]
    assert _row(plan, 4) == [(5, .25), (6, .5), (7, 1), (8, 1)]
    assert _row(plan, 5) == [(7, 1), (8, 1), (9, -1), (10, -1)]
    assert _row(plan, 7) == [(10, .5), (11, -.5), (12, -1), (13, -1)]
    assert _row(plan, 8) == [(12, -1), (13, -1), (14, 1), (15, 1)]
    assert _row(plan, 10) == [(5, .25), (11, .5), (12, 1), (13, 1)]
    assert _row(plan, 12) == [(5, .25), (11, .5), (14, 1), (15, 1)]
    g = np.random.default_rng(0).standard_normal((15, 4))
    families = [plan.topology.children(p) for p in (0, 1, 2, 3)]
    count = 0
    for choice in itertools.product(*families):  # one straggler per family: 3^4 = 81
        got = plan.reference_aggregate(g, missing=set(choice))
        assert np.allclose(got, g.sum(axis=0), rtol=0, atol=1e-12)
        count += 1
    assert count == 81


def test_example_b_frc_all_patterns() -> None:
    plan = coded_tree_plan(24, 4, 2, 1)
    assert "frc" in plan.code_for(0).name and plan.load == 4
    assert _row(plan, 1) == _row(plan, 2) == [(i, 1) for i in range(1, 5)]
    assert _row(plan, 3) == _row(plan, 4) == [(i, 1) for i in range(13, 17)]
    assert {tuple(_row(plan, r)) for r in range(5, 9)} == {
        tuple((i, 1) for i in range(5, 9)), tuple((i, 1) for i in range(9, 13))}
    g = np.random.default_rng(1).standard_normal((24, 3))
    families = [[None, *plan.topology.children(p)] for p in range(5)]
    for choice in itertools.product(*families):  # 0 or 1 straggler per family: 5^5
        got = plan.reference_aggregate(g, missing={c for c in choice if c is not None})
        assert np.array_equal(got, g.sum(axis=0)) or np.allclose(got, g.sum(axis=0), atol=1e-12)


def test_two_stragglers_in_one_family_is_not_decodable() -> None:
    plan = coded_tree_plan(15, 3, 2, 1, code=TANDON)
    with pytest.raises(NotDecodable):
        plan.reference_aggregate(np.ones((15, 2)), missing={4, 5})


@pytest.mark.parametrize("n, s, L", [(2, 1, 1), (3, 1, 2), (4, 1, 2), (4, 1, 3), (3, 2, 2),
                                     (4, 3, 2), (5, 2, 2), (3, 0, 3), (6, 2, 1), (4, 2, 2)])
def test_random_structured_stragglers_recover_the_full_gradient(n: int, s: int, L: int) -> None:
    rng = np.random.default_rng([n, s, L])
    unit = coded_tree_unit(n, L, s)
    plan = coded_tree_plan(unit * 2, n, L, s)
    g = rng.standard_normal((plan.num_samples, 5))
    parents = [r for r in range(plan.topology.size) if plan.topology.children(r)]
    for _ in range(40):
        missing: set[int] = set()
        for p in parents:
            kids = plan.topology.children(p)
            k = int(rng.integers(0, s + 1))
            missing |= {int(x) for x in rng.choice(kids, size=k, replace=False)}
        got = plan.reference_aggregate(g, missing)
        err = np.linalg.norm(got - g.sum(axis=0)) / np.linalg.norm(g.sum(axis=0))
        assert err < 1e-9


def test_unit_is_the_smallest_size_that_fits() -> None:
    assert coded_tree_unit(3, 2, 1) == 15 and coded_tree_unit(4, 2, 1) == 24
    assert coded_tree_unit(12, 2, 1) == 168  # k = 1 of the recipe m = k * sum n^l (s+1)^(L-l)
    for n, s, L in ((3, 1, 2), (4, 1, 3), (5, 2, 2)):
        unit = coded_tree_unit(n, L, s)
        coded_tree_plan(unit, n, L, s)
        with pytest.raises(ValueError, match=f"multiples of {unit} fit"):
            coded_tree_plan(unit + 1, n, L, s)


def test_misfit_sizes_name_the_nearest_valid_ones() -> None:
    with pytest.raises(ValueError, match="multiples of 15 fit, nearest 90 or 105"):
        coded_tree_plan(100, 3, 2, 1)
    with pytest.raises(ValueError, match="needs 1"):
        coded_tree_plan(24, 4, 2, 1, code=GradientCode.from_matrix(np.eye(4), 0))


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 5), st.integers(0, 3), st.integers(1, 3), st.integers(1, 3))
def test_planner_weights_sum_to_one_and_loads_balance(n: int, s: int, L: int, k: int) -> None:
    if s >= n or TreeTopology(n, L).size > 200:
        return
    M = coded_tree_unit(n, L, s) * k
    plan = coded_tree_plan(M, n, L, s)
    rho = n / (s + 1)  # every default code gives each worker s + 1 parts
    assert plan.load * sum(rho ** lv for lv in range(1, L + 1)) == pytest.approx(M)
    assert all(len(plan.placement(r)[0]) == plan.load for r in range(1, plan.topology.size))
    assert len(plan.placement(0)[0]) == 0
    # Identity "gradients": the root's decode is each sample's total weight over the tree.
    weights = plan.reference_aggregate(np.eye(M))
    assert np.allclose(weights, 1.0, atol=1e-9)
    rng = np.random.default_rng([n, s, L, k])
    missing = set()
    for p in range(plan.topology.size):
        kids = plan.topology.children(p)
        if kids and s:
            missing |= {int(x) for x in rng.choice(kids, size=s, replace=False)}
    assert np.allclose(plan.reference_aggregate(np.eye(M), missing), 1.0, atol=1e-9)


def test_flat_gc_and_uncoded_are_special_cases() -> None:
    gc = coded_tree_plan(12, 6, 1, 2)  # L = 1: gradient coding, load (s+1)/n
    assert gc.load == 6
    uncoded = coded_tree_plan(12, 3, 2, 0)  # s = 0: each of 12 workers gets 1 sample
    assert uncoded.load == 1
    assert sorted(int(uncoded.placement(r)[0][0]) for r in range(1, 13)) == list(range(12))


def test_cost_model_matches_the_closed_form_without_noise() -> None:
    link = LinkModel(alpha=0.0, bandwidth=1e6)
    compute = ComputeModel(full_time=1.0, rate=1e12)  # (almost) no noise
    n, s, L, vec = 3, 1, 2, 1000.0
    tau = vec / link.bandwidth
    load = 1 / sum((n / (s + 1)) ** lv for lv in range(1, L + 1))
    t = predict_tree(n, L, s, vector_bytes=vec, link=link, compute=compute, trials=10)
    assert t.median == pytest.approx(load + L * (n - s) * tau + L * n * tau, rel=1e-6)
    ring = predict_ring(13, vector_bytes=vec, link=link, compute=compute, trials=10)
    assert ring.median == pytest.approx(1 / 13 + 2 * 12 * tau / 13, rel=1e-6)
    slow = predict_ring(13, vector_bytes=vec, link=link, compute=compute, slow={4: 3.0})
    assert slow.median == pytest.approx(3 / 13 + 2 * 12 * tau / 13, rel=1e-6)
    star = predict_star(12, 1, vector_bytes=vec, link=link, compute=compute, trials=10)
    assert star.median == pytest.approx(2 / 12 + 11 * tau + 12 * tau, rel=1e-6)
    assert math.isfinite(star.p99)


def test_coded_tree_keeps_its_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan is made once per data-set size (planning a 13-rank tree costs tens of ms of CPU,
    which a bench or sampler asking every step spent while peers were mid-step), equal to a
    fresh one, and only the most recent few sizes are kept."""
    from aioreduce.schemes import CodedTree
    from aioreduce.schemes import tree as tree_mod

    made: list[int] = []

    def counting(num: int, *args: object) -> object:
        made.append(num)
        return coded_tree_plan(num, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(tree_mod, "coded_tree_plan", counting)
    scheme = CodedTree(3, 2, 1)
    unit = scheme.min_samples
    first = scheme.plan(unit)
    assert scheme.plan(unit) is first and made == [unit]
    fresh = coded_tree_plan(unit, 3, 2, 1)
    for rank in range(13):
        for got, want in zip(first.placement(rank), fresh.placement(rank), strict=True):
            np.testing.assert_array_equal(got, want)
    for k in range(2, 2 + tree_mod._PLANS_KEPT):  # older sizes fall out
        scheme.plan(k * unit)
    scheme.plan(unit)
    assert made.count(unit) == 2
