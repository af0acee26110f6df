"""Per-request sampling settings (DESIGN §6), validated once at the edge.

Ranges follow the OpenAI API reference and vLLM's SamplingParams: temperature in [0, 2] (0 =
greedy; OpenAI's documented range), top_p in (0, 1], top_k 0/-1 = off, min_p in [0, 1],
presence/frequency penalties in [-2, 2], repetition_penalty in [1e-4, 1e4] (1 = off; vLLM only
asks > 0, but float32 logits overflow past this range), top_logprobs in
[0, 20], min_tokens <= max_tokens, logit_bias values in [-100, 100] (OpenAI), prompt_logprobs in
[0, 20] (vLLM's extension; None = off); at most 64 stop strings of at most 1024 characters and
1024 stop token ids. Every float must be finite (JSON's bare ``NaN``/``Infinity``
literals parse, so the edge must refuse them). Integer counts and token ids travel as protobuf
``int32`` (worker.proto), so they must fit in [0, 2^31); seeds travel as ``uint64`` and are kept in
[0, 2^63). Token ids are checked against the vocabulary by the router, which knows it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Collection
from dataclasses import dataclass, field

from pdserve.structured.spec import StructuredOutputSpec


class SamplingError(ValueError):
    """A sampling value is out of range. ``field`` names the offending parameter."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


MAX_TOP_LOGPROBS = 20
MAX_INT32 = 2**31 - 1  # largest value of a protobuf int32 field
MAX_TEMPERATURE = 2.0  # OpenAI API reference: temperature is between 0 and 2
# repetition_penalty divides (or multiplies) logits: outside this range float32 logits overflow
# or underflow (1e39 is inf in float32, 1e-50 is 0.0), and within it the effect has long
# saturated (HF/vLLM users pass 1.0-2.0).
MIN_REPETITION_PENALTY = 1e-4
MAX_REPETITION_PENALTY = 1e4
# Workers get these floats as protobuf ``float`` (float32). 1e-4 is not a float32: it arrives as
# 9.99999975e-05, so a worker checks the lower limit as the float32 it travels as.
_MIN_REPETITION_PENALTY_F32 = struct.unpack("f", struct.pack("f", MIN_REPETITION_PENALTY))[0]
# The smallest positive float32 (a subnormal): a positive top_p below it would arrive as 0.0,
# which the wire reads as "unset"; rpc.sampling_to_proto sends this instead.
MIN_POSITIVE_F32 = 2.0**-149
# Hostile-input bounds (issue 12). The router matches stop strings against every output token's
# text, so their number and length bound per-token work; OpenAI allows 4 stop strings, vLLM has no
# cap, these leave room for any real use.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024  # checked by the router before it adds the model's EOS ids
MAX_LOGIT_BIAS = 100.0  # OpenAI API reference: logit_bias values are between -100 and 100


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. All token counts are in tokens.

    ``max_tokens`` counts every output token (token 1 included); ``None`` = up to the model limit
    (the router resolves it before a worker sees the request). ``stop`` strings are matched in text
    by the router; workers only see ``stop_token_ids``. ``include_stop_str_in_output``: the text
    keeps the stop string that ended it (vLLM's extension; the router's, like ``stop``).

    ``logit_bias``: (token id, bias) pairs added to the logits before sampling (OpenAI's
    ``logit_bias``; +100 all but forces a token, -100 all but bans it). ``allowed_token_ids``:
    when set, every other token is masked (vLLM's extension). ``structured``: the output must
    match this spec (JSON schema, regex, choice, grammar). ``prompt_logprobs``: when set, the
    prefill also reports the log-probability of every prompt token after the first and this many
    top alternatives (vLLM's extension). Reported logprobs are always the model's own
    distribution, before any of these masks or biases.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    structured: StructuredOutputSpec | None = None
    prompt_logprobs: int | None = None
    extra: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        def bad(name: str, msg: str) -> None:
            raise SamplingError(name, f"'{name}' {msg}")

        for name in (
            "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty",
        ):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, f"must be a finite number, got {v!r}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= MAX_INT32:
            bad(
                "top_k",
                f"must be -1, 0 (off) or a positive count <= {MAX_INT32}, got {self.top_k}",
            )
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2 <= v <= 2:
                bad(name, f"must be in [-2, 2], got {v}")
        if not _MIN_REPETITION_PENALTY_F32 <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            bad(
                "repetition_penalty",
                f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 = off), "
                f"got {self.repetition_penalty:g}",
            )
        if self.max_tokens is not None and not 1 <= self.max_tokens <= MAX_INT32:
            bad("max_tokens", f"must be in [1, {MAX_INT32}], got {self.max_tokens}")
        if not 0 <= self.min_tokens <= MAX_INT32:
            bad("min_tokens", f"must be in [0, {MAX_INT32}], got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            bad("stop", f"strings may be at most {MAX_STOP_STRING_CHARS} characters, got {longest}")
        for t in self.stop_token_ids:
            if not 0 <= t <= MAX_INT32:
                bad("stop_token_ids", f"must hold token ids in [0, {MAX_INT32}], got {t}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            bad("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if not 1 <= self.n <= MAX_INT32:
            bad("n", f"must be in [1, {MAX_INT32}], got {self.n}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            bad("seed", f"must be in [0, 2^63), got {self.seed}")
        seen: set[int] = set()
        for t, b in self.logit_bias:
            if not 0 <= t <= MAX_INT32:
                bad("logit_bias", f"key '{t}' is not a token id in [0, {MAX_INT32}]")
            if t in seen:
                bad("logit_bias", f"key '{t}' is given twice")
            seen.add(t)
            if (
                isinstance(b, bool)
                or not isinstance(b, (int, float))
                or not math.isfinite(b)
                or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
            ):
                bad(
                    "logit_bias",
                    f"value for key '{t}' must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {b!r}",
                )
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                bad("allowed_token_ids", "must hold at least one token id when given")
            for t in self.allowed_token_ids:
                if not 0 <= t <= MAX_INT32:
                    bad("allowed_token_ids", f"must hold token ids in [0, {MAX_INT32}], got {t}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            bad(
                "prompt_logprobs",
                f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}",
            )

    def check_min_tokens_reachable(self, eos_token_ids: Collection[int]) -> None:
        """Refuse ``min_tokens`` > 0 with an ``allowed_token_ids`` that holds only ids ending
        the sequence: ``stop_token_ids`` and, unless ``ignore_eos``, ``eos_token_ids`` (the
        model's EOS ids). ``min_tokens`` masks those ids until that many tokens exist (vLLM's
        min_tokens rule; :mod:`pdserve.sampling` step 5), so no token would be left to sample
        and the sampler would emit the forbidden ids anyway. With ``ignore_eos`` an EOS does not
        end the sequence, so it still counts. Raises SamplingError naming ``allowed_token_ids``.
        """
        if self.min_tokens == 0 or self.allowed_token_ids is None:
            return
        ending = set(self.stop_token_ids)
        if not self.ignore_eos:
            ending.update(eos_token_ids)
        if ending.issuperset(self.allowed_token_ids):
            shown = sorted(set(self.allowed_token_ids))[:8]
            raise SamplingError(
                "allowed_token_ids",
                f"'allowed_token_ids' {shown} holds only EOS or stop token ids, which "
                f"'min_tokens' ({self.min_tokens}) forbids until {self.min_tokens} tokens were "
                "generated, so no token is left to sample; allow another token id or drop "
                "'min_tokens'",
            )

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0 or self.top_k == 1
