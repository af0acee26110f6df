"""DecodeScheduler policy: reservations, admission, continuous batching, preemption, deadlines.

Pure Python over a real KVCacheManager with tiny pools and exact block ids; the "runner" is a
deterministic function of the scheduled tokens so every decision can be checked by hand.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from decode_worker.request import (
    DecodeRequest,
    ErrorEvent,
    FinishedEvent,
    PreemptedEvent,
    TokensEvent,
)
from decode_worker.scheduler import DecodeOutput, DecodeScheduler, SeqState
from pdserve.config import SchedulerConfig
from pdserve.engine.errors import (
    CANCELLED,
    DEADLINE_EXCEEDED,
    INTERNAL,
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    EngineError,
)
from pdserve.kv_cache.manager import KVCacheManager
from pdserve.sampling_params import SamplingParams
from pdserve.structured.spec import StructuredOutputError
from pdserve.types import SampledToken

pytestmark = pytest.mark.timeout(30)

VOCAB = 100
EOS = 99
BS = 4  # tokens per block


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(
    num_blocks: int = 16,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    chunk: int = 0,
    chunked: bool = True,
    caching: bool = False,
    clock: Clock | None = None,
    prefill_thread: bool = False,
    prefill_step_tokens: int = 0,
) -> DecodeScheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)
    cfg = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=chunk,
    )
    return DecodeScheduler(
        kv,
        cfg,
        max_model_len=max_model_len,
        vocab_size=VOCAB,
        eos_token_ids=(EOS,),
        clock=clock or Clock(),
        prefill_thread=prefill_thread,
        prefill_step_tokens=prefill_step_tokens,
    )


def req(
    rid: str,
    n: int,
    *,
    max_tokens: int = 8,
    local: bool = False,
    prev: int = 0,
    deadline: float | None = None,
    kv_timeout_s: float | None = None,
    **sp: object,
) -> DecodeRequest:
    return DecodeRequest(
        request_id=rid,
        prompt_token_ids=tuple(range(1, n + 1)),
        sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, **sp),  # type: ignore[arg-type]
        num_output_tokens=prev,
        prefill_locally=local,
        deadline=deadline,
        kv_timeout_s=kv_timeout_s,
    )


def fake_runner(plan: DecodeOutput, token: int | None = None) -> list[SampledToken | None]:
    """Next token = (position of the sampled token) % 50 + 1, or ``token`` when given."""
    out: list[SampledToken | None] = []
    for s in plan.scheduled:
        assert len(s.block_table) * BS >= s.num_tokens_after
        out.append(
            SampledToken(token if token is not None else s.num_tokens_after % 50 + 1)
            if s.sample
            else None
        )
    return out


def step(s: DecodeScheduler, token: int | None = None) -> DecodeOutput:
    plan = s.schedule()
    s.update_from_output(plan, fake_runner(plan, token))
    return plan


def events_of(s: DecodeScheduler) -> list[tuple[str, object]]:
    return s.drain()[0]


def test_remote_reservation_and_admission() -> None:
    s = make(num_blocks=8)
    table = s.add_request(req("a", 6), transfer_id=7)
    assert table == [0, 1]  # 6 tokens -> 2 blocks of 4
    assert s.state("a") is SeqState.WAITING_FOR_KV and s.num_waiting_for_kv == 1
    assert s.schedule().is_empty  # nothing runs before the KV arrives
    s.update_from_output(DecodeOutput(), [])
    assert s.kv_arrived("a", 7, SampledToken(11))
    assert s.state("a") is SeqState.WAITING
    plan = s.schedule()
    (seq,) = plan.scheduled
    # token 1 (11) is decoded at position 6; a block boundary is crossed at 8, not yet.
    assert seq.token_ids == [11] and seq.num_computed == 6 and seq.block_table == [0, 1]
    assert seq.output_token_ids == [11] and seq.prompt_token_ids == [1, 2, 3, 4, 5, 6]
    s.update_from_output(plan, fake_runner(plan))
    ev = events_of(s)
    assert ev == [("a", TokensEvent((SampledToken(8),)))]  # token 1 is not re-streamed
    plan = s.schedule()
    assert plan.scheduled[0].block_table == [0, 1] and plan.scheduled[0].num_computed == 7
    s.update_from_output(plan, fake_runner(plan))
    plan = s.schedule()  # position 8 needs a third block
    assert plan.scheduled[0].block_table == [0, 1, 2]
    s.update_from_output(plan, fake_runner(plan))
    s.check_integrity()


def test_refusals() -> None:
    s = make(num_blocks=4, max_model_len=32)
    with pytest.raises(EngineError) as e:
        s.add_request(req("x", 32))
    assert e.value.code == INVALID_ARGUMENT and "max_model_len" in e.value.message
    with pytest.raises(EngineError, match="num_output_tokens"):
        s.add_request(req("x", 4, prev=4))
    with pytest.raises(EngineError, match="max_tokens"):
        s.add_request(req("x", 6, prev=3, max_tokens=3))
    bad = DecodeRequest("x", (1, VOCAB), SamplingParams())
    with pytest.raises(EngineError, match=r"\[0, 100\)"):
        s.add_request(bad)
    s.add_request(req("a", 12))  # 3 of 4 blocks
    with pytest.raises(EngineError) as e:
        s.add_request(req("b", 8))
    assert e.value.code == RESOURCE_EXHAUSTED and "1 of 4 free" in e.value.message
    with pytest.raises(EngineError) as e:
        s.add_request(req("a", 2))
    assert e.value.code == "ALREADY_EXISTS"
    assert not s.has("b")
    s.check_integrity()


def test_reservations_leave_the_watermark_free() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    s = DecodeScheduler(
        kv, SchedulerConfig(max_model_len=64), max_model_len=64, vocab_size=VOCAB,
        watermark_blocks=2,
    )  # fmt: skip
    s.add_request(req("a", 16), transfer_id=1)  # 4 blocks, 4 free
    with pytest.raises(EngineError, match="2 kept for running sequences") as e:
        s.add_request(req("b", 12), transfer_id=2)  # 3 blocks would leave 1 < 2
    assert e.value.code == RESOURCE_EXHAUSTED and "retry later" in e.value.message
    s.add_request(req("b", 8), transfer_id=2)  # 2 blocks leave 2
    with pytest.raises(EngineError, match="never fits"):
        s.add_request(req("c", 28), transfer_id=3)  # 7 blocks > 8 - 2
    with pytest.raises(ValueError, match="watermark_blocks"):
        DecodeScheduler(
            kv, SchedulerConfig(), max_model_len=64, vocab_size=VOCAB, watermark_blocks=8
        )
    # Running sequences may still grow into the watermark.
    s.kv_arrived("a", 1, SampledToken(5))
    s.kv_arrived("b", 2, SampledToken(5))
    plan = step(s)
    assert [len(x.block_table) for x in plan.scheduled] == [5, 3] and kv.num_free_blocks == 0


def test_token_one_finishes_immediately() -> None:
    s = make()
    s.add_request(req("len", 5, max_tokens=1), transfer_id=1)
    s.add_request(req("eos", 5), transfer_id=2)
    s.add_request(req("ign", 5, ignore_eos=True), transfer_id=3)
    s.add_request(req("prev", 5, prev=2, max_tokens=3), transfer_id=4)
    for rid, tid, tok in (("len", 1, 5), ("eos", 2, EOS), ("ign", 3, EOS), ("prev", 4, 5)):
        s.kv_arrived(rid, tid, SampledToken(tok))
    assert events_of(s) == [
        ("len", FinishedEvent("length", 1)),
        ("eos", FinishedEvent("stop", 1)),
        ("prev", FinishedEvent("length", 3)),  # 2 earlier outputs + token 1 = max_tokens
    ]
    assert s.has("ign") and not s.has("len")
    assert s.kv.num_free_blocks == 16 - 2
    s.check_integrity()


def test_stop_conditions() -> None:
    s = make(max_model_len=12)
    s.add_request(req("stop", 4, stop_token_ids=(42,)), transfer_id=1)
    s.add_request(req("minlen", 4, min_tokens=3, stop_token_ids=(42,)), transfer_id=2)
    s.add_request(req("model", 9, max_tokens=100), transfer_id=3)
    for rid, tid in (("stop", 1), ("minlen", 2), ("model", 3)):
        s.kv_arrived(rid, tid, SampledToken(5))
    step(s, token=42)
    ev = dict((r, e) for r, e in events_of(s) if not isinstance(e, TokensEvent))
    assert ev == {"stop": FinishedEvent("stop", 2)}
    step(s, token=42)  # minlen now has 3 outputs; model reaches 9 + 3 = 12 tokens
    ev = dict((r, e) for r, e in events_of(s) if not isinstance(e, TokensEvent))
    assert ev == {"minlen": FinishedEvent("stop", 3), "model": FinishedEvent("length", 3)}
    assert s.kv.num_free_blocks == 16
    s.check_integrity()


def test_max_num_seqs_and_fifo_admission() -> None:
    s = make(max_num_seqs=2)
    for i, rid in enumerate("abc"):
        s.add_request(req(rid, 3, max_tokens=3), transfer_id=i)
    for i, rid in zip((2, 0), "ca", strict=True):
        s.kv_arrived(rid, i, SampledToken(5))
    plan = step(s)
    assert [x.request_id for x in plan.scheduled] == ["a", "c"]  # in arrival order, once ready
    s.kv_arrived("b", 1, SampledToken(5))
    assert s.num_waiting == 1
    step(s)  # a and c finish (3 outputs)
    plan = step(s)
    assert [x.request_id for x in plan.scheduled] == ["b"]


def test_a_replaced_sequence_keeps_its_place_in_both_queues() -> None:
    """A sequence the router re-places (after a preemption or a lost worker) carries the time it
    first arrived; it goes ahead of requests that arrived after it, for a batch slot and in the
    prefill thread's queue, and a stamp from the future counts as now."""
    s = make(max_num_seqs=1)
    s.add_request(req("a", 3, max_tokens=3), transfer_id=1)
    s.add_request(req("b", 3, max_tokens=3), transfer_id=2)
    old = replace(req("old", 3, max_tokens=3), arrival_time=time.monotonic() - 5)
    s.add_request(old, transfer_id=3)
    for rid, tid in (("a", 1), ("b", 2), ("old", 3)):
        s.kv_arrived(rid, tid, SampledToken(5))
    admitted = []
    while s.has_work():
        admitted += [x.request_id for x in step(s).scheduled if x.request_id not in admitted]
    assert admitted == ["old", "a", "b"]

    s = make(num_blocks=32, max_model_len=128, prefill_thread=True, prefill_step_tokens=16)
    s.add_request(req("p", 6, local=True, max_tokens=2))
    s.add_request(replace(req("future", 6, local=True), arrival_time=time.monotonic() + 60))
    s.add_request(req("q", 6, local=True, max_tokens=2))
    s.add_request(replace(req("old", 6, local=True), arrival_time=time.monotonic() - 5))
    plan = s.schedule_prefill()
    assert [x.request_id for x in plan.scheduled] == ["old", "p", "future"]  # 16 tokens a step
    s.check_integrity()


