"""The background flows' bursts: parsed, validated, and drawn the same for the same seed."""

from __future__ import annotations

import itertools
import statistics

import pytest

from aioreduce.bench.flows import Bursts


def test_parse_and_validate() -> None:
    assert Bursts.parse("0.1,0.4") == Bursts(0.1, 0.4)
    assert Bursts().steady and not Bursts(0.1, 0.4).steady
    for bad in ("0.1", "a,b", "0,1", "0.1,0.2,0.3"):
        with pytest.raises(ValueError):
            Bursts.parse(bad)
    with pytest.raises(ValueError, match="pause"):
        Bursts(0.1, 0)
    with pytest.raises(ValueError):
        Bursts(-1, 1)


def test_schedule_is_seeded_and_has_the_means_asked() -> None:
    b = Bursts(0.1, 0.4)
    first = list(itertools.islice(b.schedule(3), 4000))
    assert first[:50] == list(itertools.islice(b.schedule(3), 50))
    assert first[:50] != list(itertools.islice(b.schedule(4), 50))
    on = statistics.fmean(x for x, _ in first)
    off = statistics.fmean(y for _, y in first)
    assert 0.09 < on < 0.11 and 0.36 < off < 0.44, (on, off)
    assert all(x > 0 and y > 0 for x, y in first)
