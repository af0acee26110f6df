"""PrefillEngine KV hand-off over the loopback transport (issue 4 acceptance).

A loopback receiver with its own KVPool plays the decode worker: it reserves blocks per request,
the engine sends token 1 + the prompt's KV, and the test compares what arrived against the
one-shot runner.
"""

from __future__ import annotations

import time

import pytest
import torch
from prefill_tiny import TINY, OneShot, prompt, tiny_config

from kv_transfer import make_receiver
from kv_transfer.base import KVLayout, KVReceiver, TransferResult
from pdserve.engine.errors import ABORTED, EngineError
from pdserve.kv_cache.pool import KVPool
from pdserve.sampling_params import SamplingParams
from prefill_worker.engine import PrefillEngine
from prefill_worker.request import KVTarget, PrefillRequest

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams(temperature=0, logprobs=True)
ATOL = 1e-4  # fp32; chunked and one-shot attention differ only by summation order


class Decode:
    """The receiving side: a pool of its own and block reservations, like a decode worker."""

    def __init__(self, engine: PrefillEngine, num_blocks: int = 512) -> None:
        src = engine.runner.kv_pool
        self.pool = KVPool(
            src.num_layers, num_blocks, src.block_size, src.num_kv_heads, src.head_dim, src.dtype
        )
        layout = KVLayout.from_pool(src, TINY.model_id)
        self.receiver: KVReceiver = make_receiver(engine.config.transfer, self.pool, layout)
        self.next_block = num_blocks - 1
        self.next_id = 100

    def reserve(self, num_tokens: int) -> tuple[KVTarget, list[int], object]:
        """Reserve blocks (descending ids: non-contiguous with the sender's) for one prompt."""
        nb = -(-num_tokens // 16)
        blocks = list(range(self.next_block, self.next_block - nb, -1))
        self.next_block -= nb
        self.next_id += 1
        fut = self.receiver.expect(self.next_id, blocks, time.time() + 60)
        return KVTarget(self.next_id, self.receiver.endpoint, "decode-0"), blocks, fut


def _engine(**kw: int) -> PrefillEngine:
    return PrefillEngine.build(tiny_config(**kw), model_config=TINY)


def test_mixed_prompts_kv_and_token1_match_one_shot(one_shot: OneShot) -> None:
    eng = _engine(max_num_batched_tokens=256)
    dec = Decode(eng)
    lens = [5, 1500, 40, 300, 17, 700, 256, 90]
    prompts = [prompt(n, seed=i) for i, n in enumerate(lens)]
    jobs = []
    for i, p in enumerate(prompts):
        target, blocks, recv = dec.reserve(len(p))
        fut = eng.add_request(PrefillRequest(f"r{i}", p, GREEDY, target=target))
        jobs.append((p, blocks, recv, fut))
    eng.run_until_idle()
    for p, blocks, recv, fut in jobs:
        res = fut.result(0)
        got: TransferResult = recv.result(10)  # type: ignore[attr-defined]
        ref_tok, ref_kv = one_shot.run(p, GREEDY)
        assert res.token.token_id == ref_tok.token_id == got.first_token
        assert got.first_logprob == pytest.approx(ref_tok.logprob, abs=1e-4)
        assert got.num_tokens == len(p)
        torch.testing.assert_close(dec.pool.gather(blocks, len(p)), ref_kv, atol=ATOL, rtol=0)
        assert res.transfer is not None and res.transfer.outcome.value == "ok"
        assert res.transfer.bytes == len(p) * eng.runner.kv_pool.bytes_per_token()
        assert res.transfer_ms >= 0
    eng.check_integrity()
    st = eng.stats()
    assert st.num_prefills == 8 and st.transfer_failures == 0
    assert st.transfer_bytes == sum(lens) * eng.runner.kv_pool.bytes_per_token()
    # Sent requests keep their full blocks as evictable prefix cache.
    assert st.kv_blocks_used == 0 and st.kv_blocks_cached == sum(n // 16 for n in lens)
    eng.shutdown()


def test_prefix_cached_request_sends_the_same_kv_as_uncached(one_shot: OneShot) -> None:
    eng = _engine()
    dec = Decode(eng)
    system = prompt(64, seed=200)
    first, second = system + prompt(20, seed=201), system + prompt(37, seed=202)
    t1, _, _ = dec.reserve(len(first))
    f1 = eng.add_request(PrefillRequest("a", first, GREEDY, target=t1))
    eng.run_until_idle()
    t2, blocks, recv = dec.reserve(len(second))
    f2 = eng.add_request(PrefillRequest("b", second, GREEDY, target=t2))
    assert eng.step() == len(second) - 64
    eng.run_until_idle()
    assert f1.result(0).cached_tokens == 0 and f2.result(0).cached_tokens == 64
    recv.result(10)  # type: ignore[attr-defined]
    ref_tok, ref_kv = one_shot.run(second, GREEDY)
    assert f2.result(0).token.token_id == ref_tok.token_id
    torch.testing.assert_close(dec.pool.gather(blocks, len(second)), ref_kv, atol=ATOL, rtol=0)
    assert eng.stats().prefix_cache_hit_rate == pytest.approx(64 / (len(first) + len(second)))
    eng.shutdown()


def test_send_without_a_reservation_fails_and_frees_blocks() -> None:
    eng = _engine()
    dec = Decode(eng)
    f = eng.add_request(
        PrefillRequest("x", prompt(40, seed=1), GREEDY, target=KVTarget(999, dec.receiver.endpoint))
    )
    eng.run_until_idle()
    with pytest.raises(EngineError) as e:
        f.result(0)
    assert e.value.code == ABORTED and "dropped" in e.value.message
    assert eng.stats().transfer_failures == 1
    eng.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    # An unreachable endpoint fails the same way; the engine keeps serving.
    g = eng.add_request(
        PrefillRequest("y", prompt(40, seed=2), GREEDY, target=KVTarget(5, "loopback:999999"))
    )
    eng.run_until_idle()
    assert g.exception(0).code == ABORTED  # type: ignore[union-attr]
    target, _, recv = dec.reserve(30)
    ok = eng.add_request(PrefillRequest("z", prompt(30, seed=3), GREEDY, target=target))
    eng.run_until_idle()
    assert ok.result(0).token.token_id == recv.result(10).first_token  # type: ignore[attr-defined]
    eng.shutdown()
