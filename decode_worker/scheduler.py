"""Decode-worker scheduling policy: reservations, continuous batching, preemption (no torch).

Lifecycle of one sequence (DESIGN §4)::

    add_request ──remote──> WAITING_FOR_KV ──kv_arrived──> READY ──admit──> RUNNING ──> finished
                └─local───────────────────────────────────> READY            │
                                                                             └─> preempted

* ``add_request`` reserves blocks for the whole prompt (earlier output tokens included) at once,
  or refuses with RESOURCE_EXHAUSTED. It leaves ``watermark_blocks`` free for the growth of
  running sequences (vLLM keeps a similar admission watermark, 1% of the pool by default), so a
  new reservation does not immediately force a preemption. A remote request then waits for its KV transfer; a local
  one (unified mode) is ready at once and is prefilled here in chunks. With prefix caching on, a
  local prompt takes its longest cached prefix first.
* ``kv_arrived`` stores token 1 (sampled by the prefill worker). If token 1 already ends the
  request the sequence finishes there; otherwise it waits for a batch slot.
* ``schedule`` runs at each step boundary: expire deadlines; admit ready sequences (FIFO) while
  fewer than ``max_num_seqs`` run; give every decoding sequence one token (oldest first), growing
  its block table when it crosses a block boundary and, when no block is free, preempting the
  newest running sequence (possibly itself) the way vLLM's recompute preemption picks its victim;
  finally hand prefill chunks to running local prefills. While decodes run, prefill tokens per
  step are capped at one chunk (``long_prefill_token_threshold``, default
  ``max_num_batched_tokens // 2``), so a long local prefill delays running decodes by at most one
  chunk per step.
* ``update`` applies the runner's sampled tokens and checks the stop conditions: EOS (unless
  ``ignore_eos``), ``stop_token_ids`` (both only once ``min_tokens`` outputs exist),
  ``max_tokens`` (every output counts, earlier attempts and token 1 included) and
  ``max_model_len``.

Events go to an outbox drained with :meth:`DecodeScheduler.drain`, with the transfer ids whose
reservation was released (for the KV receiver to forget).

NOTE: blocks of a sequence inside the step being computed (between ``schedule`` and ``update``)
are never freed mid-step: aborting or expiring such a sequence ends its stream at once but frees
its blocks in ``update``, so a block the forward is writing is never handed to another request.
KV tables are keyed by a per-attempt key, so a request id may be re-used (after preemption) while
its previous attempt's blocks are still waiting to be released.
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
    CANCELLED,
    DEADLINE_EXCEEDED,
    INTERNAL,
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    DecodeEvent,
    DecodeRequest,
    ErrorEvent,
    FinishedEvent,
    PreemptedEvent,
    RequestRefused,
    TokensEvent,
)
from pdserve.config import SchedulerConfig
from pdserve.engine.batch import ScheduledSeq
from pdserve.kv_cache.manager import KVCacheManager
from pdserve.structured.spec import StructuredOutputError
from pdserve.types import PromptLogprobs, SampledToken

if TYPE_CHECKING:
    from pdserve.structured.grammar import GrammarMatcher


class SeqState(enum.Enum):
    """Where a sequence is in its lifecycle (see module docstring)."""

    WAITING_FOR_KV = "waiting_for_kv"  # blocks reserved; KV transfer pending
    READY = "ready"  # KV present (or local prefill pending); waiting for a batch slot
    RUNNING = "running"  # admitted: prefilling locally in chunks, or decoding
    DONE = "done"  # finished, preempted, aborted or failed; holds no blocks (or will not soon)


@dataclass(eq=False)
class DecodeSeq:
    """One request attempt on this worker.

    ``token_ids``: prompt (earlier outputs included) then the tokens generated here.
    ``output_token_ids``: every output token (earlier attempts first). ``num_computed``: tokens
    whose KV is in the pool. ``key``: the KV-table key, unique per attempt. ``grammar``: the
    structured-output state, advanced over every output token (received or sampled here).
    ``prompt_logprobs``: gathered chunk by chunk during a local prefill that asked for them.
    """

    request: DecodeRequest
    key: str
    transfer_id: int
    token_ids: list[int]
    output_token_ids: list[int]
    original_prompt: list[int]
    num_computed: int = 0
    state: SeqState = SeqState.WAITING_FOR_KV
    kv_deadline: float | None = None
    grammar: GrammarMatcher | None = None
    prompt_logprobs: list[SampledToken] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        """The router's request id."""
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens whose KV the prefill (remote or local) computes."""
        return len(self.request.prompt_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """True while prompt KV is still missing (local prefill only)."""
        return self.num_computed < self.num_prompt_tokens


@dataclass
class StepPlan:
    """One step's batch. ``seqs[i]`` is computed for ``members[i]``."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    members: list[DecodeSeq] = field(default_factory=list)
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0

    @property
    def empty(self) -> bool:
        """True when nothing is to be computed."""
        return not self.seqs


