"""Hostfiles in the common MPI/DeepSpeed/Horovod format, ``-H`` lists, include/exclude.

One host per line::

    # comment
    [user@]host [slots=N] [max_slots=M] [ssh_port=P] [addr=A] [spare=yes]

``slots`` defaults to 1; ``addr`` is the data-plane address peers use when it differs from the
name SSH uses; ``max_slots`` is accepted (and must be at least ``slots``); a ``spare`` host runs
no rank at the start and takes, up to its slots, the ranks ``--restart`` starts again after
their host was lost. Blank lines and
``#`` comments are skipped. Unknown keys, bad numbers, duplicate hosts and empty files are
errors naming the file and line. ``localhost``/``127.0.0.1`` run without SSH.

``--include``/``--exclude`` use DeepSpeed's syntax: ``NODE_SPEC[@NODE_SPEC...]`` with
``NODE_SPEC = NAME[:SLOT[,SLOT...]]``, e.g. ``worker-0@worker-1:0,2``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_KEYS = ("slots", "max_slots", "ssh_port", "addr", "spare")
_HOST_RE = re.compile(r"^(?:(?P<user>[A-Za-z0-9._-]+)@)?(?P<host>[A-Za-z0-9._:\[\]-]+)$")


class HostfileError(ValueError):
    """A hostfile, ``-H`` list or include/exclude filter that does not parse."""


@dataclass(frozen=True)
class HostEntry:
    """One host of a job."""

    host: str
    slots: int = 1
    user: str | None = None
    ssh_port: int | None = None
    addr: str | None = None
    max_slots: int | None = None
    where: str = ""  # "file:line" it came from, for messages
    spare: bool = False  # no rank at the start; ranks restarted after their host was lost

    @property
    def is_local(self) -> bool:
        """Runs without SSH."""
        return self.host in LOCAL_NAMES

    @property
    def data_addr(self) -> str:
        """The address other ranks dial to reach ranks on this host."""
        return self.addr or ("127.0.0.1" if self.is_local else self.host)

    def to_line(self) -> str:
        """This entry in hostfile syntax (parses back to an equal entry)."""
        parts = [f"{self.user}@{self.host}" if self.user else self.host, f"slots={self.slots}"]
        if self.max_slots is not None:
            parts.append(f"max_slots={self.max_slots}")
        if self.ssh_port is not None:
            parts.append(f"ssh_port={self.ssh_port}")
        if self.addr is not None:
            parts.append(f"addr={self.addr}")
        if self.spare:
            parts.append("spare=yes")
        return " ".join(parts)


def _number(value: str, key: str, where: str, low: int, high: int | None = None) -> int:
    if not value.isdigit():
        raise HostfileError(f"{where}: {key}={value!r} is not a whole number")
    n = int(value)
    if n < low or (high is not None and n > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise HostfileError(f"{where}: {key}={n} is out of range ({bound})")
    return n


def parse_line(line: str, where: str) -> HostEntry | None:
    """One hostfile line; None for blank lines and comments."""
    text = line.split("#", 1)[0].strip()
    if not text:
        return None
    first, *rest = text.split()
    m = _HOST_RE.match(first)
    if not m:
        raise HostfileError(f"{where}: {first!r} is not a host name ([user@]host)")
    fields: dict[str, str] = {}
    for item in rest:
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise HostfileError(f"{where}: expected key=value, got {item!r}")
        if key not in _KEYS:
            raise HostfileError(f"{where}: unknown key {key!r} (known: {', '.join(_KEYS)})")
        if key in fields:
            raise HostfileError(f"{where}: {key} given twice")
        fields[key] = value
    slots = _number(fields["slots"], "slots", where, 1) if "slots" in fields else 1
    max_slots = (_number(fields["max_slots"], "max_slots", where, 1)
                 if "max_slots" in fields else None)
    if max_slots is not None and max_slots < slots:
        raise HostfileError(f"{where}: max_slots={max_slots} is below slots={slots}")
    port = _number(fields["ssh_port"], "ssh_port", where, 1, 65535) if "ssh_port" in fields \
        else None
    spare = fields.get("spare", "no")
    if spare not in ("yes", "no"):
        raise HostfileError(f"{where}: spare={spare!r}: give yes or no")
    return HostEntry(m["host"], slots, m["user"], port, fields.get("addr"), max_slots, where,
                     spare == "yes")


def parse_hostfile(text: str, filename: str = "hostfile") -> list[HostEntry]:
    """All entries of a hostfile; errors name ``filename:line``."""
    entries: list[HostEntry] = []
    seen: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        where = f"{filename}:{lineno}"
        entry = parse_line(line, where)
        if entry is None:
            continue
        if entry.host in seen:
            raise HostfileError(f"{where}: host {entry.host!r} is already listed at "
                                f"{seen[entry.host]}")
        seen[entry.host] = where
        entries.append(entry)
    if not entries:
        raise HostfileError(f"{filename}: no hosts (only blank lines and comments)")
    return entries


def read_hostfile(path: str) -> list[HostEntry]:
    """Parse the hostfile at ``path``."""
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError as exc:
        raise HostfileError(f"{path}: {exc.strerror}") from None
    return parse_hostfile(text, path)


def format_hostfile(entries: list[HostEntry]) -> str:
    """Hostfile text for ``entries`` (the inverse of :func:`parse_hostfile`)."""
    return "".join(e.to_line() + "\n" for e in entries)


def parse_hosts_arg(spec: str) -> list[HostEntry]:
    """Horovod's ``-H host1:2,host2:4`` (slots default to 1)."""
    entries = []
    for i, item in enumerate(x.strip() for x in spec.split(",")):
        if not item:
            continue
        name, _, slots = item.rpartition(":") if item.count(":") == 1 else (item, "", "")
        where = f"-H item {i + 1}"
        entry = parse_line(f"{name} slots={slots}" if slots else name, where)
        assert entry is not None
        entries.append(entry)
    if not entries:
        raise HostfileError("-H lists no hosts")
    names = [e.host for e in entries]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise HostfileError(f"-H lists host {dup!r} twice")
    return entries


