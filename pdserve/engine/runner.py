"""ModelRunner: a scheduled batch (plain dataclasses) -> tensors -> one forward -> sampled tokens.

The only engine piece that touches tensors. Each step it flattens the batch's query tokens (prefill
chunks continuing after cached tokens and single-token decodes, in batch order), has the model's
attention backend build the step's metadata (positions, slot mapping and whatever the backend
reads), runs the model, which writes every new token's K/V into the KVPool by slot mapping,
computes logits only for the last token of each sequence that samples, and hands them to the
Sampler.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.batch import ScheduledSeq
from pdserve.kv_cache.pool import KVPool
from pdserve.model.cpu_linear import pack_linears
from pdserve.model.loader import load_model, torch_dtype
from pdserve.sampling import Sampler
from pdserve.types import SampledToken


class ModelRunner:
    """Owns the model weights, the paged KV pool and the sampler of one worker.

    ``model_config``: given, it overrides the checkpoint's (with ``load_format='dummy'`` it is the
    only config: random weights seeded by ``config.load.seed``). ``pack_weights``: on CPU, hold
    linear weights pre-packed for oneDNN (:func:`pdserve.model.cpu_linear.pack_linears`; faster,
    same results within rounding); False keeps the loader's dense layers. Raises ConfigError while
    loading.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig | None = None,
        *,
        pack_weights: bool = True,
    ) -> None:
        self.config = config
        load = config.load
        self.dtype: torch.dtype = torch_dtype(load.resolved_dtype)
        self.device = torch.device(load.device)
        self.model = load_model(load, model_config)
        if pack_weights and self.device.type == "cpu":
            pack_linears(self.model)
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
        self._check(batch)
        ids = [t for seq in batch for t in seq.token_ids]
        meta = self.model.attn_backend.build_metadata(
            [len(s.token_ids) for s in batch],
            [s.num_computed for s in batch],
            [s.block_table for s in batch],
            self.block_size,
            self.device,
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            meta.positions,
            meta,
            self._kv_caches,
        )  # [num_tokens, hidden]
        last_rows = meta.query_start_loc[1:] - 1
        want = torch.tensor([s.sample for s in batch], dtype=torch.bool, device=self.device)
        return self.model.compute_logits(hidden[last_rows[want]])

    def execute(self, batch: list[ScheduledSeq]) -> list[SampledToken | None]:
        """One step: forward, KV written by slot mapping, then sampling. Returns one entry per
        sequence: a SampledToken if ``seq.sample`` else None. Raises ValueError like
        :meth:`compute_logits`."""
        if not batch:
            return []
        logits = self.compute_logits(batch)
        sampling = [s for s in batch if s.sample]
        tokens = iter(self.sampler(logits, sampling) if sampling else [])
        return [next(tokens) if s.sample else None for s in batch]
