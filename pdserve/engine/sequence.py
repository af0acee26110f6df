"""A request's progress inside a worker's scheduler: the state both schedulers share.

:class:`EngineSeq` holds the token ids (prompt, earlier outputs, tokens generated here), how many
of them have KV in the pool, and the two operations both workers need: cutting the next
:class:`~pdserve.engine.batch.ScheduledSeq` out of it, and appending a sampled token with the
stop check (EOS, stop token ids, ``max_tokens``, ``max_model_len``). :func:`queue_by_arrival`
keeps a worker's queues in the order its sequences first arrived at their router.
"""

from __future__ import annotations

import time
from collections.abc import Collection, MutableSequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from pdserve.engine.batch import ScheduledSeq
from pdserve.engine.request import EngineRequest

if TYPE_CHECKING:
    from pdserve.structured.grammar import GrammarMatcher

R = TypeVar("R", bound=EngineRequest)


@dataclass(eq=False)
class EngineSeq(Generic[R]):
    """One request (attempt) on a worker.

    ``token_ids``: the request's prompt token ids (earlier outputs included), then the tokens
    generated here. ``prompt_token_ids`` / ``output_token_ids``: the same ids split into the
    original prompt and every output token (earlier attempts first). ``num_computed``: tokens
    whose KV is in the pool (prefix-cache hits included); ``num_cached``: tokens served from the
    prefix cache at admission. ``grammar``: the structured-output state when the request has
    ``sampling.structured``, already advanced over the earlier output in its prompt; the sampler
    masks by it and advances it over each token it samples (the decode worker also advances it
    over token 1 received from the prefill worker). ``queue_key``: its place in the worker's
    queues (``time.monotonic()`` seconds): the request's ``arrival_time``, capped at when this
    object was made (a stamp from the future would jump the queue), else that time.
    """

    request: R
    num_computed: int = 0
    num_cached: int = 0
    grammar: GrammarMatcher | None = None
    token_ids: list[int] = field(init=False)
    prompt_token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(init=False)
    queue_key: float = field(init=False)

    def __post_init__(self) -> None:
        now = time.monotonic()
        arrival = self.request.arrival_time
        self.queue_key = now if arrival is None else min(arrival, now)
        tokens = list(self.request.prompt_token_ids)
        split = len(tokens) - self.request.num_output_tokens
        self.token_ids = tokens
        self.prompt_token_ids = tokens[:split]
        self.output_token_ids = tokens[split:]

    @property
    def request_id(self) -> str:
        """The router's request id."""
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens the prefill computes (the request's prompt, earlier outputs included)."""
        return len(self.request.prompt_token_ids)

    @property
    def num_remaining_prompt_tokens(self) -> int:
        """Prompt tokens whose KV is not in the pool yet (0 once decoding)."""
        return max(0, self.num_prompt_tokens - self.num_computed)

    def schedule(self, num_tokens: int, block_table: list[int]) -> ScheduledSeq:
        """The step's share for this sequence: its next ``num_tokens`` uncomputed tokens, over
        ``block_table`` (covering them). Samples when they reach the last known token.

        The prompt and output lists are shared, not copied: they must not change before the
        runner has used the ScheduledSeq (the scheduler appends only after the step).
        """
        start = self.num_computed
        end = start + num_tokens
        return ScheduledSeq(
            request_id=self.request_id,
            token_ids=self.token_ids[start:end],
            num_computed=start,
            block_table=block_table,
            sample=end == len(self.token_ids),
            sampling=self.request.sampling,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=self.output_token_ids,
            grammar=self.grammar,
        )

    def append_token(
        self, token_id: int, eos_token_ids: Collection[int], max_model_len: int
    ) -> str | None:
        """Append a sampled token; return the finish reason it causes, or None.

        'stop': an EOS id (unless ``ignore_eos``) or one of ``stop_token_ids``, both only once
        ``min_tokens`` outputs exist, or an EOS id that ends the request's grammar (complete, or
        broken so that only EOS may follow) whatever ``min_tokens`` and ``ignore_eos`` say: the
        grammar wins over both, as in the sampler, and nothing may follow its end; 'length':
        ``max_tokens`` outputs (earlier attempts included) or ``max_model_len`` tokens in all.
        """
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        sp = self.request.sampling
        n_out = len(self.output_token_ids)
        if n_out >= sp.min_tokens and (
            (token_id in eos_token_ids and not sp.ignore_eos) or token_id in sp.stop_token_ids
        ):
            return "stop"
        g = self.grammar
        if g is not None and token_id in eos_token_ids and (g.is_terminated or g.error):
            return "stop"
        if sp.max_tokens is not None and n_out >= sp.max_tokens:
            return "length"
        if len(self.token_ids) >= max_model_len:
            return "length"
        return None


S = TypeVar("S", bound=EngineSeq)  # type: ignore[type-arg]


def queue_by_arrival(queue: MutableSequence[S], seq: S) -> None:
    """Insert ``seq`` into ``queue``, which is kept in ``queue_key`` order (oldest first), after
    every sequence with the same or an earlier key. Sequences that arrive now go to the back in
    O(1); a re-placed one walks back past those that came after it."""
    at = len(queue)
    while at > 0 and queue[at - 1].queue_key > seq.queue_key:
        at -= 1
    queue.insert(at, seq)
