"""The request state machine against fake gRPC workers: flow, migration, retries, aborts."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fake_workers import EOS, start_fake_cluster
from lifecycle_kit import PROMPT, collect, collect_acting, expected, make, wait_until

from router.background import drain_background, spawn
from router.errors import BadRequest, NoWorkers, RequestTimeout, WorkerFailure
from router.lifecycle import RequestLifecycle
from router.request_state import RequestState

pytestmark = pytest.mark.timeout(60)


async def test_disaggregated_flow_reserves_then_prefills_then_decodes() -> None:
    c = await start_fake_cluster()
    try:
        lc = make(c, max_tokens=8)
        assert await collect(lc) == expected(PROMPT, 8)
        assert lc.state is RequestState.FINISHED and lc.finish_reason == "length"
        (dreq,) = c.decodes[0].requests
        (preq,) = c.prefills[0].requests
        assert not dreq.prefill_locally and dreq.num_output_tokens == 0
        assert list(preq.prompt_token_ids) == PROMPT
        assert preq.target.decode_worker_id == "decode-0" and preq.target.transfer_id == 1
        assert preq.target.kv_endpoint == c.decodes[0].kv_endpoint
        assert lc.cached_tokens == 16 and lc.transfers[0].outcome == "ok"
        assert set(lc.state_times) >= {RequestState.PREFILLING, RequestState.DECODING}
        await wait_until(lambda: not c.decodes[0].held)  # the worker frees it after Finished
    finally:
        await c.close()


async def test_unified_mode_matches_disaggregated() -> None:
    c = await start_fake_cluster()
    try:
        lc = make(c, max_tokens=8, unified=True)
        assert await collect(lc) == expected(PROMPT, 8)
        assert c.decodes[0].requests[0].prefill_locally
        assert not c.prefills[0].requests
        assert lc.cached_tokens == 16  # the decode worker's prefix-cache hit, from Accepted
    finally:
        await c.close()


async def test_no_prefill_worker_falls_back_to_local_prefill() -> None:
    c = await start_fake_cluster(prefills=())
    try:
        assert await collect(make(c, max_tokens=5)) == expected(PROMPT, 5)
        assert c.decodes[0].requests[0].prefill_locally
    finally:
        await c.close()


async def test_conditional_disaggregation_prefills_short_prompts_locally_behind_a_backlog() -> None:
    c = await start_fake_cluster()
    try:
        cfg = {"max_local_prefill_length": 64, "min_prefill_queue_tokens": 1000}
        lc = make(c, max_tokens=6, **cfg)  # no backlog: the prefill worker takes it
        assert await collect(lc) == expected(PROMPT, 6)
        assert len(c.prefills[0].requests) == 1 and lc.num_local_prefills == 0
        prefill, decode = c.pool.get("prefill-0"), c.pool.get("decode-0")
        assert prefill is not None and decode is not None
        c.prefills[0].queue["num_queued_tokens"] = 1000  # another router's prompts queued there
        await wait_until(lambda: prefill.stats and prefill.stats.num_queued_tokens == 1000)
        lc = make(c, max_tokens=6, request_id="req-2", **cfg)
        assert await collect(lc) == expected(PROMPT, 6)  # the same tokens, prefilled on D
        assert c.decodes[0].requests[-1].prefill_locally and lc.num_local_prefills == 1
        assert len(c.prefills[0].requests) == 1 and decode.local_prefill_tokens == 0
        long_prompt = list(range(100, 165))  # 65 tokens: over the local limit
        lc = make(c, max_tokens=3, request_id="req-3", prompt=long_prompt, **cfg)
        assert await collect(lc) == expected(long_prompt, 3)
        assert len(c.prefills[0].requests) == 2 and lc.num_local_prefills == 0
        # local prefills in flight there: the prompt goes local only while they all fit the
        # larger of the 64-token limit and the 1000 tokens it would wait behind on P
        decode.local_prefill_tokens += 1000 - len(PROMPT)
        lc = make(c, max_tokens=3, request_id="req-4", **cfg)
        assert await collect(lc) == expected(PROMPT, 3)
        assert len(c.prefills[0].requests) == 2 and lc.num_local_prefills == 1
        decode.local_prefill_tokens += 1  # one token more: it no longer fits, P takes it
        lc = make(c, max_tokens=3, request_id="req-5", **cfg)
        assert await collect(lc) == expected(PROMPT, 3)
        assert len(c.prefills[0].requests) == 3 and lc.num_local_prefills == 0
        assert decode.local_prefill_tokens == 1000 - len(PROMPT) + 1  # finished gave theirs back
    finally:
        await c.close()


async def test_conditional_disaggregation_counts_the_backlog_of_the_prompts_class() -> None:
    """A prompt short enough for the prefill worker's short class waits only behind the short
    prompts queued there (long prompts' chunks take a bounded share of each step), so a long
    backlog alone does not send it to the decode worker; a prompt over the class bound does."""
    queue = {
        "num_queued_tokens": 3000,
        "num_queued_short_tokens": 0,
        "long_prefill_token_threshold": len(PROMPT),
    }
    c = await start_fake_cluster(prefills=[{"queue": queue}])
    try:
        cfg = {"max_local_prefill_length": 64, "min_prefill_queue_tokens": 1000}
        prefill = c.pool.get("prefill-0")
        assert prefill is not None
        await wait_until(lambda: prefill.stats and prefill.stats.num_queued_tokens == 3000)
        lc = make(c, max_tokens=3, **cfg)  # 40 tokens, short there: behind 0 short tokens
        assert await collect(lc) == expected(PROMPT, 3)
        assert len(c.prefills[0].requests) == 1 and lc.num_local_prefills == 0
        longer = list(range(100, 141))  # 41 tokens: long there, behind the whole queue
        lc = make(c, max_tokens=3, request_id="req-2", prompt=longer, **cfg)
        assert await collect(lc) == expected(longer, 3)
        assert len(c.prefills[0].requests) == 1 and lc.num_local_prefills == 1
        # short prompts queued there
        c.prefills[0].queue["num_queued_short_tokens"] = 1000 - 1
        await wait_until(lambda: prefill.stats.num_queued_short_tokens == 1000 - 1)
        lc = make(c, max_tokens=3, request_id="req-3", **cfg)  # 999 short tokens ahead
        assert await collect(lc) == expected(PROMPT, 3)
        assert len(c.prefills[0].requests) == 2 and lc.num_local_prefills == 0
        c.prefills[0].queue["num_queued_short_tokens"] = 1000  # 1000 short tokens ahead now
        await wait_until(lambda: prefill.stats.num_queued_short_tokens == 1000)
        lc = make(c, max_tokens=3, request_id="req-4", **cfg)
        assert await collect(lc) == expected(PROMPT, 3)
        assert len(c.prefills[0].requests) == 2 and lc.num_local_prefills == 1
    finally:
        await c.close()


async def test_preemption_reprefills_prompt_plus_output_and_continues() -> None:
    c = await start_fake_cluster(decodes=[{"preempt_budget": 1, "preempt_at": 3}])
    try:
        lc = make(c, max_tokens=8)
        assert await collect(lc) == expected(PROMPT, 8)
        assert lc.num_preemptions == 1 and lc.state is RequestState.FINISHED
        first, second = c.decodes[0].requests
        assert second.request_id == "req-1~1" and second.num_output_tokens == 3
        assert list(second.prompt_token_ids) == PROMPT + expected(PROMPT, 3)
        assert c.prefills[0].requests[1].num_output_tokens == 3
        # the re-prefill keeps the sequence's first arrival: its place in the prefill queue
        first_p, second_p = c.prefills[0].requests
        assert second_p.age_ms >= first_p.age_ms >= 0  # its age since arrival, not since now
        assert second.age_ms >= first.age_ms >= 0  # and in the decode worker's queues
        assert RequestState.MIGRATING in lc.state_times
    finally:
        await c.close()


async def test_broken_decode_stream_migrates_to_another_worker() -> None:
    c = await start_fake_cluster(decodes=[{"break_budget": 1, "break_at": 4}, {}])
    try:
        # both idle: the tie goes to decode-0, which breaks after 4 tokens
        lc = make(c, max_tokens=10)
        assert await collect(lc) == expected(PROMPT, 10)
        assert lc.num_migrations == 1
        assert [r.num_output_tokens for r in c.decodes[1].requests] == [4]
    finally:
        await c.close()


async def test_killed_decode_worker_migrates_and_is_marked_unhealthy() -> None:
    c = await start_fake_cluster(decodes=[{"step_s": 0.05}, {"step_s": 0.001}])
    try:
        lc = make(c, max_tokens=12)

        async def kill(_: RequestLifecycle) -> None:
            await c.kill("decode-0")

        assert await collect_acting(lc, 3, kill) == expected(PROMPT, 12)
        assert lc.num_migrations >= 1
        await wait_until(lambda: not c.pool.get("decode-0").healthy)  # type: ignore[union-attr]
    finally:
        await c.close()


async def test_decode_worker_lost_during_prefill_aborts_the_prefill_and_re_places() -> None:
    # the first Prefill never ends on its own: only the router noticing D's death ends it
    c = await start_fake_cluster(prefills=[{"stall_budget": 1}], decodes=[{}, {}])
    try:
        lc = make(c, max_tokens=6)
        task = asyncio.ensure_future(collect(lc))
        await wait_until(lambda: bool(c.prefills[0].running))
        (victim,) = [d for d in c.decodes if d.held]
        await c.kill(victim.worker_id)
        assert await asyncio.wait_for(task, 10) == expected(PROMPT, 6)
        assert lc.num_migrations == 1 and lc.num_prefill_failures == 0
        assert c.prefills[0].cancelled == ["req-1"]  # the stalled call was cancelled
        assert [r.request_id for r in c.prefills[0].requests] == ["req-1", "req-1~1"]
        (survivor,) = [d for d in c.decodes if d is not victim]
        assert [r.request_id for r in survivor.requests] == ["req-1~1"]
        await drain_background()
        assert "req-1" in c.prefills[0].aborted
        await wait_until(lambda: not c.prefills[0].running and not survivor.held)
    finally:
        await c.close()


async def test_decode_tokens_before_the_prefill_answer_are_kept_in_order() -> None:
    # the prefill worker answers 0.3 s after D got the KV: D streams tokens 2.. meanwhile
    c = await start_fake_cluster(prefills=[{"reply_delay_s": 0.3}], decodes=[{"step_s": 0.01}])
    try:
        lc = make(c, max_tokens=8)
        assert await collect(lc) == expected(PROMPT, 8)
        assert lc.num_migrations == 0 and lc.state is RequestState.FINISHED
    finally:
        await c.close()


async def test_failed_prefill_is_retried_and_releases_the_reservation() -> None:
    c = await start_fake_cluster(prefills=[{"fail_budget": 1}, {}])
    try:
        # shorter than a block: no affinity, the tie goes to prefill-0, which fails once
        lc = make(c, max_tokens=4, prompt=[5, 6, 7])
        assert await collect(lc) == expected([5, 6, 7], 4)
        assert lc.num_prefill_failures == 1
        assert len(c.prefills[0].requests) == 1 and len(c.prefills[1].requests) == 1
        await drain_background()
        assert "req-1" in c.decodes[0].aborted  # the first reservation was given back
        assert len(c.decodes[0].requests) == 2
    finally:
        await c.close()


async def test_a_kv_handoff_failure_re_places_away_from_the_decode_worker() -> None:
    """ABORTED from a prefill worker: the prompt was computed but its KV did not reach the
    decode worker. The sequence goes to another decode worker, and the prefill worker, which
    did its part, is neither counted as failing nor passed over (no local-prefill fallback)."""
    aborted = {"fail_budget": 1, "fail_code": grpc.StatusCode.ABORTED}
    c = await start_fake_cluster(prefills=[aborted], decodes=[{}, {}])
    try:
        lc = make(c, max_tokens=4)
        assert await collect(lc) == expected(PROMPT, 4)
        assert lc.num_prefill_failures == 1 and lc.num_local_prefills == 0
        assert len(c.prefills[0].requests) == 2  # the same prefill worker, again
        prefill = c.pool.get("prefill-0")
        assert prefill is not None and prefill.healthy and prefill.failures == 0
        assert [len(d.requests) for d in c.decodes] == [1, 1]  # decode-0, then decode-1
        # the failed handoff counts with the KV transfers (/v1/cluster/status, metrics)
        assert [t.outcome for t in lc.transfers] == ["failed", "ok"]
    finally:
        await c.close()


async def test_a_kv_handoff_failure_keeps_the_prefill_worker_that_cached_the_prompt() -> None:
    """With two prefill workers, the retry after ABORTED goes back to the one that computed the
    prompt (its prefix cache holds it); a second ABORTED from it counts it as down, and the
    sequence moves on."""
    aborted = {"fail_budget": 2, "fail_code": grpc.StatusCode.ABORTED}
    c = await start_fake_cluster(prefills=[aborted, {}], decodes=[{}, {}])
    try:
        lc = make(c, max_tokens=4, prompt=[5, 6, 7])  # shorter than a block: the tie -> prefill-0
        assert await collect(lc) == expected([5, 6, 7], 4)
        assert lc.num_prefill_failures == 2
        assert [len(p.requests) for p in c.prefills] == [2, 1]  # again on prefill-0, then moved
        first = c.pool.get("prefill-0")
        assert first is not None and first.failures == 1  # the second ABORTED counted
    finally:
        await c.close()


async def test_repeated_kv_handoff_failures_fall_back_to_local_prefill() -> None:
    """One prefill worker whose KV never reaches any decode worker (its transport is broken):
    the second ABORTED marks it down for the sequence, which is then prefilled locally."""
    broken = {"fail_budget": 100, "fail_code": grpc.StatusCode.ABORTED}
    c = await start_fake_cluster(prefills=[broken])
    try:
        lc = make(c, max_tokens=4)
        assert await collect(lc) == expected(PROMPT, 4)
        assert lc.num_prefill_failures == 2 and lc.num_local_prefills == 1
    finally:
        await c.close()


async def test_prefill_failing_every_time_gives_up_and_frees_everything() -> None:
    # RESOURCE_EXHAUSTED does not mark the worker down, so there is no local-prefill fallback
    busy = {"fail_budget": 100, "fail_code": grpc.StatusCode.RESOURCE_EXHAUSTED}
    c = await start_fake_cluster(prefills=[busy])
    try:
        lc = make(c, max_tokens=4, max_prefill_attempts=3)
        with pytest.raises(WorkerFailure, match="prefill failed 3 times"):
            await collect(lc)
        assert lc.state is RequestState.FAILED
        await drain_background()
        await wait_until(lambda: not c.decodes[0].held)
    finally:
        await c.close()


async def test_prefill_invalid_argument_is_a_bad_request_without_retry() -> None:
    c = await start_fake_cluster(
        prefills=[{"fail_budget": 5, "fail_code": grpc.StatusCode.INVALID_ARGUMENT}]
    )
    try:
        with pytest.raises(BadRequest, match="rejected by prefill worker"):
            await collect(make(c))
        assert len(c.prefills[0].requests) == 1
    finally:
        await c.close()


async def test_full_decode_workers_are_retried_until_one_accepts() -> None:
    c = await start_fake_cluster(decodes=[{"reject_budget": 3}])
    try:
        assert await collect(make(c, max_tokens=3)) == expected(PROMPT, 3)
        assert len(c.decodes[0].requests) == 4
    finally:
        await c.close()


async def test_closing_the_stream_aborts_on_every_worker_holding_state() -> None:
    c = await start_fake_cluster(decodes=[{"step_s": 0.02}])
    try:
        lc = make(c, max_tokens=100)
        gen = lc.run()
        for _ in range(3):
            await gen.__anext__()
        await gen.aclose()
        assert lc.state is RequestState.ABORTED
        await wait_until(lambda: not c.decodes[0].held)
        await drain_background()
        assert "req-1" in c.decodes[0].aborted
    finally:
        await c.close()


async def test_cancelled_consumer_task_aborts() -> None:
    c = await start_fake_cluster(decodes=[{"step_s": 0.02}])
    try:
        lc = make(c, max_tokens=100)
        task = asyncio.ensure_future(collect(lc))
        await wait_until(lambda: len(lc.output) >= 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert lc.state is RequestState.ABORTED
        await wait_until(lambda: not c.decodes[0].held)
    finally:
        await c.close()


async def test_deadline_aborts_with_timeout() -> None:
    c = await start_fake_cluster(decodes=[{"step_s": 0.1}])
    try:
        lc = make(c, max_tokens=100, timeout_s=0.5)
        with pytest.raises(RequestTimeout):
            await collect(lc)
        assert lc.state is RequestState.ABORTED
        await wait_until(lambda: not c.decodes[0].held)
    finally:
        await c.close()


async def test_eos_finishes_with_stop() -> None:
    script = [7, 8, 9, EOS]
    c = await start_fake_cluster(prefills=[{"script": script}], decodes=[{"script": script}])
    try:
        lc = make(c, max_tokens=50)
        assert await collect(lc) == script
        assert lc.finish_reason == "stop"
    finally:
        await c.close()


async def test_failed_kv_transfer_keeps_token_one_and_reprefills() -> None:
    c = await start_fake_cluster(prefills=[{"transfer_outcome": "failed"}, {}])
    try:
        # prompt shorter than a block: no affinity, least-queued (tie -> prefill-0) goes first
        lc = make(c, max_tokens=6, prompt=[5, 6, 7])
        out = await collect(lc)
        assert out == expected([5, 6, 7], 6)
        assert lc.num_migrations >= 1
    finally:
        await c.close()


async def test_kv_exhaustion_preempts_and_moves_to_a_worker_with_room() -> None:
    # decode-0 has room for the prompt (3 blocks) but not for growth past 48 tokens; decode-1
    # (roomier, so ranked first) refuses once, so the sequence starts on decode-0
    c = await start_fake_cluster(decodes=[{"num_blocks": 3}, {"num_blocks": 8, "reject_budget": 1}])
    try:
        lc = make(c, max_tokens=12)
        assert await collect(lc) == expected(PROMPT, 12)
        assert lc.num_preemptions == 1
        assert [r.num_output_tokens for r in c.decodes[0].requests] == [0]
        assert [r.num_output_tokens for r in c.decodes[1].requests] == [0, 8]
    finally:
        await c.close()


async def test_sequence_larger_than_any_decode_pool_fails_fast() -> None:
    c = await start_fake_cluster(decodes=[{"num_blocks": 2}])
    try:
        with pytest.raises(NoWorkers, match="largest decode worker holds 2 blocks"):
            await collect(make(c))
    finally:
        await c.close()


async def test_max_tokens_one_disaggregated() -> None:
    c = await start_fake_cluster()
    try:
        lc = make(c, max_tokens=1)
        assert await collect(lc) == expected(PROMPT, 1)
        assert lc.finish_reason == "length"
    finally:
        await c.close()


async def test_concurrent_sequences_spread_over_decode_workers() -> None:
    c = await start_fake_cluster(decodes=[{"step_s": 0.01}, {"step_s": 0.01}])
    try:
        lcs = [make(c, max_tokens=6, request_id=f"r{i}") for i in range(8)]
        outs = await asyncio.gather(*(collect(lc) for lc in lcs))
        assert all(o == expected(PROMPT, 6) for o in outs)
        assert len(c.decodes[0].requests) >= 2 and len(c.decodes[1].requests) >= 2
    finally:
        await c.close()


async def test_abort_on_a_removed_worker_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    """QA R3: Abort through a closed channel (worker removed) returns False, raises nothing."""
    c = await start_fake_cluster()
    try:
        state = c.pool.get("decode-0")
        assert state is not None
        await state.client.close()
        assert await state.client.abort("gone", 0.5) is False
        spawn(state.client.abort("gone-too", 0.5))
        await drain_background()
        assert "never retrieved" not in caplog.text
    finally:
        await c.close()
