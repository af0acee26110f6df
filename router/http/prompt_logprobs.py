"""Response shapes of prompt log-probabilities (torch-free, no FastAPI).

Two forms, as the APIs pdserve mirrors define them:

* OpenAI's legacy completions ``echo`` + ``logprobs``: the prompt's tokens come first in
  ``logprobs.tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``, the first
  token's logprob and alternatives ``null`` (nothing precedes it), then the completion's.
* vLLM's ``prompt_logprobs``: a list with one entry per prompt token, ``null`` first, then
  ``{token_id: {"logprob", "rank", "decoded_token"}}`` holding the prompt token and the top
  alternatives (``rank``: 1-based rank in the whole vocabulary, ties counting against the
  token, as vLLM's: the worker computes the prompt token's, and an alternative's is its place
  among the alternatives, best first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pdserve.types import SampledToken


def legacy_top_logprobs(
    t: SampledToken, top: int, token_text: Callable[[int], str]
) -> dict[str, float]:
    """One position's ``top_logprobs`` entry of a legacy completion: the ``top`` best tokens and
    the chosen token, text -> logprob (OpenAI: "the API will always return the logprob of the
    sampled token, so there may be up to logprobs+1 elements"; vLLM does the same), so
    ``logprobs: 0`` gives the chosen token alone."""
    out = {token_text(i): lp for i, lp in t.top_logprobs[:top]}
    out.setdefault(token_text(t.token_id), t.logprob)
    return out


def echo_logprobs(
    prompt_ids: Sequence[int],
    prompt_lps: Sequence[SampledToken],
    top: int,
    token_text: Callable[[int], str],
) -> dict[str, list[Any]]:
    """The prompt part of a legacy ``logprobs`` object (offsets from 0). ``prompt_lps``: prompt
    tokens 1..n-1 (SampledToken per token, best alternatives first)."""
    texts = [token_text(t) for t in prompt_ids]
    offsets, at = [], 0
    for s in texts:
        offsets.append(at)
        at += len(s)
    token_lps: list[float | None] = [None]
    tops: list[dict[str, float] | None] = [None]
    for t in prompt_lps:
        token_lps.append(t.logprob)
        tops.append(legacy_top_logprobs(t, top, token_text))
    return {
        "tokens": texts,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def end_offset(part: dict[str, list[Any]], start: int) -> int:
    """The ``text_offset`` after a legacy ``logprobs`` part that began at ``start``.

    Offsets are running sums of the tokens' text lengths (the echoed prompt's from 0, then the
    completion's), so they only go up; they index ``text`` exactly where every token decodes to
    whole characters (a special token skipped in the text, or one character split over byte
    tokens, shifts them), as in vLLM."""
    if not part["tokens"]:
        return start
    return int(part["text_offset"][-1]) + len(part["tokens"][-1])


def join_logprobs(head: dict[str, list[Any]], tail: dict[str, list[Any]] | None) -> dict[str, Any]:
    """``head`` followed by ``tail`` (same keys), as one legacy ``logprobs`` object."""
    if tail is None:
        return head
    return {k: head[k] + tail[k] for k in head}


def vllm_prompt_logprobs(
    prompt_ids: Sequence[int], prompt_lps: Sequence[SampledToken], token_text: Callable[[int], str]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` list for a prompt (see the module docstring)."""
    out: list[dict[str, dict[str, Any]] | None] = [None] if prompt_ids else []
    for t in prompt_lps:
        entry: dict[str, dict[str, Any]] = {}
        ranks = {tid: r + 1 for r, (tid, _) in enumerate(t.top_logprobs)}
        entry[str(t.token_id)] = {
            "logprob": t.logprob,
            "rank": t.rank or ranks.get(t.token_id),
            "decoded_token": token_text(t.token_id),
        }
        for tid, lp in t.top_logprobs:
            entry.setdefault(
                str(tid), {"logprob": lp, "rank": ranks[tid], "decoded_token": token_text(tid)}
            )
        out.append(entry)
    return out
