"""An emulated cluster on one machine: network namespaces as hosts, shaped links, teardown.

Each host is a network namespace with one interface ``eth0`` (address ``10.213.<net>.<i+1>``,
chosen per cluster), connected by a veth pair to a bridge that lives in a namespace of its own
(the "switch"), so nothing in the machine's own namespace can route to the test subnet.
Each host's TCP runs cubic (``congestion``), whatever this machine's default is, and does not
restart an idle connection from its initial window (``idle_restart``).
With ``rate_mbit``, each link is shaped with ``tbf`` in **both** directions (egress of the
host's ``eth0`` and egress of the switch-side end), like a real NIC: shaping only egress lets a
master receive from many peers at once and flatters star topologies.

Requires root and iproute2 (``ip``, ``tc``); :class:`ClusterUnavailable` says why otherwise.
Everything is torn down on exit of the context manager, on interpreter exit, and processes left
inside the namespaces are killed first. Namespaces are named ``arx<pid>-...`` so a later run can
remove those of a run that died (:func:`remove_stale`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

from . import congestion as congestion_list
from . import cpushare
from .flows import Bursts
from .owner import orphaned

log = logging.getLogger("aioreduce.bench")
PREFIX = "arx"


SSHD_CONFIG = """\
Port 22
ListenAddress {addr}
HostKey {host_key}
PidFile {workdir}/sshd_{i}.pid
AuthorizedKeysFile {workdir}/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
MaxStartups 64
LogLevel ERROR
"""


@dataclass(frozen=True)
class SSHAccess:
    """How to log in to the cluster's sshd hosts."""

    client_key: str
    known_hosts: str


