"""The launcher's failure policy: tolerance, culprit, exit status, summary."""

from __future__ import annotations

import signal

from aioreduce_launch.policy import FailurePolicy, how_it_ended

PEER_LOST = ("Traceback (most recent call last):", "  ...",
             "aioreduce.errors.PeerLost: rank 2: connection reset")


def test_how_it_ended_names_signals() -> None:
    assert how_it_ended(128 + signal.SIGKILL) == "killed by SIGKILL"
    assert how_it_ended(128 + signal.SIGTERM) == "killed by SIGTERM"
    assert how_it_ended(3) == "exited with code 3"
    assert how_it_ended(255) == "exited with code 255"  # no signal 127


def test_default_policy_stops_at_the_first_death() -> None:
    p = FailurePolicy()
    assert not p.exited(0, "a", 0, [])
    assert p.exited(3, "a", 1, ["ValueError: bad"])
    p.stop()  # the launcher stops the job
    assert not p.exited(1, "a", 143, [])  # the launcher's own SIGTERM: not a death
    assert [d.rank for d in p.deaths] == [3]
    assert p.exit_code(None) == 1
    assert "culprit: rank 3 on a exited with code 1; its last lines:" in p.summary()


def test_tolerated_deaths_give_zero_and_are_listed() -> None:
    p = FailurePolicy(tolerate=2)
    assert not p.exited(5, "h1", 137, [])
    assert not p.exited(7, "h2", 1, ["boom"])
    assert p.exit_code(None) == 0
    text = "\n".join(p.summary())
    assert "rank 5 on h1 killed by SIGKILL" in text and "rank 7 on h2 exited with code 1" in text
    assert "culprit" not in text
    assert p.exited(8, "h2", 1, [])  # the third stops the job


def test_the_culprit_is_the_first_death_that_is_not_a_victim() -> None:
    p = FailurePolicy(tolerate=1)
    assert not p.exited(1, "a", 1, PEER_LOST)  # a victim happens to be seen first
    assert p.exited(2, "b", 137, [])
    assert p.culprit is not None and p.culprit.rank == 2
    assert p.exit_code(None) == 137


def test_only_victims_names_the_first_with_the_caveat() -> None:
    p = FailurePolicy()
    p.exited(4, "a", 1, PEER_LOST)
    assert p.culprit is not None and p.culprit.rank == 4
    assert any("every death reports a lost peer" in line for line in p.summary())


def test_interrupt_without_deaths_is_128_plus_signal() -> None:
    assert FailurePolicy().exit_code(signal.SIGINT) == 130


def test_restarts_are_counted_apart_rank0_included() -> None:
    p = FailurePolicy(tolerate=1, restart=3)
    assert p.restarts(3, "h", 137, []) and p.restarts(3, "h", 137, [])
    assert p.restarts(0, "h", 137, [])  # it comes back at the rendezvous address
    assert not p.restarts(4, "h", 137, [])  # none left: a death like any other
    assert not p.exited(4, "h", 137, [])  # tolerated
    assert not p.restarts(0, "h", 1, ["ValueError: x"])
    assert not p.restarts(5, "h", 0, [])  # a clean exit is no death
    assert p.exited(0, "h", 1, ["ValueError: x"])  # the second death stops the job
    text = "\n".join(p.summary())
    assert "rank 3 on h killed by SIGKILL; restarted (2 of at most 3)" in text
    assert "rank 0 on h killed by SIGKILL; restarted (3 of at most 3)" in text
    assert p.exit_code(None) == 137  # the culprit: the first death that was not restarted


def test_a_replacement_that_fails_after_the_job_finished_is_late_not_dead() -> None:
    p = FailurePolicy(restart=3)
    assert p.restarts(2, "h", 137, [])
    p.finished = True  # rank 0 exited 0
    assert not p.restarts(3, "h", 137, [])  # nothing is restarted once the job is over
    assert not p.exited(2, "h", 143, ["PeerLost: rank 1: no live peer healed this rank"])
    assert p.late == [2] and not p.deaths and p.exit_code(None) == 0
    assert any("rank 2's replacement came after the job had finished" in x for x in p.summary())
    assert p.exited(3, "h", 137, [])  # an original process's death still counts
