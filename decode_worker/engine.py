"""DecodeEngine: the decode worker's core (plain Python; the gRPC service and the actor wrap it).

It owns the ModelRunner (weights, KV pool, sampler), a :class:`KVCacheManager` over that pool, the
:class:`DecodeScheduler` policy and the worker's KV receiver, and runs the step loop:

    add_request ──> reserve blocks ──> receiver.expect(transfer_id, blocks, deadline)
                                        └─ future done (KV scattered, token 1 in the header)
                                           ──> kv_arrived ──> admitted at the next step boundary
    step: schedule (expire, admit, decodes + preemption, local prefill chunks)
          ──> runner.run (one forward; releases the GIL) ──> update ──> events to sinks

With a **prefill thread** (``prefill_thread``; unified mode's default where the worker has two or
more CPU threads), local prompts are not chunks of the decode steps: a second thread runs their
prefill steps (``schedule_prefill`` -> ``runner.run`` -> ``update_prefill``) concurrently with the
decode loop, each thread with half of the worker's intra-op threads, over the same weights and KV
pool (disjoint blocks), and a finished prompt joins the decode batch at the next step boundary as
a remote prompt does when its KV arrives. On a 2-core CPU this is the disaggregated layout inside
one process, without a KV transfer: two single-threaded loops that never wait for each other,
where one two-threaded loop syncs both threads at every parallel region and stretches the steps
that carry a prompt chunk (see docs/benchmarks.md, session 13). ``runner.run`` releases the GIL
for its matmul and attention kernels, so the two forwards overlap, but not fully: the decode
step's Python (and inductor's fused loops, which run holding the GIL) waits on the other thread,
so two threads reach 1.65-1.75 of the two loops' solo rates where two processes reach 1.96
(``bench/prefill_thread_overlap.py [--processes]``, docs/benchmarks.md, session 15).

The step loop, lock and shutdown come from :class:`~pdserve.engine.worker_engine.WorkerEngine`.
KV arrivals are completed on the receiver's threads: their callbacks only queue a notice and
wake the loop (they never take the engine lock, so a receiver that completes futures under its
own lock cannot deadlock against ``receiver.cancel`` called under ours); the loop applies notices
at the next step boundary, or within ``idle_poll_s`` when idle. Each request's events go to the
``sink`` given to :meth:`DecodeEngine.add_request`, called with the lock held, in order, never
after the request's terminal event: sinks must not block (the service hands events to its
asyncio loop with ``call_soon_threadsafe``). A sink may carry a ``batch`` attribute, an object
with a ``flush()`` method: after each round of deliveries the engine calls every distinct one
once, so sinks may queue their events and hand a round over in one go (the service wakes its
event loop once a step instead of once per request: each wake-up is a socket write that gives
up the GIL, and the step thread then waited to take it back, up to ~1 ms a step at batch 16).
"""

from __future__ import annotations

import itertools
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from decode_worker.request import Accepted, DecodeEvent, DecodeRequest, is_terminal
from decode_worker.scheduler import DecodeOutput, DecodeScheduler, admission_watermark
from pdserve.config import EngineConfig, ModelConfig, prefill_step_budget
from pdserve.engine.errors import (
    DEADLINE_EXCEEDED,
    FAILED_PRECONDITION,
    INVALID_ARGUMENT,
    UNAVAILABLE,
    EngineError,
)
from pdserve.engine.faults import FaultInjector, FaultPhase
from pdserve.engine.worker_engine import WorkerEngine
from pdserve.structured.grammar import resume_matcher
from pdserve.structured.spec import StructuredOutputError
from pdserve.types import PromptLogprobs, SampledToken

if TYPE_CHECKING:
    from kv_transfer.base import KVReceiver, TransferResult
    from pdserve.engine.runner import ModelRunner

log = logging.getLogger(__name__)

EventSink = Callable[[DecodeEvent], None]


