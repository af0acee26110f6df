"""Torch-free value types shared by the router and the workers.

Plain frozen dataclasses and string enums: the router (which never imports torch) and the workers
(which build these from tensors) exchange them through pdserve.rpc; kv_transfer builds the
transfer records.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class SampledToken:
    """A sampled token and, when requested, log-probabilities (natural log). ``rank``: for a
    prompt token, its 1-based rank among the whole vocabulary by logprob, counting every token
    with the same or a higher logprob (vLLM's rule); 0 when not computed (sampled tokens)."""

    token_id: int
    logprob: float = 0.0
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first
    rank: int = 0


class TransferOutcome(str, enum.Enum):
    """How a KV transfer ended, as recorded for metrics (matches ``pdserve.v1.TransferRecord``)."""

    OK = "ok"
    DROPPED = "dropped"  # drained and discarded: the receiver held no reservation for the id
    FAILED = "failed"
    TIMEOUT = "timeout"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TransferRecord:
    """One KV transfer's record (DESIGN §5; mirrors ``pdserve.v1.TransferRecord``, crosses the gRPC
    boundary). Built by kv_transfer, read by the worker services and the router."""

    transfer_id: int  # id the decode worker reserved blocks under
    bytes: int  # payload bytes moved (0 when nothing was sent)
    ms: float  # wall milliseconds from header send (or receipt) to completion
    outcome: TransferOutcome  # ok | dropped | failed | timeout
    path: str = "transferred"  # 'transferred' over a channel | 'local' (unified mode)
    error: str = ""  # why it failed or was dropped ('' when ok)


@dataclass(frozen=True)
class PromptLogprobs:
    """Log-probabilities of a run of prompt tokens (vLLM's ``prompt_logprobs``).

    ``tokens[j]`` is prompt token ``start + j`` with its log-probability given the tokens before
    it and its ``top_logprobs`` alternatives. Prompt token 0 has no logprob, so ``start >= 1``.
    """

    start: int
    tokens: tuple[SampledToken, ...]
