"""A rank of a scheme test: ``python schemeprog.py SCHEME [options]``.

Every rank computes deterministic data, runs ``--steps`` aggregation steps and prints one JSON
line per step (``STEP {...}``) with the relative error of the result against the exact sum,
which every rank can compute on its own (the data of the step the node is at: after
``FellBehind`` it jumps ahead). ``--options JSON`` passes more scheme options. Ranks listed in
``--die`` SIGKILL themselves at ``--die-step``; ``--stop`` ranks SIGSTOP themselves instead.
``--pace S`` makes each step's compute a function that takes S seconds (as a trainer's would);
``--gap S`` waits S seconds between steps instead (compute outside the step: a pause of T
seconds then spans at most T / S of its peers' steps, however fast the machine);
each line then also carries the wall-clock start and end (``t0``, ``t1``) and the rank's
failover state (``link``). ``--flood KIND --flood-rank R --flood-to T``: at ``--die-step`` rank
R (authenticated: it is a rank of the job) floods rank T over its connection with far-ahead,
early, tiny or control frames (see :func:`_flood`), prints ``FLOOD {...}`` and leaves the job.
``--state``: the rank keeps a "model" (the running sum of its results, skipped on a failed
step), gives it to the node as its state (:class:`aioreduce.StateHooks`, so a replacement of
a killed rank heals it from a peer) and prints ``FINAL {...}`` with its digest at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

import numpy as np

import aioreduce as ar
from aioreduce.codes import cyclic_mds, frc, gaussian_mds
from aioreduce.schemes import by_name
from aioreduce.wire.control import Register

SAMPLES = 0  # set per scheme


def sample_grads(num_samples: int, dim: int, step: int) -> np.ndarray:
    """Per-sample "gradients" for one step: deterministic, different every step."""
    base = np.random.default_rng(12345).standard_normal((num_samples, dim))
    return base * (1.0 + 0.1 * step) + step


def make_scheme(args: argparse.Namespace) -> ar.Scheme:
    code = None
    if args.scheme.startswith("gc-"):
        n = int(os.environ["WORLD_SIZE"]) - 1
        code = {"gc-frc": lambda: frc(n, args.stragglers),
                "gc-cyclic": lambda: cyclic_mds(n, args.stragglers),
                "gc-gaussian": lambda: gaussian_mds(n, args.stragglers, 2)}[args.scheme]()
    name = "gc" if code is not None else args.scheme
    options = {"fanout": args.fanout, "levels": args.levels, "stragglers": args.stragglers,
               "chunk_bytes": args.chunk_bytes, "code": code, "deadline": args.deadline,
               "on_insufficient": "approximate" if args.approximate else "raise",
               **json.loads(args.options)}
    return by_name(name, strict=False, **options)


def _debug_dump(node: ar.Node) -> None:
    """SIGUSR1: print every task's stack (to debug hangs)."""
    import asyncio

    for task in asyncio.all_tasks():
        task.print_stack(limit=6, file=sys.stderr)
    sys.stderr.flush()


