"""Who left a bench resource behind: emulated clusters name what they make on the machine
(network namespaces, CPU groups, congestion holds) ``<prefix><pid>-...`` after the process
that made it, so that a later run can remove what a killed one left, and only that."""

from __future__ import annotations

from pathlib import Path


def owner(name: str, prefix: str = "") -> int | None:
    """The process id in ``name`` (``<prefix><pid>-...``), or None if it names none."""
    if not name.startswith(prefix):
        return None
    pid, dash, _rest = name[len(prefix):].partition("-")
    return int(pid) if dash and pid.isdigit() else None


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine."""
    return Path(f"/proc/{pid}").exists()


def orphaned(name: str, prefix: str = "") -> bool:
    """Whether ``name`` was made by a process that is gone (a name with no owner is not)."""
    pid = owner(name, prefix)
    return pid is not None and not alive(pid)
