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
