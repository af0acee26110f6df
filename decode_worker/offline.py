"""OfflineEngine: batch generation in one process (``pdserve generate``, offline benchmarks,
tests) on the decode worker's own scheduler in unified mode.

Every prompt runs through the :class:`DecodeScheduler` that serves: chunked local prefill with
prefix caching, decode-first continuous batching, preemption of the newest sequence when the pool
runs out. This class adds only what the router does for a served request: it admits prompts
while KV room (and ``max_num_seqs``) lasts, in order, and re-submits a preempted request as
prompt + generated tokens (recompute), ahead of prompts not yet admitted. A request with
``sampling.structured`` gets a grammar matcher like a served one (rebuilt over its output after a
preemption).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from decode_worker.request import (
    DecodeEvent,
    DecodeRequest,
    ErrorEvent,
    FinishedEvent,
    PreemptedEvent,
    TokensEvent,
)
from decode_worker.scheduler import DecodeScheduler, admission_watermark
from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.errors import INVALID_ARGUMENT, RESOURCE_EXHAUSTED, EngineError
from pdserve.engine.runner import ModelRunner
from pdserve.kv_cache.manager import KVCacheManager
from pdserve.sampling_params import SamplingParams
from pdserve.structured.grammar import GrammarMatcher, resume_matcher
from pdserve.structured.spec import StructuredOutputError


@dataclass
class GenerationOutput:
    """One finished request. ``output_token_ids`` includes the stop token when one ended it.
    ``logprobs``: per output token (natural log; 0.0 unless the request asked for logprobs).
    ``num_cached_tokens``: prompt tokens served from the prefix cache (last admission)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str  # 'stop' | 'length'
    logprobs: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0


@dataclass
class GenerateStats:
    """Timing of one ``generate`` call (seconds, tokens). ``decode_*`` counts only steps that
    computed no prefill token, so ``decode_tokens / decode_s`` is the decode throughput."""

    wall_s: float = 0.0
    steps: int = 0
    prefill_tokens: int = 0
    decode_s: float = 0.0
    decode_tokens: int = 0
    preemptions: int = 0


