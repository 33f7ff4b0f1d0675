"""Command line: ``aioreduce-launch -n N [options] -- CMD [ARGS...]``.

Starts N ranks of CMD on this machine with the environment contract of :mod:`.plan`, prefixes
every output line with its rank, and applies the failure policy of :mod:`.supervise`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import sys
from collections.abc import Sequence

from aioreduce.jobplan import HostSlots, JobConfig, RankSpec, free_ports, plan_ranks

from . import torchstore
from .hostfile import (
    LOCAL_NAMES,
    HostEntry,
    HostfileError,
    filter_hosts,
    parse_hosts_arg,
    read_hostfile,
)
from .local import LocalRank
from .remote import RemoteHost, SSHError, SSHOptions, connect_all
from .spares import Spares
from .supervise import RankHandle, Supervisor

REJOIN_WAIT_S = 60.0  # --restart: how long a failed step waits for a replacement
TOLERATE_WAIT_S = 1.0  # --tolerate alone: none comes; the ring goes on without the dead rank


class UsageError(Exception):
    """Bad command line; printed without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aioreduce-launch",
        usage="aioreduce-launch [HOSTFILE | -H HOSTS | -n N] [options] -- CMD [ARGS...]",
        description="Start the ranks of an aioreduce job on this machine or on hosts over SSH, "
                    "tag their output, and stop them all on the first failure or Ctrl-C.")
    p.add_argument("hostfile", nargs="?", metavar="HOSTFILE",
                   help="lines of '[user@]host [slots=N] [ssh_port=P] [addr=A] [max_slots=M]'")
    p.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...", help="hosts instead of a file")
    p.add_argument("-n", "--np", type=int, metavar="N",
                   help="number of ranks (default: all slots; alone: N ranks on this machine)")
    p.add_argument("-i", "--include", metavar="SPEC", help="only these hosts/slots, e.g. "
                   "'worker-0@worker-1:0,2' (DeepSpeed syntax)")
    p.add_argument("-e", "--exclude", metavar="SPEC", help="all hosts/slots but these")
    p.add_argument("--kill-timeout", type=float, default=10.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default 10)")
    p.add_argument("--tolerate", type=int, default=0, metavar="K",
                   help="up to K ranks may die without stopping the job, for schemes that "
                        "finish without them (coded-tree, gc; the ring after "
                        "AIOREDUCE_REJOIN_WAIT seconds, default 1, re-formed over the live "
                        "ranks); the summary names them (default 0: the first death stops the "
                        "job)")
    p.add_argument("--restart", type=int, default=0, metavar="N",
                   help="restart a rank that dies, up to N times in all, on its host; the new "
                        "process rejoins the running job and heals its state from a live "
                        "peer (see docs/heal.md); a step that lost it (the ring's) waits up "
                        "to AIOREDUCE_REJOIN_WAIT seconds (default 60) for it and runs again; "
                        "a rank whose host was lost goes to a spare host (spare=yes in the "
                        "hostfile) (default 0)")
    p.add_argument("--cause-wait", type=float, default=3.0, metavar="S",
                   help="when the deaths that stop the job all report a lost peer, wait up to "
                        "S seconds for the rank that caused them before stopping the others, "
                        "so the summary names it (default 3)")
    p.add_argument("--no-tag-output", action="store_true",
                   help="do not prefix output lines with [rank]")
    p.add_argument("--output-dir", metavar="DIR",
                   help="also write each rank's stdout/stderr to DIR/rank.N.{stdout,stderr}")
    p.add_argument("-x", dest="export", action="append", default=[], metavar="VAR[=VAL]",
                   help="pass VAR (with its value here, or VAL) to every rank; repeatable")
    p.add_argument("--env-file", metavar="FILE",
                   help="pass the VAR=VAL lines of FILE to every rank")
    p.add_argument("--master-port", type=int, metavar="PORT",
                   help="MASTER_PORT for the ranks (aioreduce's rendezvous uses PORT+1; "
                        "default: a free port)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the rank placement and commands, start nothing")
    ssh = p.add_argument_group("SSH (hosts other than localhost)")
    ssh.add_argument("-p", "--ssh-port", type=int, metavar="PORT",
                     help="SSH port of every host (default: ssh config, else 22)")
    ssh.add_argument("--ssh-user", metavar="USER",
                     help="user on every host (default: ssh config, else yours)")
    ssh.add_argument("-I", "--ssh-identity-file", metavar="FILE",
                     help="private key to log in with (default: ssh config and agent)")
    ssh.add_argument("--ssh-config", metavar="FILE", help="default: ~/.ssh/config")
    ssh.add_argument("--ssh-known-hosts", metavar="FILE|none",
                     help="default: ~/.ssh/known_hosts; 'none' disables host key checks")
    ssh.add_argument("--connect-timeout", type=float, default=15.0, metavar="S",
                     help="seconds to reach and authenticate each host (default 15)")
    ssh.add_argument("--python", metavar="PATH", default=sys.executable,
                     help="interpreter for the remote agent (default: this launcher's, for "
                          "clusters with a shared environment)")
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


