"""Admin routes over the cluster: ``GET /admin/workers`` and ``POST /admin/scale``.

Present only when the router runs with a cluster controller (``pdserve serve``); they need the
API key like the ``/v1`` routes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from fastapi import APIRouter
from fastapi.params import Depends
from pydantic import BaseModel, ConfigDict

from router.errors import BadRequest, InsufficientResources, NoClusterControl


class ClusterControl(Protocol):
    """What ``/admin`` needs from the worker pool owner (router/cluster)."""

    def describe(self) -> list[dict[str, Any]]: ...

    async def scale(self, role: str, count: int) -> None: ...


class ScaleRequest(BaseModel):
    """POST /admin/scale body: run ``count`` workers of ``role`` ('prefill' | 'decode')."""

    model_config = ConfigDict(strict=True, extra="forbid")
    role: str
    count: int


def admin_routes(control: ClusterControl, dependencies: Sequence[Depends]) -> APIRouter:
    """The ``/admin`` router over ``control``; ``dependencies`` run first (authentication)."""
    admin = APIRouter(prefix="/admin", dependencies=list(dependencies))

    @admin.get("/workers")
    async def workers() -> dict[str, Any]:
        return {"workers": control.describe()}

    @admin.post("/scale")
    async def scale(body: ScaleRequest) -> dict[str, Any]:
        if body.role not in ("prefill", "decode"):
            raise BadRequest(
                f"'role' must be 'prefill' or 'decode', got {body.role!r}", param="role"
            )
        if body.count < (1 if body.role == "decode" else 0):
            raise BadRequest(
                f"'count' must be >= {1 if body.role == 'decode' else 0} for {body.role}",
                param="count",
            )
        try:
            await control.scale(body.role, body.count)
        except ValueError as e:
            raise BadRequest(str(e), param="count") from None
        except RuntimeError as e:  # a new worker failed to start (RouterErrors pass through)
            raise InsufficientResources(f"scaling {body.role} failed: {e}") from None
        return {"workers": control.describe()}

    return admin


def no_control_routes(dependencies: Sequence[Depends]) -> APIRouter:
    """``/admin/workers`` and ``/admin/scale`` on a router without the cluster controller (one
    started with ``pdserve router``): a 404 saying where they are served instead of a bare
    "Not Found"."""
    admin = APIRouter(prefix="/admin", dependencies=list(dependencies))

    @admin.api_route("/workers", methods=["GET"], include_in_schema=False)
    @admin.api_route("/scale", methods=["POST"], include_in_schema=False)
    async def elsewhere() -> None:
        raise NoClusterControl(
            "this router does not own the workers (it joined with `pdserve router`): "
            "/admin/workers and /admin/scale are served by the head router (`pdserve serve`)"
        )

    return admin
