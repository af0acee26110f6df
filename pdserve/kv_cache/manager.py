"""Per-request block tables on top of a :class:`BlockPool` (no torch).

Lifecycle of one request's blocks:

1. ``get_computed_blocks(prompt)`` finds the longest run of FULL prompt blocks already cached
   (automatic prefix caching). It never covers the whole prompt: at least one token is left to
   compute so the last position yields logits to sample from.
2. ``allocate_slots(rid, n, computed_blocks)`` makes the block table cover ``n`` tokens; the first
   call takes (touches) the cached blocks first. Call it right after ``get_computed_blocks`` with
   no other allocation in between, or an evicted block could have been reused.
3. After each forward, ``cache_blocks(rid, tokens, num_computed)`` registers hashes of the blocks
   that became full, so later requests can share them.
4. ``free(rid)`` drops the request's references; cached blocks become evictable, tail block
   first, so a shared prefix's first blocks are evicted last.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pdserve.kv_cache.block_pool import BlockPool, hash_block_tokens


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables of the requests on one worker, with automatic prefix caching.

    ``num_blocks`` blocks of ``block_size`` tokens. With ``enable_prefix_caching=False`` nothing is
    ever looked up or registered.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._tables: dict[str, list[int]] = {}
        # Chained hashes of the request's leading full blocks already registered (or taken from
        # the cache); entry i belongs to block_table[i].
        self._hashes: dict[str, list[int]] = {}
        self._query_tokens = 0
        self._hit_tokens = 0

    # ----------------------------------------------------------------------------- queries
    @property
    def num_blocks(self) -> int:
        """Total blocks in the pool."""
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to new allocations (free + evictable cached)."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1 (evictable cached blocks count as free)."""
        return 1.0 - self.block_pool.num_free_blocks / self.block_pool.num_blocks

    @property
    def prefix_cache_stats(self) -> tuple[int, int]:
        """(queried prompt tokens, prefix-cache hit tokens) since start."""
        return self._query_tokens, self._hit_tokens

    def has(self, request_id: str) -> bool:
        """True while ``request_id`` holds a block table."""
        return request_id in self._tables

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table. Raises KeyError for an unknown request."""
        return list(self._tables[request_id])

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks covering ``num_tokens`` tokens."""
        return _cdiv(num_tokens, self.block_size)

    # ----------------------------------------------------------------------------- prefix cache
    def get_computed_blocks(
        self, token_ids: Sequence[int], record_stats: bool = True
    ) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks of ``token_ids``: (block ids, cached tokens).

        At most ``(len(token_ids) - 1) // block_size`` blocks, so at least one token is left to
        compute. Read-only except for the hit statistics (``record_stats=False`` when re-asking for
        a request already counted, e.g. one that waited a step for room).
        """
        blocks: list[int] = []
        if self.enable_prefix_caching and token_ids:
            max_blocks = (len(token_ids) - 1) // self.block_size
            parent: int | None = None
            bs = self.block_size
            for i in range(max_blocks):
                parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
                b = self.block_pool.lookup(parent)
                if b is None:
                    break
                blocks.append(b)
        num_cached = len(blocks) * self.block_size
        if record_stats:
            self._query_tokens += len(token_ids)
            self._hit_tokens += num_cached
        return blocks, num_cached

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one prefix-cache query in ``prefix_cache_stats`` (for callers that look up with
        ``record_stats=False`` and count once, when the request is admitted)."""
        if not 0 <= num_hit_tokens <= num_query_tokens:
            raise ValueError(f"hit tokens {num_hit_tokens} not in [0, {num_query_tokens}]")
        self._query_tokens += num_query_tokens
        self._hit_tokens += num_hit_tokens

    # ----------------------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        request_id: str,
        num_tokens: int,
        computed_blocks: Sequence[int] = (),
        headroom_tokens: int = 0,
    ) -> list[int] | None:
        """Grow ``request_id``'s block table to cover ``num_tokens`` tokens in total.

        On the request's first call, ``computed_blocks`` (from ``get_computed_blocks``) become the
        table's first entries. New blocks continue the table's last block where the pool can
        (see :class:`BlockPool` on placement); ``headroom_tokens``: tokens the request may still
        append after these (e.g. its remaining ``max_tokens``): the free blocks past the table's
        end that would hold them (at most ``BlockPool.MAX_HEADROOM_BLOCKS``) move to the back of
        the free queue, so other requests reach them after the blocks queued before them. A
        hint, not a reservation: the count of free blocks does not change, and blocks freed
        later queue behind them. Returns a copy of the full block table, or None when the pool
        lacks room (then nothing changes). Raises ValueError when ``computed_blocks`` is passed
        for a request that already has a table or covers more than ``num_tokens``.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        pool = self.block_pool
        table = self._tables.get(request_id)
        if table is not None:
            if computed_blocks:
                raise ValueError(f"request {request_id!r} already has a block table")
            need = self.num_blocks_needed(num_tokens) - len(table)
            if need <= 0:
                return list(table)
            if need > pool.num_free_blocks:
                return None
            after = table[-1] if table else None
            table.extend(pool.allocate(need, after, self._headroom(num_tokens, headroom_tokens)))
            return list(table)

        computed = list(computed_blocks)
        if len(computed) * self.block_size > max(num_tokens, 0) and computed:
            raise ValueError(
                f"computed_blocks cover {len(computed) * self.block_size} tokens, more than "
                f"num_tokens={num_tokens}"
            )
        need = self.num_blocks_needed(num_tokens) - len(computed)
        # Touching an evictable cached block takes it out of the free count.
        revived = sum(1 for b in set(computed) if pool.ref_count(b) == 0)
        if need > pool.num_free_blocks - revived:
            return None
        pool.touch(computed)
        hashes: list[int] = []
        for b in computed:
            h = pool.block_hash(b)
            if h is None:
                raise AssertionError(f"computed block {b} lost its prefix hash")
            hashes.append(h)
        after = computed[-1] if computed else None
        table = computed + pool.allocate(need, after, self._headroom(num_tokens, headroom_tokens))
        self._tables[request_id] = table
        self._hashes[request_id] = hashes
        return list(table)

    def _headroom(self, num_tokens: int, headroom_tokens: int) -> int:
        """Blocks beyond those covering ``num_tokens`` that ``headroom_tokens`` more would need."""
        if headroom_tokens <= 0:
            return 0
        return self.num_blocks_needed(num_tokens + headroom_tokens) - self.num_blocks_needed(
            num_tokens
        )

    def cache_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Register the hashes of the request's full blocks within its first ``num_computed_tokens``.

        ``token_ids``: the request's tokens (at least ``num_computed_tokens`` of them) whose KV is
        now in the pool. Blocks already registered are skipped. Raises KeyError for an unknown
        request and ValueError when the tokens or the table do not cover ``num_computed_tokens``.
        """
        if not self.enable_prefix_caching:
            return
        table = self._tables[request_id]
        hashes = self._hashes[request_id]
        if num_computed_tokens > len(token_ids):
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} > {len(token_ids)} token ids given"
            )
        num_full = num_computed_tokens // self.block_size
        if num_full > len(table):
            raise ValueError(
                f"request {request_id!r} has {len(table)} blocks, fewer than {num_full} full ones"
            )
        bs = self.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full):
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            self.block_pool.cache_block(table[i], parent)
            hashes.append(parent)

    def free(self, request_id: str) -> bool:
        """Release the request's blocks (tail block first). Idempotent; True if it held any."""
        table = self._tables.pop(request_id, None)
        self._hashes.pop(request_id, None)
        if table is None:
            return False
        self.block_pool.free(reversed(table))
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every evictable cached block. Returns how many were dropped."""
        return self.block_pool.reset_prefix_cache()

    # ----------------------------------------------------------------------------- checks
    def check_integrity(self) -> None:
        """Assert pool invariants and that each block's ref count equals its number of holders.

        Raises AssertionError naming the broken invariant.
        """
        holders: Counter[int] = Counter()
        for rid, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"request {rid!r} holds a block twice: {table}")
            if len(self._hashes[rid]) > len(table):
                raise AssertionError(f"request {rid!r} has more hashes than blocks")
            holders.update(table)
        self.block_pool.check_integrity(expected_refs=dict(holders))
