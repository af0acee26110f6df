"""PrefillEngine: the prefill worker's core, plain Python (no Ray, no gRPC).

One step = schedule prompt chunks (``PrefillScheduler``), run them as one forward
(``ModelRunner.execute``: KV written into the paged pool, token 1 sampled for finished prompts),
register newly full blocks in the prefix cache, and start the KV hand-off of every finished
prompt (gather its blocks into ``[layers, 2, tokens, kv_heads, head_dim]``, ``KVSender.send``).
When a send completes the request's blocks are freed; they stay in the pool as evictable prefix
cache. See ``prefill_worker/request.py`` for the per-request state machine.

Threading: every engine mutation (add, abort, schedule, post-processing, send completions)
happens under one re-entrant lock; the forward runs outside it, so ``add_request``/``abort``
from other threads (the gRPC event loop) never wait for a forward. ``start()`` runs the step
loop in one background thread (the model's matmuls release the GIL); tests may instead call
``step()`` themselves. Callers wait on the ``concurrent.futures.Future`` ``add_request`` returns.

NOTE: an abort during a forward frees the request's blocks while the forward may still write
into them. That is safe: new blocks are only handed out by ``schedule()`` on the step thread,
after the forward returns, and a forward only writes blocks that are not yet prefix-cached.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kv_transfer.base import KVSender, TransferOutcome, TransferRecord
from pdserve.config import EngineConfig, ModelConfig
from pdserve.kv_cache.manager import KVCacheManager
from pdserve.sampling_params import SamplingError
from pdserve.structured.grammar import resume_matcher
from pdserve.structured.spec import StructuredOutputError
from pdserve.types import SampledToken
from prefill_worker.request import (
    ALREADY_EXISTS,
    CANCELLED,
    DEADLINE_EXCEEDED,
    INTERNAL,
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    PrefillError,
    PrefillRequest,
    PrefillResult,
    PrefillState,
)
from prefill_worker.scheduler import PrefillScheduler, PrefillSeq

if TYPE_CHECKING:
    from pdserve.engine.runner import ModelRunner

logger = logging.getLogger(__name__)

_RATE_WINDOW_S = 10.0  # window of the prompt tokens/s statistic, seconds


@dataclass(frozen=True)
class PrefillEngineStats:
    """A snapshot for ``GetStats`` and metrics. Counts in requests/tokens/blocks/bytes."""

    num_waiting: int
    num_queued_tokens: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_cached: int
    prefix_cache_hit_rate: float  # hit tokens / queried prompt tokens since start, 0..1
    prompt_tokens_per_s: float  # computed prompt tokens per second over the last 10 s
    num_prefills: int
    transfer_bytes: int
    transfer_failures: int


@dataclass(eq=False)
class _Pending:
    """Engine-side state of one live request (the future its caller waits on)."""

    seq: PrefillSeq
    future: Future[PrefillResult]
    token: SampledToken | None = None
    sampled_at: float = 0.0  # time.monotonic() seconds
    prompt_logprobs: list[SampledToken] = field(default_factory=list)
    send_started: float = 0.0


@dataclass
class _Counters:
    num_prefills: int = 0
    transfer_bytes: int = 0
    transfer_failures: int = 0
    steps: deque[tuple[float, int]] = field(default_factory=deque)  # (end time, tokens)


class PrefillEngine:
    """Chunked, batched prefill with automatic prefix caching and KV hand-off.

    ``runner``: the ModelRunner (weights, KV pool, sampler). ``sender``: the KV transport; may be
    None when every request has ``target=None`` (KV kept as prefix cache only).
    """

    def __init__(
        self, config: EngineConfig, runner: ModelRunner, sender: KVSender | None = None
    ) -> None:
        self.config = config
        self.runner = runner
        self.sender = sender
        self.kv = KVCacheManager(
            runner.num_blocks, runner.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = PrefillScheduler(config.scheduler, self.kv)
        mc = runner.model_config
        self.max_model_len = min(config.scheduler.max_model_len, mc.max_position_embeddings)
        self._lock = threading.RLock()
        self._pending: dict[str, _Pending] = {}
        self._completions: queue.SimpleQueue[tuple[_Pending, Future[TransferRecord]]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._counters = _Counters()
        self._started_at = time.monotonic()
        self._owns_sender = False
        self._closed = False

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        model_config: ModelConfig | None = None,
        sender: KVSender | None = None,
    ) -> PrefillEngine:
        """Load the model per ``config.load`` (``model_config`` for dummy weights) and wrap it.

        Without ``sender``, builds one of ``config.transfer.backend`` for this pool's KV layout;
        the engine then owns it and closes it in :meth:`shutdown`.
        """
        from kv_transfer import make_sender
        from kv_transfer.base import KVLayout
        from pdserve.engine.runner import ModelRunner

        runner = ModelRunner(config, model_config)
        if sender is not None:
            return cls(config, runner, sender)
        layout = KVLayout.from_pool(runner.kv_pool, runner.model_config.model_id)
        engine = cls(config, runner, make_sender(config.transfer, layout, device=runner.device))
        engine._owns_sender = True
        return engine

    # ----------------------------------------------------------------------------- requests
    def add_request(self, request: PrefillRequest) -> Future[PrefillResult]:
        """Validate and queue a prefill. Returns a future resolving to a PrefillResult, or failing
        with PrefillError (CANCELLED on abort, DEADLINE_EXCEEDED, UNAVAILABLE when the KV send
        fails, INTERNAL when the forward raised).

        Raises PrefillError at once: INVALID_ARGUMENT (empty prompt, a token id outside the
        vocabulary, a prompt leaving no room for one output token under the model limit, bad
        ``num_output_tokens``, a stop token id outside the vocabulary), RESOURCE_EXHAUSTED (the
        prompt needs more KV blocks than the pool has), ALREADY_EXISTS (id in use), UNAVAILABLE
        (a target but no KV sender, or the engine was shut down), DEADLINE_EXCEEDED (deadline
        already past).
        """
        if self._closed:
            raise PrefillError(UNAVAILABLE, "prefill worker is shutting down")
        self._validate(request)
        try:  # the state token 1 is sampled under (advanced over a re-prefill's earlier output)
            grammar = resume_matcher(self.config.load.model, self.runner.model_config,
                                     request.sampling.structured, request.prompt_token_ids,
                                     request.num_output_tokens)  # fmt: skip
        except StructuredOutputError as e:
            raise PrefillError(INVALID_ARGUMENT, str(e)) from None
        fut: Future[PrefillResult] = Future()
        fut.set_running_or_notify_cancel()
        with self._lock:
            if request.request_id in self._pending:
                raise PrefillError(
                    ALREADY_EXISTS, f"request {request.request_id!r} is already being prefilled"
                )
            seq = PrefillSeq(request, grammar=grammar)
            self.scheduler.add(seq)
            self._pending[request.request_id] = _Pending(seq, fut)
        self._wake.set()
        return fut

    def _validate(self, request: PrefillRequest) -> None:
        tokens = request.prompt_token_ids
        n = len(tokens)
        if n == 0:
            raise PrefillError(INVALID_ARGUMENT, "prompt_token_ids is empty")
        vocab = self.runner.model_config.vocab_size
        lo, hi = min(tokens), max(tokens)
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise PrefillError(
                INVALID_ARGUMENT,
                f"prompt_token_ids contains {bad}, outside the vocabulary [0, {vocab})",
            )
        if n >= self.max_model_len:
            raise PrefillError(
                INVALID_ARGUMENT,
                f"prompt has {n} tokens; the model limit is {self.max_model_len} tokens "
                f"(max_model_len), so at most {self.max_model_len - 1} prompt tokens fit",
            )
        k = request.num_output_tokens
        if not 0 <= k < n:
            raise PrefillError(
                INVALID_ARGUMENT, f"num_output_tokens must be in [0, {n}) for {n} tokens, got {k}"
            )
        max_tokens = request.sampling.max_tokens
        if max_tokens is not None and k >= max_tokens:
            raise PrefillError(
                INVALID_ARGUMENT,
                f"num_output_tokens ({k}) already reaches max_tokens ({max_tokens})",
            )
        try:
            self.runner.sampler.check(request.sampling)
        except SamplingError as e:
            raise PrefillError(INVALID_ARGUMENT, str(e)) from None
        need = self.kv.num_blocks_needed(n)
        if need > self.kv.num_blocks:
            raise PrefillError(
                RESOURCE_EXHAUSTED,
                f"prompt of {n} tokens needs {need} KV blocks; this worker has {self.kv.num_blocks}",
            )
        if request.target is not None and self.sender is None:
            raise PrefillError(UNAVAILABLE, "this prefill worker has no KV sender configured")
        if request.deadline is not None and request.deadline <= time.time():
            raise PrefillError(DEADLINE_EXCEEDED, "request deadline already passed")

    def abort(self, request_id: str) -> bool:
        """Drop a request at any stage, freeing everything it holds; its future fails with
        CANCELLED. Idempotent: returns whether the request was live."""
        return self._fail(request_id, PrefillError(CANCELLED, f"request {request_id!r} aborted"))

    def _fail(self, request_id: str, error: PrefillError) -> bool:
        with self._lock:
            p = self._pending.pop(request_id, None)
            if p is None:
                return False
            self.scheduler.remove(request_id)
        if not p.future.done():
            p.future.set_exception(error)
        return True

    # ----------------------------------------------------------------------------- the step
    def has_work(self) -> bool:
        """True while any request is queued, computing or sending."""
        with self._lock:
            return bool(self._pending)

    def step(self) -> int:
        """Run one engine step. Returns the number of prompt tokens computed (0 when idle)."""
        with self._lock:
            self._drain_completions()
            self._expire_deadlines()
            chunks = self.scheduler.schedule()
        if not chunks:
            return 0
        try:
            out = self.runner.run([c.batch for c in chunks])
        except Exception as e:  # the worker keeps serving the others
            logger.exception("prefill forward failed")
            for c in chunks:
                self._fail(c.seq.request_id, PrefillError(INTERNAL, f"prefill forward failed: {e}"))
            return 0
        now = time.monotonic()
        num = sum(len(c.batch.token_ids) for c in chunks)
        with self._lock:
            self._counters.steps.append((now, num))
            for rid, lps in out.prompt_logprobs.items():
                if rid in self._pending:
                    self._pending[rid].prompt_logprobs.extend(lps.tokens)
            sampled = {
                c.seq.request_id: t
                for c, t in zip(chunks, out.tokens, strict=True)
                if t is not None
            }
            for seq in self.scheduler.on_computed(chunks):
                self._hand_off(seq, sampled[seq.request_id], now)
        return num

    def _hand_off(self, seq: PrefillSeq, token: SampledToken, now: float) -> None:
        """Token 1 is sampled: gather the KV and send it (or finish at once without a target)."""
        p = self._pending[seq.request_id]
        p.token, p.sampled_at = token, now
        target = seq.request.target
        if target is None:
            self._complete(p, None)
            return
        assert self.sender is not None  # checked in _validate
        table = self.kv.block_table(seq.request_id)
        kv = self.runner.kv_pool.gather(table, seq.num_tokens)  # [L, 2, T, H, D], a copy
        p.send_started = time.monotonic()
        try:
            fut = self.sender.send(
                target.kv_endpoint, target.transfer_id, kv, token.token_id, token.logprob
            )
        except Exception as e:
            self._counters.transfer_failures += 1
            self._fail(seq.request_id, PrefillError(UNAVAILABLE, f"KV send failed: {e}"))
            return

        def done(f: Future[TransferRecord], p: _Pending = p) -> None:
            self._completions.put((p, f))
            self._wake.set()

        fut.add_done_callback(done)

    def _drain_completions(self) -> None:
        while True:
            try:
                p, f = self._completions.get_nowait()
            except queue.Empty:
                return
            rid = p.seq.request_id
            if self._pending.get(rid) is not p:
                continue  # aborted while sending; its blocks are already free
            exc = f.exception()
            if exc is not None:
                self._counters.transfer_failures += 1
                self._fail(rid, PrefillError(UNAVAILABLE, f"KV transfer failed: {exc}"))
                continue
            record = f.result()
            if record.outcome is not TransferOutcome.OK:
                # 'dropped': the decode worker held no reservation (it gave the request up).
                self._counters.transfer_failures += 1
                reason = f": {record.error}" if record.error else ""
                self._fail(
                    rid, PrefillError(UNAVAILABLE, f"KV transfer {record.outcome.value}{reason}")
                )
                continue
            self._counters.transfer_bytes += int(record.bytes)
            self._complete(p, record)

    def _complete(self, p: _Pending, record: TransferRecord | None) -> None:
        """Resolve the request's future and free its blocks (kept as prefix cache)."""
        seq = p.seq
        assert p.token is not None and seq.first_scheduled is not None
        end = time.monotonic()
        result = PrefillResult(
            request_id=seq.request_id,
            token=p.token,
            num_prompt_tokens=seq.num_tokens,
            cached_tokens=seq.num_cached,
            queue_ms=(seq.first_scheduled - seq.arrival) * 1e3,
            compute_ms=(p.sampled_at - seq.first_scheduled) * 1e3,
            transfer_ms=(end - p.send_started) * 1e3 if record is not None else 0.0,
            transfer=record,
            prompt_logprobs=tuple(p.prompt_logprobs),
        )
        del self._pending[seq.request_id]
        self.scheduler.finish(seq.request_id)
        self._counters.num_prefills += 1
        p.future.set_result(result)

    def _expire_deadlines(self) -> None:
        now = time.time()
        for rid, p in list(self._pending.items()):
            d = p.seq.request.deadline
            if d is not None and d <= now:
                self._fail(rid, PrefillError(DEADLINE_EXCEEDED, f"request {rid!r} deadline passed"))

    # ----------------------------------------------------------------------------- the loop
    def start(self) -> None:
        """Run the step loop in a background daemon thread (idempotent)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="prefill-engine", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        """True while the background step loop thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                computed = self.step()
            except Exception as e:  # a bug: fail what is live, keep serving new requests
                logger.exception("prefill engine step failed")
                for rid in list(self._pending):
                    self._fail(rid, PrefillError(INTERNAL, f"prefill engine step failed: {e}"))
                computed = 0
            if computed == 0:
                # Idle or only sends in flight: sleep until a request, an abort or a send
                # completion arrives (or 50 ms pass, to expire deadlines).
                self._wake.wait(0.05)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the loop thread, fail every live request with UNAVAILABLE, and close the KV
        sender when the engine built it."""
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for rid in list(self._pending):
            self._fail(rid, PrefillError(UNAVAILABLE, "prefill worker shutting down"))
        if self._owns_sender and self.sender is not None:
            self.sender.close()
            self._owns_sender = False

    def run_until_idle(self, timeout: float = 60.0) -> None:
        """Step until no request is live (for tests and offline use, without ``start()``).
        Raises TimeoutError after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while self.has_work():
            if time.monotonic() > end:
                raise TimeoutError(f"prefill engine still busy after {timeout} s")
            self._wake.clear()
            if self.step() == 0 and self.has_work():
                self._wake.wait(0.01)

    # ----------------------------------------------------------------------------- stats
    def stats(self) -> PrefillEngineStats:
        """A consistent snapshot of queue, KV and throughput statistics."""
        with self._lock:
            now = time.monotonic()
            steps = self._counters.steps
            while steps and steps[0][0] < now - _RATE_WINDOW_S:
                steps.popleft()
            span = min(_RATE_WINDOW_S, max(now - self._started_at, 1e-3))
            queries, hits = self.kv.prefix_cache_stats
            pool = self.kv.block_pool
            return PrefillEngineStats(
                num_waiting=self.scheduler.num_waiting,
                num_queued_tokens=self.scheduler.num_queued_tokens,
                num_running=self.scheduler.num_running,
                kv_blocks_used=pool.num_blocks - pool.num_free_blocks,
                kv_blocks_total=pool.num_blocks,
                kv_blocks_cached=pool.num_cached_blocks,
                prefix_cache_hit_rate=hits / queries if queries else 0.0,
                prompt_tokens_per_s=sum(n for _, n in steps) / span,
                num_prefills=self._counters.num_prefills,
                transfer_bytes=self._counters.transfer_bytes,
                transfer_failures=self._counters.transfer_failures,
            )

    def request_state(self, request_id: str) -> PrefillState | None:
        """Where a live request is, or None when it is not live."""
        with self._lock:
            p = self._pending.get(request_id)
            return p.seq.state if p is not None else None

    def check_integrity(self) -> None:
        """Assert engine, scheduler and KV bookkeeping agree. Raises AssertionError."""
        with self._lock:
            live = self.scheduler.num_waiting + self.scheduler.num_running
            if (
                any(rid not in self.scheduler for rid in self._pending)
                or len(self._pending) != live
            ):
                raise AssertionError("engine requests disagree with the scheduler")
            self.scheduler.check_integrity()