def test_preempts_newest_when_out_of_blocks() -> None:
    s = make(num_blocks=4)
    s.add_request(req("old", 4, max_tokens=20), transfer_id=1)
    s.add_request(req("new", 4, max_tokens=20), transfer_id=2)
    s.kv_arrived("old", 1, SampledToken(7))
    s.kv_arrived("new", 2, SampledToken(9))
    # Step 1: both need a 2nd block at position 4 -> 4 blocks used.
    step(s)
    events_of(s)
    assert s.kv.num_free_blocks == 0
    for _ in range(3):
        step(s)
    # Position 8 needs a 3rd block for "old": "new" (the newest) is preempted.
    plan = step(s)
    assert [x.request_id for x in plan.scheduled] == ["old"]
    (pre,) = [(r, e) for r, e in events_of(s) if isinstance(e, PreemptedEvent)]
    assert pre[0] == "new"
    assert pre[1].output_token_ids == (9, 6, 7, 8, 9)  # token 1 + four decoded tokens
    assert s.num_preemptions == 1 and not s.has("new")
    s.check_integrity()


def test_preempts_itself_when_alone() -> None:
    s = make(num_blocks=2)
    s.add_request(req("a", 4, max_tokens=20), transfer_id=1)
    s.add_request(req("b", 4, max_tokens=20), transfer_id=2)  # holds the other block, no KV yet
    s.kv_arrived("a", 1, SampledToken(7))
    plan = step(s)
    assert plan.is_empty
    assert events_of(s) == [("a", PreemptedEvent((7,), "no free KV blocks"))]
    assert s.state("b") is SeqState.WAITING_FOR_KV
    s.check_integrity()


