"""Benchmark workloads: lists of prompts with exact token lengths and output lengths.

- ``random``: random-token prompts of ``input_len`` tokens (uniform in
  ``[len * (1 - range_ratio), len * (1 + range_ratio)]``, the ``vllm bench serve`` convention),
  optionally after a shared random prefix of ``prefix_len`` tokens; outputs likewise.
- ``shared-prefix``: ``num_groups`` system prompts x ``prompts_per_group`` questions, shuffled, so
  requests of a group share a long prefix (prefix-cache workloads; SGLang's "generated shared
  prefix" benchmark has the same shape).
- ``mixed``: short chat turns plus a given fraction of long RAG-style prompts (a shared instruction,
  then a long document body), the traffic where long prefills stall short requests' tokens.
- ``jsonl``: trace replay; one JSON object per line with ``output_len`` and either ``prompt`` (text)
  or ``prompt_len`` (tokens), and optionally ``timestamp`` (seconds from the trace start) or
  ``timestamp_ms``; arrivals then follow the timestamps.

Prompt text is built by decoding random token ids and re-encoding until the text is exactly the
wanted number of tokens under the bench tokenizer (a few rounds; if a tokenizer will not settle the
nearest length is kept and reported as the request's ``prompt_len``). Everything is seeded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.bench.word_tokenizer import BenchTokenizer

DATASETS = ("random", "shared-prefix", "mixed", "jsonl")


class DatasetError(ValueError):
    """A dataset argument or trace line is invalid (one line, names the field or line)."""


@dataclass(frozen=True)
class SampleRequest:
    """One request of a workload.

    ``prompt`` is the text sent to /v1/completions; on /v1/chat/completions ``messages`` is sent
    when set, else one user message holding ``prompt``. ``prompt_len`` is in tokens of the bench
    tokenizer (chat template not included). ``timestamp`` (seconds from the first request) is set
    only for trace replay. ``label`` names the request class ('random', 'short', 'long', 'group3').
    """

    prompt: str
    prompt_len: int
    output_len: int
    messages: tuple[tuple[str, str], ...] | None = None  # ((role, content), ...)
    timestamp: float | None = None
    label: str = ""

    def chat_messages(self) -> list[dict[str, str]]:
        """OpenAI chat ``messages`` for this request."""
        if self.messages:
            return [{"role": r, "content": c} for r, c in self.messages]
        return [{"role": "user", "content": self.prompt}]


class PromptBuilder:
    """Builds random text of an exact token count under ``tokenizer``. Seeded by ``rng``."""

    def __init__(self, tokenizer: BenchTokenizer, rng: np.random.Generator, rounds: int = 10):
        self.tokenizer = tokenizer
        self.rng = rng
        self.rounds = rounds
        self._usable_cache: dict[int, bool] = {}

    def count(self, text: str) -> int:
        """Tokens in ``text`` without special tokens."""
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _usable(self, token_id: int) -> bool:
        """A token that decodes on its own to non-empty valid text (not special, not a byte
        fragment of a multi-byte character), so any sequence of them decodes cleanly."""
        ok = self._usable_cache.get(token_id)
        if ok is None:
            piece = self.tokenizer.decode([token_id], skip_special_tokens=True)
            ok = bool(piece) and "\ufffd" not in piece
            self._usable_cache[token_id] = ok
        return ok

    def _ids(self, n: int) -> list[int]:
        """``n`` random usable token ids. Raises DatasetError if the vocabulary has almost none."""
        out: list[int] = []
        for _ in range(100):
            if len(out) >= n:
                break
            draw = self.rng.integers(0, self.tokenizer.vocab_size, size=2 * (n - len(out)) + 8)
            out.extend(int(i) for i in draw if self._usable(int(i)))
        if len(out) < n:
            raise DatasetError("the tokenizer decodes almost no token ids to valid text")
        return out[:n]

    def text(self, num_tokens: int, prefix: str = "") -> tuple[str, int]:
        """Random text ``t`` so ``prefix + ' ' + t`` (or ``t`` alone) has the wanted tokens.

        ``num_tokens`` counts only the new part. Returns (t, tokens of the whole prompt).
        """
        base = self.count(prefix) if prefix else 0
        target = base + num_tokens
        ids = self._ids(num_tokens)
        best: tuple[int, str, int] | None = None
        for _ in range(self.rounds):
            body = self.tokenizer.decode(ids, skip_special_tokens=True)
            total = self.count(f"{prefix} {body}" if prefix else body)
            if best is None or abs(total - target) < best[0]:
                best = (abs(total - target), body, total)
            if total == target:
                break
            diff = target - total
            ids = ids + self._ids(diff) if diff > 0 else ids[: max(0, len(ids) + diff)]
        assert best is not None
        return best[1], best[2]


def _sample_len(rng: np.random.Generator, mean: int, ratio: float, minimum: int = 1) -> int:
    """Integer uniform in [mean * (1 - ratio), mean * (1 + ratio)], at least ``minimum``."""
    lo = max(minimum, math.floor(mean * (1 - ratio)))
    hi = max(lo, math.ceil(mean * (1 + ratio)))
    return int(rng.integers(lo, hi + 1))


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if v <= 0:
            raise DatasetError(f"--{name.replace('_', '-')} must be > 0, got {v}")


def random_requests(
    tokenizer: BenchTokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """``num_prompts`` random-token prompts (see module docstring). Lengths in tokens.

    Raises DatasetError for non-positive lengths or ``range_ratio`` outside [0, 1).
    """
    _check_positive(num_prompts=num_prompts, random_input_len=input_len,
                    random_output_len=output_len)  # fmt: skip
    if not 0 <= range_ratio < 1:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if prefix_len < 0:
        raise DatasetError(f"--random-prefix-len must be >= 0, got {prefix_len}")
    rng = np.random.default_rng(seed)
    builder = PromptBuilder(tokenizer, rng)
    prefix = builder.text(prefix_len)[0] if prefix_len else ""
    out = []
    for _ in range(num_prompts):
        n_in = _sample_len(rng, input_len, range_ratio, 1)
        n_out = _sample_len(rng, output_len, range_ratio, 1)
        body, total = builder.text(n_in, prefix)
        prompt = f"{prefix} {body}" if prefix else body
        out.append(SampleRequest(prompt, total, n_out, label="random"))
    return out


def shared_prefix_requests(
    tokenizer: BenchTokenizer,
    num_groups: int,
    prompts_per_group: int,
    system_len: int,
    question_len: int,
    output_len: int,
    seed: int = 0,
) -> list[SampleRequest]:
    """``num_groups * prompts_per_group`` requests, shuffled; each group shares a system prompt.

    The chat form sends (system, user) messages; the completions form sends ``system + ' ' +
    question``. Raises DatasetError for non-positive sizes.
    """
    _check_positive(shared_prefix_num_groups=num_groups,
                    shared_prefix_prompts_per_group=prompts_per_group,
                    shared_prefix_system_len=system_len,
                    shared_prefix_question_len=question_len,
                    shared_prefix_output_len=output_len)  # fmt: skip
    rng = np.random.default_rng(seed)
    builder = PromptBuilder(tokenizer, rng)
    out = []
    for g in range(num_groups):
        system, _ = builder.text(system_len)
        for _ in range(prompts_per_group):
            question, total = builder.text(question_len, system)
            out.append(
                SampleRequest(
                    prompt=f"{system} {question}",
                    prompt_len=total,
                    output_len=output_len,
                    messages=(("system", system), ("user", question)),
                    label=f"group{g}",
                )
            )
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def mixed_requests(
    tokenizer: BenchTokenizer,
    num_prompts: int,
    long_fraction: float,
    short_input_len: int,
    short_output_len: int,
    long_input_len: int,
    long_output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Short chats (label 'short') mixed with ``round(long_fraction * num_prompts)`` long prompts.

    Long prompts (label 'long') are a fixed instruction line shared by all of them plus a random
    document body up to ``long_input_len`` tokens in all. Positions of long prompts are shuffled.
    Raises DatasetError for sizes out of range.
    """
    _check_positive(num_prompts=num_prompts, mixed_short_input_len=short_input_len,
                    mixed_short_output_len=short_output_len, mixed_long_input_len=long_input_len,
                    mixed_long_output_len=long_output_len)  # fmt: skip
    if not 0 <= long_fraction <= 1:
        raise DatasetError(f"--mixed-long-fraction must be in [0, 1], got {long_fraction}")
    if not 0 <= range_ratio < 1:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    builder = PromptBuilder(tokenizer, rng)
    n_long = round(long_fraction * num_prompts)
    is_long = np.zeros(num_prompts, dtype=bool)
    is_long[rng.choice(num_prompts, size=n_long, replace=False)] = True
    instruction = "Answer the question using only the documents below."
    instr_len = builder.count(instruction)
    if long_input_len <= instr_len:
        raise DatasetError(
            f"--mixed-long-input-len must be > {instr_len} (the instruction line), "
            f"got {long_input_len}"
        )
    out = []
    for long in is_long:
        if long:
            n_in = _sample_len(rng, long_input_len, range_ratio, instr_len + 1)
            body, total = builder.text(n_in - instr_len, instruction)
            n_out = _sample_len(rng, long_output_len, range_ratio, 1)
            out.append(SampleRequest(f"{instruction} {body}", total, n_out, label="long"))
        else:
            n_in = _sample_len(rng, short_input_len, range_ratio, 1)
            body, total = builder.text(n_in)
            n_out = _sample_len(rng, short_output_len, range_ratio, 1)
            out.append(SampleRequest(body, total, n_out, label="short"))
    return out