def _node_specs(spec: str, what: str) -> dict[str, list[int] | None]:
    out: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        name, sep, slots = part.partition(":")
        if not name:
            raise HostfileError(f"{what} {spec!r}: empty host name")
        try:
            out[name] = [int(s) for s in slots.split(",")] if sep else None
        except ValueError:
            raise HostfileError(f"{what} {spec!r}: slots must be numbers") from None
    return out


def filter_hosts(entries: list[HostEntry], include: str | None = None,
                 exclude: str | None = None) -> list[HostEntry]:
    """Apply DeepSpeed-style ``--include``/``--exclude`` (not both)."""
    if include and exclude:
        raise HostfileError("--include and --exclude cannot be used together")
    by_name = {e.host: e for e in entries}
    spec = include or exclude
    if not spec:
        return entries
    wanted = _node_specs(spec, "--include" if include else "--exclude")
    for name, slots in wanted.items():
        if name not in by_name:
            raise HostfileError(f"{'--include' if include else '--exclude'}: host {name!r} "
                                "is not in the host list")
        bad = [s for s in slots or [] if not 0 <= s < by_name[name].slots]
        if bad:
            raise HostfileError(f"host {name!r} has slots 0..{by_name[name].slots - 1}, "
                                f"not {bad}")
    out = []
    for e in entries:
        listed = e.host in wanted
        slots = wanted.get(e.host)
        if include:
            if listed:
                out.append(e if slots is None else replace(e, slots=len(set(slots))))
        elif not listed:
            out.append(e)
        elif slots is not None and e.slots - len(set(slots)) > 0:
            out.append(replace(e, slots=e.slots - len(set(slots))))
    if not out:
        raise HostfileError("no hosts left after --include/--exclude")
    return out