def test_chunked_local_prefill_delays_decodes_by_one_chunk() -> None:
    s = make(num_blocks=32, chunk=8, max_model_len=128)
    s.add_request(req("d", 4, max_tokens=50), transfer_id=1)
    s.kv_arrived("d", 1, SampledToken(3))
    step(s)
    s.add_request(req("long", 30, local=True, max_tokens=2))
    sizes = []
    for _ in range(5):
        plan = s.schedule()
        assert plan.scheduled[0].request_id == "d" and len(plan.scheduled[0].token_ids) == 1
        sizes.append([len(x.token_ids) for x in plan.scheduled[1:]])
        s.update_from_output(plan, fake_runner(plan))
    assert sizes == [[8], [8], [8], [6], [1]]  # the 30-token prompt in 8-token chunks, then decode
    ev = [(r, e) for r, e in events_of(s) if r == "long"]
    assert ev == [
        ("long", TokensEvent((SampledToken(31),))),
        ("long", TokensEvent((SampledToken(32),))),
        ("long", FinishedEvent("length", 2)),
    ]
    s.check_integrity()


def test_local_prefill_uses_full_budget_when_alone_and_unchunked_waits() -> None:
    s = make(num_blocks=32, chunk=8, max_num_batched_tokens=16, max_model_len=128)
    s.add_request(req("p", 20, local=True, max_tokens=1))
    assert [len(x.token_ids) for x in step(s).scheduled] == [16]
    assert [len(x.token_ids) for x in step(s).scheduled] == [4]
    u = make(num_blocks=32, max_num_batched_tokens=16, chunked=False, max_model_len=16)
    u.add_request(req("p", 10, local=True, max_tokens=1))
    plan = step(u)
    assert [(len(x.token_ids), x.sample) for x in plan.scheduled] == [(10, True)]


