"""PrefillScheduler: chunk packing, the long-prompt share, prefix hits, FCFS memory, removal.

The policy's bounds over random traffic are checked in test_prefill_scheduler_bounds.py.
"""

from __future__ import annotations

import time

import pytest

from pdserve.config import (
    CPU_PREFILL_STEP_TOKENS,
    ConfigError,
    SchedulerConfig,
    prefill_step_budget,
)
from pdserve.engine.long_prompts import default_long_threshold
from pdserve.kv_cache.manager import KVCacheManager
from pdserve.sampling_params import SamplingParams
from pdserve.types import SampledToken
from prefill_worker.request import PrefillRequest, PrefillState
from prefill_worker.scheduler import PrefillOutput, PrefillScheduler, PrefillSeq

BS = 16


def _sched(
    num_blocks: int = 256, batched: int = 256, threshold: int = 128, max_seqs: int = 64, **kw: bool
) -> PrefillScheduler:
    cfg = SchedulerConfig(
        max_num_batched_tokens=batched,
        max_num_seqs=max_seqs,
        max_model_len=4096 if kw.get("enable_chunked_prefill", True) else batched,
        long_prefill_token_threshold=threshold,
        **kw,
    )
    return PrefillScheduler(cfg, KVCacheManager(num_blocks, BS))


def _add(s: PrefillScheduler, rid: str, n: int, base: int = 0, k: int = 0) -> PrefillSeq:
    req = PrefillRequest(
        rid, tuple(base + i for i in range(n)), SamplingParams(temperature=0), num_output_tokens=k
    )
    seq = PrefillSeq(req)
    s.add(seq)
    return seq


def _ran(s: PrefillScheduler, out: PrefillOutput) -> list[PrefillSeq]:
    """Apply ``out`` as if run (token 7 sampled where asked); returns the completed prompts."""
    sampled = [SampledToken(7) if x.sample else None for x in out.scheduled]
    return [seq for seq, _ in s.update_from_output(out, sampled)]


def _step(s: PrefillScheduler) -> dict[str, int]:
    out = s.schedule()
    for done in _ran(s, out):
        s.finish(done.request_id)
    s.check_integrity()
    return {x.request_id: len(x.token_ids) for x in out.scheduled}


def test_default_long_share_is_an_eighth_of_the_budget() -> None:
    assert _sched(batched=2048, threshold=0).long_threshold == 256
    assert _sched(batched=4, threshold=0).long_threshold == 1
    wide = _sched(batched=256, threshold=1000)  # an explicit threshold above the step
    assert (wide.long_threshold, wide.long_share) == (1000, 256)  # the share never exceeds it


def test_prefill_step_budget_is_capped_on_cpu_unless_set() -> None:
    default = SchedulerConfig()  # max_num_batched_tokens 2048
    assert prefill_step_budget(default, "cpu") == CPU_PREFILL_STEP_TOKENS == 320
    assert prefill_step_budget(default, "cuda") == 2048
    small = SchedulerConfig(max_num_batched_tokens=128)
    assert prefill_step_budget(small, "cpu") == 128  # never above max_num_batched_tokens
    explicit = SchedulerConfig(prefill_max_num_batched_tokens=1024)
    assert prefill_step_budget(explicit, "cpu") == prefill_step_budget(explicit, "cuda") == 1024
    # without chunked prefill a whole prompt must fit one step
    whole = SchedulerConfig(
        enable_chunked_prefill=False, max_num_batched_tokens=4096, max_model_len=4096
    )
    assert prefill_step_budget(whole, "cpu") == 4096
    with pytest.raises(ConfigError, match="prefill-max-num-batched-tokens"):
        SchedulerConfig(prefill_max_num_batched_tokens=-1)
    with pytest.raises(ConfigError, match="prefill-max-num-batched-tokens must be >= --max-model"):
        SchedulerConfig(
            enable_chunked_prefill=False,
            max_num_batched_tokens=4096,
            max_model_len=4096,
            prefill_max_num_batched_tokens=256,
        )