def host_list(opts: argparse.Namespace) -> list[HostEntry]:
    """The job's hosts from HOSTFILE, -H, or this machine alone."""
    if opts.hostfile and opts.hosts:
        raise UsageError("give a HOSTFILE or -H, not both")
    if opts.hostfile:
        entries = read_hostfile(opts.hostfile)
    elif opts.hosts:
        entries = parse_hosts_arg(opts.hosts)
    else:
        if opts.np is None or opts.np < 1:
            raise UsageError("give a HOSTFILE, -H HOSTS, or the number of ranks with -n N")
        entries = [HostEntry("localhost", opts.np)]
    return filter_hosts(entries, opts.include, opts.exclude)


def job_ports(opts: argparse.Namespace, first: HostEntry) -> tuple[int, int]:
    """(MASTER_PORT, aioreduce rendezvous port) on the first host."""
    if opts.master_port:
        return opts.master_port, opts.master_port + 1
    if first.is_local:
        master, rendezvous = free_ports(2)  # (both used: torch's store and ours)
        return master, rendezvous
    # A remote host's free ports cannot be probed from here: pick from a quiet range.
    base = random.randrange(20000, 40000, 2)
    return base, base + 1


async def launch(opts: argparse.Namespace, command: list[str]) -> int:
    entries = host_list(opts)
    if any(not e.is_local for e in entries):
        unroutable = [e.where or e.host for e in entries if e.is_local and e.addr is None]
        if unroutable:
            raise UsageError(f"{', '.join(unroutable)}: a localhost entry in a job with remote "
                             "hosts needs addr=<this machine's address>, so remote ranks can "
                             "reach its ranks")
    if opts.tolerate < 0:
        raise UsageError("--tolerate K: K must be 0 or more")
    if opts.restart < 0:
        raise UsageError("--restart N: N must be 0 or more")
    master_port, rendezvous_port = job_ports(opts, entries[0])
    job = JobConfig(master_addr=entries[0].data_addr, master_port=master_port,
                    rendezvous_port=rendezvous_port,
                    user_env=user_env(opts.export, opts.env_file))
    if (opts.restart or opts.tolerate) and "AIOREDUCE_REJOIN_WAIT" not in os.environ:
        # a step that lost a rank waits this long for the replacement, and a ring then goes
        # on without it (see aioreduce.heal)
        job.user_env.setdefault("AIOREDUCE_REJOIN_WAIT",
                                str(REJOIN_WAIT_S if opts.restart else TOLERATE_WAIT_S))
    # torch's store outlives rank 0 where the launcher, or rank 0's host's agent, serves it
    # (see torchstore; the agent where torch is installed there)
    keep_store = bool(opts.restart) and "TORCHELASTIC_USE_AGENT_STORE" not in os.environ
    serve_store = keep_store and entries[0].is_local and torchstore.available()
    if serve_store:
        job.user_env.update(torchstore.AGENT_STORE)
    agent_store = ((job.master_addr, job.master_port)
                   if keep_store and not entries[0].is_local else None)
    if "OMP_NUM_THREADS" in os.environ:  # the user's own setting reaches the ranks as is
        job.user_env.setdefault("OMP_NUM_THREADS", os.environ["OMP_NUM_THREADS"])
    spare_entries = [e for e in entries if e.spare]
    if any(e.is_local for e in spare_entries):
        raise UsageError("a spare host must be a remote one (this machine is never lost alone)")
    entries = [e for e in entries if not e.spare]
    if not entries:
        raise UsageError("every host is a spare: name at least one without spare=yes")
    slots = [HostSlots(e.host, e.slots, addr=None if e.is_local else e.data_addr,
                       cores=os.cpu_count() if e.is_local else None) for e in entries]
    spares = Spares([HostSlots(e.host, e.slots, addr=e.data_addr) for e in spare_entries],
                    len(entries))
    try:
        specs = plan_ranks(slots, job, opts.np)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    by_host: dict[str, list[RankSpec]] = {}
    for spec in specs:
        by_host.setdefault(spec.host.name, []).append(spec)
    if opts.dry_run:
        for spec in specs:
            via = "local" if spec.host.name in LOCAL_NAMES else "ssh"
            print(f"rank {spec.rank}: host {spec.host.name} ({via}) node_rank {spec.node_rank} "
                  f"local_rank {spec.local_rank}: {shlex.join(command)}")
        print(f"MASTER_ADDR={job.master_addr} MASTER_PORT={job.master_port} "
              f"AIOREDUCE_MASTER_PORT={job.rendezvous_port}")
        return 0

    store = torchstore.serve(job.master_addr, job.master_port) if serve_store else None
    remote_entries = [e for e in entries if not e.is_local and e.host in by_host]
    remote_entries += spare_entries if opts.restart else []
    ssh_opts = SSHOptions(opts.ssh_port, opts.ssh_user, opts.ssh_identity_file,
                          opts.ssh_config, opts.ssh_known_hosts, opts.connect_timeout,
                          opts.python)
    hosts: list[RemoteHost] = []
    if remote_entries:
        try:
            conns = await connect_all(remote_entries, ssh_opts)
        except SSHError as exc:
            raise UsageError(f"cannot reach every host, nothing started: {exc}") from None
        hosts = [RemoteHost(e.host, conns[e.host], ssh_opts) for e in remote_entries]

    ranks: list[RankHandle] = []
    tag = not opts.no_tag_output
    spec_of = {spec.rank: spec for spec in specs}

    host_of = {h.name: h for h in hosts}

    async def restart(old: RankHandle) -> RankHandle:
        now = spec_of[old.rank]
        lost = now.host.name in host_of and host_of[now.host.name].lost
        spec = spec_of[old.rank] = spares.place(now, lost)
        if spec.host.name in host_of:  # that host's agent starts it
            return host_of[spec.host.name].restart(spec, tag, opts.output_dir)
        return await LocalRank.start(spec, command, tag=tag, output_dir=opts.output_dir,
                                     restarted=True)

    supervisor = Supervisor(ranks, kill_timeout=opts.kill_timeout, tolerate=opts.tolerate,
                            cause_wait=opts.cause_wait, restart=opts.restart,
                            restarter=restart)
    try:
        for e in entries:
            if e.is_local and e.host in by_host:
                for spec in by_host[e.host]:
                    ranks.append(await LocalRank.start(spec, command, tag=tag,
                                                       output_dir=opts.output_dir))
        for host in hosts:  # a spare host's agent starts with no rank
            ranks.extend(await host.start(by_host.get(host.name, []), command, os.getcwd(),
                                          opts.kill_timeout, tag, opts.output_dir,
                                          agent_store if host.name == entries[0].host
                                          else None))
        ranks.sort(key=lambda r: r.rank)
        return await supervisor.run()
    except OSError as exc:
        for r in ranks:
            r.signal(9)
        raise UsageError(f"cannot start {command[0]!r}: {exc.strerror or exc}") from None
    finally:
        await asyncio.gather(*(h.close() for h in hosts), return_exceptions=True)
        del store  # (served until every rank is gone)


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
    except (UsageError, HostfileError) as exc:
        sys.stderr.write(f"aioreduce-launch: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
