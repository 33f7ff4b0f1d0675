"""torch's store, kept by the launcher for a job whose ranks may be restarted.

``init_process_group`` meets through a ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` that rank 0
serves, and a serving store waits for every rank to connect. A replacement of rank 0 would
serve a new store and wait for ranks that connected to the old one long ago, until its
timeout. So, as torchrun's agent does, the launcher serves the store while the job runs and
tells the ranks so (``TORCHELASTIC_USE_AGENT_STORE=True``: every rank, rank 0 included, is a
client). Where rank 0's host is this machine the launcher serves it, where it is a remote host
that host's agent does (and sets the variable for the ranks it starts); either only where
torch is installed (otherwise the ranks serve it as before, and a program without torch has
no use for it).
"""

from __future__ import annotations

import importlib.util
from typing import Any

AGENT_STORE = {"TORCHELASTIC_USE_AGENT_STORE": "True"}


def available() -> bool:
    """Whether torch is installed here (without importing it)."""
    return importlib.util.find_spec("torch") is not None


def serve(addr: str, port: int) -> Any:
    """A store serving ``addr:port`` for as long as the returned object lives."""
    from datetime import timedelta

    from torch._C._distributed_c10d import TCPStore

    # (wait_for_workers=False: it serves whoever comes, when they come)
    return TCPStore(addr, port, None, True, timedelta(seconds=300), wait_for_workers=False,
                    multi_tenant=True)
