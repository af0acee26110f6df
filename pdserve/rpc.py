"""Conversions between wire messages (``pdserve.v1`` protobuf) and core dataclasses.

Only service layers (router gateways, worker services) import this module; engines below them see
plain dataclasses (DESIGN §1). Every ``*_from_proto`` validates: bad values raise
:class:`~pdserve.sampling_params.SamplingError` naming the field, which services map to
INVALID_ARGUMENT / HTTP 400.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from pdserve.sampling_params import (
    MAX_TOP_LOGPROBS,
    MIN_POSITIVE_F32,
    SamplingError,
    SamplingParams,
)
from pdserve.structured.spec import StructuredOutputError, StructuredOutputSpec
from pdserve.types import SampledToken, TransferRecord
from pdserve.v1 import common_pb2 as cpb
from pdserve.v1 import worker_pb2 as pb


def status_code(name: str) -> grpc.StatusCode:
    """The grpc.StatusCode named ``name`` (engines name codes as plain strings, e.g.
    'RESOURCE_EXHAUSTED'); INTERNAL for an unknown name."""
    return grpc.StatusCode.__members__.get(name, grpc.StatusCode.INTERNAL)


def sampling_to_proto(p: SamplingParams) -> cpb.SamplingParams:
    """Worker-facing fields of ``p``. Stop strings stay in the router (workers see token ids).

    ``max_tokens`` must be resolved (not None) before a request reaches a worker.
    Raises SamplingError when ``max_tokens`` is None.
    """
    if p.max_tokens is None:
        raise SamplingError("max_tokens", "'max_tokens' must be resolved before dispatch")
    msg = cpb.SamplingParams(
        temperature=p.temperature,
        top_p=max(p.top_p, MIN_POSITIVE_F32),  # 0.0 on the wire means "unset"
        top_k=p.top_k,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        max_tokens=p.max_tokens,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
        min_tokens=p.min_tokens,
    )
    if p.seed is not None:
        msg.seed = p.seed
    for t, b in p.logit_bias:
        msg.logit_bias[t] = b
    msg.allowed_token_ids.extend(p.allowed_token_ids or ())
    if p.structured is not None:
        msg.structured.CopyFrom(
            cpb.StructuredOutput(
                kind=p.structured.kind, value=p.structured.value, field=p.structured.field
            )
        )
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    return msg


def sampling_from_proto(m: cpb.SamplingParams) -> SamplingParams:
    """Rebuild SamplingParams from the wire. Raises SamplingError naming a bad field.

    proto3 scalars default to 0, so ``top_p`` 0 and ``repetition_penalty`` 0 mean "unset" (1.0),
    and ``max_tokens`` must be >= 1.
    """
    structured = None
    if m.HasField("structured"):
        try:
            structured = StructuredOutputSpec(
                m.structured.kind, m.structured.value, m.structured.field or "structured_outputs"
            )
        except StructuredOutputError as e:
            raise SamplingError(e.field, str(e)) from None
    return SamplingParams(
        temperature=m.temperature,
        top_p=m.top_p or 1.0,
        top_k=m.top_k,
        min_p=m.min_p,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty or 1.0,
        seed=m.seed if m.HasField("seed") else None,
        max_tokens=m.max_tokens,
        min_tokens=m.min_tokens,
        stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        logprobs=m.logprobs or m.top_logprobs > 0,
        top_logprobs=m.top_logprobs,
        logit_bias=tuple(sorted(m.logit_bias.items())),
        allowed_token_ids=tuple(m.allowed_token_ids) or None,
        structured=structured,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
    )


def token_to_proto(t: SampledToken) -> cpb.TokenLogprob:
    """One sampled token (with its top log-probabilities, best first) as a wire message."""
    return cpb.TokenLogprob(
        token_id=t.token_id,
        logprob=t.logprob,
        top_token_ids=[tid for tid, _ in t.top_logprobs],
        top_logprobs=[lp for _, lp in t.top_logprobs],
        rank=t.rank,
    )


def token_from_proto(m: cpb.TokenLogprob) -> SampledToken:
    """Inverse of :func:`token_to_proto`. Keeps at most MAX_TOP_LOGPROBS entries."""
    tops = tuple(zip(m.top_token_ids, m.top_logprobs, strict=False))[:MAX_TOP_LOGPROBS]
    return SampledToken(token_id=m.token_id, logprob=m.logprob, top_logprobs=tops, rank=m.rank)


def tokens_to_proto(tokens: Sequence[SampledToken]) -> pb.Tokens:
    """A Tokens event holding ``tokens`` in order."""
    return pb.Tokens(tokens=[token_to_proto(t) for t in tokens])


def record_to_proto(r: TransferRecord) -> pb.TransferRecord:
    """A KV transfer record (bytes, ms, outcome, path) as a wire message."""
    return pb.TransferRecord(
        transfer_id=r.transfer_id,
        bytes=r.bytes,
        ms=r.ms,
        outcome=r.outcome.value,
        path=r.path,
        error=r.error or "",
    )
