"""DecodeEngine: the decode worker's core (plain Python; the gRPC service and the actor wrap it).

It owns the ModelRunner (weights, KV pool, sampler), a :class:`KVCacheManager` over that pool, the
:class:`DecodeScheduler` policy and the worker's KV receiver, and runs the step loop:

    add_request ──> reserve blocks ──> receiver.expect(transfer_id, blocks, deadline)
                                        └─ future done (KV scattered, token 1 in the header)
                                           ──> kv_arrived ──> admitted at the next step boundary
    step: schedule (expire, admit, decodes + preemption, local prefill chunks)
          ──> runner.execute (one forward; releases the GIL) ──> update ──> events to sinks

Threads: the step loop runs in one background thread (:meth:`start`); requests and aborts come
from other threads (the gRPC event loop). One re-entrant lock guards the scheduler; the forward
runs outside it. KV arrivals are completed on the receiver's threads: their callbacks only queue a
notice and wake the loop (they never take the engine lock, so a receiver that completes futures
under its own lock cannot deadlock against ``receiver.cancel`` called under ours); the loop
applies notices at the next step boundary, or within ``idle_poll_s`` when idle. Each request's
events go to the ``sink`` given to :meth:`add_request`, called with the lock held, in order, never
after the request's terminal event: sinks must not block (the service hands events to its asyncio
loop with ``call_soon_threadsafe``). Tests may instead call :meth:`step` directly without
starting the thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from decode_worker.request import (
    DEADLINE_EXCEEDED,
    FAILED_PRECONDITION,
    INTERNAL,
    INVALID_ARGUMENT,
    UNAVAILABLE,
    Accepted,
    DecodeEvent,
    DecodeRequest,
    RequestRefused,
    is_terminal,
)
from decode_worker.scheduler import DecodeScheduler, StepPlan
from pdserve.config import EngineConfig, ModelConfig
from pdserve.kv_cache.manager import KVCacheManager
from pdserve.sampling_params import SamplingError
from pdserve.structured.grammar import resume_matcher
from pdserve.structured.spec import StructuredOutputError
from pdserve.types import SampledToken

if TYPE_CHECKING:
    from kv_transfer.base import KVReceiver, TransferResult
    from pdserve.engine.runner import ModelRunner

log = logging.getLogger(__name__)

EventSink = Callable[[DecodeEvent], None]


@dataclass(frozen=True)
class DecodeStatsSnapshot:
    """What GetStats reports. Step time in ms, throughput in generated tokens per second, both
    over the last ``window_s`` seconds of steps."""

    worker_id: str
    num_running: int
    num_waiting_for_kv: int
    num_waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    step_time_ms: float
    generation_tokens_per_s: float
    num_preemptions: int
    num_finished: int
    kv_endpoint: str


class _StepWindow:
    """Recent steps: (end time s, duration s, sampled tokens), kept for ``window_s`` seconds."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._steps: deque[tuple[float, float, int]] = deque()

    def add(self, end: float, duration: float, tokens: int) -> None:
        self._steps.append((end, duration, tokens))
        while self._steps and self._steps[0][0] < end - self.window_s:
            self._steps.popleft()

    def rates(self, now: float) -> tuple[float, float]:
        """(mean step ms, generated tokens/s) over the window ending ``now``."""
        steps = [s for s in self._steps if s[0] >= now - self.window_s]
        if not steps:
            return 0.0, 0.0
        busy_ms = 1000.0 * sum(d for _, d, _ in steps) / len(steps)
        span = max(now - (steps[0][0] - steps[0][1]), 1e-9)
        return busy_ms, sum(t for _, _, t in steps) / span


