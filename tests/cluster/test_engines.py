"""The real launch engines our environment contract claims: Open MPI's ``mpirun`` and SLURM's
``srun`` (a single-node SLURM with its own munge, started here), each running
``examples/logreg.py`` to the single-process reference loss.

Root only (slurmd and munge need it); skipped, with the reason, where the Debian packages
(openmpi-bin, slurm-wlm, munge) are missing. Everything listens on 127.0.0.1; every daemon
started here runs in its own process group and is killed at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aioreduce.jobplan import free_port

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
LOGREG = [sys.executable, str(ROOT / "examples" / "logreg.py"), "--scheme", "ring"]
REFERENCE_LOSS = 0.03228846978368438  # examples/logreg.py --reference
# Each rank writes what it found to its own file: the engines interleave ranks' stdout.
SHOW_ENV = ("import sys; from aioreduce.env import discover; e = discover(); "
            "open(f'{sys.argv[1]}/env.{e.rank}', 'w').write("
            "f'{e.source} {e.rank} {e.world_size} {e.local_rank}')")


def _seen(where: Path) -> list[list[str]]:
    return sorted(p.read_text().split() for p in where.glob("env.*"))


def _needs(*programs: str) -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    missing = [p for p in programs if shutil.which(p) is None]
    return f"not installed: {', '.join(missing)}" if missing else None


def _final_loss(out: str) -> float:
    import json

    line = next(x for x in out.splitlines() if x.startswith("SUMMARY "))
    return float(json.loads(line.removeprefix("SUMMARY "))["final_loss"])


@pytest.fixture
def secret_file(tmp_path: Path) -> str:
    path = tmp_path / "secret"
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    return str(path)


# -- Open MPI ----------------------------------------------------------------------------------

MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "4",
          "--mca", "oob_tcp_if_include", "lo", "--mca", "btl_tcp_if_include", "lo"]


@pytest.mark.skipif(_needs("mpirun") is not None, reason=str(_needs("mpirun")))
def test_mpirun_runs_logreg_to_the_reference_loss(secret_file: str, tmp_path: Path) -> None:
    env = ["-x", f"AIOREDUCE_SECRET_FILE={secret_file}", "-x", "MASTER_ADDR=127.0.0.1",
           "-x", f"AIOREDUCE_MASTER_PORT={free_port()}", "-x", "OMP_NUM_THREADS=1"]
    who = subprocess.run([*MPIRUN, *env, sys.executable, "-c", SHOW_ENV, str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert who.returncode == 0, who.stderr[-2000:]
    # Rank, size and local rank come from Open MPI's own variables.
    assert _seen(tmp_path) == [["openmpi", str(r), "4", str(r)] for r in range(4)]
    res = subprocess.run([*MPIRUN, *env, *LOGREG], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert abs(_final_loss(res.stdout) - REFERENCE_LOSS) < 1e-9


# -- SLURM -------------------------------------------------------------------------------------

SLURM_CONF = """\
ClusterName=aioreduce-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A single-node SLURM (slurmctld + slurmd + its own munged) on 127.0.0.1; yields the
    environment for srun."""
    base = tmp_path / "slurm"
    for sub in ("state", "spool"):
        (base / sub).mkdir(parents=True)
    # munged runs as its own user, which cannot enter pytest's private tmp_path.
    mdir = Path(tempfile.mkdtemp(prefix="aioreduce-munge-"))
    mdir.chmod(0o755)
    shutil.chown(mdir, "munge", "munge")
    sock = mdir / "munge.socket"
    munged = _start(["runuser", "-u", "munge", "--", "munged", "-F", "-S", str(sock),
                     "--pid-file", str(mdir / "munged.pid"),
                     "--log-file", str(mdir / "munged.log"),
                     "--seed-file", str(mdir / "munged.seed")], base / "munged.out")
    conf = base / "slurm.conf"
    conf.write_text(SLURM_CONF.format(ctld_port=free_port(), d_port=free_port(),
                                      munge_socket=sock, dir=base))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [munged]
    try:
        deadline = time.monotonic() + 20
        while not sock.exists():
            assert munged.poll() is None and time.monotonic() < deadline, \
                (base / "munged.out").read_text()
            time.sleep(0.05)  # waiting for munged's socket to appear
        daemons.append(_start(["slurmctld", "-D", "-f", str(conf)], base / "ctld.out"))
        daemons.append(_start(["slurmd", "-D", "-N", "localhost", "-f", str(conf)],
                              base / "d.out"))
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                   text=True, timeout=20).stdout.strip()
            if state == "idle":
                break
            assert time.monotonic() < deadline, (state, (base / "ctld.out").read_text(),
                                                 (base / "d.out").read_text())
            time.sleep(0.2)  # polling slurmctld until the node registers
        yield env
    finally:
        for proc in reversed(daemons):
            _stop(proc)
        shutil.rmtree(mdir, ignore_errors=True)


@pytest.mark.skipif(_needs("srun", "slurmctld", "slurmd", "munged", "runuser") is not None,
                    reason=str(_needs("srun", "slurmctld", "slurmd", "munged", "runuser")))
def test_srun_runs_logreg_to_the_reference_loss(slurm: dict[str, str], secret_file: str,
                                                tmp_path: Path) -> None:
    export = f"--export=ALL,AIOREDUCE_SECRET_FILE={secret_file},OMP_NUM_THREADS=1"
    who = subprocess.run(["srun", "-n", "4", export, sys.executable, "-c", SHOW_ENV,
                          str(tmp_path)], env=slurm, capture_output=True, text=True, timeout=120)
    assert who.returncode == 0, who.stderr[-2000:]
    # Rank, size, local rank and job id come from SLURM's variables; the rendezvous host is
    # the first node of SLURM_JOB_NODELIST and the port is derived from the job id.
    assert _seen(tmp_path) == [["slurm", str(r), "4", str(r)] for r in range(4)]
    res = subprocess.run(["srun", "-n", "4", export, *LOGREG], env=slurm, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert abs(_final_loss(res.stdout) - REFERENCE_LOSS) < 1e-9
