"""``benchmarks/papers.py``'s plan and step runner, without running the experiments."""

from __future__ import annotations

import sys
from pathlib import Path

from .scripts import load

papers = load("papers")


def test_a_step_lands_its_results_in_a_folder_nobody_made_yet(tmp_path: Path) -> None:
    # (The full run's simulator step once failed after 26 minutes: its folder did not exist.)
    rows = tmp_path / "new" / "deeper" / "rows.jsonl"
    step = papers.Step("echo", [sys.executable, "-c", "print('{\"a\": 1}'); print('noise')"],
                       rows, lines="{")
    assert papers.run(step) >= 0
    assert rows.read_text() == '{"a": 1}\n'
    own = tmp_path / "own.jsonl"  # a command that writes its own file, copied to the results
    own.write_text("x\n")
    copied = tmp_path / "other" / "copy.jsonl"
    assert papers.run(papers.Step("copy", [sys.executable, "-c", "pass"], copied, own)) >= 0
    assert copied.read_text() == "x\n"


def test_the_full_plan_runs_every_experiment_and_the_report_last(tmp_path: Path) -> None:
    plan = papers.steps(tmp_path, quick=False, root=True, torch=True)
    names = [s.name for s in plan]
    assert names[-1] == "reproduction.md"
    for name in ("dose: delay", "dose: delay-large", "dose: slow", "dose: codes-40k",
                 "dose: codes-4m", "OptiReduce: tail", "OptiReduce: time to accuracy",
                 "simulator out of sample"):
        assert name in names, name
    # The report reads what the steps before it wrote, in this run's folder: the scores of
    # every sweep the simulator was not fitted to (the advisor's margin counts them all).
    report = plan[-1].argv
    for sub in ("", "heldout", "heldout-params"):
        assert str(tmp_path / "sweep" / sub / "out_of_sample.json") in report, sub
        assert any(str(Path("docs") / "sweep" / sub) in " ".join(s.argv) for s in plan
                   if s.name.startswith("simulator out of sample")), sub
    quick = papers.steps(tmp_path, quick=True, root=True, torch=True)
    assert not [s for s in quick if s.name.startswith("simulator out of sample")]
    assert str(papers.ROOT / "docs" / "sweep" / "heldout" / "out_of_sample.json") in \
        quick[-1].argv
