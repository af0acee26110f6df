"""Stop strings over streamed text.

A stop string may sit inside one token's text ("CDEF" carrying stop "DE") or straddle tokens
("...D" then "E..."). The matcher keeps back the longest tail of what it has seen that is a proper
prefix of some stop string, so text that might still become a stop is never emitted; when a stop
completes, the text before it is released and the stop itself (and anything after it) is dropped,
as the OpenAI API does (with ``include_stop``, vLLM's ``include_stop_str_in_output``, the stop
string is released too). The stream ends at the first stop string to *complete*: with stops "a" and
"baa", text "baa" stops after "b" (at "a"), whichever way the text was split into pieces.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Filters a text stream against ``stops`` (non-empty strings).

    ``feed(text)`` -> (text safe to emit now, stopped). Once stopped, further feeds return
    ("", True); ``matched`` names the stop string that ended the stream. ``flush()`` releases
    the held-back tail at the end of an unstopped stream. ``include_stop``: the emitted text
    ends with the stop string instead of before it. Raises ValueError for an empty stop string.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        if isinstance(stops, str):
            raise ValueError("'stop' must be a list of strings, not one string")
        for i, s in enumerate(stops):
            if not isinstance(s, str) or not s:
                raise ValueError(f"'stop'[{i}] must be a non-empty string, got {s!r}")
        self.stops: tuple[str, ...] = tuple(stops)
        self.include_stop = include_stop
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._held = ""
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        """True once a stop string completed."""
        return self.matched is not None

    def feed(self, text: str) -> tuple[str, bool]:
        """Add the next piece of text; return (text to emit now, whether a stop completed)."""
        if self.matched is not None:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        # The stream stops where the first stop string completes (smallest end), so the result
        # does not depend on how the text was cut into pieces; of stops completing at the same
        # character, the one starting first (the longest) wins.
        best: tuple[int, int] | None = None  # (end, start)
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best):
                best, self.matched = (i + len(s), i), s
        if best is not None:
            self._held = ""
            return buf[: best[0] if self.include_stop else best[1]], True
        hold = self._hold_length(buf)
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def _hold_length(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of some stop string."""
        for k in range(min(self._max_hold, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        """The held-back tail (the stream ended without completing it); "" after a stop."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held
