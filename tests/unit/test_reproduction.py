"""OptiReduce's row of docs/reproduction.md comes from the measured runs' files only: the
figures are the files', the verdict follows from them, and without files it says so."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from .scripts import load

ROOT = Path(__file__).resolve().parents[2]
reproduction = load("reproduction")


def _tta(run: str, seconds: float) -> dict[str, object]:
    return {"run": run, "time_to_target_s": seconds, "train_s": 2 * seconds,
            "final_loss": 0.08, "least_received": 1.0, "target": 0.95, "hosts": 8,
            "link_mbit": 1000.0, "flows": 16}


def test_the_optireduce_row_is_made_from_the_files(tmp_path: Path) -> None:
    assert "not measured" in reproduction.optireduce_row(tmp_path)
    tail = [{"scheme": s, "nodes": 4, "size_bytes": 1 << 20, "rank_p50_s": 0.1,
             "rank_p99_s": p, "lost": 0.002 if s == "transpose" else 0.0}
            for s, p in (("transpose", 0.11), ("ring", 0.13), ("gloo", 0.12))]
    (tmp_path / "tail.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tail)
                                         + json.dumps({"scheme": "gloo,transpose,ring"}))
    (tmp_path / "tta.jsonl").write_text("".join(
        "RESULT " + json.dumps(_tta(run, t)) + "\n"
        for run, t in (("transpose", 4.0), ("transpose-norot", 4.5), ("ring", 6.0),
                       ("gloo", 10.0))))
    row = reproduction.optireduce_row(tmp_path)
    assert "rank P99/P50 transpose 1.10 (0.20 % lost), ring 1.30, Gloo 1.20" in row
    assert "transpose 4.00 s, without the rotation 4.50 s, ring 6.00 s, Gloo 10.00 s" in row
    assert "transpose / Gloo 0.40" in row
    assert "the tail is flatter than the ring's and Gloo's" in row
    assert "time to accuracy 60% faster than Gloo at worst" in row
    assert "**reproduced in part**" in row


def test_the_held_out_cell_is_set_against_the_simulator_from_the_files(tmp_path: Path
                                                                        ) -> None:
    # The sentence under the table: the cell the sweep leaves out, from its results file,
    # against the simulator's prediction with the costs fitted at that cluster size.
    assert reproduction.heldout_sentence(tmp_path, {}) == ""
    heldout = ROOT / "docs" / "sweep" / "heldout-40x64m"
    platforms = reproduction.load_platforms(ROOT / "docs" / "sweep" / "costs.json")
    rows = [json.loads(x) for x in (heldout / "results.jsonl").read_text().splitlines()]
    checks = reproduction.compare(reproduction.from_sweep(rows, reproduction.row_config),
                                  platforms[40])
    sentence = reproduction.heldout_sentence(heldout, platforms)
    assert {c.measured.scheme for c in checks} == {"ring", "gloo", "tree"}
    for c in checks:
        assert (f"{c.measured.scheme} {c.measured.median:.2f} s against {c.predicted:.2f} s "
                f"({c.error:+.0%})") in sentence
    assert "40 ranks at 64 MiB" in sentence and "5 steps" in sentence


def test_the_coded_tree_rows_conditions_come_from_the_dose_response_runs(tmp_path: Path
                                                                          ) -> None:
    """Where the claim holds is read from the dose-response runs: a cell holds when the
    lower end of its 95 % interval (over launches, each launch's coded tree paired with its
    own baseline) reaches the claim, fails when the upper end is below it, and is undecided
    otherwise; the verdict is "partly" when only the dose-response runs reach it."""
    rows = []
    for repeat, (calm, slow, near) in enumerate(((2.0, 20.0, 6.0), (2.2, 21.0, 9.0),
                                                 (1.8, 19.0, 7.0))):
        for dose, speedup in ((0.0, calm), (0.5, slow), (0.05, near)):
            rows += [{"nodes": 13, "dose": dose, "repeat": repeat, "scheme": "coded-tree",
                      "median_s": 0.01},
                     {"nodes": 13, "dose": dose, "repeat": repeat, "scheme": "ring",
                      "median_s": 0.01 * speedup}]
    (tmp_path / "delay.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cells = reproduction.dose_cells(tmp_path, "ring")
    assert [(c.nodes, c.dose) for c in cells] == [(13, 0.0), (13, 0.05), (13, 0.5)]
    text = reproduction.conditions(cells, 7.0)
    assert text.startswith("7x or more with 95 % confidence in 1 of 3 dose-response cells "
                           "(13 ranks, 0.5s delay: 20.0x")
    assert "less in 1 (13 ranks, 0s delay: 2.0x" in text
    assert "undecided in 1 (13 ranks, 0.05s delay:" in text
    assert reproduction.verdict(7.0, 2.0, [0.5], cells) == "**partly**"
    assert reproduction.verdict(7.0, 2.0, [0.5], []) == "**not reproduced**"
    assert reproduction.conditions([], 7.0) == "no dose-response runs"


def test_a_cell_of_one_launch_is_undecided_in_both_rows(tmp_path: Path) -> None:
    """One launch gives no interval: the cell is neither held nor failed, whether it is a
    dose-response cell or a code cell (the two rows decide through the same rule)."""
    rows = [{"nodes": 13, "dose": 0.0, "repeat": 0, "scheme": "coded-tree", "median_s": 0.01},
            {"nodes": 13, "dose": 0.0, "repeat": 0, "scheme": "ring", "median_s": 0.02}]
    (tmp_path / "delay.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = reproduction.conditions(reproduction.dose_cells(tmp_path, "ring"), 7.0)
    assert "in 0 of 1" in text and "less in 0 (none); undecided in 1 (13 ranks, 0s" in text
    codes = {(13, 40960): (0.9, math.nan, math.nan)}
    text = reproduction.codes_conditions(codes, 0.16)
    assert "in 0 of 1" in text and "less in 0 (none); undecided in 1 (n=12, 41 KB: -10 %)" in text


def test_the_codes_row_reads_paired_launches_and_says_where_the_saving_holds(
        tmp_path: Path) -> None:
    rows = []
    for repeat, gain in enumerate((0.75, 0.78, 0.76)):  # m=2 over m=1, per launch
        rows += [{"nodes": 40, "dose": 1.0, "repeat": repeat, "size_bytes": 40960,
                  "scheme": reproduction.GAUSSIAN, "median_s": 0.1 * gain},
                 {"nodes": 40, "dose": 1.0, "repeat": repeat, "size_bytes": 40960,
                  "scheme": reproduction.DEFAULT, "median_s": 0.1}]
    (tmp_path / "codes-40k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    codes = reproduction.measured_codes(tmp_path)
    mean, lo, hi = codes[(40, 40960)]
    assert mean == pytest.approx(0.7633, abs=1e-3) and lo < mean < hi < 0.84
    text = reproduction.codes_conditions(codes, 0.16)
    assert text.startswith("16% or more saved with 95 % confidence in 1 of 1 cells "
                           "(n=39, 41 KB: -24 %")
    assert "less in 0 (none)" in text


def test_the_out_of_sample_sentence_is_made_from_the_scores_files(tmp_path: Path) -> None:
    path, other = tmp_path / "out_of_sample.json", tmp_path / "heldout" / "out_of_sample.json"
    assert "not scored out of sample" in reproduction.held_out_scores([path])
    score = {"cells": 50, "median_abs_error": 0.11, "worst": "40/40960/slow3/ring",
             "worst_error": 0.76, "picks": 10}
    path.write_text(json.dumps([
        {**score, "split": "in sample: 40 ranks", "axis": "in sample", "advisor_right": 10,
         "rule_right": 8, "rules": {"pause rule": 8, "ring": 3}},
        {**score, "split": "ranks: 40 ranks", "axis": "ranks", "advisor_right": 9,
         "rule_right": 8, "rules": {"pause rule": 8, "ring": 3}}]))
    other.parent.mkdir()
    other.write_text(json.dumps([
        {**score, "split": "parameters: 13 ranks", "axis": "parameters", "advisor_right": 8,
         "rule_right": 7, "rules": {"pause rule": 7, "ring": 9}},
        # the same cells drawn again: not counted twice in the totals
        {**score, "split": "parameters, other draws: 13", "axis": "parameters, other draws",
         "advisor_right": 8, "rule_right": 7, "rules": {"pause rule": 7, "ring": 9}}]))
    text = reproduction.held_out_scores([path, other])
    assert "ranks: 40 ranks: median error 11% over 50 cells, worst 40/40960/slow3/ring +76%" \
        in text
    assert "In sample: 40 ranks: median error 11%" in text
    # the best rule over the counted picks is the pause rule (15 of 20; the ring 12)
    assert "the advisor was right in 17 of 20 picks and the best of 2 simple rules (pause " \
        "rule) in 15: the advisor ahead by 2." in text