def test_long_share_is_capped_at_the_prefill_step_but_the_class_threshold_is_not() -> None:
    assert default_long_threshold(2048) == 256
    assert default_long_threshold(8) == 1
    s = PrefillScheduler(
        SchedulerConfig(max_num_batched_tokens=2048), KVCacheManager(256, BS), step_budget=256
    )
    assert (s.step_budget, s.long_threshold, s.long_share) == (256, 256, 256)
    _add(s, "long", 1000)
    _add(s, "short1", 100, base=5000)
    _add(s, "short2", 200, base=6000)
    # a step never exceeds its budget; with S = B a long chunk fills its step, and the next
    # step is the short prompts' (short2 continues in the one after the next long chunk)
    assert _step(s) == {"long": 256}
    assert _step(s) == {"short1": 100, "short2": 156}
    assert _step(s) == {"long": 256}
    assert _step(s) == {"short2": 44}
    assert _step(s) == {"long": 256}
    # a tiny step budget keeps the class threshold: 30-token prompts stay short and go first
    tiny = PrefillScheduler(
        SchedulerConfig(max_num_batched_tokens=2048), KVCacheManager(256, BS), step_budget=16
    )
    assert (tiny.long_threshold, tiny.long_share) == (256, 16)
    _add(tiny, "long", 1600)
    _add(tiny, "short", 30, base=5000)
    assert _step(tiny) == {"long": 16}
    assert _step(tiny) == {"short": 16}
    assert _step(tiny) == {"long": 16}
    assert _step(tiny) == {"short": 14}
    with pytest.raises(ValueError, match="step_budget"):
        PrefillScheduler(SchedulerConfig(), KVCacheManager(4, BS), step_budget=0)


def test_long_prompt_runs_t_tokens_per_step_even_alone() -> None:
    s = _sched()
    _add(s, "long", 600)
    # No top-up from the unused budget: a step never computes more than T long-prompt tokens.
    assert [_step(s) for _ in range(5)] == [{"long": 128}] * 4 + [{"long": 88}]
    assert not s.has_unscheduled_work() and s.num_running == 0


def test_short_prompts_get_the_rest_of_the_step_while_long_ones_share_t() -> None:
    s = _sched(threshold=100)
    _add(s, "long1", 1000)
    _add(s, "long2", 1000, base=5000)
    _add(s, "short1", 90, base=9000)
    _add(s, "short2", 50, base=9500)
    # long1 takes T=100, long2 is passed over (not admitted), both shorts run whole.
    assert _step(s) == {"long1": 100, "short1": 90, "short2": 50}
    assert s.get("long2").state is PrefillState.WAITING  # type: ignore[union-attr]
    _add(s, "short3", 30, base=12000)
    # the step after a long chunk is short-only while a short prompt can run, then long1 resumes
    assert _step(s) == {"short3": 30}
    assert _step(s) == {"long1": 100}
    assert _step(s) == {"long1": 100}  # no short prompt left: long chunks back to back


def test_queued_short_tokens_follow_the_classes() -> None:
    s = _sched(batched=512, threshold=100)
    _add(s, "long1", 150)
    _add(s, "short1", 90, base=9000)
    _add(s, "edge", 100, base=20000)  # at T: short
    assert (s.class_threshold, s.num_queued_tokens, s.num_queued_short_tokens) == (100, 340, 190)
    _add(s, "short2", 60, base=30000)
    assert _step(s) == {"long1": 100, "short1": 90, "edge": 100, "short2": 60}
    # long1's last 50 tokens stay in the long class (a prompt keeps its class to the end)
    assert (s.num_queued_tokens, s.num_queued_short_tokens) == (50, 0)
    _add(s, "short3", 40, base=40000)
    _add(s, "long2", 101, base=50000)  # waiting: classed by its prompt length
    assert (s.num_queued_tokens, s.num_queued_short_tokens) == (191, 40)
    # one class with chunked prefill off: nothing reported as short, threshold 0
    u = _sched(batched=128, enable_chunked_prefill=False)
    _add(u, "a", 100)
    assert (u.class_threshold, u.num_queued_tokens, u.num_queued_short_tokens) == (0, 100, 0)