def use_prefill_thread(setting: bool | None, allow_local_prefill: bool, num_threads: int) -> bool:
    """Whether a decode worker runs its local prefills on a thread of their own:
    ``setting`` (``SchedulerConfig.local_prefill_thread``) when given, else (automatic) where the
    worker has at least 2 intra-op threads to split; never without local prefill."""
    if not allow_local_prefill:
        return False
    return num_threads >= 2 if setting is None else setting


@dataclass(frozen=True)
class DecodeEngineStats:
    """What GetStats reports. ``num_waiting``: sequences waiting for a batch slot (remote ones
    whose KV arrived and local prefills). Step time in ms, throughput in generated tokens per
    second, both over the last 10 s of steps."""

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
    batch_size: float = 0.0  # mean sequences per step over the window
    generation_tokens: int = 0  # tokens sampled since start
    transfer_bytes_received: int = 0  # KV bytes received since start


class DecodeEngine(WorkerEngine):
    """One decode worker's engine.

    ``runner``: a ModelRunner (built from ``config``/``model_config`` when None).
    ``receiver``: the worker's KV receiver, scattering into ``runner.kv_pool``; None = the
    engine only serves local prefills (remote requests are refused with UNAVAILABLE).
    ``allow_local_prefill``: unified mode allowed (``prefill_locally`` requests; refused with
    FAILED_PRECONDITION otherwise). ``prefill_thread``: compute local prompts on a thread of their
    own (see module docstring; :meth:`start` starts it; without :meth:`start`, :meth:`step` runs a
    prefill step before each decode step, so tests and offline use see the same results). The
    caller sets the intra-op thread count each loop should use before building ``runner``
    (compiled kernels keep the count they were built with); :meth:`build` does.
    ``default_kv_timeout_s``: how long a reservation waits for its KV when the request names no
    timeout (default ``config.transfer.timeout_s``). ``clock``: wall
    time in seconds (deadlines are ``time.time()`` values). ``faults``: fault injection (see
    pdserve/engine/faults.py). Raises ConfigError while building the runner.
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
        prefill_thread: bool = False,
        default_kv_timeout_s: float | None = None,
        idle_poll_s: float = 0.05,
        clock: Callable[[], float] = time.time,
        faults: FaultInjector | None = None,
    ) -> None:
        if runner is None:
            from pdserve.engine.runner import ModelRunner

            runner = ModelRunner(config, model_config)
        super().__init__(config, runner, name=worker_id, idle_poll_s=idle_poll_s, faults=faults)
        self.worker_id = worker_id
        self.receiver = receiver
        self.allow_local_prefill = allow_local_prefill
        self.prefill_thread = prefill_thread and allow_local_prefill
        self.clock = clock
        mc = runner.model_config
        self.scheduler = DecodeScheduler(
            self.kv,
            config.scheduler,
            max_model_len=self.max_model_len,
            vocab_size=mc.vocab_size,
            eos_token_ids=mc.eos_token_ids,
            default_kv_timeout_s=default_kv_timeout_s or config.transfer.timeout_s,
            watermark_blocks=admission_watermark(runner.num_blocks),
            check_sampling=runner.sampler.check,
            clock=clock,
            prefill_thread=self.prefill_thread,
            prefill_step_tokens=prefill_step_budget(config.scheduler, runner.device.type),
        )
        self._kv_notices: queue.SimpleQueue[tuple[str, int, Future[TransferResult]]] = (
            queue.SimpleQueue()
        )
        self._sinks: dict[str, EventSink] = {}
        # Transfer ids start at a random base so a restarted worker does not accept KV that was
        # addressed to its previous incarnation. Kept below 2^62 (the header is int64).
        self._transfer_ids = itertools.count(random.getrandbits(40) << 20 | 1)
        self._owns_receiver = False  # build() made it: shutdown() closes it
        self._prefill_wake = threading.Event()
        self._prefill_loop: threading.Thread | None = None
        self._inline_prefill = True  # step() runs the prefill steps until start() starts a loop

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        model_config: ModelConfig | None = None,
        *,
        worker_id: str = "decode-0",
        allow_local_prefill: bool = True,
        kv_port: int = 0,
        faults: FaultInjector | None = None,
    ) -> DecodeEngine:
        """Load the model per ``config.load`` (``model_config`` for dummy weights) and open the
        KV receiver of ``config.transfer.backend`` on ``config.transfer.host:kv_port`` (0 = a
        free port), scattering into the runner's pool. With a prefill thread
        (:func:`use_prefill_thread` of ``config.scheduler.local_prefill_thread``) it first halves
        this process's intra-op threads (``torch.set_num_threads``), one half per loop, and on CPU
        lets the prefills' matmuls share the decode steps' helper thread
        (:func:`pdserve.model.cpu_linear.prefill_helper_setting`). Raises ConfigError /
        ValueError."""
        import torch

        from kv_transfer import make_receiver
        from kv_transfer.base import KVLayout
        from pdserve.engine.runner import ModelRunner
        from pdserve.model.cpu_linear import prefill_helper_setting, share_prefill_linears

        threads = torch.get_num_threads()
        setting = config.scheduler.local_prefill_thread
        prefill_thread = use_prefill_thread(setting, allow_local_prefill, threads)
        if prefill_thread:
            torch.set_num_threads(max(1, threads // 2))
        runner = ModelRunner(config, model_config)
        if prefill_thread and config.load.device == "cpu":
            # the prefill thread's matmuls share the helper with the decode steps, so a prefill
            # also runs on the decode loop's CPU while that one idles
            share_prefill_linears(prefill_helper_setting(runner.dtype))
        layout = KVLayout.from_pool(runner.kv_pool, runner.model_config.model_id)
        receiver = make_receiver(config.transfer, runner.kv_pool, layout, port=kv_port)
        engine = cls(
            config,
            worker_id=worker_id,
            runner=runner,
            receiver=receiver,
            allow_local_prefill=allow_local_prefill,
            prefill_thread=prefill_thread,
            faults=faults,
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
        EngineError: INVALID_ARGUMENT, DEADLINE_EXCEEDED, ALREADY_EXISTS, RESOURCE_EXHAUSTED (no
        KV room), UNAVAILABLE (shutting down, or no receiver for a remote request),
        FAILED_PRECONDITION (local prefill not allowed here).
        """
        try:  # outside the lock: a first compile may take a while
            grammar = resume_matcher(self.config.load.model, self.runner.model_config,
                                     req.sampling.structured, req.prompt_token_ids, req.num_output_tokens)  # fmt: skip
        except StructuredOutputError as e:
            raise EngineError(INVALID_ARGUMENT, str(e)) from None
        with self._lock:
            if self.is_closed:
                raise EngineError(UNAVAILABLE, f"decode worker {self.worker_id} is stopping")
            if req.prefill_locally and not self.allow_local_prefill:
                raise EngineError(
                    FAILED_PRECONDITION,
                    f"decode worker {self.worker_id} does not prefill locally (unified mode off)",
                )
            if not req.prefill_locally and self.receiver is None:
                raise EngineError(UNAVAILABLE, f"decode worker {self.worker_id} has no KV receiver")
            transfer_id = 0 if req.prefill_locally else next(self._transfer_ids)
            table = self.scheduler.add_request(req, transfer_id, grammar)
            seq = self.scheduler.get(req.request_id)
            cached = seq.num_cached if seq is not None and req.prefill_locally else 0
            self._sinks[req.request_id] = sink
            if not req.prefill_locally:
                self._expect_kv(req, transfer_id, table)
            self._flush()
        self.wake()
        return Accepted(
            transfer_id=transfer_id,
            kv_endpoint=self.kv_endpoint,
            decode_worker_id=self.worker_id,
            num_reserved_blocks=len(table),
            cached_tokens=cached,
        )

    def _expect_kv(self, req: DecodeRequest, transfer_id: int, table: list[int]) -> None:
        """Register the reservation with the receiver (lock held); undo the request and raise
        EngineError(UNAVAILABLE) when the receiver refuses."""
        assert self.receiver is not None
        rid = req.request_id
        deadline = self.clock() + (req.kv_timeout_s or self.scheduler.default_kv_timeout_s)
        if req.deadline is not None:
            deadline = min(deadline, req.deadline)
        try:
            fut = self.receiver.expect(transfer_id, table, deadline)
        except Exception as e:  # noqa: BLE001 - any receiver failure refuses the request
            self._sinks.pop(rid, None)
            self.scheduler.abort(rid)
            self.scheduler.drain()
            raise EngineError(UNAVAILABLE, f"KV receiver refused: {e}") from e
        fut.add_done_callback(lambda f: self._on_kv(rid, transfer_id, f))

    def wake(self) -> None:
        """Make both loops look for work now (new work arrived)."""
        super().wake()
        self._prefill_wake.set()

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
        self.wake()

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
        batches: dict[int, object] = {}
        for rid, ev in events:
            sink = self._sinks.pop(rid, None) if is_terminal(ev) else self._sinks.get(rid)
            if sink is None:
                continue
            batch = getattr(sink, "batch", None)
            if batch is not None:
                batches[id(batch)] = batch
            try:
                sink(ev)
            except Exception:  # noqa: BLE001 - a broken sink must not stop the engine
                log.exception("event sink of request %s raised", rid)
        for batch in batches.values():
            try:
                batch.flush()  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001
                log.exception("event batch flush raised")
        if self.receiver is not None:
            for tid in released:
                try:
                    self.receiver.cancel(tid)
                except Exception:  # noqa: BLE001
                    log.exception("receiver.cancel(%d) raised", tid)

    def _fail_all(self, code: str, message: str) -> None:
        with self._lock:
            self._apply_kv_notices()
            for rid in list(self._sinks):
                self.scheduler.fail(rid, code, message)
            self._flush()

    def _close_transport(self) -> None:
        if self._owns_receiver and self.receiver is not None:
            self.receiver.close()
            self._owns_receiver = False

    # ------------------------------------------------------------------------------- stepping
    def has_work(self) -> bool:
        """True while a step would compute or admit something (or a KV notice is queued), the
        prefill thread's steps included."""
        with self._lock:
            return (
                self.scheduler.has_work()
                or self.scheduler.has_prefill_work()
                or not self._kv_notices.empty()
            )

    def start(self) -> None:
        """Start the step loop and, with ``prefill_thread``, the prefill loop (idempotent).
        Raises RuntimeError after :meth:`shutdown`."""
        with self._lock:
            if self.prefill_thread and self._prefill_loop is None and not self.is_closed:
                self._inline_prefill = False  # before either loop runs a step
                self._prefill_loop = threading.Thread(
                    target=self._run_prefill_loop, name=f"{self.name}-prefill", daemon=True
                )
                self._prefill_loop.start()
        super().start()

    def _run_prefill_loop(self) -> None:
        self._run_loop(self.prefill_step, self._prefill_wake, "prefill step")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop both loops, then as :meth:`WorkerEngine.shutdown`. Idempotent."""
        with self._lock:
            self._closed = True
            thread, self._prefill_loop = self._prefill_loop, None
        self._prefill_wake.set()
        if thread is not None:
            thread.join(timeout_s)
        super().shutdown(timeout_s)

    def prefill_step(self) -> int:
        """Run one prefill-thread step (chunks of queued local prompts; see module docstring).
        Returns the number of prompt tokens computed (0 when none were queued). A runner
        exception fails that step's requests (INTERNAL) and is logged, not raised."""
        with self._lock:
            output = self.scheduler.schedule_prefill()
            self._flush()
            if output.is_empty:
                self.scheduler.update_prefill(output, [])
                return 0
        s = self.scheduler
        if self._forward(output, s.update_prefill, s.fail_prefill_step) is None:
            return 0
        super().wake()  # prompts that finished join the decode batch at once
        return output.num_scheduled_tokens

    def _forward(
        self,
        output: DecodeOutput,
        update: Callable[
            [DecodeOutput, list[SampledToken | None], dict[str, PromptLogprobs]], None
        ],
        fail: Callable[[DecodeOutput, str], None],
    ) -> float | None:
        """Compute ``output`` (lock not held), then apply it with ``update`` under the lock and
        deliver its events; a runner exception, or ``update``'s ValueError, ends the step's
        requests through ``fail`` instead (logged, not raised). Returns the forward's seconds,
        None when it raised."""
        t0 = time.perf_counter()
        try:
            out = self.runner.run(output.scheduled)
        except Exception as e:  # noqa: BLE001 - the worker survives a bad batch
            log.exception("forward failed for %d sequences", len(output.scheduled))
            with self._lock:
                fail(output, f"forward failed: {type(e).__name__}: {e}")
                self._flush()
            return None
        duration = time.perf_counter() - t0
        with self._lock:
            try:
                update(output, out.tokens, out.prompt_logprobs)
            except ValueError as e:
                fail(output, str(e))
            self._flush()
        return duration

    @property
    def num_live(self) -> int:
        """Requests holding state here (waiting for KV, waiting, running)."""
        with self._lock:
            return len(self._sinks)

    def step(self) -> int:
        """Run one step: apply KV notices, schedule (expiring deadlines), forward, update.
        Returns the number of tokens computed (0 when nothing ran).

        A runner exception fails that step's requests (INTERNAL) and is logged, not raised.
        With ``prefill_thread`` but no prefill loop running (:meth:`start` not called), a prefill
        step runs first, in this thread.
        """
        computed = 0
        if self.prefill_thread and self._inline_prefill:
            computed = self.prefill_step()
        with self._lock:
            self._apply_kv_notices()
            if self.faults is not None and self.scheduler.num_running:
                self.faults.at(FaultPhase.DECODE_RUNNING)
            output = self.scheduler.schedule()
            self._flush()
            if output.is_empty:
                self.scheduler.update_from_output(output, [])
                return computed
        s = self.scheduler
        duration = self._forward(output, s.update_from_output, s.fail_step)
        if duration is None:
            return computed
        with self._lock:
            self._record_step(duration, output.num_sampled, len(output.seqs))
        return computed + output.num_scheduled_tokens

    # ------------------------------------------------------------------------------- stats
    def stats(self) -> DecodeEngineStats:
        """A consistent snapshot of the engine's counters (see DecodeEngineStats)."""
        with self._lock:
            s = self.scheduler
            step_ms, tok_s = self.window.rates()
            return DecodeEngineStats(
                worker_id=self.worker_id,
                num_running=s.num_running,
                num_waiting_for_kv=s.num_waiting_for_kv,
                num_waiting=s.num_waiting,
                kv_blocks_free=self.kv.num_free_blocks,
                kv_blocks_total=self.kv.num_blocks,
                step_time_ms=step_ms,
                generation_tokens_per_s=tok_s,
                num_preemptions=s.num_preemptions,
                num_finished=s.num_finished,
                kv_endpoint=self.kv_endpoint,
                batch_size=self.window.mean_batch(),
                generation_tokens=self.window.total_tokens,
                transfer_bytes_received=self.receiver.stats().bytes if self.receiver else 0,
            )

    def check_integrity(self) -> None:
        """Assert the scheduler's and the KV manager's invariants. Raises AssertionError."""
        with self._lock:
            self.scheduler.check_integrity()
            for rid in self._sinks:
                if not self.scheduler.has(rid):
                    raise AssertionError(f"sink kept for request {rid!r} that is not live")
