"""Suite-wide: the emulated-cluster tests run one after another in one worker.

With workers (``python -m pytest -n 2``: pytest-xdist, ``--dist loadgroup`` from
pyproject.toml), tests marked ``cluster`` share machine-wide state that one test at a time
may own (network namespaces, the allowed congestion controls, a single-node SLURM on its
fixed ports, the module-scoped clusters), so they form one group, which xdist runs in a
single worker.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups off the items
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("cluster") is not None:
            item.add_marker(pytest.mark.xdist_group("cluster"))