async def main(args: argparse.Namespace) -> None:
    scheme = make_scheme(args)
    model = np.zeros(args.dim)

    def load(blob: memoryview) -> None:
        model[:] = np.frombuffer(blob, np.float64)

    hooks = ar.StateHooks(lambda: model.tobytes(), load) if args.state else None
    closing = {} if args.close_timeout is None else {"close_timeout": args.close_timeout}
    async with ar.Node.from_env(scheme=scheme, state=hooks, **closing) as node:
        import asyncio

        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, _debug_dump, node)
        me = node.rank
        if scheme.coded:
            num = _fit(scheme) if isinstance(scheme, ar.CodedTree) else scheme.code.k * 2
            ids, weights = node.placement(num)
        stopped = False
        while node.step < args.steps:
            if args.gap and node.step:
                await asyncio.sleep(args.gap)  # pacing the workload, not a synchronisation
            step = node.step  # the data of the step the node runs (it may jump ahead)
            part_norms = None
            if me in args.die and step == args.die_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if me in args.stop and step >= args.die_step and not stopped:
                stopped = True
                os.kill(os.getpid(), signal.SIGSTOP)
            if args.flood and me == args.flood_rank and step == args.die_step:
                print("FLOOD " + json.dumps(await _flood(node, args.flood, args.flood_to,
                                                         step)), flush=True)
                os._exit(0)  # a compromised rank leaves without a goodbye
            if scheme.coded:
                g = sample_grads(num, args.dim, step)
                mine = weights @ g[ids] if len(ids) else np.zeros(args.dim)
                truth = g.sum(axis=0)
                if isinstance(scheme, ar.GradientCoding):
                    parts = g.reshape(scheme.code.k, -1, args.dim).sum(axis=1)
                    part_norms = np.linalg.norm(parts, axis=1)
            else:
                rng = np.random.default_rng([me, step])
                mine = rng.standard_normal(args.dim).astype(args.dtype)
                truth = None  # the sum over the ranks the result used (a ring may leave some out)
            t0 = time.monotonic()
            wall0 = time.time()
            arg = mine if not args.pace else _paced(mine, args.pace)
            try:
                if args.in_place:  # the result lands in this rank's own vector
                    res = await node.allreduce(mine, in_place=True)
                else:
                    res = await (node.aggregate(arg) if scheme.coded else node.allreduce(arg))
            except (ar.StragglerError, getattr(ar, "FellBehind", ar.StragglerError)) as exc:
                kind = "straggler" if isinstance(exc, ar.StragglerError) else "behind"
                print("STEP " + json.dumps({"step": step, "error": kind,
                                            "healed": getattr(exc, "healed", False),
                                            "missing": getattr(exc, "missing", []),
                                            # (FellBehind: the step the node jumps to)
                                            "current": getattr(exc, "current_step", None),
                                            "message": str(exc), "t0": wall0,
                                            "t1": time.time(), "link": _link(node),
                                            "deadline": _deadline(node),
                                            "seconds": time.monotonic() - t0}), flush=True)
                continue
            if truth is None:
                truth = sum(np.random.default_rng([r, step]).standard_normal(args.dim)
                            .astype(args.dtype).astype(np.float64) for r in res.used)
            err = float(np.linalg.norm(res.value - truth) / np.linalg.norm(truth))
            model += res.value
            out = {"step": step, "result_step": res.step, "rel_err": err,
                   "inc": node.mesh.incarnations.mine,
                   "retried": res.step != step,  # a lost rank's replacement came: run again
                   "value": hashlib.sha256(np.ascontiguousarray(res.value)).hexdigest()[:16]
                   if args.state else None,
                   "seconds": res.seconds, "used": res.used, "late": res.late,
                   "exact": res.exact, "error_bound": res.error_bound, "t0": wall0,
                   "t1": time.time(), "link": _link(node), "received": res.received,
                   "stand_in": res.stand_in, "deadline": res.deadline,
                   "into_own": bool(np.shares_memory(res.value, mine)),
                   "lanes": getattr(node.session, "lanes_open", None),
                   "lane_peers": getattr(node.session, "lane_peers", None),
                   "wall": time.monotonic() - t0}
            if part_norms is not None and not res.exact:
                out["abs_err"] = float(np.linalg.norm(res.value - truth))
                out["bound"] = res.error_bound * float(np.linalg.norm(part_norms))
            print("STEP " + json.dumps(out), flush=True)
        if args.state:
            digest = hashlib.sha256(model.tobytes()).hexdigest()
            print("FINAL " + json.dumps({"rank": me, "digest": digest,
                                         "incarnation": node.mesh.incarnations.mine,
                                         "hosts": node.mesh.hosts}),
                  flush=True)


