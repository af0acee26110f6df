"""Prefill engine -> loopback KV transfer -> decode engine, against unified (local prefill) runs.

Both engines load the same tiny random weights (dummy format, same seed), so a request's tokens
must be identical whether its prompt was prefilled by the prefill engine (token 1 sampled there,
KV sent over the loopback transport into the blocks the decode engine reserved) or locally.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import pytest
from decode_kit import TINY, Collector, greedy, prompt, tiny_config

from decode_worker.engine import DecodeEngine
from decode_worker.request import DecodeRequest, ErrorEvent, FinishedEvent, PreemptedEvent
from pdserve.config import EngineConfig, TransferConfig
from pdserve.engine.errors import CANCELLED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, EngineError
from pdserve.sampling_params import SamplingParams
from prefill_worker.engine import PrefillEngine
from prefill_worker.request import KVTarget, PrefillRequest, PrefillResult

pytestmark = pytest.mark.timeout(120)


def _with_loopback(cfg: EngineConfig) -> EngineConfig:
    return EngineConfig(
        load=cfg.load,
        cache=cfg.cache,
        scheduler=cfg.scheduler,
        transfer=TransferConfig(backend="loopback", timeout_s=20.0),
    )


PairFactory = Callable[..., tuple[PrefillEngine, DecodeEngine]]


@pytest.fixture
def make_pair() -> Iterator[PairFactory]:
    """Builds (prefill, decode) engines on the same tiny weights; shuts them all down after."""
    made: list[tuple[PrefillEngine, DecodeEngine]] = []

    def build(**kw: object) -> tuple[PrefillEngine, DecodeEngine]:
        cfg = _with_loopback(tiny_config(**kw))  # type: ignore[arg-type]
        made.append((PrefillEngine.build(cfg, TINY), DecodeEngine.build(cfg, TINY)))
        return made[-1]

    yield build
    for prefill, decode in made:
        prefill.shutdown()
        decode.shutdown()


def _sampling(i: int, mode: str, max_tokens: int) -> SamplingParams:
    if mode == "greedy":
        return greedy(max_tokens)
    return SamplingParams(
        temperature=0.9, top_k=40, top_p=0.95, seed=1000 + i, max_tokens=max_tokens,
        presence_penalty=0.3, repetition_penalty=1.1,
    )  # fmt: skip


class MiniRouter:
    """Places requests the way the router does: reserve on D, prefill on P with D as the target,
    token 1 from P's result, the rest from D's stream; on Preempted, re-place prompt + outputs."""

    def __init__(self, prefill: PrefillEngine, decode: DecodeEngine, col: Collector) -> None:
        self.prefill, self.decode, self.col = prefill, decode, col
        self.outputs: dict[str, list[int]] = {}
        self.attempt: dict[str, str] = {}
        self._k = 0

    def place(
        self, rid: str, prompt_ids: tuple[int, ...], sp: SamplingParams
    ) -> Future[PrefillResult]:
        """Reserve on D and start the prefill. Raises EngineError when D has no room."""
        out = self.outputs.setdefault(rid, [])
        self._k += 1
        aid = f"{rid}~{self._k}"
        tokens = prompt_ids + tuple(out)
        acc = self.decode.add_request(
            DecodeRequest(aid, tokens, sp, num_output_tokens=len(out)), self.col.sink(aid)
        )
        self.attempt[rid] = aid
        target = KVTarget(acc.transfer_id, acc.kv_endpoint, acc.decode_worker_id)
        return self.prefill.add_request(
            PrefillRequest(aid, tokens, sp, target=target, num_output_tokens=len(out))
        )

    def tokens(self, rid: str) -> list[int]:
        """Every output token of ``rid`` so far: before this attempt, then streamed by D."""
        aid = self.attempt.get(rid)
        return self.outputs[rid] + (self.col.tokens(aid) if aid else [])


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_disaggregated_equals_unified(mode: str, make_pair: PairFactory) -> None:
    prefill, decode = make_pair()
    prefill.start()
    decode.start()
    col = Collector()
    router = MiniRouter(prefill, decode, col)
    cases = [(f"q{i}", prompt(i, 3 + 5 * i), _sampling(i, mode, 3 + i)) for i in range(10)]
    futs = {rid: router.place(rid, p, sp) for rid, p, sp in cases}
    for rid, fut in futs.items():
        router.outputs[rid].append(fut.result(30).token.token_id)  # token 1, from P
    col.wait(list(router.attempt.values()))
    disagg = {rid: router.tokens(rid) for rid, _, _ in cases}
    for rid, _, sp in cases:
        last = col.last(router.attempt[rid])
        assert isinstance(last, FinishedEvent), (rid, last)
        assert last.num_output_tokens == len(disagg[rid]) <= sp.max_tokens  # type: ignore[operator]
    for rid, p, sp in cases:
        col.events.pop(rid, None)
        decode.add_request(DecodeRequest(rid, p, sp, prefill_locally=True), col.sink(rid))
    col.wait([rid for rid, _, _ in cases])
    unified = {rid: col.tokens(rid) for rid, _, _ in cases}
    assert disagg == unified
    assert decode.receiver is not None and decode.receiver.stats().transfers_ok == 10
    assert decode.kv.num_free_blocks == decode.kv.num_blocks
    decode.check_integrity()


def test_preemption_with_reprefill_on_the_prefill_engine(make_pair: PairFactory) -> None:
    prefill, decode = make_pair(num_blocks=16)  # 6 x up to 8 blocks of 4 tokens: must preempt
    col = Collector()
    router = MiniRouter(prefill, decode, col)
    cases = [(f"p{i}", prompt(i, 5 + i), greedy(22, ignore_eos=True)) for i in range(6)]
    expected = {}
    for rid, p, sp in cases:  # each alone, unified, on the same engine
        decode.add_request(DecodeRequest(rid, p, sp, prefill_locally=True), col.sink(rid))
        decode.run_until_idle()
        expected[rid] = col.tokens(rid)
    queue = list(cases)
    while queue or decode.has_work():
        retry = []
        for rid, p, sp in queue:
            try:
                fut = router.place(rid, p, sp)
            except EngineError as e:
                assert e.code == RESOURCE_EXHAUSTED
                retry.append((rid, p, sp))
                continue
            prefill.run_until_idle()
            router.outputs[rid].append(fut.result(0).token.token_id)
        queue = retry
        decode.step()
        for rid, p, sp in cases:
            aid = router.attempt.get(rid)
            last = col.last(aid) if aid else None
            if isinstance(last, PreemptedEvent):
                assert list(last.output_token_ids) == router.tokens(rid)
                router.outputs[rid] = list(last.output_token_ids)
                del router.attempt[rid]  # this attempt is over
                queue.append((rid, p, sp))
    assert decode.stats().num_preemptions > 0
    for rid, _, _ in cases:
        assert router.tokens(rid) == expected[rid], rid
        last = col.last(router.attempt[rid])
        assert isinstance(last, FinishedEvent) and last.num_output_tokens == 22
    assert decode.kv.num_free_blocks == decode.kv.num_blocks
    decode.check_integrity()
    prefill.check_integrity()


def test_abort_at_each_stage_frees_everything(make_pair: PairFactory) -> None:
    prefill, decode = make_pair()
    col = Collector()
    router = MiniRouter(prefill, decode, col)
    assert decode.receiver is not None
    # 1. Waiting for KV: the reservation is cancelled; the late KV is received and dropped.
    acc = decode.add_request(DecodeRequest("w", prompt(1, 9), greedy(5)), col.sink("w"))
    assert decode.stats().num_waiting_for_kv == 1
    assert decode.abort("w") and not decode.abort("w")
    assert col.last("w") == ErrorEvent(CANCELLED, "aborted")
    fut = prefill.add_request(
        PrefillRequest(
            "w", prompt(1, 9), greedy(5), target=KVTarget(acc.transfer_id, acc.kv_endpoint)
        )
    )
    prefill.run_until_idle()
    with pytest.raises(EngineError, match="dropped"):
        fut.result(0)
    assert decode.receiver.stats().reservations_cancelled == 1
    # 2. Running.
    fut = router.place("r", prompt(2, 9), greedy(30))
    prefill.run_until_idle()
    fut.result(0)
    for _ in range(3):
        decode.step()
    aid = router.attempt["r"]
    assert len(col.tokens(aid)) == 3  # admitted at the first step boundary, one token a step
    assert decode.abort(aid) and not decode.abort(aid)
    # 3. Just finished (token 1 from P already reaches max_tokens).
    fut = router.place("f", prompt(3, 9), greedy(1))
    prefill.run_until_idle()
    decode.step()
    last = col.last(router.attempt["f"])
    assert last == FinishedEvent("length", 1)
    assert not decode.abort(router.attempt["f"])
    assert decode.num_live == 0 and decode.kv.num_free_blocks == decode.kv.num_blocks
    decode.check_integrity()
    prefill.check_integrity()


def test_reservation_freed_when_kv_never_arrives(make_pair: PairFactory) -> None:
    _, decode = make_pair()
    col = Collector()
    decode.start()
    t0 = time.monotonic()
    decode.add_request(
        DecodeRequest("lost", prompt(1, 9), greedy(5), kv_timeout_s=0.2), col.sink("lost")
    )
    decode.add_request(
        DecodeRequest("dl", prompt(2, 9), greedy(5), deadline=time.time() + 0.3), col.sink("dl")
    )
    col.wait(["lost", "dl"], timeout_s=5)
    assert time.monotonic() - t0 < 2
    for rid in ("lost", "dl"):
        ev = col.last(rid)
        assert isinstance(ev, ErrorEvent) and ev.code == DEADLINE_EXCEEDED, ev
    assert decode.kv.num_free_blocks == decode.kv.num_blocks
    decode.check_integrity()


def test_remote_sequences_waiting_for_a_slot_count_as_waiting(make_pair: PairFactory) -> None:
    """GetStats' num_waiting (the router's load view) counts sequences whose KV arrived but which
    wait for a batch slot, not only local prefills."""
    prefill, decode = make_pair(max_num_seqs=1)
    col = Collector()
    router = MiniRouter(prefill, decode, col)
    futs = [router.place(rid, prompt(i, 9), greedy(8)) for i, rid in enumerate("ab")]
    prefill.run_until_idle()
    for fut in futs:
        fut.result(0)
    assert decode.stats().num_waiting_for_kv == 2  # KV landed; the notices are not applied yet
    decode.step()  # applies both arrivals: one runs (max_num_seqs=1), the other waits
    s = decode.stats()
    assert (s.num_running, s.num_waiting, s.num_waiting_for_kv) == (1, 1, 0)
    decode.run_until_idle()
    assert decode.stats().num_waiting == 0 and decode.num_live == 0
