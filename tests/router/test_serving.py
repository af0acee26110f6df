"""Router core: validation, admission, n sequences, detokenization and stop strings."""

from __future__ import annotations

import asyncio
import time

import pytest
from fake_workers import EOS, FakeCluster, start_fake_cluster

from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer
from router.background import drain_background
from router.errors import BadRequest, ContextLengthExceeded, Overloaded
from router.lifecycle import LifecycleConfig
from router.serving import ChoiceDelta, Router, RouterConfig

pytestmark = pytest.mark.timeout(60)

ANSWER = " Paris is the capital of France."


def make_router(cluster: FakeCluster, tokenizer: Tokenizer, **cfg: object) -> Router:
    config = RouterConfig(
        model_name="smollm2",
        max_model_len=int(cfg.pop("max_model_len", 256)),  # type: ignore[call-overload]
        lifecycle=LifecycleConfig(),
        **cfg,  # type: ignore[arg-type]
    )
    return Router(config, tokenizer, cluster.pool)


async def scripted(tokenizer: Tokenizer, text: str = ANSWER, **decode: object) -> FakeCluster:
    script = tokenizer.encode(text, add_special_tokens=False) + [EOS]
    return await start_fake_cluster(
        prefills=[{"script": script}], decodes=[{"script": script, **decode}]
    )


async def drain(stream) -> list[ChoiceDelta]:  # type: ignore[no-untyped-def]
    return [d async for d in stream]


async def wait_free(cluster: FakeCluster, timeout_s: float = 2.0) -> None:
    end = time.monotonic() + timeout_s
    while any(d.held for d in cluster.decodes):
        assert time.monotonic() < end, "decode workers still hold KV"
        await asyncio.sleep(0.01)


async def test_text_is_detokenized_and_eos_text_is_hidden(tokenizer: Tokenizer) -> None:
    c = await scripted(tokenizer)
    try:
        router = make_router(c, tokenizer)
        prompt = tokenizer.encode("Capital of France?")
        stream = router.submit("r1", prompt, SamplingParams(temperature=0, max_tokens=None))
        deltas = await drain(stream)
        assert "".join(d.text for d in deltas) == ANSWER
        # the EOS token rides in the finish (no empty token delta before it); its text is hidden
        assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason is None
        assert [t.token_id for t in deltas[-1].tokens] == [EOS] and deltas[-1].text == ""
        assert all(len(d.tokens) == 1 for d in deltas)  # one token per delta
        n_script = len(tokenizer.encode(ANSWER, add_special_tokens=False)) + 1
        assert stream.completion_tokens == n_script
        # max_tokens None = rest of the context; EOS ids were added to the stop ids
        (req,) = c.decodes[0].requests
        assert req.sampling.max_tokens == 256 - len(prompt)
        assert list(req.sampling.stop_token_ids) == list(tokenizer.eos_token_ids)
    finally:
        await c.close()


async def test_ignore_eos_does_not_add_eos_stop_ids(tokenizer: Tokenizer) -> None:
    c = await scripted(tokenizer)
    try:
        router = make_router(c, tokenizer)
        s = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        await drain(router.submit("r1", [1, 2, 3], s))
        assert list(c.decodes[0].requests[0].sampling.stop_token_ids) == []
    finally:
        await c.close()


async def test_stop_string_truncates_and_aborts_the_workers(tokenizer: Tokenizer) -> None:
    c = await scripted(tokenizer, step_s=0.01)
    try:
        router = make_router(c, tokenizer)
        s = SamplingParams(temperature=0, max_tokens=50, stop=("capital",))
        deltas = await drain(router.submit("r1", [1, 2, 3], s))
        assert "".join(d.text for d in deltas) == " Paris is the "
        assert deltas[-1].finish_reason == "stop"
        await wait_free(c)
        await drain_background()
        assert "r1" in c.decodes[0].aborted
    finally:
        await c.close()


async def test_n_sequences_get_distinct_seeds_and_indices(tokenizer: Tokenizer) -> None:
    c = await scripted(tokenizer)
    try:
        router = make_router(c, tokenizer)
        s = SamplingParams(temperature=0.8, max_tokens=4, n=3, seed=41)
        deltas = await drain(router.submit("r1", [1, 2, 3], s))
        finals = sorted(d.index for d in deltas if d.finish_reason)
        assert finals == [0, 1, 2]
        seeds = sorted(r.sampling.seed for r in c.decodes[0].requests)
        assert seeds == [41, 42, 43]
        assert sorted(r.request_id for r in c.decodes[0].requests) == ["r1-0", "r1-1", "r1-2"]
    finally:
        await c.close()


