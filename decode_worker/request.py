"""What enters and leaves the decode engine (plain dataclasses, no torch, no protobuf).

A decode request is an :class:`~pdserve.engine.request.EngineRequest` (token ids, sampling,
earlier outputs after a preemption or migration, deadline) plus how its prompt KV arrives.
Refusals are :class:`~pdserve.engine.errors.EngineError`; later failures end the stream with an
ErrorEvent carrying the same status-code names.

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

from dataclasses import dataclass

from pdserve.engine.request import EngineRequest
from pdserve.types import SampledToken


@dataclass(frozen=True, kw_only=True)
class DecodeRequest(EngineRequest):
    """One request as the decode engine sees it (fields of EngineRequest, then keyword-only ones).

    ``prefill_locally``: unified mode (compute the prompt's KV here) instead of waiting for a KV
    transfer. ``kv_timeout_s``: seconds a reservation waits for its KV before it is released
    (None = the engine default).
    """

    prefill_locally: bool = False
    kv_timeout_s: float | None = None


@dataclass(frozen=True)
class Accepted:
    """Answer to an accepted request. ``transfer_id``: the id the prefill worker sends the KV
    under (0 for a local prefill). ``num_reserved_blocks``: blocks reserved for the prompt.
    ``cached_tokens``: for a local prefill, prompt tokens served from this worker's prefix cache
    (0 for a remote one: its prefill worker reports them)."""

    transfer_id: int
    kv_endpoint: str
    decode_worker_id: str
    num_reserved_blocks: int
    cached_tokens: int = 0


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
    """The request failed. ``code``: a grpc.StatusCode name (``pdserve.engine.errors``)."""

    code: str
    message: str


DecodeEvent = TokensEvent | FinishedEvent | PreemptedEvent | ErrorEvent


def is_terminal(event: DecodeEvent) -> bool:
    """True for the events that end a request's stream."""
    return not isinstance(event, TokensEvent)
