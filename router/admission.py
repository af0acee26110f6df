"""Admission control and length limits, checked before a request touches any worker.

A request is *queued* from admission until its first token exists (every one of its ``n``
sequences has been prefilled); after that it is running and no longer counts. Two limits bound the
queue: requests and prompt tokens. A request that would exceed either is refused with
:class:`~router.errors.Overloaded` (HTTP 429 + ``Retry-After``, gRPC RESOURCE_EXHAUSTED). A request
arriving at an empty queue is always admitted, so a busy server never refuses a request forever;
but a request that alone holds more prompt tokens than ``max_queued_tokens`` could only ever be
admitted into an idle server, so it is refused at once with a 400 naming the prompt and the limit.

``Retry-After`` is an estimate of how long the queue takes to drain: the mean queue wait of
recent requests (exponentially weighted), at least 1 s, at most 60 s.
"""

from __future__ import annotations

import math
import time

from router.errors import BadRequest, ContextLengthExceeded, Overloaded

_EWMA_ALPHA = 0.2  # weight of the newest queue-wait sample
MAX_RETRY_AFTER_S = 60


def resolve_max_tokens(
    prompt_len: int, max_tokens: int | None, max_model_len: int, prompt_param: str = "prompt"
) -> int:
    """Output token budget for a prompt of ``prompt_len`` tokens.

    ``max_tokens`` None means the rest of the context (``max_model_len - prompt_len``).
    Raises ContextLengthExceeded (400) naming the counts and the limit when the prompt leaves no
    room or prompt + max_tokens exceed ``max_model_len``; BadRequest for an empty prompt.
    ``prompt_param`` is the request field the prompt came from ("prompt" or "messages").
    """
    if prompt_len <= 0:
        raise BadRequest("the prompt is empty; it must hold at least 1 token", param=prompt_param)
    if prompt_len >= max_model_len:
        raise ContextLengthExceeded(
            f"the prompt has {prompt_len} tokens but this model's maximum context length "
            f"(--max-model-len) is {max_model_len} tokens, leaving no room for output; "
            "shorten the prompt",
            param=prompt_param,
        )
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise ContextLengthExceeded(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = "
            f"{prompt_len + max_tokens} tokens exceeds this model's maximum context length "
            f"(--max-model-len) of {max_model_len} tokens; shorten the prompt or lower max_tokens",
            param="max_tokens",
        )
    return max_tokens


class Ticket:
    """One admitted request's place in the queue. ``release()`` is idempotent."""

    def __init__(self, controller: AdmissionController, num_tokens: int) -> None:
        self._controller = controller
        self.num_tokens = num_tokens
        self.admitted_at = time.monotonic()
        self.released = False

    def release(self) -> float:
        """Leave the queue; returns the seconds spent queued (0 if already released)."""
        if self.released:
            return 0.0
        self.released = True
        return self._controller._release(self)


class AdmissionController:
    """Bounds the router's queue by requests and prompt tokens (see the module docstring).

    ``max_queued_requests``/``max_queued_tokens`` must be >= 1 (ValueError otherwise).
    """

    def __init__(self, max_queued_requests: int, max_queued_tokens: int) -> None:
        if max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        if max_queued_tokens < 1:
            raise ValueError(f"max_queued_tokens must be >= 1, got {max_queued_tokens}")
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.num_queued = 0
        self.queued_tokens = 0
        self.num_rejected = 0
        self._mean_wait_s = 0.0

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait before retrying (1..60)."""
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(self._mean_wait_s)))

    def admit(self, num_tokens: int, prompt_param: str = "prompt") -> Ticket:
        """Queue a request of ``num_tokens`` prompt tokens (all sequences together).

        Raises Overloaded with ``retry_after_s`` when a limit would be exceeded; BadRequest
        (param ``prompt_param``) when the request alone exceeds ``max_queued_tokens``.
        """
        if num_tokens > self.max_queued_tokens:
            raise BadRequest(
                f"the request holds {num_tokens} prompt tokens (prompt tokens x n), more than the "
                f"server queues at once (--max-queued-tokens {self.max_queued_tokens}); shorten "
                "the prompt or lower n",
                param=prompt_param,
            )
        if self.num_queued > 0:
            if self.num_queued + 1 > self.max_queued_requests:
                self.num_rejected += 1
                raise Overloaded(
                    f"the server is busy: {self.num_queued} requests are queued "
                    f"(limit --max-queued-requests {self.max_queued_requests}); retry later",
                    retry_after_s=self.retry_after_s(),
                )
            if self.queued_tokens + num_tokens > self.max_queued_tokens:
                self.num_rejected += 1
                raise Overloaded(
                    f"the server is busy: {self.queued_tokens} prompt tokens are queued and this "
                    f"request adds {num_tokens} (limit --max-queued-tokens "
                    f"{self.max_queued_tokens}); retry later",
                    retry_after_s=self.retry_after_s(),
                )
        self.num_queued += 1
        self.queued_tokens += num_tokens
        return Ticket(self, num_tokens)

    def _release(self, ticket: Ticket) -> float:
        self.num_queued -= 1
        self.queued_tokens -= ticket.num_tokens
        waited = time.monotonic() - ticket.admitted_at
        self._mean_wait_s += _EWMA_ALPHA * (waited - self._mean_wait_s)
        return waited