async def _flood(node: ar.Node, kind: str, to: int, step: int) -> dict[str, object]:
    """Send rank ``to`` what an authenticated but buggy or hostile rank could: frames far
    beyond the current step, 1024 early 1 MiB frames, 300k tiny frames, 2000 control
    messages of 60 KiB. Returns how many went out before ``to`` closed the connection."""
    import asyncio

    from aioreduce.schemes.reduce.family import REQUEST_TAG

    mesh = node.mesh
    sent, error = 0, ""
    mib = np.ones(1 << 17)  # 1 MiB
    empty = np.empty(0, np.uint8)
    count = {"ahead": 16, "early": 1024, "tiny": 300_000, "control": 2000}[kind]
    t0 = time.monotonic()
    try:
        for i in range(count):
            if kind == "ahead":
                await mesh.send(to, mib[:1], step=step + 10**7 + i, tag=0)
            elif kind == "early":
                await mesh.send(to, mib, step=step + 2 + i % 1000, tag=REQUEST_TAG + 1 + i)
            elif kind == "tiny":
                await mesh.send(to, empty, step=step + 2 + i % 1000, tag=REQUEST_TAG + 1 + i)
            else:
                await mesh.send_control(to, Register("x" * 60_000, 0, 0))  # never read
            sent += 1
            if i % 256 == 0:
                await asyncio.sleep(0)  # let the connection notice it was closed
                if mesh.is_lost(to):
                    break
    except Exception as exc:  # the target closed the connection: what we expect
        error = f"{type(exc).__name__}: {exc}"
    return {"kind": kind, "sent": sent, "of": count, "error": error,
            "seconds": round(time.monotonic() - t0, 2)}


def _paced(vector: np.ndarray, seconds: float):  # type: ignore[no-untyped-def]
    """This step's compute as a function that takes ``seconds`` (run in a worker thread)."""
    def compute() -> np.ndarray:
        time.sleep(seconds)
        return vector
    return compute


def _link(node: ar.Node) -> str | None:
    """Where this rank takes results from (its failover state), for the soak's checks."""
    failover = getattr(node.session, "failover", None)
    return None if failover is None else str(failover.state.value)


def _deadline(node: ar.Node) -> float | None:
    """The stage bound a bounded-time session used last (None for other schemes)."""
    return getattr(node.session, "last_deadline", None)


def _fit(scheme: ar.CodedTree) -> int:
    return scheme.min_samples * 2


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING"),
                        format="%(asctime)s %(name)s %(message)s")
    p = argparse.ArgumentParser()
    p.add_argument("scheme")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dim", type=int, default=1000)
    p.add_argument("--fanout", type=int, default=3)
    p.add_argument("--levels", type=int, default=2)
    p.add_argument("--stragglers", type=int, default=1)
    p.add_argument("--deadline", type=float, default=30.0)
    p.add_argument("--approximate", action="store_true")
    p.add_argument("--options", default="{}", help="more scheme options, as JSON")
    p.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    p.add_argument("--in-place", action="store_true",
                   help="allreduce(in_place=True): uncoded schemes, no --pace")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.add_argument("--die", type=lambda s: [int(x) for x in s.split(",") if x], default=[])
    p.add_argument("--stop", type=lambda s: [int(x) for x in s.split(",") if x], default=[])
    p.add_argument("--die-step", type=int, default=5)
    p.add_argument("--close-timeout", type=float, default=None,
                   help="Node(close_timeout=...): how long the closing barrier waits for a rank "
                        "(one --stop left stopped never comes; default Node's)")
    p.add_argument("--pace", type=float, default=0.0)
    p.add_argument("--gap", type=float, default=0.0,
                   help="seconds between steps (a trainer's compute outside the step)")
    p.add_argument("--state", action="store_true")
    p.add_argument("--flood", choices=["ahead", "early", "tiny", "control"])
    p.add_argument("--flood-rank", type=int, default=5)
    p.add_argument("--flood-to", type=int, default=1)
    ar.run(main(p.parse_args(sys.argv[1:])))