def test_prefix_cache_hit_for_local_prefill() -> None:
    s = make(caching=True)
    s.add_request(req("a", 9, local=True, max_tokens=1))
    step(s)
    assert events_of(s)[-1] == ("a", FinishedEvent("length", 1))
    s.add_request(req("b", 10, local=True, max_tokens=1))
    plan = s.schedule()
    (x,) = plan.scheduled
    assert x.num_computed == 8 and x.token_ids == [9, 10]  # two cached blocks reused
    s.update_from_output(plan, fake_runner(plan))
    assert s.kv.prefix_cache_stats == (19, 8)
    s.check_integrity()


def test_abort_each_stage_is_idempotent() -> None:
    s = make(num_blocks=8)
    s.add_request(req("wait", 4), transfer_id=1)
    s.add_request(req("run", 4), transfer_id=2)
    s.kv_arrived("run", 2, SampledToken(5))
    step(s)
    events_of(s)
    assert s.abort("wait") and not s.abort("wait")
    assert s.abort("run") and not s.abort("run")
    ev, released = s.drain()
    assert ev == [
        ("wait", ErrorEvent(CANCELLED, "aborted")),
        ("run", ErrorEvent(CANCELLED, "aborted")),
    ]
    assert released == [1]  # the receiver must forget transfer 1
    assert not s.kv_arrived("wait", 1, SampledToken(5))  # late KV for an aborted request
    s.add_request(req("done", 4, max_tokens=1), transfer_id=3)
    s.kv_arrived("done", 3, SampledToken(5))
    assert not s.abort("done")  # just finished: nothing held
    assert s.kv.num_free_blocks == 8
    s.check_integrity()


