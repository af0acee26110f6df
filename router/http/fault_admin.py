"""``POST /admin/faults``: arm a worker's fault plan (pdserve/engine/faults.py) on a live cluster.

Mounted only when the server runs with ``--enable-fault-injection`` (otherwise the route does not
exist: 404), behind the API key like the other ``/admin`` routes. The body names the worker and
the plan, e.g. ``{"worker_id": "decode-0", "plan": {"kill_at": "decode_running"}}`` or
``{"worker_id": "prefill-0", "plan": {"stall_transfer_s": 5, "drop_aborts": 1}}``; an empty
plan disarms. The answer is the plan now in force on that worker. A plan holding a fault the
worker's role never fires (``kill_at`` a phase of the other role, a KV transfer fault on a
decode worker) is a 400 naming the phase or fault, the role and the role's phases.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from fastapi import APIRouter
from fastapi.params import Depends
from pydantic import BaseModel, ConfigDict

from pdserve.engine.faults import FaultPlan
from router.errors import BadRequest, RouterError


class FaultControl(Protocol):
    """What ``/admin/faults`` needs from the cluster (router/cluster)."""

    def worker_role(self, worker_id: str) -> str:
        """The role ('prefill' | 'decode') of ``worker_id``; KeyError for an unknown worker."""
        ...

    async def set_faults(self, worker_id: str, plan: dict[str, Any]) -> dict[str, Any]:
        """Arm ``plan`` on ``worker_id``; KeyError for an unknown worker."""
        ...


class FaultsRequest(BaseModel):
    """POST /admin/faults body."""

    model_config = ConfigDict(strict=True, extra="forbid")
    worker_id: str
    plan: dict[str, Any]


def fault_routes(control: FaultControl, dependencies: Sequence[Depends]) -> APIRouter:
    """The ``/admin/faults`` route over ``control``; ``dependencies`` run first (auth)."""
    admin = APIRouter(prefix="/admin", dependencies=list(dependencies))

    @admin.post("/faults")
    async def set_faults(body: FaultsRequest) -> dict[str, Any]:
        try:
            plan = FaultPlan.from_dict(body.plan)
        except (TypeError, ValueError) as e:
            raise BadRequest(f"'plan': {e}", param="plan") from None
        try:
            role = control.worker_role(body.worker_id)
            plan.check_role(role)  # a fault the worker never reaches would arm silently
            armed = await control.set_faults(body.worker_id, plan.to_dict())
        except KeyError:
            raise BadRequest(
                f"'worker_id': no worker {body.worker_id!r} (see GET /admin/workers)",
                param="worker_id",
            ) from None
        except ValueError as e:
            raise BadRequest(f"'plan' for {body.worker_id}: {e}", param="plan") from None
        except Exception as e:  # the worker refused or died: report it, never a bare 500
            err = RouterError(f"worker {body.worker_id} did not arm the plan: {e}")
            err.status = 503
            err.type = "service_unavailable"
            raise err from None
        return {"worker_id": body.worker_id, "plan": armed}

    return admin