def test_long_chunks_alternate_with_short_steps_under_a_stream_of_short_prompts() -> None:
    s = _sched(threshold=100)
    _add(s, "long", 400)
    steps = []
    for i in range(8):
        _add(s, f"short{i}", 20, base=1000 * (i + 1))
        steps.append(_step(s))
    # the long prompt gains T tokens every other step; every short prompt runs in the step after
    # it arrived, in a step without long tokens when the step before had some
    assert [st.get("long", 0) for st in steps] == [100, 0, 100, 0, 100, 0, 100, 0]
    assert all(st.get(f"short{i}") == 20 for i, st in enumerate(steps))


def test_a_long_prompts_final_chunk_may_run_a_quarter_over_the_share() -> None:
    # the default CPU step: share 256, budget 320; a 280-token prompt runs whole, not 256 + 24
    cfg = SchedulerConfig()  # max_num_batched_tokens 2048: threshold 256
    s = PrefillScheduler(cfg, KVCacheManager(256, BS), step_budget=prefill_step_budget(cfg, "cpu"))
    assert (s.step_budget, s.long_share) == (CPU_PREFILL_STEP_TOKENS, 256)
    _add(s, "p280", 280)
    assert _step(s) == {"p280": 280}
    # over 5/4 of the share: chunks of the share until the rest fits (1000 = 256 * 3 + 232)
    _add(s, "p1000", 1000, base=5000)
    assert [_step(s) for _ in range(4)] == [{"p1000": 256}] * 3 + [{"p1000": 232}]
    # two long prompts: a's final 200 leave 56 of the share, so b gets 56 (its 330 are over
    # 5/4 of what is left), then its final 274 in one step
    _add(s, "a", 456, base=10000)
    _add(s, "b", 330, base=20000)
    assert _step(s) == {"a": 256}
    assert _step(s) == {"a": 200, "b": 56}
    assert _step(s) == {"b": 274}
    assert not s.has_unscheduled_work()


def test_long_class_is_kept_to_the_last_chunk() -> None:
    s = _sched(threshold=100)
    _add(s, "long1", 140)
    _add(s, "long2", 1000, base=5000)
    assert _step(s) == {"long1": 100}
    # long1 has 40 left (below T) but is still long: its last chunk comes out of the long share,
    # and long2 gets the other 60 tokens of it.
    _add(s, "short", 90, base=9000)
    assert _step(s) == {"short": 90}  # a short-only step after a long chunk
    assert _step(s) == {"long1": 40, "long2": 60}
    assert _step(s) == {"long2": 100}


@pytest.mark.parametrize("num_longs", [1, 4])
def test_short_prompt_delay_is_bounded_by_long_prompts(num_longs: int) -> None:
    s = _sched(threshold=64)
    for i in range(num_longs):
        _add(s, f"long{i}", 2000, base=10000 * (i + 1))
    _step(s)
    _add(s, "short", 60, base=99)
    # Scheduled in the very next step, alone, whatever the number of long prompts ahead.
    assert _step(s) == {"short": 60}


def test_chunk_batch_entries_cover_positions_and_sample_on_last_chunk() -> None:
    s = _sched(batched=64, threshold=64)
    _add(s, "a", 100, k=3)
    out = s.schedule()
    (c,) = out.scheduled
    assert c.num_computed == 0 and len(c.token_ids) == 64 and not c.sample
    assert c.block_table == list(range(7))  # whole prompt reserved at admission
    assert out.num_prefill_tokens == 64 and out.num_decode_tokens == 0
    _ran(s, out)
    out = s.schedule()
    (c,) = out.scheduled
    assert c.num_computed == 64 and c.token_ids == list(range(64, 100))
    assert c.sample
    assert c.prompt_token_ids == list(range(97)) and c.output_token_ids == [97, 98, 99]
    ((done, token),) = s.update_from_output(out, [SampledToken(5)])
    assert token == SampledToken(5)
    assert done.state is PrefillState.SENDING and s.num_running == 1 and s.num_sending == 1
    s.check_integrity()
    s.finish("a")
    assert s.num_running == 0 and s.kv.block_pool.num_cached_blocks == 6  # 6 full blocks cached


