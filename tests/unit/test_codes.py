"""Gradient codes: exhaustive exactness, the reference's worked examples, refusals."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest

from aioreduce.codes import (
    GradientCode,
    NotDecodable,
    StabilityWarning,
    coded_tree_plan,
    coded_tree_unit,
    cyclic_mds,
    default_code,
    frc,
    gaussian_mds,
    group_code,
    polynomial_code,
    random_cyclic,
)
from aioreduce.codes.gradient import FP32_BUDGET


def constructions(n: int, s: int) -> list[GradientCode]:
    codes = [random_cyclic(n, s)]
    if n % (s + 1) == 0:
        codes.append(frc(n, s))
    if (n - s) % 2 == 1:
        codes.append(cyclic_mds(n, s))
    for m in (2, 3):
        if s + m <= n:
            codes.append(polynomial_code(n, s, m))
        if n % (s + m) == 0:
            codes.append(gaussian_mds(n, s, m))
    return codes


CASES = [(n, s) for n in range(2, 13) for s in range(0, 4) if s < n]


def _check_exact(code: GradientCode, responders: list[int], parts: np.ndarray) -> None:
    truth = parts.sum(axis=0)
    msgs = {i: code.encode(i, parts) for i in responders}
    assert all(len(f) == code.message_length(parts.shape[1]) for f in msgs.values())
    got = code.decode(msgs, parts.shape[1])
    err = np.linalg.norm(got - truth) / np.linalg.norm(truth)
    assert err < 1e-9, (code.name, responders, err)


@pytest.mark.parametrize("n, s", CASES)
def test_every_pattern_of_at_most_s_decodes_exactly(n: int, s: int) -> None:
    rng = np.random.default_rng([n, s])
    for code in constructions(n, s):
        parts = rng.standard_normal((code.k, 12))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StabilityWarning)
            for e in range(s + 1):
                for gone in itertools.combinations(range(n), e):
                    responders = [i for i in range(n) if i not in gone]
                    assert code.is_sufficient(responders), (code.name, gone)
                    _check_exact(code, responders, parts)
                    a = code.decoder(responders)
                    assert np.all(np.atleast_2d(a)[:, list(gone)] == 0)


@pytest.mark.parametrize("n, s", [(n, s) for n, s in CASES if s + 1 < n])
def test_s_plus_one_stragglers_are_never_silently_wrong(n: int, s: int) -> None:
    rng = np.random.default_rng([n, s, 1])
    for code in constructions(n, s):
        parts = rng.standard_normal((code.k, 6))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StabilityWarning)
            for gone in itertools.combinations(range(n), s + 1):
                responders = [i for i in range(n) if i not in gone]
                try:
                    code.decoder(responders)
                except NotDecodable as exc:
                    assert not code.is_sufficient(responders)
                    assert exc.missing == list(gone)
                    continue
                assert code.is_sufficient(responders)
                _check_exact(code, responders, parts)  # if it decodes, it is exact


def test_tandon_textbook_example() -> None:
    B = np.array([[0.5, 1, 0], [0, 1, -1], [0.5, 0, 1]])
    code = GradientCode.from_matrix(B, 1)
    for responders, want in (([0, 1], [2, -1, 0]), ([0, 2], [1, 0, 1]), ([1, 2], [0, 1, 2])):
        assert np.allclose(code.decoder(responders), want)
    with pytest.raises(ValueError, match="not tolerated"):
        GradientCode.from_matrix(np.eye(3), 1)


def test_cyclic_mds_closed_forms_and_table() -> None:
    code = cyclic_mds(4, 1) if (4 - 1) % 2 else None
    assert code is not None
    assert np.allclose(code.B[0], [1, 1, 0, 0])
    for straggler, want in ((0, [0, 1, 0, 1]), (1, [1, 0, 1, 0]), (2, [0, 1, 0, 1]),
                            (3, [1, 0, 1, 0])):
        a = code.decoder([i for i in range(4) if i != straggler])
        assert np.allclose(a @ code.B, 1)
        assert np.allclose(a, want) or np.linalg.norm(a) <= np.linalg.norm(want) + 1e-12
    assert np.allclose(cyclic_mds(7, 2).B[0, :3], [1, 1.8019, 1], atol=1e-4)
    assert np.allclose(cyclic_mds(11, 2).B[0, :3], [1, 1.9190, 1], atol=1e-4)
    assert np.allclose(cyclic_mds(8, 3).B[0, :4], [1, 2.4142, 2.4142, 1], atol=1e-4)
    assert np.allclose(cyclic_mds(9, 4).B[0, :5], [1, 2.8794, 3.8794, 2.8794, 1], atol=1e-4)
    with pytest.raises(ValueError, match="n - s odd"):
        cyclic_mds(12, 2)


def test_frc_fast_path_decodes_before_n_minus_s() -> None:
    code = frc(6, 2)
    assert code.is_sufficient([1, 4])  # one per group: 2 responders, n - s = 4
    a = code.decoder([4, 1, 0])
    assert list(a) == [0, 1, 0, 0, 1, 0]  # first arrival of each group, 0/1
    with pytest.raises(NotDecodable):
        code.decoder([0, 1, 2])
    with pytest.raises(ValueError, match="valid s are"):
        frc(6, 3)


def test_min_norm_with_extra_responders() -> None:
    code = cyclic_mds(7, 2)
    exact = code.decoder(range(5))
    extra = code.decoder(range(7))
    assert np.linalg.norm(extra) < np.linalg.norm(exact)
    assert np.allclose(extra @ code.B, 1)


def test_approximate_decode_bound_holds() -> None:
    rng = np.random.default_rng(3)
    code = cyclic_mds(7, 2)
    parts = rng.standard_normal((7, 50))
    responders = [0, 2, 4, 6]  # three missing: not decodable
    assert not code.is_sufficient(responders)
    approx = code.approximate(responders)
    assert not approx.exact and approx.error_factor > 0
    got = sum(approx.coefficients[i] * code.encode(i, parts) for i in responders)
    err = np.linalg.norm(got - parts.sum(axis=0))
    assert err <= approx.bound(np.linalg.norm(parts, axis=1)) + 1e-9
    full = code.approximate(range(7))
    assert full.exact and full.error_factor < 1e-8


def test_stability_warning_for_an_ill_conditioned_code() -> None:
    # Worker 0 sends a tiny multiple of the sum: decoding from it alone multiplies by 1e4.
    bad = GradientCode.from_matrix(np.array([[1e-4, 1e-4], [1.0, 1.0]]), 1, name="tiny-row")
    assert bad.stability.amplification > 1e3
    with pytest.warns(StabilityWarning, match="fp32 budget"):
        bad.decoder([0])  # the warning is judged on the pattern decoded, without a survey
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        frc(4, 1).decoder([0, 2])
        cyclic_mds(7, 2).decoder(range(5))


# --- communication-efficient codes (reference kadhe_optireduce.md §1.8) -----------------------

def test_single_parity_group_code_example_a() -> None:
    code = group_code(6, np.array([[1, 0, 1], [0, 1, 1]]))
    assert (code.n, code.s, code.m) == (6, 1, 2)
    g = np.array([[1, 0, 2, 1], [0, 1, 1, 0], [2, 1, 0, 3], [1, 1, 1, 1], [0, 2, 0, 1],
                  [3, 0, 1, 0]], float)
    msgs = {i: code.encode(i, g) for i in range(6)}
    want = [[3, 2], [3, 4], [6, 6], [4, 3], [2, 2], [6, 5]]
    assert all(np.allclose(msgs[i], want[i]) for i in range(6))
    for gone in range(6):
        sub = {i: f for i, f in msgs.items() if i != gone}
        assert np.allclose(code.decode(sub, 4), [7, 5, 5, 6])
    assert np.allclose(code.decode({i: msgs[i] for i in (1, 2, 4, 5)}, 4), [7, 5, 5, 6])
    with pytest.raises(NotDecodable):
        code.decoder([2, 3, 4, 5])  # two missing in one group


def test_mds_group_code_example_b() -> None:
    code = group_code(4, np.array([[1, 0, 1, 1], [0, 1, 1, 2]]))
    assert code.s == 2
    g = np.array([[1, 2, 3, 4], [0, 1, 0, 1], [2, 0, 2, 0], [1, 1, 1, 1]], float)
    msgs = {i: code.encode(i, g) for i in range(4)}
    assert [list(msgs[i]) for i in range(4)] == [[4, 4], [6, 6], [10, 10], [16, 16]]
    for pair in itertools.combinations(range(4), 2):
        assert np.allclose(code.decode({i: msgs[i] for i in pair}, 4), [4, 4, 6, 6])


def test_polynomial_code_example_c() -> None:
    code = polynomial_code(4, 1, 2, points=np.array([-1.0, 0, 1, 2]))
    coef = code.B.reshape(4, 4, 2)  # worker, part, chunk
    assert np.allclose(coef[0, 0], [1, -1]) and np.allclose(coef[0, 1], [0, -2])
    assert np.allclose(coef[0, 2], [-3, -3]) and np.allclose(coef[0, 3], [0, 0])
    assert np.allclose(coef[3, 3], [3, 3]) and np.allclose(coef[2, 0], [1, 1])
    g = np.array([[1, 2, 0, 1], [0, 1, 1, 0], [2, 0, 1, 1], [1, 1, 0, 2]], float)
    msgs = {i: code.encode(i, g) for i in range(4)}
    want = [[-10, -2], [-12, -2], [-6, 6], [8, 22]]
    assert all(np.allclose(msgs[i], want[i]) for i in range(4))
    for gone in range(4):
        assert np.allclose(code.decode({i: f for i, f in msgs.items() if i != gone}, 4),
                           [4, 4, 2, 4])


def test_repetition_code_is_frc_example_d() -> None:
    code = group_code(4, np.array([[1.0, 1.0]]))
    assert code.s == 1 and code.groups == ((0, 1), (2, 3))
    assert np.array_equal(code.B, frc(4, 1).B)


def test_gaussian_mds_n6_d3_m2_s1_and_message_length() -> None:
    code = gaussian_mds(6, 1, 2)
    assert (code.s, code.m) == (1, 2)
    parts = np.random.default_rng(0).standard_normal((6, 11))  # odd length: padded
    assert code.message_length(11) == 6
    for gone in range(6):
        _check_exact(code, [i for i in range(6) if i != gone], parts)
    with pytest.raises(ValueError, match="divide n"):
        gaussian_mds(4, 1, 2)


def test_ye_abbe_bound_is_enforced() -> None:
    with pytest.raises(ValueError):
        polynomial_code(4, 3, 2)  # d = 5 > n
    code = group_code(6, np.random.default_rng(1).standard_normal((2, 3)))
    assert code.s == 3 - 2  # d - m: an MDS code meets d = s + m and no better


# --- found while reading (issue 8): each test failed before its fix -------------------------

def test_first_decode_runs_no_stability_survey() -> None:
    # The worst-case survey took 1.5 s at n=64 (79 s at n=156) inside the first step.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StabilityWarning)
        code = random_cyclic(64, 2)
        code.decoder([i for i in range(64) if i not in (3, 9)])
    assert "stability" not in code.__dict__  # the survey never ran
    plan = coded_tree_plan(coded_tree_unit(12, 2, 2), 12, 2, 2)
    for c in plan.codes:
        c.decoder(range(2, 12))
        assert "stability" not in c.__dict__


def test_polynomial_code_placement_is_exactly_zero_outside_held_parts() -> None:
    # Wide evaluation points (B reaches ~1e7) left round-off where B must be exactly 0.
    code = polynomial_code(6, 1, 2, points=np.linspace(-1, 1, 6) * 3e2)
    assert [code.parts_of(i) for i in range(6)] == [
        [0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5], [0, 4, 5], [0, 1, 5]]
    for missing in range(6):
        survivors = [i for i in range(6) if i != missing]
        assert code.is_sufficient(survivors)


@pytest.mark.parametrize("n, s", [(10, 2), (5, 1), (8, 2), (7, 3)])
def test_default_code_stays_within_the_fp32_budget(n: int, s: int) -> None:
    code = default_code(n, s)
    assert code.s >= s
    assert code.stability.amplification <= FP32_BUDGET, code.name


def test_default_code_without_a_code_in_budget_takes_the_best_conditioned() -> None:
    code = default_code(14, 4)  # no candidate is within budget here
    assert code.s >= 4
    assert code.stability.amplification <= random_cyclic(14, 4).stability.amplification / 100