class OfflineEngine:
    """Runs batches of token-id prompts to completion with a ModelRunner and a DecodeScheduler.

    ``eos_token_ids``: ids that end a request (unless ``ignore_eos``) in addition to the model
    config's (a tokenizer may know more, e.g. end-of-turn ids). ``runner``: reuse an already
    loaded ModelRunner (its weights and KV pool) under this ``config``'s scheduler limits; the
    KV pool must then be idle. Raises ConfigError while loading the model.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig | None = None,
        eos_token_ids: Sequence[int] = (),
        runner: ModelRunner | None = None,
    ) -> None:
        self.config = config
        self.runner = runner or ModelRunner(config, model_config)
        self.kv = KVCacheManager(
            self.runner.num_blocks, self.runner.block_size, config.cache.enable_prefix_caching
        )
        cfg = self.runner.model_config
        self.eos_token_ids = frozenset(cfg.eos_token_ids) | frozenset(eos_token_ids or ())
        self.max_model_len = min(config.scheduler.max_model_len, cfg.max_position_embeddings)
        self.scheduler = DecodeScheduler(
            self.kv,
            config.scheduler,
            max_model_len=self.max_model_len,
            vocab_size=cfg.vocab_size,
            eos_token_ids=tuple(self.eos_token_ids),
            watermark_blocks=admission_watermark(self.runner.num_blocks),
            check_sampling=self.runner.sampler.check,
        )
        self.stats = GenerateStats()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[GenerationOutput]:
        """Generate for every prompt (token ids); outputs in prompt order. ``params``: one for all
        or one per prompt. Raises EngineError(INVALID_ARGUMENT) naming the prompt (empty, a token
        id outside the vocabulary, no room under max_model_len, ``n`` > 1, a bad sampling value, a
        structured-output spec that does not compile), ValueError when the counts of prompts and
        params differ, RuntimeError when the KV cache cannot hold a request or a step fails."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        jobs: list[_Job] = []
        for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
            req = DecodeRequest(str(i), tuple(p), sp, prefill_locally=True)
            try:
                if sp.n != 1:
                    raise EngineError(INVALID_ARGUMENT, "'n' must be 1 for offline generation")
                self.scheduler.validate(req)
                job = _Job(req, self._matcher(req))
            except EngineError as e:
                raise EngineError(e.code, f"prompt {i}: {e.message}") from None
            jobs.append(job)
        self.stats = GenerateStats()
        start = time.perf_counter()
        pending: deque[_Job] = deque(jobs)
        by_id = {job.request.request_id: job for job in jobs}
        while pending or self.scheduler.has_work():
            self._admit(pending)
            output = self.scheduler.schedule()
            if output.is_empty:
                self.scheduler.update_from_output(output, [])
            else:
                t0 = time.perf_counter()
                try:
                    sampled = self.runner.execute(output.scheduled)
                except Exception:
                    self.scheduler.fail_step(output, "forward failed")
                    self.scheduler.drain()
                    raise
                dt = time.perf_counter() - t0
                self.scheduler.update_from_output(output, sampled)
                self.stats.steps += 1
                if output.num_prefill_tokens:
                    self.stats.prefill_tokens += output.num_prefill_tokens
                else:
                    self.stats.decode_s += dt
                    self.stats.decode_tokens += output.num_decode_tokens
            events, _ = self.scheduler.drain()
            for rid, ev in events:
                self._apply(by_id[rid], ev, pending)
        self.stats.wall_s = time.perf_counter() - start
        return [job.result() for job in jobs]

    def _matcher(self, req: DecodeRequest) -> GrammarMatcher | None:
        """``req``'s grammar matcher (None without a structured spec), advanced over its earlier
        output. Raises EngineError(INVALID_ARGUMENT) when the spec does not compile."""
        try:
            return resume_matcher(self.config.load.model, self.runner.model_config,
                                  req.sampling.structured, req.prompt_token_ids,
                                  req.num_output_tokens)  # fmt: skip
        except StructuredOutputError as e:
            raise EngineError(INVALID_ARGUMENT, str(e)) from None

    def _admit(self, pending: deque[_Job]) -> None:
        """Reserve KV for pending requests in order while room and ``max_num_seqs`` last."""
        s = self.scheduler
        while pending and s.num_running + s.num_waiting < self.config.scheduler.max_num_seqs:
            job = pending[0]
            try:
                s.add_request(job.request, grammar=job.grammar)
            except EngineError as e:
                if e.code != RESOURCE_EXHAUSTED:
                    raise
                if not s.has_work():
                    raise RuntimeError(
                        f"KV cache too small: request {job.request.request_id} does not fit in an "
                        f"idle pool ({e.message})"
                    ) from None
                return  # room returns as running requests finish
            seq = s.get(job.request.request_id)
            assert seq is not None
            job.num_cached = seq.num_cached
            pending.popleft()

    def _apply(self, job: _Job, event: DecodeEvent, pending: deque[_Job]) -> None:
        if isinstance(event, TokensEvent):
            for tok in event.tokens:
                job.output.append(tok.token_id)
                job.logprobs.append(tok.logprob)
        elif isinstance(event, FinishedEvent):
            job.finish_reason = event.reason
        elif isinstance(event, PreemptedEvent):
            self.stats.preemptions += 1
            job.resume()
            job.grammar = self._matcher(job.request)
            pending.appendleft(job)
        elif isinstance(event, ErrorEvent):
            raise RuntimeError(f"request {job.request.request_id} failed: {event.message}")


class _Job:
    """One prompt's generation across admissions: the original prompt and what it produced."""

    def __init__(self, request: DecodeRequest, grammar: GrammarMatcher | None) -> None:
        self.request = request
        self.grammar = grammar
        self.prompt = list(request.prompt_token_ids)
        self.output: list[int] = []
        self.logprobs: list[float] = []
        self.num_cached = 0
        self.finish_reason: str | None = None

    def resume(self) -> None:
        """Preempted: the next admission re-prefills prompt + output (recompute)."""
        self.request = DecodeRequest(
            self.request.request_id,
            tuple(self.prompt + self.output),
            self.request.sampling,
            num_output_tokens=len(self.output),
            prefill_locally=True,
        )

    def result(self) -> GenerationOutput:
        return GenerationOutput(
            self.request.request_id,
            self.prompt,
            self.output,
            self.finish_reason or "length",
            self.logprobs,
            self.num_cached,
        )
