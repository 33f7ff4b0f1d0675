"""Chaos soak of torch healing: ``aioreduce-launch -n 4 --restart 50`` runs ``torchheal.py``
(``--mode optimizer``: ``DistributedOptimizer``; ``--mode ddp``: DDP through
``aioreduce.torch.DistributedDataParallel``; ``--mode stock --init pg``: torch's own DDP class,
built by the program over the default group) while a controller SIGKILLs a random rank other than
0 every ``--every`` seconds or so, at whatever point of its iteration it is (forward, backward,
a bucket summing, the optimizer), the next kill once the last victim's replacement healed.

Checked: the launcher exits 0; every kill was answered by a replacement that healed; every
rank's final parameters are identical; under the optimizer they equal an undisturbed run's bit
for bit; under DDP (an iteration run again as one vector adds in another order) rank 0's are
within 1e-5 of the undisturbed run's in the iterations after each heal (over a whole run a
rounding difference can grow: see ``_ddp_check``). Printed: the kills and the time from each kill to
its replacement's heal. A script (exit 1 on a failed check)::

    python -m tests.loopback.torch_heal_soak --mode optimizer --steps 1000 --kills 10
    python -m tests.loopback.torch_heal_soak --mode ddp --steps 1000 --kills 10

``--device cuda``: the model and batches on the GPU (four ranks share it). ``--model
transformer``: a small transformer encoder instead of the MLP. Checked too: the model's loss
at the end (on a batch no rank trained on) within 1 % of the undisturbed run's.

``--rejoin-wait S`` (under a second: shorter than a replacement's start): the live ranks run
the iterations without a killed rank once S passed (the ring re-formed) and take its
replacement back at an iteration's start; the run is then not the undisturbed one (some
iterations summed three ranks' gradients), so the checks are exit 0, every kill healed (taken
back), identical replicas, and the loss at the end within 1 % of the undisturbed run's.
Printed too: how many times the ring ran without a rank, and took one back.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

PROG = Path(__file__).resolve().parent / "torchheal.py"
HEALED = re.compile(r"^\[(\d+)\] rank \d+ \(incarnation (\d+)\) healed from rank")
TRACE = re.compile(r"^\[(\d+)\] IT (\d+) (\d+) ?(.*)$")
WINDOW = 5  # iterations after a heal in which DDP must match the undisturbed run in rounding
# At most this many times the difference before a heal (or 1e-5) in its window: a heal that
# landed a wrong state (another iteration's parameters or momentum) jumps by 1e-2 against
# 1e-4 (lr x gradient); the transformer's largest rounding bump over 10 heals was 2.2x.
JUMP = 10.0


def _launch(mode: str, steps: int, pace: float, restart: int, save: str,
            device: str = "cpu", model: str = "mlp",
            rejoin_wait: float | None = None, init: str = "connect") -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "aioreduce_launch.cli", "-n", "4",
           *(["--restart", str(restart)] if restart else []), "--", sys.executable, str(PROG),
           "--mode", mode, "--steps", str(steps), "--pace", str(pace), "--save", save,
           "--device", device, "--model", model, "--init", init,
           *(["--trace"] if mode != "optimizer" else [])]
    wait = {} if rejoin_wait is None else {"AIOREDUCE_REJOIN_WAIT": str(rejoin_wait)}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **wait})


def _finals(stdout: str) -> list[dict]:
    return [json.loads(x.split("FINAL ", 1)[1]) for x in stdout.splitlines() if "FINAL " in x]


def _rank_process(launcher: psutil.Process, rank: int) -> psutil.Process | None:
    for child in launcher.children(recursive=True):
        try:
            if "torchheal.py" in " ".join(child.cmdline()) and \
                    child.environ().get("RANK") == str(rank):
                return child
        except psutil.Error:
            continue
    return None


def _trace(lines: list[str]) -> tuple[dict[int, np.ndarray], list[int]]:
    """From ``--trace`` lines: rank 0's parameter sample per iteration, and the iterations
    that a new incarnation of a rank ran first (where each heal's rerun landed)."""
    sample: dict[int, np.ndarray] = {}
    heals: list[int] = []
    seen: set[tuple[int, int]] = set()
    for line in lines:
        m = TRACE.match(line)
        if m is None:
            continue
        rank, it, incarnation = (int(m[i]) for i in (1, 2, 3))
        if rank == 0:  # (a replacement of rank 0 goes on with the samples)
            sample[it] = np.array([float(x) for x in m[4].split()])
        if incarnation > 0 and (rank, incarnation) not in seen:
            seen.add((rank, incarnation))
            heals.append(it)
    return sample, heals


def _differences(calm_lines: list[str], lines: list[str]
                 ) -> tuple[dict[int, float], list[int]]:
    """From the ``--trace`` lines of an undisturbed run and of one with kills: per iteration
    both ran, how far rank 0's parameter sample is from the undisturbed one's (the largest
    difference over the largest value); and the iterations where each heal landed."""
    want, _ = _trace(calm_lines)
    got, heals = _trace(lines)
    return ({it: float(np.abs(got[it] - want[it]).max() / np.abs(want[it]).max())
             for it in got if it in want}, heals)


def _ddp_check(calm_err: str, err_lines: list[str]) -> bool:
    """DDP runs an iteration again as one vector: the ring adds in another order, so the
    run leaves the undisturbed one by rounding, and a ReLU that flips on a rounding
    difference later (no kill near) makes that grow over hundreds of iterations (faster in
    a transformer). So each heal is checked where it lands: rank 0's parameters in the
    WINDOW iterations after it within 1e-5 (relative) of the undisturbed run's, or, once the
    run has drifted that far, within JUMP times the difference just before the heal (a heal
    that landed the wrong state jumps by orders of magnitude; rounding drifts by a few
    percent an iteration, with bumps of about 2x in a transformer). Printed: where the
    difference first passed 1e-5, the largest difference and the largest jump within a
    window."""
    diff, heals = _differences(calm_err.splitlines(keepends=True), err_lines)
    worst = max((diff.get(it, 0.0) for h in heals for it in range(h, h + WINDOW)),
                default=0.0)
    jumps = [max(diff.get(it, 0.0) for it in range(h, h + WINDOW))
             / max(diff.get(h - 1, 0.0), 1e-5) for h in heals]
    past = [it for it in sorted(diff) if diff[it] > 1e-5]
    print(f"heals landed at iterations {heals}; largest difference within {WINDOW} "
          f"iterations of one: {worst:.2e}; largest jump across one: "
          f"{max(jumps, default=0.0):.2f}x; first above 1e-5: "
          f"{past[0] if past else 'none'}; at the end {diff[max(diff)]:.2e}")
    return len(heals) > 0 and max(jumps) <= JUMP


def soak(mode: str, steps: int, pace: float, kills: int, every: float, seed: int,
         log: str = "", device: str = "cpu", model: str = "mlp",
         rejoin_wait: float | None = None, root_too: bool = False,
         init: str = "connect") -> bool:
    tmp = tempfile.mkdtemp(prefix="torch-heal-soak-")
    calm = _launch(mode, steps, 0.0, 0, f"{tmp}/calm", device, model, init=init)
    out, calm_err = calm.communicate(timeout=600)
    want = _finals(out)
    if calm.returncode != 0 or len(want) != 4:
        print("the undisturbed run failed:", calm_err[-2000:])
        return False
    job = _launch(mode, steps, pace, kills + 5, f"{tmp}/soak", device, model, rejoin_wait, init)
    launcher = psutil.Process(job.pid)
    err_lines: list[str] = []
    healed, training = threading.Event(), threading.Event()
    heal_times: list[float] = []
    killed_at = [0.0]

    def read_err() -> None:
        assert job.stderr is not None
        for line in job.stderr:
            err_lines.append(line)
            if line.startswith("[0] TRAINING"):
                training.set()
            if HEALED.match(line):
                heal_times.append(time.monotonic() - killed_at[0])
                healed.set()

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    rng = random.Random(seed)
    done = 0
    training.wait(120)  # a kill before the job runs would be a plain start, not a heal
    time.sleep(every)
    while done < kills and job.poll() is None:
        victim = (0 if done == 0 else rng.randrange(0, 4)) if root_too else rng.randrange(1, 4)
        proc = _rank_process(launcher, victim)
        if proc is None:
            time.sleep(0.05)
            continue
        healed.clear()
        killed_at[0] = time.monotonic()
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            continue
        done += 1
        print(f"kill {done}: rank {victim}", flush=True)
        if not healed.wait(120):
            print("no replacement healed within 120 s")
            break
        time.sleep(every * rng.uniform(0.5, 1.5))
    # stdout only: the reader thread has stderr (communicate() would read it too, and the
    # last iterations' trace lines went to whichever read first)
    assert job.stdout is not None
    out = job.stdout.read()
    job.wait(600)
    reader.join(10)
    got = _finals(out)
    ok = job.returncode == 0 and len(got) == 4 and len(heal_times) == done == kills
    ok = ok and len({f["params"] for f in got}) == 1
    if rejoin_wait is not None:  # (not the undisturbed run: the loss below is the check)
        text = "".join(err_lines)
        without = set(re.findall(r"did not come back within .* from step (\d+)", text))
        print(f"the ring ran without a rank {len(without)} times and took one back "
              f"{text.count('healed; the steps take them back')} times")
    elif ok and mode == "optimizer":
        ok = got[0]["params"] == want[0]["params"]
    elif ok:
        a, b = np.load(f"{tmp}/soak.0.npy"), np.load(f"{tmp}/calm.0.npy")
        print(f"largest difference from the undisturbed run at the end: "
              f"{np.abs(a - b).max() / np.abs(b).max():.2e} of the largest parameter")
        ok = _ddp_check(calm_err, err_lines)
    if len(got) == 4:  # the model's loss at the end, on a batch no rank trained on
        calm_loss, loss = want[0]["loss"], got[0]["loss"]
        print(f"loss at the end: {loss:.6g}, undisturbed {calm_loss:.6g} "
              f"({(loss / calm_loss - 1) * 100:+.3f} %)")
        ok = ok and abs(loss / calm_loss - 1) <= 0.01
    if not ok:  # (first: the verdict below stays the output's last lines)
        print("".join(err_lines[-60:]))
    print(f"{mode}: {done} kills, exit {job.returncode}, {len(heal_times)} heals, "
          f"identical replicas: {len({f['params'] for f in got}) == 1}, as undisturbed: {ok}")
    if heal_times:
        print(f"kill to the replacement's heal: median {statistics.median(heal_times):.2f} s, "
              f"max {max(heal_times):.2f} s")
    if log:  # the whole job's stderr, for the diagnosis of a run that went wrong
        Path(log).write_text("".join(err_lines))
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("optimizer", "ddp", "stock"), default="optimizer",
                    help="stock: torch's own DDP class built by the program (with --init pg)")
    ap.add_argument("--steps", type=int, default=1000, help="training iterations")
    ap.add_argument("--pace", type=float, default=0.01, help="seconds of sleep an iteration")
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--every", type=float, default=1.0, help="seconds between kills, about")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", default="", help="write the job's whole stderr to this file")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the model on the GPU)")
    ap.add_argument("--model", choices=("mlp", "transformer", "bn"), default="mlp",
                    help="transformer: a small transformer encoder; bn: the MLP with a "
                    "BatchNorm1d, buffers DDP syncs (torchheal.py)")
    ap.add_argument("--rejoin-wait", type=float, default=None,
                    help="seconds the ranks wait for a replacement before they run without "
                    "it (and take it back later); default: the launcher's 60")
    ap.add_argument("--root-too", action="store_true",
                    help="rank 0 among the victims (the first one), its replacement restarted "
                    "at the job's rendezvous address")
    ap.add_argument("--init", choices=("connect", "pg"), default="connect",
                    help="pg: init_process_group(backend='aioreduce'), the state hooks given "
                    "to aioreduce.torch.configure (torchheal.py)")
    a = ap.parse_args()
    sys.exit(0 if soak(a.mode, a.steps, a.pace, a.kills, a.every, a.seed, a.log, a.device,
                       a.model, a.rejoin_wait, a.root_too, a.init) else 1)


if __name__ == "__main__":
    main()
