"""The operators' routes: cluster status, request records, and the live dashboard page.

* ``GET /v1/cluster/status``: :meth:`router.status.ClusterMonitor.snapshot` (JSON).
* ``GET /v1/cluster/history``: the dashboard's chart series (:meth:`ClusterMonitor.history`).
* ``GET /v1/requests?limit=N``: the last N requests (1..200, default 20), newest first, summaries.
* ``GET /v1/requests/{id}``: one request's record by ``x-request-id`` or response id (404 when
  unknown or no longer kept).
* ``GET /dashboard``: the page; ``/dashboard/static/...``: its script, style and the vendored
  uPlot chart library (MIT, licence beside it). Nothing is loaded from another host.

With an API key, the ``/v1`` routes need ``Authorization: Bearer <key>`` like every other ``/v1``
route. The page and its static files are open (they hold no cluster data); the page asks for the
key once, keeps it in the browser tab's ``sessionStorage`` and sends it on every call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from router.errors import RequestNotFound
from router.status import ClusterMonitor

STATIC_DIR = Path(__file__).resolve().parent / "static"
MAX_LISTED = 200


def add_operator_routes(
    app: FastAPI,
    monitor: ClusterMonitor,
    require_key: Callable[[Request], Awaitable[None]],
) -> None:
    """Mount the status API, request records and dashboard on ``app`` (see module docstring)."""
    requests_log = monitor.router.requests
    api = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    @api.get("/cluster/status")
    async def cluster_status() -> dict[str, Any]:
        monitor.ensure_started()
        return monitor.snapshot()

    @api.get("/cluster/history")
    async def cluster_history() -> dict[str, Any]:
        monitor.ensure_started()
        return monitor.history()

    @api.get("/requests")
    async def list_requests(limit: int = Query(20, ge=1, le=MAX_LISTED)) -> dict[str, Any]:
        return {"object": "list", "data": [r.summary() for r in requests_log.recent(limit)]}

    @api.get("/requests/{record_id}")
    async def get_request(record_id: str) -> dict[str, Any]:
        rec = requests_log.get(record_id)
        if rec is None:
            raise RequestNotFound(
                f"no record of request '{record_id}': the router keeps the last "
                f"{requests_log.capacity} requests, by x-request-id or response id",
                param="id",
            )
        return rec.to_dict()

    app.include_router(api)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> FileResponse:
        monitor.ensure_started()
        return FileResponse(STATIC_DIR / "dashboard.html", headers={"Cache-Control": "no-cache"})

    app.mount("/dashboard/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")