def _trace_int(obj: dict, keys: Sequence[str], where: str, required: bool = True) -> int | None:
    for key in keys:
        if key in obj:
            v = obj[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v <= 0:
                raise DatasetError(f"{where}: {key!r} must be a positive integer, got {v!r}")
            return int(v)
    if required:
        raise DatasetError(f"{where}: missing {' or '.join(repr(k) for k in keys)}")
    return None


def jsonl_requests(
    tokenizer: BenchTokenizer,
    path: str | Path,
    num_prompts: int | None = None,
    time_scale: float = 1.0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Read a JSONL trace (see module docstring); the first ``num_prompts`` lines if given.

    Timestamps are shifted so the earliest is 0 and multiplied by ``time_scale`` (0.5 replays
    twice as fast); requests come back sorted by timestamp. Lines without a timestamp are sent at
    the start. Raises DatasetError naming the file, line and field of the first bad line.
    """
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"--dataset-path: file not found: {p}")
    if not time_scale > 0:
        raise DatasetError(f"--trace-time-scale must be > 0, got {time_scale}")
    builder = PromptBuilder(tokenizer, np.random.default_rng(seed))
    rows: list[SampleRequest] = []
    any_ts = False
    for lineno, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if num_prompts is not None and len(rows) >= num_prompts:
            break
        where = f"{p}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise DatasetError(f"{where}: each line must be a JSON object")
        out_len = _trace_int(obj, ("output_len", "output_length", "max_tokens"), where)
        ts: float | None = None
        for key, scale in (("timestamp", 1.0), ("timestamp_ms", 1e-3)):
            if key in obj:
                v = obj[key]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                    raise DatasetError(f"{where}: {key!r} must be a number >= 0, got {v!r}")
                ts = float(v) * scale
                any_ts = True
        if isinstance(obj.get("prompt"), str) and obj["prompt"]:
            prompt = obj["prompt"]
            prompt_len = builder.count(prompt)
        elif "prompt" in obj:
            raise DatasetError(f"{where}: 'prompt' must be a non-empty string")
        else:
            n = _trace_int(obj, ("prompt_len", "input_length", "input_len"), where)
            assert n is not None
            prompt, prompt_len = builder.text(n)
        assert out_len is not None
        rows.append(SampleRequest(prompt, prompt_len, out_len, timestamp=ts, label="trace"))
    if not rows:
        raise DatasetError(f"--dataset-path {p}: the trace holds no requests")
    if not any_ts:
        return rows
    t0 = min(r.timestamp for r in rows if r.timestamp is not None)
    shifted = [
        SampleRequest(
            r.prompt,
            r.prompt_len,
            r.output_len,
            timestamp=0.0 if r.timestamp is None else (r.timestamp - t0) * time_scale,
            label=r.label,
        )
        for r in rows
    ]
    return sorted(shifted, key=lambda r: r.timestamp or 0.0)
