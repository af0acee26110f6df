"""One sequence's life in the router: :class:`RequestLifecycle` drives the state machine of
:mod:`router.request_state` (DESIGN §4) over the worker pool.

It places the sequence on a decode worker (a :class:`~router.decode_attempt.DecodeAttempt`),
prefills it on a prefill worker (or locally on the decode worker in unified mode), follows the
decode stream, and re-places it after a preemption, a lost worker or a failed prefill, within
the retry budgets of :class:`LifecycleConfig`. A prefill worker that failed the sequence as if
down is not tried again for it; with no other prefill worker left, the decode worker prefills.
Usage: iterate :meth:`RequestLifecycle.run` (an async generator of ``SampledToken``); when it
ends, ``finish_reason`` is "stop" or "length".
Closing the generator early (``aclose()`` or task cancellation) aborts the sequence.

NOTE: a little over 450 lines on purpose: the transitions of one state machine read best in one
class, top to bottom (states, the decode attempt and background aborts live in their own modules).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

import grpc

from pdserve import metrics, rpc
from pdserve.kv_cache.block_pool import prefix_block_hashes
from pdserve.sampling_params import SamplingParams
from pdserve.types import SampledToken
from pdserve.v1 import worker_pb2 as pb
from router.background import spawn
from router.decode_attempt import WORKER_DOWN, DecodeAttempt, status_from_code
from router.errors import BadRequest, NoWorkers, RequestTimeout, WorkerFailure
from router.policy import (
    PrefillLoad,
    PrefillPolicy,
    blocks_for_tokens,
    prefill_locally,
    rank_decode,
)
from router.pool import WORKER_SLOW, WorkerPool, WorkerState
from router.readiness import STARTING_RETRY_AFTER_S
from router.request_log import SequenceTrace
from router.request_state import TERMINAL, RequestState, check_transition
from router.request_state import RequestState as S
from router.worker_client import cancelled_by_caller

log = logging.getLogger(__name__)


def _raise_if_unauthenticated(worker: WorkerState, code: grpc.StatusCode) -> None:
    """A worker refusing the router's internal token is a deployment error, not a busy or dead
    worker: fail the request at once (500) instead of retrying every worker forever."""
    if code is grpc.StatusCode.UNAUTHENTICATED:
        log.error(
            "worker %s refused this router's internal token: start the router and the workers "
            "with the same --internal-token / PDSERVE_INTERNAL_TOKEN",
            worker.worker_id,
        )
        raise WorkerFailure(f"worker {worker.worker_id} refused the router's credentials")


# seconds a KV reservation outlives the Prefill call's own timeout (transfer + ack time)
_KV_MARGIN_S = 30.0


@dataclass(frozen=True)
class LifecycleConfig:
    """Knobs of the lifecycle. Times in seconds.

    ``unified``: always prefill on the decode worker. ``accept_timeout_s``: wait for ``Accepted``.
    ``prefill_timeout_s``: one Prefill call. ``kv_timeout_s``: how long D keeps a reservation
    waiting for KV (0 = ``prefill_timeout_s`` plus a margin: a prompt may queue on a busy prefill
    worker for most of its Prefill call, and the reservation must outlive that wait; the router
    aborts it at once when the prefill fails). ``no_worker_timeout_s``: how long to wait for any
    decode worker to appear before failing with 503. ``max_local_prefill_length`` (tokens; 0 =
    off) and ``min_prefill_queue_tokens`` (tokens): conditional disaggregation, see
    :func:`router.policy.prefill_locally`. ``max_prefill_attempts``: failed prefills
    tolerated per sequence. ``max_replacements``: re-placements (preemptions + broken streams)
    tolerated per sequence. ``max_backoff_s``: ceiling of the wait between rounds when every
    decode worker is full.
    """

    block_size: int = 16
    unified: bool = False
    max_local_prefill_length: int = 0
    min_prefill_queue_tokens: int = 256
    accept_timeout_s: float = 30.0
    prefill_timeout_s: float = 120.0
    kv_timeout_s: float = 0.0
    no_worker_timeout_s: float = 5.0
    max_prefill_attempts: int = 3
    max_replacements: int = 16
    max_backoff_s: float = 0.5
    abort_timeout_s: float = 2.0


class RequestLifecycle:
    """Drive one sequence through prefill and decode (see the module docstring).

    ``prompt_token_ids``: the prompt (>= 1 token). ``sampling``: with ``max_tokens`` resolved
    (tokens; counts every output token). ``deadline``: ``time.monotonic()`` seconds after which
    the sequence is aborted with :class:`RequestTimeout`.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        pool: WorkerPool,
        config: LifecycleConfig,
        deadline: float,
        prefill_policy: PrefillPolicy | None = None,
        trace: SequenceTrace | None = None,
    ) -> None:
        if sampling.max_tokens is None:
            raise ValueError("sampling.max_tokens must be resolved before the lifecycle starts")
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must hold at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling = sampling
        self.max_tokens: int = sampling.max_tokens
        self.pool = pool
        self.config = config
        self.deadline = deadline
        self.policy = prefill_policy or PrefillPolicy()
        self._sampling_pb = rpc.sampling_to_proto(sampling)
        # the timeline /v1/requests/{id} shows (placements, KV transfers, re-placements)
        self.trace = trace or SequenceTrace(
            request_id, 0, len(self.prompt_token_ids), config.block_size, time.monotonic()
        )

        self.state = S.QUEUED
        self.output: list[SampledToken] = []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.cached_tokens = 0  # prompt tokens served by a prefix cache (first prefill)
        self.transfers: list[pb.TransferRecord] = []
        self.num_preemptions = 0
        self.num_migrations = 0  # re-placements after a broken stream / worker error
        self.num_local_prefills = 0  # prefills done by the decode worker itself (no KV transfer)
        self.num_prefill_failures = 0
        self.state_times: dict[RequestState, float] = {S.QUEUED: time.monotonic()}
        self._arrival = time.monotonic()  # its place in prefill workers' queues (age_ms)
        self.first_token_time: float | None = None
        # prompt tokens 1..n-1 with their logprobs, once a worker reported them (when asked)
        self.prompt_logprobs: tuple[SampledToken, ...] | None = None
        self._attempts = 0
        self._attempt: DecodeAttempt | None = None
        self._prefill_holder: tuple[WorkerState, str] | None = None
        self._prefix_hashes: list[int] | None = None
        self._failed_prefill: set[str] = set()
        # prefill workers that failed this sequence as if down (WORKER_DOWN): never tried again
        # for it, since the pool may still call them healthy (see _prefill_loads)
        self._down_prefill: set[str] = set()
        self._aborted_on: set[str] = set()  # prefill workers whose KV handoff failed (ABORTED)
        self._left_decode: set[str] = set()  # decode workers that preempted or lost this sequence

    # -- state ------------------------------------------------------------------------------

    def _set(self, new: RequestState) -> None:
        check_transition(self.state, new, self.request_id)
        if new is self.state:
            return
        log.debug("%s: %s -> %s", self.request_id, self.state.name, new.name)
        self.state = new
        self.state_times.setdefault(new, time.monotonic())

    def _retry_state(self) -> RequestState:
        return S.MIGRATING if self.output else S.QUEUED

    def _remaining(self) -> float:
        """Seconds left before the deadline; raises RequestTimeout when none."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RequestTimeout(
                f"request {self.request_id} exceeded its deadline (--request-timeout)"
            )
        return left

    def _deadline_unix_ms(self) -> int:
        return int((time.time() + (self.deadline - time.monotonic())) * 1000)

    def _age_ms(self) -> int:
        """Milliseconds since the sequence arrived here: its place in workers' queues."""
        return int((time.monotonic() - self._arrival) * 1000)

    def _unified(self) -> bool:
        """Prefill on the decode worker: unified mode, or no prefill worker this sequence may use
        (none is up, or every one failed it as if down)."""
        return self.config.unified or not self._prefill_loads()

    def _conditional_local(self) -> bool:
        """Conditional disaggregation: this prompt is short and the prefill workers are
        backlogged (see :func:`router.policy.prefill_locally`)."""
        if self.config.max_local_prefill_length <= 0:
            return False
        return prefill_locally(
            len(self.prompt_token_ids) + len(self.output),
            self._prefill_loads(),
            self.pool.decode_loads(),
            self.config.max_local_prefill_length,
            self.config.min_prefill_queue_tokens,
        )

    def _prefill_loads(self) -> list[PrefillLoad]:
        """Healthy prefill workers' loads, without those in ``_down_prefill``.

        NOTE: a worker that just died (or fails every forward pass) still looks healthy until
        its polls fail (or keeps passing them), so retrying it would spend the sequence's whole
        prefill budget there within a second (QA D6); the decode worker's local prefill is the
        fallback once no other prefill worker is left.
        """
        return [w for w in self.pool.prefill_loads() if w.worker_id not in self._down_prefill]

    # -- the state machine --------------------------------------------------------------------

    async def run(self) -> AsyncGenerator[SampledToken, None]:
        """Yield output tokens in order; ``finish_reason`` is set when the iterator ends.

        Raises RouterError subclasses (BadRequest, NoWorkers, RequestTimeout, WorkerFailure).
        """
        try:
            while self.state not in TERMINAL:
                if len(self.output) >= self.max_tokens:  # nothing left after a re-placement
                    self._end(S.FINISHED, "length")
                    break
                unified = self._unified()
                conditional = not unified and self._conditional_local()
                local = unified or conditional
                attempt = await self._place(local, prefer_idle=conditional)
                self._set(S.PREFILLING)
                if not local:
                    first, kv_sent = await self._prefill(attempt)
                    if first is None:
                        continue
                    self._set(S.DECODING)
                    for tok in self._take([first]):
                        yield tok
                    if self.state in TERMINAL:
                        break
                    if not kv_sent:  # token 1 is good but D never got the KV: re-place
                        self._lost(attempt, "KV transfer failed", None)
                        continue
                async with contextlib.aclosing(self._follow(attempt)) as tokens:
                    async for tok in tokens:
                        yield tok
        except asyncio.CancelledError:
            if cancelled_by_caller():
                self._end(S.ABORTED, None)
                raise
            # NOTE: not this task's cancellation but a worker call's, ended under it (worker
            # calls report a closed channel as UNAVAILABLE, so this is a last resort): fail with
            # an error the client sees; re-raising would end the sequence silently (QA D1).
            err = WorkerFailure("a worker call was cancelled under the request; retry it")
            self.error = err
            self._end(S.FAILED, None)
            raise err from None
        except GeneratorExit:
            self._end(S.ABORTED, None)
            raise
        except BaseException as e:
            self.error = e
            self._end(S.ABORTED if isinstance(e, RequestTimeout) else S.FAILED, None)
            raise
        finally:
            if self.state not in TERMINAL:
                self._end(S.ABORTED, None)

    def _end(self, state: RequestState, reason: str | None) -> None:
        """Enter a terminal state; release and abort everything still held."""
        if self.state in TERMINAL:
            return
        self._set(state)
        self.finish_reason = reason
        self.trace.ended(state.value, reason, len(self.output), str(self.error or ""))
        timeout = self.config.abort_timeout_s
        if self._attempt is not None:
            self._attempt.close(abort=state is not S.FINISHED, timeout_s=timeout)
            self._attempt = None
        if self._prefill_holder is not None:
            worker, attempt_id = self._prefill_holder
            self._prefill_holder = None
            spawn(worker.client.abort(attempt_id, timeout))

    def _take(self, tokens: Sequence[SampledToken]) -> list[SampledToken]:
        """Accept new tokens, never beyond max_tokens (then finish with 'length')."""
        room = self.max_tokens - len(self.output)
        accepted = list(tokens[:room])
        if accepted and self.first_token_time is None:
            self.first_token_time = time.monotonic()
            self.trace.first_token()
        self.output.extend(accepted)
        if len(self.output) >= self.max_tokens and len(tokens) > len(accepted):
            log.warning("%s: worker sent tokens past max_tokens", self.request_id)
            self._end(S.FINISHED, "length")
        return accepted

    # -- placement on a decode worker -----------------------------------------------------------

    async def _place(self, local: bool, prefer_idle: bool = False) -> DecodeAttempt:
        """Open a Decode stream on the best decode worker that accepts; wait while all are full.

        ``prefer_idle``: rank decode workers with the fewest local prefill tokens in flight
        first.
        """
        tokens = self.prompt_token_ids + [t.token_id for t in self.output]
        blocks = blocks_for_tokens(len(tokens) + 1, self.config.block_size)
        backoff = 0.02
        no_worker_since: float | None = None
        while True:
            left = self._remaining()
            ranking = rank_decode(self.pool.decode_loads(), blocks, local=prefer_idle)
            # re-placement goes elsewhere first: workers that preempted or lost it go last
            ranking.sort(key=lambda w: w in self._left_decode)
            capacity = max((w.info.num_blocks for w in self.pool.workers("decode")), default=0)
            if ranking and 0 < capacity < blocks:
                raise NoWorkers(
                    f"the sequence needs {blocks} KV blocks ({len(tokens)} tokens) but the largest "
                    f"decode worker holds {capacity} blocks"
                )
            if not ranking:
                now = time.monotonic()
                no_worker_since = no_worker_since or now
                if now - no_worker_since > self.config.no_worker_timeout_s:
                    raise NoWorkers(
                        "no decode worker is available; try again later",
                        retry_after_s=STARTING_RETRY_AFTER_S,
                    )
                await self.pool.wait_changed(min(left, 0.5))
                continue
            no_worker_since = None
            for worker_id in ranking:
                worker = self.pool.get(worker_id)
                if worker is None:
                    continue
                attempt = await self._open(worker, tokens, blocks, local)
                if attempt is not None:
                    self._attempt = attempt
                    return attempt
            await asyncio.sleep(min(backoff, self._remaining()))
            backoff = min(backoff * 2, self.config.max_backoff_s)

    def _next_attempt_id(self) -> str:
        k = self._attempts
        self._attempts += 1
        return self.request_id if k == 0 else f"{self.request_id}~{k}"

    async def _open(
        self, worker: WorkerState, tokens: list[int], blocks: int, local: bool
    ) -> DecodeAttempt | None:
        """Try one decode worker. Returns the accepted attempt, or None to try the next worker."""
        attempt_id = self._next_attempt_id()
        req = pb.DecodeRequest(
            request_id=attempt_id,
            prompt_token_ids=tokens,
            num_output_tokens=len(self.output),
            sampling=self._sampling_pb,
            prefill_locally=local,
            deadline_unix_ms=self._deadline_unix_ms(),
            kv_timeout_s=self.config.kv_timeout_s or self.config.prefill_timeout_s + _KV_MARGIN_S,
            age_ms=self._age_ms(),
        )
        timeout = min(self._remaining(), self.config.accept_timeout_s)
        attempt = DecodeAttempt(
            self.pool,
            worker,
            worker.client.decode(req),
            attempt_id,
            blocks,
            local_tokens=len(tokens) if local else 0,
        )
        abort_timeout = self.config.abort_timeout_s
        try:
            event = await attempt.read(timeout)
        except asyncio.CancelledError:  # the request ended while D reserves: cancel and abort
            attempt.close(abort=True, timeout_s=abort_timeout)
            raise
        except grpc.aio.AioRpcError as e:
            attempt.close(abort=False, timeout_s=abort_timeout)
            self._refused(worker, e.code(), e.details() or "")
            return None
        except asyncio.TimeoutError:
            attempt.close(abort=True, timeout_s=abort_timeout)
            self.pool.report_failure(worker.worker_id, slow=True)
            log.warning(
                "%s: %s did not accept within %.1f s", attempt_id, worker.worker_id, timeout
            )
            return None
        if event is grpc.aio.EOF:
            attempt.close(abort=True, timeout_s=abort_timeout)
            self.pool.report_failure(worker.worker_id)
            return None
        kind = event.WhichOneof("event")
        if kind == "accepted":
            attempt.accepted = event.accepted
            reserved = event.accepted.num_reserved_blocks or blocks
            self.trace.decode_reserved(worker.worker_id, attempt_id, reserved, local)
            self.num_local_prefills += local
            if local and not self.output:  # a local prefill: the decode worker's prefix cache
                self.cached_tokens = event.accepted.cached_tokens
            return attempt
        attempt.close(abort=True, timeout_s=abort_timeout)
        if kind == "error":
            self._refused(worker, status_from_code(event.error.code), event.error.message)
            return None
        log.error("%s: %s sent %s before Accepted", attempt_id, worker.worker_id, kind)
        self.pool.report_failure(worker.worker_id)
        return None

    def _refused(self, worker: WorkerState, code: grpc.StatusCode, details: str) -> None:
        """A decode worker refused a reservation: bad request raises, anything else moves on."""
        _raise_if_unauthenticated(worker, code)
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            raise BadRequest(f"rejected by decode worker: {details}")
        if code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
            log.warning(
                "%s: decode %s refused: %s %s",
                self.request_id,
                worker.worker_id,
                code.name,
                details,
            )
            if code in WORKER_DOWN:
                self.pool.report_failure(worker.worker_id, slow=code in WORKER_SLOW)

    # -- prefill -------------------------------------------------------------------------------

    def _affinity_hashes(self) -> list[int]:
        if self._prefix_hashes is None:
            bs = self.config.block_size
            head = self.prompt_token_ids[: self.policy.affinity_blocks * bs]
            self._prefix_hashes = prefix_block_hashes(head, bs)
        return self._prefix_hashes

    async def _prefill(self, attempt: DecodeAttempt) -> tuple[SampledToken | None, bool]:
        """Prefill on the best prefill worker with ``attempt`` as KV target.

        Returns (token 1, whether its KV reached D), or (None, False) to go round again. On
        failure the decode reservation is released and the state goes back to QUEUED (or
        MIGRATING); after ``max_prefill_attempts`` failures raises WorkerFailure. A first ABORTED
        from a prefill worker (the KV did not reach D) re-places the sequence away from D and
        keeps that prefill worker first (its prefix cache holds the prompt now); a second one
        from the same worker counts as that worker being down (its KV path is what fails).
        """
        assert attempt.accepted is not None
        ranking = self.policy.rank(self._prefill_loads(), self._affinity_hashes())
        # retry elsewhere: workers that already failed this sequence go last
        ranking.sort(key=lambda w: w in self._failed_prefill)
        if not ranking:  # every prefill worker vanished since placement: go round again
            self._drop_attempt(abort=True)
            self._set(self._retry_state())
            return None, False
        worker = self.pool.get(ranking[0])
        assert worker is not None
        tokens = self.prompt_token_ids + [t.token_id for t in self.output]
        req = pb.PrefillRequest(
            request_id=attempt.attempt_id,
            prompt_token_ids=tokens,
            sampling=self._sampling_pb,
            target=pb.KVTarget(
                transfer_id=attempt.accepted.transfer_id,
                kv_endpoint=attempt.accepted.kv_endpoint,
                decode_worker_id=attempt.accepted.decode_worker_id or attempt.worker.worker_id,
            ),
            num_output_tokens=len(self.output),
            deadline_unix_ms=self._deadline_unix_ms(),
            age_ms=self._age_ms(),
        )
        timeout = min(self._remaining(), self.config.prefill_timeout_s)  # may raise: before reserve
        tick = self.pool.reserve(worker, tokens=len(tokens))
        self._prefill_holder = (worker, attempt.attempt_id)
        self.trace.prefill_started(worker.worker_id, attempt.attempt_id, len(tokens))
        call = asyncio.ensure_future(worker.client.prefill(req, timeout))
        try:
            lost = await self._decode_lost_first(call, attempt)
            if lost is not None:  # D is gone: its KV has nowhere to go, stop computing it
                self._prefill_holder = None
                spawn(worker.client.abort(attempt.attempt_id, self.config.abort_timeout_s))
                self.trace.prefill_failed(
                    worker.worker_id, "CANCELLED", "the decode worker was lost"
                )
                self._lost(attempt, lost[0], lost[1])
                return None, False
            resp = call.result()
        except grpc.aio.AioRpcError as e:
            self._prefill_failed(worker, attempt, e.code(), e.details() or "")
            return None, False
        finally:
            if not call.done():
                call.cancel()  # the request ended, or D was lost: the prefill worker aborts it
            self.pool.release(worker, tick)
        self._prefill_holder = None
        self.transfers.append(resp.transfer)
        self.trace.prefill_done(worker.worker_id, resp, len(tokens))
        metrics.observe_prefill(resp.queue_ms, resp.compute_ms, resp.transfer_ms)
        if not self.output:
            self.cached_tokens = resp.cached_tokens
        self._got_prompt_logprobs(resp.prompt_logprobs)
        kv_sent = resp.transfer.outcome in ("", "ok")
        if not kv_sent:
            log.warning(
                "%s: KV transfer %s (%s); re-placing",
                attempt.attempt_id, resp.transfer.outcome, resp.transfer.error or "no cause given",
            )  # fmt: skip
        return rpc.token_from_proto(resp.token), kv_sent

    @staticmethod
    async def _decode_lost_first(
        call: asyncio.Future[pb.PrefillResponse], attempt: DecodeAttempt
    ) -> tuple[str, grpc.StatusCode] | None:
        """Wait for the Prefill ``call`` while watching D's stream. Returns None once the call
        is done (D's next event, if one came, stays for :meth:`_follow`), or (why, code) when
        D's stream broke or ended first: the decode worker is gone (or the router dropped it).

        Any event D sends meanwhile leaves the call to finish: tokens are normal (D got the KV
        and decoded on before the prefill worker's answer reached the router), and an error
        event (say a KV payload that failed its checksum) fails the transfer, which the call's
        own answer reports.
        """
        watch = attempt.read_ahead()
        await asyncio.wait((call, watch), return_when=asyncio.FIRST_COMPLETED)
        if not call.done() and not watch.cancelled():
            err = watch.exception()
            if isinstance(err, grpc.aio.AioRpcError):
                return f"stream broke during prefill: {err.code().name} {err.details()}", err.code()
            if err is None and watch.result() is grpc.aio.EOF:
                return "stream ended during prefill", grpc.StatusCode.UNAVAILABLE
        await asyncio.wait((call,))
        return None

    def _prefill_failed(
        self, worker: WorkerState, attempt: DecodeAttempt, code: grpc.StatusCode, details: str
    ) -> None:
        if self._prefill_holder is not None:
            spawn(worker.client.abort(attempt.attempt_id, self.config.abort_timeout_s))
            self._prefill_holder = None
        self._drop_attempt(abort=True)
        self.trace.prefill_failed(worker.worker_id, code.name, details)
        _raise_if_unauthenticated(worker, code)
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            raise BadRequest(f"rejected by prefill worker: {details}")
        if code is grpc.StatusCode.ABORTED:  # the KV handoff failed: count it with the transfers
            self.transfers.append(pb.TransferRecord(outcome="failed", path="transferred"))
        handoff = code is grpc.StatusCode.ABORTED and worker.worker_id not in self._aborted_on
        if handoff:
            # computed, but the KV did not reach D (gone, or it gave the reservation up): the
            # next placement avoids D, and this prefill worker, whose cache now holds the
            # prompt, stays first; a second ABORTED from it falls through to "down" below
            self._aborted_on.add(worker.worker_id)
            self._left_decode.add(attempt.worker.worker_id)
        elif code in WORKER_DOWN or code is grpc.StatusCode.ABORTED:
            self.pool.report_failure(worker.worker_id, slow=code in WORKER_SLOW)
            self._down_prefill.add(worker.worker_id)
        self.num_prefill_failures += 1
        if not handoff:
            self._failed_prefill.add(worker.worker_id)
        log.warning(
            "%s: prefill on %s failed (%s: %s), attempt %d/%d",
            attempt.attempt_id, worker.worker_id, code.name, details,
            self.num_prefill_failures, self.config.max_prefill_attempts,
        )  # fmt: skip
        if self.num_prefill_failures >= self.config.max_prefill_attempts:
            raise WorkerFailure(
                f"prefill failed {self.num_prefill_failures} times (last: {code.name}: {details})"
            )
        self._set(self._retry_state())

    def _drop_attempt(self, abort: bool) -> None:
        if self._attempt is not None:
            self._attempt.close(abort=abort, timeout_s=self.config.abort_timeout_s)
            self._attempt = None

    def _check_replacements(self) -> None:
        total = self.num_preemptions + self.num_migrations
        if total > self.config.max_replacements:
            raise WorkerFailure(
                f"request re-placed {total} times (limit {self.config.max_replacements}); giving up"
            )

    def _got_prompt_logprobs(self, wire: Sequence[pb.TokenLogprob]) -> None:
        """Keep the first prompt logprobs a worker reports; later placements do not ask again."""
        if self.sampling.prompt_logprobs is None or self.prompt_logprobs is not None:
            return
        self.prompt_logprobs = tuple(rpc.token_from_proto(t) for t in wire)
        self._sampling_pb.ClearField("prompt_logprobs")

    # -- decode stream ---------------------------------------------------------------------------

    async def _follow(self, attempt: DecodeAttempt) -> AsyncGenerator[SampledToken, None]:
        """Emit D's tokens until Finished (-> FINISHED) or a re-placement (-> MIGRATING)."""
        while True:
            try:
                event = await attempt.read(self._remaining())
            except asyncio.TimeoutError:
                raise RequestTimeout(
                    f"request {self.request_id} exceeded its deadline (--request-timeout)"
                ) from None
            except grpc.aio.AioRpcError as e:
                self._lost(attempt, f"stream broke: {e.code().name} {e.details()}", e.code())
                return
            if event is grpc.aio.EOF:
                self._lost(attempt, "stream ended without Finished", grpc.StatusCode.UNAVAILABLE)
                return
            kind = event.WhichOneof("event")
            if kind == "tokens":
                if self.state is S.PREFILLING:
                    attempt.prefilled()
                    self._set(S.DECODING)  # a local prefill: its logprobs ride here
                    self._got_prompt_logprobs(event.tokens.prompt_logprobs)
                for tok in self._take([rpc.token_from_proto(t) for t in event.tokens.tokens]):
                    yield tok
                if self.state in TERMINAL:
                    return
            elif kind == "finished" and self.state is S.DECODING:
                self._drop_attempt(abort=False)
                self._end(S.FINISHED, event.finished.reason or "stop")
                return
            elif kind == "preempted":
                for tok in self._take(self._reconcile(event.preempted.output_token_ids)):
                    yield tok
                if self.state not in TERMINAL:
                    self._preempted(attempt, event.preempted)
                return
            elif kind == "error":
                code = status_from_code(event.error.code)
                if code is grpc.StatusCode.INVALID_ARGUMENT:
                    raise BadRequest(f"rejected by decode worker: {event.error.message}")
                self._lost(attempt, f"error event {code.name}: {event.error.message}", code)
                return
            else:
                self._lost(attempt, f"unexpected {kind} event", grpc.StatusCode.INTERNAL)
                return

    def _reconcile(self, output_ids: Sequence[int]) -> list[SampledToken]:
        """Tokens the worker generated that the router has not emitted (normally none)."""
        have = len(self.output)
        if len(output_ids) <= have:
            return []
        return [SampledToken(token_id=t) for t in output_ids[have:]]

    def _preempted(self, attempt: DecodeAttempt, ev: pb.Preempted) -> None:
        self._drop_attempt(abort=False)
        self._left_decode.add(attempt.worker.worker_id)
        self.num_preemptions += 1
        cause = ev.reason or "preempted by the decode worker"
        self.trace.replaced("preemption", attempt.worker.worker_id, cause, len(self.output))
        log.info(
            "%s: preempted on %s (%s)", attempt.attempt_id, attempt.worker.worker_id, ev.reason
        )
        self._set(S.MIGRATING if self.state is S.DECODING else self._retry_state())
        self._check_replacements()

    def _lost(self, attempt: DecodeAttempt, why: str, code: grpc.StatusCode | None) -> None:
        """D's stream is gone: release it and re-place the sequence (MIGRATING / QUEUED)."""
        if code in WORKER_DOWN:
            self.pool.report_failure(attempt.worker.worker_id, slow=code in WORKER_SLOW)
        self._drop_attempt(abort=True)
        self._left_decode.add(attempt.worker.worker_id)
        self.num_migrations += 1
        self.trace.replaced("migration", attempt.worker.worker_id, why, len(self.output))
        log.warning(
            "%s: decode %s lost (%s); re-placing", attempt.attempt_id, attempt.worker.worker_id, why
        )
        self._set(S.MIGRATING if self.state is S.DECODING else self._retry_state())
        self._check_replacements()
