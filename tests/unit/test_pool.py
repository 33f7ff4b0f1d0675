"""BufferPool: memory is handed out again only when nothing else refers to it."""

from __future__ import annotations

import numpy as np

from aioreduce.schemes.pool import BufferPool

F4 = np.dtype("<f4")


def test_an_array_nobody_holds_is_handed_out_again() -> None:
    pool = BufferPool()
    first = pool.take(8, F4)
    address = first.__array_interface__["data"][0]
    del first
    again = pool.take(8, F4)
    assert again.__array_interface__["data"][0] == address and pool.reused == 1


def test_views_tensors_and_memoryviews_keep_an_array_out_of_reach() -> None:
    pool = BufferPool()
    held = [pool.take(8, F4) for _ in range(3)]
    keepers = [held[0][2:5], memoryview(held[1]), held[2].reshape(2, 4)]
    addresses = {a.__array_interface__["data"][0] for a in held}
    del held
    fresh = [pool.take(8, F4) for _ in range(3)]
    assert not addresses & {a.__array_interface__["data"][0] for a in fresh}
    assert pool.reused == 0 and len(keepers) == 3


def test_only_a_matching_size_and_dtype_is_reused() -> None:
    pool = BufferPool()
    del_me = pool.take(8, F4)
    del del_me
    assert pool.take(9, F4).size == 9 and pool.take(8, np.dtype("<f8")).dtype == "<f8"
    assert pool.reused == 0


def test_the_pool_keeps_at_most_spare_free_arrays() -> None:
    pool = BufferPool(spare=2)
    arrays = [pool.take(8, F4) for _ in range(6)]
    del arrays
    pool.take(3, F4)  # no match: the free arrays beyond two are let go
    assert len(pool._arrays) == 3  # two spare + the one just taken
