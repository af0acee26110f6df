"""The attention backend interface (+ registry) and the metadata every backend shares.

A step's batch is *flat packed*: the query tokens of every scheduled sequence are concatenated
(``num_tokens`` rows), sequence ``i`` owning rows ``query_start_loc[i]:query_start_loc[i + 1]``.
A sequence either continues a prefill (a chunk of ``query_len >= 1`` tokens after ``num_computed``
tokens whose KV is already in the pool) or decodes one token. Its KV lives in fixed-size blocks of
the paged pool named by its block table; token ``p`` of the sequence is stored at slot
``block_table[p // block_size] * block_size + p % block_size`` (the *slot mapping*).

How a backend plugs in (``torch_ref`` is the reference):

* Once per step the runner calls ``backend.build_metadata(query_lens, num_computed,
  block_tables, block_size, device)`` with plain per-sequence numbers (Python ints and lists).
  The backend returns an :class:`AttentionMetadata` (usually a subclass with its own fields:
  index tensors, masks, kernel launch sizes). :meth:`FlatBatch.build` validates the inputs and
  makes the CPU index tensors every backend needs (positions, slot mapping, query start
  offsets, the 0-padded block table), so a backend only adds what it reads itself.
* The model reads only the common fields: ``positions`` (RoPE) and ``query_start_loc`` (which
  rows to compute logits for); every layer passes the same metadata object to
  ``backend.forward``, which writes the layer's new K/V into the pool at ``slot_mapping`` and
  returns the attention output (causal within a chunk, full over the earlier tokens).
* ``@register_backend("name")`` on the class makes it available to ``get_backend("name")``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from pdserve.config import ConfigError


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step inputs shared by every layer; a backend subclasses it to add its own fields.

    Tensors (on the model's device):
      positions:       int64 [num_tokens]   position of each token in its sequence (for RoPE).
      slot_mapping:    int64 [num_tokens]   pool slot of each new token's K/V.
      query_start_loc: int64 [num_seqs + 1] cumulative query lengths.
    ``block_size`` in tokens.
    """

    block_size: int
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """Rows of the flat batch."""
        return int(self.slot_mapping.shape[0])


@dataclass(frozen=True)
class FlatBatch:
    """A step's validated per-sequence inputs and the index tensors derived from them, on the
    CPU (a backend moves what it reads to its device).

    ``query_lens`` / ``num_computed``: per sequence, tokens computed now / already in the pool.
    Tensors: ``block_tables`` int64 [num_seqs, max_blocks] (0-padded; padding is never read),
    ``query_start_loc`` int64 [num_seqs + 1], ``seq_lens`` int64 [num_seqs] (cached + new
    tokens), ``positions`` and ``slot_mapping`` int64 [num_tokens].
    """

    block_size: int
    query_lens: list[int]
    num_computed: list[int]
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch."""
        return len(self.query_lens)

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        num_computed: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
    ) -> FlatBatch:
        """Validate and index a step: ``query_lens[i] >= 1`` tokens are computed for sequence
        ``i`` at positions ``num_computed[i] ..``; ``block_tables[i]`` must cover
        ``num_computed[i] + query_lens[i]`` tokens. Raises ValueError naming the sequence index
        when a length or block table is bad."""
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
        # per token: its sequence and position (vectorised, no per-token Python)
        seq_of = torch.repeat_interleave(torch.arange(n), q_t)
        positions = torch.arange(int(qsl[-1])) - qsl[:-1][seq_of] + c_t[seq_of]
        slots = tables[seq_of, positions // block_size] * block_size + positions % block_size
        return cls(block_size, qlens, ctx, tables, qsl, c_t + q_t, positions, slots)

    def common(self, device: str | torch.device) -> dict[str, Any]:
        """The :class:`AttentionMetadata` fields on ``device``, as keyword arguments for a
        backend's metadata constructor."""
        return {
            "block_size": self.block_size,
            "positions": self.positions.to(device),
            "slot_mapping": self.slot_mapping.to(device),
            "query_start_loc": self.query_start_loc.to(device),
        }


M = TypeVar("M", bound=AttentionMetadata)


class AttentionBackend(ABC, Generic[M]):
    """Builds its per-step metadata, then writes each layer's new K/V into the paged pool and
    attends over each sequence's context (see the module docstring)."""

    name: str = ""

    @abstractmethod
    def build_metadata(
        self,
        query_lens: Sequence[int],
        num_computed: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: str | torch.device = "cpu",
    ) -> M:
        """The step's metadata, shared by every layer. ``query_lens[i] >= 1`` tokens are
        computed for sequence ``i`` at positions ``num_computed[i] ..``; ``block_tables[i]``
        (physical block ids) covers ``num_computed[i] + query_lens[i]`` tokens of ``block_size``
        per block. Raises ValueError naming the sequence index for a bad length or table."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: M,
        scale: float,
    ) -> torch.Tensor:
        """One layer's attention over a flat packed batch.

        q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim] (RoPE
        applied); k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim] (written in
        place at ``meta.slot_mapping``). ``scale``: softmax scale (1/sqrt(head_dim)).
        Returns [num_tokens, num_heads, head_dim].
        """


_BACKENDS: dict[str, Callable[[], AttentionBackend[Any]]] = {}


B = TypeVar("B", bound=type[AttentionBackend[Any]])


def register_backend(name: str) -> Callable[[B], B]:
    """Class decorator: make a backend available as ``get_backend(name)``."""

    def deco(cls: B) -> B:
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return deco


def get_backend(name: str = "torch_ref") -> AttentionBackend[Any]:
    """A new backend instance by name. Raises ConfigError naming the known backends."""
    # importing the implementations registers them
    from pdserve.attention import cpu_paged, torch_ref, triton_paged  # noqa: F401

    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ConfigError(
            f"attention backend {name!r} is not available; choose one of {sorted(_BACKENDS)}"
        ) from None
