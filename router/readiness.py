"""Whether the router can serve a request now, and the 503 it answers while it cannot.

A request can be served once a healthy decode worker is registered: it decodes, and it prefills
the prompt itself when no prefill worker is up (the unified fallback of
:meth:`router.lifecycle.RequestLifecycle._unified`), so a prefill worker is not required. Workers
register only after their model has loaded (``router/cluster``), so "registered" means "ready".

Until then every serving endpoint (``/v1/models``, the OpenAI endpoints, gRPC ``Generate`` and
``ListModels``) answers 503 with ``Retry-After`` and ``/health`` answers 503: a script that
waits for ``/v1/models`` (a common readiness check) never sees 200 while a chat request would be
refused.
"""

from __future__ import annotations

from router.errors import NoWorkers
from router.pool import WorkerPool

# seconds a client is told to wait before retrying while the cluster starts (Retry-After)
STARTING_RETRY_AFTER_S = 5


def is_ready(pool: WorkerPool) -> bool:
    """True when a request placed now would find a healthy decode worker."""
    return bool(pool.workers("decode"))


def check_ready(pool: WorkerPool) -> None:
    """Raise :class:`NoWorkers` (503, ``Retry-After``) when :func:`is_ready` is False."""
    if not is_ready(pool):
        raise NoWorkers(
            "the server is not ready: no decode worker is up yet (workers are starting or "
            "restarting); retry after the Retry-After seconds",
            retry_after_s=STARTING_RETRY_AFTER_S,
        )
