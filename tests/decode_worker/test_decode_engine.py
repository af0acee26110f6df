"""DecodeEngine on a tiny random-weight Llama: continuous batching, preemption, abort, deadlines.

Outputs under batching must equal the same request run alone (greedy and seeded), and after every
scenario all blocks are free and the integrity checks hold.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from decode_kit import Collector, greedy, prompt, run_solo, tiny_engine

from decode_worker.request import (
    DecodeRequest,
    ErrorEvent,
    FinishedEvent,
    PreemptedEvent,
    TokensEvent,
)
from pdserve.engine.errors import (
    CANCELLED,
    DEADLINE_EXCEEDED,
    FAILED_PRECONDITION,
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    EngineError,
)
from pdserve.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)


def _requests(n: int, seed: int = 0, local: bool = True) -> list[DecodeRequest]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        sp = (
            greedy(rng.randint(1, 14))
            if i % 3
            else SamplingParams(
                temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=rng.randint(2, 14)
            )
        )
        reqs.append(
            DecodeRequest(f"r{i}", prompt(i, rng.randint(2, 30)), sp, prefill_locally=local)
        )
    return reqs


def test_staggered_batching_matches_solo_runs() -> None:
    eng = tiny_engine(max_num_seqs=8, chunk=8, max_num_batched_tokens=32)
    reqs = _requests(16)
    expected = {r.request_id: run_solo(eng, r) for r in reqs}
    rng = random.Random(1)
    arrival = sorted(rng.randint(0, 10) for _ in reqs)
    col = Collector()
    step = 0
    pending = list(zip(arrival, reqs, strict=True))
    max_running = 0
    while pending or eng.has_work():
        while pending and pending[0][0] <= step:
            _, r = pending.pop(0)
            eng.add_request(r, col.sink(r.request_id))
        eng.step()
        max_running = max(max_running, eng.stats().num_running)
        step += 1
    assert max_running == 8  # the batch was full at some point: real continuous batching
    for r in reqs:
        rid = r.request_id
        assert col.tokens(rid) == expected[rid], rid
        last = col.last(rid)
        assert isinstance(last, FinishedEvent) and last.num_output_tokens == len(expected[rid])
    s = eng.stats()
    assert s.kv_blocks_free == s.kv_blocks_total and s.num_running == 0 and s.num_finished == 32
    eng.check_integrity()


def test_preemption_then_reprefill_completes_every_request_exactly() -> None:
    reqs = [
        DecodeRequest(f"p{i}", prompt(i, 6 + i), greedy(24, ignore_eos=True), prefill_locally=True)
        for i in range(6)
    ]
    eng = tiny_engine(num_blocks=24)  # 6 requests x up to 10 blocks each: must preempt
    expected = {r.request_id: run_solo(eng, r) for r in reqs}
    col = Collector()
    outputs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    queue = list(reqs)
    attempts = 0
    while queue or eng.has_work():
        retry = []
        for r in queue:
            rid = r.request_id
            out = outputs[rid]
            resumed = DecodeRequest(
                rid,
                prompt(int(rid[1:]), 6 + int(rid[1:])) + tuple(out),
                r.sampling,
                num_output_tokens=len(out),
                prefill_locally=True,
            )
            col.events.pop(rid, None)
            try:
                eng.add_request(resumed, col.sink(rid))
                attempts += 1
            except EngineError as e:
                assert e.code == RESOURCE_EXHAUSTED
                retry.append(r)
        queue = retry
        eng.step()
        for r in reqs:
            rid = r.request_id
            last = col.last(rid)
            if isinstance(last, PreemptedEvent):
                # What the router does: keep what was streamed, re-prefill prompt + outputs.
                got = outputs[rid] + col.tokens(rid)
                assert list(last.output_token_ids) == got
                outputs[rid] = got
                col.events.pop(rid)
                queue.append(r)
    assert eng.stats().num_preemptions > 0 and attempts > len(reqs)
    for r in reqs:
        rid = r.request_id
        assert outputs[rid] + col.tokens(rid) == expected[rid], rid
        last = col.last(rid)
        assert isinstance(last, FinishedEvent) and last.num_output_tokens == 24
    assert eng.kv.num_free_blocks == 24
    eng.check_integrity()


def test_refusals() -> None:
    eng = tiny_engine(num_blocks=8)
    col = Collector()
    with pytest.raises(EngineError) as e:
        eng.add_request(
            DecodeRequest("a", prompt(0, 40), greedy(4), prefill_locally=True), col.sink("a")
        )
    assert e.value.code == RESOURCE_EXHAUSTED and "never fits" in e.value.message
    with pytest.raises(EngineError) as e:
        eng.add_request(DecodeRequest("a", prompt(0, 4), greedy(4)), col.sink("a"))
    assert e.value.code == UNAVAILABLE  # no KV receiver
    bad = SamplingParams(stop_token_ids=(500,))
    with pytest.raises(EngineError) as e:
        eng.add_request(DecodeRequest("a", prompt(0, 4), bad, prefill_locally=True), col.sink("a"))
    assert e.value.code == INVALID_ARGUMENT and "stop_token_ids" in e.value.message
    eng.allow_local_prefill = False
    with pytest.raises(EngineError) as e:
        eng.add_request(
            DecodeRequest("a", prompt(0, 4), greedy(4), prefill_locally=True), col.sink("a")
        )
    assert e.value.code == FAILED_PRECONDITION
    assert eng.num_live == 0
    eng.check_integrity()


def test_abort_running_and_finished_is_idempotent() -> None:
    eng = tiny_engine()
    col = Collector()
    eng.add_request(
        DecodeRequest("a", prompt(0, 9), greedy(50), prefill_locally=True), col.sink("a")
    )
    eng.add_request(
        DecodeRequest("b", prompt(1, 5), greedy(2), prefill_locally=True), col.sink("b")
    )
    eng.step()
    eng.step()
    assert isinstance(col.last("b"), FinishedEvent)
    assert not eng.abort("b") and not eng.abort("b")  # just finished: nothing held
    assert eng.abort("a") and not eng.abort("a")
    assert col.last("a") == ErrorEvent(CANCELLED, "aborted")
    assert len(col.events["a"]) == 3  # two tokens, then the terminal event only once
    eng.step()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks and eng.num_live == 0
    eng.check_integrity()


def test_background_loop_streams_and_honours_deadlines() -> None:
    now = [1000.0]  # a wall clock the test moves
    eng = tiny_engine(clock=lambda: now[0])
    col = Collector()
    eng.start()
    try:
        reqs = _requests(6, seed=3)
        for r in reqs:
            eng.add_request(r, col.sink(r.request_id))
        late = DecodeRequest(
            "late", prompt(9, 5), greedy(240, ignore_eos=True), prefill_locally=True,
            deadline=now[0] + 10,
        )  # fmt: skip
        eng.add_request(late, col.sink("late"))
        col.wait([r.request_id for r in reqs])  # at most 14 tokens each: "late" is still running
        assert all(isinstance(col.last(r.request_id), FinishedEvent) for r in reqs)
        assert not col.done("late")
        now[0] += 11
        col.wait(["late"])
        assert col.last("late") == ErrorEvent(DEADLINE_EXCEEDED, "request deadline passed")
        deadline = time.time() + 5
        while eng.kv.num_free_blocks != eng.kv.num_blocks and time.time() < deadline:
            time.sleep(0.01)
        assert eng.kv.num_free_blocks == eng.kv.num_blocks
        s = eng.stats()
        assert s.step_time_ms > 0 and s.generation_tokens_per_s > 0 and s.num_finished >= 6
    finally:
        eng.shutdown()
    eng.check_integrity()


def test_stop_fails_live_requests() -> None:
    eng = tiny_engine()
    col = Collector()
    eng.add_request(
        DecodeRequest("a", prompt(0, 9), greedy(50), prefill_locally=True), col.sink("a")
    )
    eng.shutdown()
    assert isinstance(col.last("a"), ErrorEvent) and col.last("a").code == UNAVAILABLE  # type: ignore[union-attr]
    with pytest.raises(EngineError):
        eng.add_request(
            DecodeRequest("b", prompt(0, 9), greedy(5), prefill_locally=True), col.sink("b")
        )
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_logprobs_when_asked() -> None:
    eng = tiny_engine()
    col = Collector()
    sp = SamplingParams(temperature=0.0, max_tokens=3, logprobs=True, top_logprobs=2)
    eng.add_request(DecodeRequest("lp", prompt(0, 6), sp, prefill_locally=True), col.sink("lp"))
    eng.add_request(
        DecodeRequest("no", prompt(0, 6), greedy(3), prefill_locally=True), col.sink("no")
    )
    eng.run_until_idle()
    toks = [t for e in col.events["lp"] if isinstance(e, TokensEvent) for t in e.tokens]
    assert len(toks) == 3
    for t in toks:
        assert t.logprob < 0 and len(t.top_logprobs) == 2
        assert t.top_logprobs[0][0] == t.token_id  # greedy: the sampled token is the best one
        assert t.top_logprobs[0][1] == pytest.approx(t.logprob)
    plain = [t for e in col.events["no"] if isinstance(e, TokensEvent) for t in e.tokens]
    assert [t.token_id for t in plain] == [t.token_id for t in toks]
    assert all(t.top_logprobs == () for t in plain)


def test_a_local_prefill_reports_its_prefix_cache_hit() -> None:
    """Unified mode: the Accepted answer carries the prompt tokens served from the decode
    worker's prefix cache (the router reports them as usage cached_tokens), 0 on a miss."""
    eng = tiny_engine(prefix_caching=True)
    col = Collector()
    shared = prompt(0, 17)  # 4 full blocks of 4, then one token
    first = eng.add_request(
        DecodeRequest("a", shared, greedy(2), prefill_locally=True), col.sink("a")
    )
    assert first.cached_tokens == 0
    while not col.done("a"):
        eng.step()
    again = eng.add_request(
        DecodeRequest("b", shared, greedy(2), prefill_locally=True), col.sink("b")
    )
    assert again.cached_tokens == 16  # the full blocks; the last token is always computed
    while not col.done("b"):
        eng.step()
    eng.check_integrity()


