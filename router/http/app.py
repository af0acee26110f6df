"""The FastAPI application: routes, authentication, the body-size limit and error handlers.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (and
``/v1/models/{id}``), vLLM's ``POST /tokenize`` and ``POST /detokenize`` (router/http/utility.py),
``GET /health`` (200 when a decode worker is up, else 503; until then the /v1 serving endpoints
answer 503 with ``Retry-After`` too, see :mod:`router.readiness`), ``GET /metrics`` (Prometheus text),
and, with a cluster controller, ``GET /admin/workers`` and ``POST /admin/scale``. With an API key,
every ``/v1`` and ``/admin`` route needs ``Authorization: Bearer <key>`` (401 otherwise);
``/health`` and ``/metrics`` stay open for probes and scrapers.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve import metrics
from pdserve.auth import bearer_credentials, secrets_match
from router.dashboard import add_operator_routes
from router.errors import Unauthorized
from router.http.admin import ClusterControl, admin_routes, no_control_routes
from router.http.body_limit import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from router.http.chat import chat_completion
from router.http.completions import text_completion
from router.http.errors import install_error_handlers
from router.http.fault_admin import FaultControl, fault_routes
from router.http.header_limit import MAX_HEADER_BYTES, HeaderSizeLimit
from router.http.openapi import install_openapi
from router.http.responses import Logprobs
from router.http.stream_limit import (
    DEFAULT_MAX_CONCURRENT_STREAMS,
    StreamLimiter,
    StreamSlotRelease,
)
from router.http.utility import add_utility_routes, model_card
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from router.readiness import STARTING_RETRY_AFTER_S, check_ready, is_ready
from router.request_id import RequestIdMiddleware
from router.serving import Router
from router.status import ClusterMonitor


def build_app(
    router: Router,
    api_key: str | None = None,
    control: ClusterControl | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    fault_control: FaultControl | None = None,
    max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> FastAPI:
    """The FastAPI application serving ``router``.

    ``api_key``: require ``Authorization: Bearer <api_key>`` on /v1 and /admin routes.
    ``control``: enables /admin/workers and /admin/scale. ``max_body_bytes``: larger request
    bodies get 413 (bytes). ``fault_control``: mounts ``POST /admin/faults``
    (``--enable-fault-injection``; router/http/fault_admin.py). ``max_concurrent_streams``: open
    SSE responses before a new streaming request gets 429 (router/http/stream_limit.py).
    ``max_header_bytes``: larger request heads (target + headers) get 431.
    """
    app = FastAPI(title="pdserve", description="OpenAI-compatible API of a pdserve cluster")
    streams = StreamLimiter(max_concurrent_streams)
    app.state.streams = streams
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes, stopping=router.stopping)
    app.add_middleware(StreamSlotRelease, limiter=streams)
    app.add_middleware(HeaderSizeLimit, max_bytes=max_header_bytes)
    app.add_middleware(RequestIdMiddleware)  # outermost: every response carries x-request-id
    logprobs = Logprobs(router.tokenizer)  # token texts cached across requests

    async def require_key(request: Request) -> None:
        if not api_key:
            return
        got = bearer_credentials(request.headers.get("authorization"))
        if not secrets_match(got, api_key):
            raise Unauthorized(
                "missing or incorrect API key: send 'Authorization: Bearer <key>' "
                "(the key given by --api-key / PDSERVE_API_KEY)"
            )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])
    add_utility_routes(app, v1, router, dependencies=[Depends(require_key)])

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        if body.stream:
            streams.reserve(request)
        return await chat_completion(router, logprobs, body, request)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if body.stream:
            streams.reserve(request)
        return await text_completion(router, logprobs, body, request)

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        check_ready(router.pool)  # 503 + Retry-After until a request can be served
        return {"object": "list", "data": [model_card(router)]}

    app.include_router(v1)
    # operators' view: /v1/cluster/status, /v1/requests/{id}, /dashboard
    app.state.monitor = ClusterMonitor(router, control)
    add_operator_routes(app, app.state.monitor, require_key)

    @app.get("/health")
    async def health() -> JSONResponse:
        decode = router.pool.workers("decode")
        prefill = router.pool.workers("prefill")
        ok = is_ready(router.pool) and router.accepting  # unready while shutting down
        return JSONResponse(
            {
                "status": "ok" if ok else "unavailable" if router.accepting else "shutting_down",
                "decode_workers": len(decode),
                "prefill_workers": len(prefill),
            },
            status_code=200 if ok else 503,
            headers=None if ok else {"Retry-After": str(STARTING_RETRY_AFTER_S)},
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.CONTENT_TYPE)

    if control is not None:
        app.include_router(admin_routes(control, [Depends(require_key)]))
    else:
        app.include_router(no_control_routes([Depends(require_key)]))
    if fault_control is not None:
        app.include_router(fault_routes(fault_control, [Depends(require_key)]))
    install_error_handlers(app)
    install_openapi(app)  # documents the error responses above (router/http/openapi.py)
    return app
