"""Torch-free value types shared by the router and the workers.

Everything here is a plain frozen dataclass: the router (which never imports torch) and the workers
(which build these from tensors) exchange them through pdserve.rpc.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SampledToken:
    """A sampled token and, when requested, log-probabilities (natural log)."""

    token_id: int
    logprob: float = 0.0
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass(frozen=True)
class PromptLogprobs:
    """Log-probabilities of a run of prompt tokens (vLLM's ``prompt_logprobs``).

    ``tokens[j]`` is prompt token ``start + j`` with its log-probability given the tokens before
    it and its ``top_logprobs`` alternatives. Prompt token 0 has no logprob, so ``start >= 1``.
    """

    start: int
    tokens: tuple[SampledToken, ...]