def test_abort_mid_step_frees_after_update() -> None:
    s = make(num_blocks=8)
    s.add_request(req("a", 4), transfer_id=1)
    s.kv_arrived("a", 1, SampledToken(5))
    plan = s.schedule()
    assert s.abort("a")
    assert s.kv.num_free_blocks == 6  # the forward may still write blocks 0-1
    s.add_request(req("a", 4, prev=1), transfer_id=2)  # same id re-used by the router
    s.update_from_output(plan, fake_runner(plan))
    ev, _ = s.drain()
    assert ev == [("a", ErrorEvent(CANCELLED, "aborted"))]  # no token after the terminal event
    assert s.kv.num_free_blocks == 7 and s.state("a") is SeqState.WAITING_FOR_KV
    assert not s.kv_arrived("a", 1, SampledToken(5))  # the first attempt's transfer is stale
    s.check_integrity()


def test_deadlines_and_kv_timeout() -> None:
    clock = Clock()
    s = make(clock=clock)
    s.add_request(req("kv", 4, kv_timeout_s=2.0), transfer_id=1)
    s.add_request(req("dl", 4, deadline=clock.t + 5), transfer_id=2)
    s.kv_arrived("dl", 2, SampledToken(5))
    clock.t += 2.5
    step(s)
    ev, released = s.drain()
    assert ev[0] == (
        "kv",
        ErrorEvent(DEADLINE_EXCEEDED, "KV for transfer 1 did not arrive in time"),
    )
    assert released == [1]
    clock.t += 3
    s.expire()
    ev, _ = s.drain()
    assert ev == [("dl", ErrorEvent(DEADLINE_EXCEEDED, "request deadline passed"))]
    assert s.kv.num_free_blocks == 16
    s.check_integrity()


def test_kv_failed_and_fail_step() -> None:
    s = make()
    s.add_request(req("a", 4), transfer_id=1)
    s.add_request(req("b", 4), transfer_id=2)
    assert not s.kv_failed("a", 9, "UNAVAILABLE", "x")  # another attempt's transfer
    assert s.kv_failed("a", 1, "UNAVAILABLE", "channel down")
    s.kv_arrived("b", 2, SampledToken(5))
    plan = s.schedule()
    s.fail_step(plan, "forward raised")
    ev, released = s.drain()
    assert ev == [
        ("a", ErrorEvent("UNAVAILABLE", "channel down")),
        ("b", ErrorEvent(INTERNAL, "forward raised")),
    ]
    assert released == []  # the receiver already dropped transfer 1 itself
    assert s.kv.num_free_blocks == 16
    s.check_integrity()


class RejectingGrammar:
    """A grammar matcher that rejects every token (what a degenerate schema's can do)."""

    def advance(self, token_ids: list[int]) -> None:
        raise StructuredOutputError("guided_json", "'guided_json': token sequence leaves it")


def test_token_one_outside_the_grammar_fails_the_request_not_the_worker() -> None:
    s = make()
    s.add_request(req("g", 4), transfer_id=1, grammar=RejectingGrammar())  # type: ignore[arg-type]
    assert not s.kv_arrived("g", 1, SampledToken(5))
    ev, _ = s.drain()
    ((rid, err),) = ev
    # INVALID_ARGUMENT: the router answers 400 naming the field and keeps the worker healthy
    assert rid == "g" and isinstance(err, ErrorEvent) and err.code == INVALID_ARGUMENT
    assert "guided_json" in err.message
    assert s.kv.num_free_blocks == 16 and not s.has("g")
    s.check_integrity()
    # an EOS ends the sequence without the matcher (a grammar with no token left allows only
    # EOS; the matcher would refuse an EOS before the grammar is complete), as on a local prefill
    s.add_request(req("e", 4), transfer_id=2, grammar=RejectingGrammar())  # type: ignore[arg-type]
    assert s.kv_arrived("e", 2, SampledToken(EOS))
    ev, _ = s.drain()
    assert ev[-1] == ("e", FinishedEvent("stop", 1))
    assert s.kv.num_free_blocks == 16 and not s.has("e")


