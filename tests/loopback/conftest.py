from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from .harness import Ranks


@pytest.fixture
def ranks() -> Iterator[Callable[[int], Ranks]]:
    """Make jobs of real processes; every process group they started is killed at teardown."""
    jobs: list[Ranks] = []

    def make(n: int) -> Ranks:
        job = Ranks(n)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.kill()
        for proc in job.procs.values():
            if proc.poll() is None:
                proc.wait(5)
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
