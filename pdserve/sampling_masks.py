"""The token masks and biases of step 5 of :mod:`pdserve.sampling`: OpenAI's ``logit_bias``,
vLLM's ``allowed_token_ids`` and the structured-output grammar's token bitmask.

Both functions work in place on processed logits ``x`` [num_seqs, vocab] (fp32, after penalties
and the ``min_tokens`` mask), row ``i`` belonging to ``seqs[i]``. The grammar wins over
``min_tokens``, biases and ``allowed_token_ids``: a row they left with no token the grammar allows
gets the grammar's tokens back from the raw logits (the router refuses a request whose
``allowed_token_ids`` hold none of the grammar's first tokens, so this is a later step's conflict,
such as the grammar's EOS outside ``allowed_token_ids``); a matcher in its error state (or a live one allowing nothing)
allows only EOS, so the sequence ends instead of running on.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from pdserve.engine.batch import ScheduledSeq
from pdserve.sampling_params import SamplingParams
from pdserve.structured.grammar import (
    GrammarMatcher,
    allocate_bitmask,
    fill_bitmasks,
    unpack_bitmask,
)


def apply_bias_and_allowed(
    x: torch.Tensor,
    seqs: Sequence[ScheduledSeq],
    vocab_size: int,
    check: Callable[[SamplingParams], None],
) -> None:
    """In place on ``x`` [n, vocab_size]: add ``logit_bias``, mask tokens outside
    ``allowed_token_ids``. ``check``: the sampler's vocabulary check, run before indexing (raises
    SamplingError, a ValueError, for an id outside the vocabulary)."""
    for i, s in enumerate(seqs):
        p = s.sampling
        if p.logit_bias:
            check(p)
            ids = torch.tensor([t for t, _ in p.logit_bias], device=x.device)
            bias = torch.tensor([b for _, b in p.logit_bias], device=x.device)
            x[i, ids] += bias
        if p.allowed_token_ids is not None:
            check(p)
            keep = torch.tensor(p.allowed_token_ids, device=x.device)
            banned = torch.ones(vocab_size, dtype=torch.bool, device=x.device)
            banned[keep] = False
            x[i].masked_fill_(banned, float("-inf"))


def apply_grammar(
    x: torch.Tensor,
    raw: torch.Tensor,
    seqs: Sequence[ScheduledSeq],
    vocab_size: int,
    eos_token_ids: Collection[int],
) -> None:
    """In place on ``x`` [n, vocab_size]: mask what each row's grammar forbids next.

    ``raw``: the unprocessed logits, for the rows where min_tokens left nothing the grammar
    allows (the grammar wins). A matcher in its error state allows only ``eos_token_ids``.
    """
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return
    bitmask = allocate_bitmask(len(rows), vocab_size)
    live: list[tuple[GrammarMatcher, int]] = []
    broken: list[tuple[GrammarMatcher, int]] = []
    for j, i in enumerate(rows):
        m = seqs[i].grammar
        assert m is not None
        (broken if m.error else live).append((m, j))
    if live:
        fill_bitmasks(live, bitmask)
    allowed = torch.from_numpy(unpack_bitmask(bitmask, vocab_size)).to(x.device)
    stuck = [j for _, j in broken]
    if len(live) > len(broken):  # a live grammar allowing nothing is an error state too
        stuck += (~allowed.any(dim=1)).nonzero().flatten().tolist()
    if stuck:
        eos_only = torch.zeros(vocab_size, dtype=torch.bool, device=x.device)
        eos_only[list(eos_token_ids)] = True
        allowed[sorted(set(stuck))] = eos_only
    whole = len(rows) == x.shape[0]  # every row constrained: mask in place, no row copies
    idx = torch.tensor(rows, device=x.device)
    masked = (
        x.masked_fill_(~allowed, float("-inf"))
        if whole
        else x[idx].masked_fill(~allowed, float("-inf"))
    )
    dead = torch.isneginf(masked.amax(dim=-1))
    if bool(dead.any()):  # min_tokens or a bias left nothing: keep the grammar's tokens
        masked[dead] = raw[idx[dead]].masked_fill(~allowed[dead], float("-inf"))
    if not whole:
        x[idx] = masked