def test_update_checks_result_count() -> None:
    s = make()
    s.add_request(req("a", 4), transfer_id=1)
    s.kv_arrived("a", 1, SampledToken(5))
    plan = s.schedule()
    with pytest.raises(RuntimeError, match="before update"):
        s.schedule()
    with pytest.raises(ValueError, match="0 results for 1 seqs"):
        s.update_from_output(plan, [])
    s.update_from_output(s.schedule(), [SampledToken(5)])  # the step was not applied; it runs again
    assert s.drain()[0] == [("a", TokensEvent((SampledToken(5),)))]


def prefill_step(s: DecodeScheduler, token: int | None = None) -> DecodeOutput:
    plan = s.schedule_prefill()
    s.update_prefill(plan, fake_runner(plan, token))
    return plan


def test_prefill_thread_keeps_local_prompts_out_of_decode_steps() -> None:
    s = make(  # chunk=32: no prompt here is long (the next test covers long ones)
        num_blocks=32, max_model_len=128, prefill_thread=True, prefill_step_tokens=16, chunk=32
    )
    for i, rid in enumerate(("d", "e")):
        s.add_request(req(rid, 4, max_tokens=50), transfer_id=i + 1)
        s.kv_arrived(rid, i + 1, SampledToken(3))
    step(s)
    s.add_request(req("p", 30, local=True, max_tokens=3))
    s.add_request(req("q", 6, local=True, max_tokens=3))
    assert s.state("p") is SeqState.PREFILLING and s.num_waiting == 2
    # a decode step and a prefill step planned at once (the two threads) touch disjoint seqs;
    # as many sequences decode as prompts wait, so the decode step takes no prompt chunk
    dplan = s.schedule()
    pplan = s.schedule_prefill()
    assert [x.request_id for x in dplan.scheduled] == ["d", "e"]
    assert [(x.request_id, len(x.token_ids), x.sample) for x in pplan.scheduled] == [
        ("p", 16, False)
    ]
    with pytest.raises(RuntimeError):
        s.schedule_prefill()  # the previous prefill step is still being computed
    s.update_from_output(dplan, fake_runner(dplan))
    s.update_prefill(pplan, fake_runner(pplan))
    # arrival order: p's last 14 tokens, then q's first 2 (16 tokens a step)
    plan = prefill_step(s)
    assert [(x.request_id, len(x.token_ids), x.sample) for x in plan.scheduled] == [
        ("p", 14, True),
        ("q", 2, False),
    ]
    assert s.state("p") is SeqState.WAITING  # token 1 sampled: waits for a batch slot
    assert [e for r, e in events_of(s) if r == "p"] == [TokensEvent((SampledToken(31),))]
    plan = s.schedule()  # p joins the decode batch; q still prefilling
    assert [x.request_id for x in plan.scheduled] == ["d", "e", "p"]
    s.update_from_output(plan, fake_runner(plan))
    plan = prefill_step(s)
    assert [(x.request_id, len(x.token_ids)) for x in plan.scheduled] == [("q", 4)]
    assert not s.has_prefill_work()
    s.check_integrity()


def test_prefill_thread_short_prompts_do_not_wait_for_a_whole_long_one() -> None:
    """The prefill thread shares its steps as a prefill worker does: long prompts (over T = 64 //
    8 = 8 tokens to compute) take at most 8 tokens a step, a short prompt that arrives meanwhile
    runs in the next step, alone, and the long prompt still progresses every other step."""
    s = make(num_blocks=32, max_model_len=128, prefill_thread=True, prefill_step_tokens=16)
    assert s.long_threshold == 8
    s.add_request(req("long", 40, local=True, max_tokens=2))
    plan = prefill_step(s)
    assert [(x.request_id, len(x.token_ids)) for x in plan.scheduled] == [("long", 8)]
    s.add_request(req("short", 6, local=True, max_tokens=2))
    plan = prefill_step(s)  # a short-only step after a long chunk
    assert [(x.request_id, len(x.token_ids), x.sample) for x in plan.scheduled] == [
        ("short", 6, True)
    ]
    assert s.state("short") is SeqState.WAITING  # token 1 sampled, 32 tokens of "long" left
    sizes = []
    while s.has_prefill_work():
        plan = prefill_step(s)
        sizes += [len(x.token_ids) for x in plan.scheduled]
    assert sizes == [8, 8, 8, 8]  # 32 left: 8 a step; the last 8 fits the share whole
    s.check_integrity()


