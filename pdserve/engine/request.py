"""The request base both workers (and the offline engine) share, and its validation.

A request carries token ids only. After a preemption or migration the router re-sends it with
the tokens generated so far appended to the prompt and ``num_output_tokens`` naming how many
trailing ids are output: they count towards ``max_tokens``, feed the presence/frequency
penalties and key the seeded generator, so the continuation is the one the request would have
produced had it never moved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.errors import DEADLINE_EXCEEDED, INVALID_ARGUMENT, EngineError
from pdserve.sampling_params import SamplingError, SamplingParams

# Seconds a worker keeps a request whose caller named no deadline: the router always names one,
# so this only bounds what a lost caller leaves behind (every per-request state has a lease).
DEFAULT_LEASE_S = 3600.0


def wire_deadline(deadline_unix_ms: int, now: float) -> float:
    """The ``time.time()`` deadline of a wire request: ``deadline_unix_ms`` / 1000, or
    ``now + DEFAULT_LEASE_S`` when it is 0 (unset)."""
    return deadline_unix_ms / 1000.0 if deadline_unix_ms > 0 else now + DEFAULT_LEASE_S


def wire_arrival(age_ms: int, now: float) -> float | None:
    """The ``time.monotonic()`` arrival of a wire request whose sequence arrived at its router
    ``age_ms`` milliseconds ago (``now``: this process's monotonic seconds); None when 0 (unset:
    it arrives when the worker receives it). An age, not a timestamp, crosses the wire, so no two
    hosts' clocks are compared."""
    return now - age_ms / 1000.0 if age_ms > 0 else None


@dataclass(frozen=True)
class EngineRequest:
    """Fields every worker request has.

    ``prompt_token_ids``: the prompt, followed by ``num_output_tokens`` earlier output tokens on
    a resumed request. ``deadline``: absolute ``time.time()`` seconds after which the worker
    drops the request and frees what it holds; None = none. ``arrival_time``:
    ``time.monotonic()`` seconds (this process's clock) when the sequence first arrived at its
    router (:func:`wire_arrival`); a worker keeps its queues in this order, so a sequence
    re-placed after a preemption, a lost worker or a failed prefill keeps its place instead of
    queueing behind requests that came after it (vLLM likewise puts a preempted request back at
    the head of its queue); None = when the worker receives it.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    num_output_tokens: int = 0
    deadline: float | None = None
    arrival_time: float | None = None

    def validate(
        self,
        *,
        vocab_size: int,
        max_model_len: int,
        check_sampling: Callable[[SamplingParams], None] | None = None,
        now: float | None = None,
    ) -> None:
        """Check the request against a model of ``vocab_size`` ids and ``max_model_len`` tokens.

        ``check_sampling``: the sampler's own check (raises SamplingError). ``now``: wall seconds;
        given, a deadline at or before it is refused. Raises EngineError: INVALID_ARGUMENT naming
        the first bad field (empty id or prompt, a token id outside the vocabulary, a prompt
        leaving no room for one output token, ``num_output_tokens`` out of range or already at
        ``max_tokens``, a bad sampling value), DEADLINE_EXCEEDED.
        """
        tokens = self.prompt_token_ids
        n, k = len(tokens), self.num_output_tokens

        def bad(message: str) -> EngineError:
            return EngineError(INVALID_ARGUMENT, message)

        if not self.request_id:
            raise bad("'request_id' is empty")
        if n == 0:
            raise bad("'prompt_token_ids' is empty")
        lo, hi = min(tokens), max(tokens)
        if lo < 0 or hi >= vocab_size:
            raise bad(
                f"'prompt_token_ids' contains {lo if lo < 0 else hi}, outside the vocabulary "
                f"[0, {vocab_size})"
            )
        if n >= max_model_len:
            raise bad(
                f"prompt has {n} tokens; max_model_len is {max_model_len}, so at most "
                f"{max_model_len - 1} prompt tokens fit (one token must be left to generate)"
            )
        if not 0 <= k < n:
            raise bad(f"'num_output_tokens' must be in [0, {n}) for {n} tokens, got {k}")
        max_tokens = self.sampling.max_tokens
        if max_tokens is not None and k >= max_tokens:
            raise bad(
                f"'max_tokens' ({max_tokens}) leaves nothing to generate after {k} output tokens"
            )
        if check_sampling is not None:
            try:
                check_sampling(self.sampling)
            except SamplingError as e:
                raise bad(str(e)) from None
        if now is not None and self.deadline is not None and self.deadline <= now:
            raise EngineError(DEADLINE_EXCEEDED, "request deadline already passed")
