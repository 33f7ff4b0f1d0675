"""The sweep's grid: steps by vector size, cells left out, launches split to fit memory."""

from __future__ import annotations

import pytest

from aioreduce.bench.sweep import (
    DEFAULT_ITERS,
    DEFAULT_SKIP,
    Cell,
    Iterations,
    grid,
    launches,
    parse_skip,
)

MIB = 1 << 20
SCHEMES = ["ring", "coded-tree", "gc", "tree"]


def test_steps_by_vector_size() -> None:
    iters = Iterations.parse(DEFAULT_ITERS)
    assert [iters.for_size(s) for s in (40 << 10, 4 * MIB, 64 * MIB)] == [20, 20, 10]
    assert Iterations.parse("7").for_size(64 * MIB) == 7


@pytest.mark.parametrize("text", ["64M=10", "0", "20,64M=0"])
def test_step_counts_that_make_no_sense_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=repr(text)):
        Iterations.parse(text)


def test_the_default_grid_leaves_out_40_ranks_at_64_mib_only() -> None:
    cells = grid([13, 40], [40 << 10, 4 * MIB, 64 * MIB], ["none", "pause"],
                 parse_skip(DEFAULT_SKIP))
    assert len(cells) == 2 * 3 * 2 - 2
    assert {(c.nodes, c.size_bytes) for c in cells if c.size_bytes == 64 * MIB} == {(13, 64 * MIB)}
    assert len(grid([40], [64 * MIB], ["none"], parse_skip(""))) == 1
    with pytest.raises(ValueError, match="RANKSxSIZE"):
        parse_skip("40")


def test_a_cell_too_big_for_memory_runs_one_scheme_per_launch() -> None:
    memory = 24 << 30
    assert launches(Cell(13, 64 * MIB, "none"), SCHEMES, True, memory) == [(SCHEMES, True)]
    split = launches(Cell(40, 64 * MIB, "none"), SCHEMES, True, memory)
    assert split == [(["ring"], True), (["coded-tree"], False), (["gc"], False),
                     (["tree"], False)]