def test_prefill_thread_passes_over_a_long_prompt_past_its_share() -> None:
    """Two long prompts share one share (8 tokens): the second is passed over, keeping its place,
    and a short prompt behind both still runs in the same step."""
    s = make(num_blocks=32, max_model_len=128, prefill_thread=True, prefill_step_tokens=16)
    for rid, n in (("a", 30), ("b", 30), ("c", 5)):
        s.add_request(req(rid, n, local=True, max_tokens=2))
    plan = prefill_step(s)
    assert [(x.request_id, len(x.token_ids)) for x in plan.scheduled] == [("a", 8), ("c", 5)]
    s.check_integrity()


def test_decode_steps_take_prompt_chunks_while_fewer_sequences_decode() -> None:
    s = make(  # chunk=32: no prompt here is long
        num_blocks=32, max_model_len=128, prefill_thread=True, prefill_step_tokens=16, chunk=32
    )
    for rid, n in (("p", 20), ("q", 6), ("r", 6)):
        s.add_request(req(rid, n, local=True, max_tokens=3))
    pplan = s.schedule_prefill()
    assert [(x.request_id, len(x.token_ids)) for x in pplan.scheduled] == [("p", 16)]
    dplan = s.schedule()  # nothing decodes, 3 prompts wait: the decode step helps
    assert [(x.request_id, len(x.token_ids), x.sample) for x in dplan.scheduled] == [
        ("q", 6, True),
        ("r", 6, True),
    ]
    s.update_from_output(dplan, fake_runner(dplan))
    assert s.state("q") is s.state("r") is SeqState.WAITING
    assert events_of(s) == [
        ("q", TokensEvent((SampledToken(7),))),
        ("r", TokensEvent((SampledToken(7),))),
    ]
    s.update_prefill(pplan, fake_runner(pplan))
    dplan = s.schedule()  # 2 decode, 1 prompt waits: decodes only
    assert [(x.request_id, len(x.token_ids)) for x in dplan.scheduled] == [("q", 1), ("r", 1)]
    s.update_from_output(dplan, fake_runner(dplan))
    plan = prefill_step(s)
    assert [(x.request_id, len(x.token_ids), x.sample) for x in plan.scheduled] == [("p", 4, True)]
    s.check_integrity()


def test_prefill_thread_abort_mid_step_eos_at_token_one_and_failures_free_blocks() -> None:
    s = make(num_blocks=16, prefill_thread=True, prefill_step_tokens=8)
    s.add_request(req("a", 12, local=True))
    plan = s.schedule_prefill()
    assert s.abort("a")
    assert s.kv.num_free_blocks == 13  # the forward may still write a's 3 blocks
    s.update_prefill(plan, fake_runner(plan))
    assert events_of(s) == [("a", ErrorEvent(CANCELLED, "aborted"))]
    assert s.kv.num_free_blocks == 16
    s.add_request(req("eos", 4, local=True))
    prefill_step(s, token=EOS)
    assert events_of(s) == [
        ("eos", TokensEvent((SampledToken(EOS),))),
        ("eos", FinishedEvent("stop", 1)),
    ]
    assert s.kv.num_free_blocks == 16 and not s.has("eos")
    s.add_request(req("bad", 4, local=True))
    plan = s.schedule_prefill()
    with pytest.raises(ValueError):
        s.update_prefill(plan, [])
    s.fail_prefill_step(plan, "forward failed")
    assert events_of(s) == [("bad", ErrorEvent(INTERNAL, "forward failed"))]
    assert s.kv.num_free_blocks == 16 and s.schedule_prefill().is_empty
    s.check_integrity()
