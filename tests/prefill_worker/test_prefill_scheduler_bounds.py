"""The prefill scheduler's stated bounds over random traffic (prefill_worker/scheduler.py).

A simulation adds random prompts between steps and runs every step as if computed, checking:

* no step computes more than ``B`` tokens, nor more than ``L = S + S // 4`` tokens of long
  prompts (``S = min(T, B)``, the share; a long prompt's final chunk may run a quarter over it);
* a short prompt with ``r`` tokens to compute, arriving after step ``k - 1`` while short prompts
  with ``A`` tokens to compute are ahead of it, has its last chunk in step
  ``k - 1 + 2 * ceil((A + r) / B)`` at the latest, and ``k - 1 + ceil((A + r) / (B - L))`` when
  ``L < B``, however many long prompts are queued;
* long chunks alternate with short-only steps: a step after one with long tokens carries none
  while a short prompt is live;
* no starvation: the earliest-arrived long prompt gains ``min(S, remaining)`` tokens (its whole
  remainder when that is at most ``L`` and fits the budget the walk leaves it) in every step
  where no short prompt that arrived before it is still live and either the step before carried
  no long tokens or no short prompt is live (``T <= B / 2``; with a larger share it gains tokens in
  at least one of any two such steps), and every prompt finishes.

KV room and ``max_num_seqs`` are ample here (the bounds assume both), and prompts share no prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pdserve.config import SchedulerConfig
from pdserve.kv_cache.manager import KVCacheManager
from pdserve.sampling_params import SamplingParams
from pdserve.types import SampledToken
from prefill_worker.request import PrefillRequest
from prefill_worker.scheduler import PrefillScheduler, PrefillSeq

pytestmark = pytest.mark.timeout(120)


@dataclass
class _Tracked:
    seq: PrefillSeq
    order: int  # arrival order
    is_long: bool  # > T tokens to compute (no prefix hits here, so fixed from the start)
    deadline: int | None  # short prompts: the last step its last chunk may run in


def _simulate(budget: int, threshold: int, arrivals: list[list[int]]) -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=1024,
        max_model_len=4096,
        long_prefill_token_threshold=threshold,
    )
    total = sum(map(sum, arrivals))
    s = PrefillScheduler(cfg, KVCacheManager(total // 16 + 64, 16, enable_prefix_caching=False))
    assert s.long_threshold == threshold
    share = min(threshold, budget)  # S: the long prompts' share of a step
    long_max = share + share // 4  # L: a final chunk may run a quarter over the share
    live: list[_Tracked] = []
    prev_had_long = False
    missed_key, misses = "", 0  # eligible steps in a row without progress for the earliest long
    step = 0
    base = 0
    while step < len(arrivals) or live:
        for n in arrivals[step] if step < len(arrivals) else []:
            req = PrefillRequest(f"r{base}", tuple(range(base, base + n)), SamplingParams())
            base += n
            seq = PrefillSeq(req)
            ahead = sum(t.seq.num_remaining_prompt_tokens for t in live if not t.is_long)
            is_long = n > threshold
            steps = 2 * -(-(ahead + n) // budget)
            if long_max < budget:
                steps = min(steps, -(-(ahead + n) // (budget - long_max)))
            live.append(_Tracked(seq, base, is_long, None if is_long else step - 1 + steps))
            s.add(seq)
        earliest_long = next((t for t in live if t.is_long), None)
        shorts_live = any(not t.is_long for t in live)
        short_only = prev_had_long and shorts_live
        eligible = (
            earliest_long is not None
            and not short_only
            and not any(not t.is_long and t.order < earliest_long.order for t in live)
        )
        # with a share above half the step, shorts admitted while it waited may take some first
        starved_check = eligible and 2 * threshold <= budget
        rest = earliest_long.seq.num_remaining_prompt_tokens if earliest_long is not None else 0
        running = [q.request_id for q in s._running]  # the walk's order, before this step

        out = s.schedule()
        chunks = {
            seq.request_id: len(x.token_ids) for seq, x in zip(out.seqs, out.scheduled, strict=True)
        }
        if earliest_long is not None:
            # what the walk leaves it: requests admitted before it (shorts admitted while it
            # waited included) go first
            key = earliest_long.seq.request_id
            ahead = running[: running.index(key)] if key in running else running
            left = budget - sum(chunks.get(r, 0) for r in ahead)
            want_long = rest if rest <= min(left, long_max) else min(share, rest, left)
        assert out.num_scheduled_tokens <= budget
        longs = {t.seq.request_id for t in live if t.is_long}
        long_tokens = sum(n for rid, n in chunks.items() if rid in longs)
        assert long_tokens <= long_max, (step, chunks)
        if short_only:
            assert long_tokens == 0, (step, chunks)
        prev_had_long = long_tokens > 0
        if starved_check:
            assert earliest_long is not None
            assert chunks.get(earliest_long.seq.request_id) == want_long, (step, chunks)
        if eligible:  # any share: no two eligible steps in a row without progress
            assert earliest_long is not None
            key = earliest_long.seq.request_id
            if key != missed_key:
                missed_key, misses = key, 0
            misses = 0 if chunks.get(key) else misses + 1
            assert misses < 2, (step, chunks)

        sampled = [SampledToken(1) if x.sample else None for x in out.scheduled]
        for done, _ in s.update_from_output(out, sampled):
            s.finish(done.request_id)
            t = next(t for t in live if t.seq is done)
            if t.deadline is not None:
                assert step <= t.deadline, f"short prompt {done.request_id} late: {step}"
            live.remove(t)
        s.check_integrity()
        step += 1
        assert step < 10_000, "the scheduler stopped making progress"


# (B, T): shares of 1/8 to all of the step, the CPU default (320, 256: a final chunk may fill
# the step) and a threshold above the step (the share is then the step)
SHAPES = [(64, 8), (64, 16), (64, 32), (64, 64), (256, 32), (256, 64), (256, 128), (256, 256)]
SHAPES += [(320, 256), (256, 512)]


@settings(max_examples=80, deadline=None)
@given(
    shape=st.sampled_from(SHAPES),
    arrivals=st.lists(
        st.lists(st.integers(min_value=1, max_value=700), max_size=4), min_size=1, max_size=12
    ),
)
# shorts admitted while the long prompt waited run ahead of it and leave it less than its
# final 150 tokens: it gets the share (128), not the whole rest
@example(shape=(256, 128), arrivals=[[150], [150, 120, 118, 128]])
def test_step_caps_short_prompt_bound_and_long_prompt_progress(
    shape: tuple[int, int], arrivals: list[list[int]]
) -> None:
    _simulate(shape[0], shape[1], arrivals)


def test_a_flood_of_short_prompts_does_not_starve_a_long_one() -> None:
    # Every step brings more short work than the budget holds; the long prompt (first in line)
    # still gains T tokens every other step, and every step once the short prompts stop.
    arrivals = [[1000, *[30] * 10]] + [[30] * 10 for _ in range(40)]
    _simulate(256, 32, arrivals)
