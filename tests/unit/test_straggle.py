"""Straggler specs: parsing, errors that name the item, and the delays they produce."""

from __future__ import annotations

import numpy as np
import pytest

from aioreduce.straggle import parse_straggle


def test_delay_slow_and_targets() -> None:
    m = parse_straggle("rank=4:delay=0.5; rank=2,3:slow=3")
    assert m.extra_delay(4, 0, 0.1) == pytest.approx(0.5)
    assert m.extra_delay(2, 0, 0.1) == pytest.approx(0.2)  # (3 - 1) x its compute time
    assert m.extra_delay(3, 7, 0.0) == 0.0
    assert m.extra_delay(1, 0, 10.0) == 0.0
    assert parse_straggle("all:delay=0.1").extra_delay(9, 0, 0) == pytest.approx(0.1)
    assert not parse_straggle("") and parse_straggle("all:delay=0")


def test_shifted_exponential_is_seeded_and_has_the_right_mean() -> None:
    m = parse_straggle("all:shifted-exp=0.01,20", seed=3)
    draws = np.array([m.extra_delay(1, step, 0) for step in range(4000)])
    assert draws.min() >= 0.01
    assert draws.mean() == pytest.approx(0.01 + 1 / 20, rel=0.08)
    assert m.extra_delay(1, 5, 0) == m.extra_delay(1, 5, 0)  # same rank and step, same draw
    assert m.extra_delay(1, 5, 0) != m.extra_delay(2, 5, 0)


def test_load_exponential_scales_with_the_ranks_own_compute() -> None:
    # The papers' runtime: load x (shift + Exp). Twice the compute (twice the coded load),
    # twice the delay, draw for draw; no compute, no delay.
    m = parse_straggle("all:load-exp=2", seed=1)
    one = np.array([m.extra_delay(3, step, 0.01) for step in range(4000)])
    two = np.array([m.extra_delay(3, step, 0.02) for step in range(4000)])
    np.testing.assert_allclose(two, 2 * one)
    assert one.mean() == pytest.approx(0.01 / 2, rel=0.08)
    assert m.extra_delay(3, 0, 0.0) == 0.0
    assert m.extra_delay(3, 7, 0.01) != m.extra_delay(4, 7, 0.01)


def test_late_on_purpose_is_a_spike_that_hit_a_named_rank_or_the_paused_one() -> None:
    m = parse_straggle("all:shifted-exp=0.002,500;all:spike=0.05,0.2;rank=3:delay=0.1", seed=2)
    for rank in range(3):
        for step in range(200):
            spiked = m.extra_delay(rank, step, 0.0) >= 0.2  # (the exponential part is < 0.2)
            assert m.late_on_purpose(rank, step, 4) == spiked
    assert all(m.late_on_purpose(3, step, 4) for step in range(20))  # named: every step
    hit = sum(m.late_on_purpose(0, step, 4) for step in range(2000))
    assert 60 < hit < 140  # about 5 % of the steps
    paused = parse_straggle("all:pause=0.1,0.2", seed=5)
    for step in range(20):
        late = [r for r in range(4) if paused.late_on_purpose(r, step, 4)]
        assert late == [r for r in range(4) if paused.extra_delay(r, step, 0.0, 4) > 0]
        assert len(late) == 1
    assert not parse_straggle("all:shifted-exp=0.002,500").late_on_purpose(0, 0, 4)


@pytest.mark.parametrize("spec, message", [
    ("rank=4", "TARGET:MODEL"),
    ("node=4:delay=1", "target must be"),
    ("rank=x:delay=1", "bad rank list"),
    ("rank=4:fast=2", "model must be"),
    ("rank=4:slow=0.5", "slow >= 1"),
    ("all:shifted-exp=1", "model must be"),
    ("all:load-exp=0", "model must be"),
])
def test_bad_specs_name_the_item(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_straggle(f"all:delay=0.1;{spec}")
    assert spec.split(";")[0] in str(info.value)


def test_kill_model_names_the_rank_and_step() -> None:
    m = parse_straggle("rank=5:kill=10;rank=1:slow=2")
    assert not m.kills(5, 9) and m.kills(5, 10) and m.kills(5, 11)
    assert not m.kills(4, 10) and not m.kills(1, 100)
    with pytest.raises(ValueError, match="kill=STEP"):
        parse_straggle("rank=5:kill=soon")


def test_spike_model_adds_its_seconds_with_its_probability() -> None:
    model = parse_straggle("all:spike=0.02,0.3", seed=4)
    delays = [model.extra_delay(r, s, 0.0) for r in range(4) for s in range(5000)]
    assert set(delays) == {0.0, 0.3}
    assert 0.015 < delays.count(0.3) / len(delays) < 0.025
    assert parse_straggle("all:spike=0.02,0.3", seed=4).extra_delay(1, 7, 0) == delays[5007]
    with pytest.raises(ValueError, match="spike=PROB,SECONDS"):
        parse_straggle("all:spike=0.5")
    with pytest.raises(ValueError, match="non-negative"):
        parse_straggle("all:spike=2,0.1")


def test_pause_model_pauses_one_rank_per_step_the_same_on_every_rank() -> None:
    model = parse_straggle("all:pause=0.1,0.5", seed=2)
    world = 13
    victims = []
    for step in range(3000):
        delays = [model.extra_delay(r, step, 0.0, world) for r in range(world)]
        paused = [r for r, d in enumerate(delays) if d > 0]
        assert len(paused) == 1 and 0.1 <= delays[paused[0]] <= 0.5  # exactly one, in range
        assert model.stragglers(step, world) == frozenset(paused)  # what the benches leave out
        victims.append(paused[0])
    counts = np.bincount(victims, minlength=world)
    assert counts.min() > 0.6 * 3000 / world  # every rank takes its turn, about as often
    named = parse_straggle("rank=2,5:pause=0.2,0.2")
    assert {r for s in range(50) for r in named.stragglers(s, world)} == {2, 5}
    assert parse_straggle("rank=4:slow=3").stragglers(0, world) == frozenset({4})
    with pytest.raises(ValueError, match="world size"):
        model.extra_delay(0, 0, 0.0)
    with pytest.raises(ValueError, match="pause=LO,HI"):
        parse_straggle("all:pause=0.5,0.1")


def test_makespan_leaves_out_the_rank_paused_at_that_step() -> None:
    from aioreduce.bench.allreduce import makespans

    spec, world, first = "all:pause=0.3,0.3", 4, 5
    model = parse_straggle(spec)
    t = np.zeros((world, 3, 2))
    t[:, :, 1] = 1.0  # every rank done after 1 s ...
    for i in range(3):
        t[sorted(model.stragglers(first + i, world))[0], i, 1] = 9.0  # ... but the paused one
    assert list(makespans(spec, t, first)) == [1.0, 1.0, 1.0]
    assert list(makespans("", t, first)) == [9.0, 9.0, 9.0]
