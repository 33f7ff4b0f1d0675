"""Stragglers that come back: real processes paused with SIGSTOP and resumed with SIGCONT.

Short versions of the soaks in :mod:`tests.loopback.soak` (the long ones run as a script).
Every result of every rank is checked against the exact sum.
"""

from __future__ import annotations

import pytest

from .soak import MARGIN, family_check, family_soak, intermediate_soak, random_soak

pytestmark = pytest.mark.loopback
# Each soak over the event loop's frames and with the chunks over lanes.
PATHS = pytest.mark.parametrize("extra", [(), ("--options", '{"lanes": true}')],
                                ids=["event-loop", "lanes"])


def _path(soak, lanes: bool) -> None:  # type: ignore[no-untyped-def]
    """Every judged step of every rank ran over the path the test means."""
    for rank in soak.lines:
        got = [s["lanes"] for s in soak.judged(rank) if "lanes" in s]
        assert got and set(got) == {lanes}, (rank, set(got))


@PATHS
def test_intermediate_rank_paused_two_deadlines_serves_its_children_again(extra) -> None:
    soak = intermediate_soak(deadline=1.0, after=20, extra=extra)
    _path(soak, bool(extra))
    rep = soak.report()
    assert rep["wrong"] == 0 and rep["errors"] == 0, rep
    assert rep["complete"], rep
    kids = (10, 11, 12)
    # The path we mean: while rank 3 was out its children took results from rank 0 ...
    assert all(any(s["link"] == "bypassed" for s in soak.judged(k)) for k in kids)
    # ... and from rank 3 again once it has caught up, to the end. How many steps the child
    # needs to notice is timing (rank 3's answer takes one hop more than rank 0's and must land
    # before the child's next step starts), so the check is: back to healthy, never away again.
    pause = soak.pauses[0]
    assert pause.caught_up is not None, "rank 3 never caught up"
    level = pause.cont + pause.caught_up
    for k in kids:
        after = [s["link"] for s in soak.judged(k) if s["t0"] >= level]
        assert "healthy" in after, (k, after)
        back = after.index("healthy")
        assert set(after[back:]) == {"healthy"} and len(after) - back >= 10, (k, after)
    assert rep["max_unpaused_step"] <= 1.0 + MARGIN, rep


@PATHS
def test_random_pauses_and_a_killed_leaf_no_error_no_wrong_result(extra) -> None:
    soak = random_soak(steps=150, seed=2, extra=extra)
    _path(soak, bool(extra))
    rep = soak.report()
    assert rep["pauses"] >= 2 and rep["killed"] is not None, rep
    assert rep["wrong"] == 0 and rep["errors"] == 0 and rep["complete"], rep
    assert rep["not_caught_up"] == 0, rep
    assert rep["max_unpaused_step"] <= soak.deadline + MARGIN, rep


@PATHS
def test_two_children_of_one_family_paused_every_rank_raises_then_recovers(extra) -> None:
    soak = family_soak(steps=100, seconds=4.0, extra=extra)
    _path(soak, bool(extra))
    rep = {**soak.report(), **family_check(soak)}
    assert rep["complete"] and rep["wrong"] == 0, rep
    assert rep["errors_while_out"] >= 10, rep  # every other rank raised, at least once
    assert rep["slow_errors"] == 0, rep  # each within deadline + margin
    assert rep["steps_until_exact_after_resume"] <= 3, rep
