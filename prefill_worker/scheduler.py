"""Prefill scheduler (no torch): chunked, batched prefill with automatic prefix caching.

Each ``schedule()`` call packs prompt chunks of several requests into one step under the prefill
step budget B (:func:`pdserve.config.prefill_step_budget`: ``prefill_max_num_batched_tokens``, by
default at most 320 tokens on a CPU) and ``max_num_seqs``.

Policy (short prompts never wait for whole long prompts; long prompts always progress):

* When a request is admitted, it is *long* if the prompt tokens it has left to compute (after
  prefix-cache hits) exceed ``T = long_prefill_token_threshold`` (``0`` = automatic, see
  :func:`default_long_threshold`), else *short*. The class is kept until the prompt is done, so
  a long prompt's last chunk never jumps ahead of short prompts.
* One walk in admission/arrival order: running (admitted) requests first, then the waiting
  queue, which is kept in order of each sequence's first arrival at its router
  (``PrefillRequest.arrival_time``), so a sequence re-placed after a preemption, a lost decode
  worker or a failed prefill keeps its place ahead of requests that came after it. A short
  request takes its whole remainder while budget lasts (a remainder the budget cuts continues
  in the next step that runs short prompts, ahead of later ones). Long requests
  **share at most S = min(T, B) tokens per step** between them, the earliest first, and get no
  more even when the rest of the budget is unused, with one exception: a long prompt whose
  remainder fits the step's budget and is at most a quarter over the share left takes it whole
  (its final chunk; :func:`long_chunk`), so where the step's budget allows, a prompt does not
  end with a small chunk in a step of its own. Every step then computes at most L = S + S // 4
  tokens of long prompts, so a short prompt arriving during a step waits for one such step,
  never for a whole long prompt (a step's time grows with its tokens, and on a CPU faster than
  linearly with a chunk's attention context). A waiting long request that finds the long share
  used up is passed over (it keeps its place), so shorter prompts behind it still run.
* **Long chunks alternate with short-only steps while short prompts wait**: a step that follows
  one which carried long tokens carries none itself when any short prompt can run. A short
  prompt that arrives during a long chunk's step then runs in a step of short prompts alone,
  whose time is its own work's, not a long chunk's on top (measured: a 64-token prompt batched
  with 7 others took 0.2-0.3 s alone and 0.3-0.6 s beside a 256-token chunk of a 1500-token
  prompt on one core). Long prompts still progress at least every other step.
* Admission reserves KV blocks for the request's whole prompt at once (a prefill worker holds KV
  only until it is sent), after reusing cached prefix blocks. If the pool cannot hold the next
  request to admit, admission stops for the step: memory is strictly first-come-first-served,
  so small prompts cannot starve a big one.

The bounds (given KV room and ``max_num_seqs``):

* Short prompts: every step gives at most L tokens to long prompts, and a step with long tokens
  is followed by one without while short prompts are queued, so the short prompts, served in
  arrival order, get at least ``B - L`` tokens of every step and at least ``B`` of every two
  consecutive steps while any is queued. A short prompt with ``r`` tokens to compute, arriving
  while short prompts with ``A`` tokens to compute are ahead of it, is fully scheduled within
  ``2 * ceil((A + r) / B)`` steps after the step in progress when it arrived, and within
  ``ceil((A + r) / (B - L))`` when ``L < B``, however many long prompts are queued. (A waiting
  request's class is decided at admission: one that arrived earlier and turns short through a
  new prefix-cache hit counts in ``A``, as does a re-placed sequence that first arrived before
  it, even when it is queued later.)
* Long prompts (no starvation): they are served in admission order at up to S tokens per step
  (their final chunk up to L), so once every request admitted before it is done, a long prompt
  gains at least ``min(S, remaining)`` tokens in every step that follows a step without long
  tokens, and in every step in which no short prompt can run: at least every other step,
  whatever short prompts keep arriving (with ``S > B / 2``, short prompts admitted while it
  waited may take part of such a step first).

With ``enable_chunked_prefill=False`` a prompt runs whole in one step (no classes, no S cap;
config ensures ``B >= max_model_len``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig
from pdserve.engine.batch import SchedulerOutput
from pdserve.engine.long_prompts import default_long_threshold, long_chunk
from pdserve.engine.sequence import EngineSeq, queue_by_arrival
from pdserve.kv_cache.manager import KVCacheManager
from pdserve.types import SampledToken
from prefill_worker.request import PrefillRequest, PrefillState


@dataclass(eq=False)
class PrefillSeq(EngineSeq[PrefillRequest]):
    """A prefill's progress (see EngineSeq). Times are ``time.monotonic()`` seconds."""

    arrival: float = field(default_factory=time.monotonic)
    state: PrefillState = PrefillState.WAITING
    first_scheduled: float | None = None
    is_long: bool = False  # its class, decided at admission (see the module docstring)


PrefillOutput = SchedulerOutput[PrefillSeq]