class DecodeScheduler:
    """Continuous-batching policy of one decode worker over a :class:`KVCacheManager`.

    ``max_model_len``: prompt + output tokens per request (already the min of the scheduler
    config and the model's position limit). ``vocab_size`` bounds token ids.
    ``eos_token_ids``: the model's EOS ids. ``default_kv_timeout_s``: seconds a reservation waits
    for its KV when the request names none. ``watermark_blocks``: blocks a new reservation must
    leave free. ``clock``: wall time in seconds (``time.time``).
    Not thread-safe: the engine serialises calls.
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
        clock: Callable[[], float] = time.time,
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
        self.clock = clock
        threshold = config.long_prefill_token_threshold or config.max_num_batched_tokens // 2
        self.chunk_size = max(1, min(threshold, config.max_num_batched_tokens))
        self._seqs: dict[str, DecodeSeq] = {}  # live attempts by request id
        self._ready: deque[DecodeSeq] = deque()
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
    def num_ready(self) -> int:
        """Sequences waiting for a batch slot (KV arrived, or local prefill queued)."""
        return len(self._ready)

    @property
    def num_waiting_local(self) -> int:
        """Local prefills not yet admitted."""
        return sum(1 for s in self._ready if s.request.prefill_locally)

    @property
    def has_work(self) -> bool:
        """True when a step would compute something (or admit a ready sequence)."""
        return bool(self._running or self._ready)

    def has(self, request_id: str) -> bool:
        """True while ``request_id`` is live here."""
        return request_id in self._seqs

    def state(self, request_id: str) -> SeqState | None:
        """The live request's state, or None."""
        seq = self._seqs.get(request_id)
        return None if seq is None else seq.state

    def next_deadline(self) -> float | None:
        """Earliest deadline (wall seconds) among live requests, or None."""
        times = [
            t
            for s in self._seqs.values()
            for t in (s.request.deadline, s.kv_deadline)
            if t is not None
        ]
        return min(times, default=None)

    # ------------------------------------------------------------------------------- intake
    def validate(self, req: DecodeRequest) -> None:
        """Raise RequestRefused(INVALID_ARGUMENT) naming the first bad field of ``req``."""

        def bad(msg: str) -> None:
            raise RequestRefused(INVALID_ARGUMENT, msg)

        n = len(req.prompt_token_ids)
        if not req.request_id:
            bad("request_id must be non-empty")
        if n == 0:
            bad("prompt_token_ids must be non-empty")
        if not 0 <= req.num_output_tokens < n:
            bad(f"num_output_tokens must be in [0, {n}) for a {n}-token prompt, got "
                f"{req.num_output_tokens}")  # fmt: skip
        if n >= self.max_model_len:
            bad(f"prompt_token_ids has {n} tokens; max_model_len is {self.max_model_len} "
                "(at least one token must be left to generate)")  # fmt: skip
        lo, hi = min(req.prompt_token_ids), max(req.prompt_token_ids)
        if lo < 0 or hi >= self.vocab_size:
            bad(f"prompt_token_ids must be in [0, {self.vocab_size}), got {lo if lo < 0 else hi}")
        mt = req.sampling.max_tokens
        if mt is not None and req.num_output_tokens >= mt:
            bad(f"sampling.max_tokens={mt} leaves nothing to generate after "
                f"{req.num_output_tokens} output tokens")  # fmt: skip
        if req.kv_timeout_s is not None and req.kv_timeout_s <= 0:
            bad(f"kv_timeout_s must be > 0, got {req.kv_timeout_s}")

    def add_request(
        self, req: DecodeRequest, transfer_id: int = 0, grammar: GrammarMatcher | None = None
    ) -> list[int]:
        """Reserve blocks for ``req``'s prompt and queue it. Returns the reserved block table.

        Remote requests (``prefill_locally`` False) wait for :meth:`kv_arrived` under
        ``transfer_id``. ``grammar``: the request's structured-output state, already advanced
        over the earlier output in its prompt. Raises RequestRefused: INVALID_ARGUMENT (see :meth:`validate`),
        ALREADY_EXISTS (the request id is live here), RESOURCE_EXHAUSTED (not enough free blocks).
        """
        self.validate(req)
        if req.request_id in self._seqs:
            raise RequestRefused("ALREADY_EXISTS", f"request {req.request_id!r} is already live")
        prompt = list(req.prompt_token_ids)
        n_prev = req.num_output_tokens
        n = len(prompt)
        seq = DecodeSeq(
            request=req,
            key=f"{req.request_id}#{next(self._keys)}",
            transfer_id=transfer_id,
            token_ids=prompt,
            output_token_ids=prompt[n - n_prev :] if n_prev else [],
            original_prompt=prompt[: n - n_prev],
            grammar=grammar,
        )
        computed: list[int] = []
        num_cached = 0
        # NOTE: prompt logprobs need every prompt token computed, so such a request skips the cache
        if req.prefill_locally and req.sampling.prompt_logprobs is None:
            computed, num_cached = self.kv.get_computed_blocks(prompt)
        need = self.kv.num_blocks_needed(n) - len(computed)
        free = self.kv.num_free_blocks
        table = None
        if need <= free - self.watermark_blocks:
            table = self.kv.allocate_slots(seq.key, n, computed)
        if table is None:
            room = self.kv.num_blocks - self.watermark_blocks
            why = "never fits" if need > room else "retry later or elsewhere"
            raise RequestRefused(
                RESOURCE_EXHAUSTED,
                f"no KV room: prompt of {n} tokens needs {need} blocks, {free} of "
                f"{self.kv.num_blocks} free, {self.watermark_blocks} kept for running "
                f"sequences ({why})",
            )
        self._seqs[req.request_id] = seq
        if req.prefill_locally:
            seq.num_computed = num_cached
            seq.state = SeqState.READY
            self._ready.append(seq)
        else:
            timeout = req.kv_timeout_s or self.default_kv_timeout_s
            seq.kv_deadline = self.clock() + timeout
        return table

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
        if seq.grammar is not None:  # token 1 was sampled under the grammar on the prefill worker
            try:
                seq.grammar.advance([first_token.token_id])
            except StructuredOutputError as e:
                self._fail(seq, INTERNAL, f"token 1 from the prefill worker: {e}")
                return False
        seq.num_computed = seq.num_prompt_tokens
        seq.kv_deadline = None
        self.kv.cache_blocks(seq.key, seq.token_ids, seq.num_computed)
        reason = self._append_token(seq, first_token.token_id)
        if reason is not None:
            self._finish(seq, reason)
            return True
        seq.state = SeqState.READY
        self._ready.append(seq)
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

    def schedule(self) -> StepPlan:
        """Plan the next step (see module docstring). Events it causes go to the outbox.

        Raises RuntimeError if the previous plan was not passed to :meth:`update`.
        """
        if self._in_step:
            raise RuntimeError("schedule() called before update() of the previous step")
        self.expire()
        cfg = self.config
        while self._ready and len(self._running) < cfg.max_num_seqs:
            seq = self._ready.popleft()
            seq.state = SeqState.RUNNING
            self._running.append(seq)

        plan = StepPlan()
        budget = cfg.max_num_batched_tokens
        for seq in list(self._running):
            if seq.state is not SeqState.RUNNING or seq.is_prefilling:
                continue
            if plan.num_decode_tokens >= budget:
                break
            table = self.kv.allocate_slots(seq.key, len(seq.token_ids))
            while table is None:
                victim = self._running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
                table = self.kv.allocate_slots(seq.key, len(seq.token_ids))
            if table is None:
                continue
            plan.members.append(seq)
            plan.seqs.append(self._scheduled(seq, seq.token_ids[-1:], table, sample=True))
            plan.num_decode_tokens += 1

        left = budget - plan.num_decode_tokens
        if plan.num_decode_tokens and cfg.enable_chunked_prefill:
            left = min(left, self.chunk_size)
        for seq in self._running:
            if left <= 0:
                break
            if not seq.is_prefilling:
                continue
            remaining = seq.num_prompt_tokens - seq.num_computed
            n = min(remaining, left)
            if not cfg.enable_chunked_prefill and n < remaining:
                continue
            start = seq.num_computed
            chunk = seq.token_ids[start : start + n]
            table = self.kv.block_table(seq.key)
            plan.members.append(seq)
            plan.seqs.append(self._scheduled(seq, chunk, table, sample=n == remaining))
            plan.num_prefill_tokens += n
            left -= n
        self._in_step = {s.key for s in plan.members}
        return plan

    def update(
        self,
        plan: StepPlan,
        sampled: Sequence[SampledToken | None],
        prompt_logprobs: Mapping[str, PromptLogprobs] | None = None,
    ) -> None:
        """Apply a computed step: advance KV, append sampled tokens, stop, free deferred blocks.

        ``sampled[i]`` belongs to ``plan.seqs[i]`` (None where nothing was sampled).
        ``prompt_logprobs``: request id -> logprobs of prompt tokens this step's chunk predicted
        (local prefill); sent with the request's first TokensEvent.
        Raises ValueError when the lengths differ or a sampled entry is missing.
        """
        if len(sampled) != len(plan.seqs):
            self._end_step()
            raise ValueError(f"runner returned {len(sampled)} results for {len(plan.seqs)} seqs")
        for seq, sched, tok in zip(plan.members, plan.seqs, sampled, strict=True):
            if seq.state is not SeqState.RUNNING:
                continue  # aborted or expired mid-step; freed below
            seq.num_computed += len(sched.token_ids)
            self.kv.cache_blocks(seq.key, seq.token_ids, seq.num_computed)
            if prompt_logprobs and seq.request_id in prompt_logprobs:
                seq.prompt_logprobs.extend(prompt_logprobs[seq.request_id].tokens)
            if not sched.sample:
                continue
            if tok is None:
                self._fail(seq, INTERNAL, "runner returned no token for a sampled sequence")
                continue
            reason = self._append_token(seq, tok.token_id)
            self.num_generated_tokens += 1
            prompt_lps, seq.prompt_logprobs = tuple(seq.prompt_logprobs), []
            self._events.append((seq.request_id, TokensEvent((tok,), prompt_lps)))
            if reason is not None:
                self._finish(seq, reason)
        self._end_step()

    def fail_step(self, plan: StepPlan, message: str) -> None:
        """The runner raised on ``plan``: end each of its sequences with INTERNAL and free them."""
        self._end_step()
        for seq in plan.members:
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
        for seq in self._ready:
            if seq.state is not SeqState.READY:
                raise AssertionError(f"{seq.key} is in the ready queue as {seq.state}")
        for rid, seq in self._seqs.items():
            if seq.state is SeqState.DONE or rid != seq.request_id:
                raise AssertionError(f"live map holds {seq.key} in state {seq.state}")
            if not self.kv.has(seq.key):
                raise AssertionError(f"live {seq.key} holds no block table")
        if len(self._running) > self.config.max_num_seqs:
            raise AssertionError(f"{len(self._running)} running > max_num_seqs")
        self.kv.check_integrity()

    # ------------------------------------------------------------------------------- internals
    def _scheduled(
        self, seq: DecodeSeq, tokens: list[int], table: list[int], *, sample: bool
    ) -> ScheduledSeq:
        return ScheduledSeq(
            request_id=seq.request_id,
            token_ids=tokens,
            num_computed=seq.num_computed,
            block_table=table,
            sample=sample,
            sampling=seq.request.sampling,
            prompt_token_ids=seq.original_prompt,
            output_token_ids=seq.output_token_ids,
            grammar=seq.grammar,
        )

    def _append_token(self, seq: DecodeSeq, token_id: int) -> str | None:
        """Append an output token; return the finish reason it causes, or None."""
        seq.token_ids.append(token_id)
        seq.output_token_ids.append(token_id)
        sp = seq.request.sampling
        n_out = len(seq.output_token_ids)
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and token_id in self.eos_token_ids:
                return "stop"
            if token_id in sp.stop_token_ids:
                return "stop"
        if sp.max_tokens is not None and n_out >= sp.max_tokens:
            return "length"
        if len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

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
        elif prev is SeqState.READY:
            self._ready.remove(seq)
        elif prev is SeqState.WAITING_FOR_KV and release_transfer:
            self._released_transfers.append(seq.transfer_id)
        self._events.append((seq.request_id, event))
        if seq.key in self._in_step:
            self._deferred_free.append(seq.key)
        else:
            self.kv.free(seq.key)

    def _end_step(self) -> None:
        self._in_step = set()
        for key in self._deferred_free:
            self.kv.free(key)
        self._deferred_free = []
