"""Placement policy (pure): decode ranking, rendezvous hashing, prefix affinity, load guard."""

from __future__ import annotations

import pytest

from pdserve.kv_cache.block_pool import prefix_block_hashes
from router.policy import (
    DecodeLoad,
    PrefillLoad,
    PrefillPolicy,
    blocks_for_tokens,
    prefill_locally,
    rank_decode,
    rendezvous_rank,
)


def test_blocks_for_tokens() -> None:
    assert [blocks_for_tokens(n, 16) for n in (0, 1, 16, 17, 33)] == [0, 1, 1, 2, 3]
    with pytest.raises(ValueError, match="block_size"):
        blocks_for_tokens(5, 0)


def test_decode_prefers_room_then_fewest_running_then_most_free() -> None:
    loads = [
        DecodeLoad("a", free_blocks=100, running=5),
        DecodeLoad("b", free_blocks=50, running=2),
        DecodeLoad("c", free_blocks=80, running=2),
        DecodeLoad("d", free_blocks=3, running=0),  # no room for 4 blocks
        DecodeLoad("e", free_blocks=1, running=0),
    ]
    assert rank_decode(loads, blocks_needed=4) == ["c", "b", "a", "d", "e"]
    assert rank_decode([], 1) == []


def test_rendezvous_is_stable_and_moves_only_the_removed_workers_keys() -> None:
    workers = [f"prefill-{i}" for i in range(5)]
    keys = range(2000)
    owner = {k: rendezvous_rank(k, workers)[0] for k in keys}
    assert owner == {k: rendezvous_rank(k, list(reversed(workers)))[0] for k in keys}
    counts = {w: sum(1 for o in owner.values() if o == w) for w in workers}
    assert min(counts.values()) > 2000 / 5 * 0.7  # roughly balanced
    fewer = [w for w in workers if w != "prefill-2"]
    for k in keys:
        new = rendezvous_rank(k, fewer)[0]
        assert new == owner[k] or owner[k] == "prefill-2"


def test_affinity_key_uses_the_first_blocks_of_the_prompt() -> None:
    policy = PrefillPolicy(affinity_blocks=2)
    system = list(range(1, 33))  # two full blocks shared by both prompts
    a = prefix_block_hashes(system + [100] * 20, 16)
    b = prefix_block_hashes(system + [200] * 40, 16)
    assert policy.affinity_key(a) == policy.affinity_key(b) == a[1]
    assert policy.affinity_key(prefix_block_hashes([1, 2, 3], 16)) is None
    assert policy.affinity_key(a[:1]) == a[0]


def test_prefill_affinity_and_load_guard() -> None:
    policy = PrefillPolicy(affinity_blocks=1, balance_abs_tokens=1000, balance_rel=2.0)
    hashes = prefix_block_hashes(list(range(1, 17)), 16)
    ids = ["p0", "p1", "p2"]
    owner = rendezvous_rank(hashes[0], ids)[0]

    def loads(owner_tokens: int, others: int) -> list[PrefillLoad]:
        return [PrefillLoad(w, owner_tokens if w == owner else others) for w in ids]

    # same prefix -> same worker, even when it is somewhat busier
    assert policy.rank(loads(1500, 800), hashes)[0] == owner
    # gap > 1000 tokens but not 2x: still affine
    assert policy.rank(loads(2500, 1400), hashes)[0] == owner
    # gap > 1000 and more than 2x: the least-queued worker takes it
    ranked = policy.rank(loads(5000, 100), hashes)
    assert ranked[0] != owner and owner in ranked and len(ranked) == 3
    # no full block: least-queued first
    assert policy.rank([PrefillLoad("p0", 9), PrefillLoad("p1", 3), PrefillLoad("p2", 5)], []) == [
        "p1",
        "p2",
        "p0",
    ]
    assert policy.rank([], hashes) == []


