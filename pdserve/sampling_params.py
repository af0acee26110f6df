"""Per-request sampling settings (DESIGN §6), validated once at the edge.

Ranges follow the OpenAI API reference and vLLM's SamplingParams: temperature >= 0 (0 = greedy),
top_p in (0, 1], top_k 0/-1 = off, min_p in [0, 1], presence/frequency penalties in [-2, 2],
repetition_penalty > 0 (1 = off), top_logprobs in [0, 20].
"""

from __future__ import annotations

from dataclasses import dataclass, field


class SamplingError(ValueError):
    """A sampling value is out of range. ``field`` names the offending parameter."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. All token counts are in tokens.

    ``max_tokens`` counts every output token (token 1 included); ``None`` = up to the model limit
    (the router resolves it before a worker sees the request). ``stop`` strings are matched in text
    by the router; workers only see ``stop_token_ids``.
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
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    skip_special_tokens: bool = True
    extra: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        def bad(name: str, msg: str) -> None:
            raise SamplingError(name, f"'{name}' {msg}")

        if not self.temperature >= 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1, 0 (off) or a positive count, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2 <= v <= 2:
                bad(name, f"must be in [-2, 2], got {v}")
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            bad("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.n < 1:
            bad("n", f"must be >= 1, got {self.n}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            bad("seed", f"must be in [0, 2^63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0 or self.top_k == 1
