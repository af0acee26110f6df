"""The router core both gateways call: validate, admit, fan out ``n`` sequences, produce text.

``Router.submit`` checks a tokenized request (token ids in the vocabulary, ``n``, the context
length: :func:`router.admission.resolve_max_tokens`), takes a place in the admission queue
(:class:`router.admission.AdmissionController`) and returns a :class:`RequestStream`. Iterating the
stream runs one :class:`router.lifecycle.RequestLifecycle` per sequence in its own task and yields
:class:`ChoiceDelta` items, one per output token, in arrival order across sequences, then one
final item per sequence carrying its ``finish_reason``.

Text is produced here, not on workers: an :class:`~pdserve.tokenizer.IncrementalDetokenizer` per
sequence turns ids into text pieces and a :class:`~pdserve.tokenizer.StopMatcher` applies stop
strings; a hit ends the sequence with ``finish_reason="stop"`` and closes its lifecycle, which
sends Abort to the workers. As in vLLM, the text of the token that ended a sequence by EOS or a
stop token id is not included in the output.

Seeds: with ``n`` > 1 and a seed, sequence *i* samples with ``seed + i`` so the sequences differ
yet the request stays reproducible.

The file runs just past 450 lines: the stream, its per-sequence text production and the Router's
checks share the request's state and are read together; prompt preparation (router/prompts.py)
and tool-call parsing (router/tool_parsers.py) already live apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve import metrics, rpc
from pdserve.config import ServeConfig
from pdserve.sampling_params import MAX_STOP_TOKEN_IDS, SamplingError, SamplingParams
from pdserve.tokenizer import IncrementalDetokenizer, StopMatcher, Tokenizer
from pdserve.types import SampledToken
from router.admission import AdmissionController, Ticket, resolve_max_tokens
from router.errors import BadRequest, Overloaded, RouterError, ShuttingDown, WorkerFailure
from router.lifecycle import LifecycleConfig, RequestLifecycle, RequestState
from router.policy import PrefillPolicy
from router.pool import WorkerPool
from router.prompt_log import PromptLog
from router.prompts import PromptPreparer
from router.readiness import check_ready
from router.request_id import current_request_id, current_request_scope
from router.request_log import RequestLog
from router.serving_stats import ServingStats
from router.tool_parsers import select_parser
from router.worker_client import cancelled_by_caller

log = logging.getLogger(__name__)

_SEED_MODULUS = 2**63


@dataclass(frozen=True)
class RouterConfig:
    """What the router enforces. Token counts in tokens, times in seconds.

    ``max_model_len``: prompt + output limit. ``max_n``: sequences per prompt (``n``).
    ``max_sequences``: sequences per request over all its prompts (prompts x ``n``).
    ``lifecycle``: placement/retry knobs (``block_size`` must match the workers').
    ``log_prompts``: log prompt and output texts (``--log-prompts``; router/prompt_log.py).
    ``chat_template``: a Jinja chat template used instead of the model's (``--chat-template``).
    ``tool_call_parser``: 'hermes' | 'json' | None (chosen from the chat template).
    """

    model_name: str
    max_model_len: int
    # defaults: the ones `pdserve serve` has (one place: pdserve/config.py)
    max_queued_requests: int = ServeConfig.max_queued_requests
    max_queued_tokens: int = ServeConfig.max_queued_tokens
    request_timeout_s: float = ServeConfig.request_timeout_s
    max_n: int = 16
    max_sequences: int = 64
    log_prompts: bool = False
    lifecycle: LifecycleConfig = dataclasses.field(default_factory=LifecycleConfig)
    chat_template: str | None = None
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.max_sequences < self.max_n:
            raise ValueError(
                f"max_sequences must be >= max_n ({self.max_n}), got {self.max_sequences}"
            )


@dataclass(frozen=True)
class ChoiceDelta:
    """New output of sequence ``index``: ``text`` (may be "") behind ``tokens``.

    The last item of a sequence has ``finish_reason`` "stop" | "length" and carries the last
    token when it is known to be last (EOS / stop id, stop string, max_tokens); ``stop_reason``
    is then the matched stop string or stop token id (None for EOS, length or an early end).
    """

    index: int
    text: str
    tokens: tuple[SampledToken, ...] = ()
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that hit


class RequestStream:
    """The running output of one request. Iterate it; ``aclose()`` (or ``close_nowait()``) ends it.

    Closing before every sequence finished aborts the rest (counted as a client disconnect).
    ``completion_tokens`` and ``cached_tokens`` are final once iteration ends.
    """

    def __init__(
        self,
        router: Router,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        ticket: Ticket,
        arrival: float,
    ) -> None:
        self.router = router
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling = sampling
        self.n = sampling.n
        self.created = int(time.time())
        self.arrival = arrival
        self.lifecycles: list[RequestLifecycle] = []
        self._ticket = ticket
        self._queue: asyncio.Queue[ChoiceDelta | BaseException] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._finished = 0
        self._first_tokens = 0
        self._closed = False
        self._ended_by: RouterError | None = None  # set by cancel(): the server ended it
        router._open.add(self)
        metrics.REQUESTS_WAITING.inc()
        metrics.REQUESTS_RUNNING.inc()
        router.stats.request_admitted(len(prompt_token_ids))
        self.record = router.requests.open(
            current_request_id() or request_id,
            request_id,
            arrival,
            len(prompt_token_ids),
            self.n,
            current_request_scope(),
        )

    @property
    def completion_tokens(self) -> int:
        return sum(len(lc.output) for lc in self.lifecycles)

    @property
    def cached_tokens(self) -> int:
        return max((lc.cached_tokens for lc in self.lifecycles), default=0)

    @property
    def prompt_logprobs(self) -> tuple[SampledToken, ...] | None:
        """Prompt tokens 1..n-1 with logprobs (when ``sampling.prompt_logprobs`` is set), known
        once the first token of a sequence arrived; None before or when not asked."""
        for lc in self.lifecycles:
            if lc.prompt_logprobs is not None:
                return lc.prompt_logprobs
        return None

    @property
    def done(self) -> bool:
        return self._finished >= self.n

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> ChoiceDelta:
        # NOTE: the one place that guarantees release: any way out of here other than an item
        # (end, error, a failure to start, the consumer's cancellation) closes the stream, which
        # returns the admission ticket and the running/waiting gauges exactly once.
        try:
            if not self._tasks and not self._closed and self._ended_by is None:
                self._start()
            if self.done or self._closed:
                raise StopAsyncIteration
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
        except BaseException:
            self.close_nowait()
            raise
        if item.finish_reason is not None:
            self._finished += 1
        return item

    def _start(self) -> None:
        """Start one task per sequence. A router bug here is reported as WorkerFailure (500)."""
        loop = asyncio.get_running_loop()
        try:
            for i in range(self.n):
                lc = self.router._lifecycle(self, i)
                self.lifecycles.append(lc)
                self._tasks.append(loop.create_task(self._run(i, lc)))
        except RouterError:
            raise
        except Exception as e:
            log.exception("%s: cannot start its sequences", self.request_id)
            raise WorkerFailure(f"internal error: {e!r}") from e

    def _first_token(self) -> None:
        self._first_tokens += 1
        if self._first_tokens == self.n:
            self._release_ticket()

    def _release_ticket(self) -> None:
        if not self._ticket.released:
            self._ticket.release()
            metrics.REQUESTS_WAITING.dec()

    def close_nowait(self) -> None:
        """End the request now (idempotent, never awaits): cancel unfinished sequences."""
        if self._closed:
            return
        self._closed = True
        self.router._open.discard(self)
        self._release_ticket()
        metrics.REQUESTS_RUNNING.dec()
        client_left = (
            self._ended_by is None and not self.done and any(not t.done() for t in self._tasks)
        )
        if client_left:
            metrics.CLIENT_DISCONNECTS.inc()
        self.router.stats.request_closed(client_left)
        self.router.requests.close(self.record)
        for task in self._tasks:
            task.cancel()

    def cancel(self, error: RouterError) -> None:
        """End the request from the server's side (a shutdown): its unfinished sequences are
        cancelled, which aborts them on their workers, and the consumer gets ``error`` after
        the output already queued (HTTP: an error event then ``[DONE]``, or an error response;
        gRPC: a GenerateError). Idempotent; nothing once the request is closed or done."""
        if self._closed or self.done or self._ended_by is not None:
            return
        self._ended_by = error
        self._queue.put_nowait(error)
        for task in self._tasks:
            task.cancel()

    async def aclose(self) -> None:
        """``close_nowait()`` and wait for the sequence tasks to wind down."""
        self.close_nowait()
        if self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self, index: int, lc: RequestLifecycle) -> None:
        """One sequence: lifecycle tokens -> text pieces -> queue.

        The token known to be the last (a stop token id or EOS, which workers stop on; the one
        completing a stop string; the max_tokens-th) rides in the finishing ChoiceDelta, so a
        stream never sends an empty token chunk just before its finish chunk.
        """
        tok = self.router.tokenizer
        sampling = lc.sampling
        detok = IncrementalDetokenizer(tok, self.prompt_token_ids, sampling.skip_special_tokens)
        stops = (
            StopMatcher(sampling.stop, sampling.include_stop_str_in_output)
            if sampling.stop
            else None
        )
        stop_ids = set(sampling.stop_token_ids)
        eos_ids = set() if sampling.ignore_eos else set(tok.eos_token_ids)
        reason: str | None = None
        stop_reason: int | str | None = None
        held: SampledToken | None = None  # a stop-id token, sent with the finish
        last_text = ""  # text of the token that completed a stop string / max_tokens
        last_tokens: tuple[SampledToken, ...] = ()
        last: float | None = None
        gen = lc.run()
        try:
            async for t in gen:
                if self._closed:  # the consumer left; a lost cancellation must not keep us going
                    raise asyncio.CancelledError
                now = time.monotonic()
                if last is None:
                    self._first_token()
                    metrics.TTFT.observe(now - self.arrival)
                else:
                    metrics.ITL.observe(now - last)
                self.router.stats.token(None if last is None else now - last, now - self.arrival)
                last = now
                if held is not None:  # a stop id that did not end the sequence (never expected)
                    self._queue.put_nowait(ChoiceDelta(index, "", (held,)))
                    held, stop_reason = None, None
                if t.token_id in stop_ids:
                    held = t
                    stop_reason = None if t.token_id in eos_ids else t.token_id
                    continue
                text = detok.add(t.token_id)
                if stops is not None:
                    text, stopped = stops.feed(text)
                    if stopped:
                        reason, stop_reason = "stop", stops.matched
                        last_text, last_tokens = text, (t,)
                        break
                if len(lc.output) >= lc.max_tokens:  # the last token: the finish carries it
                    last_text, last_tokens = text, (t,)
                    continue
                self._queue.put_nowait(ChoiceDelta(index, text, (t,)))
            if reason is None:
                reason = lc.finish_reason or "stop"
                tail = detok.flush()
                if stops is not None:
                    tail, stopped = stops.feed(tail)
                    if stopped:
                        stop_reason = stops.matched
                    else:
                        tail += stops.flush()
                if reason != "stop":
                    stop_reason = None
            else:
                tail = ""
            await gen.aclose()  # a stop string hit: abort the workers
            self._observe(lc, reason)
            self.router.prompt_log.output(lc.request_id, lc.output, reason)
            tokens = last_tokens + ((held,) if held is not None else ())
            self._queue.put_nowait(
                ChoiceDelta(index, last_text + tail, tokens, reason, stop_reason)
            )
        except asyncio.CancelledError:
            await gen.aclose()
            metrics.REQUESTS_ABORTED.inc()
            self.router.stats.counts["aborted"] += 1
            if self._closed or self._ended_by is not None or cancelled_by_caller():
                raise
            # NOTE: nobody cancelled this task: a cancellation leaked from below. Tell the
            # consumer, who would otherwise wait for this sequence forever (QA D1).
            log.error("%s: sequence %d ended by a stray cancellation", self.request_id, index)
            self._queue.put_nowait(WorkerFailure("internal error: the sequence was cancelled"))
        except RouterError as e:
            metrics.REQUESTS_ABORTED.inc()
            self.router.stats.counts["aborted"] += 1
            self._queue.put_nowait(e)
        except Exception as e:  # a router bug: report it as a 500, keep serving
            log.exception("%s: sequence %d failed", self.request_id, index)
            self._queue.put_nowait(WorkerFailure(f"internal error: {e!r}"))
        finally:
            if last is None:  # ended without a token: it no longer waits either
                self._first_token()
            # every token produced and every KV transfer counts, however the sequence ended
            # (deadline, error, client), as the workers' own byte counters do
            metrics.GENERATION_TOKENS.inc(len(lc.output))
            self.router.stats.counts["generation_tokens"] += len(lc.output)
            for rec in lc.transfers:
                metrics.observe_transfer(rec.bytes, rec.ms, rec.outcome, rec.path)
                self.router.stats.kv_transfer(rec.bytes, rec.path, rec.outcome)
            for _ in range(lc.num_local_prefills):  # KV computed where it is used: nothing moved
                metrics.observe_transfer(0, 0.0, "ok", "local")
                self.router.stats.kv_transfer(0, "local", "ok")

    def _observe(self, lc: RequestLifecycle, reason: str) -> None:
        now = time.monotonic()
        metrics.REQUESTS_FINISHED.labels(finish_reason=reason).inc()
        metrics.E2E_LATENCY.observe(now - self.arrival)
        metrics.PROMPT_TOKENS.inc(len(self.prompt_token_ids))
        metrics.CACHED_PROMPT_TOKENS.inc(lc.cached_tokens)
        metrics.REQUESTS_PREEMPTED.inc(lc.num_preemptions)
        metrics.REQUESTS_MIGRATED.inc(lc.num_migrations)
        metrics.PREFILL_RETRIES.inc(lc.num_prefill_failures)
        placed = lc.state_times.get(RequestState.PREFILLING)
        if placed is not None:
            metrics.QUEUE_TIME.observe(placed - self.arrival)
        tpot = None
        if lc.first_token_time is not None and len(lc.output) > 1:
            tpot = (now - lc.first_token_time) / (len(lc.output) - 1)
            metrics.TPOT.observe(tpot)
        self.router.stats.sequence_finished(
            reason,
            now - self.arrival,
            tpot,
            lc.num_preemptions,
            lc.num_migrations,
            lc.cached_tokens,
        )


class Router:
    """Validation, admission and sequence fan-out over a :class:`WorkerPool`."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Tokenizer,
        pool: WorkerPool,
        prefill_policy: PrefillPolicy | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.pool = pool
        self.prefill_policy = prefill_policy or PrefillPolicy()
        self.admission = AdmissionController(config.max_queued_requests, config.max_queued_tokens)
        self.prompt_log = PromptLog(tokenizer, config.log_prompts)  # off: no user text in logs
        # both gateways tokenize (and check structured-output specs) through it
        self.prompts = PromptPreparer(tokenizer, config.chat_template)
        # how tool calls are read from chat output (both gateways)
        self.tool_parser = select_parser(
            config.tool_call_parser, config.chat_template or tokenizer.hf.chat_template
        )
        self.stats = ServingStats()  # the operators' view (/v1/cluster/status)
        self.requests = RequestLog()  # per-request records (/v1/requests/{id})
        self._open: set[RequestStream] = set()  # admitted, not closed yet
        self._shutting_down = False
        self.stopping = asyncio.Event()  # set with _shutting_down (what waits on it: body_limit)

    @property
    def accepting(self) -> bool:
        """False once the router stops admitting (:meth:`stop_admitting`)."""
        return not self._shutting_down

    @property
    def num_open(self) -> int:
        """Requests admitted and not yet closed (finished, failed or ended)."""
        return len(self._open)

    def stop_admitting(self) -> None:
        """Refuse new requests with :class:`ShuttingDown` (503); those in flight go on."""
        self._shutting_down = True
        self.stopping.set()

    def shut_down(self) -> int:
        """Stop serving (the gateways are stopping): refuse new requests and end every open
        one with :class:`ShuttingDown` (503), aborting its sequences on their workers (the
        aborts run in the background: ``drain_background``). Idempotent. Returns how many
        requests were ended."""
        self.stop_admitting()
        err = ShuttingDown("the server is shutting down; retry the request on another server")
        open_now = [s for s in self._open if not s.done]
        for s in open_now:
            s.cancel(err)
        return len(open_now)

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        prompt_param: str = "prompt",
    ) -> RequestStream:
        """Validate and admit one prompt. Raises NoWorkers (not ready) / BadRequest /
        ContextLengthExceeded / Overloaded.

        ``sampling.max_tokens`` None = the rest of the context. ``prompt_param`` names the request
        field the prompt came from in errors ("prompt" or "messages"). The returned stream must be
        iterated to the end or closed.
        """
        arrival = time.monotonic()
        ids = list(prompt_token_ids)
        if self._shutting_down:
            raise ShuttingDown("the server is shutting down; send the request to another server")
        check_ready(self.pool)  # 503 + Retry-After while no decode worker is up
        self.check_token_ids(ids, prompt_param)
        if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:  # the client's, before EOS ids
            raise BadRequest(
                f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids, "
                f"got {len(sampling.stop_token_ids)}",
                param="stop_token_ids",
            )
        self.check_token_ids(sampling.stop_token_ids, "stop_token_ids")
        self.check_token_ids([t for t, _ in sampling.logit_bias], "logit_bias")
        self.check_token_ids(sampling.allowed_token_ids or (), "allowed_token_ids")
        if sampling.n > self.config.max_n:
            raise BadRequest(f"'n' must be <= {self.config.max_n}, got {sampling.n}", param="n")
        max_tokens = resolve_max_tokens(
            len(ids), sampling.max_tokens, self.max_model_len, prompt_param
        )
        stop_ids = tuple(sampling.stop_token_ids)
        if not sampling.ignore_eos:  # the router hides the text of EOS: make workers stop on it
            stop_ids += tuple(t for t in self.tokenizer.eos_token_ids if t not in stop_ids)
        try:
            sampling = dataclasses.replace(sampling, max_tokens=max_tokens, stop_token_ids=stop_ids)
            sampling.check_min_tokens_reachable(self.tokenizer.eos_token_ids)
            rpc.sampling_to_proto(sampling)  # everything a worker will see must fit the wire
        except SamplingError as e:
            raise BadRequest(str(e), param=e.field) from None
        except ValueError as e:  # protobuf range checks: a field SamplingParams does not bound
            raise BadRequest(f"a sampling value does not fit the worker protocol: {e}") from None
        try:
            ticket = self.admission.admit(len(ids) * sampling.n, prompt_param)
        except Overloaded as e:
            metrics.REQUESTS_REJECTED.inc()
            self.stats.request_rejected()
            self.requests.reject(
                current_request_id() or request_id,
                request_id,
                len(ids),
                str(e),
                current_request_scope(),
            )
            raise
        self.prompt_log.prompt(request_id, ids)
        return RequestStream(self, request_id, ids, sampling, ticket, arrival)

    def check_num_sequences(self, num_prompts: int, n: int) -> None:
        """Raise BadRequest when prompts x ``n`` exceed ``max_sequences``."""
        if num_prompts * n > self.config.max_sequences:
            raise BadRequest(
                f"the request asks for {num_prompts} prompts x n={n} = {num_prompts * n} "
                f"sequences; at most {self.config.max_sequences} are allowed per request",
                param="prompt" if num_prompts > 1 else "n",
            )

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        """Raise BadRequest naming ``param`` when an id is outside ``[0, vocab_size)``."""
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequest(
                f"'{param}' holds token id {bad}, outside the vocabulary [0, {vocab})", param=param
            )

    def _lifecycle(self, stream: RequestStream, index: int) -> RequestLifecycle:
        sampling = stream.sampling
        if stream.n > 1 and sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=(sampling.seed + index) % _SEED_MODULUS)
        rid = stream.request_id if stream.n == 1 else f"{stream.request_id}-{index}"
        return RequestLifecycle(
            rid,
            stream.prompt_token_ids,
            sampling,
            self.pool,
            self.config.lifecycle,
            deadline=stream.arrival + self.config.request_timeout_s,
            prefill_policy=self.prefill_policy,
            trace=stream.record.add_sequence(
                rid, index, len(stream.prompt_token_ids), self.config.lifecycle.block_size
            ),
        )
