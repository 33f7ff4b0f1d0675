"""The dose-response bench's pure parts (``aioreduce/bench/dose.py``): the confidence interval
over repeats, the dose as a straggler spec on a leaf, each cell's tree shape, and the table."""

from __future__ import annotations

import math
import statistics

import pytest

from aioreduce.bench import dose


def test_the_interval_is_students_t_over_the_repeats() -> None:
    e = dose.estimate([0.010, 0.012, 0.014])
    assert e.mean == pytest.approx(0.012) and e.n == 3
    assert e.half_width == pytest.approx(4.303 * statistics.stdev([10, 12, 14]) / 1e3
                                         / math.sqrt(3))
    assert math.isnan(dose.estimate([0.5]).half_width)  # one run: no interval
    assert dose.t95(11) == 2.228  # between rows: the wider one's
    assert dose.t95(100) == 1.96
    with pytest.raises(ValueError):
        dose.t95(0)


def test_the_dose_lands_on_the_last_rank_a_leaf_of_every_tree() -> None:
    assert dose.straggle_spec(13, 0.2, "delay") == "rank=12:delay=0.2"
    assert dose.straggle_spec(13, 0.0, "delay") == ""  # no dose: the calm run
    assert dose.straggle_spec(7, 3, "slow") == "rank=6:slow=3"
    assert dose.straggle_spec(7, 1, "slow") == ""
    with pytest.raises(ValueError, match="unknown dose"):
        dose.straggle_spec(7, 1, "fast")


@pytest.mark.parametrize("nodes, fanout, levels", [(7, 2, 2), (13, 3, 2), (21, 4, 2),
                                                   (31, 2, 4), (40, 3, 3)])
def test_each_size_gets_its_full_tree_and_the_repeat_its_seed(nodes: int, fanout: int,
                                                               levels: int) -> None:
    cfg = dose.cell_config(nodes, 0.1, "delay", 2, schemes=dose.SCHEMES, size_bytes=40960,
                           iters=10, warmup=3, compute=0.0, netns=True, link_mbit=None,
                           latency=1e-4)
    assert (cfg.fanout, cfg.levels, cfg.seed) == (fanout, levels, 2)
    assert cfg.straggle == f"rank={nodes - 1}:delay=0.1" and cfg.latency == 1e-4
    both = dose.cell_config(nodes, 1, "slow", 0, schemes=dose.SCHEMES, size_bytes=40960,
                            iters=10, warmup=3, compute=0.05, netns=True, link_mbit=None,
                            latency=0.0, straggle="all:load-exp=2")
    assert both.straggle == "all:load-exp=2"  # no dose at 1x: the model for every rank alone
    with pytest.raises(ValueError, match="no full tree"):
        dose.cell_config(12, 0.1, "delay", 0, schemes=dose.SCHEMES, size_bytes=40960,
                         iters=10, warmup=3, compute=0.0, netns=False, link_mbit=None,
                         latency=0.0)


def test_the_table_gives_each_cell_its_estimates_and_the_coded_trees_ratios() -> None:
    rows = [{"nodes": 13, "dose": d, "scheme": s, "median_s": m}
            for d, s, m in [(0.0, "coded-tree", 0.010), (0.0, "coded-tree", 0.012),
                            (0.0, "tree", 0.010), (0.0, "tree", 0.010),
                            (0.0, "ring", 0.020), (0.0, "ring", 0.020),
                            (0.2, "coded-tree", 0.011), (0.2, "tree", 0.211)]]
    text = dose.table(dose.summarize(rows), "delay")
    lines = text.splitlines()
    assert lines[0].startswith("| ranks | dose (s delay) | coded-tree ms | tree ms | ring ms")
    assert lines[2].startswith("| 13 | 0 | 11.00 ± ") and lines[2].endswith("| 1.10 | 0.55 |")
    assert lines[3] == "| 13 | 0.2 | 11.00 | 211.00 | - | 0.05 | - |"  # one run, no ring


def test_the_ratios_are_paired_within_each_launch_and_the_plot_is_drawn(tmp_path) -> None:
    """The coded tree's step over another's is taken launch by launch (schemes alternated in
    one launch share its noise), then averaged with its interval; the plot draws both."""
    rows = []
    for repeat, (coded, tree) in enumerate([(1.0, 4.0), (3.0, 6.0), (2.0, 10.0)]):
        for scheme, median in (("coded-tree", coded), ("tree", tree)):
            rows.append({"nodes": 7, "dose": 0.5, "scheme": scheme, "median_s": median,
                         "repeat": repeat, "kind": "delay", "size_bytes": 40960})
    est = dose.ratios(rows, "coded-tree")[(7, 0.5, "tree")]
    pairs = [1 / 4, 3 / 6, 2 / 10]
    assert est.n == 3 and math.isclose(est.mean, statistics.fmean(pairs))
    # not the ratio of the means (6 / 20): the pairing is the point
    assert not math.isclose(est.mean, 6 / 20)
    png = dose.plot(rows, tmp_path / "dose.png")
    assert png.stat().st_size > 10_000
