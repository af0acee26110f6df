"""Fire-and-forget tasks of the router (Aborts to workers), kept referenced until they finish.

A cancelled consumer never waits on an Abort; shutdown and tests wait for the stragglers with
:func:`drain_background`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)

# references, so the tasks are not garbage-collected mid-flight
_background: set[asyncio.Task[object]] = set()


def spawn(coro: Coroutine[Any, Any, object]) -> None:
    """Run ``coro`` in the background, keeping a reference until it finishes."""
    task: asyncio.Task[object] = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background_done)


def _background_done(task: asyncio.Task[object]) -> None:
    """Forget a finished background task; log (never leave unretrieved) its exception."""
    _background.discard(task)
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("background task failed: %r", exc)


async def drain_background(timeout_s: float = 5.0) -> None:
    """Wait for background aborts (tests and shutdown)."""
    if _background:
        await asyncio.wait(list(_background), timeout=timeout_s)
