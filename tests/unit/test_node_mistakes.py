"""Caller mistakes on a node's public calls: a clear error naming the rank, and the node
still usable after it (one rank, a real node over 127.0.0.1)."""

from __future__ import annotations

import numpy as np
import pytest

from aioreduce.env import NodeEnv
from aioreduce.jobplan import free_port
from aioreduce.node import Node
from aioreduce.schemes import Ring


async def test_a_wrong_op_or_a_coded_call_on_an_uncoded_scheme_is_named_and_harmless() -> None:
    env = NodeEnv(0, 1, "127.0.0.1", free_port(), b"k" * 32)
    async with Node(env, scheme=Ring()) as node:
        with pytest.raises(ValueError, match=r"rank 0: op must be 'sum' or 'mean', not 'max'"):
            await node.allreduce(np.ones(4), op="max")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"rank 0: Ring is used through allreduce\(\)"):
            node.placement(100)
        with pytest.raises(TypeError, match=r"rank 0: Ring is used through allreduce\(\)"):
            await node.aggregate(np.ones(4))
        assert node.step == 0  # none of them took a step
        res = await node.allreduce(np.arange(4.0), op="mean")
        assert np.array_equal(res.value, np.arange(4.0)) and node.step == 1
