"""PrefillEngine without a KV target: token 1, prefix caching, LRU eviction, abort, errors.

KV hand-off over the loopback transport is covered in test_prefill_handoff.py.
"""

from __future__ import annotations

import threading
import time

import pytest
from prefill_tiny import TINY, OneShot, prompt, tiny_config

from pdserve.engine.errors import (
    ALREADY_EXISTS,
    CANCELLED,
    DEADLINE_EXCEEDED,
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    EngineError,
)
from pdserve.sampling_params import SamplingParams
from prefill_worker.engine import PrefillEngine
from prefill_worker.request import KVTarget, PrefillRequest, PrefillState

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams(temperature=0, logprobs=True, top_logprobs=3)


def _engine(**kw: int | bool) -> PrefillEngine:
    return PrefillEngine.build(tiny_config(**kw), model_config=TINY)  # type: ignore[arg-type]


def _req(rid: str, tokens: tuple[int, ...], **kw: object) -> PrefillRequest:
    return PrefillRequest(rid, tokens, kw.pop("sampling", GREEDY), **kw)  # type: ignore[arg-type]


def test_mixed_prompts_token1_matches_one_shot(one_shot: OneShot) -> None:
    eng = _engine(max_num_batched_tokens=256)
    lens = [5, 1500, 40, 300, 17, 700, 256, 90]
    prompts = [prompt(n, seed=i) for i, n in enumerate(lens)]
    futs = [eng.add_request(_req(f"r{i}", p)) for i, p in enumerate(prompts)]
    eng.run_until_idle()
    for p, f in zip(prompts, futs, strict=True):
        res = f.result(0)
        ref, _ = one_shot.run(p, GREEDY)
        assert res.token.token_id == ref.token_id
        assert res.token.logprob == pytest.approx(ref.logprob, abs=1e-4)
        assert [t for t, _ in res.token.top_logprobs] == [t for t, _ in ref.top_logprobs]
        assert res.num_prompt_tokens == len(p) and res.cached_tokens == 0
        assert res.transfer is None and res.transfer_ms == 0.0
        assert res.queue_ms >= 0 and res.compute_ms >= 0
    eng.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    assert eng.stats().num_prefills == 8


def test_prefix_cache_hit_computes_only_the_rest(one_shot: OneShot) -> None:
    eng = _engine()
    system = prompt(64, seed=100)
    first = system + prompt(30, seed=101)
    second = system + prompt(45, seed=102)
    f1 = eng.add_request(_req("a", first))
    assert eng.step() == len(first)
    eng.run_until_idle()
    assert f1.result(0).cached_tokens == 0
    f2 = eng.add_request(_req("b", second))
    assert eng.step() == len(second) - 64  # only the uncached tokens are computed
    eng.run_until_idle()
    res = f2.result(0)
    assert res.cached_tokens == 64
    ref, _ = one_shot.run(second, GREEDY)
    assert res.token.token_id == ref.token_id
    assert res.token.logprob == pytest.approx(ref.logprob, abs=1e-4)
    st = eng.stats()
    assert st.prefix_cache_hit_rate == pytest.approx(64 / (len(first) + len(second)))
    assert st.kv_blocks_used == 0 and st.kv_blocks_cached > 0


def test_prefix_caching_off() -> None:
    eng = _engine(enable_prefix_caching=False)
    p = prompt(80, seed=3)
    eng.add_request(_req("a", p))
    eng.run_until_idle()
    f = eng.add_request(_req("b", p))
    assert eng.step() == 80
    eng.run_until_idle()
    assert f.result(0).cached_tokens == 0 and eng.stats().kv_blocks_cached == 0


def test_eviction_under_a_small_pool_is_lru() -> None:
    eng = _engine(num_blocks=8)
    a, b, c = (prompt(48, seed=s) for s in (11, 12, 13))  # 3 full blocks each
    for rid, p in (("a", a), ("b", b)):
        eng.add_request(_req(rid, p + (1,)))  # 4 blocks; the 3 full ones get cached
        eng.run_until_idle()
    # 8 blocks: a's 3 + b's 3 cached; c needs 4 -> 2 free + evicts 2 from a (least recent).
    eng.add_request(_req("c", c + (1,)))
    eng.run_until_idle()
    # b is intact (its first 2 full blocks are usable: at least one token stays to compute).
    fb = eng.add_request(_req("b2", b + (2,)))
    eng.run_until_idle()
    assert fb.result(0).cached_tokens == 48
    # a lost its tail blocks first; its first block survived (tail-first LRU order).
    fa = eng.add_request(_req("a2", a + (2,)))
    eng.run_until_idle()
    assert fa.result(0).cached_tokens == 16
    eng.check_integrity()


