"""KVCacheManager: block tables, prefix hits, LRU eviction order, stats, idempotent free."""

from __future__ import annotations

import pytest

from pdserve.kv_cache.block_pool import prefix_block_hashes
from pdserve.kv_cache.manager import KVCacheManager

BS = 4


def _run(mgr: KVCacheManager, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    """Admit, compute the whole prompt in one step, register its blocks."""
    blocks, cached = mgr.get_computed_blocks(prompt)
    table = mgr.allocate_slots(rid, len(prompt), blocks)
    assert table is not None
    mgr.cache_blocks(rid, prompt, len(prompt))
    return table, cached


def test_block_table_grows_with_exact_ids() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    assert mgr.allocate_slots("a", 5) == [0, 1]
    assert mgr.allocate_slots("b", 1) == [2]
    assert mgr.allocate_slots("a", 8) == [0, 1]  # still covered
    assert mgr.allocate_slots("a", 9) == [0, 1, 3]
    assert mgr.block_table("a") == [0, 1, 3]
    assert mgr.allocate_slots("b", 13) is None  # needs 3 more, 2 free: nothing changes
    assert mgr.block_table("b") == [2] and mgr.num_free_blocks == 2
    assert mgr.usage == pytest.approx(4 / 6)
    mgr.check_integrity()
    assert mgr.free("a") and not mgr.free("a")
    assert not mgr.has("a") and mgr.has("b")
    mgr.check_integrity()
    with pytest.raises(KeyError):
        mgr.block_table("a")


def test_prefix_hit_shares_full_blocks_and_leaves_one_token() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    sys_prompt = list(range(100, 108))  # two full blocks
    t1, c1 = _run(mgr, "a", sys_prompt + [1, 2, 3])
    assert c1 == 0 and t1 == [0, 1, 2]
    blocks, cached = mgr.get_computed_blocks(sys_prompt + [7, 8, 9, 10, 11])
    assert blocks == [0, 1] and cached == 8
    t2 = mgr.allocate_slots("b", 13, blocks)
    assert t2 == [0, 1, 3, 4]
    assert mgr.block_pool.ref_count(0) == 2
    # A prompt that is exactly the cached blocks still computes its last token.
    blocks, cached = mgr.get_computed_blocks(sys_prompt)
    assert blocks == [0] and cached == 4
    # The partial block 2 of request a is never cached.
    assert mgr.get_computed_blocks(sys_prompt + [1, 2, 3, 4, 5])[1] == 8
    assert mgr.prefix_cache_stats == (11 + 13 + 8 + 13, 0 + 8 + 4 + 8)
    mgr.get_computed_blocks(sys_prompt + [5], record_stats=False)
    assert mgr.prefix_cache_stats == (45, 20)
    mgr.record_prefix_query(9, 8)
    assert mgr.prefix_cache_stats == (54, 28)
    with pytest.raises(ValueError, match="hit tokens"):
        mgr.record_prefix_query(4, 8)
    mgr.check_integrity()


def test_chunked_caching_registers_only_computed_full_blocks() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(10))
    mgr.allocate_slots("a", 6)
    mgr.cache_blocks("a", prompt, 6)  # block 0 full, block 1 half
    hs = prefix_block_hashes(prompt, BS)
    assert mgr.block_pool.lookup(hs[0]) == 0 and mgr.block_pool.lookup(hs[1]) is None
    mgr.allocate_slots("a", 10)
    mgr.cache_blocks("a", prompt, 10)
    assert mgr.block_pool.lookup(hs[1]) == 1
    with pytest.raises(ValueError, match="token ids given"):
        mgr.cache_blocks("a", prompt, 11)
    mgr.check_integrity()


def test_free_puts_tail_first_and_eviction_is_lru() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    p1 = list(range(12))  # 3 full blocks -> [0, 1, 2]
    p2 = list(range(50, 62))  # 3 full blocks -> [3, 4, 5]
    _run(mgr, "a", p1)
    _run(mgr, "b", p2)
    mgr.free("a")
    mgr.free("b")
    # Request a freed first (older); within a request the tail block goes first.
    assert mgr.block_pool.eviction_order() == [2, 1, 0, 5, 4, 3]
    assert mgr.num_free_blocks == 6 and mgr.usage == 0.0
    # Re-use p2's prefix: its blocks are revived, so a's blocks are evicted, tail first.
    blocks, cached = mgr.get_computed_blocks(p2[:8] + [0])
    assert blocks == [3, 4] and cached == 8
    assert mgr.allocate_slots("c", 9, blocks) == [3, 4, 2]
    assert mgr.get_computed_blocks(p1 + [0])[0] == [0, 1]  # block 2 (p1's 3rd) evicted
    assert mgr.allocate_slots("d", 12) == [0, 1, 5]  # evicted in LRU order, handed out ascending
    assert mgr.get_computed_blocks(p1 + [0])[0] == []
    mgr.check_integrity()


def test_allocation_failure_counts_revived_blocks() -> None:
    mgr = KVCacheManager(num_blocks=3, block_size=BS)
    prompt = list(range(8))
    _run(mgr, "a", prompt + [0])  # blocks 0,1 cached, 2 partial
    mgr.free("a")
    blocks, _ = mgr.get_computed_blocks(prompt + [9] * 5)
    assert blocks == [0, 1]
    # 13 tokens need 4 blocks: 2 revived + 2 new, but only 1 non-cached block is left.
    assert mgr.allocate_slots("b", 13, blocks) is None
    assert mgr.block_pool.ref_count(0) == 0 and mgr.num_free_blocks == 3
    mgr.check_integrity()
    with pytest.raises(ValueError, match="cover 8 tokens"):
        mgr.allocate_slots("b", 5, blocks)
    assert mgr.allocate_slots("b", 12, blocks) == [0, 1, 2]
    with pytest.raises(ValueError, match="already has a block table"):
        mgr.allocate_slots("b", 12, blocks)


def test_prefix_caching_disabled() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    _run(mgr, "a", list(range(9)))
    mgr.free("a")
    assert mgr.get_computed_blocks(list(range(9))) == ([], 0)
    assert mgr.block_pool.num_cached_blocks == 0
    mgr.check_integrity()
