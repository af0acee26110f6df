"""Step statistics over a sliding time window: mean step time and token rate for GetStats."""

from __future__ import annotations

import time
from collections import deque


class StepWindow:
    """Recent steps as (end time s, duration s, tokens, sequences), kept for ``window_s`` seconds,
    and the tokens of every step since start (``total_tokens``).

    Times are ``time.monotonic()`` seconds. The rate is tokens over the last ``window_s``
    seconds (or over the time since the window was created, when that is shorter), so an idle
    worker decays to 0.
    """

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._steps: deque[tuple[float, float, int, int]] = deque()
        self._created = time.monotonic()
        self.total_tokens = 0

    def add(self, end: float, duration: float, tokens: int, batch: int = 0) -> None:
        """Record a step that ended at ``end`` (monotonic s), took ``duration`` s, computed or
        sampled ``tokens`` tokens, over ``batch`` sequences."""
        self._steps.append((end, duration, tokens, batch))
        self.total_tokens += tokens
        self._trim(end)

    def _trim(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self.window_s:
            self._steps.popleft()

    def rates(self, now: float | None = None) -> tuple[float, float]:
        """(mean step time in ms, tokens per second) over the window ending ``now``."""
        now = time.monotonic() if now is None else now
        self._trim(now)
        if not self._steps:
            return 0.0, 0.0
        step_ms = 1000.0 * sum(s[1] for s in self._steps) / len(self._steps)
        span = min(self.window_s, max(now - self._created, 1e-3))
        return step_ms, sum(s[2] for s in self._steps) / span

    def mean_batch(self, now: float | None = None) -> float:
        """Mean sequences per step over the window ending ``now`` (0 when idle)."""
        self._trim(time.monotonic() if now is None else now)
        return sum(s[3] for s in self._steps) / len(self._steps) if self._steps else 0.0
