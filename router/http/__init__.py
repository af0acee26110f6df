"""The OpenAI-compatible HTTP gateway (FastAPI), one module per noun.

``app`` (factory, routes, auth), ``handlers`` (chat and text completions), ``responses`` (OpenAI
bodies), ``streams`` (SSE, merging, disconnects), ``admin`` (/admin routes), ``errors`` (error
handlers), ``body_limit`` (ASGI body-size middleware). Prompts are prepared by
:mod:`router.prompts`, shared with the gRPC gateway. Semantics follow the OpenAI API reference.
"""

from __future__ import annotations

from router.http.admin import ClusterControl
from router.http.app import build_app

__all__ = ["ClusterControl", "build_app"]