def test_policy_validates_its_knobs() -> None:
    with pytest.raises(ValueError, match="affinity_blocks"):
        PrefillPolicy(affinity_blocks=0)
    with pytest.raises(ValueError, match="balance_rel"):
        PrefillPolicy(balance_rel=0.5)


def test_conditional_disaggregation_needs_a_short_prompt_a_backlog_and_local_room() -> None:
    backlog = [PrefillLoad("p0", queued_tokens=3000), PrefillLoad("p1", queued_tokens=1500)]
    room = [
        DecodeLoad("d0", free_blocks=10, running=4, local_prefill_tokens=300),
        DecodeLoad("d1", free_blocks=10, running=6),
    ]
    assert prefill_locally(256, backlog, room, 512, 1024)
    assert not prefill_locally(513, backlog, room, 512, 1024)  # longer than the local limit
    assert not prefill_locally(256, backlog, room, 0, 1024)  # 0 turns it off
    assert not prefill_locally(256, backlog, room, 512, 2000)  # p1 is not backlogged enough
    assert not prefill_locally(256, [], room, 512, 0)  # no prefill worker: not this rule's call
    # the gate: a decode worker's local prefills in flight, this one included, fit the limit
    # or, when it is longer, the backlog the prompt would wait behind remotely (here p1's 1500)
    busy = [DecodeLoad("d0", free_blocks=10, running=4, local_prefill_tokens=300)]
    assert prefill_locally(212, backlog, busy, 512, 1024)
    assert prefill_locally(213, backlog, busy, 512, 1024)
    assert prefill_locally(400, backlog, busy, 512, 1024)  # 700 in flight, behind 1500 remotely
    short = [PrefillLoad("p0", queued_tokens=600)]
    assert prefill_locally(212, short, busy, 512, 256)
    assert prefill_locally(300, short, busy, 512, 256)  # 600 local against 600 remote
    assert not prefill_locally(301, short, busy, 512, 256)
    fuller = [DecodeLoad("d0", free_blocks=10, running=4, local_prefill_tokens=1400)]
    assert prefill_locally(100, backlog, fuller, 512, 1024)
    assert not prefill_locally(101, backlog, fuller, 512, 1024)  # local queue would be longer
    # a local request goes to the decode worker with the fewest local tokens in flight, if it
    # has room; without local prefill the local tokens do not count
    assert rank_decode(room, 4, local=True) == ["d1", "d0"]
    assert rank_decode(room, 4) == ["d0", "d1"]
    assert rank_decode(room, 11, local=True) == ["d0", "d1"]  # neither has room: by free blocks


def test_a_short_prompt_counts_only_the_short_prompts_queued_before_going_local() -> None:
    # p0 holds 3000 queued tokens, 200 of them in short prompts (<= 256 tokens); its scheduler
    # serves those ahead of the long prompts' chunks, so a 64-token prompt waits behind 200
    p0 = PrefillLoad("p0", queued_tokens=3000, queued_short_tokens=200, long_threshold=256)
    room = [DecodeLoad("d0", free_blocks=10, running=4)]
    assert p0.backlog(64) == 200 and p0.backlog(256) == 200
    assert p0.backlog(257) == 3000  # a long prompt waits in the long share behind everything
    assert not prefill_locally(64, [p0], room, 512, 512)  # stays on the prefill worker
    assert prefill_locally(300, [p0], room, 512, 512)  # long there: the whole queue is ahead
    # a worker that reports no classes (chunked prefill off) is first come, first served
    fcfs = PrefillLoad("p1", queued_tokens=3000, queued_short_tokens=0, long_threshold=0)
    assert fcfs.backlog(64) == 3000
    assert prefill_locally(64, [fcfs], room, 512, 512)
    # every prefill worker must be backlogged for this prompt's class
    assert not prefill_locally(64, [fcfs, p0], room, 512, 512)
    busy_short = PrefillLoad("p2", queued_tokens=3000, queued_short_tokens=600, long_threshold=256)
    assert prefill_locally(64, [fcfs, busy_short], room, 512, 512)