def test_prefix_hit_skips_cached_blocks() -> None:
    s = _sched()
    _add(s, "a", 100)
    _step(s)
    seq = _add(s, "b", 80)  # shares the first 80 tokens: 5 full blocks cached, 4 usable
    out = s.schedule()
    assert seq.num_cached == 64
    assert out.scheduled[0].num_computed == 64 and len(out.scheduled[0].token_ids) == 16
    assert s.kv.prefix_cache_stats == (180, 64)


def test_memory_is_first_come_first_served() -> None:
    s = _sched(num_blocks=8)
    _add(s, "a", 64)  # 4 blocks
    _add(s, "big", 80, base=1000)  # 5 blocks: does not fit next to a
    _add(s, "small", 16, base=2000)  # would fit, but must not overtake big
    assert _step(s) == {"a": 64}
    assert s.num_waiting == 2
    # a finished and was freed (its blocks are evictable): big is admitted, then small.
    assert _step(s) == {"big": 80, "small": 16}


def test_max_num_seqs_caps_a_step() -> None:
    s = _sched(max_seqs=2)
    for i in range(3):
        _add(s, f"r{i}", 10, base=100 * i)
    assert _step(s) == {"r0": 10, "r1": 10}
    assert _step(s) == {"r2": 10}


def test_unchunked_prompt_runs_whole() -> None:
    s = _sched(batched=128, enable_chunked_prefill=False)
    _add(s, "a", 100)
    _add(s, "b", 100, base=500)
    assert _step(s) == {"a": 100}
    assert _step(s) == {"b": 100}


@pytest.mark.parametrize("stage", ["waiting", "running", "sending"])
def test_remove_frees_everything_in_any_state(stage: str) -> None:
    s = _sched(batched=32, threshold=32)
    _add(s, "x", 100)
    if stage != "waiting":
        _ran(s, s.schedule())
    if stage == "sending":
        while s.get("x").state is PrefillState.RUNNING:  # type: ignore[union-attr]
            _ran(s, s.schedule())
    seq = s.remove("x")
    assert seq is not None and seq.state is PrefillState.DONE
    assert s.remove("x") is None
    assert s.kv.num_free_blocks == s.kv.num_blocks and s.num_running == s.num_waiting == 0
    s.check_integrity()


def test_chunks_of_a_request_removed_during_the_forward_are_ignored() -> None:
    s = _sched()
    _add(s, "x", 40)
    out = s.schedule()
    s.remove("x")
    assert _ran(s, out) == []
    s.check_integrity()


def test_update_checks_the_sampled_tokens() -> None:
    s = _sched()
    _add(s, "x", 40)
    out = s.schedule()
    with pytest.raises(ValueError, match="0 results for 1 sequences"):
        s.update_from_output(out, [])
    with pytest.raises(ValueError, match="no token for a sampled one"):
        s.update_from_output(out, [None])
    assert s.get("x").num_computed == 0  # type: ignore[union-attr]  # nothing was applied


def test_duplicate_id_is_refused() -> None:
    s = _sched()
    _add(s, "x", 4)
    with pytest.raises(ValueError, match="already queued"):
        _add(s, "x", 4)


def test_waiting_queue_is_in_first_arrival_order() -> None:
    """A re-placed sequence (preempted, its decode worker lost) carries its first arrival and
    goes ahead of the requests that came after it; a request without one arrives now, and one
    stamped in the future counts as arriving now."""
    s = _sched(batched=64, max_seqs=1)
    _add(s, "a", 40)  # no arrival_time: now
    _add(s, "b", 40, base=1000)
    req = PrefillRequest(
        "old~1",
        tuple(range(2000, 2040)),
        SamplingParams(temperature=0),
        arrival_time=time.monotonic() - 30.0,
    )
    s.add(PrefillSeq(req))
    later = PrefillRequest(
        "c",
        tuple(range(3000, 3040)),
        SamplingParams(temperature=0),
        arrival_time=time.monotonic() + 5,
    )
    s.add(PrefillSeq(later))
    _add(s, "d", 40, base=4000)  # now: after c, whose future stamp was capped at its arrival
    order = [next(iter(_step(s))) for _ in range(5)]
    assert order == ["old~1", "a", "b", "c", "d"]
