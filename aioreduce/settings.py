"""A node's settings from ``AIOREDUCE_*`` variables beyond the job itself (which
:mod:`aioreduce.env` reads): emulated latency, Unix sockets, step telemetry, garbage collection,
injected stragglers; and where rank 0 listens. Shared by :meth:`Node.from_env
<aioreduce.node.Node.from_env>` and the torch backend."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import ConfigError
from .straggle import parse_seeded
from .transport import MeshOptions


def env_extras(env_map: Mapping[str, str], max_frame: int | None = None) -> dict[str, Any]:
    """The :class:`Node` arguments that ``AIOREDUCE_*`` variables set besides the job itself
    (see :meth:`Node.from_env`): ``options`` (``AIOREDUCE_LATENCY``,
    ``AIOREDUCE_LOCAL_UNIX``, ``AIOREDUCE_LANE_SPIN``), ``trace``, ``gc_every``, ``rejoin_wait``
    (``AIOREDUCE_REJOIN_WAIT``) and ``straggle``, each only if its variable is set; a
    malformed value is a :class:`ConfigError` naming the variable. Shared with the torch
    backend."""
    extras: dict[str, Any] = {}
    mesh: dict[str, Any] = {}
    if env_map.get("AIOREDUCE_LATENCY"):
        mesh["latency"] = _seconds(env_map, "AIOREDUCE_LATENCY", 60, "the emulated one-way "
                                   "latency in seconds (e.g. 0.0001)")
    if env_map.get("AIOREDUCE_LOCAL_UNIX"):
        value = env_map["AIOREDUCE_LOCAL_UNIX"]
        if value not in ("0", "1"):
            raise ConfigError(f"AIOREDUCE_LOCAL_UNIX={value!r}: give 1 (ranks on one host "
                              "talk over Unix sockets, the default) or 0 (TCP always)")
        mesh["local_unix"] = value == "1"
    if env_map.get("AIOREDUCE_LANE_SPIN"):
        mesh["lane_spin"] = _seconds(env_map, "AIOREDUCE_LANE_SPIN", 1, "the seconds an "
                                     "in-order lane receive polls before it blocks (0: never)")
    if mesh:
        if max_frame is not None:
            mesh["max_payload"] = max_frame
        extras["options"] = MeshOptions(**mesh)
    if env_map.get("AIOREDUCE_TRACE"):
        extras["trace"] = env_map["AIOREDUCE_TRACE"]
    if env_map.get("AIOREDUCE_GC_EVERY"):
        value = env_map["AIOREDUCE_GC_EVERY"]
        if not value.isdigit():
            raise ConfigError(f"AIOREDUCE_GC_EVERY={value!r}: give a number of steps "
                              "(0: leave Python's collector alone)")
        extras["gc_every"] = int(value)
    if env_map.get("AIOREDUCE_REJOIN_WAIT"):
        extras["rejoin_wait"] = _seconds(env_map, "AIOREDUCE_REJOIN_WAIT", 1e6, "the seconds a "
                                         "step that lost a rank waits for its replacement "
                                         "(0: it fails at once)")
    if env_map.get("AIOREDUCE_STRAGGLE"):
        extras["straggle"] = parse_seeded(env_map["AIOREDUCE_STRAGGLE"], env_map)
    return extras


def _seconds(env_map: Mapping[str, str], name: str, below: float, what: str) -> float:
    """Variable ``name`` as seconds in [0, ``below``); else a :class:`ConfigError` saying
    ``what`` to give."""
    try:
        value = float(env_map[name])
    except ValueError:
        value = -1.0
    if not 0 <= value < below:
        raise ConfigError(f"{name}={env_map[name]!r}: give {what}")
    return value


def bind_for(master_addr: str) -> str:
    """Rank 0 listens on the rendezvous address if it is a loopback one, else on all interfaces."""
    loopback = master_addr.startswith("127.") or master_addr == "localhost"
    return master_addr if loopback else "0.0.0.0"