def test_prefill_thread_outputs_equal_prefill_inside_decode_steps() -> None:
    """Local prompts computed by the prefill thread, concurrently with the decode loop, give the
    tokens of the in-step chunked prefill (greedy and seeded), and free every block."""
    reqs = _requests(12, seed=5)
    ref = tiny_engine(max_num_seqs=8, chunk=8, max_num_batched_tokens=32)
    expected = {r.request_id: run_solo(ref, r) for r in reqs}
    eng = tiny_engine(max_num_seqs=8, max_num_batched_tokens=32, prefill_thread=True)
    threads: set[str] = set()
    run = eng.runner.run

    def recording_run(batch):  # type: ignore[no-untyped-def]
        threads.add(threading.current_thread().name)
        return run(batch)

    eng.runner.run = recording_run  # type: ignore[method-assign]
    col = Collector()
    eng.start()
    try:
        for r in reqs:
            eng.add_request(r, col.sink(r.request_id))
        col.wait([r.request_id for r in reqs])
        deadline = time.time() + 5
        while eng.kv.num_free_blocks != eng.kv.num_blocks and time.time() < deadline:
            time.sleep(0.01)
        assert eng.kv.num_free_blocks == eng.kv.num_blocks
    finally:
        eng.shutdown()
    assert threads == {"decode-0-loop", "decode-0-prefill"}  # both loops computed
    for r in reqs:
        assert col.tokens(r.request_id) == expected[r.request_id], r.request_id
        assert isinstance(col.last(r.request_id), FinishedEvent)
    eng.check_integrity()
    # without start(), step() runs a prefill step first: same tokens, stepped in one thread
    inline = tiny_engine(max_num_seqs=8, max_num_batched_tokens=32, prefill_thread=True)
    col2 = Collector()
    for r in reqs:
        inline.add_request(r, col2.sink(r.request_id))
    inline.run_until_idle()
    assert {r.request_id: col2.tokens(r.request_id) for r in reqs} == expected
    assert inline.kv.num_free_blocks == inline.kv.num_blocks