class ClusterUnavailable(RuntimeError):
    """This machine cannot host an emulated cluster (not root, no iproute2, ...)."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and res.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip() or res.stdout.strip()}")
    return res


def available() -> str | None:
    """None if clusters can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs {tool} (apt-get install iproute2)"
    probe = f"{PREFIX}probe{os.getpid()}"
    res = _run("ip", "netns", "add", probe, check=False)
    if res.returncode:
        return f"cannot create network namespaces: {res.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def _pids_in(ns: str) -> list[int]:
    res = _run("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split()]


def kill_namespace_processes(ns: str, sig: int = signal.SIGKILL) -> int:
    """Signal every process inside namespace ``ns``; return how many there were."""
    pids = _pids_in(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return len(pids)


def remove_stale() -> list[str]:
    """Delete namespaces (and CPU groups) of clusters whose creating process is gone."""
    res = _run("ip", "netns", "list", check=False)
    removed = []
    for line in res.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if orphaned(name, PREFIX):
            kill_namespace_processes(name)
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return (removed + cpushare.remove_stale(PREFIX)
            + [f"congestion hold {h}" for h in congestion_list.remove_stale()])


@dataclass
class Cluster:
    """``hosts`` namespaces on a bridge; use as a context manager."""

    hosts: int
    rate_mbit: float | None = None
    # Each host's TCP congestion control: Linux's default, not this machine's setting (a
    # namespace inherits the machine's, and BBR's estimates with a dozen flows through a
    # shaped link swing widely: docs/schemes.md). None: the machine's.
    congestion: str | None = "cubic"
    # Linux's tcp_slow_start_after_idle: a connection idle for longer than its retransmission
    # timeout starts again from its initial window. Off here: schemes that alternate in one run
    # (ABBA) sit idle for zero or two other schemes' steps at the ends of the order and for one
    # in the middle, so with it on, with other flows in the queues, the end schemes' steps
    # alternated fast and slow while the middle one's stayed steady, which read as a tail of
    # their own (figures: docs/transpose.md, "Measured").
    idle_restart: bool = False
    # CPUs each host may use (a cgroup quota per host, see .cpushare): equal shares, so a
    # rank's contention for the machine's cores is the same at any cluster size. None: none.
    cpus_per_host: float | None = None
    net: int = field(default_factory=lambda: 1 + os.getpid() % 250)
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}-{os.urandom(2).hex()}")
    names: list[str] = field(default_factory=list, init=False)
    # This cluster's hold on ``congestion`` being allowed in namespaces (see .congestion).
    _congestion_hold: congestion_list.Allowance | None = field(default=None, init=False)
    sshd: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict, init=False)
    shares: cpushare.CpuShares | None = field(default=None, init=False)
    _up: bool = field(default=False, init=False)

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def ns(self, i: int) -> str:
        """Namespace name of host ``i``."""
        return f"{self.tag}-h{i}"

    def addr(self, i: int) -> str:
        """Address of host ``i`` on the cluster's bridge."""
        return f"10.213.{self.net}.{i + 1}"

    def exec_argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``i``."""
        return ["ip", "netns", "exec", self.ns(i), *argv]

    def rank_argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``i``, within its CPU share if the cluster has one
        (the hosts' own work; background flows and sshd are not held to it)."""
        if self.shares is None:
            return self.exec_argv(i, argv)
        # The group first: inside the namespace, /sys is a new sysfs without the cgroups.
        return self.shares.argv(i, self.exec_argv(i, argv))

    def __enter__(self) -> Cluster:
        reason = available()
        if reason is not None:
            raise ClusterUnavailable(reason)
        if self.hosts < 1 or self.hosts > 250:
            raise ValueError("a cluster has 1..250 hosts")
        atexit.register(self.teardown)
        try:
            self._create()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.teardown()

    def _allow_congestion(self) -> None:
        """Let the hosts choose ``congestion``: outside the machine's own namespace, Linux
        lets a namespace pick only the algorithms in ``tcp_allowed_congestion_control``
        (the machine's default and the boot one; on a machine booted with BBR, cubic is not
        there). Held for the cluster's life, shared with any other cluster on the machine
        (.congestion); if that fails, the hosts keep the machine's."""
        if not self.congestion:
            return
        try:
            self._congestion_hold = congestion_list.allow(self.congestion)
        except OSError as exc:
            log.warning("the emulated hosts keep this machine's TCP congestion control: "
                        "cannot allow %s in namespaces (%s)", self.congestion, exc)
            self.congestion = None

    def _create(self) -> None:
        self._allow_congestion()
        sw = self.switch
        _run("ip", "netns", "add", sw)
        self.names.append(sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        _run("ip", "-n", sw, "link", "set", "lo", "up")
        for i in range(self.hosts):
            ns = self.ns(i)
            _run("ip", "netns", "add", ns)
            self.names.append(ns)
            # veth pair: "eth0" in the host, "p<i>" in the switch on the bridge
            _run("ip", "link", "add", f"{self.tag[-4:]}h{i}", "type", "veth", "peer", "name",
                 f"{self.tag[-4:]}s{i}")
            _run("ip", "link", "set", f"{self.tag[-4:]}h{i}", "netns", ns, "name", "eth0")
            _run("ip", "link", "set", f"{self.tag[-4:]}s{i}", "netns", sw, "name", f"p{i}")
            _run("ip", "-n", sw, "link", "set", f"p{i}", "master", "br0")
            _run("ip", "-n", sw, "link", "set", f"p{i}", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            tcp = [f"net.ipv4.tcp_slow_start_after_idle={int(self.idle_restart)}"]
            if self.congestion:
                tcp.append(f"net.ipv4.tcp_congestion_control={self.congestion}")
            _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", *tcp)
            if self.rate_mbit:
                self._shape(ns, "eth0")
                self._shape(sw, f"p{i}")
        self._static_neighbours()
        if self.cpus_per_host is not None:
            self.shares = cpushare.CpuShares(self.tag, self.hosts, self.cpus_per_host)
            self.shares.create()
        self._up = True

    def _static_neighbours(self) -> None:
        """Every host knows every other host's MAC address from the start. With 40 hosts
        starting at once on two busy cores, ARP replies came late enough that connects failed
        with "No route to host" (Gloo gives up after three tries); a real cluster's ARP
        does not compete with the job for the same two cores."""
        macs = []
        for i in range(self.hosts):
            res = _run("ip", "-n", self.ns(i), "-o", "link", "show", "eth0")
            macs.append(res.stdout.split("link/ether", 1)[1].split()[0])
        for i in range(self.hosts):
            lines = "".join(f"neigh replace {self.addr(j)} lladdr {macs[j]} dev eth0 "
                            "nud permanent\n" for j in range(self.hosts) if j != i)
            if lines:
                res = subprocess.run(["ip", "-n", self.ns(i), "-batch", "-"], input=lines,
                                     capture_output=True, text=True, timeout=30)
                if res.returncode:
                    raise RuntimeError(f"static neighbours of host {i}: {res.stderr.strip()}")

    def _shape(self, ns: str, dev: str) -> None:
        assert self.rate_mbit is not None
        rate_bytes = self.rate_mbit * 1e6 / 8
        burst = max(64 * 1024, int(rate_bytes / 250))  # enough for the kernel's timer tick
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
             "rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "100ms")

    # -- background traffic ------------------------------------------------------------------
    def background(self, flows: int, port: int = 5201,
                   bursts: Bursts | None = None) -> list[subprocess.Popen[bytes]]:
        """Start ``flows`` bulk TCP transfers between hosts (flow ``k``: host ``k mod n`` to
        host ``k+1 mod n``), as other tenants' traffic on the same links: steady, or in
        ``bursts`` (flow ``k`` seeded with ``k``: :mod:`aioreduce.bench.flows`). They run
        until the cluster is torn down (or the caller kills them)."""
        bursts = bursts or Bursts()
        procs: list[subprocess.Popen[bytes]] = []
        n = self.hosts
        flow = [sys.executable, "-P", "-m", "aioreduce.bench.flows"]  # (-P: see the bench's worker)
        for k in range(flows):
            src, dst = k % n, (k + 1) % n
            if src == dst:
                break
            addr, p = self.addr(dst), str(port + k)
            listener = subprocess.Popen(self.exec_argv(dst, [*flow, "sink", addr, p]),
                                        stdout=subprocess.PIPE)
            assert listener.stdout is not None
            listener.stdout.readline()  # wait until it listens
            procs += [listener, subprocess.Popen(self.exec_argv(src, [
                *flow, "source", addr, p, "--on", repr(bursts.on), "--off", repr(bursts.off),
                "--seed", str(k)]), stdout=subprocess.DEVNULL)]
        return procs

    # -- real SSH hosts ----------------------------------------------------------------------
    def start_sshd(self, workdir: str, hosts: Sequence[int] | None = None) -> SSHAccess:
        """Run Debian's sshd in each host with its own config and host key; return a client
        key authorized for this user and a known_hosts file listing every host's key."""
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        if not os.path.exists(sshd) or shutil.which("ssh-keygen") is None:
            raise ClusterUnavailable("needs openssh-server (apt-get install openssh-server)")
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        access = SSHAccess(os.path.join(workdir, "client_key"),
                           os.path.join(workdir, "known_hosts"))
        host_key = os.path.join(workdir, "host_key")
        for key in (access.client_key, host_key):
            if not os.path.exists(key):
                _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key)
        with open(access.client_key + ".pub") as fh, \
                open(os.path.join(workdir, "authorized_keys"), "w") as out:
            out.write(fh.read())
        with open(host_key + ".pub") as fh:
            host_pub = " ".join(fh.read().split()[:2])
        with open(access.known_hosts, "w") as out:
            out.writelines(f"{self.addr(i)} {host_pub}\n" for i in range(self.hosts))
        for i in hosts if hosts is not None else range(self.hosts):
            conf = os.path.join(workdir, f"sshd_{i}.conf")
            with open(conf, "w") as out:
                out.write(SSHD_CONFIG.format(addr=self.addr(i), host_key=host_key,
                                             workdir=workdir, i=i))
            self.sshd[i] = subprocess.Popen(self.exec_argv(i, [sshd, "-D", "-e", "-f", conf]),
                                            stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)
        for i in self.sshd:
            self._wait_port(i, 22)
        return access

    def stop_sshd(self, i: int) -> None:
        """Take host ``i``'s sshd down (its existing sessions go with it)."""
        proc = self.sshd.pop(i, None)
        if proc is not None:
            proc.kill()
            proc.wait()

    def _wait_port(self, i: int, port: int, timeout: float = 10.0) -> None:
        probe = ("import socket,sys,time\n"
                 "t=time.time()+float(sys.argv[3])\n"
                 "while True:\n"
                 "  try: socket.create_connection((sys.argv[1],int(sys.argv[2])),1); break\n"
                 "  except OSError:\n"
                 "    if time.time()>t: sys.exit(1)\n"
                 "    time.sleep(0.05)\n")
        res = subprocess.run(self.exec_argv(i, ["python3", "-c", probe, self.addr(i), str(port),
                                                str(timeout)]), timeout=timeout + 5)
        if res.returncode:
            raise RuntimeError(f"host {i}: nothing listens on port {port} after {timeout} s")

    def teardown(self) -> None:
        """Kill what runs inside, delete the namespaces (and so their links). Idempotent."""
        for proc in self.sshd.values():
            with contextlib.suppress(Exception):
                proc.kill()
                proc.wait(5)
        self.sshd.clear()
        for ns in reversed(self.names):
            kill_namespace_processes(ns)
        if self.shares is not None:
            self.shares.remove()
            self.shares = None
        for ns in reversed(self.names):
            _run("ip", "netns", "del", ns, check=False)
        self.names.clear()
        self._up = False
        if self._congestion_hold is not None:  # (namespaces keep the algorithm they chose)
            with contextlib.suppress(OSError):
                congestion_list.release(self._congestion_hold)
            self._congestion_hold = None
        with contextlib.suppress(Exception):
            atexit.unregister(self.teardown)