class PrefillScheduler:
    """Owns the waiting queue, the running prefills and the requests whose KV is being sent.

    All methods must be called from one thread (the engine serialises them).
    """

    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, step_budget: int | None = None
    ) -> None:
        self.config = config
        self.kv = kv
        # tokens per step (prefill_step_budget for the worker's device; default B)
        self.step_budget = config.max_num_batched_tokens if step_budget is None else step_budget
        if self.step_budget < 1:
            raise ValueError(f"step_budget must be >= 1, got {self.step_budget}")
        # T: prompts with more tokens than this to compute are long; their share of a step is T
        # capped at the step
        self.long_threshold = config.long_prefill_token_threshold or default_long_threshold(
            config.max_num_batched_tokens
        )
        self.long_share = min(self.long_threshold, self.step_budget)
        self._waiting: deque[PrefillSeq] = deque()
        self._running: list[PrefillSeq] = []  # admitted, prompt not fully computed; FCFS
        self._sending: dict[str, PrefillSeq] = {}
        self._by_id: dict[str, PrefillSeq] = {}
        self._last_step_had_long = False  # the previous schedule() gave long prompts tokens

    # ----------------------------------------------------------------------------- queries
    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Admitted requests still computing or sending their KV."""
        return len(self._running) + len(self._sending)

    @property
    def num_sending(self) -> int:
        """Requests whose KV transfer is in flight."""
        return len(self._sending)

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens of waiting and running requests not yet computed."""
        return sum(s.num_remaining_prompt_tokens for s in self._waiting) + sum(
            s.num_remaining_prompt_tokens for s in self._running
        )

    @property
    def num_queued_short_tokens(self) -> int:
        """Of :attr:`num_queued_tokens`, those of short prompts: the work a newly arrived short
        prompt waits behind (long prompts' chunks take at most ``long_share`` tokens of a step,
        and never two steps in a row while a short prompt can run). A waiting request is not
        classed yet; it counts as short when its whole prompt is at most ``long_threshold``
        tokens (its class at admission also subtracts prefix-cache hits). 0 with chunked
        prefill off, where there is one first-come-first-served class."""
        if not self.config.enable_chunked_prefill:
            return 0
        return sum(
            s.num_remaining_prompt_tokens
            for s in self._waiting
            if s.num_remaining_prompt_tokens <= self.long_threshold
        ) + sum(s.num_remaining_prompt_tokens for s in self._running if not s.is_long)

    @property
    def class_threshold(self) -> int:
        """``long_threshold`` when prompts are classed (chunked prefill on), else 0."""
        return self.long_threshold if self.config.enable_chunked_prefill else 0

    def has_unscheduled_work(self) -> bool:
        """True when a ``schedule()`` call could produce chunks."""
        return bool(self._waiting or self._running)

    def get(self, request_id: str) -> PrefillSeq | None:
        """The live request with this id, or None."""
        return self._by_id.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    # ----------------------------------------------------------------------------- lifecycle
    def add(self, seq: PrefillSeq) -> None:
        """Queue a request (validated by the engine) in arrival order (``seq.queue_key``: its
        request's ``arrival_time`` when it has one, so a re-placed sequence keeps its place).
        Raises ValueError for a duplicate id."""
        if seq.request_id in self._by_id:
            raise ValueError(f"request {seq.request_id!r} is already queued")
        seq.state = PrefillState.WAITING
        queue_by_arrival(self._waiting, seq)
        self._by_id[seq.request_id] = seq

    def remove(self, request_id: str) -> PrefillSeq | None:
        """Drop a request in any state and free its blocks. Returns it, or None if unknown."""
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return None
        if seq.state is PrefillState.WAITING:
            self._waiting.remove(seq)
        elif seq.state is PrefillState.RUNNING:
            self._running.remove(seq)
        elif seq.state is PrefillState.SENDING:
            del self._sending[request_id]
        self.kv.free(request_id)
        seq.state = PrefillState.DONE
        return seq

    # ----------------------------------------------------------------------------- scheduling
    def schedule(self, now: float | None = None) -> PrefillOutput:
        """Pick this step's chunks (see the module docstring). Admits waiting requests.

        ``now``: ``time.monotonic()`` seconds used for ``first_scheduled`` (default: now).
        """
        if self.config.enable_chunked_prefill and self._last_step_had_long:
            # a short-only step between long chunks when any short prompt can run (docstring)
            picks = self._pick(long_share=0) or self._pick(self.long_share)
        else:
            picks = self._pick(self.long_share)
        self._last_step_had_long = any(seq.is_long for seq in picks)
        t = time.monotonic() if now is None else now
        out = PrefillOutput()
        for seq in self._running:  # emit in arrival (admission) order
            n = picks.get(seq, 0)
            if n == 0:
                continue
            if seq.first_scheduled is None:
                seq.first_scheduled = t
            out.add(seq, seq.schedule(n, self.kv.block_table(seq.request_id)))
        return out

    def _pick(self, long_share: int) -> dict[PrefillSeq, int]:
        """One walk in admission/arrival order: tokens per request for this step, long prompts
        sharing at most ``long_share`` tokens. Admits the waiting requests it picks; picks none
        (and admits none) only when nothing can run under ``long_share``."""
        cfg = self.config
        chunked = cfg.enable_chunked_prefill
        budget = self.step_budget
        long_left = long_share
        picks: dict[PrefillSeq, int] = {}
        for seq in self._running:
            if budget == 0 or len(picks) >= cfg.max_num_seqs:
                break
            n = min(seq.num_remaining_prompt_tokens, budget)
            if seq.is_long:
                n = long_chunk(seq.num_remaining_prompt_tokens, budget, long_left)
                long_left = max(0, long_left - n)
            if n > 0:
                picks[seq] = n
                budget -= n
        for seq in list(self._waiting):
            if budget == 0 or len(picks) >= cfg.max_num_seqs:
                break
            blocks, cached = self._lookup(seq)
            remaining = seq.num_prompt_tokens - cached
            is_long = chunked and remaining > self.long_threshold
            if is_long and long_left == 0:
                continue  # passed over: keeps its place; shorter prompts behind it may run
            if not chunked and remaining > budget:
                break  # runs whole next step
            if not self._admit(seq, blocks, cached, is_long):
                break  # memory is FCFS: nothing behind it may overtake
            n = min(remaining, budget)
            if is_long:
                n = long_chunk(remaining, budget, long_left)
                long_left = max(0, long_left - n)
            picks[seq] = n
            budget -= n
        return picks

    def _lookup(self, seq: PrefillSeq) -> tuple[list[int], int]:
        """Prefix-cache hit (block ids, cached tokens) for a waiting request; not yet counted.

        NOTE: a request asking for prompt logprobs skips the cache (every prompt token must be
        computed to get its logprob); its blocks are still cached for later requests.
        """
        if seq.request.sampling.prompt_logprobs is not None:
            return [], 0
        return self.kv.get_computed_blocks(seq.token_ids, record_stats=False)

    def _admit(self, seq: PrefillSeq, blocks: list[int], cached: int, is_long: bool) -> bool:
        """Reserve blocks for the whole prompt, reusing the cached ``blocks`` (looked up just
        before, with no allocation in between), and fix the request's class.
        WAITING -> RUNNING; False when no room."""
        if self.kv.allocate_slots(seq.request_id, seq.num_prompt_tokens, blocks) is None:
            return False
        seq.is_long = is_long
        self.kv.record_prefix_query(seq.num_prompt_tokens, cached)  # the hit rate counts admissions
        seq.num_cached = cached
        seq.num_computed = cached
        seq.state = PrefillState.RUNNING
        self._waiting.remove(seq)
        self._running.append(seq)
        return True

    def update_from_output(
        self, output: PrefillOutput, sampled: Sequence[SampledToken | None]
    ) -> list[tuple[PrefillSeq, SampledToken]]:
        """Record that ``output`` ran (``sampled[i]`` for ``output.scheduled[i]``): advance
        progress, register newly full blocks in the prefix cache. Returns the requests whose
        prompt is now complete (moved RUNNING -> SENDING) with their token 1. Sequences removed
        meanwhile (aborted during the forward) are skipped. Raises ValueError when ``sampled``
        does not match ``output`` (nothing is applied then)."""
        if len(sampled) != len(output.scheduled) or any(
            tok is None for sch, tok in zip(output.scheduled, sampled, strict=True) if sch.sample
        ):
            raise ValueError(
                f"runner returned {len(sampled)} results for {len(output.scheduled)} sequences"
                " or no token for a sampled one"
            )
        done: list[tuple[PrefillSeq, SampledToken]] = []
        for seq, sch, tok in zip(output.seqs, output.scheduled, sampled, strict=True):
            if self._by_id.get(seq.request_id) is not seq or seq.state is not PrefillState.RUNNING:
                continue
            seq.num_computed = sch.num_tokens_after
            self.kv.cache_blocks(seq.request_id, seq.token_ids, seq.num_computed)
            if seq.num_remaining_prompt_tokens == 0:
                assert tok is not None  # checked above: the last chunk samples
                self._running.remove(seq)
                seq.state = PrefillState.SENDING
                self._sending[seq.request_id] = seq
                done.append((seq, tok))
        return done

    def finish(self, request_id: str) -> PrefillSeq | None:
        """The KV hand-off ended (or was skipped): free the blocks, which stay as evictable prefix
        cache. Returns the request, or None if it was removed meanwhile."""
        return self.remove(request_id)

    def check_integrity(self) -> None:
        """Assert scheduler bookkeeping matches the KV manager. Raises AssertionError."""
        live = list(self._waiting) + self._running + list(self._sending.values())
        if len(live) != len(self._by_id) or {s.request_id for s in live} != set(self._by_id):
            raise AssertionError("scheduler queues disagree with the request index")
        for s in self._waiting:
            if self.kv.has(s.request_id):
                raise AssertionError(f"waiting request {s.request_id!r} holds blocks")
        for s in self._running + list(self._sending.values()):
            if not self.kv.has(s.request_id):
                raise AssertionError(f"admitted request {s.request_id!r} holds no blocks")
        self.kv.check_integrity()