def test_abort_during_chunked_prefill_frees_everything() -> None:
    eng = _engine(max_num_batched_tokens=64)
    long_f = eng.add_request(_req("long", prompt(1000, seed=5)))
    short_f = eng.add_request(_req("short", prompt(20, seed=6)))
    eng.step()
    eng.step()
    assert eng.request_state("long") is PrefillState.RUNNING
    assert eng.abort("long") and not eng.abort("long")
    eng.check_integrity()
    with pytest.raises(EngineError) as e:
        long_f.result(0)
    assert e.value.code == CANCELLED
    late_f = eng.add_request(_req("late", prompt(200, seed=7)))
    eng.run_until_idle()
    assert short_f.result(0).num_prompt_tokens == 20
    assert late_f.result(0).num_prompt_tokens == 200
    eng.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_abort_while_waiting_and_unknown_id() -> None:
    eng = _engine()
    f = eng.add_request(_req("w", prompt(10, seed=1)))
    assert eng.request_state("w") is PrefillState.WAITING
    assert eng.abort("w")
    assert not eng.abort("nope")
    assert f.exception(0).code == CANCELLED  # type: ignore[union-attr]
    eng.check_integrity()
    assert not eng.has_work()


def test_reprefill_counts_outputs_for_penalties_and_seed(one_shot: OneShot) -> None:
    eng = _engine()
    sp = SamplingParams(temperature=0.8, seed=42, frequency_penalty=1.5, max_tokens=20)
    toks = prompt(50, seed=9)
    f = eng.add_request(_req("x", toks, sampling=sp, num_output_tokens=5))
    eng.run_until_idle()
    ref, _ = one_shot.run(toks, sp, num_output_tokens=5)
    assert f.result(0).token.token_id == ref.token_id


def test_bad_requests_are_refused_and_the_engine_keeps_serving() -> None:
    eng = _engine(num_blocks=64)

    def code(req: PrefillRequest) -> str:
        with pytest.raises(EngineError) as e:
            eng.add_request(req)
        assert e.value.message
        return e.value.code

    assert code(_req("e", ())) == INVALID_ARGUMENT
    assert code(_req("l", prompt(2048, seed=1))) == INVALID_ARGUMENT
    assert code(_req("v", (1, TINY.vocab_size))) == INVALID_ARGUMENT
    assert code(_req("k", (1, 2, 3), num_output_tokens=3)) == INVALID_ARGUMENT
    sp = SamplingParams(max_tokens=2)
    assert code(_req("m", (1, 2, 3), sampling=sp, num_output_tokens=2)) == INVALID_ARGUMENT
    assert code(_req("s", (1, 2), sampling=SamplingParams(stop_token_ids=(9999,)))) == (
        INVALID_ARGUMENT
    )
    assert code(_req("b", prompt(1100, seed=1))) == RESOURCE_EXHAUSTED  # 69 blocks > 64
    assert code(_req("d", (1, 2), deadline=time.time() - 1)) == DEADLINE_EXCEEDED
    f = eng.add_request(_req("ok", (1, 2, 3)))
    assert code(_req("ok", (4, 5))) == ALREADY_EXISTS
    eng.run_until_idle()
    assert f.result(0).num_prompt_tokens == 3
    eng.check_integrity()


def test_a_target_without_a_sender_is_unavailable() -> None:
    eng = _engine()
    bare = PrefillEngine(eng.config, eng.runner, sender=None)
    with pytest.raises(EngineError) as e:
        bare.add_request(_req("t", (1, 2), target=KVTarget(1, "loopback:1")))
    assert e.value.code == UNAVAILABLE and "no KV sender" in e.value.message
    eng.shutdown()


def test_deadline_expires_a_queued_request() -> None:
    eng = _engine()
    f = eng.add_request(_req("d", prompt(10, seed=2), deadline=time.time() + 0.05))
    time.sleep(0.1)
    eng.step()
    assert f.exception(0).code == DEADLINE_EXCEEDED  # type: ignore[union-attr]
    eng.check_integrity()


def test_forward_error_fails_only_that_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = _engine()
    real = eng.runner.run
    calls = {"n": 0}

    def flaky(batch):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return real(batch)

    monkeypatch.setattr(eng.runner, "run", flaky)
    f1 = eng.add_request(_req("a", (1, 2, 3)))
    eng.step()
    assert "injected" in f1.exception(0).message  # type: ignore[union-attr]
    f2 = eng.add_request(_req("b", (1, 2, 3)))
    eng.run_until_idle()
    assert f2.result(0).token.token_id >= 0
    eng.check_integrity()


def test_background_loop_serves_concurrent_callers() -> None:
    eng = _engine(max_num_batched_tokens=128)
    eng.start()
    try:
        results: dict[str, int] = {}

        def call(i: int) -> None:
            f = eng.add_request(_req(f"c{i}", prompt(60 + 40 * i, seed=i)))
            results[f"c{i}"] = f.result(30).num_prompt_tokens

        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == {f"c{i}": 60 + 40 * i for i in range(4)}
        st = eng.stats()
        assert st.num_prefills == 4 and st.prompt_tokens_per_s > 0
    finally:
        eng.shutdown()
    eng.check_integrity()


def test_shutdown_fails_live_requests() -> None:
    eng = _engine()
    f = eng.add_request(_req("x", prompt(10, seed=1)))
    eng.shutdown()
    assert f.exception(0).code == UNAVAILABLE  # type: ignore[union-attr]
    assert not eng.has_work()
    with pytest.raises(EngineError) as e:
        eng.add_request(_req("late", prompt(10, seed=1)))
    assert e.value.code == UNAVAILABLE
