"""The failover state machine on its own: every transition, and the requests it asks for."""

from __future__ import annotations

from aioreduce.schemes.reduce import Ask, Link, ParentFailover


def test_healthy_parent_is_the_only_source() -> None:
    fo = ParentFailover(parent=1, grandparent=0)
    assert fo.step_started(5) == []
    fo.answered(1, 5)
    assert fo.state is Link.HEALTHY and not fo.uses_grandparent


def test_silent_parent_asks_both_then_bypasses_then_recovers() -> None:
    fo = ParentFailover(parent=1, grandparent=0)
    assert fo.deadline_passed(3) == [Ask(1, 3), Ask(0, 3)]
    assert fo.state is Link.SILENT
    assert fo.deadline_passed(3) == []  # asked once per step
    fo.answered(0, 3)
    assert fo.state is Link.BYPASSED
    assert fo.step_started(4) == [Ask(0, 4)]  # the grandparent is asked at once now
    fo.answered(0, 4)
    assert fo.state is Link.BYPASSED
    fo.answered(1, 4)  # the parent's probe arrived: it is back
    assert fo.state is Link.HEALTHY
    assert fo.step_started(5) == []
    assert [(a.value, b.value) for a, b, _ in fo.transitions] == [
        ("healthy", "silent"), ("silent", "bypassed"), ("bypassed", "healthy")]


def test_we_were_paused_and_the_parent_answers_the_request() -> None:
    fo = ParentFailover(parent=1, grandparent=0)
    fo.deadline_passed(7)
    fo.answered(1, 7)
    assert fo.state is Link.HEALTHY


def test_silent_step_without_any_answer_starts_the_next_one_healthy() -> None:
    fo = ParentFailover(parent=1, grandparent=0)
    fo.deadline_passed(2)
    assert fo.step_started(3) == [] and fo.state is Link.HEALTHY


def test_lost_parent_goes_to_the_grandparent_until_it_answers_again() -> None:
    fo = ParentFailover(parent=1, grandparent=0)
    assert fo.parent_lost(2) == [Ask(0, 2)]
    assert fo.state is Link.LOST
    assert fo.deadline_passed(2) == []  # already asked
    assert fo.step_started(3) == [Ask(0, 3)]
    fo.parent_back()
    assert fo.state is Link.BYPASSED
    fo.answered(1, 3)
    assert fo.state is Link.HEALTHY


def test_child_of_the_root_asks_its_parent_again() -> None:
    fo = ParentFailover(parent=0, grandparent=None)
    assert fo.deadline_passed(9) == [Ask(0, 9)]
    assert not fo.uses_grandparent
    assert fo.parent_lost(9) == []