async def test_context_length_is_checked_with_counts_and_limit(tokenizer: Tokenizer) -> None:
    c = await scripted(tokenizer)
    try:
        router = make_router(c, tokenizer, max_model_len=16)
        with pytest.raises(ContextLengthExceeded) as e:
            router.submit("r1", list(range(10, 20)), SamplingParams(max_tokens=10))
        assert "10 tokens" in e.value.message and "16" in e.value.message
        assert e.value.status == 400 and e.value.param == "max_tokens"
        with pytest.raises(ContextLengthExceeded, match="maximum context length"):
            router.submit("r2", list(range(10, 26)), SamplingParams(max_tokens=None))
    finally:
        await c.close()


async def test_bad_token_ids_and_n_are_rejected(tokenizer: Tokenizer) -> None:
    c = await scripted(tokenizer)
    try:
        router = make_router(c, tokenizer, max_n=4)
        with pytest.raises(BadRequest, match="outside the vocabulary"):
            router.submit("r1", [1, 10**6], SamplingParams())
        with pytest.raises(BadRequest, match="'n' must be <= 4"):
            router.submit("r1", [1, 2], SamplingParams(n=5))
    finally:
        await c.close()


async def test_admission_refuses_with_retry_after_then_recovers(tokenizer: Tokenizer) -> None:
    c = await scripted(tokenizer, accept_delay_s=0.2)
    try:
        router = make_router(c, tokenizer, max_queued_requests=1)
        first = router.submit("r1", [1, 2, 3], SamplingParams(max_tokens=2))
        task = asyncio.ensure_future(drain(first))
        with pytest.raises(Overloaded) as e:
            router.submit("r2", [1, 2, 3], SamplingParams(max_tokens=2))
        assert e.value.status == 429 and e.value.retry_after_s and e.value.retry_after_s >= 1
        await task
        await drain(router.submit("r3", [1, 2, 3], SamplingParams(max_tokens=2)))
        assert router.admission.num_queued == 0 and router.admission.queued_tokens == 0
    finally:
        await c.close()


async def test_closing_a_stream_early_aborts_every_sequence(tokenizer: Tokenizer) -> None:
    c = await start_fake_cluster(decodes=[{"step_s": 0.02}])
    try:
        router = make_router(c, tokenizer)
        stream = router.submit("r1", [1, 2, 3], SamplingParams(max_tokens=200, n=2))
        got = 0
        async for _ in stream:
            got += 1
            if got == 6:
                break
        await stream.aclose()
        await wait_free(c)
        assert router.admission.num_queued == 0
    finally:
        await c.close()


async def test_close_ends_sequences_even_when_a_cancellation_is_lost(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QA L2: closing an n=2 stream ends both sequences, even one whose cancellation is lost
    (Python 3.11's ``asyncio.wait_for`` swallows a cancel that races a completed read)."""
    import router.serving as serving
    from pdserve.types import SampledToken
    from router.lifecycle import RequestLifecycle

    closed: list[str] = []

    class SwallowsCancel(RequestLifecycle):
        async def run(self):  # type: ignore[no-untyped-def,override]
            try:
                for i in range(1000):
                    try:
                        await asyncio.sleep(0.005)
                    except asyncio.CancelledError:
                        pass  # the lost cancellation
                    self.output.append(SampledToken(token_id=1000 + i))
                    yield self.output[-1]
            finally:
                closed.append(self.request_id)

    monkeypatch.setattr(serving, "RequestLifecycle", SwallowsCancel)
    cluster = await scripted(tokenizer)
    try:
        router = make_router(cluster, tokenizer)
        stream = router.submit("r", [1, 2, 3], SamplingParams(max_tokens=200, n=2))
        it = aiter(stream)
        for _ in range(4):
            await anext(it)
        await asyncio.wait_for(stream.aclose(), 1.0)
        assert sorted(closed) == ["r-0", "r-1"]
        assert all(t.done() for t in stream._tasks)
        assert max(len(lc.output) for lc in stream.lifecycles) < 50
        assert router.admission.num_queued == 0
    finally:
        await cluster.close()


async def test_tokens_of_a_request_past_its_deadline_are_counted(tokenizer: Tokenizer) -> None:
    """QA metrics: tokens streamed before a deadline hit count in generation_tokens_total."""
    from pdserve import metrics
    from router.errors import RequestTimeout

    cluster = await start_fake_cluster(decodes=[{"step_s": 0.02}])
    try:
        router = make_router(cluster, tokenizer, request_timeout_s=0.3)
        before = metrics.GENERATION_TOKENS._value.get()
        stream = router.submit("r", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
        seen = 0
        with pytest.raises(RequestTimeout):
            async for d in stream:
                seen += len(d.tokens)
        assert seen > 0 and metrics.GENERATION_TOKENS._value.get() - before == seen
    finally:
        await cluster.close()
