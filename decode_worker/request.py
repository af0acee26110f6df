"""What enters and leaves the decode engine (plain dataclasses, no torch, no protobuf).

A decode request carries token ids only. After a preemption or migration the router re-sends the
request with the tokens generated so far appended to the prompt and ``num_output_tokens`` naming
how many trailing prompt tokens are output: they count towards ``max_tokens``, feed the
presence/frequency penalties, and key the seeded generator, so the continuation is the same as if
the request had never moved.

Per-request event stream (DESIGN §4), in order:

    Accepted (returned by ``add_request``, sent first by the service)
    TokensEvent*                      one per step that sampled a token for the request
    FinishedEvent | PreemptedEvent | ErrorEvent   exactly one, last

In disaggregated mode token 1 is sampled by the prefill worker and reaches the router in its
PrefillResponse, so the decode worker does not stream it again; it only counts it (and reports
Finished at once when token 1 alone ends the request). In unified mode the decode worker samples
token 1 itself and streams it like any other token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.sampling_params import SamplingParams
from pdserve.types import SampledToken

# Terminal error codes, named after grpc.StatusCode members; the service maps them to the wire.
CANCELLED = "CANCELLED"
DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
INTERNAL = "INTERNAL"
INVALID_ARGUMENT = "INVALID_ARGUMENT"
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
UNAVAILABLE = "UNAVAILABLE"
ALREADY_EXISTS = "ALREADY_EXISTS"
FAILED_PRECONDITION = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class DecodeRequest:
    """One request as the decode engine sees it.

    ``prompt_token_ids``: the prompt, followed by the ``num_output_tokens`` tokens generated so far
    when the request is resumed after a preemption. ``prefill_locally``: unified mode (compute the
    prompt's KV here) instead of waiting for a KV transfer. ``deadline``: absolute wall time in
    seconds since the epoch (``time.time()`` scale) after which everything is freed; None = none.
    ``kv_timeout_s``: seconds a reservation waits for its KV before it is released (None = the
    engine default).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    num_output_tokens: int = 0
    prefill_locally: bool = False
    deadline: float | None = None
    kv_timeout_s: float | None = None


@dataclass(frozen=True)
class Accepted:
    """Answer to an accepted request. ``transfer_id``: the id the prefill worker sends the KV
    under (0 for a local prefill). ``num_reserved_blocks``: blocks reserved for the prompt."""

    transfer_id: int
    kv_endpoint: str
    decode_worker_id: str
    num_reserved_blocks: int


class RequestRefused(Exception):
    """The engine cannot take a request. ``code``: INVALID_ARGUMENT | RESOURCE_EXHAUSTED |
    UNAVAILABLE | ALREADY_EXISTS | FAILED_PRECONDITION (grpc.StatusCode names)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class TokensEvent:
    """Tokens sampled for the request this step, in order (with logprobs when asked).

    ``prompt_logprobs``: on the first event of a local prefill that asked for them, the
    logprobs of prompt tokens 1..n-1 (token 0 has none); empty otherwise.
    """

    tokens: tuple[SampledToken, ...]
    prompt_logprobs: tuple[SampledToken, ...] = ()


@dataclass(frozen=True)
class FinishedEvent:
    """The request ended. ``reason``: 'stop' (EOS or a stop token id) | 'length' (max_tokens or
    the model length). ``num_output_tokens``: every output token, earlier attempts and token 1
    included."""

    reason: str
    num_output_tokens: int


@dataclass(frozen=True)
class PreemptedEvent:
    """The worker gave the request up (no KV room). ``output_token_ids``: every output token so
    far, the ones generated before this attempt and token 1 included, so that
    ``original prompt + output_token_ids`` is the re-prefill."""

    output_token_ids: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed. ``code``: a grpc.StatusCode name (see module constants)."""

    code: str
    message: str


DecodeEvent = TokensEvent | FinishedEvent | PreemptedEvent | ErrorEvent


def is_terminal(event: DecodeEvent) -> bool:
    """True for the events that end a request's stream."""
    return not isinstance(event, TokensEvent)


@dataclass
class EventBatch:
    """Events produced by one scheduler call, in emission order: (request_id, event)."""

    events: list[tuple[str, DecodeEvent]] = field(default_factory=list)

    def add(self, request_id: str, event: DecodeEvent) -> None:
        """Append one event for ``request_id``."""
        self.events.append((request_id, event))

    def extend(self, other: EventBatch) -> None:
        """Append every event of ``other``."""
        self.events.extend(other.events)
