"""Startup output of `pdserve serve` / `pdserve router`: progress lines and the model-load bar.

Lines go to stdout, prefixed ``[pdserve]`` and flushed (startup happens before logging is
interesting); the bar of workers loaded goes to stderr, only when stderr is a terminal.
"""

from __future__ import annotations

import asyncio
import sys
import time


def say(line: str) -> None:
    """One progress line on stdout, flushed (startup happens before logging is interesting)."""
    print(f"[pdserve] {line}", flush=True)


class StartupProgress:
    """Startup display on stderr: a live tqdm bar of workers loaded, with elapsed time, when
    stderr is a terminal; otherwise (logs, CI) a "still starting" line every ``every_s`` seconds.

    ``line()`` prints a progress line without tearing the bar.
    """

    def __init__(self, num_workers: int, label: str, every_s: float = 10.0) -> None:
        from tqdm import tqdm

        self.label = label
        self.every_s = every_s
        self._t0 = time.monotonic()
        self._bar = tqdm(
            total=num_workers,
            desc=f"[pdserve] {label}",
            unit="worker",
            file=sys.stderr,
            disable=None,  # only on a terminal
            dynamic_ncols=True,
            bar_format="{desc}: {n_fmt}/{total_fmt} workers loaded |{bar}| {elapsed}",
        )
        self._task: asyncio.Task[None] | None = None

    @property
    def live(self) -> bool:
        """True when the bar is drawn (stderr is a terminal)."""
        return not self._bar.disable

    def line(self, text: str) -> None:
        if self.live:
            self._bar.write(f"[pdserve] {text}", file=sys.stdout)
        else:
            say(text)

    def worker_ready(self, _info: object = None) -> None:
        self._bar.update(1)

    def start(self) -> None:
        """Keep the elapsed time moving (or print the periodic line); needs a running loop."""
        self._task = asyncio.ensure_future(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0.5 if self.live else self.every_s)
            if self.live:
                self._bar.refresh()
            else:
                say(f"{self.label}... {time.monotonic() - self._t0:.0f} s")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._bar.close()
