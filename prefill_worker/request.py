"""What enters and leaves the prefill engine (plain dataclasses: no torch, no protobuf).

A prefill request is an :class:`~pdserve.engine.request.EngineRequest` (token ids, sampling,
earlier outputs on a re-prefill, deadline) plus where its KV goes. Errors are
:class:`~pdserve.engine.errors.EngineError`.

Lifecycle of one request inside the engine (``PrefillState``)::

    WAITING --admitted (blocks for the whole prompt)--> RUNNING --last chunk computed,
        token 1 sampled--> SENDING --KV transfer done--> DONE (blocks stay as prefix cache)
    any state --abort / deadline / error--> DONE (future fails, blocks freed)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.request import EngineRequest
from pdserve.types import SampledToken

if TYPE_CHECKING:
    from kv_transfer.base import TransferRecord


class PrefillState(enum.Enum):
    """Where a request is in the engine (see the module docstring)."""

    WAITING = "waiting"
    RUNNING = "running"
    SENDING = "sending"
    DONE = "done"


@dataclass(frozen=True)
class KVTarget:
    """Where the KV goes: the decode worker's receiver and the id it reserved blocks under."""

    transfer_id: int
    kv_endpoint: str  # "host:port" of the decode worker's KV receiver
    decode_worker_id: str = ""


@dataclass(frozen=True, kw_only=True)
class PrefillRequest(EngineRequest):
    """One prefill (fields of EngineRequest, then keyword-only ones).

    ``target``: the decode worker to send the KV to; None keeps the KV here as prefix cache only
    (offline benchmarks, cache warm-up) and the result carries no transfer record.
    """

    target: KVTarget | None = None


@dataclass(frozen=True)
class PrefillResult:
    """A finished prefill: token 1, cache hits, and timings in milliseconds.

    ``queue_ms``: arrival to first chunk scheduled. ``compute_ms``: first chunk to token 1
    sampled. ``transfer_ms``: KV send start to completion (0 without a target).
    """

    request_id: str
    token: SampledToken
    num_prompt_tokens: int
    cached_tokens: int
    queue_ms: float
    compute_ms: float
    transfer_ms: float
    transfer: TransferRecord | None  # the KV transfer's record; None without a target
    prompt_logprobs: tuple[SampledToken, ...] = ()  # prompt tokens 1..n-1, when asked