class DecodeEngine:
    """One decode worker's engine.

    ``runner``: a ModelRunner (built from ``config``/``model_config`` when None).
    ``receiver``: the worker's KV receiver, scattering into ``runner.kv_pool``; None = the
    engine only serves local prefills (remote requests are refused with UNAVAILABLE).
    ``allow_local_prefill``: unified mode allowed (``prefill_locally`` requests; refused with
    FAILED_PRECONDITION otherwise). ``default_kv_timeout_s``: how long a reservation waits for its
    KV when the request names no timeout (default ``config.transfer.timeout_s``). ``clock``: wall
    time in seconds (deadlines are ``time.time()`` values). Raises ConfigError while building the
    runner.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        worker_id: str = "decode-0",
        model_config: ModelConfig | None = None,
        runner: ModelRunner | None = None,
        receiver: KVReceiver | None = None,
        allow_local_prefill: bool = True,
        default_kv_timeout_s: float | None = None,
        idle_poll_s: float = 0.05,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if runner is None:
            from pdserve.engine.runner import ModelRunner

            runner = ModelRunner(config, model_config)
        self.config = config
        self.worker_id = worker_id
        self.runner = runner
        self.receiver = receiver
        self.allow_local_prefill = allow_local_prefill
        self.idle_poll_s = idle_poll_s
        self.clock = clock
        mc = runner.model_config
        self.max_model_len = min(config.scheduler.max_model_len, mc.max_position_embeddings)
        self.kv = KVCacheManager(
            runner.num_blocks, runner.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = DecodeScheduler(
            self.kv,
            config.scheduler,
            max_model_len=self.max_model_len,
            vocab_size=mc.vocab_size,
            eos_token_ids=mc.eos_token_ids,
            default_kv_timeout_s=default_kv_timeout_s or config.transfer.timeout_s,
            watermark_blocks=min(-(-runner.num_blocks // 100), runner.num_blocks - 1),
            clock=clock,
        )
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._kv_notices: queue.SimpleQueue[tuple[str, int, Future[TransferResult]]] = (
            queue.SimpleQueue()
        )
        self._sinks: dict[str, EventSink] = {}
        # Transfer ids start at a random base so a restarted worker does not accept KV that was
        # addressed to its previous incarnation. Kept below 2^62 (the header is int64).
        self._transfer_ids = itertools.count(random.getrandbits(40) << 20 | 1)
        self._window = _StepWindow()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._owns_receiver = False  # build() made it: stop() closes it
        self.num_steps = 0

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        model_config: ModelConfig | None = None,
        *,
        worker_id: str = "decode-0",
        allow_local_prefill: bool = True,
        kv_port: int = 0,
    ) -> DecodeEngine:
        """Load the model per ``config.load`` (``model_config`` for dummy weights) and open the
        KV receiver of ``config.transfer.backend`` on ``config.transfer.host:kv_port`` (0 = a
        free port), scattering into the runner's pool. Raises ConfigError / ValueError."""
        from kv_transfer import make_receiver
        from kv_transfer.base import KVLayout
        from pdserve.engine.runner import ModelRunner

        runner = ModelRunner(config, model_config)
        layout = KVLayout.from_pool(runner.kv_pool, runner.model_config.model_id)
        receiver = make_receiver(config.transfer, runner.kv_pool, layout, port=kv_port)
        engine = cls(
            config,
            worker_id=worker_id,
            runner=runner,
            receiver=receiver,
            allow_local_prefill=allow_local_prefill,
        )
        engine._owns_receiver = True
        return engine

    # ------------------------------------------------------------------------------- requests
    @property
    def kv_endpoint(self) -> str:
        """'host:port' of the KV receiver ('' without one)."""
        return self.receiver.endpoint if self.receiver is not None else ""

    def add_request(self, req: DecodeRequest, sink: EventSink) -> Accepted:
        """Reserve blocks for ``req`` and register its KV transfer (or queue its local prefill).

        ``sink`` receives the request's events from then on (see module docstring). Raises
        RequestRefused: INVALID_ARGUMENT, ALREADY_EXISTS, RESOURCE_EXHAUSTED (no KV room),
        UNAVAILABLE (stopping, or no receiver for a remote request), FAILED_PRECONDITION (local
        prefill not allowed here).
        """
        try:  # outside the lock: a first compile may take a while
            grammar = resume_matcher(self.config.load.model, self.runner.model_config,
                                     req.sampling.structured, req.prompt_token_ids, req.num_output_tokens)  # fmt: skip
        except StructuredOutputError as e:
            raise RequestRefused(INVALID_ARGUMENT, str(e)) from None
        with self._lock:
            if self._stopping:
                raise RequestRefused(UNAVAILABLE, f"decode worker {self.worker_id} is stopping")
            if req.deadline is not None and req.deadline <= self.clock():
                raise RequestRefused(DEADLINE_EXCEEDED, "request deadline already passed")
            if req.prefill_locally and not self.allow_local_prefill:
                raise RequestRefused(
                    FAILED_PRECONDITION,
                    f"decode worker {self.worker_id} does not prefill locally (unified mode off)",
                )
            if not req.prefill_locally and self.receiver is None:
                raise RequestRefused(
                    UNAVAILABLE, f"decode worker {self.worker_id} has no KV receiver"
                )
            try:
                self.runner.sampler.check(req.sampling)
            except SamplingError as e:
                raise RequestRefused(INVALID_ARGUMENT, str(e)) from e
            transfer_id = 0 if req.prefill_locally else next(self._transfer_ids)
            table = self.scheduler.add_request(req, transfer_id, grammar)
            self._sinks[req.request_id] = sink
            if not req.prefill_locally:
                assert self.receiver is not None
                rid = req.request_id
                timeout = req.kv_timeout_s or self.scheduler.default_kv_timeout_s
                deadline = self.clock() + timeout
                if req.deadline is not None:
                    deadline = min(deadline, req.deadline)
                try:
                    fut = self.receiver.expect(transfer_id, table, deadline)
                except Exception as e:  # noqa: BLE001 - any receiver failure refuses the request
                    self._sinks.pop(rid, None)
                    self.scheduler.abort(rid)
                    self.scheduler.drain()
                    raise RequestRefused(UNAVAILABLE, f"KV receiver refused: {e}") from e
                fut.add_done_callback(lambda f: self._on_kv(rid, transfer_id, f))
            self._flush()
        self._wake.set()
        return Accepted(
            transfer_id=transfer_id,
            kv_endpoint=self.kv_endpoint,
            decode_worker_id=self.worker_id,
            num_reserved_blocks=len(table),
        )

    def abort(self, request_id: str) -> bool:
        """Drop ``request_id`` (CANCELLED event), free its blocks, forget its KV transfer.

        Idempotent: False when the request is not live here (unknown, finished or aborted).
        """
        with self._lock:
            found = self.scheduler.abort(request_id)
            self._flush()
            return found

    def _on_kv(self, request_id: str, transfer_id: int, fut: Future[TransferResult]) -> None:
        """Receiver callback (any thread): queue the notice and wake the loop; nothing else."""
        self._kv_notices.put((request_id, transfer_id, fut))
        self._wake.set()

    def _apply_kv_notices(self) -> None:
        """Apply queued KV arrivals/failures to the scheduler (lock held)."""
        while True:
            try:
                request_id, transfer_id, fut = self._kv_notices.get_nowait()
            except queue.Empty:
                return
            try:
                result = fut.result()
            except CancelledError:
                continue  # we cancelled it (abort / deadline): the scheduler already released it
            except Exception as e:  # noqa: BLE001 - every transfer failure ends the request
                code = DEADLINE_EXCEEDED if isinstance(e, TimeoutError) else UNAVAILABLE
                self.scheduler.kv_failed(request_id, transfer_id, code, f"KV transfer failed: {e}")
            else:
                token = SampledToken(int(result.first_token), float(result.first_logprob))
                self.scheduler.kv_arrived(request_id, transfer_id, token)

    def _flush(self) -> None:
        """Deliver the scheduler's events to their sinks and cancel released transfers."""
        events, released = self.scheduler.drain()
        for rid, ev in events:
            sink = self._sinks.pop(rid, None) if is_terminal(ev) else self._sinks.get(rid)
            if sink is None:
                continue
            try:
                sink(ev)
            except Exception:  # noqa: BLE001 - a broken sink must not stop the engine
                log.exception("event sink of request %s raised", rid)
        if self.receiver is not None:
            for tid in released:
                try:
                    self.receiver.cancel(tid)
                except Exception:  # noqa: BLE001
                    log.exception("receiver.cancel(%d) raised", tid)

    # ------------------------------------------------------------------------------- stepping
    @property
    def has_work(self) -> bool:
        """True while a step would compute or admit something (or a KV notice is queued)."""
        with self._lock:
            return self.scheduler.has_work or not self._kv_notices.empty()

    @property
    def num_live(self) -> int:
        """Requests holding state here (waiting for KV, waiting, running)."""
        with self._lock:
            return len(self._sinks)

    def step(self) -> int:
        """Run one step: schedule, forward, update. Returns the number of sequences computed.

        A runner exception fails that step's requests (INTERNAL) and is logged, not raised.
        """
        with self._lock:
            self._apply_kv_notices()
            plan: StepPlan = self.scheduler.schedule()
            self._flush()
            if plan.empty:
                self.scheduler.update(plan, [])
                return 0
        t0 = time.perf_counter()
        try:
            out = self.runner.run(plan.seqs)
        except Exception as e:  # noqa: BLE001 - the worker survives a bad batch
            log.exception("forward failed for %d sequences", len(plan.seqs))
            with self._lock:
                self.scheduler.fail_step(plan, f"forward failed: {type(e).__name__}: {e}")
                self._flush()
            return 0
        t1 = time.perf_counter()
        with self._lock:
            try:
                self.scheduler.update(plan, out.tokens, out.prompt_logprobs)
            except ValueError as e:
                self.scheduler.fail_step(plan, str(e))
            self._flush()
            self.num_steps += 1
            self._window.add(time.monotonic(), t1 - t0, sum(s.sample for s in plan.seqs))
        return len(plan.seqs)

    def run_until_idle(self, max_steps: int = 1_000_000) -> int:
        """Step until nothing is running or ready (KV still awaited does not count).

        Returns the number of steps taken. Raises RuntimeError after ``max_steps`` steps.
        """
        for n in range(max_steps):
            if not self.has_work:
                return n
            self.step()
        raise RuntimeError(f"decode engine still busy after {max_steps} steps")

    def poll(self) -> None:
        """Apply queued KV notices and expire deadlines without computing (the idle loop's work)."""
        with self._lock:
            self._apply_kv_notices()
            self.scheduler.expire()
            self._flush()

    def start(self) -> None:
        """Run the step loop in a background daemon thread. Raises RuntimeError if running."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("decode engine loop already started")
            self._stopping = False
            self._thread = threading.Thread(
                target=self._loop, name=f"decode-loop-{self.worker_id}", daemon=True
            )
            self._thread.start()

    def is_running(self) -> bool:
        """True while the background step loop thread is alive."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop, fail every live request (UNAVAILABLE), free its blocks, and close the
        receiver if :meth:`build` opened it. Idempotent."""
        with self._lock:
            self._stopping = True
            thread, self._thread = self._thread, None
        self._wake.set()
        if thread is not None:
            thread.join(timeout_s)
        with self._lock:
            self._apply_kv_notices()
            for rid in list(self._sinks):
                self.scheduler.fail(rid, UNAVAILABLE, f"decode worker {self.worker_id} stopped")
            self._flush()
            if self._owns_receiver and self.receiver is not None:
                self.receiver.close()

    def _loop(self) -> None:
        while not self._stopping:
            self._wake.clear()  # before looking at the state, so no wake-up is lost
            self.poll()
            if not self.has_work:
                self._wake.wait(self.idle_poll_s)
                continue
            try:
                self.step()
            except Exception:  # noqa: BLE001 - keep serving; the step's requests were failed
                log.exception("decode step failed")
                with self._lock:
                    for rid in list(self._sinks):
                        self.scheduler.fail(rid, INTERNAL, "internal error in the decode loop")
                    self._flush()

    # ------------------------------------------------------------------------------- stats
    def stats(self) -> DecodeStatsSnapshot:
        """A consistent snapshot of the engine's counters (see DecodeStatsSnapshot)."""
        with self._lock:
            s = self.scheduler
            step_ms, tok_s = self._window.rates(time.monotonic())
            return DecodeStatsSnapshot(
                worker_id=self.worker_id,
                num_running=s.num_running,
                num_waiting_for_kv=s.num_waiting_for_kv,
                num_waiting=s.num_waiting_local,
                kv_blocks_free=self.kv.num_free_blocks,
                kv_blocks_total=self.kv.num_blocks,
                step_time_ms=step_ms,
                generation_tokens_per_s=tok_s,
                num_preemptions=s.num_preemptions,
                num_finished=s.num_finished,
                kv_endpoint=self.kv_endpoint,
            )

    def check_integrity(self) -> None:
        """Assert the scheduler's and the KV manager's invariants. Raises AssertionError."""
        with self._lock:
            self.scheduler.check_integrity()
            for rid in self._sinks:
                if not self.scheduler.has(rid):
                    raise AssertionError(f"sink kept for request {rid!r} that is not live")
