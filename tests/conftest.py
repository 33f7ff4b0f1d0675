"""Suite-wide: how the tests share a machine and pytest-xdist's workers.

* With workers (``python -m pytest -n 2``: pytest-xdist, ``--dist loadgroup`` from
  pyproject.toml), tests marked ``cluster`` share machine-wide state that one test at a time
  may own (network namespaces, the allowed congestion controls, a single-node SLURM on its
  fixed ports, the module-scoped clusters), so they form one group, which xdist runs in a
  single worker.
* A module whose tests share a module-scoped fixture (the torch tests' launches of 4 torch
  processes, made once for the module) is one group too: each worker would make the fixture
  again.
* One thread per process for OpenMP and BLAS (torch's and numpy's), unless the environment
  says otherwise: a test starts several processes at once on a machine with few cores, and
  a pool of threads in each fought the others for them.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs[-1].scope == "module" for defs in info.name2fixturedefs.values() if defs)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups off the items
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("cluster") is not None:
            item.add_marker(pytest.mark.xdist_group("cluster"))
        elif _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
