"""ModelRunner: a scheduled batch (plain dataclasses) -> tensors -> one forward -> sampled tokens.

The only engine piece that touches tensors. Each step it flattens the batch's query tokens (prefill
chunks continuing after cached tokens and single-token decodes, in batch order), has the model's
attention backend build the step's metadata (positions, slot mapping and whatever the backend
reads), runs the model, which writes every new token's K/V into the KVPool by slot mapping,
computes logits only for the last token of each sequence that samples, and hands them to the
Sampler.

Prompt logprobs (``sampling.prompt_logprobs`` set): for the rows of such a sequence's chunk, the
runner also computes the log-probability of the next prompt token and the top-k alternatives, a
slice of ``PROMPT_LOGPROB_ROWS`` rows at a time, so at most ``[PROMPT_LOGPROB_ROWS, vocab]`` logits
exist at once, never the whole prompt's. Only computed rows get values: a token served from the
prefix cache has none, so a scheduler must not use the cache for such a request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.batch import ScheduledSeq
from pdserve.kv_cache.pool import KVPool
from pdserve.model.compile import compile_model
from pdserve.model.cpu_decode import FusedDecode
from pdserve.model.cpu_linear import pack_linears
from pdserve.model.loader import load_model, torch_dtype
from pdserve.sampling import Sampler
from pdserve.types import PromptLogprobs, SampledToken

log = logging.getLogger(__name__)

# Prompt rows whose full-vocabulary logits exist at once while computing prompt logprobs.
PROMPT_LOGPROB_ROWS = 256


@dataclass
class StepOutput:
    """What one :meth:`ModelRunner.run` produced.

    ``tokens``: one entry per scheduled sequence, a SampledToken where ``seq.sample`` else None.
    ``prompt_logprobs``: request id -> the logprobs of the prompt tokens this step's chunk
    predicts, for sequences that asked (absent when the chunk predicts no prompt token).
    """

    tokens: list[SampledToken | None]
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)


class ModelRunner:
    """Owns the model weights, the paged KV pool and the sampler of one worker.

    ``model_config``: given, it overrides the checkpoint's (with ``load_format='dummy'`` it is the
    only config: random weights seeded by ``config.load.seed``). ``pack_weights``: on CPU, hold
    linear weights pre-packed for oneDNN (:func:`pdserve.model.cpu_linear.pack_linears`; faster,
    same results within rounding); False keeps the loader's dense layers. ``skinny_linears``:
    fp32 and bf16 weights also get panels for the few-row decode kernel (``pack_linears``'
    ``skinny``: None = wherever it applies; False for a worker that never decodes, saving that
    weight copy). With
    ``config.load.torch_compile`` on CPU the decoder is compiled in the constructor (a forward of
    one dummy token; ``compile_seconds`` says how long it took). Raises ConfigError while loading.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig | None = None,
        *,
        pack_weights: bool = True,
        skinny_linears: bool | None = None,
    ) -> None:
        self.config = config
        load = config.load
        self.dtype: torch.dtype = torch_dtype(load.resolved_dtype)
        self.device = torch.device(load.device)
        self.model = load_model(load, model_config)
        if pack_weights and self.device.type == "cpu":
            pack_linears(self.model, skinny=skinny_linears)
        self.model_config: ModelConfig = self.model.config
        cfg = self.model_config
        self.block_size: int = config.cache.block_size
        self.num_blocks: int = config.cache.blocks_for(cfg, load.resolved_dtype)
        self.kv_pool = KVPool(
            num_layers=cfg.num_hidden_layers,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self._kv_caches = [self.kv_pool.layer(i) for i in range(cfg.num_hidden_layers)]
        self.sampler = Sampler(cfg.vocab_size, cfg.eos_token_ids)
        # seconds spent compiling at startup (0 when eager)
        self.compile_seconds = 0.0
        if load.torch_compile and self.device.type == "cpu":
            self._compile()
        # decode-only steps as one C call where the model fits (pdserve.model.cpu_decode)
        self.fused_decode: FusedDecode | None = None
        if pack_weights and self.device.type == "cpu" and skinny_linears is not False:
            self.fused_decode, why = FusedDecode.create(self.model, self._kv_caches)
            if why:
                log.info("decode steps run the model's forward (no fused decode: %s)", why)

    def _compile(self) -> None:
        """Compile the decoder now (before the worker reports ready). A failure (no C++ compiler,
        an unsupported op) is logged and the model stays eager: slower, same results."""
        try:
            self.compile_seconds = compile_model(self.model, warmup=self._warmup)
        except Exception as e:  # noqa: BLE001 - any compiler failure means "serve eagerly"
            log.warning(
                "torch.compile of the model failed; running eagerly (--enforce-eager skips the "
                "attempt): %s",
                str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__,
            )

    @torch.inference_mode()
    def _warmup(self) -> None:
        """One forward of a dummy token into block 0 (free at startup: whatever is written there
        is overwritten before any sequence reads it)."""
        meta = self.model.attn_backend.build_metadata([1], [0], [[0]], self.block_size, self.device)
        ids = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.model(ids, meta.positions, meta, self._kv_caches)

    def _check(self, batch: Sequence[ScheduledSeq]) -> None:
        vocab = self.model_config.vocab_size
        for seq in batch:
            if not seq.token_ids:
                raise ValueError(f"request {seq.request_id}: no tokens scheduled")
            if min(seq.token_ids) < 0 or max(seq.token_ids) >= vocab:
                raise ValueError(f"request {seq.request_id}: token id outside [0, {vocab})")
            need = -(-seq.num_tokens_after // self.block_size)
            if len(seq.block_table) < need:
                raise ValueError(
                    f"request {seq.request_id}: block table has {len(seq.block_table)} blocks, "
                    f"{seq.num_tokens_after} tokens need {need}"
                )
            if not (0 <= min(seq.block_table) and max(seq.block_table) < self.num_blocks):
                raise ValueError(
                    f"request {seq.request_id}: block id outside [0, {self.num_blocks})"
                )

    @torch.inference_mode()
    def compute_logits(self, batch: Sequence[ScheduledSeq]) -> torch.Tensor:
        """Run one forward over ``batch`` (writing its KV) and return the logits of the last
        token of every sequence with ``sample=True``, in batch order: [num_sampling, vocab] in the
        model dtype. Raises ValueError (named request) for an empty chunk, an out-of-vocab token,
        or a block table that is too short or out of range."""
        return self._forward(batch)[0]

    def _forward(
        self, batch: Sequence[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sampling logits [num_sampling, vocab], hidden [num_tokens, hidden], query start
        offsets [len(batch) + 1]) of one forward over ``batch``."""
        self._check(batch)
        ids = [t for seq in batch for t in seq.token_ids]
        meta = self.model.attn_backend.build_metadata(
            [len(s.token_ids) for s in batch],
            [s.num_computed for s in batch],
            [s.block_table for s in batch],
            self.block_size,
            self.device,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        fused = self.fused_decode
        logits: torch.Tensor | None = None
        if fused is not None and fused.applies(meta, len(ids)):
            hidden, logits = fused(input_ids, meta)
        else:
            hidden = self.model(input_ids, meta.positions, meta, self._kv_caches)
        # hidden: [num_tokens, hidden]
        # the last row of every sampling sequence (plain ints: no per-step mask tensors)
        rows, end = [], 0
        for seq in batch:
            end += len(seq.token_ids)
            if seq.sample:
                rows.append(end - 1)
        if len(rows) < len(ids):  # else every row samples (a decode-only step): no gather
            hidden_rows = hidden[torch.tensor(rows, dtype=torch.int64, device=self.device)]
            logits = None
        else:
            hidden_rows = hidden
        if logits is None:
            logits = self.model.compute_logits(hidden_rows)
        return logits, hidden, meta.query_start_loc

    def execute(self, batch: list[ScheduledSeq]) -> list[SampledToken | None]:
        """One step: forward, KV written by slot mapping, then sampling. Returns one entry per
        sequence: a SampledToken if ``seq.sample`` else None. Raises ValueError like
        :meth:`compute_logits`."""
        return self.run(batch).tokens

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> StepOutput:
        """:meth:`execute`, plus the prompt logprobs of sequences whose sampling asks for them.
        Raises ValueError like :meth:`compute_logits`."""
        if not batch:
            return StepOutput([])
        logits, hidden, starts = self._forward(batch)
        prompt_lps: dict[str, PromptLogprobs] = {}
        if any(seq.sampling.prompt_logprobs is not None for seq in batch):
            offsets = starts.tolist()
            for i, seq in enumerate(batch):
                if seq.sampling.prompt_logprobs is not None:
                    lp = self._prompt_logprobs(seq, hidden[offsets[i] : offsets[i + 1]])
                    if lp is not None:
                        prompt_lps[seq.request_id] = lp
        sampling = [s for s in batch if s.sample]
        tokens = iter(self.sampler(logits, sampling) if sampling else [])
        return StepOutput([next(tokens) if s.sample else None for s in batch], prompt_lps)

    def _prompt_logprobs(self, seq: ScheduledSeq, hidden: torch.Tensor) -> PromptLogprobs | None:
        """Logprobs of the prompt tokens that ``seq``'s chunk predicts. ``hidden``: the chunk's
        hidden states [len(seq.token_ids), hidden]. Row r (position num_computed + r) predicts
        prompt token num_computed + r + 1; rows past the prompt (re-prefilled output) predict
        none. Each token carries its rank in the vocabulary (``SampledToken.rank``). None when
        no row predicts a prompt token."""
        prompt = seq.prompt_token_ids
        k = seq.sampling.prompt_logprobs or 0
        rows = min(len(seq.token_ids), len(prompt) - 1 - seq.num_computed)
        if rows <= 0:
            return None
        start = seq.num_computed + 1
        targets = torch.tensor(prompt[start : start + rows], device=hidden.device)
        out: list[SampledToken] = []
        for a in range(0, rows, PROMPT_LOGPROB_ROWS):
            b = min(a + PROMPT_LOGPROB_ROWS, rows)
            lg = self.model.compute_logits(hidden[a:b])[:, : self.sampler.vocab_size].float()
            lse = torch.logsumexp(lg, dim=-1, keepdim=True)  # [rows, 1]
            target_logits = lg.gather(1, targets[a:b, None])  # [rows, 1]
            chosen = (target_logits - lse).squeeze(1).tolist()
            ranks = (lg >= target_logits).sum(dim=-1).tolist()
            tops: list[tuple[tuple[int, float], ...]] = [()] * (b - a)
            if k:
                vals, ids = lg.topk(k, dim=-1)
                tops = [
                    tuple(zip(r_ids, r_vals, strict=True))
                    for r_ids, r_vals in zip(ids.tolist(), (vals - lse).tolist(), strict=True)
                ]
            tgt = targets[a:b].tolist()
            out.extend(
                SampledToken(token_id=t, logprob=c, top_logprobs=top, rank=r)
                for t, c, top, r in zip(tgt, chosen, tops, ranks, strict=True)
            )
        return PromptLogprobs(start=start, tokens=tuple(out))
