"""A small offline generation loop on one process: `pdserve generate`, benchmarks and tests.

All requests are known up front. Each step schedules, within ``max_num_batched_tokens`` and
``max_num_seqs``: first one decode token for every running request, then prefill chunks of waiting
requests in arrival order (a long prompt is split across steps: chunked prefill). A new request
first takes the longest prefix-cache hit from the KVCacheManager and computes only the rest. When
the pool has no room for a decode token, the newest running request is preempted: its blocks are
freed and it re-prefills prompt + generated tokens later (recompute).

Request life: waiting -> prefilling (0..n chunks) -> decoding -> finished ('stop' on an EOS or
stop token id, 'length' on max_tokens or max_model_len).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.batch import ScheduledSeq
from pdserve.engine.runner import ModelRunner
from pdserve.kv_cache.manager import KVCacheManager
from pdserve.sampling_params import SamplingError, SamplingParams


@dataclass
class GenerationOutput:
    """One finished request. ``output_token_ids`` includes the stop token when one ended it.
    ``logprobs``: per output token (natural log; 0.0 unless the request asked for logprobs).
    ``num_cached_tokens``: prompt tokens served from the prefix cache."""

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


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0
    started: bool = False  # holds a block table
    finish_reason: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class OfflineEngine:
    """Runs batches of token-id prompts to completion with a ModelRunner and a KVCacheManager.

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
        self.stats = GenerateStats()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[GenerationOutput]:
        """Generate for every prompt (token ids); outputs in prompt order. ``params``: one for all
        or one per prompt. Raises SamplingError (``n`` > 1 is not supported here, a prompt that
        leaves no room under max_model_len) and ValueError for an empty prompt."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if sp.n != 1:
                raise SamplingError("n", "'n' must be 1 for offline generation")
            if len(p) >= self.max_model_len:
                raise SamplingError(
                    "max_tokens",
                    f"prompt {i} has {len(p)} tokens; max_model_len is {self.max_model_len}",
                )
            self.runner.sampler.check(sp)
            reqs.append(_Request(str(i), list(p), sp))
        self.stats = GenerateStats()
        start = time.perf_counter()
        waiting: list[_Request] = list(reqs)
        running: list[_Request] = []
        while waiting or running:
            batch, scheduled = self._schedule(waiting, running)
            t0 = time.perf_counter()
            sampled = self.runner.execute(batch)
            dt = time.perf_counter() - t0
            self.stats.steps += 1
            prefill = sum(
                len(s.token_ids)
                for s, r in zip(batch, scheduled, strict=True)
                if len(s.token_ids) > 1 or s.num_computed < len(r.prompt)
            )
            if prefill:
                self.stats.prefill_tokens += prefill
            else:
                self.stats.decode_s += dt
                self.stats.decode_tokens += len(batch)
            for req, seq, tok in zip(scheduled, batch, sampled, strict=True):
                req.num_computed += len(seq.token_ids)
                self.kv.cache_blocks(req.rid, req.tokens, req.num_computed)
                if tok is not None:
                    req.output.append(tok.token_id)
                    req.logprobs.append(tok.logprob)
                    req.finish_reason = self._finish_reason(req)
            for req in [r for r in running if r.finish_reason]:
                running.remove(req)
                self.kv.free(req.rid)
        self.stats.wall_s = time.perf_counter() - start
        return [
            GenerationOutput(
                r.rid, r.prompt, r.output, r.finish_reason or "length", r.logprobs, r.num_cached
            )
            for r in reqs
        ]

    def _finish_reason(self, req: _Request) -> str | None:
        tok, sp = req.output[-1], req.params
        if len(req.output) >= sp.min_tokens and (
            (tok in self.eos_token_ids and not sp.ignore_eos) or tok in sp.stop_token_ids
        ):
            return "stop"
        if (sp.max_tokens is not None and len(req.output) >= sp.max_tokens) or len(
            req.tokens
        ) >= self.max_model_len:
            return "length"
        return None

    def _schedule(
        self, waiting: list[_Request], running: list[_Request]
    ) -> tuple[list[ScheduledSeq], list[_Request]]:
        """Pick this step's work; moves admitted requests from ``waiting`` to ``running``."""
        sched = self.config.scheduler
        budget = sched.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        chosen: list[_Request] = []
        # 1) decodes of running requests whose prompt is fully computed (oldest first)
        for req in list(running):
            if req not in running or len(req.tokens) - req.num_computed != 1:
                continue
            while self.kv.allocate_slots(req.rid, req.num_computed + 1) is None:
                victim = running[-1]
                self._preempt(victim, waiting, running)
                if victim is req:
                    break
            if req in running:
                batch.append(self._seq(req, 1))
                chosen.append(req)
                budget -= 1
        # 2) prefill chunks: unfinished prefills first, then new requests, in arrival order
        for req in [r for r in running if r not in chosen] + list(waiting):
            if budget <= 0:
                break
            if not req.started:
                if len(running) >= sched.max_num_seqs:
                    break
                blocks, cached = self.kv.get_computed_blocks(req.tokens)
            else:
                blocks, cached = [], req.num_computed
            remaining = len(req.tokens) - cached
            chunk = min(remaining, budget)
            if chunk < remaining and not sched.enable_chunked_prefill:
                break
            table = self.kv.allocate_slots(req.rid, cached + chunk, () if req.started else blocks)
            if table is None:
                break  # no room now; decodes free blocks as requests finish
            if not req.started:
                req.started, req.num_computed, req.num_cached = True, cached, cached
                waiting.remove(req)
                running.append(req)
            batch.append(self._seq(req, chunk))
            chosen.append(req)
            budget -= chunk
        if not batch:
            raise RuntimeError(
                "KV cache too small: not even one request fits "
                f"({self.kv.num_free_blocks} free blocks of {self.runner.block_size} tokens)"
            )
        return batch, chosen

    def _seq(self, req: _Request, n: int) -> ScheduledSeq:
        tokens = req.tokens
        return ScheduledSeq(
            request_id=req.rid,
            token_ids=tokens[req.num_computed : req.num_computed + n],
            num_computed=req.num_computed,
            block_table=self.kv.block_table(req.rid),
            sample=req.num_computed + n == len(tokens),
            sampling=req.params,
            prompt_token_ids=req.prompt,
            output_token_ids=req.output,
        )

    def _preempt(self, req: _Request, waiting: list[_Request], running: list[_Request]) -> None:
        """Free ``req``'s blocks; it re-prefills prompt + output when room returns."""
        running.remove(req)
        self.kv.free(req.rid)
        req.started, req.num_computed = False, 0
        waiting.insert(0, req)
        self.stats.preemptions += 1
