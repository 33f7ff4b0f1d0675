"""Logistic regression by gradient descent, the workload of the gradient-coding papers.

    aioreduce-launch -n 13 -- python examples/logreg.py --scheme coded-tree \\
        --fanout 3 --levels 2 --stragglers 1 --straggle 'rank=4:slow=3'
    aioreduce-launch -n 8 -- python examples/logreg.py --scheme transpose --loss 0.01
    python examples/logreg.py --reference        # the same GD in one process

A synthetic two-component Gaussian mixture with labels from a logistic model (as in the
papers' scripts). Each rank computes the gradient on its own samples: under a coded scheme on
the weighted samples ``node.placement`` gives it, otherwise on an even share. The loss rides
along as one more coordinate of the vector (it is linear in the sample weights too), so the
aggregate gives the exact loss and gradient of the whole data set. Rank 0 prints every step's
time, loss and the ranks that were skipped.

Under the bounded-time ``transpose`` scheme a step may use an inexact sum (what arrived by
the deadline; ``--loss P`` drops that fraction of slices on arrival, as a lossy network
would). A step the safety valve refuses is skipped; every ``--resync-every`` steps the ranks
take rank 0's parameters, so replicas that used stand-ins cannot drift apart; and at the end
the final parameters are evaluated exactly (a ring allreduce), so the summary's
``final_loss`` is the true loss of the model, whatever the steps used.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

import aioreduce as ar
from aioreduce.codes import cyclic_mds, default_code, frc
from aioreduce.schemes import by_name


def sample_rows(ids: np.ndarray, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Features and labels of the given samples; the same on every rank for the same id."""
    truth = np.random.default_rng([seed, 1, 0]).standard_normal(dim) / np.sqrt(dim)
    mu = np.random.default_rng([seed, 2, 0]).standard_normal(dim) / np.sqrt(dim)
    X = np.empty((len(ids), dim))
    y = np.empty(len(ids))
    for row, i in enumerate(ids):
        rng = np.random.default_rng([seed, 0, int(i)])
        side = 1.0 if rng.random() < 0.5 else -1.0
        X[row] = side * mu + rng.standard_normal(dim)
        p = 1.0 / (1.0 + np.exp(-X[row] @ truth))
        y[row] = 1.0 if rng.random() < p else -1.0
    return X, y


def weighted_grad_and_loss(theta: np.ndarray, X: np.ndarray, y: np.ndarray,
                           w: np.ndarray) -> np.ndarray:
    """[sum_i w_i grad l_i(theta), sum_i w_i l_i(theta)] for the logistic loss."""
    margin = y * (X @ theta)
    loss = np.logaddexp(0.0, -margin)  # log(1 + exp(-margin)), stable
    coef = -y / (1.0 + np.exp(margin))  # d loss / d (x . theta)
    out = np.empty(len(theta) + 1)
    out[:-1] = X.T @ (w * coef)
    out[-1] = w @ loss
    return out


def make_scheme(a: argparse.Namespace, world: int) -> ar.Scheme:
    code = None
    if a.scheme == "gc":
        code = {"frc": frc, "cyclic": cyclic_mds}.get(a.code, default_code)(world - 1,
                                                                             a.stragglers)
    if a.scheme == "transpose":
        rotation = {"always": True, "never": False, "after_loss": "after_loss"}
        return ar.Transpose(hadamard=rotation["never" if a.no_hadamard else a.hadamard],
                            inject_loss=a.loss,
                            max_loss=a.max_loss, missing=a.missing,
                            resync_every=a.resync_every)
    return by_name(a.scheme, strict=False, fanout=a.fanout, levels=a.levels,
                   stragglers=a.stragglers, deadline=a.deadline, code=code)


