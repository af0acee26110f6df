"""Physical KV block bookkeeping: reference counts, free queue, prefix-cache hashes, LRU eviction.

No torch here (DESIGN §1): the pool only hands out integer block ids; ``pool.py`` owns the tensor.

Every block is in exactly one of three states (``check_integrity`` verifies this):

* **free**: ref count 0, no content hash, on the free queue;
* **referenced**: ref count > 0 (held by one or more requests), maybe carrying a content hash;
* **evictable cached**: ref count 0 with a content hash, on the LRU list. A prefix-cache lookup
  can revive it (``touch``); ``allocate`` reuses it (dropping its hash) only when no free block
  is left, oldest first.

Placement: a decode step reads every running sequence's K and V block by block, and on CPUs the
memory system delivers scattered 12 KB blocks markedly slower than a contiguous run (SmolLM2 fp32,
14 sequences at context 350: 29.6 ms a step with each block table contiguous against 32.1 ms
with the same blocks shuffled, docs/benchmarks.md session 36). So ``allocate`` places blocks in
runs where it is free to: a request's new blocks continue its table (``after``), a run taken from
the free queue extends upward through free neighbours, evicted blocks are handed out in ascending
order, and ``headroom`` pushes the free blocks just past a table's end to the back of the free
queue, so a growing request usually finds its next block adjacent. Nothing is reserved (the free
count is unchanged), and eviction stays least recently freed first except that a growing table
may take its cached upper neighbour when that one is among the oldest quarter of the LRU list.
Such a neighbour is usually the first block of an old request's run, so its cached successors
become unreachable (prefix lookups are chained) and wait on the LRU list for their turn. In a
simulated multi-turn workload under cache pressure (/tmp script, docs/benchmarks.md session 36)
this cost 0.4-0.5 points of prefix-cache hit rate where the oldest half cost 2.1-2.5.

Prefix hashes are chained: the hash of block *i* covers the parent hash (block *i-1*) and block
*i*'s tokens, so one hash names the whole prefix up to the end of that block (the scheme of
vLLM's automatic prefix caching and SGLang's radix cache, reduced to full blocks). They use
BLAKE2b, never Python's salted ``hash()``, so a router or another worker process computes the same
values for the same tokens.
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

# Hashes are unsigned 64-bit ints (the first 8 bytes of a BLAKE2b digest, little-endian).
_HASH_BYTES = 8
_ROOT_TAG = b"pdserve-kv-root\x00"  # parent of the first block; distinct from any 8-byte parent
_PARENT = struct.Struct("<Q")


class NoFreeBlocksError(RuntimeError):
    """``BlockPool.allocate`` asked for more blocks than are free plus evictable."""


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Content hash of one block chained on its parent's hash.

    ``parent_hash``: the previous block's hash, or None for the first block of a sequence.
    ``token_ids``: the block's token ids (each in [0, 2^63)). Returns an unsigned 64-bit int that
    is the same in every process and Python version. Raises ValueError for a negative token id.
    """
    if any(t < 0 for t in token_ids):
        raise ValueError(f"token ids must be >= 0, got {min(token_ids)}")
    h = hashlib.blake2b(digest_size=_HASH_BYTES)
    h.update(_ROOT_TAG if parent_hash is None else _PARENT.pack(parent_hash))
    try:
        h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    except struct.error:
        raise ValueError(
            f"token ids must be ints in [0, 2^63), got {list(token_ids)[:8]}"
        ) from None
    return int.from_bytes(h.digest(), "little")


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the FULL blocks of ``token_ids`` (a trailing partial block is skipped).

    Returns ``len(token_ids) // block_size`` hashes; entry *i* names tokens ``[0, (i+1)*block_size)``.
    Raises ValueError when block_size <= 0.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class BlockPool:
    """Reference-counted pool of ``num_blocks`` KV blocks with an LRU prefix cache.

    ``enable_caching=False`` makes ``cache_block`` a no-op, so freed blocks always go back to the
    free queue. Block ids are ``0..num_blocks-1``; a fresh pool hands them out in ascending order.
    """

    # Most blocks one ``allocate`` moves behind a table's end as headroom (bounds its cost).
    MAX_HEADROOM_BLOCKS = 64

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        # ref 0, no hash; an ordered set: FIFO order, and O(1) removal of a chosen block.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # ref 0 with a hash -> its free stamp; iteration order = eviction order (least recently
        # freed first, so stamps ascend).
        self._lru: OrderedDict[int, int] = OrderedDict()
        self._stamp = 0  # frees into the LRU list so far
        self._hash_to_block: dict[int, int] = {}

    # ----------------------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks an ``allocate`` can hand out now: free plus evictable cached."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks that still hold cached prefix content (evictable)."""
        return len(self._lru)

    def ref_count(self, block_id: int) -> int:
        """Current reference count of ``block_id``. Raises IndexError when out of range."""
        self._check_id(block_id)
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> int | None:
        """The content hash registered for ``block_id``, or None."""
        self._check_id(block_id)
        return self._hash[block_id]

    def lookup(self, block_hash: int) -> int | None:
        """The block holding the prefix named by ``block_hash`` (referenced or evictable), or None."""
        return self._hash_to_block.get(block_hash)

    def eviction_order(self) -> list[int]:
        """Evictable cached blocks, next-to-evict first (for tests and stats)."""
        return list(self._lru)

    # ----------------------------------------------------------------------------- mutations
    def allocate(self, n: int, after: int | None = None, headroom: int = 0) -> list[int]:
        """Take ``n`` blocks (ref count 1 each), all or nothing.

        Free blocks go first, in the free queue's order (FIFO; ascending on a fresh pool),
        except that each block taken is followed by its upper neighbour while that one is free,
        starting from ``after + 1`` when ``after`` (the caller's last block) is given. Then cached
        blocks are evicted (their hashes dropped): the run's upper neighbour while at most a
        quarter of the LRU list was freed before it, then the least recently freed ones, handed
        out in ascending id order. ``headroom``: blocks the caller expects to append later; up
        to that many (at most ``MAX_HEADROOM_BLOCKS``) free blocks right after the last block
        handed out move to the back of the free queue, so other callers reach them after the
        blocks queued before them (a hint: blocks freed later still queue behind them).
        Raises NoFreeBlocksError when ``n`` exceeds ``num_free_blocks`` (nothing changes),
        ValueError when ``n < 0``.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"need {n} KV blocks but only {self.num_free_blocks} of {self.num_blocks} are free"
            )
        out: list[int] = []
        free = self._free
        nxt = -1 if after is None else operator.index(after) + 1
        while len(out) < n and free:
            if nxt in free:
                del free[nxt]
                b = nxt
            else:
                b, _ = free.popitem(last=False)
            out.append(b)
            nxt = b + 1
        if len(out) < n:
            lru = self._lru
            # Continue the run into a cached neighbour only if it is among the oldest quarter of
            # the LRU list: stamps ascend along the list, so at most ``lru[nxt] - oldest`` of its
            # entries are older than ``nxt``.
            oldest = next(iter(lru.values()))
            while len(out) < n and nxt in lru and lru[nxt] - oldest <= len(lru) // 4:
                self._evict(nxt)
                out.append(nxt)
                nxt += 1
            out.extend(sorted(self._evict(next(iter(lru))) for _ in range(n - len(out))))
        for b in out:
            self._ref[b] = 1
        if out:
            end = out[-1] + 1
            for b in range(end, end + min(headroom, self.MAX_HEADROOM_BLOCKS)):
                if b not in free:
                    break
                free.move_to_end(b)
        return out

    def _evict(self, b: int) -> int:
        """Take evictable cached block ``b`` off the LRU list and drop its hash; returns ``b``."""
        del self._lru[b]
        h = self._hash[b]
        assert h is not None
        del self._hash_to_block[h]
        self._hash[b] = None
        return b

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a prefix-cache hit).

        An evictable cached block leaves the LRU list. Raises ValueError (changing nothing) if a
        block is free and uncached: it holds no content anyone may share.
        """
        ids = list(block_ids)
        for b in ids:
            self._check_id(b)
            if self._ref[b] == 0 and self._hash[b] is None:
                raise ValueError(f"touch of free uncached block {b}")
        for b in ids:
            if self._ref[b] == 0:
                del self._lru[b]
            self._ref[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order.

        A block reaching 0 goes to the LRU tail when it carries a hash (evictable cached), else
        back to the free queue. Blocks appended later are evicted later, so a caller freeing a
        request's block table should pass it reversed (tail block first) to keep the prefix's
        earlier blocks longest. Raises ValueError (changing nothing) on a double free.
        """
        ids = list(block_ids)
        drops = Counter(ids)
        for b, k in drops.items():
            self._check_id(b)
            if self._ref[b] < k:
                raise ValueError(
                    f"double free of block {b} (ref count {self._ref[b]}, freeing {k} times)"
                )
        for b in ids:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash[b] is not None:
                    self._stamp += 1
                    self._lru[b] = self._stamp
                else:
                    self._free[b] = None

    def cache_block(self, block_id: int, block_hash: int) -> None:
        """Register ``block_id`` (referenced, full, computed) as holding the prefix ``block_hash``.

        No-op when caching is off, when the block already carries this hash, or when another block
        already holds this prefix (two requests computed it concurrently; the first one stays
        the cached copy and this block is freed normally later). Raises ValueError when the block
        is not referenced or already carries a different hash.
        """
        self._check_id(block_id)
        if not self.enable_caching:
            return
        if self._ref[block_id] == 0:
            raise ValueError(f"cache_block of unreferenced block {block_id}")
        cur = self._hash[block_id]
        if cur is not None:
            if cur != block_hash:
                raise ValueError(f"block {block_id} already caches a different prefix")
            return
        if block_hash in self._hash_to_block:
            return
        self._hash[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id

    def reset_prefix_cache(self) -> int:
        """Drop every evictable cached block back to the free queue. Returns how many."""
        n = len(self._lru)
        while self._lru:
            b, _ = self._lru.popitem(last=False)
            h = self._hash[b]
            assert h is not None
            del self._hash_to_block[h]
            self._hash[b] = None
            self._free[b] = None
        return n

    # ----------------------------------------------------------------------------- checks
    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Assert every invariant; raises AssertionError naming the first broken one.

        ``expected_refs``: block id -> number of holders (e.g. from the block tables of a
        KVCacheManager); when given, every block's ref count must equal it (0 when absent).
        """
        free_list = list(self._free)
        free_set = set(free_list)
        lru_set = set(self._lru)
        if len(free_set) != len(free_list):
            dup = [b for b, k in Counter(free_list).items() if k > 1]
            raise AssertionError(f"blocks {dup} appear more than once on the free queue")
        both = free_set & lru_set
        if both:
            raise AssertionError(f"blocks {sorted(both)} are both free and evictable-cached")
        for b in range(self.num_blocks):
            ref, h = self._ref[b], self._hash[b]
            if ref < 0:
                raise AssertionError(f"block {b} has negative ref count {ref}")
            if ref > 0 and (b in free_set or b in lru_set):
                raise AssertionError(f"block {b} is referenced ({ref}) but on a free list")
            if ref == 0:
                if h is None and b not in free_set:
                    raise AssertionError(f"block {b} is unreferenced and uncached but not free")
                if h is not None and b not in lru_set:
                    raise AssertionError(f"block {b} is unreferenced and cached but not on LRU")
                if h is None and b in lru_set:
                    raise AssertionError(f"block {b} is on the LRU without a hash")
                if h is not None and b in free_set:
                    raise AssertionError(f"block {b} is on the free queue with a hash")
            if h is not None and self._hash_to_block.get(h) != b:
                raise AssertionError(f"block {b}'s hash maps to {self._hash_to_block.get(h)}")
            if expected_refs is not None and ref != expected_refs.get(b, 0):
                raise AssertionError(
                    f"block {b} has ref count {ref} but {expected_refs.get(b, 0)} holders"
                )
        for h, b in self._hash_to_block.items():
            if not 0 <= b < self.num_blocks or self._hash[b] != h:
                raise AssertionError(f"hash map entry {h:#x} -> {b} does not match the block")
        if expected_refs is not None:
            unknown = [b for b in expected_refs if not 0 <= b < self.num_blocks]
            if unknown:
                raise AssertionError(f"holders reference unknown blocks {unknown}")
        if len(free_set) + len(lru_set) + sum(1 for r in self._ref if r > 0) != self.num_blocks:
            raise AssertionError("free + evictable + referenced != num_blocks (leak)")

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} out of range [0, {self.num_blocks})")
