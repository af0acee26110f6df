"""The contract between a scheduler (no torch) and the ModelRunner (tensors).

A scheduler decides, each step, which sequences compute which tokens and returns them as a
:class:`SchedulerOutput`; the runner turns its ``scheduled`` list into one forward pass over a
mixed batch of prefill chunks and single-token decodes, writes the new KV into the paged pool by
slot mapping, and samples where asked; the scheduler then takes the sampled tokens back in
``update_from_output(output, sampled)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from pdserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.structured.grammar import GrammarMatcher

S = TypeVar("S")


@dataclass
class ScheduledSeq:
    """One sequence's share of a step.

    ``token_ids``: the tokens to compute now (a prefill chunk, or one decode token), occupying
    positions ``[num_computed, num_computed + len(token_ids))``. ``num_computed``: tokens whose KV
    is already in the pool (earlier chunks, prefix-cache hits, or earlier decode steps).
    ``block_table``: physical block ids covering at least ``num_computed + len(token_ids)`` tokens.
    ``sample``: sample a token after the last one (False for a non-final prefill chunk).
    ``output_token_ids``: tokens generated so far (for penalties and the seeded generator's
    position); ``prompt_token_ids``: the prompt (for repetition penalty and prompt logprobs).
    ``grammar``: the sequence's structured-output state when ``sampling.structured`` is set; the
    Sampler masks by it and advances it over the token it samples.
    """

    request_id: str
    token_ids: list[int]
    num_computed: int
    block_table: list[int]
    sample: bool
    sampling: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    grammar: GrammarMatcher | None = None

    @property
    def num_tokens_after(self) -> int:
        """Sequence length once this step's tokens are in the KV cache."""
        return self.num_computed + len(self.token_ids)


@dataclass
class SchedulerOutput(Generic[S]):
    """One step's work, in batch order: ``scheduled[i]`` is computed for ``seqs[i]`` (the
    scheduler's own per-request state). Token counts split prefill (prompt chunks) from decode
    (one token per decoding sequence)."""

    seqs: list[S] = field(default_factory=list)
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    def add(self, seq: S, scheduled: ScheduledSeq, *, decode: bool = False) -> None:
        """Append one sequence's share; ``decode``: a decode token rather than a prompt chunk."""
        self.seqs.append(seq)
        self.scheduled.append(scheduled)
        if decode:
            self.num_decode_tokens += len(scheduled.token_ids)
        else:
            self.num_prefill_tokens += len(scheduled.token_ids)

    @property
    def is_empty(self) -> bool:
        """True when nothing is to be computed."""
        return not self.scheduled

    @property
    def num_scheduled_tokens(self) -> int:
        """Query tokens of the step (rows of the forward)."""
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_sampled(self) -> int:
        """Sequences that sample a token this step."""
        return sum(s.sample for s in self.scheduled)
