"""Hypothesis state machines: random allocate/free/cache/touch/evict sequences keep every invariant.

Two machines: one drives BlockPool directly, one drives KVCacheManager like a scheduler would (with
a shadow copy of each block's token contents, so a prefix-cache hit must return blocks holding
exactly the prompt's tokens).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.kv_cache.block_pool import BlockPool, NoFreeBlocksError
from pdserve.kv_cache.manager import KVCacheManager

SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class PoolMachine(RuleBasedStateMachine):
    """Holders are lists of block ids; each holds one reference per entry."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(8)
        self.holders: list[list[int]] = []
        self.next_hash = 1

    @rule(n=st.integers(0, 5), after=st.none() | st.integers(-1, 8), headroom=st.integers(0, 4))
    def allocate(self, n: int, after: int | None, headroom: int) -> None:
        before = self.pool.num_free_blocks
        try:
            ids = self.pool.allocate(n, after, headroom)
        except NoFreeBlocksError:
            assert n > before
            assert self.pool.num_free_blocks == before
            return
        assert len(ids) == n == len(set(ids))
        held = {b for h in self.holders for b in h}
        assert not held & set(ids), "allocate handed out a referenced block"
        self.holders.append(ids)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def free_holder(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.holders) - 1))
        ids = self.holders.pop(i)
        self.pool.free(reversed(ids))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def cache_one(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(self.holders))
        if not h:
            return
        b = data.draw(st.sampled_from(h))
        if self.pool.block_hash(b) is None:
            self.pool.cache_block(b, self.next_hash)
            self.next_hash += 1

    @precondition(lambda self: self.next_hash > 1)
    @rule(data=st.data())
    def hit(self, data: st.DataObject) -> None:
        b = self.pool.lookup(data.draw(st.integers(1, self.next_hash - 1)))
        if b is not None:
            self.pool.touch([b])
            self.holders.append([b])

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def double_free_is_refused(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(self.holders))
        if not h:
            return
        b = h[0]
        extra = self.pool.ref_count(b) + 1
        with pytest.raises(ValueError, match="double free"):
            self.pool.free([b] * extra)

    @invariant()
    def consistent(self) -> None:
        refs = Counter(b for h in self.holders for b in h)
        self.pool.check_integrity(expected_refs=dict(refs))
        assert self.pool.num_free_blocks + len(refs) == self.pool.num_blocks  # no leak


class ManagerMachine(RuleBasedStateMachine):
    """Requests with prompts over a 2-token vocabulary (so prefixes collide often), block size 2."""

    BS = 2

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(num_blocks=10, block_size=self.BS)
        self.reqs: dict[str, tuple[list[int], int]] = {}  # rid -> (tokens, num_computed)
        self.content: dict[int, tuple[int, ...]] = {}  # block -> tokens written to it
        self.n = 0

    @rule(
        prompt=st.lists(st.integers(0, 1), min_size=1, max_size=9),
        chunk=st.integers(1, 9),
        headroom=st.integers(0, 12),
    )
    def admit(self, prompt: list[int], chunk: int, headroom: int) -> None:
        blocks, cached = self.mgr.get_computed_blocks(prompt)
        assert cached == len(blocks) * self.BS < len(prompt)
        for i, b in enumerate(blocks):
            assert self.content.get(b) == tuple(prompt[i * self.BS : (i + 1) * self.BS])
        rid = f"r{self.n}"
        self.n += 1
        todo = min(len(prompt), cached + chunk)
        free_before = self.mgr.num_free_blocks
        table = self.mgr.allocate_slots(rid, todo, blocks, headroom)
        if table is None:
            assert not self.mgr.has(rid) and self.mgr.num_free_blocks == free_before
            return
        assert table[: len(blocks)] == blocks
        self._compute(rid, prompt, cached, todo)

    def _compute(self, rid: str, prompt: list[int], start: int, end: int) -> None:
        table = self.mgr.block_table(rid)
        bs = self.BS
        for t in range(start, end):  # "write" KV of token t
            b = table[t // bs]
            cur = list(self.content.get(b, ())) if t % bs else []
            self.content[b] = (*cur[: t % bs], prompt[t])
        self.mgr.cache_blocks(rid, prompt, end)
        self.reqs[rid] = (prompt, end)

    @precondition(lambda self: any(n < len(p) for p, n in self.reqs.values()))
    @rule(data=st.data(), chunk=st.integers(1, 4), headroom=st.integers(0, 12))
    def continue_chunk(self, data: st.DataObject, chunk: int, headroom: int) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r, (p, n) in self.reqs.items() if n < len(p))))
        prompt, done = self.reqs[rid]
        end = min(len(prompt), done + chunk)
        if self.mgr.allocate_slots(rid, end, headroom_tokens=headroom) is not None:
            self._compute(rid, prompt, done, end)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        del self.reqs[rid]
        assert self.mgr.free(rid)
        assert not self.mgr.free(rid)  # idempotent

    @invariant()
    def consistent(self) -> None:
        self.mgr.check_integrity()
        held = {b for r in self.reqs for b in self.mgr.block_table(r)}
        assert self.mgr.num_free_blocks + len(held) == self.mgr.num_blocks
        q, h = self.mgr.prefix_cache_stats
        assert 0 <= h <= q


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = SETTINGS
TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = SETTINGS
