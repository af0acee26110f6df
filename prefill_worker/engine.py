"""PrefillEngine: the prefill worker's core, plain Python (no Ray, no gRPC).

One step = schedule prompt chunks (``PrefillScheduler``), run them as one forward
(``ModelRunner.run``: KV written into the paged pool, token 1 sampled for finished prompts),
register newly full blocks in the prefix cache, and start the KV hand-off of every finished
prompt (gather its blocks into ``[layers, 2, tokens, kv_heads, head_dim]``, ``KVSender.send``).
When a send completes the request's blocks are freed; they stay in the pool as evictable prefix
cache. See ``prefill_worker/request.py`` for the per-request state machine.

The step loop, lock and shutdown come from :class:`~pdserve.engine.worker_engine.WorkerEngine`.
Callers wait on the ``concurrent.futures.Future`` ``add_request`` returns. Send completions
arrive on the sender's threads, which apply them at once under the engine lock (held only for
bookkeeping, never across a forward), so a request's result goes out when its KV is acked, not
after the forward that was running meanwhile (which on a CPU can take seconds). NOTE: the sender
resolves transfer futures holding none of its own locks, and the engine calls the sender only for
``send`` (non-blocking) under its lock, so the two locks cannot deadlock.

NOTE: an abort during a forward frees the request's blocks while the forward may still write
into them. That is safe: new blocks are only handed out by ``schedule()`` on the step thread,
after the forward returns, and a forward only writes blocks that are not yet prefix-cached.
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kv_transfer.base import KVSender, TransferOutcome, TransferRecord
from pdserve.config import EngineConfig, ModelConfig, prefill_step_budget
from pdserve.engine.errors import (
    ABORTED,
    ALREADY_EXISTS,
    CANCELLED,
    DEADLINE_EXCEEDED,
    INTERNAL,
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    EngineError,
)
from pdserve.engine.faults import FaultInjector, FaultPhase
from pdserve.engine.worker_engine import WorkerEngine
from pdserve.structured.grammar import resume_matcher
from pdserve.structured.spec import StructuredOutputError
from pdserve.types import SampledToken
from prefill_worker.request import PrefillRequest, PrefillResult, PrefillState
from prefill_worker.scheduler import PrefillScheduler, PrefillSeq

if TYPE_CHECKING:
    from pdserve.engine.runner import ModelRunner

logger = logging.getLogger(__name__)


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
    step_time_ms: float = 0.0  # mean forward time per step over the last 10 s, ms
    batch_size: float = 0.0  # mean prompt chunks per step over the last 10 s
    prompt_tokens_computed: int = 0  # prompt tokens computed since start
    long_prefill_token_threshold: int = 0  # the scheduler's class bound (0 = one class)
    num_queued_short_tokens: int = 0  # of num_queued_tokens, those of short prompts


@dataclass(eq=False)
class _Pending:
    """Engine-side state of one live request (the future its caller waits on)."""

    seq: PrefillSeq
    future: Future[PrefillResult]
    token: SampledToken | None = None
    sampled_at: float = 0.0  # time.monotonic() seconds
    prompt_logprobs: list[SampledToken] = field(default_factory=list)
    send_started: float = 0.0
    transfer: Future[TransferRecord] | None = None  # the KV send, once handed to the sender


class PrefillEngine(WorkerEngine):
    """Chunked, batched prefill with automatic prefix caching and KV hand-off.

    ``runner``: the ModelRunner (weights, KV pool, sampler). ``sender``: the KV transport; may be
    None when every request has ``target=None`` (KV kept as prefix cache only).
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        sender: KVSender | None = None,
        *,
        name: str = "prefill",
        faults: FaultInjector | None = None,
    ) -> None:
        super().__init__(config, runner, name=name, faults=faults)
        self.sender = sender
        self.scheduler = PrefillScheduler(
            config.scheduler,
            self.kv,
            prefill_step_budget(config.scheduler, runner.device.type),
        )
        logger.info(
            "%s: at most %d prompt tokens a step, long prompts (> %d tokens) share at most %d",
            name,
            self.scheduler.step_budget,
            self.scheduler.long_threshold,
            self.scheduler.long_share,
        )
        self._pending: dict[str, _Pending] = {}
        self._owns_sender = False
        self.num_prefills = 0
        self.transfer_bytes = 0
        self.transfer_failures = 0

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        model_config: ModelConfig | None = None,
        sender: KVSender | None = None,
        *,
        name: str = "prefill",
        faults: FaultInjector | None = None,
    ) -> PrefillEngine:
        """Load the model per ``config.load`` (``model_config`` for dummy weights) and wrap it.

        Without ``sender``, builds one of ``config.transfer.backend`` for this pool's KV layout;
        the engine then owns it and closes it in :meth:`shutdown`. ``faults`` goes to the engine
        and the sender it builds.
        """
        from kv_transfer import make_sender
        from kv_transfer.base import KVLayout
        from pdserve.engine.runner import ModelRunner
        from pdserve.model.cpu_linear import prefill_helper_setting, share_prefill_linears
        from pdserve.model.loader import torch_dtype

        # A prefill worker never decodes: its weights get the skinny kernel's panels (a second
        # copy) only where it shares its matmuls with the helper thread.
        nice = None
        if config.load.device == "cpu":
            nice = prefill_helper_setting(torch_dtype(config.load.resolved_dtype))
        runner = ModelRunner(
            config, model_config, skinny_linears=None if nice is not None else False
        )
        if nice is not None and share_prefill_linears(nice):
            logger.info("prefill matmuls shared with a helper thread (niceness %s)",
                     "SCHED_IDLE" if nice < 0 else nice)  # fmt: skip
        if sender is not None:
            return cls(config, runner, sender, name=name, faults=faults)
        layout = KVLayout.from_pool(runner.kv_pool, runner.model_config.model_id)
        sender = make_sender(config.transfer, layout, device=runner.device, faults=faults)
        engine = cls(config, runner, sender, name=name, faults=faults)
        engine._owns_sender = True
        return engine

    # ----------------------------------------------------------------------------- requests
    def add_request(self, request: PrefillRequest) -> Future[PrefillResult]:
        """Validate and queue a prefill. Returns a future resolving to a PrefillResult, or failing
        with EngineError (CANCELLED on abort, DEADLINE_EXCEEDED, ABORTED when the KV could not
        be sent to the target (unreachable, gone, or it no longer holds the reservation),
        INTERNAL when the forward raised).

        Raises EngineError at once: INVALID_ARGUMENT (see ``EngineRequest.validate``),
        RESOURCE_EXHAUSTED (the prompt needs more KV blocks than the pool has), ALREADY_EXISTS
        (id in use), UNAVAILABLE (a target but no KV sender, or the engine was shut down),
        DEADLINE_EXCEEDED (deadline already past).
        """
        if self.is_closed:
            raise EngineError(UNAVAILABLE, f"{self.name} is shutting down")
        request.validate(
            vocab_size=self.runner.model_config.vocab_size,
            max_model_len=self.max_model_len,
            check_sampling=self.runner.sampler.check,
            now=time.time(),
        )
        n = len(request.prompt_token_ids)
        need = self.kv.num_blocks_needed(n)
        if need > self.kv.num_blocks:
            raise EngineError(
                RESOURCE_EXHAUSTED,
                f"prompt of {n} tokens needs {need} KV blocks; this worker has {self.kv.num_blocks}",
            )
        if request.target is not None and self.sender is None:
            raise EngineError(UNAVAILABLE, f"{self.name} has no KV sender configured")
        try:  # the state token 1 is sampled under (advanced over a re-prefill's earlier output)
            grammar = resume_matcher(self.config.load.model, self.runner.model_config,
                                     request.sampling.structured, request.prompt_token_ids,
                                     request.num_output_tokens)  # fmt: skip
        except StructuredOutputError as e:
            raise EngineError(INVALID_ARGUMENT, str(e)) from None
        fut: Future[PrefillResult] = Future()
        fut.set_running_or_notify_cancel()
        with self._lock:
            if request.request_id in self._pending:
                raise EngineError(
                    ALREADY_EXISTS, f"request {request.request_id!r} is already being prefilled"
                )
            seq = PrefillSeq(request, grammar=grammar)
            self.scheduler.add(seq)
            self._pending[request.request_id] = _Pending(seq, fut)
        self.wake()
        return fut

    def abort(self, request_id: str) -> bool:
        """Drop a request at any stage, freeing everything it holds; its future fails with
        CANCELLED. Idempotent: returns whether the request was live."""
        return self._fail(request_id, EngineError(CANCELLED, f"request {request_id!r} aborted"))

    def _fail(self, request_id: str, error: EngineError) -> bool:
        """Drop a live request with ``error``. A KV send still queued behind another on its
        peer's channel is cancelled (never started): when a decode worker dies, the router
        aborts the prompts bound for it, and none of them then waits out a connect timeout
        against the dead endpoint. A send already on the wire runs to its end."""
        with self._lock:
            p = self._pending.pop(request_id, None)
            if p is None:
                return False
            self.scheduler.remove(request_id)
        if p.transfer is not None:
            p.transfer.cancel()
        if not p.future.done():
            p.future.set_exception(error)
        return True

    def _fail_all(self, code: str, message: str) -> None:
        for rid in list(self._pending):
            self._fail(rid, EngineError(code, message))

    def _close_transport(self) -> None:
        if self._owns_sender and self.sender is not None:
            self.sender.close()
            self._owns_sender = False

    # ----------------------------------------------------------------------------- the step
    def has_work(self) -> bool:
        """True while any request is queued, computing or sending."""
        with self._lock:
            return bool(self._pending)

    def step(self) -> int:
        """Run one engine step. Returns the number of prompt tokens computed (0 when idle)."""
        with self._lock:
            self._expire_deadlines()
            if self.faults is not None and self.scheduler.num_waiting:
                self.faults.at(FaultPhase.PREFILL_QUEUED)
            output = self.scheduler.schedule()
        if output.is_empty:
            return 0
        t0 = time.perf_counter()
        try:
            out = self.runner.run(output.scheduled)
            now = time.monotonic()
            with self._lock:
                for rid, lps in out.prompt_logprobs.items():
                    if rid in self._pending:
                        self._pending[rid].prompt_logprobs.extend(lps.tokens)
                finished = self.scheduler.update_from_output(output, out.tokens)
                self._record_step(
                    time.perf_counter() - t0, output.num_scheduled_tokens, len(output.seqs)
                )
                # Smallest KV first: a sender's queue is FIFO per decode worker, so a short
                # prompt's transfer never waits behind a long one finished in the same step.
                for seq, token in sorted(finished, key=lambda f: f[0].num_prompt_tokens):
                    self._hand_off(seq, token, now)
        except Exception as e:  # noqa: BLE001 - the worker keeps serving the others
            logger.exception("prefill forward failed")
            for seq in output.seqs:
                self._fail(seq.request_id, EngineError(INTERNAL, f"prefill forward failed: {e}"))
            return 0
        return output.num_scheduled_tokens

    def _hand_off(self, seq: PrefillSeq, token: SampledToken, now: float) -> None:
        """Token 1 is sampled: gather the KV and send it (or finish at once without a target)."""
        p = self._pending[seq.request_id]
        p.token, p.sampled_at = token, now
        target = seq.request.target
        if target is None:
            self._complete(p, None)
            return
        assert self.sender is not None  # checked in add_request
        if self.faults is not None:
            self.faults.at(FaultPhase.KV_SEND)
        table = self.kv.block_table(seq.request_id)
        kv = self.runner.kv_pool.gather(table, seq.num_prompt_tokens)  # [L, 2, T, H, D], a copy
        # NOTE: on CUDA the gather is queued on the compute stream and the sender moves it on its
        # own stream after an event (kv_transfer.sender_core), overlapping the next prefill
        p.send_started = time.monotonic()
        try:
            fut = self.sender.send(
                target.kv_endpoint, target.transfer_id, kv, token.token_id, token.logprob
            )
        except Exception as e:
            self.transfer_failures += 1
            self._fail(seq.request_id, EngineError(ABORTED, f"KV send failed: {e}"))
            return

        p.transfer = fut
        fut.add_done_callback(functools.partial(self._transfer_done, p))

    def _transfer_done(self, p: _Pending, f: Future[TransferRecord]) -> None:
        """A KV send ended (on the sender's thread, or at once in ``send``): resolve the request
        now (see the module docstring) and wake the loop, whose freed blocks may admit more."""
        with self._lock:
            rid = p.seq.request_id
            if self._pending.get(rid) is not p:
                return  # aborted while sending; its blocks are already free
            exc = f.exception()
            if exc is not None:
                self.transfer_failures += 1
                self._fail(rid, EngineError(ABORTED, f"KV transfer failed: {exc}"))
            elif (record := f.result()).outcome is not TransferOutcome.OK:
                # 'dropped': the decode worker held no reservation (it gave the request up).
                self.transfer_failures += 1
                reason = f": {record.error}" if record.error else ""
                self._fail(rid, EngineError(ABORTED, f"KV transfer {record.outcome.value}{reason}"))
            else:
                self.transfer_bytes += int(record.bytes)
                self._complete(p, record)
        self.wake()

    def _complete(self, p: _Pending, record: TransferRecord | None) -> None:
        """Resolve the request's future and free its blocks (kept as prefix cache)."""
        seq = p.seq
        assert p.token is not None and seq.first_scheduled is not None
        end = time.monotonic()
        result = PrefillResult(
            request_id=seq.request_id,
            token=p.token,
            num_prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached,
            queue_ms=(seq.first_scheduled - seq.arrival) * 1e3,
            compute_ms=(p.sampled_at - seq.first_scheduled) * 1e3,
            transfer_ms=(end - p.send_started) * 1e3 if record is not None else 0.0,
            transfer=record,
            prompt_logprobs=tuple(p.prompt_logprobs),
        )
        del self._pending[seq.request_id]
        self.scheduler.finish(seq.request_id)
        self.num_prefills += 1
        p.future.set_result(result)

    def _expire_deadlines(self) -> None:
        now = time.time()
        for rid, p in list(self._pending.items()):
            d = p.seq.request.deadline
            if d is not None and d <= now:
                self._fail(rid, EngineError(DEADLINE_EXCEEDED, f"request {rid!r} deadline passed"))

    # ----------------------------------------------------------------------------- stats
    def stats(self) -> PrefillEngineStats:
        """A consistent snapshot of queue, KV and throughput statistics."""
        with self._lock:
            step_ms, tokens_per_s = self.window.rates()
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
                prompt_tokens_per_s=tokens_per_s,
                num_prefills=self.num_prefills,
                transfer_bytes=self.transfer_bytes,
                transfer_failures=self.transfer_failures,
                step_time_ms=step_ms,
                batch_size=self.window.mean_batch(),
                prompt_tokens_computed=self.window.total_tokens,
                long_prefill_token_threshold=self.scheduler.class_threshold,
                num_queued_short_tokens=self.scheduler.num_queued_short_tokens,
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
