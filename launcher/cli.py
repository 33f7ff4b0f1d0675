"""Command line: ``aioreduce-launch -n N [options] -- CMD [ARGS...]``.

Starts N ranks of CMD on this machine with the environment contract of :mod:`.plan`, prefixes
every output line with its rank, and applies the failure policy of :mod:`.supervise`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence

from aioreduce.jobplan import HostSlots, JobConfig, free_port, plan_ranks

from .local import LocalRank
from .supervise import RankHandle, Supervisor


class UsageError(Exception):
    """Bad command line; printed without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aioreduce-launch",
        usage="aioreduce-launch -n N [options] -- CMD [ARGS...]",
        description="Start the ranks of an aioreduce job, tag their output, and stop them all "
                    "on the first failure or Ctrl-C.")
    p.add_argument("-n", "--np", type=int, metavar="N", help="number of ranks")
    p.add_argument("--kill-timeout", type=float, default=10.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default 10)")
    p.add_argument("--no-tag-output", action="store_true",
                   help="do not prefix output lines with [rank]")
    p.add_argument("--output-dir", metavar="DIR",
                   help="also write each rank's stdout/stderr to DIR/rank.N.{stdout,stderr}")
    p.add_argument("-x", dest="export", action="append", default=[], metavar="VAR[=VAL]",
                   help="pass VAR (with its value here, or VAL) to every rank; repeatable")
    p.add_argument("--env-file", metavar="FILE",
                   help="pass the VAR=VAL lines of FILE to every rank")
    p.add_argument("--master-port", type=int, metavar="PORT",
                   help="MASTER_PORT for the ranks (default: a free port)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the rank placement and commands, start nothing")
    return p


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split at the first ``--`` into launcher options and the rank command."""
    argv = list(argv)
    if "--" not in argv:
        raise UsageError("separate the command with --, e.g. aioreduce-launch -n 4 -- python "
                         "train.py")
    i = argv.index("--")
    if i + 1 == len(argv):
        raise UsageError("no command after --")
    return argv[:i], argv[i + 1:]


def user_env(exports: list[str], env_file: str | None) -> dict[str, str]:
    """Variables from ``-x`` and ``--env-file`` (file first; ``-x`` wins)."""
    env: dict[str, str] = {}
    if env_file:
        try:
            with open(env_file) as fh:
                lines = fh.read().splitlines()
        except OSError as exc:
            raise UsageError(f"--env-file {env_file}: {exc.strerror}") from None
        for lineno, line in enumerate(lines, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, value = line.removeprefix("export ").partition("=")
            if not sep or not name.strip().isidentifier():
                raise UsageError(f"{env_file}:{lineno}: expected VAR=VALUE, got {line!r}")
            env[name.strip()] = value.strip().strip("'\"")
    for item in exports:
        name, sep, value = item.partition("=")
        if not name.isidentifier():
            raise UsageError(f"-x {item}: not a variable name")
        if not sep:
            if name not in os.environ:
                raise UsageError(f"-x {name}: not set in the launcher's environment")
            value = os.environ[name]
        env[name] = value
    return env


async def launch(opts: argparse.Namespace, command: list[str]) -> int:
    if opts.np is None or opts.np < 1:
        raise UsageError("give the number of ranks with -n N (N >= 1)")
    job = JobConfig(master_addr="127.0.0.1",
                    master_port=opts.master_port or free_port(),
                    rendezvous_port=free_port(),
                    user_env=user_env(opts.export, opts.env_file))
    if "OMP_NUM_THREADS" in os.environ:  # the user's own setting reaches the ranks as is
        job.user_env.setdefault("OMP_NUM_THREADS", os.environ["OMP_NUM_THREADS"])
    specs = plan_ranks([HostSlots("localhost", opts.np, cores=os.cpu_count())], job, opts.np)
    if opts.dry_run:
        for s in specs:
            print(f"rank {s.rank}: host {s.host.name} local_rank {s.local_rank}: "
                  f"{shlex.join(command)}")
        return 0
    ranks: list[RankHandle] = []
    supervisor = Supervisor(ranks, kill_timeout=opts.kill_timeout)
    try:
        for spec in specs:
            ranks.append(await LocalRank.start(spec, command, tag=not opts.no_tag_output,
                                               output_dir=opts.output_dir))
    except OSError as exc:
        for r in ranks:
            r.signal(9)
        raise UsageError(f"cannot start {command[0]!r}: {exc.strerror}") from None
    return await supervisor.run()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``aioreduce-launch``."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        if args and args[0] in ("-h", "--help"):
            build_parser().print_help()
            return 0
        options, command = split_argv(args)
        opts = build_parser().parse_args(options)
        from aioreduce.transport.loop import run

        return run(launch(opts, command))
    except UsageError as exc:
        sys.stderr.write(f"aioreduce-launch: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
