"""BlockPool: exact block ids on tiny pools, chained hashes, LRU eviction, double-free errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.kv_cache.block_pool import (
    BlockPool,
    NoFreeBlocksError,
    hash_block_tokens,
    prefix_block_hashes,
)


def test_hash_is_chained_and_deterministic_across_processes() -> None:
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    # Same tokens, different parent: different prefix, different hash.
    b = hash_block_tokens(a, [1, 2, 3, 4])
    assert b != a and b != hash_block_tokens(7, [1, 2, 3, 4])
    assert 0 <= a < 2**64
    code = (
        "from pdserve.kv_cache.block_pool import prefix_block_hashes as p;"
        "print(p(list(range(40)), 16))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == str(prefix_block_hashes(list(range(40)), 16))


def test_prefix_block_hashes_full_blocks_only() -> None:
    toks = list(range(40))
    hs = prefix_block_hashes(toks, 16)
    assert len(hs) == 2
    assert hs[0] == hash_block_tokens(None, toks[:16])
    assert hs[1] == hash_block_tokens(hs[0], toks[16:32])
    assert prefix_block_hashes(toks[:15], 16) == []
    # A prompt sharing only the first block shares only the first hash.
    other = toks[:16] + [99] * 16
    assert prefix_block_hashes(other, 16)[0] == hs[0]
    assert prefix_block_hashes(other, 16)[1] != hs[1]
    with pytest.raises(ValueError, match="block_size"):
        prefix_block_hashes(toks, 0)
    with pytest.raises(ValueError, match=">= 0"):
        hash_block_tokens(None, [1, -2])


def test_allocate_exact_ids_and_all_or_nothing() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    with pytest.raises(NoFreeBlocksError, match="need 2 KV blocks but only 1 of 4"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1  # nothing taken by the failed call
    pool.free([1])
    assert pool.allocate(2) == [3, 1]  # free queue is FIFO
    pool.check_integrity()
    with pytest.raises(ValueError, match="negative"):
        pool.allocate(-1)


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    ids = pool.allocate(2)
    pool.free([ids[0]])
    with pytest.raises(ValueError, match="double free of block 0"):
        pool.free([ids[1], ids[0]])
    assert pool.ref_count(ids[1]) == 1  # the valid half was not applied
    pool.touch([ids[1]])
    with pytest.raises(ValueError, match="double free of block 1"):
        pool.free([ids[1], ids[1], ids[1]])
    pool.free([ids[1], ids[1]])
    pool.check_integrity()
    assert pool.num_free_blocks == 3
    with pytest.raises(IndexError, match="out of range"):
        pool.free([3])


def test_cached_block_lookup_touch_and_revival() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache_block(b, 111)
    assert pool.lookup(111) == b and pool.block_hash(b) == 111
    pool.free([b])
    assert pool.num_cached_blocks == 1 and pool.num_free_blocks == 3
    assert pool.lookup(111) == b  # still findable while evictable
    pool.touch([b])  # cache hit revives it
    assert pool.ref_count(b) == 1 and pool.num_cached_blocks == 0
    pool.touch([b])
    assert pool.ref_count(b) == 2
    pool.free([b, b])
    pool.check_integrity()
    with pytest.raises(ValueError, match="free uncached block 1"):
        pool.touch([1])


def test_cache_block_rules() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, 5)
    pool.cache_block(a, 5)  # idempotent
    with pytest.raises(ValueError, match="different prefix"):
        pool.cache_block(a, 6)
    pool.cache_block(b, 5)  # duplicate content: the first copy stays the cached one
    assert pool.lookup(5) == a and pool.block_hash(b) is None
    with pytest.raises(ValueError, match="unreferenced"):
        pool.cache_block(2, 9)
    pool.free([a, b])
    assert pool.eviction_order() == [a]
    pool.check_integrity()

    off = BlockPool(2, enable_caching=False)
    (c,) = off.allocate(1)
    off.cache_block(c, 5)
    assert off.lookup(5) is None
    off.free([c])
    assert off.num_cached_blocks == 0


def test_eviction_prefers_free_blocks_then_lru_order() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(3)  # [0, 1, 2]
    for i, b in enumerate(ids):
        pool.cache_block(b, 100 + i)
    pool.free([2])
    pool.free([0])
    pool.free([1])
    assert pool.eviction_order() == [2, 0, 1]
    # Block 3 is free and uncached: it goes first, no eviction.
    assert pool.allocate(1) == [3]
    assert pool.lookup(102) == 2
    # Then least recently freed first: 2, then 0 (handed out in ascending order).
    assert pool.allocate(2) == [0, 2]
    assert pool.lookup(102) is None and pool.lookup(100) is None and pool.lookup(101) == 1
    # A revived block is no longer evictable; touching 1 leaves nothing to evict.
    pool.touch([1])
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.check_integrity()


def test_reset_prefix_cache() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, 1)
    pool.free([a, b])
    assert pool.reset_prefix_cache() == 1
    assert pool.lookup(1) is None and pool.num_cached_blocks == 0
    pool.check_integrity()


def test_check_integrity_detects_wrong_holder_count() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.check_integrity(expected_refs={a: 1})
    with pytest.raises(AssertionError, match="ref count 1 but 2 holders"):
        pool.check_integrity(expected_refs={a: 2})
    with pytest.raises(AssertionError, match="ref count 0 but 1 holders"):
        pool.check_integrity(expected_refs={a: 1, 1: 1})


def test_placement_continues_a_table_and_extends_runs() -> None:
    pool = BlockPool(12, enable_caching=False)
    a = pool.allocate(3)  # [0, 1, 2]
    b = pool.allocate(2)  # [3, 4]
    assert (a, b) == ([0, 1, 2], [3, 4])
    # a's next block would be 3 (taken): the free queue's head, then its free neighbours.
    assert pool.allocate(2, after=a[-1]) == [5, 6]
    pool.free([1, 0])  # queue: 7..11, 1, 0
    # A run starting at the queue's head follows free upper neighbours, not queue order.
    assert pool.allocate(3, after=None) == [7, 8, 9]
    # after + 1 free: taken first, even though it sits at the back of the queue.
    assert pool.allocate(2, after=0) == [1, 10]
    pool.check_integrity()


def test_headroom_keeps_blocks_past_a_table_for_its_growth() -> None:
    pool = BlockPool(16, enable_caching=False)
    a = pool.allocate(2, headroom=3)  # [0, 1]; 2, 3, 4 go to the back of the queue
    b = pool.allocate(2, headroom=3)  # [5, 6]; 7, 8, 9 likewise
    assert (a, b) == ([0, 1], [5, 6])
    assert pool.allocate(1) == [10]  # a third request takes neither's headroom
    assert pool.allocate(1, after=a[-1], headroom=2) == [2]
    assert pool.allocate(1, after=b[-1]) == [7]
    assert pool.num_free_blocks == 16 - 7  # nothing reserved: every free block still counts
    # Once nothing else is free, headroom is handed out like any free block.
    rest = pool.allocate(pool.num_free_blocks)
    assert sorted(rest) == [3, 4, 8, 9, 11, 12, 13, 14, 15]
    pool.check_integrity()
    # Headroom stops at the first block that is not free and is bounded.
    pool.free([3, 4])
    pool.free([15])
    assert pool.allocate(1, after=None, headroom=10**9) == [3]
    pool.check_integrity()


def _all_cached(num_blocks: int, first_hash: int) -> BlockPool:
    """A pool whose every block is held and caches hash ``first_hash + block id``."""
    pool = BlockPool(num_blocks)
    for b in pool.allocate(num_blocks):
        pool.cache_block(b, first_hash + b)
    return pool


def test_evicted_blocks_come_out_ascending_but_in_lru_choice() -> None:
    pool = _all_cached(6, 50)
    pool.free(reversed(range(6)))  # eviction order 5, 4, 3, 2, 1, 0
    got = pool.allocate(3)
    assert got == [3, 4, 5]  # the three least recently freed, ascending
    assert [pool.lookup(50 + i) for i in range(3)] == [0, 1, 2]
    pool.check_integrity()


def test_growth_into_a_cached_neighbour_only_from_the_oldest_quarter() -> None:
    pool = _all_cached(10, 70)
    for b in range(10):
        pool.free([b])  # freed in id order: block b is the (b+1)-th oldest, stamp b + 1
    pool.touch([1])  # a prefix hit revives block 1: a request's table ends there
    # No free block left; the LRU list holds 9 blocks. Block 2 has one block freed before it
    # (at most 9 // 4 = 2 may be): taken out of LRU order to continue the table.
    assert pool.allocate(1, after=1) == [2]
    assert pool.lookup(72) is None and pool.lookup(70) == 0
    # Block 3 would have 3 older stamps ahead of it in a list of 8: the oldest goes instead.
    assert pool.allocate(1, after=2) == [0]
    assert pool.lookup(73) == 3
    pool.check_integrity()


def test_the_quarter_counts_entries_not_stamps() -> None:
    """A hot block freed many times must not make every cold block count as old."""
    pool = _all_cached(8, 90)
    pool.free(range(7))
    for _ in range(20):  # block 7: hit and freed again and again (stamps 8..27)
        pool.free([7])
        pool.touch([7])
    pool.free([7])
    pool.touch([0])
    # LRU: blocks 1..6 (stamps 2..7), then 7 (stamp 28). Block 1 is the oldest: taken.
    assert pool.allocate(1, after=0) == [1]
    # Blocks 2..6 and 7 left: block 5 has three entries ahead of it, more than 6 // 4 = 1,
    # although its stamp is in the older half of the stamps' span (3..28): the oldest goes.
    assert pool.allocate(1, after=4) == [2]
    assert pool.lookup(95) == 5
    pool.check_integrity()


def test_after_must_be_an_integer() -> None:
    pool = BlockPool(4)
    with pytest.raises(TypeError):
        pool.allocate(1, after=1.0)  # type: ignore[arg-type]
    assert pool.num_free_blocks == 4
    pool.check_integrity()
