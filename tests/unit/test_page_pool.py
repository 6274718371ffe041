from __future__ import annotations

import pytest

from longserve.cache.page_pool import PagePool

PS = 16  # tokens per page: the pool only stores it


def test_fresh_pool_counts() -> None:
    pool = PagePool(8, PS)
    assert (pool.num_total, pool.num_free, pool.num_used) == (8, 8, 0)
    pool.check()


def test_alloc_lowest_ids_and_reuse() -> None:
    pool = PagePool(8, PS)
    assert pool.alloc(3) == [1, 2, 3]
    pool.check()
    assert [pool.ref(p) for p in (1, 2, 3, 4)] == [1, 1, 1, 0]
    assert pool.decref([2]) == [2]
    pool.check()
    assert pool.alloc(2) == [2, 4]
    pool.check()
    assert (pool.num_free, pool.num_used) == (4, 4)
    assert pool.alloc(0) == []


def test_alloc_returns_ascending_after_scattered_frees() -> None:
    pool = PagePool(8, PS)
    assert pool.alloc(8) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert pool.decref([7, 3, 5]) == [7, 3, 5]
    pool.check()
    assert pool.alloc(2) == [3, 5]
    assert pool.alloc(1) == [7]
    assert pool.num_free == 0


def test_exhausted_returns_none_without_side_effects() -> None:
    pool = PagePool(4, PS)
    assert pool.alloc(3) == [1, 2, 3]
    assert pool.alloc(2) is None
    pool.check()
    assert pool.num_free == 1
    assert pool.ref(4) == 0
    assert pool.alloc(1) == [4]
    assert pool.alloc(1) is None
    assert PagePool(0, PS).alloc(1) is None
    assert PagePool(0, PS).alloc(0) == []


def test_refcounts() -> None:
    pool = PagePool(4, PS)
    pages = pool.alloc(2)
    assert pages == [1, 2]
    pool.incref([1, 1, 2])
    pool.check()
    assert (pool.ref(1), pool.ref(2)) == (3, 2)
    assert pool.decref([1, 2]) == []
    assert pool.decref([2, 1]) == [2]
    assert pool.num_free == 3
    pool.check()
    assert pool.decref([1]) == [1]
    assert pool.num_free == 4
    pool.check()


def test_double_free_raises_and_changes_nothing() -> None:
    pool = PagePool(4, PS)
    pool.alloc(2)
    assert pool.decref([2]) == [2]
    with pytest.raises(ValueError, match="page 2"):
        pool.decref([2])
    # Atomic: page 1 must not be dropped when the batch also double-frees page 1.
    with pytest.raises(ValueError, match="page 1"):
        pool.decref([1, 1])
    assert pool.ref(1) == 1
    pool.check()


def test_incref_of_free_page_raises_and_changes_nothing() -> None:
    pool = PagePool(4, PS)
    pool.alloc(1)
    with pytest.raises(ValueError, match="page 3"):
        pool.incref([1, 3])
    assert pool.ref(1) == 1
    pool.check()


@pytest.mark.parametrize("bad", [0, 5, -1])
def test_out_of_range_ids_raise(bad: int) -> None:
    pool = PagePool(4, PS)
    pool.alloc(4)
    with pytest.raises(ValueError, match=str(bad)):
        pool.ref(bad)
    with pytest.raises(ValueError):
        pool.incref([bad])
    with pytest.raises(ValueError):
        pool.decref([bad])
    pool.check()


def test_negative_alloc_raises() -> None:
    with pytest.raises(ValueError):
        PagePool(4, PS).alloc(-1)


def test_the_pool_is_the_one_home_of_the_page_size() -> None:
    """The radix tree and the manager read the pool's page size; a page size below 1 is refused."""
    from longserve.cache.manager import KVCacheManager
    from longserve.cache.radix_tree import RadixTree

    pool = PagePool(4, 8)
    assert pool.page_size == RadixTree(pool).page_size == 8
    kv = KVCacheManager(4, 8)
    assert kv.page_size == kv.pool.page_size == 8
    for bad in (0, -16):
        with pytest.raises(ValueError, match="page_size must be positive"):
            PagePool(4, bad)


def test_pages_as_arrays_of_any_int_dtype_count_like_lists() -> None:
    # the prefix cache hands lists; arrays (an int32 page row, say) are taken as well, checked the same way
    import numpy as np

    pool = PagePool(8, PS)
    pages = pool.alloc(3)
    pool.incref(np.array(pages, dtype=np.int32))
    assert [pool.ref(p) for p in pages] == [2, 2, 2]
    assert pool.decref(np.array(pages, dtype=np.int16)) == []
    assert pool.decref(pages) == pages
    with pytest.raises(ValueError, match="page id 9 out of range"):
        pool.incref(np.array([1, 9], dtype=np.int32))
    with pytest.raises(ValueError, match="page id 0 out of range"):
        pool.decref(np.array([0], dtype=np.int64))
    pool.check()


@pytest.mark.parametrize("n", [3, 40])  # the scalar reads and the array path
def test_num_sole_counts_the_pages_a_decref_would_free(n: int) -> None:
    pool = PagePool(64, PS)
    pages = pool.alloc(n)
    pool.incref(pages[::2])  # every other page held twice
    assert pool.num_sole(pages) == n // 2 == len(pool.decref(list(pages)))
    pool.check()
