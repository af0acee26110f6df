"""Placement policy: which decode worker reserves KV, which prefill worker computes the prompt.

Pure functions over load snapshots (no I/O, no gRPC, no Ray), so every decision is testable in
microseconds. Each function returns a *ranking* (best first) rather than one worker, so the
lifecycle can fall through to the next candidate when the first refuses or fails.

Decode: a worker must have room for the prompt's blocks; among those, the fewest running
sequences wins (continuous batching slows every sequence on a busy worker), ties broken by more
free blocks. Workers without room come last, most free blocks first (their stats may be stale).

Prefill: prefix affinity by rendezvous (highest-random-weight) hashing, Thaler & Ravishankar,
"A Name-Based Mapping Scheme for Rendezvous" (1996): every router computes the same owner for a
prompt prefix without shared state, and adding or removing a worker only moves the prefixes it
owned. The key is the chained hash of the prompt's first ``affinity_blocks`` full KV blocks (the
hash of a block names its whole prefix), so prompts that share a system prompt or few-shot header
land where that prefix is cached. A load guard, in the spirit of SGLang's cache-aware router
(route by cache unless the cluster is imbalanced), sends the request to the least-queued worker
instead when the affine one has both ``balance_abs_tokens`` more queued prompt tokens than the
least-queued worker and ``balance_rel`` times as many.

Conditional disaggregation (:func:`prefill_locally`), after NVIDIA Dynamo's feature of that name:
a short prompt is prefilled on its decode worker instead of waiting behind a backlog on the
prefill workers. Dynamo decides by prompt length and prefill queue size; here the prompt must be
short, every prefill worker backlogged for the prompt's own class (a prompt the prefill scheduler
classes short waits only behind the short prompts queued there), and the local prefills in
flight on some decode worker, this one included, within the length limit or, when the prefill
workers' backlog is longer, within that backlog (the shorter of the two queues).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeLoad:
    """A decode worker's load as the router sees it.

    ``free_blocks``: KV blocks free (reported, minus reservations the router made since the
    report). ``running``: sequences running or waiting for KV (reported plus router in-flight not
    yet reflected in a report). ``local_prefill_tokens``: prompt tokens this router sent there
    to be prefilled locally, of prompts that have not produced their first token.
    """

    worker_id: str
    free_blocks: int
    running: int
    local_prefill_tokens: int = 0


@dataclass(frozen=True)
class PrefillLoad:
    """A prefill worker's load in prompt tokens not yet computed on it: ``queued_tokens`` in
    all, ``queued_short_tokens`` of them in prompts of at most ``long_threshold`` tokens, the
    class its scheduler serves ahead of longer prompts' chunks (0 = one first-come class).
    """

    worker_id: str
    queued_tokens: int
    queued_short_tokens: int = 0
    long_threshold: int = 0

    def backlog(self, num_tokens: int) -> int:
        """Prompt tokens a new ``num_tokens``-token prompt would wait behind here: the short
        class's when it is short (long prompts' chunks take a bounded share of each step, see
        prefill_worker/scheduler.py), else the whole queue."""
        if 0 < num_tokens <= self.long_threshold:
            return self.queued_short_tokens
        return self.queued_tokens


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """KV blocks needed to hold ``num_tokens`` tokens (ceil division). Raises ValueError if < 0."""
    if num_tokens < 0 or block_size <= 0:
        raise ValueError(f"need num_tokens >= 0 and block_size > 0, got {num_tokens}, {block_size}")
    return -(-num_tokens // block_size)


def rank_decode(
    workers: Sequence[DecodeLoad], blocks_needed: int, *, local: bool = False
) -> list[str]:
    """Decode workers best first for a request needing ``blocks_needed`` KV blocks.

    ``local``: the request will be prefilled there; among workers with room, those with the
    fewest local prefill tokens in flight go first (so the one :func:`prefill_locally` found
    room on is tried first).
    """
    fits = [w for w in workers if w.free_blocks >= blocks_needed]
    short = [w for w in workers if w.free_blocks < blocks_needed]
    fits.sort(
        key=lambda w: (
            w.local_prefill_tokens if local else 0,
            w.running,
            -w.free_blocks,
            w.worker_id,
        )
    )
    short.sort(key=lambda w: (-w.free_blocks, w.running, w.worker_id))
    return [w.worker_id for w in fits + short]


def prefill_locally(
    num_tokens: int,
    prefill: Sequence[PrefillLoad],
    decode: Sequence[DecodeLoad],
    max_local_prefill_length: int,
    min_prefill_queue_tokens: int,
) -> bool:
    """Conditional disaggregation: prefill a ``num_tokens``-token prompt on its decode worker?

    True when ``num_tokens <= max_local_prefill_length`` (0 turns the feature off), the prompt
    would wait behind at least ``min_prefill_queue_tokens`` prompt tokens on every prefill
    worker in ``prefill`` (:meth:`PrefillLoad.backlog`: a short prompt counts only the short
    prompts queued, which the prefill scheduler serves ahead of long prompts' chunks; the
    smallest such backlog is the prompt's wait there), and on some decode worker the local
    prefills in flight, this prompt included, stay within the larger of
    ``max_local_prefill_length`` and that backlog. The first bounds the prefill work a decode
    worker takes on beside its batch while the prefill workers keep up (a burst of short
    prompts can go local together, one prompt of the maximum length goes alone); the second
    lets the local queue grow as long as the queue the prompt would join remotely, so a burst
    splits between the two (join the shorter queue) instead of waiting on the prefill worker
    while the decode worker prefills one prompt at a time. False with no prefill worker: the
    caller falls back to local prefill for that reason, not this one.
    (NVIDIA Dynamo's conditional disaggregation gates on the prompt length and the prefill
    queue; the in-flight token bound is pdserve's, for decode workers that share a CPU.)
    Measured (session 34, docs/benchmarks.md): 16 prompts of ~286 tokens arriving at once went
    1 local / 15 remote with the length bound alone, the last first token after 4.3 s; with the
    backlog bound 5 / 11, 2.8 s.
    """
    if not prefill or num_tokens > max_local_prefill_length:
        return False
    backlog = min(w.backlog(num_tokens) for w in prefill)
    if backlog < min_prefill_queue_tokens:
        return False
    limit = max(max_local_prefill_length, backlog)
    return any(w.local_prefill_tokens + num_tokens <= limit for w in decode)


def _weight(key: int, worker_id: str) -> int:
    """Rendezvous weight of (key, worker): 64 bits of BLAKE2b, identical in every process."""
    h = hashlib.blake2b(digest_size=8)
    h.update(key.to_bytes(16, "little", signed=True))
    h.update(worker_id.encode())
    return int.from_bytes(h.digest(), "little")


def rendezvous_rank(key: int, worker_ids: Sequence[str]) -> list[str]:
    """Worker ids by descending rendezvous weight for ``key`` (the first one owns the key)."""
    return sorted(worker_ids, key=lambda w: (-_weight(key, w), w))


@dataclass(frozen=True)
class PrefillPolicy:
    """Prefix-affinity prefill placement with a load guard (see the module docstring).

    ``affinity_blocks``: how many leading full blocks form the affinity key (>= 1).
    ``balance_abs_tokens``: queued-token gap (tokens) beyond which affinity may be overridden.
    ``balance_rel``: ratio (>= 1) the affine worker's queue must also exceed over the minimum.
    """

    affinity_blocks: int = 4
    balance_abs_tokens: int = 2048
    balance_rel: float = 1.5

    def __post_init__(self) -> None:
        if self.affinity_blocks < 1:
            raise ValueError(f"affinity_blocks must be >= 1, got {self.affinity_blocks}")
        if self.balance_abs_tokens < 0:
            raise ValueError(f"balance_abs_tokens must be >= 0, got {self.balance_abs_tokens}")
        if self.balance_rel < 1:
            raise ValueError(f"balance_rel must be >= 1, got {self.balance_rel}")

    def affinity_key(self, prefix_hashes: Sequence[int]) -> int | None:
        """The chained hash of the first ``affinity_blocks`` full blocks; None without a full block."""
        if not prefix_hashes:
            return None
        return prefix_hashes[min(len(prefix_hashes), self.affinity_blocks) - 1]

    def rank(self, workers: Sequence[PrefillLoad], prefix_hashes: Sequence[int]) -> list[str]:
        """Prefill workers best first. ``prefix_hashes``: the prompt's chained full-block hashes."""
        if not workers:
            return []
        by_load = sorted(workers, key=lambda w: (w.queued_tokens, w.worker_id))
        key = self.affinity_key(prefix_hashes)
        if key is None:
            return [w.worker_id for w in by_load]
        owner_id = rendezvous_rank(key, [w.worker_id for w in workers])[0]
        owner = next(w for w in workers if w.worker_id == owner_id)
        least = by_load[0]
        gap = owner.queued_tokens - least.queued_tokens
        imbalanced = (
            gap > self.balance_abs_tokens
            and owner.queued_tokens > self.balance_rel * least.queued_tokens
        )
        first = least if imbalanced else owner
        return [first.worker_id] + [w.worker_id for w in by_load if w is not first]
