"""The TCP congestion controls network namespaces may choose: one machine-wide list that
overlapping emulated clusters share.

Linux lets a namespace other than the machine's own pick only the algorithms in
``tcp_allowed_congestion_control`` (the machine's default and the boot one). A cluster that
wants another one for its hosts adds it to that list for its life. Clusters of several processes
overlap (two pytest-xdist workers, two benches), and the list is the machine's, so it is not
one cluster's to put back: the first to add records the list as it was, every cluster leaves
a holder file named by its process id while it runs, and the last one out (or
:func:`remove_stale`, for holders whose process died) writes the recorded list back. A lock
file orders all of it. Putting the list back on the first exit, as clusters did alone, took
the algorithm away from a cluster still setting up its hosts.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .owner import alive, owner

ALLOWED = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
# Where the holders and the recorded list live: /run is cleared at boot, as the list is.
STATE = (Path("/run") if Path("/run").is_dir() else Path(tempfile.gettempdir())) \
    / "aioreduce-congestion"
_BEFORE = "before"  # the list as it was before the first holder added to it


@dataclass(frozen=True)
class Allowance:
    """One cluster's hold on ``algorithm`` being allowed; give it back with :func:`release`."""

    algorithm: str
    holder: Path


@contextlib.contextmanager
def _locked(state: Path) -> Iterator[None]:
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(state / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _prune(state: Path) -> tuple[list[Path], list[str]]:
    """The live holders; the dead ones' files removed (their names returned)."""
    live, dead = [], []
    for holder in state.glob("*-*"):
        pid = owner(holder.name)
        if pid is not None and alive(pid):
            live.append(holder)
        else:
            holder.unlink(missing_ok=True)
            dead.append(holder.name)
    return live, dead


def _restore_if_unheld(state: Path, allowed: Path, live: list[Path]) -> None:
    """With no ``live`` holder left, write back the list recorded before the first one."""
    before = state / _BEFORE
    if not live and before.exists():
        allowed.write_text(before.read_text())
        before.unlink()


def allow(algorithm: str, *, state: Path = STATE, allowed: Path = ALLOWED) -> Allowance:
    """Let namespaces choose ``algorithm`` until the returned hold is released (and every
    other hold too). Raises ``OSError`` where the list cannot be read or written."""
    with _locked(state):
        _prune(state)  # a dead run's holders: its addition stays, recorded in "before"
        current = allowed.read_text().split()
        if algorithm not in current:
            before = state / _BEFORE
            if not before.exists():
                before.write_text(" ".join(current))
            allowed.write_text(" ".join([*current, algorithm]))
        holder = state / f"{os.getpid()}-{os.urandom(4).hex()}"
        holder.write_text(algorithm)
        return Allowance(algorithm, holder)


def release(hold: Allowance, *, state: Path = STATE, allowed: Path = ALLOWED) -> None:
    """Give ``hold`` back; the last one out puts the machine's list back as it was."""
    with _locked(state):
        hold.holder.unlink(missing_ok=True)
        live, _dead = _prune(state)
        _restore_if_unheld(state, allowed, live)


def remove_stale(*, state: Path = STATE, allowed: Path = ALLOWED) -> list[str]:
    """Drop the holds of processes that are gone (a killed bench); with none left, put the
    machine's list back. Returns the dropped holders' names."""
    if not state.is_dir():
        return []
    with _locked(state):
        live, dead = _prune(state)
        _restore_if_unheld(state, allowed, live)
        return dead
