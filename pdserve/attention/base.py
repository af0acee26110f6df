"""Attention metadata for one mixed batch, and the attention backend interface + registry.

A step's batch is *flat packed*: the query tokens of every scheduled sequence are concatenated
(``num_tokens`` rows), sequence ``i`` owning rows ``query_start_loc[i]:query_start_loc[i + 1]``.
A sequence either continues a prefill (a chunk of ``query_len >= 1`` tokens after ``num_computed``
tokens whose KV is already in the pool) or decodes one token. Its KV lives in fixed-size blocks of
the paged pool named by its block table; token ``p`` of the sequence is stored at slot
``block_table[p // block_size] * block_size + p % block_size`` (the *slot mapping*).

Everything that does not depend on the layer (index tensors, masks) is built once per step by
:meth:`AttentionMetadata.build` and shared by all layers. A backend (``torch_ref`` here) writes the
new K/V into the pool by slot mapping and attends each query over its sequence's context: causal
within the chunk, full over the earlier tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.config import ConfigError


@dataclass(frozen=True)
class PrefillSpan:
    """A sequence attended on its own: a prefill chunk (``query_len > 1``, from position 0 or
    after cached tokens) or a one-token prompt.

    ``start``/``end``: its query rows in the flat batch. ``num_computed``: tokens already in the
    pool before this step. ``seq_len``: ``num_computed + (end - start)``. ``block_ids``: the blocks
    covering ``seq_len`` tokens, int64 [ceil(seq_len / block_size)]. ``mask``: bool
    [query_len, seq_len] (True = may attend) when the chunk continues after cached tokens, else
    None (plain causal attention over the chunk itself).
    """

    start: int
    end: int
    num_computed: int
    seq_len: int
    block_ids: torch.Tensor
    mask: torch.Tensor | None


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs shared by every layer.

    Tensors (all on the model's device):
      positions:       int64 [num_tokens]  position of each token in its sequence (for RoPE).
      slot_mapping:    int64 [num_tokens]  pool slot of each new token's K/V.
      query_start_loc: int64 [num_seqs + 1] cumulative query lengths.
      seq_lens:        int64 [num_seqs]    context length after this step (cached + new tokens).
      block_tables:    int64 [num_seqs, max_blocks] padded with 0 (padding is never attended).
    Decode group (sequences with one query token and cached context), batched:
      decode_rows:     int64 [num_decodes] their rows in the flat batch.
      decode_blocks:   int64 [num_decodes, max_decode_blocks] their block tables (0-padded).
      decode_mask:     bool  [num_decodes, 1, 1, max_decode_blocks * block_size] True = real token.
      decode_bias:     float32, same shape: 0 where decode_mask, -inf elsewhere (added to scores).
    ``prefills``: the other sequences, attended one by one (one SDPA call per sequence, never per
    token). ``block_size`` in tokens.
    """

    block_size: int
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    decode_rows: torch.Tensor
    decode_blocks: torch.Tensor
    decode_mask: torch.Tensor
    prefills: tuple[PrefillSpan, ...]
    decode_bias: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """Rows of the flat batch."""
        return int(self.slot_mapping.shape[0])

    @property
    def num_decodes(self) -> int:
        """Sequences in the batched decode group."""
        return int(self.decode_rows.shape[0])

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        num_computed: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: str | torch.device = "cpu",
    ) -> AttentionMetadata:
        """Build the metadata from per-sequence plain numbers.

        ``query_lens[i] >= 1`` tokens are computed for sequence ``i`` at positions
        ``num_computed[i] ..``; ``block_tables[i]`` must cover ``num_computed[i] + query_lens[i]``
        tokens. Raises ValueError naming the sequence index when a length or block table is bad.
        """
        n = len(query_lens)
        if not (len(num_computed) == len(block_tables) == n):
            raise ValueError(
                f"query_lens, num_computed and block_tables must have one entry per sequence "
                f"(got {n}, {len(num_computed)}, {len(block_tables)})"
            )
        qlens = [int(q) for q in query_lens]
        ctx = [int(c) for c in num_computed]
        max_blocks = 1
        for i in range(n):
            q, c, nb = qlens[i], ctx[i], len(block_tables[i])
            if q < 1 or c < 0:
                raise ValueError(f"sequence {i}: query_len must be >= 1 and num_computed >= 0")
            need = -(-(c + q) // block_size)
            if nb < need:
                raise ValueError(
                    f"sequence {i}: block table has {nb} blocks but {c + q} tokens "
                    f"need {need} blocks of {block_size}"
                )
            max_blocks = max(max_blocks, nb)
        tables = torch.tensor(
            [list(t) + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.int64
        ).view(n, max_blocks)
        q_t = torch.tensor(qlens, dtype=torch.int64)
        c_t = torch.tensor(ctx, dtype=torch.int64)
        qsl = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(q_t, 0, out=qsl[1:])
        seq_lens = c_t + q_t
        # per token: its sequence and position (vectorised, no per-token Python)
        seq_of = torch.repeat_interleave(torch.arange(n), q_t)
        positions = torch.arange(int(qsl[-1])) - qsl[:-1][seq_of] + c_t[seq_of]
        slots = tables[seq_of, positions // block_size] * block_size + positions % block_size

        decode_idx = [i for i in range(n) if qlens[i] == 1 and ctx[i] > 0]
        prefills = []
        for i in range(n):
            q, c = qlens[i], ctx[i]
            if q == 1 and c > 0:
                continue
            mask = None
            if c > 0:
                # query row r sits at position c + r and may see keys 0 .. c + r
                mask = torch.arange(c + q)[None, :] <= (c + torch.arange(q))[:, None]
                mask = mask.to(device)
            start = int(qsl[i])
            blocks = tables[i, : -(-(c + q) // block_size)].to(device)
            prefills.append(PrefillSpan(start, start + q, c, c + q, blocks, mask))

        d_idx = torch.tensor(decode_idx, dtype=torch.int64)
        d_seq_lens = seq_lens[d_idx]
        d_nblocks = int(-(-int(d_seq_lens.max()) // block_size)) if decode_idx else 1
        d_mask = torch.arange(d_nblocks * block_size)[None, :] < d_seq_lens[:, None]
        d_mask = d_mask.view(len(decode_idx), 1, 1, d_nblocks * block_size)
        d_bias = torch.zeros(d_mask.shape).masked_fill_(~d_mask, float("-inf"))
        return cls(
            block_size=block_size,
            positions=positions.to(device),
            slot_mapping=slots.to(device),
            query_start_loc=qsl.to(device),
            seq_lens=seq_lens.to(device),
            block_tables=tables.to(device),
            decode_rows=qsl[d_idx].to(device),
            decode_blocks=tables[d_idx, :d_nblocks].to(device),
            decode_mask=d_mask.to(device),
            prefills=tuple(prefills),
            decode_bias=d_bias.to(device),
        )


class AttentionBackend(ABC):
    """Writes a layer's new K/V into the paged pool and attends over each sequence's context."""

    name: str = ""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """One layer's attention over a flat packed batch.

        q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim] (RoPE
        applied); k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim] (written in
        place at ``meta.slot_mapping``). ``scale``: softmax scale (1/sqrt(head_dim)).
        Returns [num_tokens, num_heads, head_dim].
        """


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(
    name: str,
) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    """Class decorator: make a backend available as ``get_backend(name)``."""

    def deco(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return deco


def get_backend(name: str = "torch_ref") -> AttentionBackend:
    """A new backend instance by name. Raises ConfigError naming the known backends."""
    # importing the implementations registers them
    from pdserve.attention import torch_ref, triton_paged  # noqa: F401

    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ConfigError(
            f"attention backend {name!r} is not available; choose one of {sorted(_BACKENDS)}"
        ) from None
