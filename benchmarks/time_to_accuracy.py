"""Time to accuracy of a real training run on emulated hosts with background flows: stock DDP
(``examples/torch_ddp.py``, an MLP on scikit-learn's digits) over our transpose, our ring and
Gloo, every rank on its own network namespace with shaped links and bulk TCP flows between
the hosts as other tenants (``aioreduce.bench.cluster``). Prints, per run, the training time
until the test accuracy first reached ``--target``, the final accuracy, the median step and
the least fraction of gradients a transpose step received. Needs root, iproute2 and the
``examples`` extra.

    python benchmarks/time_to_accuracy.py [--hosts 8] [--flows 4] [--link-mbit 1000]
        [--epochs 15] [--hidden 1024] [--batch 16] [--target 0.95] [--repeats 1]
        [--runs transpose,transpose-norot,transpose-resync,transpose-rescale,ring,gloo]
        [--straggle MODEL]
        [--transpose-options JSON] [--json]

The training time starts after a barrier, once every rank has its process group: it includes
the first steps' one-time costs (our lanes open at the first sum; the transpose's warm-up
steps wait for everything).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from aioreduce.bench.allreduce import run_on_cluster

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "torch_ddp.py")
RUNS = {"transpose": ["--scheme", "transpose"],
        # the transpose without the Hadamard rotation: what the rotation buys where slices
        # are cut (it spreads a cut slice's loss over the whole vector)
        "transpose-norot": ["--scheme", "transpose", "--options", '{"hadamard": false}'],
        # the transpose under aioreduce.torch.DistributedDataParallel, which broadcasts rank
        # 0's parameters when a step reports that the replicas drifted apart (a cut slice)
        "transpose-resync": ["--scheme", "transpose", "--via", "hook"],
        # a cut contribution estimated, not dropped: each reduced slice scaled by N over the
        # contributions it holds, a missing reduced slice N times this rank's own
        "transpose-rescale": ["--scheme", "transpose", "--options", '{"missing": "rescale"}'],
        "ring": ["--scheme", "ring"], "gloo": ["--backend", "gloo"]}


def one(name: str, a: argparse.Namespace) -> dict[str, object]:
    argv = [sys.executable, EXAMPLE, "--epochs", str(a.epochs), "--hidden", str(a.hidden),
            "--batch", str(a.batch), "--lr", str(a.lr), *RUNS[name]]
    if a.straggle:
        argv += ["--straggle", a.straggle]
    if name.startswith("transpose"):  # the transpose's options, beside the run's own
        argv = _with_options(argv, json.loads(a.transpose_options))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AIOREDUCE_GC_EVERY": "50"}
    out = run_on_cluster(a.hosts, a.link_mbit, a.flows, argv, env, timeout=1800)
    epochs = [json.loads(line[len("EPOCH "):]) for line in out.splitlines()
              if line.startswith("EPOCH ")]
    if not epochs:
        raise RuntimeError(f"{name}: no EPOCH line in:\n{out[-2000:]}")
    reached = next((e["elapsed_s"] for e in epochs if e["test"] >= a.target), None)
    # The step-time tail after the first epoch (which holds the one-time costs).
    steps = sorted(t for e in epochs[1:] for t in e["steps_s"])
    return {"run": name, "time_to_target_s": reached, "final_test": epochs[-1]["test"],
            "final_loss": epochs[-1]["loss"], "train_s": epochs[-1]["elapsed_s"],
            "p99_over_p50": (steps[min(len(steps) - 1, int(0.99 * len(steps)))]
                             / steps[len(steps) // 2]) if steps else None,
            "median_step_ms": 1e3 * sorted(e["median_step_s"] for e in epochs)[len(epochs) // 2],
            "least_received": min(e["received"] for e in epochs)}


def _with_options(argv: list[str], extra: dict[str, object]) -> list[str]:
    """``argv`` with ``extra`` merged into its ``--options`` JSON (added if it has none)."""
    if not extra:
        return argv
    if "--options" in argv:
        i = argv.index("--options") + 1
        return [*argv[:i], json.dumps({**json.loads(argv[i]), **extra}), *argv[i + 1:]]
    return [*argv, "--options", json.dumps(extra)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--flows", type=int, default=4, help="background flows between hosts")
    p.add_argument("--link-mbit", type=float, default=1000.0)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--target", type=float, default=0.95, help="test accuracy to reach")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--runs", default="transpose,transpose-norot,ring,gloo")
    p.add_argument("--json", action="store_true", help="also a RESULT line of JSON per run")
    p.add_argument("--transpose-options", default="{}", metavar="JSON",
                   help='the transpose\'s options for both of its runs, e.g. \'{"max_loss": 0.2}\' '
                        "(by default a step that would lose more than 5 %% waits for the rest)")
    p.add_argument("--straggle", default="",
                   help="a straggler model for every run (see the README), e.g. "
                        "'all:shifted-exp=0.002,500' (Gloo's runs get it too)")
    a = p.parse_args()
    print(f"{a.hosts} emulated hosts, {a.link_mbit:g} Mbit/s links, {a.flows} background "
          f"flows; MLP hidden {a.hidden}, batch {a.batch} per rank, {a.epochs} epochs; target "
          f"test accuracy {a.target}\n")
    print("| run | time to target | training time | final accuracy | final loss | median step "
          "| step P99/P50 | least received |")
    print("|---|---|---|---|---|---|---|---|")
    for _ in range(a.repeats):
        for name in a.runs.split(","):
            r = one(name, a)
            t = r["time_to_target_s"]
            print(f"| {name} | {'not reached' if t is None else f'{t:.2f} s'} | "
                  f"{r['train_s']:.2f} s | {r['final_test']:.3f} | {r['final_loss']:.4f} | "
                  f"{r['median_step_ms']:.1f} ms | {r['p99_over_p50']:.2f} | "
                  f"{r['least_received']:.3f} |", flush=True)
            if a.json:
                print("RESULT " + json.dumps({**vars(a), **r}), flush=True)


if __name__ == "__main__":
    main()
