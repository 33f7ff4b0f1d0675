"""``scheme="auto"`` on real ranks: every rank runs rank 0's pick, which is the simulator's,
and the sums are exact; a small vector gets a tree, a large one the ring."""

from __future__ import annotations

import pytest

from aioreduce.costmodel import auto

from .harness import HERE, Ranks

pytestmark = pytest.mark.loopback


@pytest.mark.parametrize("nbytes", [40_000, 16 << 20])
def test_auto_runs_the_predicted_scheme_on_every_rank(ranks, nbytes: int) -> None:
    job: Ranks = ranks(7)
    job.start_all(str(nbytes), prog=str(HERE / "autoprog.py"))
    done = job.wait(240)
    chosen = set()
    for rank, d in done.items():
        assert d.returncode == 0, (rank, d.err[-2000:])
        assert d.out.splitlines()[-1] == "OK"
        chosen |= {line[6:] for line in d.out.splitlines() if line.startswith("CHOSE ")}
    want = auto.build(auto.choose(7, nbytes // 8 * 8, auto.GENERIC)[0])
    assert chosen == {repr(want)}
    assert ("Ring" in repr(want)) == (nbytes > 1 << 20)
