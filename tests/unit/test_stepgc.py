"""Python's garbage collection at step boundaries (aioreduce.stepgc): off between steps, a
collection and a freeze after the first step, then one collection per period of steps, and the
collector as it was once the node closes."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import numpy as np
import pytest

from aioreduce.env import NodeEnv
from aioreduce.errors import ConfigError
from aioreduce.jobplan import free_port
from aioreduce.node import Node
from aioreduce.schemes import Ring
from aioreduce.settings import env_extras
from aioreduce.stepgc import StepGC


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _cycle() -> weakref.ref[_Cycle]:
    """A reference cycle nobody holds: only a collection frees it."""
    return weakref.ref(_Cycle())


def test_collections_come_after_the_first_step_then_once_a_period() -> None:
    gc.enable()  # (the unit tests' conftest pauses it during each test)
    sgc = StepGC(every=5)
    sgc.start()
    assert not gc.isenabled() and sgc.active
    sgc.after(0)  # the first step: collect, then freeze what survived
    assert sgc.collections == 1 and gc.get_freeze_count() > 0
    ran = []
    for step in range(1, 15):
        before = sgc.collections
        garbage = _cycle()
        sgc.after(step)
        ran.append(sgc.collections > before)
        # Garbage made in a period is freed at its end and not before: the path under test.
        assert (garbage() is None) == ran[-1], step
    assert [s for s, r in zip(range(1, 15), ran, strict=True) if r] == [4, 9, 14]
    sgc.after(31)  # a jump ahead (FellBehind): one collection for the periods skipped
    sgc.after(32)
    assert sgc.collections == 5
    sgc.stop()
    assert gc.isenabled() and gc.get_freeze_count() == 0 and not sgc.active


def test_the_collector_stays_off_if_it_was_off_and_every_must_be_positive() -> None:
    gc.disable()
    sgc = StepGC(every=1)
    sgc.start()
    sgc.after(0)
    sgc.stop()
    assert not gc.isenabled()
    with pytest.raises(ValueError, match="gc_every must be >= 1"):
        StepGC(every=0)


ENV = {"AIOREDUCE_SECRET": "s3cret-for-tests", "AIOREDUCE_RANK": "0",
       "AIOREDUCE_WORLD_SIZE": "1", "AIOREDUCE_MASTER_ADDR": "127.0.0.1",
       "AIOREDUCE_MASTER_PORT": "4000"}


def test_the_environment_sets_gc_every_and_a_bad_value_is_named() -> None:
    node = Node.from_env({**ENV, "AIOREDUCE_GC_EVERY": "20"})
    assert node.stepgc is not None and node.stepgc.every == 20
    assert Node.from_env(ENV).stepgc is None
    with pytest.raises(ConfigError, match="AIOREDUCE_GC_EVERY='often'"):
        Node.from_env({**ENV, "AIOREDUCE_GC_EVERY": "often"})
    # The torch backend builds its Node from the same reading of the environment.
    assert env_extras({"AIOREDUCE_GC_EVERY": "7", "AIOREDUCE_TRACE": "/tmp/t"}) == {
        "gc_every": 7, "trace": "/tmp/t"}
    with pytest.raises(ValueError, match="rank 0: gc_every must be >= 0"):
        Node(NodeEnv(0, 1, "127.0.0.1", free_port(), b"k" * 32), gc_every=-1)


async def test_a_node_collects_between_its_steps_and_restores_the_collector() -> None:
    gc.enable()
    env = NodeEnv(0, 1, "127.0.0.1", free_port(), b"k" * 32)
    async with Node(env, scheme=Ring(), gc_every=3) as node:
        assert not gc.isenabled()  # from the start: no collection inside a step
        for _step in range(7):
            await node.allreduce(np.ones(10))
        assert node.stepgc is not None and node.stepgc.collections == 3  # steps 0, 2, 5
    assert gc.isenabled() and gc.get_freeze_count() == 0
