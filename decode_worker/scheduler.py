"""Decode-worker scheduling policy: reservations, continuous batching, preemption (no torch).

Lifecycle of one sequence (DESIGN §4; the policy in full is in docs/worker_core.md)::

    add_request ──remote──> WAITING_FOR_KV ──kv_arrived──> WAITING ──admit──> RUNNING ──> finished
                ├─local───────────────────────────────────> WAITING            │
                └─local, prefill thread─> PREFILLING ─prompt done─> WAITING    └─> preempted

``add_request`` reserves KV for the whole prompt at once, leaving an admission watermark free;
``schedule`` admits waiting sequences in arrival order (``queue_by_arrival``: when each first
arrived at its router, so a re-placed sequence keeps its place) up to ``max_num_seqs``, gives every
decoding sequence one token (preempting the newest running sequence when no block is free), then
prefill chunks of local prefills (one chunk per step while decodes run); ``update_from_output``
appends the sampled tokens and applies the stop check. With ``prefill_thread`` (see DecodeEngine),
local prompts skip the decode steps instead: ``schedule_prefill`` / ``update_prefill`` plan and
apply the steps of the engine's prefill thread, which computes prompt chunks concurrently with the
decode steps, and a prompt whose last chunk sampled token 1 joins the waiting queue like a remote
prompt whose KV arrived. The two kinds of step touch disjoint sequences. While fewer sequences
decode than local prompts wait (a burst of new prompts, such as a closed loop of clients that all
start over at once), a decode step also takes chunks of the prompts the prefill thread is not
computing, up to the prefill step budget, so both threads prefill until the batch fills again.
Events and released transfer ids go to an outbox (``drain``).
Structured output: a sequence's grammar matcher is advanced over token 1 when its KV arrives (the
sampler advances it over tokens sampled here); a local prefill asking for prompt logprobs skips
the prefix-cache lookup and gathers them chunk by chunk for its first TokensEvent.

The file runs past 550 lines: the sequence state machine (intake, KV arrival, the decode step,
the prefill thread's step, preemption, release) shares one set of queues and the in-step
bookkeeping, and reads best whole.

NOTE: blocks of a sequence inside the step being computed are freed only in
``update_from_output`` (``update_prefill`` for a prefill-thread step), so a block a forward is
writing is never handed to another request.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from decode_worker.request import (
    DecodeEvent,
    DecodeRequest,
    ErrorEvent,
    FinishedEvent,
    PreemptedEvent,
    TokensEvent,
)
from pdserve.config import SchedulerConfig
from pdserve.engine.batch import ScheduledSeq, SchedulerOutput
from pdserve.engine.errors import (
    ALREADY_EXISTS,
    CANCELLED,
    DEADLINE_EXCEEDED,
    INTERNAL,
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    EngineError,
)
from pdserve.engine.long_prompts import default_long_threshold, long_chunk
from pdserve.engine.sequence import EngineSeq, queue_by_arrival
from pdserve.kv_cache.manager import KVCacheManager
from pdserve.sampling_params import SamplingParams
from pdserve.structured.spec import StructuredOutputError
from pdserve.types import PromptLogprobs, SampledToken

if TYPE_CHECKING:
    from pdserve.structured.grammar import GrammarMatcher


class SeqState(enum.Enum):
    """Where a sequence is in its lifecycle (see module docstring)."""

    WAITING_FOR_KV = "waiting_for_kv"  # blocks reserved; KV transfer pending
    PREFILLING = "prefilling"  # local prompt queued for (or in) the prefill thread's steps
    WAITING = "waiting"  # KV present (or local prefill pending); waiting for a batch slot
    RUNNING = "running"  # admitted: prefilling locally in chunks, or decoding
    DONE = "done"  # finished, preempted, aborted or failed; holds no blocks (or will not soon)


@dataclass(eq=False)
class DecodeSeq(EngineSeq[DecodeRequest]):
    """One request attempt on this worker (see EngineSeq). ``key``: the KV-table key, unique per
    attempt. ``kv_deadline``: wall seconds by which a remote prompt's KV must arrive.
    ``grammar`` (EngineSeq) is advanced over every output token, received or sampled here.
    ``prompt_logprobs``: gathered chunk by chunk during a local prefill that asked for them."""

    key: str = ""
    transfer_id: int = 0
    state: SeqState = SeqState.WAITING_FOR_KV
    kv_deadline: float | None = None
    prompt_logprobs: list[SampledToken] = field(default_factory=list)

    @property
    def is_prefilling(self) -> bool:
        """True while prompt KV is still missing (local prefill only)."""
        return self.num_computed < self.num_prompt_tokens


DecodeOutput = SchedulerOutput[DecodeSeq]


def admission_watermark(num_blocks: int) -> int:
    """Blocks a new reservation must leave free in a pool of ``num_blocks``: 1% rounded up (the
    default of vLLM's admission watermark), at most ``num_blocks - 1``."""
    return min(-(-num_blocks // 100), num_blocks - 1)


class DecodeScheduler:
    """Continuous-batching policy of one decode worker over a :class:`KVCacheManager`.

    ``max_model_len``: prompt + output tokens per request (already the min of the scheduler
    config and the model's position limit). ``vocab_size`` bounds token ids.
    ``eos_token_ids``: the model's EOS ids. ``default_kv_timeout_s``: seconds a reservation waits
    for its KV when the request names none. ``watermark_blocks``: blocks a new reservation must
    leave free. ``check_sampling``: the sampler's check of a request's sampling values (raises
    SamplingError). ``clock``: wall time in seconds (``time.time``). ``prefill_thread``: local
    prompts are computed by :meth:`schedule_prefill` steps (the engine's prefill thread), not inside
    decode steps; ``prefill_step_tokens`` caps the prompt tokens of such a step (0 =
    ``max_num_batched_tokens``). Not thread-safe: the engine serialises calls.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        config: SchedulerConfig,
        *,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        default_kv_timeout_s: float = 30.0,
        watermark_blocks: int = 0,
        check_sampling: Callable[[SamplingParams], None] | None = None,
        clock: Callable[[], float] = time.time,
        prefill_thread: bool = False,
        prefill_step_tokens: int = 0,
    ) -> None:
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {max_model_len}")
        if default_kv_timeout_s <= 0:
            raise ValueError(f"default_kv_timeout_s must be > 0, got {default_kv_timeout_s}")
        self.kv = kv
        self.config = config
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.default_kv_timeout_s = default_kv_timeout_s
        if not 0 <= watermark_blocks < kv.num_blocks:
            raise ValueError(
                f"watermark_blocks must be in [0, {kv.num_blocks}), got {watermark_blocks}"
            )
        self.watermark_blocks = watermark_blocks
        self.check_sampling = check_sampling
        self.clock = clock
        threshold = config.long_prefill_token_threshold or config.max_num_batched_tokens // 2
        self.chunk_size = max(1, min(threshold, config.max_num_batched_tokens))
        self.prefill_thread = prefill_thread
        self.prefill_step_tokens = prefill_step_tokens or config.max_num_batched_tokens
        # the prefill thread's long prompts: the prefill worker's share (pdserve/engine/long_prompts)
        self.long_threshold = config.long_prefill_token_threshold or default_long_threshold(
            config.max_num_batched_tokens
        )
        self._last_prefill_had_long = False
        # local prompts of the prefill thread; both queues in arrival order (queue_by_arrival)
        self._prefilling: deque[DecodeSeq] = deque()
        self._in_prefill: set[str] = set()  # keys of sequences in the prefill step being computed
        self._deferred_prefill_free: list[str] = []
        self._seqs: dict[str, DecodeSeq] = {}  # live attempts by request id
        self._waiting: deque[DecodeSeq] = deque()  # KV present, waiting for a batch slot
        self._running: list[DecodeSeq] = []  # admission order, oldest first
        self._in_step: set[str] = set()  # keys of sequences in the step being computed
        self._deferred_free: list[str] = []  # keys to free when the step ends
        self._events: list[tuple[str, DecodeEvent]] = []
        self._released_transfers: list[int] = []
        self._keys = itertools.count()
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_generated_tokens = 0

    # ------------------------------------------------------------------------------- queries
    @property
    def num_running(self) -> int:
        """Sequences admitted to the batch (local prefills included)."""
        return len(self._running)

    @property
    def num_waiting_for_kv(self) -> int:
        """Reservations whose KV has not arrived."""
        return sum(1 for s in self._seqs.values() if s.state is SeqState.WAITING_FOR_KV)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for a batch slot: remote ones whose KV arrived and local prefills
        (those of the prefill thread included)."""
        return len(self._waiting) + len(self._prefilling)

    def has_work(self) -> bool:
        """True when a decode step would compute something (or admit a waiting sequence)."""
        return bool(self._running or self._waiting)

    def has_prefill_work(self) -> bool:
        """True when a prefill-thread step would compute something."""
        return bool(self._prefilling)

    def get(self, request_id: str) -> DecodeSeq | None:
        """The live attempt of ``request_id``, or None."""
        return self._seqs.get(request_id)

    def has(self, request_id: str) -> bool:
        """True while ``request_id`` is live here."""
        return request_id in self._seqs

    def state(self, request_id: str) -> SeqState | None:
        """The live request's state, or None."""
        seq = self._seqs.get(request_id)
        return None if seq is None else seq.state

    # ------------------------------------------------------------------------------- intake
    def validate(self, req: DecodeRequest) -> None:
        """Raise EngineError naming the first bad field of ``req`` (``EngineRequest.validate``
        plus ``kv_timeout_s``): INVALID_ARGUMENT, DEADLINE_EXCEEDED."""
        req.validate(
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            check_sampling=self.check_sampling,
            now=self.clock(),
        )
        if req.kv_timeout_s is not None and req.kv_timeout_s <= 0:
            raise EngineError(
                INVALID_ARGUMENT, f"'kv_timeout_s' must be > 0, got {req.kv_timeout_s}"
            )

    def add_request(
        self, req: DecodeRequest, transfer_id: int = 0, grammar: GrammarMatcher | None = None
    ) -> list[int]:
        """Reserve blocks for ``req``'s prompt and queue it. Returns the reserved block table.

        Remote requests (``prefill_locally`` False) wait for :meth:`kv_arrived` under
        ``transfer_id``. ``grammar``: the request's structured-output state, already advanced
        over the earlier output in its prompt. Raises EngineError: INVALID_ARGUMENT or
        DEADLINE_EXCEEDED (see :meth:`validate`), ALREADY_EXISTS (the request id is live here),
        RESOURCE_EXHAUSTED (not enough free blocks).
        """
        self.validate(req)
        if req.request_id in self._seqs:
            raise EngineError(ALREADY_EXISTS, f"request {req.request_id!r} is already live")
        seq = DecodeSeq(
            req,
            key=f"{req.request_id}#{next(self._keys)}",
            transfer_id=transfer_id,
            grammar=grammar,
        )
        prompt = seq.token_ids
        n = len(prompt)
        computed: list[int] = []
        num_cached = 0
        # NOTE: prompt logprobs need every prompt token computed, so such a request skips the cache
        if req.prefill_locally and req.sampling.prompt_logprobs is None:
            computed, num_cached = self.kv.get_computed_blocks(prompt)
        need = self.kv.num_blocks_needed(n) - len(computed)
        free = self.kv.num_free_blocks
        table = None
        if need <= free - self.watermark_blocks:
            table = self.kv.allocate_slots(seq.key, n, computed, self._headroom(seq))
        if table is None:
            room = self.kv.num_blocks - self.watermark_blocks
            why = "never fits" if need > room else "retry later or elsewhere"
            raise EngineError(
                RESOURCE_EXHAUSTED,
                f"no KV room: prompt of {n} tokens needs {need} blocks, {free} of "
                f"{self.kv.num_blocks} free, {self.watermark_blocks} kept for running "
                f"sequences ({why})",
            )
        self._seqs[req.request_id] = seq
        if req.prefill_locally:
            seq.num_computed = seq.num_cached = num_cached
            if self.prefill_thread:
                seq.state = SeqState.PREFILLING
                queue_by_arrival(self._prefilling, seq)
            else:
                seq.state = SeqState.WAITING
                queue_by_arrival(self._waiting, seq)
        else:
            timeout = req.kv_timeout_s or self.default_kv_timeout_s
            seq.kv_deadline = self.clock() + timeout
        return table

    def _headroom(self, seq: DecodeSeq) -> int:
        """Tokens ``seq`` may still append: the rest of its ``max_tokens`` and of
        ``max_model_len`` (a placement hint for its KV blocks, see ``allocate_slots``)."""
        left = self.max_model_len - len(seq.token_ids)
        max_tokens = seq.request.sampling.max_tokens
        if max_tokens is not None:
            left = min(left, max_tokens - len(seq.output_token_ids))
        return max(left, 0)

    def kv_arrived(self, request_id: str, transfer_id: int, first_token: SampledToken) -> bool:
        """The prompt's KV is in the reserved blocks and token 1 is ``first_token``.

        Stale notices (unknown request, another attempt's transfer id, not waiting) are ignored
        and return False. If token 1 ends the request, emits Finished and frees at once.
        """
        seq = self._seqs.get(request_id)
        if seq is None or seq.transfer_id != transfer_id:
            return False
        if seq.state is not SeqState.WAITING_FOR_KV:
            return False
        if not 0 <= first_token.token_id < self.vocab_size:
            self._fail(seq, INTERNAL, f"token 1 id {first_token.token_id} is outside the vocab")
            return False
        # token 1 was sampled under the grammar on the prefill worker; an EOS ends the sequence
        # (a grammar left with no token allows only EOS: pdserve/sampling_masks.py), so the
        # matcher need not take it (it refuses an EOS before the grammar is complete)
        if seq.grammar is not None and first_token.token_id not in self.eos_token_ids:
            try:
                seq.grammar.advance([first_token.token_id])
            except StructuredOutputError as e:
                # INVALID_ARGUMENT, not INTERNAL: the request's grammar is at fault (e.g. a
                # schema that only refers to itself, which the two workers' matchers read
                # differently), and the router answers 400 instead of counting this worker as
                # lost, which made other clients' requests fail while it was marked unhealthy
                self._fail(seq, INVALID_ARGUMENT, f"token 1 from the prefill worker: {e}")
                return False
        seq.num_computed = seq.num_prompt_tokens
        seq.kv_deadline = None
        self.kv.cache_blocks(seq.key, seq.token_ids, seq.num_computed)
        reason = seq.append_token(first_token.token_id, self.eos_token_ids, self.max_model_len)
        if reason is not None:
            self._finish(seq, reason)
            return True
        seq.state = SeqState.WAITING
        queue_by_arrival(self._waiting, seq)
        return True

    def kv_failed(self, request_id: str, transfer_id: int, code: str, message: str) -> bool:
        """The KV transfer for ``transfer_id`` failed: end the request with ``code`` and free it.

        Returns False for stale notices (see :meth:`kv_arrived`).
        """
        seq = self._seqs.get(request_id)
        if seq is None or seq.transfer_id != transfer_id:
            return False
        if seq.state is not SeqState.WAITING_FOR_KV:
            return False
        self._fail(seq, code, message, release_transfer=False)
        return True

    def abort(self, request_id: str, message: str = "aborted") -> bool:
        """End ``request_id`` with CANCELLED and free its blocks. Idempotent; True if it was live.

        A sequence inside the step being computed is freed when that step's update runs.
        """
        return self.fail(request_id, CANCELLED, message)

    def fail(self, request_id: str, code: str, message: str) -> bool:
        """End ``request_id`` with an ErrorEvent(``code``) and free it like :meth:`abort`."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._fail(seq, code, message)
        return True

    # ------------------------------------------------------------------------------- stepping
    def expire(self) -> None:
        """End every request whose deadline or KV wait has passed (DEADLINE_EXCEEDED)."""
        now = self.clock()
        for seq in list(self._seqs.values()):
            dl = seq.request.deadline
            if dl is not None and now >= dl:
                self._fail(seq, DEADLINE_EXCEEDED, "request deadline passed")
            elif seq.kv_deadline is not None and now >= seq.kv_deadline:
                self._fail(
                    seq,
                    DEADLINE_EXCEEDED,
                    f"KV for transfer {seq.transfer_id} did not arrive in time",
                )

    def schedule(self) -> DecodeOutput:
        """Plan the next step (see module docstring). Events it causes go to the outbox.

        Raises RuntimeError if the previous output was not passed to :meth:`update_from_output`.
        """
        if self._in_step:
            raise RuntimeError("schedule() called before update_from_output() of the previous step")
        self.expire()
        cfg = self.config
        while self._waiting and len(self._running) < cfg.max_num_seqs:
            seq = self._waiting.popleft()
            seq.state = SeqState.RUNNING
            self._running.append(seq)

        out = DecodeOutput()
        budget = cfg.max_num_batched_tokens
        for seq in list(self._running):
            if seq.state is not SeqState.RUNNING or seq.is_prefilling:
                continue
            if out.num_decode_tokens >= budget:
                break
            headroom = self._headroom(seq)
            table = self.kv.allocate_slots(seq.key, len(seq.token_ids), headroom_tokens=headroom)
            while table is None:
                victim = self._running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
                table = self.kv.allocate_slots(
                    seq.key, len(seq.token_ids), headroom_tokens=headroom
                )
            if table is None:
                continue
            out.add(seq, seq.schedule(1, table), decode=True)

        left = budget - out.num_decode_tokens
        if out.num_decode_tokens and cfg.enable_chunked_prefill:
            left = min(left, self.chunk_size)
        for seq in self._running:
            if left <= 0:
                break
            if not seq.is_prefilling:
                continue
            remaining = seq.num_remaining_prompt_tokens
            n = min(remaining, left)
            if not cfg.enable_chunked_prefill and n < remaining:
                continue
            out.add(seq, seq.schedule(n, self.kv.block_table(seq.key)))
            left -= n
        if self.prefill_thread and out.num_decode_tokens < len(self._prefilling):
            left = min(budget - out.num_decode_tokens, self.prefill_step_tokens)
            self._add_prompt_chunks(out, left, skip=self._in_prefill)
        self._in_step = {s.key for s in out.seqs}
        return out

    def schedule_prefill(self) -> DecodeOutput:
        """Plan the prefill thread's next step: chunks of the queued local prompts in arrival
        order, at most ``prefill_step_tokens`` tokens and ``max_num_seqs`` prompts in all (with
        chunked prefill off, whole prompts only), long prompts sharing at most ``long_threshold``
        of them, and none after a step that carried long tokens while a short prompt can run (the
        prefill worker's policy, prefill_worker/scheduler.py). Expires deadlines first; events go
        to the outbox.

        Raises RuntimeError if the previous prefill step was not passed to :meth:`update_prefill`
        (or :meth:`fail_prefill_step`).
        """
        if self._in_prefill:
            raise RuntimeError("schedule_prefill() called before update_prefill() of the last step")
        self.expire()
        out = DecodeOutput()
        budget = self.prefill_step_tokens
        if self.config.enable_chunked_prefill and self._last_prefill_had_long:
            # a short-only step between long chunks while a short prompt can run
            self._add_prompt_chunks(out, budget, skip=self._in_step, long_share=0)
        if not out.seqs:
            self._add_prompt_chunks(out, budget, skip=self._in_step)
        self._last_prefill_had_long = any(self._is_long(s) for s in out.seqs)
        self._in_prefill = {s.key for s in out.seqs}
        return out

    def _is_long(self, seq: DecodeSeq) -> bool:
        """A local prompt with more than ``long_threshold`` tokens to compute after its prefix-cache
        hits (its class for its whole prefill, as on a prefill worker)."""
        return (
            self.config.enable_chunked_prefill
            and seq.num_prompt_tokens - seq.num_cached > self.long_threshold
        )

    def _add_prompt_chunks(
        self, out: DecodeOutput, left: int, skip: set[str], long_share: int | None = None
    ) -> None:
        """Add chunks of queued local prompts (prefill thread) to ``out`` in arrival order, at
        most ``left`` tokens in all and ``max_num_seqs`` sequences in ``out``, passing over those
        whose key is in ``skip`` (inside the other loop's step). Long prompts (:meth:`_is_long`)
        share at most ``long_share`` of those tokens (:func:`long_chunk`; default the whole
        ``left`` capped at ``long_threshold``) and a long prompt past its share is passed over, so
        short prompts behind it still run: the prefill worker's policy (prefill_worker/scheduler.py)."""
        long_left = min(self.long_threshold, left) if long_share is None else long_share
        for seq in self._prefilling:
            if left <= 0 or len(out.seqs) >= self.config.max_num_seqs:
                break
            if seq.key in skip:
                continue
            remaining = seq.num_remaining_prompt_tokens
            n = min(remaining, left)
            if not self.config.enable_chunked_prefill and n < remaining:
                break  # first come, first served: it runs whole in a later step
            if self._is_long(seq):
                n = long_chunk(remaining, left, long_left)
                long_left = max(0, long_left - n)
                if n == 0:
                    continue  # keeps its place; shorter prompts behind it may run
            out.add(seq, seq.schedule(n, self.kv.block_table(seq.key)))
            left -= n

    def update_prefill(
        self,
        output: DecodeOutput,
        sampled: Sequence[SampledToken | None],
        prompt_logprobs: Mapping[str, PromptLogprobs] | None = None,
    ) -> None:
        """Apply a computed prefill-thread step (arguments as :meth:`update_from_output`): a
        prompt whose last chunk ran gets token 1 (its first TokensEvent) and waits for a batch slot,
        or finishes when token 1 ends it. Raises ValueError when the lengths differ (the step
        then counts as not run)."""
        self._apply(output, sampled, prompt_logprobs, self._end_prefill_step)

    def fail_prefill_step(self, output: DecodeOutput, message: str) -> None:
        """The runner raised on a prefill-thread step: end its sequences with INTERNAL."""
        self._fail_step(output, message, self._end_prefill_step)

    def update_from_output(
        self,
        output: DecodeOutput,
        sampled: Sequence[SampledToken | None],
        prompt_logprobs: Mapping[str, PromptLogprobs] | None = None,
    ) -> None:
        """Apply a computed step: advance KV, append sampled tokens, stop, free deferred blocks.

        ``sampled[i]`` belongs to ``output.scheduled[i]`` (None where nothing was sampled).
        ``prompt_logprobs``: request id -> logprobs of prompt tokens this step's chunk predicted
        (local prefill); sent with the request's first TokensEvent.
        Raises ValueError when the lengths differ (the step then counts as not run).
        """
        self._apply(output, sampled, prompt_logprobs, self._end_step)

    def fail_step(self, output: DecodeOutput, message: str) -> None:
        """The runner raised on ``output``: end each of its sequences with INTERNAL, free them."""
        self._fail_step(output, message, self._end_step)

    def _apply(
        self,
        output: DecodeOutput,
        sampled: Sequence[SampledToken | None],
        prompt_logprobs: Mapping[str, PromptLogprobs] | None,
        end: Callable[[], None],
    ) -> None:
        """Apply a computed decode or prefill-thread step, then ``end`` it (free what was
        released mid-step). Raises ValueError when the lengths differ (ended all the same)."""
        if len(sampled) != len(output.scheduled):
            end()
            raise ValueError(
                f"runner returned {len(sampled)} results for {len(output.scheduled)} seqs"
            )
        for seq, sched, tok in zip(output.seqs, output.scheduled, sampled, strict=True):
            if seq.state is SeqState.PREFILLING:  # a prompt chunk (either kind of step)
                self._prompt_chunk_done(seq, sched, tok, prompt_logprobs)
            elif seq.state is SeqState.RUNNING:  # else aborted or expired mid-step; freed below
                token = self._computed(seq, sched, tok, prompt_logprobs)
                if token is not None:
                    self._sampled(seq, token)
        end()

    def _fail_step(self, output: DecodeOutput, message: str, end: Callable[[], None]) -> None:
        end()
        for seq in output.seqs:
            if seq.state is not SeqState.DONE:
                self._fail(seq, INTERNAL, message)

    def drain(self) -> tuple[list[tuple[str, DecodeEvent]], list[int]]:
        """Take the pending (request_id, event) pairs and the released transfer ids."""
        events, self._events = self._events, []
        released, self._released_transfers = self._released_transfers, []
        return events, released

    def check_integrity(self) -> None:
        """Assert bookkeeping invariants, then the KV manager's. Raises AssertionError."""
        for seq in self._running:
            if seq.state is not SeqState.RUNNING:
                raise AssertionError(f"{seq.key} is in the running list as {seq.state}")
        for seq in self._waiting:
            if seq.state is not SeqState.WAITING:
                raise AssertionError(f"{seq.key} is in the waiting queue as {seq.state}")
        for seq in self._prefilling:
            if seq.state is not SeqState.PREFILLING:
                raise AssertionError(f"{seq.key} is in the prefill queue as {seq.state}")
        for rid, seq in self._seqs.items():
            if seq.state is SeqState.DONE or rid != seq.request_id:
                raise AssertionError(f"live map holds {seq.key} in state {seq.state}")
            if not self.kv.has(seq.key):
                raise AssertionError(f"live {seq.key} holds no block table")
        if len(self._running) > self.config.max_num_seqs:
            raise AssertionError(f"{len(self._running)} running > max_num_seqs")
        self.kv.check_integrity()

    # ------------------------------------------------------------------------------- internals
    def _prompt_chunk_done(
        self,
        seq: DecodeSeq,
        sched: ScheduledSeq,
        tok: SampledToken | None,
        prompt_logprobs: Mapping[str, PromptLogprobs] | None,
    ) -> None:
        """Apply a computed chunk of a PREFILLING prompt: its last chunk's token 1 moves it to the
        waiting queue (or finishes it)."""
        token = self._computed(seq, sched, tok, prompt_logprobs)
        if token is None:
            return
        self._prefilling.remove(seq)
        seq.state = SeqState.WAITING
        queue_by_arrival(self._waiting, seq)
        self._sampled(seq, token)

    def _computed(
        self,
        seq: DecodeSeq,
        sched: ScheduledSeq,
        tok: SampledToken | None,
        prompt_logprobs: Mapping[str, PromptLogprobs] | None,
    ) -> SampledToken | None:
        """Advance ``seq`` over its computed tokens ``sched`` (KV cached, prompt logprobs kept);
        return the token it sampled, or None when it samples none (or the runner gave none: then
        ``seq`` fails with INTERNAL)."""
        seq.num_computed += len(sched.token_ids)
        self.kv.cache_blocks(seq.key, seq.token_ids, seq.num_computed)
        if prompt_logprobs and seq.request_id in prompt_logprobs:
            seq.prompt_logprobs.extend(prompt_logprobs[seq.request_id].tokens)
        if not sched.sample:
            return None
        if tok is None:
            self._fail(seq, INTERNAL, "runner returned no token for a sampled sequence")
        return tok

    def _sampled(self, seq: DecodeSeq, tok: SampledToken) -> None:
        """Append ``tok`` to ``seq`` (sampled here), emit it with the gathered prompt logprobs,
        finish ``seq`` when it ends the request."""
        reason = seq.append_token(tok.token_id, self.eos_token_ids, self.max_model_len)
        self.num_generated_tokens += 1
        prompt_lps, seq.prompt_logprobs = tuple(seq.prompt_logprobs), []
        self._events.append((seq.request_id, TokensEvent((tok,), prompt_lps)))
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: DecodeSeq, reason: str) -> None:
        self.num_finished += 1
        self._release(seq, FinishedEvent(reason, len(seq.output_token_ids)))

    def _preempt(self, seq: DecodeSeq) -> None:
        self.num_preemptions += 1
        ev = PreemptedEvent(tuple(seq.output_token_ids), "no free KV blocks")
        self._release(seq, ev)

    def _fail(self, seq: DecodeSeq, code: str, message: str, release_transfer: bool = True) -> None:
        self._release(seq, ErrorEvent(code, message), release_transfer=release_transfer)

    def _release(self, seq: DecodeSeq, event: DecodeEvent, release_transfer: bool = True) -> None:
        """Emit ``seq``'s last event, drop it from every queue and free (or defer) its blocks."""
        prev = seq.state
        seq.state = SeqState.DONE
        self._seqs.pop(seq.request_id, None)
        if prev is SeqState.RUNNING:
            self._running.remove(seq)
        elif prev is SeqState.WAITING:
            self._waiting.remove(seq)
        elif prev is SeqState.PREFILLING:
            self._prefilling.remove(seq)
        elif prev is SeqState.WAITING_FOR_KV and release_transfer:
            self._released_transfers.append(seq.transfer_id)
        self._events.append((seq.request_id, event))
        if seq.key in self._in_step:
            self._deferred_free.append(seq.key)
        elif seq.key in self._in_prefill:
            self._deferred_prefill_free.append(seq.key)
        else:
            self.kv.free(seq.key)

    def _end_step(self) -> None:
        self._in_step = set()
        for key in self._deferred_free:
            self.kv.free(key)
        self._deferred_free = []

    def _end_prefill_step(self) -> None:
        self._in_prefill = set()
        for key in self._deferred_prefill_free:
            self.kv.free(key)
        self._deferred_prefill_free = []
