"""The long-prompt share of a prefill step, shared by the prefill worker's scheduler and a decode
worker's prefill thread (prefill_worker/scheduler.py documents the policy in full): prompts with
more than T tokens left to compute are *long*; long prompts share at most S = min(T, B) tokens of a
step of budget B, so a short prompt never waits for a whole long one.
"""

from __future__ import annotations

LONG_SHARE_DIVISOR = 8
"""Default long-prompt threshold and share of a step: ``max_num_batched_tokens // 8`` (256 tokens at
the default 2048); the share, not the threshold, is capped at the prefill step. Chosen by
measurement, not taken from elsewhere: SmolLM2-135M on one core of a 2-core
CPU computes a 256-token chunk in about 0.3-2 s depending on its context and the machine's load,
so a short prompt waits about a second for a step of long-prompt work; larger chunks made steps
(and that wait) grow faster than their size. A server with more compute per step (a GPU) sets
``--long-prefill-token-threshold`` itself."""


def default_long_threshold(max_num_batched_tokens: int) -> int:
    """T when ``long_prefill_token_threshold`` is 0: ``max_num_batched_tokens //
    LONG_SHARE_DIVISOR``, at least 1. The long prompts' share of a step is T capped at the step
    (``PrefillScheduler.long_share`` in prefill_worker/scheduler.py); the class threshold itself
    is not capped, so a small step budget does not turn every prompt into a long one."""
    return max(1, max_num_batched_tokens // LONG_SHARE_DIVISOR)


FINAL_CHUNK_SLACK = 4
"""A long prompt's final chunk may exceed the long share left by up to 1 / FINAL_CHUNK_SLACK of
it (:func:`long_chunk`)."""


def long_chunk(remaining: int, budget: int, long_left: int) -> int:
    """Tokens a long prompt with ``remaining`` tokens to compute gets in a step with ``budget``
    tokens left and ``long_left`` of the long prompts' share left: nothing once the share is used
    up; its whole remainder when that fits the budget and is at most a quarter over the share
    left (its final chunk); else at most the share. So, where the budget allows, a prompt does
    not end with a small chunk in a step of its own: a CPU step reads all the weights however
    few tokens it holds (SmolLM2-135M bf16, one core: a 256-token chunk 105-123 ms, the 24
    tokens left of a 280-token prompt another 45-47 ms; session 19, docs/benchmarks.md)."""
    if long_left <= 0:
        return 0
    if remaining <= min(budget, long_left + long_left // FINAL_CHUNK_SLACK):
        return remaining
    return min(remaining, budget, long_left)