async def distributed(a: argparse.Namespace) -> list[float]:
    # --straggle wins over AIOREDUCE_STRAGGLE, which from_env reads otherwise.
    node = ar.Node.from_env(**({"straggle": a.straggle} if a.straggle else {}))
    async with node:
        scheme = make_scheme(a, node.world_size)
        await node.use(scheme)
        if scheme.coded:
            ids, w = node.placement(a.samples)
        else:
            ids = np.array_split(np.arange(a.samples), node.world_size)[node.rank]
            w = np.ones(len(ids))
        X, y = sample_rows(ids, a.dim, a.seed)
        theta = np.zeros(a.dim)
        losses, times, received, refused = [], [], [], 0
        for t in range(a.steps):
            def compute(th: np.ndarray = theta) -> np.ndarray:
                return weighted_grad_and_loss(th, X, y, w)

            last_theta = theta  # losses[-1] is the loss at the last step's parameters
            call = node.aggregate if scheme.coded else node.allreduce
            try:
                res = await call(compute)
            except (ar.StragglerError, ar.FellBehind) as exc:  # bounded-time: skip the update
                refused += 1
                if node.rank == 0:
                    print(f"step {t:3d}  skipped the update: {exc}", flush=True)
                continue
            grad, loss = res.value[:-1] / a.samples, res.value[-1] / a.samples
            loss += 0.5 * a.l2 * float(theta @ theta)
            theta = theta - a.lr * (grad + a.l2 * theta)
            losses.append(float(loss))
            times.append(res.seconds)
            received.append(res.received)
            if res.resync:  # every rank takes rank 0's parameters (an exact broadcast)
                theta = (await node.broadcast(theta, root=0)).value.copy()
            if node.rank == 0:
                print(f"step {t:3d}  {res.seconds * 1e3:8.2f} ms  loss {loss:.10f}  "
                      f"skipped {res.late}"
                      + (f"  received {res.received:.2%}" if not res.exact else ""),
                      flush=True)
        final = losses[-1] if losses else float("nan")
        if isinstance(scheme, ar.Transpose):  # its steps may be inexact: evaluate exactly
            final = await exact_loss(node, last_theta, X, y, w, a)
        if node.rank == 0:
            print("SUMMARY " + json.dumps({"scheme": a.scheme, "ranks": node.world_size,
                                           "final_loss": final,
                                           "median_step_s": statistics.median(times[1:])
                                           if len(times) > 1 else times[0],
                                           "received": statistics.fmean(received),
                                           "refused": refused, "losses": losses}), flush=True)
        return losses


async def exact_loss(node: ar.Node, theta: np.ndarray, X: np.ndarray, y: np.ndarray,
                     w: np.ndarray, a: argparse.Namespace) -> float:
    """The true loss of rank 0's ``theta`` over the whole data set (an exact ring)."""
    theta = (await node.broadcast(theta, root=0)).value
    await node.use(ar.Ring())
    total = (await node.allreduce(weighted_grad_and_loss(theta, X, y, w))).value
    return float(total[-1] / a.samples + 0.5 * a.l2 * float(theta @ theta))


def reference(a: argparse.Namespace) -> list[float]:
    """The same gradient descent in one process, on all samples."""
    X, y = sample_rows(np.arange(a.samples), a.dim, a.seed)
    w = np.ones(a.samples)
    theta = np.zeros(a.dim)
    losses = []
    for t in range(a.steps):
        v = weighted_grad_and_loss(theta, X, y, w)
        grad, loss = v[:-1] / a.samples, v[-1] / a.samples
        loss += 0.5 * a.l2 * float(theta @ theta)
        theta = theta - a.lr * (grad + a.l2 * theta)
        losses.append(float(loss))
        print(f"step {t:3d}  loss {loss:.10f}", flush=True)
    print("SUMMARY " + json.dumps({"scheme": "reference", "ranks": 1, "final_loss": losses[-1],
                                   "losses": losses}), flush=True)
    return losses


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scheme", default="coded-tree",
                   choices=["coded-tree", "gc", "ring", "tree", "star", "transpose"])
    p.add_argument("--fanout", type=int, default=3)
    p.add_argument("--levels", type=int, default=2)
    p.add_argument("--stragglers", type=int, default=1)
    p.add_argument("--code", default="default", choices=["default", "frc", "cyclic"],
                   help="gradient code for --scheme gc")
    p.add_argument("--straggle", default="", metavar="SPEC",
                   help="inject stragglers, e.g. 'rank=4:slow=3' (see aioreduce.straggle)")
    p.add_argument("--samples", type=int, default=1560)
    p.add_argument("--dim", type=int, default=5000)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--l2", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=30.0)
    p.add_argument("--loss", type=float, default=0.0,
                   help="transpose: drop this fraction of slices on arrival (experiments)")
    p.add_argument("--hadamard", default="after_loss", choices=["after_loss", "always", "never"],
                   help="transpose: when to rotate (the scheme's default: after a loss)")
    p.add_argument("--no-hadamard", action="store_true", help="transpose: --hadamard never")
    p.add_argument("--missing", default="rescale", choices=["zero", "rescale"],
                   help="transpose: what a missing contribution becomes (the scheme's "
                        "default: rescale)")
    p.add_argument("--max-loss", type=float, default=1.0,
                   help="transpose: refuse a step missing more than this fraction")
    p.add_argument("--resync-every", type=int, default=10,
                   help="transpose: take rank 0's parameters every K steps (0: never)")
    p.add_argument("--reference", action="store_true",
                   help="run the same gradient descent in this one process")
    a = p.parse_args(argv)
    if a.reference:
        reference(a)
        return
    t0 = time.perf_counter()
    ar.run(distributed(a))
    print(f"total {time.perf_counter() - t0:.2f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
