"""What enters and leaves the prefill engine (plain dataclasses: no torch, no protobuf).

A prefill request carries token ids only. For a re-prefill after a preemption or migration the
router sends ``prompt + tokens generated so far`` with ``num_output_tokens`` naming how many
trailing ids are output: they feed the presence/frequency penalties and key the seeded generator
at the right position, so the next token is the one the decode worker would have sampled.

Lifecycle of one request inside the engine (``PrefillState``)::

    WAITING --admitted (blocks for the whole prompt)--> RUNNING --last chunk computed,
        token 1 sampled--> SENDING --KV transfer done--> DONE (blocks stay as prefix cache)
    any state --abort / deadline / error--> DONE (future fails, blocks freed)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.sampling_params import SamplingParams
from pdserve.types import SampledToken

if TYPE_CHECKING:
    from kv_transfer.base import TransferRecord

# Error codes, named after grpc.StatusCode members; the service maps them to the wire.
CANCELLED = "CANCELLED"
DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
INTERNAL = "INTERNAL"
INVALID_ARGUMENT = "INVALID_ARGUMENT"
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
UNAVAILABLE = "UNAVAILABLE"
ALREADY_EXISTS = "ALREADY_EXISTS"


class PrefillError(Exception):
    """A request was refused or failed. ``code`` is a grpc.StatusCode name (module constants)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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


@dataclass(frozen=True)
class PrefillRequest:
    """One prefill.

    ``prompt_token_ids``: the prompt (plus generated tokens on a re-prefill). ``target``: the
    decode worker to send the KV to; None keeps the KV here as prefix cache only (offline
    benchmarks, cache warm-up) and the result carries no transfer record. ``deadline``: absolute
    ``time.time()`` seconds after which the engine drops the request; None = none.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    target: KVTarget | None = None
    num_output_tokens: int = 0
    deadline: float | None = None


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
